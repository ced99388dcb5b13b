/*-------------------------------------------------------------------------
 *
 * ledger.c
 *	  The in-transaction SQL API on both ledgers: claim, complete, fail,
 *	  lookup and purge.  Every function runs in the caller's transaction and
 *	  never commits or rolls back by itself.
 *
 *	  Claims never wait.  Before touching a key, a claim takes a
 *	  transaction-scoped lock on it with dontWait (an advisory lock tag of
 *	  our own, objsubid IDEM_LOCKTAG_FIELD4 in pg_locks, so it never meets
 *	  the application's advisory locks).  Every writer of a ledger row goes
 *	  through that lock, so the INSERT ... ON CONFLICT DO NOTHING that
 *	  follows never waits for another inserter of the same key.  When the
 *	  lock is held elsewhere the claim answers from the committed row:
 *	  a terminal result is replayed, anything else is busy.
 *
 *	  Queries run through SPI with plans prepared once per backend and
 *	  ledger.  Every name in them is schema-qualified (tables in the
 *	  extension's schema, operators and functions in pg_catalog), so the
 *	  caller's search_path can neither redirect them nor force a replan.
 *
 *-------------------------------------------------------------------------
 */
#include "idem.h"

#include "access/xact.h"
#include "catalog/pg_type.h"
#include "common/hashfn.h"
#include "executor/spi.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "storage/lock.h"
#include "utils/builtins.h"
#include "utils/datetime.h"
#include "utils/jsonb.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"

PG_FUNCTION_INFO_V1(idem_claim);
PG_FUNCTION_INFO_V1(idem_complete);
PG_FUNCTION_INFO_V1(idem_fail);
PG_FUNCTION_INFO_V1(idem_lookup);
PG_FUNCTION_INFO_V1(idem_platform_claim);
PG_FUNCTION_INFO_V1(idem_platform_complete);
PG_FUNCTION_INFO_V1(idem_platform_fail);
PG_FUNCTION_INFO_V1(idem_platform_lookup);
PG_FUNCTION_INFO_V1(idem_purge);

/* objsubid of our key locks in pg_locks; core advisory locks use 1 and 2. */
#define IDEM_LOCKTAG_FIELD4		0x1DE

/* When another transaction holds a key, suggest a retry within this. */
#define IDEM_BUSY_RETRY_MS		1000

typedef enum LedgerKind
{
	LEDGER_TENANT = 0,
	LEDGER_PLATFORM,
	LEDGER_KINDS
} LedgerKind;

typedef enum LedgerPlanId
{
	PLAN_INSERT = 0,			/* new key: INSERT ... ON CONFLICT DO NOTHING */
	PLAN_SELECT,				/* the row of a key */
	PLAN_RECLAIM,				/* failed_retryable or expired lease -> processing */
	PLAN_FINISH,				/* processing -> completed / failed_* */
	PLAN_PURGE,					/* delete one batch of expired rows */
	PLAN_COUNT
} LedgerPlanId;

/* Per backend and ledger: the table we prepared for, and its plans. */
typedef struct LedgerPlans
{
	Oid			relid;
	SPIPlanPtr	plans[PLAN_COUNT];
} LedgerPlans;

static LedgerPlans ledger_plans[LEDGER_KINDS];

static const char *const ledger_tables[LEDGER_KINDS] = {
	"idempotency_keys", "platform_idempotency_keys"
};

static const char *const ledger_unique[LEDGER_KINDS] = {
	"idempotency_keys_owner_key", "platform_idempotency_keys_key"
};

/*
 * Every plan takes the owner of the key as $1 (tenant_id, unused on the
 * platform ledger) and the key as $2, so callers bind them the same way.
 */
#define OWNER_TENANT "tenant_id OPERATOR(pg_catalog.=) $1 AND idempotency_key OPERATOR(pg_catalog.=) $2"
#define OWNER_PLATFORM "idempotency_key OPERATOR(pg_catalog.=) $2"

/* A ledger row as a claim or a finish sees it. */
typedef struct LedgerRow
{
	bool		found;
	char		status[24];
	bytea	   *fingerprint;
	int32		attempt;
	Datum		outcome;		/* jsonb, in the caller's memory context */
	TimestampTz expires_at;
	bool		ours;			/* written by this transaction */
} LedgerRow;

/* What a claim answers. */
typedef struct ClaimAnswer
{
	IdemDecision decision;
	int32		attempt;
	Datum		outcome;		/* jsonb or 0 */
	TimestampTz expires_at;
} ClaimAnswer;

/* Arguments common to all per-key functions. */
typedef struct KeyArgs
{
	LedgerKind	kind;
	int64		tenant_id;
	bytea	   *key;
	int			next;			/* index of the first argument after the key */
} KeyArgs;

/* ---------- arguments ---------- */

static bytea *
digest_arg(FunctionCallInfo fcinfo, int argno, const char *name)
{
	bytea	   *d;

	idem_require_arg(fcinfo, argno, name);
	d = PG_GETARG_BYTEA_PP(argno);
	if (VARSIZE_ANY_EXHDR(d) != IDEM_DIGEST_LEN)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must be %d bytes, not %d",
						name, IDEM_DIGEST_LEN, (int) VARSIZE_ANY_EXHDR(d)),
				 errhint("Derive keys with idem_key(scope, id) and fingerprints with idem_fingerprint(request).")));
	return d;
}

static void
key_args(FunctionCallInfo fcinfo, LedgerKind kind, KeyArgs *ka)
{
	int			a = 0;

	ka->kind = kind;
	ka->tenant_id = 0;
	if (kind == LEDGER_TENANT)
	{
		idem_require_arg(fcinfo, 0, "tenant_id");
		ka->tenant_id = PG_GETARG_INT64(0);
		a = 1;
	}
	ka->key = digest_arg(fcinfo, a, "key");
	ka->next = a + 1;
}

/*
 * now() + the interval argument, or + default_ms when it is NULL.  Zero and
 * negative intervals are refused: a lease or retention that has already
 * ended is a bug in the caller.
 */
static TimestampTz
deadline_arg(FunctionCallInfo fcinfo, int argno, const char *name,
			 int64 default_ms, TimestampTz now)
{
	Interval   *iv;
	int128		span;

	if (PG_ARGISNULL(argno))
		return now + default_ms * INT64CONST(1000);
	iv = PG_GETARG_INTERVAL_P(argno);
	span = (int128) iv->time + (int128) iv->day * USECS_PER_DAY +
		(int128) iv->month * DAYS_PER_MONTH * USECS_PER_DAY;
	if (span <= 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must be positive", name),
				 errdetail("Got %s.",
						   DatumGetCString(DirectFunctionCall1(interval_out,
															   IntervalPGetDatum(iv))))));
	return DatumGetTimestampTz(DirectFunctionCall2(timestamptz_pl_interval,
												   TimestampTzGetDatum(now),
												   IntervalPGetDatum(iv)));
}

/* A result or failure detail: a JSON object of at most 4096 bytes of text. */
static char *
outcome_arg(FunctionCallInfo fcinfo, int argno, const char *name, Jsonb **jb)
{
	char	   *text;
	size_t		len;

	idem_require_arg(fcinfo, argno, name);
	*jb = PG_GETARG_JSONB_P(argno);
	if (JB_ROOT_IS_SCALAR(*jb) || !JB_ROOT_IS_OBJECT(*jb))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must be a JSON object", name),
				 errdetail("Got a JSON %s.",
						   JB_ROOT_IS_SCALAR(*jb) ? "scalar" : "array")));
	text = JsonbToCString(NULL, &(*jb)->root, VARSIZE(*jb));
	len = strlen(text);
	if (len > IDEM_OUTCOME_MAX)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("%s is %zu bytes as JSON text, over the limit of %d bytes",
						name, len, IDEM_OUTCOME_MAX),
				 errhint("Store large results elsewhere and keep a reference in the outcome.")));
	return text;
}

/* ---------- the ledger table and its plans ---------- */

static SPIPlanPtr
prepare_plan(LedgerKind kind, LedgerPlanId id, const char *qtable)
{
	const char *owner = kind == LEDGER_TENANT ? OWNER_TENANT : OWNER_PLATFORM;
	char	   *sql;
	Oid			types[5] = {INT8OID, BYTEAOID, InvalidOid, InvalidOid, InvalidOid};
	int			nargs = 2;
	SPIPlanPtr	plan;

	switch (id)
	{
		case PLAN_INSERT:
			sql = psprintf("INSERT INTO %s (%sidempotency_key, request_fingerprint, expires_at)"
						   " VALUES (%s$2, $3, $4)"
						   " ON CONFLICT ON CONSTRAINT %s DO NOTHING RETURNING attempt",
						   qtable,
						   kind == LEDGER_TENANT ? "tenant_id, " : "",
						   kind == LEDGER_TENANT ? "$1, " : "",
						   ledger_unique[kind]);
			types[2] = BYTEAOID;
			types[3] = TIMESTAMPTZOID;
			nargs = 4;
			break;
		case PLAN_SELECT:
			sql = psprintf("SELECT status, request_fingerprint, attempt, outcome, expires_at, xmin"
						   " FROM %s WHERE %s", qtable, owner);
			break;
		case PLAN_RECLAIM:
			sql = psprintf("UPDATE %s SET status = 'processing',"
						   " attempt = attempt OPERATOR(pg_catalog.+) 1,"
						   " outcome = '{}'::pg_catalog.jsonb, expires_at = $3,"
						   " updated_at = pg_catalog.clock_timestamp()"
						   " WHERE %s AND attempt OPERATOR(pg_catalog.=) $4"
						   " AND status OPERATOR(pg_catalog.=) $5"
						   " RETURNING attempt", qtable, owner);
			types[2] = TIMESTAMPTZOID;
			types[3] = INT4OID;
			types[4] = TEXTOID;
			nargs = 5;
			break;
		case PLAN_FINISH:
			sql = psprintf("UPDATE %s SET status = $3, outcome = $4, expires_at = $5,"
						   " updated_at = pg_catalog.clock_timestamp()"
						   " WHERE %s AND status OPERATOR(pg_catalog.=) 'processing'"
						   " RETURNING attempt, request_fingerprint", qtable, owner);
			types[2] = TEXTOID;
			types[3] = JSONBOID;
			types[4] = TIMESTAMPTZOID;
			nargs = 5;
			break;
		case PLAN_PURGE:
			sql = psprintf("DELETE FROM %s WHERE id OPERATOR(pg_catalog.=) ANY (ARRAY("
						   "SELECT id FROM %s WHERE"
						   " (status OPERATOR(pg_catalog.<>) 'processing' AND expires_at OPERATOR(pg_catalog.<) $1)"
						   " OR (status OPERATOR(pg_catalog.=) 'processing' AND expires_at OPERATOR(pg_catalog.<) $2)"
						   " LIMIT $3 FOR UPDATE SKIP LOCKED))", qtable, qtable);
			types[0] = TIMESTAMPTZOID;
			types[1] = TIMESTAMPTZOID;
			types[2] = INT8OID;
			nargs = 3;
			break;
		default:
			elog(ERROR, "unknown ledger plan %d", (int) id);
	}

	plan = SPI_prepare(sql, nargs, types);
	if (plan == NULL)
		elog(ERROR, "could not prepare idem ledger query: %s",
			 SPI_result_code_string(SPI_result));
	SPI_keepplan(plan);
	pfree(sql);
	return plan;
}

/*
 * The namespace the extension's functions live in, remembered per call site
 * in fn_extra (one syscache lookup per FmgrInfo, not per call).  Not for
 * set-returning functions, whose fn_extra belongs to the SRF machinery.
 */
static Oid
extension_namespace(FunctionCallInfo fcinfo)
{
	if (fcinfo->flinfo->fn_retset)
		return get_func_namespace(fcinfo->flinfo->fn_oid);
	if (fcinfo->flinfo->fn_extra == NULL)
	{
		Oid		   *nsp = MemoryContextAlloc(fcinfo->flinfo->fn_mcxt, sizeof(Oid));

		*nsp = get_func_namespace(fcinfo->flinfo->fn_oid);
		fcinfo->flinfo->fn_extra = nsp;
	}
	return *(Oid *) fcinfo->flinfo->fn_extra;
}

/*
 * Find the ledger table (ERROR if idem_install has not run) and make sure
 * our cached plans are for it.  Must be called inside SPI_connect.
 */
static LedgerPlans *
ledger_open(FunctionCallInfo fcinfo, LedgerKind kind)
{
	Oid			nsp = extension_namespace(fcinfo);
	Oid			relid = get_relname_relid(ledger_tables[kind], nsp);
	LedgerPlans *lp = &ledger_plans[kind];

	if (!OidIsValid(relid))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idem is not installed in this database: table %s.%s does not exist",
						get_namespace_name(nsp), ledger_tables[kind]),
				 errhint("Run SELECT idem_install('tenants') once after CREATE EXTENSION idem.")));

	if (lp->relid != relid)
	{
		char	   *qtable = quote_qualified_identifier(get_namespace_name(nsp),
														ledger_tables[kind]);
		int			i;

		for (i = 0; i < PLAN_COUNT; i++)
		{
			if (lp->plans[i])
				SPI_freeplan(lp->plans[i]);
			lp->plans[i] = NULL;
		}
		lp->relid = InvalidOid;
		for (i = 0; i < PLAN_COUNT; i++)
			lp->plans[i] = prepare_plan(kind, (LedgerPlanId) i, qtable);
		lp->relid = relid;
	}
	return lp;
}

/* ---------- key locks ---------- */

static void
key_locktag(LOCKTAG *tag, const KeyArgs *ka)
{
	uint8		buf[1 + sizeof(int64) + IDEM_DIGEST_LEN];
	uint64		h;

	buf[0] = (uint8) ka->kind;
	memcpy(buf + 1, &ka->tenant_id, sizeof(int64));
	memcpy(buf + 1 + sizeof(int64), VARDATA_ANY(ka->key), IDEM_DIGEST_LEN);
	h = hash_bytes_extended(buf, sizeof(buf), 0);
	SET_LOCKTAG_ADVISORY(*tag, MyDatabaseId, (uint32) (h >> 32), (uint32) h,
						 IDEM_LOCKTAG_FIELD4);
}

/* ---------- row access (inside SPI) ---------- */

static int
run_plan(LedgerPlans *lp, LedgerPlanId id, const KeyArgs *ka, Datum *extra,
		 int nextra, long count)
{
	Datum		values[5];
	int			i;
	int			rc;

	values[0] = Int64GetDatum(ka->tenant_id);
	values[1] = PointerGetDatum(ka->key);
	for (i = 0; i < nextra; i++)
		values[2 + i] = extra[i];
	rc = SPI_execute_plan(lp->plans[id], values, NULL, false, count);
	if (rc < 0)
		elog(ERROR, "idem ledger query failed: %s", SPI_result_code_string(rc));
	return rc;
}

static Datum
spi_value(int row, int col, bool *isnull)
{
	return SPI_getbinval(SPI_tuptable->vals[row], SPI_tuptable->tupdesc, col,
						 isnull);
}

/* Read the committed (or our own) row of a key. */
static void
fetch_row(LedgerPlans *lp, const KeyArgs *ka, LedgerRow *row)
{
	bool		isnull;

	memset(row, 0, sizeof(*row));
	run_plan(lp, PLAN_SELECT, ka, NULL, 0, 1);
	if (SPI_processed == 0)
		return;
	row->found = true;
	text_to_cstring_buffer(DatumGetTextPP(spi_value(0, 1, &isnull)),
						   row->status, sizeof(row->status));
	row->fingerprint = DatumGetByteaPP(SPI_datumTransfer(spi_value(0, 2, &isnull),
														 false, -1));
	row->attempt = DatumGetInt32(spi_value(0, 3, &isnull));
	row->outcome = SPI_datumTransfer(spi_value(0, 4, &isnull), false, -1);
	row->expires_at = DatumGetTimestampTz(spi_value(0, 5, &isnull));
	row->ours = TransactionIdIsCurrentTransactionId(DatumGetTransactionId(spi_value(0, 6, &isnull)));
}

static bool
same_digest(const bytea *a, const bytea *b)
{
	return memcmp(VARDATA_ANY(a), VARDATA_ANY(b), IDEM_DIGEST_LEN) == 0;
}

static bool
status_is(const LedgerRow *row, const char *status)
{
	return strcmp(row->status, status) == 0;
}

/*
 * The answer a claim gives from a row it will not change: a replay, a
 * mismatch, or busy.  retry_at is when a busy caller should come back if the
 * row itself has no running lease to offer.
 */
static void
answer_from_row(const LedgerRow *row, const bytea *fingerprint,
				TimestampTz now, TimestampTz retry_at, ClaimAnswer *ans)
{
	ans->attempt = row->found ? row->attempt : 0;
	ans->outcome = (Datum) 0;
	ans->expires_at = retry_at;
	if (row->found && !same_digest(row->fingerprint, fingerprint))
		ans->decision = IDEM_DECISION_MISMATCH;
	else if (row->found && status_is(row, "completed"))
		ans->decision = IDEM_DECISION_COMPLETED;
	else if (row->found && status_is(row, "failed_permanent"))
		ans->decision = IDEM_DECISION_FAILED_PERMANENT;
	else
	{
		ans->decision = IDEM_DECISION_BUSY;
		if (row->found && status_is(row, "processing") && row->expires_at > now)
			ans->expires_at = row->expires_at;
		return;
	}
	if (ans->decision != IDEM_DECISION_MISMATCH)
	{
		ans->outcome = row->outcome;
		ans->expires_at = row->expires_at;
	}
}

/*
 * The claim itself, with the key lock already taken (or found held).
 * A row can vanish between our INSERT and SELECT only through idem_purge;
 * then the key is new again and we retry the INSERT, a bounded number of
 * times.
 */
static void
claim_locked(LedgerPlans *lp, const KeyArgs *ka, const bytea *fingerprint,
			 TimestampTz now, TimestampTz lease_end, ClaimAnswer *ans)
{
	int			tries;
	LedgerRow	row;
	bool		isnull;

	for (tries = 0; tries < 3; tries++)
	{
		Datum		extra[3];

		extra[0] = PointerGetDatum(fingerprint);
		extra[1] = TimestampTzGetDatum(lease_end);
		if (run_plan(lp, PLAN_INSERT, ka, extra, 2, 0) == SPI_OK_INSERT_RETURNING &&
			SPI_processed == 1)
		{
			ans->decision = IDEM_DECISION_CLAIMED;
			ans->attempt = DatumGetInt32(spi_value(0, 1, &isnull));
			ans->outcome = (Datum) 0;
			ans->expires_at = lease_end;
			return;
		}

		fetch_row(lp, ka, &row);
		if (!row.found)
			continue;

		/* A claim by this very transaction is still running: busy. */
		if (row.ours && status_is(&row, "processing"))
		{
			answer_from_row(&row, fingerprint, now, row.expires_at, ans);
			ans->decision = same_digest(row.fingerprint, fingerprint) ?
				IDEM_DECISION_BUSY : IDEM_DECISION_MISMATCH;
			return;
		}

		/* failed_retryable, or a committed lease that has run out: take it. */
		if (same_digest(row.fingerprint, fingerprint) &&
			(status_is(&row, "failed_retryable") ||
			 (status_is(&row, "processing") && row.expires_at <= now)))
		{
			extra[0] = TimestampTzGetDatum(lease_end);
			extra[1] = Int32GetDatum(row.attempt);
			extra[2] = CStringGetTextDatum(row.status);
			if (run_plan(lp, PLAN_RECLAIM, ka, extra, 3, 0) == SPI_OK_UPDATE_RETURNING &&
				SPI_processed == 1)
			{
				ans->decision = IDEM_DECISION_CLAIMED;
				ans->attempt = DatumGetInt32(spi_value(0, 1, &isnull));
				ans->outcome = (Datum) 0;
				ans->expires_at = lease_end;
				return;
			}
			continue;
		}

		answer_from_row(&row, fingerprint, now, row.expires_at, ans);
		return;
	}

	/* The key kept vanishing under us (a purge racing): let the caller retry. */
	ans->decision = IDEM_DECISION_BUSY;
	ans->attempt = 0;
	ans->outcome = (Datum) 0;
	ans->expires_at = now + IDEM_BUSY_RETRY_MS * INT64CONST(1000);
}

static Datum
ledger_claim(FunctionCallInfo fcinfo, LedgerKind kind)
{
	KeyArgs		ka;
	bytea	   *fingerprint;
	TimestampTz now = GetCurrentTimestamp();
	TimestampTz lease_end;
	LOCKTAG		tag;
	LockAcquireResult lockres;
	LedgerPlans *lp;
	ClaimAnswer ans;
	TupleDesc	tupdesc;
	Datum		values[4];
	bool		nulls[4] = {false, false, false, false};

	key_args(fcinfo, kind, &ka);
	fingerprint = digest_arg(fcinfo, ka.next, "fingerprint");
	lease_end = deadline_arg(fcinfo, ka.next + 1, "lease", idem_lease_ms, now);
	if (get_call_result_type(fcinfo, NULL, &tupdesc) != TYPEFUNC_COMPOSITE)
		elog(ERROR, "idem_claim must return a composite type");

	SPI_connect();
	lp = ledger_open(fcinfo, kind);

	key_locktag(&tag, &ka);
	lockres = LockAcquire(&tag, ExclusiveLock, false, true);
	if (lockres == LOCKACQUIRE_NOT_AVAIL)
	{
		LedgerRow	row;
		TimestampTz retry_at = Min(lease_end,
								   now + IDEM_BUSY_RETRY_MS * INT64CONST(1000));

		/* Another transaction is on this key: answer without waiting. */
		fetch_row(lp, &ka, &row);
		answer_from_row(&row, fingerprint, now, retry_at, &ans);
	}
	else
	{
		claim_locked(lp, &ka, fingerprint, now, lease_end, &ans);
		/* Nothing written: let the next claimer in at once. */
		if (ans.decision != IDEM_DECISION_CLAIMED && lockres == LOCKACQUIRE_OK)
			LockRelease(&tag, ExclusiveLock, false);
	}
	SPI_finish();

	idem_stats_count_claim(ans.decision);

	values[0] = CStringGetTextDatum(idem_decision_names[ans.decision]);
	values[1] = Int32GetDatum(ans.attempt);
	nulls[1] = ans.attempt == 0;
	values[2] = ans.outcome;
	nulls[2] = ans.outcome == (Datum) 0;
	values[3] = TimestampTzGetDatum(ans.expires_at);
	tupdesc = BlessTupleDesc(tupdesc);
	PG_RETURN_DATUM(HeapTupleGetDatum(heap_form_tuple(tupdesc, values, nulls)));
}

/*
 * complete / fail: move a processing row that this transaction claimed (or
 * a committed processing row, in lease mode) to its final status, and queue
 * the terminal result for the Valkey copy made after commit.
 */
static void
ledger_finish(FunctionCallInfo fcinfo, LedgerKind kind, const char *what,
			  bool is_fail)
{
	KeyArgs		ka;
	TimestampTz now = GetCurrentTimestamp();
	TimestampTz retention_end;
	Jsonb	   *outcome;
	char	   *outcome_text;
	const char *status = "completed";
	LOCKTAG		tag;
	LedgerPlans *lp;
	Datum		extra[3];
	bool		isnull;
	int32		attempt;
	bytea	   *fingerprint;

	key_args(fcinfo, kind, &ka);
	outcome_text = outcome_arg(fcinfo, ka.next, is_fail ? "detail" : "outcome",
							   &outcome);
	if (is_fail)
	{
		idem_require_arg(fcinfo, ka.next + 1, "retryable");
		status = PG_GETARG_BOOL(ka.next + 1) ? "failed_retryable" : "failed_permanent";
	}
	retention_end = deadline_arg(fcinfo, ka.next + (is_fail ? 2 : 1), "retention",
								 (int64) idem_retention_s * 1000, now);

	SPI_connect();
	lp = ledger_open(fcinfo, kind);

	key_locktag(&tag, &ka);
	if (LockAcquire(&tag, ExclusiveLock, false, true) == LOCKACQUIRE_NOT_AVAIL)
		ereport(ERROR,
				(errcode(ERRCODE_LOCK_NOT_AVAILABLE),
				 errmsg("cannot %s idempotency key: another transaction holds it", what),
				 errhint("Only the transaction that claimed a key, or a later one after it committed, can %s it.",
						 what)));

	extra[0] = CStringGetTextDatum(status);
	extra[1] = JsonbPGetDatum(outcome);
	extra[2] = TimestampTzGetDatum(retention_end);
	if (run_plan(lp, PLAN_FINISH, &ka, extra, 3, 0) != SPI_OK_UPDATE_RETURNING ||
		SPI_processed != 1)
	{
		LedgerRow	row;

		fetch_row(lp, &ka, &row);
		if (!row.found)
			ereport(ERROR,
					(errcode(ERRCODE_NO_DATA_FOUND),
					 errmsg("cannot %s idempotency key: it has not been claimed", what),
					 errhint("Call idem_claim() for the key first, in this transaction.")));
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("cannot %s idempotency key: its status is already %s",
						what, row.status),
				 status_is(&row, "failed_retryable") ?
				 errhint("Claim the key again before completing or failing it.") : 0));
	}
	attempt = DatumGetInt32(spi_value(0, 1, &isnull));
	fingerprint = DatumGetByteaPP(spi_value(0, 2, &isnull));

	if (strcmp(status, "failed_retryable") != 0)
		idem_outbox_add(kind == LEDGER_PLATFORM, ka.tenant_id,
						(const uint8 *) VARDATA_ANY(ka.key),
						is_fail ? IDEM_CACHE_FAILED_PERMANENT : IDEM_CACHE_COMPLETED,
						attempt, (const uint8 *) VARDATA_ANY(fingerprint),
						outcome_text, (int) strlen(outcome_text), retention_end);
	SPI_finish();
}

/* idem_lookup / idem_platform_lookup: zero or one row, read-only. */
static Datum
ledger_lookup(FunctionCallInfo fcinfo, LedgerKind kind)
{
	FuncCallContext *funcctx;

	if (SRF_IS_FIRSTCALL())
	{
		KeyArgs		ka;
		LedgerPlans *lp;
		LedgerRow	row;
		MemoryContext oldcxt;
		TupleDesc	tupdesc;

		funcctx = SRF_FIRSTCALL_INIT();
		oldcxt = MemoryContextSwitchTo(funcctx->multi_call_memory_ctx);
		key_args(fcinfo, kind, &ka);
		if (get_call_result_type(fcinfo, NULL, &tupdesc) != TYPEFUNC_COMPOSITE)
			elog(ERROR, "idem_lookup must return a composite type");
		SPI_connect();
		lp = ledger_open(fcinfo, kind);
		fetch_row(lp, &ka, &row);
		SPI_finish();
		if (row.found)
		{
			Datum		values[5];
			bool		nulls[5] = {false, false, false, false, false};

			values[0] = CStringGetTextDatum(row.status);
			values[1] = Int32GetDatum(row.attempt);
			values[2] = row.outcome;
			values[3] = PointerGetDatum(row.fingerprint);
			values[4] = TimestampTzGetDatum(row.expires_at);
			funcctx->user_fctx = heap_form_tuple(BlessTupleDesc(tupdesc),
												 values, nulls);
			funcctx->max_calls = 1;
		}
		MemoryContextSwitchTo(oldcxt);
	}
	funcctx = SRF_PERCALL_SETUP();
	if (funcctx->call_cntr < funcctx->max_calls)
		SRF_RETURN_NEXT(funcctx, HeapTupleGetDatum((HeapTuple) funcctx->user_fctx));
	SRF_RETURN_DONE(funcctx);
}

Datum
idem_claim(PG_FUNCTION_ARGS)
{
	return ledger_claim(fcinfo, LEDGER_TENANT);
}

Datum
idem_platform_claim(PG_FUNCTION_ARGS)
{
	return ledger_claim(fcinfo, LEDGER_PLATFORM);
}

Datum
idem_complete(PG_FUNCTION_ARGS)
{
	ledger_finish(fcinfo, LEDGER_TENANT, "complete", false);
	PG_RETURN_VOID();
}

Datum
idem_platform_complete(PG_FUNCTION_ARGS)
{
	ledger_finish(fcinfo, LEDGER_PLATFORM, "complete", false);
	PG_RETURN_VOID();
}

Datum
idem_fail(PG_FUNCTION_ARGS)
{
	ledger_finish(fcinfo, LEDGER_TENANT, "fail", true);
	PG_RETURN_VOID();
}

Datum
idem_platform_fail(PG_FUNCTION_ARGS)
{
	ledger_finish(fcinfo, LEDGER_PLATFORM, "fail", true);
	PG_RETURN_VOID();
}

Datum
idem_lookup(PG_FUNCTION_ARGS)
{
	return ledger_lookup(fcinfo, LEDGER_TENANT);
}

Datum
idem_platform_lookup(PG_FUNCTION_ARGS)
{
	return ledger_lookup(fcinfo, LEDGER_PLATFORM);
}

/*
 * idem_purge(batch_size integer DEFAULT 10000) RETURNS bigint
 *
 * Deletes up to batch_size expired rows from each ledger: terminal rows past
 * their retention, and processing rows whose lease ended more than
 * idem.purge_grace ago.  Rows locked by a running claim or completion are
 * skipped (SKIP LOCKED), so the purge never waits for them.  Call it again
 * until it returns 0; each call is one short batch.
 */
Datum
idem_purge(PG_FUNCTION_ARGS)
{
	int32		batch;
	TimestampTz now = GetCurrentTimestamp();
	int64		deleted = 0;
	int			kind;

	idem_require_arg(fcinfo, 0, "batch_size");
	batch = PG_GETARG_INT32(0);
	if (batch <= 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("batch_size must be positive, not %d", batch)));

	SPI_connect();
	for (kind = 0; kind < LEDGER_KINDS; kind++)
	{
		LedgerPlans *lp = ledger_open(fcinfo, (LedgerKind) kind);
		Datum		values[3];

		values[0] = TimestampTzGetDatum(now);
		values[1] = TimestampTzGetDatum(now - (int64) idem_purge_grace_s * USECS_PER_SEC);
		values[2] = Int64GetDatum(batch);
		if (SPI_execute_plan(lp->plans[PLAN_PURGE], values, NULL, false, 0) != SPI_OK_DELETE)
			elog(ERROR, "idem purge failed");
		deleted += SPI_processed;
	}
	SPI_finish();
	PG_RETURN_INT64(deleted);
}
