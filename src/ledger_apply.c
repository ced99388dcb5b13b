/*-------------------------------------------------------------------------
 *
 * ledger_apply.c
 *	  idem_apply / idem_platform_apply: claim a key, run the caller's SQL
 *	  function as the effect and complete (or fail) the key, in one
 *	  statement, so that an applied run costs one round trip.
 *
 *		idem_apply(tenant_id, key, fingerprint, handler regprocedure,
 *				   args jsonb, retention interval)
 *		idem_platform_apply(key, fingerprint, handler, args, retention)
 *
 *	  The claim and the settlement are exactly those of idem_claim and
 *	  idem_complete / idem_fail (ledger_claim_key, ledger_settle_key in
 *	  ledger.c).  A key that is not claimed (completed, failed_permanent,
 *	  busy, mismatch) is answered as idem_claim answers it, and the handler
 *	  does not run.
 *
 *	  The handler: a function (not a procedure, aggregate or window
 *	  function) taking one jsonb and returning one jsonb, the outcome (a
 *	  JSON object; NULL means {}).  It runs as the caller: USAGE on its
 *	  schema and EXECUTE on it are checked, as a direct call would, and a
 *	  SECURITY DEFINER handler (or one with SET clauses) runs as fmgr runs
 *	  any such function.  It runs in a subtransaction:
 *	  an error it raises rolls its writes back and is recorded, with its
 *	  SQLSTATE and message as the detail, as failed_permanent (SQLSTATE
 *	  P0001, RAISE's default, and classes 22 and 23: the request cannot
 *	  succeed) or failed_retryable (any other, statement_timeout's cancel
 *	  and lock_timeout's 55P03 included).  An outcome that is not a JSON
 *	  object of at most 4096 bytes fails the handler in the same way (22023:
 *	  permanent; 54000: retryable), so every run of a handler is an attempt
 *	  that idem.max_attempts counts.  Errors of classes 40, 53, 57 (but a
 *	  cancel other than an operator's), 58 and XX are the server's state,
 *	  not the handler's answer: they are re-raised and nothing is recorded
 *	  (the statement fails).
 *
 *	  idem_attempt() answers, inside the handler, the attempt it runs as
 *	  (1 for the first, 2 after one retryable failure, ...), and NULL
 *	  outside any handler: backend-local state, saved and restored around
 *	  each handler so that a handler that calls idem_apply itself sees its
 *	  own attempt again afterwards.
 *
 *	  Locking: as idem_claim; the key lock of a claimed key is held until
 *	  the transaction ends.  Called outside a transaction block, the
 *	  statement's own transaction commits the effect and the key together.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/htup_details.h"
#include "access/xact.h"
#include "catalog/objectaccess.h"
#include "catalog/pg_proc.h"
#include "catalog/pg_type.h"
#include "funcapi.h"
#include "mb/pg_wchar.h"
#include "miscadmin.h"
#include "tcop/utility.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/json.h"
#include "utils/jsonb.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/regproc.h"
#include "utils/resowner.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"

#include "cache_format.h"
#include "compat.h"
#include "decision.h"
#include "guc.h"
#include "digest.h"
#include "ledger.h"
#include "ledger_row.h"
#include "ledger_store.h"
#include "sql_args.h"

PG_FUNCTION_INFO_V1(idem_apply);
PG_FUNCTION_INFO_V1(idem_platform_apply);
PG_FUNCTION_INFO_V1(idem_attempt);

/* The attempt of the handler running now (idem_attempt()); 0: none. */
static int32 apply_attempt = 0;

/*
 * Longest error message kept in a failure detail: bytes of its JSON-escaped
 * text, so that the detail always fits the outcome's IDEM_OUTCOME_MAX (a
 * control character takes six bytes escaped, \u0001).
 */
#define APPLY_MESSAGE_MAX	1024

/*
 * The handler must be a plain function (jsonb) -> jsonb that the caller
 * may execute.
 */
static void
apply_check_handler(Oid fn)
{
	HeapTuple	tup;
	Form_pg_proc proc;
	Oid			nsp;
	AclResult	acl;

	tup = SearchSysCache1(PROCOID, ObjectIdGetDatum(fn));
	if (!HeapTupleIsValid(tup))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_FUNCTION),
				 errmsg("handler function with OID %u does not exist", fn)));
	proc = (Form_pg_proc) GETSTRUCT(tup);
	if (proc->prokind != PROKIND_FUNCTION)
		ereport(ERROR,
				(errcode(ERRCODE_WRONG_OBJECT_TYPE),
				 errmsg("handler %s is not a plain function",
						format_procedure(fn)),
				 errdetail("Procedures, aggregates and window functions cannot be handlers.")));
	if (proc->pronargs != 1 || proc->proargtypes.values[0] != JSONBOID ||
		proc->prorettype != JSONBOID || proc->proretset)
		ereport(ERROR,
				(errcode(ERRCODE_DATATYPE_MISMATCH),
				 errmsg("handler %s must take one jsonb argument and return one jsonb",
						format_procedure(fn)),
				 errdetail("It returns %s%s.", proc->proretset ? "SETOF " : "",
						   format_type_be(proc->prorettype)),
				 errhint("Declare it as FUNCTION name(args jsonb) RETURNS jsonb; it returns the outcome, a JSON object.")));
	nsp = proc->pronamespace;
	ReleaseSysCache(tup);

	/*
	 * What a direct call needs: USAGE on the function's schema (checked
	 * when its name is looked up) and EXECUTE on it.  Given by OID, the
	 * name is never looked up, so the schema is checked here.
	 */
	acl = idem_namespace_aclcheck(nsp, GetUserId(), ACL_USAGE);
	if (acl != ACLCHECK_OK)
		aclcheck_error(acl, OBJECT_SCHEMA, get_namespace_name(nsp));
	acl = idem_proc_aclcheck(fn, GetUserId(), ACL_EXECUTE);
	if (acl != ACLCHECK_OK)
		aclcheck_error(acl, OBJECT_FUNCTION, get_func_name(fn));
	InvokeFunctionExecuteHook(fn);
}

/*
 * An operator's cancel (pg_cancel_backend, a client's cancel request):
 * PostgreSQL raises it with the same SQLSTATE as statement_timeout's
 * (57014) and tells the two apart only by the message.  Its id, the
 * untranslated format string, is compared: whatever lc_messages says.
 * The runners, which see only the translated text, compare that with the
 * same English text (idemc_error_is_servers, server_state_error).
 */
#define APPLY_OPERATOR_CANCEL "canceling statement due to user request"

/*
 * Not the handler's answer: the server's state.  Re-raised, nothing kept.
 * A cancel (57014) that stopped the handler is its attempt, recorded (a
 * handler that overruns statement_timeout on every run must still use up
 * idem.max_attempts), unless an operator asked for it: then, as a
 * shutdown's 57P01, it says nothing of the handler.
 */
static bool
apply_error_is_servers(ErrorData *edata)
{
	char	   *state = unpack_sql_state(edata->sqlerrcode);

	if (edata->sqlerrcode == ERRCODE_QUERY_CANCELED)
		return edata->message_id != NULL &&
			strcmp(edata->message_id, APPLY_OPERATOR_CANCEL) == 0;
	return strncmp(state, "40", 2) == 0 || strncmp(state, "53", 2) == 0 ||
		strncmp(state, "57", 2) == 0 || strncmp(state, "58", 2) == 0 ||
		strncmp(state, "XX", 2) == 0;
}

/* RAISE's default and data/constraint errors: the request cannot succeed. */
static bool
apply_error_is_permanent(int sqlerrcode)
{
	char	   *state = unpack_sql_state(sqlerrcode);

	return strcmp(state, "P0001") == 0 || strncmp(state, "22", 2) == 0 ||
		strncmp(state, "23", 2) == 0;
}

/*
 * msg as a JSON string, clipped to APPLY_MESSAGE_MAX bytes of escaped text
 * between characters: never inside a multibyte character or an escape.
 * Clipping before escaping would not do: a message quoting a request full
 * of control characters grows sixfold, over the outcome's limit, and then
 * nothing could be recorded and every redelivery would run the handler
 * again.
 */
static void
apply_append_message(StringInfo buf, const char *msg)
{
	StringInfoData one;
	const char *p = msg;
	int			used = 0;

	initStringInfo(&one);
	appendStringInfoChar(buf, '"');
	while (*p != '\0')
	{
		char		chr[MAX_MULTIBYTE_CHAR_LEN + 1];
		int			clen = Min(pg_mblen(p), (int) strnlen(p, MAX_MULTIBYTE_CHAR_LEN));

		memcpy(chr, p, clen);
		chr[clen] = '\0';
		resetStringInfo(&one);
		escape_json(&one, chr);
		/* one.data is the character escaped, between its two quotes */
		if (used + one.len - 2 > APPLY_MESSAGE_MAX)
			break;
		appendBinaryStringInfo(buf, one.data + 1, one.len - 2);
		used += one.len - 2;
		p += clen;
	}
	appendStringInfoChar(buf, '"');
	pfree(one.data);
}

/* {"sqlstate": ..., "message": ...} of an error the handler raised. */
static Jsonb *
apply_error_detail(ErrorData *edata)
{
	StringInfoData buf;

	initStringInfo(&buf);
	appendStringInfoString(&buf, "{\"sqlstate\": ");
	escape_json(&buf, unpack_sql_state(edata->sqlerrcode));
	appendStringInfoString(&buf, ", \"message\": ");
	apply_append_message(&buf, edata->message ? edata->message : "");
	appendStringInfoChar(&buf, '}');
	return DatumGetJsonbP(DirectFunctionCall1(jsonb_in, CStringGetDatum(buf.data)));
}

/*
 * Run the handler in a subtransaction.  Returns its result (NULL: {}) with
 * *failed false, or the detail of the error it raised with *failed true and
 * *permanent set.  Errors of the server's state are re-raised.
 */
static Jsonb *
apply_run_handler(Oid fn, Datum args, Oid collation, int32 attempt,
				  bool *failed, bool *permanent)
{
	MemoryContext oldcontext = CurrentMemoryContext;
	ResourceOwner oldowner = CurrentResourceOwner;
	int32		outer_attempt = apply_attempt;
	FmgrInfo	flinfo;
	Jsonb	   *volatile result = NULL;
	ErrorData  *volatile edata = NULL;

	fmgr_info(fn, &flinfo);
	*failed = false;
	*permanent = false;

	BeginInternalSubTransaction(NULL);
	MemoryContextSwitchTo(oldcontext);
	PG_TRY();
	{
		LOCAL_FCINFO(fc, 1);
		Datum		d;

		InitFunctionCallInfoData(*fc, &flinfo, 1, collation, NULL, NULL);
		fc->args[0].value = args;
		fc->args[0].isnull = false;
		apply_attempt = attempt;
		d = FunctionCallInvoke(fc);
		apply_attempt = outer_attempt;
		if (!fc->isnull)
		{
			/* in our context: the subtransaction's memory goes with it */
			MemoryContextSwitchTo(oldcontext);
			result = DatumGetJsonbPCopy(d);

			/*
			 * An outcome that cannot be stored is the handler's failure, in
			 * its subtransaction: its writes roll back and the attempt is
			 * recorded, as for an error it raised (else every redelivery
			 * would run it again, never counted by idem.max_attempts).
			 */
			(void) ledger_check_outcome(result, "handler outcome");
		}
		ReleaseCurrentSubTransaction();
		MemoryContextSwitchTo(oldcontext);
		CurrentResourceOwner = oldowner;
	}
	PG_CATCH();
	{
		apply_attempt = outer_attempt;
		MemoryContextSwitchTo(oldcontext);
		edata = CopyErrorData();
		FlushErrorState();
		RollbackAndReleaseCurrentSubTransaction();
		MemoryContextSwitchTo(oldcontext);
		CurrentResourceOwner = oldowner;
	}
	PG_END_TRY();

	if (edata != NULL)
	{
		if (apply_error_is_servers(edata))
			ReThrowError(edata);
		*failed = true;
		*permanent = apply_error_is_permanent(edata->sqlerrcode);
		result = apply_error_detail(edata);
		FreeErrorData(edata);
		return result;
	}
	if (result == NULL)
		result = DatumGetJsonbP(DirectFunctionCall1(jsonb_in, CStringGetDatum("{}")));
	return result;
}

/*
 * (decision, attempt, outcome, expires_at, ran): decision is the claim's
 * (completed, failed_permanent, busy, mismatch) when the handler did not
 * run (ran false), else applied, failed_retryable or failed_permanent.
 */
static Datum
ledger_apply(FunctionCallInfo fcinfo, LedgerKind kind)
{
	const char *func = kind == LEDGER_TENANT ? "idem_apply()" : "idem_platform_apply()";
	LedgerKey	lk;
	uint8		fingerprint[IDEM_DIGEST_LEN];
	Oid			fn;
	Datum		args;
	TimestampTz now = GetCurrentTimestamp();
	TimestampTz retention_end;
	LedgerStore *store;
	ClaimAnswer ans;
	TupleDesc	tupdesc;
	Datum		values[5];
	bool		nulls[5];
	int			a = 0;

	PreventCommandIfReadOnly(func);
	memset(&lk, 0, sizeof(lk));
	lk.kind = kind;
	if (kind == LEDGER_TENANT)
	{
		idem_require_arg(fcinfo, a, "tenant_id");
		lk.tenant_id = PG_GETARG_INT64(a);
		a++;
	}
	idem_require_arg(fcinfo, a, "key");
	idem_digest_check(PG_GETARG_BYTEA_PP(a), "key", lk.key);
	a++;
	idem_require_arg(fcinfo, a, "fingerprint");
	idem_digest_check(PG_GETARG_BYTEA_PP(a), "fingerprint", fingerprint);
	a++;
	idem_require_arg(fcinfo, a, "handler");
	fn = PG_GETARG_OID(a);
	a++;
	idem_require_arg(fcinfo, a, "args");
	args = PG_GETARG_DATUM(a);
	a++;
	retention_end = ledger_retention_end(PG_ARGISNULL(a) ? NULL :
										 PG_GETARG_INTERVAL_P(a), now);

	/* everything the caller gave is checked before the key is touched */
	apply_check_handler(fn);
	if (get_call_result_type(fcinfo, NULL, &tupdesc) != TYPEFUNC_COMPOSITE)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("function returning record called in context that cannot accept type record")));
	tupdesc = BlessTupleDesc(tupdesc);

	store = ledger_store_open_key(get_func_namespace(fcinfo->flinfo->fn_oid), &lk);
	/* settled in this statement, never left open: no lease mode */
	ledger_claim_key(store, &lk, fingerprint, now,
					 ledger_deadline(NULL, "lease", idem_lease_ms, now), true,
					 idem_max_attempts, &ans);
	if (ans.decision != IDEM_DECISION_CLAIMED)
	{
		ledger_answer_values(&ans, values, nulls);
		values[4] = BoolGetDatum(false);
	}
	else
	{
		bool		failed;
		bool		permanent;
		Jsonb	   *outcome;
		char	   *text;
		IdemStatus	status;

		outcome = apply_run_handler(fn, args, PG_GET_COLLATION(), ans.attempt,
									&failed, &permanent);
		/* The handler may have dropped or altered the ledger: check again. */
		store = ledger_store_open_key(get_func_namespace(fcinfo->flinfo->fn_oid), &lk);
		/* checked in the handler's subtransaction; the detail always fits */
		text = ledger_check_outcome(outcome, failed ? "failure detail" : "handler outcome");
		status = !failed ? IDEM_STATUS_COMPLETED :
			permanent ? IDEM_STATUS_FAILED_PERMANENT : IDEM_STATUS_FAILED_RETRYABLE;
		ledger_settle_key(store, &lk, failed ? "fail" : "complete", status,
						  outcome, text, retention_end, 0, 0);
		values[0] = CStringGetTextDatum(!failed ? "applied" :
										idem_status_names[status]);
		nulls[0] = false;
		values[1] = Int32GetDatum(ans.attempt);
		nulls[1] = false;
		values[2] = JsonbPGetDatum(outcome);
		nulls[2] = false;
		values[3] = TimestampTzGetDatum(retention_end);
		nulls[3] = false;
		values[4] = BoolGetDatum(true);
	}
	nulls[4] = false;
	PG_RETURN_DATUM(HeapTupleGetDatum(heap_form_tuple(tupdesc, values, nulls)));
}

Datum
idem_apply(PG_FUNCTION_ARGS)
{
	return ledger_apply(fcinfo, LEDGER_TENANT);
}

Datum
idem_platform_apply(PG_FUNCTION_ARGS)
{
	return ledger_apply(fcinfo, LEDGER_PLATFORM);
}

/*
 * idem_attempt(): inside an idem_apply handler, the attempt it runs as;
 * NULL elsewhere.
 */
Datum
idem_attempt(PG_FUNCTION_ARGS)
{
	if (apply_attempt <= 0)
		PG_RETURN_NULL();
	PG_RETURN_INT32(apply_attempt);
}
