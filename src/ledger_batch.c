/*-------------------------------------------------------------------------
 *
 * ledger_batch.c
 *	  The batch API: claim or complete many keys in one statement, for
 *	  consumers that receive messages in batches (Streams COUNT n, SQS
 *	  batches).  One round trip claims a whole batch; its effects and one
 *	  idem_complete_many then commit together.
 *
 *		idem_claim_many(tenant_ids, keys, fingerprints, lease)
 *		idem_platform_claim_many(keys, fingerprints, lease)
 *		idem_complete_many(tenant_ids, keys, outcomes, retention)
 *		idem_platform_complete_many(keys, outcomes, retention)
 *		idem_fail_many(tenant_ids, keys, details, retryable, retention)
 *		idem_platform_fail_many(keys, details, retryable, retention)
 *
 *	  Each element goes through exactly the code of idem_claim /
 *	  idem_complete / idem_fail (ledger_claim_key, ledger_settle_key in
 *	  ledger.c), in
 *	  array order, so every decision and every error is the single-key
 *	  one.  An error in any element raises for the whole call, naming the
 *	  element (the transaction, or the caller's savepoint, rolls back).
 *
 *	  Locking: a claimed key holds its key lock (one entry in the shared
 *	  lock table) until the transaction ends, like idem_claim; keys not
 *	  claimed release theirs at once.  The lock table is sized for
 *	  max_locks_per_transaction locks per backend on average, so one call
 *	  takes at most that many keys (54000 otherwise).  Claims never wait,
 *	  so batches cannot deadlock on keys.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_type.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "storage/lock.h"
#include "tcop/utility.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/jsonb.h"
#include "utils/lsyscache.h"
#include "utils/tuplestore.h"

#include "cache_format.h"
#include "compat.h"
#include "guc.h"
#include "digest.h"
#include "ledger.h"
#include "ledger_row.h"
#include "ledger_store.h"
#include "sql_args.h"
#include "standby_slots.h"

PG_FUNCTION_INFO_V1(idem_claim_many);
PG_FUNCTION_INFO_V1(idem_platform_claim_many);
PG_FUNCTION_INFO_V1(idem_complete_many);
PG_FUNCTION_INFO_V1(idem_platform_complete_many);
PG_FUNCTION_INFO_V1(idem_fail_many);
PG_FUNCTION_INFO_V1(idem_platform_fail_many);

/* One array argument, deconstructed. */
typedef struct BatchArray
{
	Datum	   *elems;
	bool	   *nulls;
	int			n;
} BatchArray;

/* For the error context: which element of which call. */
typedef struct BatchPosition
{
	const char *func;
	int			i;				/* 0-based; -1 before the first */
	int			n;
} BatchPosition;

static void
batch_error_context(void *arg)
{
	BatchPosition *pos = (BatchPosition *) arg;

	if (pos->i >= 0)
		errcontext("element %d of %d of %s", pos->i + 1, pos->n, pos->func);
}

/*
 * A one-dimensional array argument without NULL elements.  An empty array
 * is a batch of none.
 */
static void
batch_array_arg(FunctionCallInfo fcinfo, int argno, const char *name,
				Oid elemtype, BatchArray *out)
{
	ArrayType  *arr;
	int16		typlen;
	bool		typbyval;
	char		typalign;
	int			i;

	idem_require_arg(fcinfo, argno, name);
	arr = PG_GETARG_ARRAYTYPE_P(argno);
	if (ARR_NDIM(arr) > 1)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must be a one-dimensional array", name)));
	get_typlenbyvalalign(elemtype, &typlen, &typbyval, &typalign);
	deconstruct_array(arr, elemtype, typlen, typbyval, typalign,
					  &out->elems, &out->nulls, &out->n);
	for (i = 0; i < out->n; i++)
		if (out->nulls[i])
			ereport(ERROR,
					(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
					 errmsg("%s[%d] must not be null", name, i + 1)));
}

static void
batch_same_length(const BatchArray *a, const char *aname,
				  const BatchArray *b, const char *bname)
{
	if (a->n != b->n)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s and %s must have the same length", aname, bname),
				 errdetail("%s has %d elements, %s has %d.",
						   aname, a->n, bname, b->n)));
}

/* At most max_locks_per_transaction keys: each claimed one holds a lock. */
static void
batch_size_check(const char *func, int n)
{
	if (n > max_locks_per_xact)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("%s takes at most %d keys per call, got %d",
						func, max_locks_per_xact, n),
				 errdetail("Each claimed key holds one lock until the transaction ends, and the lock table is sized by max_locks_per_transaction (%d).",
						   max_locks_per_xact),
				 errhint("Split the batch, or raise max_locks_per_transaction.")));
}

/*
 * The optional interval argument (lease or retention): NULL when the
 * argument is NULL, meaning the setting's default.
 */
static Interval *
batch_interval_arg(FunctionCallInfo fcinfo, int argno)
{
	return PG_ARGISNULL(argno) ? NULL : PG_GETARG_INTERVAL_P(argno);
}

static void
batch_key(LedgerKind kind, const BatchArray *tenants, const BatchArray *keys,
		  int i, LedgerKey *lk)
{
	memset(lk, 0, sizeof(*lk));
	lk->kind = kind;
	lk->tenant_id = kind == LEDGER_TENANT ? DatumGetInt64(tenants->elems[i]) : 0;
	idem_digest_check(DatumGetByteaPP(keys->elems[i]), "key", lk->key);
}

/* A call's arrays, its ledger, and its place in the error context. */
typedef struct Batch
{
	const char *func;
	BatchArray	tenants;		/* tenant ledger only */
	BatchArray	keys;
	BatchArray	values;			/* fingerprints or outcomes */
	int			interval_arg;	/* the lease or retention argument */
	LedgerStore *store;
	BatchPosition pos;
	ErrorContextCallback errcb;
} Batch;

/*
 * The arguments every batch function starts with: (tenant_ids,) keys and
 * VALUES_NAME arrays of the same length, at most max_locks_per_transaction
 * of them; then the ledger.  The error context names the element from
 * here until batch_end.
 */
static void
batch_begin(FunctionCallInfo fcinfo, LedgerKind kind, const char *func,
			const char *values_name, Oid values_type, Batch *b)
{
	int			a = 0;

	memset(b, 0, sizeof(*b));
	b->func = func;
	if (kind == LEDGER_TENANT)
		batch_array_arg(fcinfo, a++, "tenant_ids", INT8OID, &b->tenants);
	batch_array_arg(fcinfo, a++, "keys", BYTEAOID, &b->keys);
	batch_array_arg(fcinfo, a++, values_name, values_type, &b->values);
	if (kind == LEDGER_TENANT)
		batch_same_length(&b->tenants, "tenant_ids", &b->keys, "keys");
	batch_same_length(&b->keys, "keys", &b->values, values_name);
	batch_size_check(func, b->keys.n);
	b->interval_arg = a;
	b->store = ledger_store_open(get_func_namespace(fcinfo->flinfo->fn_oid), kind);

	b->pos.func = func;
	b->pos.i = -1;
	b->pos.n = b->keys.n;
	b->errcb.callback = batch_error_context;
	b->errcb.arg = &b->pos;
	b->errcb.previous = error_context_stack;
	error_context_stack = &b->errcb;
}

static void
batch_end(Batch *b)
{
	error_context_stack = b->errcb.previous;
}

/*
 * claim_many: (ord, decision, attempt, outcome, expires_at) per key, in
 * the order of the arrays (ord is the 1-based position).
 */
static Datum
ledger_claim_many(FunctionCallInfo fcinfo, LedgerKind kind)
{
	const char *func = kind == LEDGER_TENANT ? "idem_claim_many" : "idem_platform_claim_many";
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	TimestampTz now = GetCurrentTimestamp();
	TimestampTz lease_end;
	Batch		b;
	int			i;
	bool		replayed = false;
	XLogRecPtr	replayed_lsn = InvalidXLogRecPtr;

	PreventCommandIfReadOnly(kind == LEDGER_TENANT ? "idem_claim_many()" : "idem_platform_claim_many()");
	batch_begin(fcinfo, kind, func, "fingerprints", BYTEAOID, &b);
	lease_end = ledger_deadline(batch_interval_arg(fcinfo, b.interval_arg), "lease",
								idem_lease_ms, now);

	InitMaterializedSRF(fcinfo, 0);

	for (i = 0; i < b.keys.n; i++)
	{
		LedgerKey	lk;
		uint8		fingerprint[IDEM_DIGEST_LEN];
		ClaimAnswer ans;
		Datum		values[5];
		bool		nulls[5];

		b.pos.i = i;
		CHECK_FOR_INTERRUPTS();
		batch_key(kind, &b.tenants, &b.keys, i, &lk);
		idem_digest_check(DatumGetByteaPP(b.values.elems[i]), "fingerprint", fingerprint);
		ledger_claim_key_nowait(b.store, &lk, fingerprint, now, lease_end,
								batch_interval_arg(fcinfo, b.interval_arg) != NULL,
								idem_max_attempts, &ans);
		if (ledger_answer_needs_durable(&ans))
		{
			XLogRecPtr	lsn = idem_commit_lsn(ans.writer);

			replayed = true;
			if (lsn > replayed_lsn)
				replayed_lsn = lsn;
		}
		values[0] = Int32GetDatum(i + 1);
		nulls[0] = false;
		ledger_answer_values(&ans, values + 1, nulls + 1);
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}

	batch_end(&b);
	/* once for every replay: all their rows were read before this */
	if (replayed)
		idem_replay_durable(replayed_lsn);
	return (Datum) 0;
}

/*
 * complete_many: every key completed with its outcome, or an ERROR.
 * fail_many (is_fail): every key failed with its detail, retryably or
 * permanently as its element of retryable says.
 */
static void
ledger_complete_many(FunctionCallInfo fcinfo, LedgerKind kind, bool is_fail)
{
	const char *func = is_fail ?
		(kind == LEDGER_TENANT ? "idem_fail_many" : "idem_platform_fail_many") :
		(kind == LEDGER_TENANT ? "idem_complete_many" : "idem_platform_complete_many");
	const char *what = is_fail ? "details" : "outcomes";
	BatchArray	retryable = {0};
	int			a;
	TimestampTz now = GetCurrentTimestamp();
	TimestampTz retention_end;
	Batch		b;
	int			i;

	batch_begin(fcinfo, kind, func, what, JSONBOID, &b);
	a = b.interval_arg;
	if (is_fail)
	{
		batch_array_arg(fcinfo, a++, "retryable", BOOLOID, &retryable);
		batch_same_length(&b.keys, "keys", &retryable, "retryable");
	}
	retention_end = ledger_retention_end(batch_interval_arg(fcinfo, a), now);

	for (i = 0; i < b.keys.n; i++)
	{
		LedgerKey	lk;
		Jsonb	   *outcome;
		char	   *outcome_text;

		b.pos.i = i;
		CHECK_FOR_INTERRUPTS();
		batch_key(kind, &b.tenants, &b.keys, i, &lk);
		outcome = DatumGetJsonbP(b.values.elems[i]);
		outcome_text = ledger_check_outcome(outcome, is_fail ? "detail" : "outcome");
		if (is_fail)
			ledger_settle_key(b.store, &lk, "fail",
							  DatumGetBool(retryable.elems[i]) ?
							  IDEM_STATUS_FAILED_RETRYABLE :
							  IDEM_STATUS_FAILED_PERMANENT,
							  outcome, outcome_text, retention_end, 0, 0);
		else
			ledger_settle_key(b.store, &lk, "complete", IDEM_STATUS_COMPLETED,
							  outcome, outcome_text, retention_end, 0, 0);
	}

	batch_end(&b);
}

Datum
idem_claim_many(PG_FUNCTION_ARGS)
{
	return ledger_claim_many(fcinfo, LEDGER_TENANT);
}

Datum
idem_platform_claim_many(PG_FUNCTION_ARGS)
{
	return ledger_claim_many(fcinfo, LEDGER_PLATFORM);
}

Datum
idem_complete_many(PG_FUNCTION_ARGS)
{
	ledger_complete_many(fcinfo, LEDGER_TENANT, false);
	PG_RETURN_VOID();
}

Datum
idem_platform_complete_many(PG_FUNCTION_ARGS)
{
	ledger_complete_many(fcinfo, LEDGER_PLATFORM, false);
	PG_RETURN_VOID();
}

Datum
idem_fail_many(PG_FUNCTION_ARGS)
{
	ledger_complete_many(fcinfo, LEDGER_TENANT, true);
	PG_RETURN_VOID();
}

Datum
idem_platform_fail_many(PG_FUNCTION_ARGS)
{
	ledger_complete_many(fcinfo, LEDGER_PLATFORM, true);
	PG_RETURN_VOID();
}
