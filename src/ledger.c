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
 *	  through that lock, so while a claim holds it no other transaction can
 *	  write the key, and the claim's probe of the committed row is final.
 *	  When the lock is held elsewhere the claim answers from the committed
 *	  row: a terminal result is replayed, anything else is busy.
 *
 *	  A new key is not written at claim time: the claim is recorded in
 *	  pending.c and its row is written once, by complete / fail, or as a
 *	  processing row at pre-commit (lease mode).  See ledger.h.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/htup_details.h"
#include "access/xact.h"
#include "catalog/pg_type.h"
#include "common/hashfn.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "storage/lock.h"
#include "tcop/utility.h"
#include "utils/builtins.h"
#include "utils/datetime.h"
#include "utils/jsonb.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/resowner.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

#include "ledger.h"
#include "cache_format.h"
#include "compat.h"
#include "decision.h"
#include "digest.h"
#include "epoch_renewal.h"
#include "guc.h"
#include "ledger_row.h"
#include "ledger_store.h"
#include "commit_copies.h"
#include "outbox.h"
#include "pending.h"
#include "sql_args.h"
#include "standby_slots.h"
#include "stats.h"

PG_FUNCTION_INFO_V1(idem_claim);
PG_FUNCTION_INFO_V1(idem_complete);
PG_FUNCTION_INFO_V1(idem_fail);
PG_FUNCTION_INFO_V1(idem_lookup);
PG_FUNCTION_INFO_V1(idem_platform_claim);
PG_FUNCTION_INFO_V1(idem_platform_complete);
PG_FUNCTION_INFO_V1(idem_platform_fail);
PG_FUNCTION_INFO_V1(idem_platform_lookup);
PG_FUNCTION_INFO_V1(idem_complete_fenced);
PG_FUNCTION_INFO_V1(idem_fail_fenced);
PG_FUNCTION_INFO_V1(idem_platform_complete_fenced);
PG_FUNCTION_INFO_V1(idem_platform_fail_fenced);
PG_FUNCTION_INFO_V1(idem_purge);

/* objsubid of our key locks in pg_locks; core advisory locks use 1 and 2. */
#define IDEM_LOCKTAG_FIELD4		0x1DE

/* When another transaction holds a key, suggest a retry within this. */
#define IDEM_BUSY_RETRY_MS		1000

const char *const idem_decision_names[IDEM_DECISION_COUNT] = {
	"claimed", "completed", "failed_permanent", "busy", "mismatch"
};

/* Per call site (fn_extra) of a non-set-returning function. */
typedef struct CallCache
{
	Oid			nsp;			/* the extension's schema */
	TupleDesc	tupdesc;		/* blessed result type, claims only */
} CallCache;

/* ---------- arguments ---------- */

static void
digest_arg(FunctionCallInfo fcinfo, int argno, const char *name, uint8 *out)
{
	idem_require_arg(fcinfo, argno, name);
	idem_digest_check(PG_GETARG_BYTEA_PP(argno), name, out);
}

/* (tenant_id,) key: returns the index of the next argument. */
static int
key_args(FunctionCallInfo fcinfo, LedgerKind kind, LedgerKey *lk)
{
	int			a = 0;

	memset(lk, 0, sizeof(*lk));
	lk->kind = kind;
	if (kind == LEDGER_TENANT)
	{
		idem_require_arg(fcinfo, 0, "tenant_id");
		lk->tenant_id = PG_GETARG_INT64(0);
		a = 1;
	}
	digest_arg(fcinfo, a, "key", lk->key);
	return a + 1;
}

/*
 * now + iv, or + default_ms when iv is NULL.  An interval whose end is not
 * in the future is refused: a lease or retention that has already ended is
 * a bug in the caller.  The end is checked as it is computed, on the
 * calendar in the session's time zone: '1 month -29 days' in February, or
 * '1 day -24 hours 1 second' across a 23-hour day, ends in the past although
 * a month counted as 30 days and a day as 24 hours would make it positive.
 * Infinite intervals (PostgreSQL 17 and later) are refused too: a lease
 * that never ends holds its key forever, a retention that never ends keeps
 * the row from idem_purge forever.
 */
TimestampTz
ledger_deadline(Interval *iv, const char *name, int64 default_ms,
				TimestampTz now)
{
	TimestampTz end;

	if (iv == NULL)
		return now + default_ms * INT64CONST(1000);
	if (!idem_interval_is_finite(iv))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must be finite", name),
				 errdetail("Got %s.",
						   DatumGetCString(DirectFunctionCall1(interval_out,
															   IntervalPGetDatum(iv))))));
	end = DatumGetTimestampTz(DirectFunctionCall2(timestamptz_pl_interval,
												  TimestampTzGetDatum(now),
												  IntervalPGetDatum(iv)));
	if (end <= now)
	{
		/* positive when a month is 30 days and a day 24 hours: no overflow */
		double		span = (double) iv->time + (double) iv->day * USECS_PER_DAY +
			(double) iv->month * DAYS_PER_MONTH * USECS_PER_DAY;
		char	   *ivtext = DatumGetCString(DirectFunctionCall1(interval_out,
																 IntervalPGetDatum(iv)));

		if (span <= 0)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("%s must be positive", name),
					 errdetail("Got %s.", ivtext)));
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must be positive", name),
				 errdetail("Got %s, which ends %s as added on the calendar, in the session's time zone.",
						   ivtext, end == now ? "now" : "before now"),
				 errhint("Months and days are added on the calendar: a month can be 28 days, a day 23 hours.")));
	}
	return end;
}

static TimestampTz
deadline_arg(FunctionCallInfo fcinfo, int argno, const char *name,
			 int64 default_ms, TimestampTz now)
{
	return ledger_deadline(PG_ARGISNULL(argno) ? NULL : PG_GETARG_INTERVAL_P(argno),
						   name, default_ms, now);
}

/*
 * The end of a result's retention: now + iv, or + idem.retention when iv
 * is NULL, never shorter than the retention floor (idem.min_retention): a
 * key purged before the queue stops redelivering its message lets a
 * redelivery run the effect again.  Nor later than a Valkey copy can say
 * (IDEM_CACHE_EXPIRES_MAX, in year 287396): the worker could not copy the
 * result, and every replay would be answered by PostgreSQL.
 */
TimestampTz
ledger_retention_end(Interval *iv, TimestampTz now)
{
	TimestampTz end = ledger_deadline(iv, "retention",
									  (int64) idem_retention_s * 1000, now);
	TimestampTz last = (TimestampTz) (IDEM_CACHE_EXPIRES_MAX -
									  (int64) (POSTGRES_EPOCH_JDATE - UNIX_EPOCH_JDATE) *
									  SECS_PER_DAY * 1000) * 1000;

	if (end > last)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("retention ends after the last time a result can be kept"),
				 errdetail("The retention given ends after %s; the Valkey copy of a result cannot say a later end.",
						   timestamptz_to_str(last)),
				 errhint("Give a shorter retention.")));
	if (end - now >= (int64) idem_min_retention_s * USECS_PER_SEC)
		return end;
	ereport(ERROR,
			(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
			 errmsg("retention is shorter than idem.min_retention (%d s)",
					idem_min_retention_s),
			 iv == NULL ?
			 errdetail("No retention was given, and idem.retention is %d s.",
					   idem_retention_s) :
			 errdetail("The retention given ends in %lld s.",
					   (long long) ((end - now) / USECS_PER_SEC)),
			 errhint("Keep results longer than the queue's longest redelivery window: a redelivery that finds its key purged runs the effect again.")));
	return 0;					/* keep the compiler quiet */
}

/* A result or failure detail: a JSON object of at most 4096 bytes of text. */
StaticAssertDecl(IDEM_OUTCOME_MAX == 4096, "the size stated above and in the README");
char *
ledger_check_outcome(Jsonb *jb, const char *name)
{
	char	   *text;
	size_t		len;

	if (JB_ROOT_IS_SCALAR(jb) || !JB_ROOT_IS_OBJECT(jb))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must be a JSON object", name),
				 errdetail("Got a JSON %s.",
						   JB_ROOT_IS_SCALAR(jb) ? "scalar" : "array")));
	text = JsonbToCString(NULL, &jb->root, VARSIZE(jb));
	len = strlen(text);
	if (len > IDEM_OUTCOME_MAX)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("%s is %zu bytes as JSON text, over the limit of %d bytes",
						name, len, IDEM_OUTCOME_MAX),
				 errhint("Store large results elsewhere and keep a reference in the outcome.")));
	return text;
}

static char *
outcome_arg(FunctionCallInfo fcinfo, int argno, const char *name, Jsonb **jb)
{
	idem_require_arg(fcinfo, argno, name);
	*jb = PG_GETARG_JSONB_P(argno);
	return ledger_check_outcome(*jb, name);
}

/*
 * The extension's schema (and the claim's result type), remembered per call
 * site in fn_extra.  Set-returning functions look it up each time: their
 * fn_extra belongs to the SRF machinery.
 */
static CallCache *
call_cache(FunctionCallInfo fcinfo, bool want_tupdesc)
{
	CallCache  *cc = (CallCache *) fcinfo->flinfo->fn_extra;

	if (cc == NULL)
	{
		MemoryContext old = MemoryContextSwitchTo(fcinfo->flinfo->fn_mcxt);
		TupleDesc	tupdesc;

		cc = palloc0(sizeof(CallCache));
		cc->nsp = get_func_namespace(fcinfo->flinfo->fn_oid);
		if (want_tupdesc)
		{
			if (get_call_result_type(fcinfo, NULL, &tupdesc) != TYPEFUNC_COMPOSITE)
				ereport(ERROR,
						(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
						 errmsg("function returning record called in context that cannot accept type record")));
			cc->tupdesc = BlessTupleDesc(CreateTupleDescCopy(tupdesc));
		}
		MemoryContextSwitchTo(old);
		fcinfo->flinfo->fn_extra = cc;
	}
	return cc;
}

static void
key_locktag(LOCKTAG *tag, const LedgerKey *lk)
{
	uint8		buf[1 + sizeof(int64) + IDEM_DIGEST_LEN];
	uint64		h;

	buf[0] = (uint8) lk->kind;
	memcpy(buf + 1, &lk->tenant_id, sizeof(int64));
	memcpy(buf + 1 + sizeof(int64), lk->key, IDEM_DIGEST_LEN);
	h = hash_bytes_extended(buf, sizeof(buf), 0);
	SET_LOCKTAG_ADVISORY(*tag, MyDatabaseId, (uint32) (h >> 32), (uint32) h,
						 IDEM_LOCKTAG_FIELD4);
}

/*
 * The key lock, taken without waiting, for the current (sub)transaction.
 * Not for CurrentResourceOwner: during a cursor's FETCH that is the
 * portal's, and a later FETCH of the same cursor that fails inside a
 * savepoint hands the portal's resources to the savepoint, whose ROLLBACK
 * TO releases them: the key lock would go while the claim it guards stays
 * ours (pending.c forgets only the claims of the aborted subtransaction).
 * Under CurTransactionResourceOwner the lock lives exactly as long as the
 * claim: to the end of the transaction, or of the subtransaction that made
 * it if that one aborts.
 */
static LockAcquireResult
key_lock_acquire(const LOCKTAG *tag)
{
	ResourceOwner save = CurrentResourceOwner;
	LockAcquireResult res;

	/* on error, the (sub)transaction's abort resets CurrentResourceOwner */
	CurrentResourceOwner = CurTransactionResourceOwner;
	res = LockAcquire(tag, ExclusiveLock, false, true);
	CurrentResourceOwner = save;
	return res;
}

/* Give back a key lock key_lock_acquire() took in this (sub)transaction. */
static void
key_lock_release(const LOCKTAG *tag)
{
	ResourceOwner save = CurrentResourceOwner;

	CurrentResourceOwner = CurTransactionResourceOwner;
	LockRelease(tag, ExclusiveLock, false);
	CurrentResourceOwner = save;
}

/*
 * The answer a claim gives from a committed row it will not change: a
 * replay, a mismatch, or busy.  retry_at is when a busy caller should come
 * back if the row has no running lease to offer.
 */
static void
answer_from_row(const LedgerRow *row, bool found, const uint8 *fingerprint,
				TimestampTz now, TimestampTz retry_at, ClaimAnswer *ans)
{
	ans->attempt = found ? row->attempt : 0;
	ans->fence = 0;
	ans->outcome = (Datum) 0;
	ans->expires_at = retry_at;
	ans->committed_row = found && !row->ours;
	ans->writer = ans->committed_row ? row->writer : InvalidTransactionId;
	if (found && memcmp(row->fingerprint, fingerprint, IDEM_DIGEST_LEN) != 0)
		ans->decision = IDEM_DECISION_MISMATCH;
	else if (found && row->status == IDEM_STATUS_COMPLETED)
		ans->decision = IDEM_DECISION_COMPLETED;
	else if (found && row->status == IDEM_STATUS_FAILED_PERMANENT)
		ans->decision = IDEM_DECISION_FAILED_PERMANENT;
	else
	{
		ans->decision = IDEM_DECISION_BUSY;
		if (found && row->status == IDEM_STATUS_PROCESSING && row->expires_at > now)
			ans->expires_at = row->expires_at;
		return;
	}
	if (ans->decision != IDEM_DECISION_MISMATCH)
	{
		ans->outcome = row->outcome;
		ans->expires_at = row->expires_at;
	}
}

static void
answer_claimed(ClaimAnswer *ans, int32 attempt, int64 fence,
			   TimestampTz lease_end)
{
	ans->decision = IDEM_DECISION_CLAIMED;
	ans->committed_row = false;
	ans->writer = InvalidTransactionId;
	ans->attempt = attempt;
	ans->fence = fence;
	ans->outcome = (Datum) 0;
	ans->expires_at = lease_end;
}

/* The processing row an open claim of this transaction stands for. */
static void
pending_as_row(const PendingClaim *mine, LedgerRow *row)
{
	memset(row, 0, sizeof(*row));
	row->status = IDEM_STATUS_PROCESSING;
	memcpy(row->fingerprint, mine->fingerprint, IDEM_DIGEST_LEN);
	row->attempt = 1;
	row->outcome = DirectFunctionCall1(jsonb_in, CStringGetDatum("{}"));
	row->expires_at = mine->lease_end;
	row->ours = true;
}

/*
 * The claim, with the key lock held by us.  No other transaction can
 * write the key now, so what the probe sees is what there is (under READ
 * COMMITTED; see the REPEATABLE READ check below).
 */
static void
claim_locked(LedgerStore *store, const LedgerKey *lk, const uint8 *fingerprint,
			 TimestampTz now, TimestampTz lease_end, bool lease_given,
			 int32 max_attempts, ClaimAnswer *ans)
{
	PendingClaim *mine = pending_find(lk);
	LedgerRow	row;
	int			tries;

	/* This transaction already claimed the key: busy, not a second run. */
	if (mine)
	{
		pending_as_row(mine, &row);
		answer_from_row(&row, true, fingerprint, now, mine->lease_end, ans);
		return;
	}

	for (tries = 0; tries < 3; tries++)
	{
		int32		attempt;
		int64		fence;
		Snapshot	snapshot = GetTransactionSnapshot();

		if (!ledger_probe(store, lk, snapshot, &row))
		{
			/*
			 * Under REPEATABLE READ our snapshot may predate a row that is
			 * committed now: running the effect would double it.
			 */
			if (IsolationUsesXactSnapshot() &&
				ledger_probe(store, lk, GetLatestSnapshot(), &row))
				ereport(ERROR,
						(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
						 errmsg("could not serialize access: the idempotency key was written by a concurrent transaction"),
						 errhint("Retry the transaction; it will see the key's current state.")));
			if (lk->kind == LEDGER_TENANT &&
				!ledger_tenant_exists(store, lk->tenant_id, snapshot))
				ereport(ERROR,
						(errcode(ERRCODE_FOREIGN_KEY_VIOLATION),
						 errmsg("tenant %lld does not exist", (long long) lk->tenant_id),
						 errdetail("Key (id)=(%lld) is not present in table \"%s\".",
								   (long long) lk->tenant_id, ledger_tenants_name(store))));
			pending_add(lk, fingerprint, lease_end, lease_given,
						ledger_store_relid(store));
			answer_claimed(ans, 1, 0, lease_end);
			return;
		}

		/* This transaction wrote the row and it is still processing. */
		if (row.ours && row.status == IDEM_STATUS_PROCESSING)
		{
			answer_from_row(&row, true, fingerprint, now, row.expires_at, ans);
			return;
		}

		/*
		 * failed_retryable as the last attempt allowed: no attempt is left,
		 * so the key fails for good, with the last failure's detail, and
		 * every later claim replays that.
		 */
		if (memcmp(row.fingerprint, fingerprint, IDEM_DIGEST_LEN) == 0 &&
			row.status == IDEM_STATUS_FAILED_RETRYABLE &&
			max_attempts > 0 && row.attempt >= max_attempts)
		{
			TimestampTz kept_until;

			if (ledger_exhaust(store, lk, &row,
							   now + (int64) idem_retention_s * USECS_PER_SEC,
							   &kept_until))
			{
				Jsonb	   *detail = DatumGetJsonbP(row.outcome);
				char	   *text = JsonbToCString(NULL, &detail->root, VARSIZE(detail));

				ans->decision = IDEM_DECISION_FAILED_PERMANENT;
				ans->committed_row = false;
				ans->wrote_row = true;
				ans->attempt = row.attempt;
				ans->fence = 0;
				ans->outcome = row.outcome;
				ans->expires_at = kept_until;
				idem_copies_add(lk->kind == LEDGER_PLATFORM, lk->tenant_id, lk->key,
								IDEM_CACHE_FAILED_PERMANENT, row.attempt,
								row.fingerprint, text, (int) strlen(text),
								kept_until);
				return;
			}
			continue;			/* changed under us: look again */
		}

		/* failed_retryable, or a committed lease that ran out: take it over. */
		if (memcmp(row.fingerprint, fingerprint, IDEM_DIGEST_LEN) == 0 &&
			(row.status == IDEM_STATUS_FAILED_RETRYABLE ||
			 (row.status == IDEM_STATUS_PROCESSING && row.expires_at <= now)))
		{
			if (ledger_reclaim(store, lk, &row, lease_end, &attempt, &fence))
			{
				/* held until completed or failed, as a new key's claim */
				pending_add_taken(lk, ledger_store_relid(store));
				answer_claimed(ans, attempt, fence, lease_end);
				return;
			}
			continue;			/* purged under us: look again */
		}

		answer_from_row(&row, true, fingerprint, now, row.expires_at, ans);
		return;
	}

	/* The row kept changing under us (a purge racing): let the caller retry. */
	ans->decision = IDEM_DECISION_BUSY;
	ans->committed_row = false;
	ans->writer = InvalidTransactionId;
	ans->attempt = 0;
	ans->fence = 0;
	ans->outcome = (Datum) 0;
	ans->expires_at = now + IDEM_BUSY_RETRY_MS * INT64CONST(1000);
}

/*
 * A terminal row read from PostgreSQL (after a cache miss, typically):
 * queue its copy for Valkey, which the worker writes once the row's commit
 * is durable.  Rows of this transaction are left to the commit hook.
 *
 * generation is the renewal generation read before the probe that found
 * the row (idem_renewal_stamp; IDEM_RENEWAL_NO_COPY: nothing is copied
 * while a removal is prepared).  Under READ COMMITTED that probe took
 * a snapshot after the read, which sees every removal of ledger rows the
 * generation counts.  Under REPEATABLE READ and SERIALIZABLE the
 * transaction's snapshot may predate one (a transaction that began before
 * a DELETE): the row is copied only if a probe under a snapshot taken now
 * finds it still there, the same (epoch_renewal.c says why).
 */
static void
repopulate(LedgerStore *store, const LedgerKey *lk, uint64 generation,
		   IdemStatus status, int32 attempt, const uint8 *fingerprint,
		   Datum outcome, TimestampTz expires_at)
{
	IdemCacheKind kind;
	char	   *text;
	Jsonb	   *jb = DatumGetJsonbP(outcome);

	if (status == IDEM_STATUS_COMPLETED)
		kind = IDEM_CACHE_COMPLETED;
	else if (status == IDEM_STATUS_FAILED_PERMANENT)
		kind = IDEM_CACHE_FAILED_PERMANENT;
	else
		return;
	if (generation == IDEM_RENEWAL_NO_COPY)
		return;					/* a removal is prepared, not committed */
	if (generation > 0 && IsolationUsesXactSnapshot())
	{
		LedgerRow	now;
		Jsonb	   *now_jb;

		if (!ledger_probe(store, lk, GetLatestSnapshot(), &now))
			return;
		now_jb = DatumGetJsonbP(now.outcome);
		if (now.status != status || now.attempt != attempt ||
			now.expires_at != expires_at ||
			memcmp(now.fingerprint, fingerprint, IDEM_DIGEST_LEN) != 0 ||
			VARSIZE(now_jb) != VARSIZE(jb) ||
			memcmp(now_jb, jb, VARSIZE(jb)) != 0)
			return;
	}
	text = JsonbToCString(NULL, &jb->root, VARSIZE(jb));
	idem_copies_repopulate(lk->kind == LEDGER_PLATFORM, lk->tenant_id, lk->key,
						   kind, attempt, fingerprint, text,
						   (int) strlen(text), expires_at, generation);
	pfree(text);
}

/*
 * Whether the answer is final and was read from another transaction's row
 * (a replay or a mismatch the caller acts on): it must then not be given
 * before that row is as durable as the caller's own commits
 * (idem_replay_durable).
 */
bool
ledger_answer_needs_durable(const ClaimAnswer *ans)
{
	return ans->committed_row &&
		(ans->decision == IDEM_DECISION_COMPLETED ||
		 ans->decision == IDEM_DECISION_FAILED_PERMANENT ||
		 ans->decision == IDEM_DECISION_MISMATCH);
}

/*
 * One key's claim, answered once a row of another transaction it answers
 * from is durable.  Shared by idem_claim and idem_apply (ledger_apply.c).
 */
void
ledger_claim_key(LedgerStore *store, const LedgerKey *lk,
				 const uint8 *fingerprint, TimestampTz now,
				 TimestampTz lease_end, bool lease_given, int32 max_attempts,
				 ClaimAnswer *ans)
{
	ledger_claim_key_nowait(store, lk, fingerprint, now, lease_end,
							lease_given, max_attempts, ans);
	if (ledger_answer_needs_durable(ans))
		idem_replay_durable(idem_commit_lsn(ans->writer));
}

/*
 * One key's claim: the key lock without waiting, then the decision.  The
 * lock stays held (until the transaction ends) only when the key is
 * claimed.  The caller waits for idem_replay_durable() before it answers
 * when ledger_answer_needs_durable() (idem_claim_many does so once for
 * all its keys).
 */
void
ledger_claim_key_nowait(LedgerStore *store, const LedgerKey *lk,
						const uint8 *fingerprint, TimestampTz now,
						TimestampTz lease_end, bool lease_given,
						int32 max_attempts, ClaimAnswer *ans)
{
	LOCKTAG		tag;
	LockAcquireResult lockres;
	/* before any probe: what a copy of the row read is stamped with */
	uint64		generation = idem_renewal_stamp();

	ans->wrote_row = false;
	key_locktag(&tag, lk);
	lockres = key_lock_acquire(&tag);
	if (lockres == LOCKACQUIRE_NOT_AVAIL)
	{
		/* Another transaction is on this key: answer without waiting. */
		LedgerRow	row;
		bool		found = ledger_probe(store, lk, GetTransactionSnapshot(), &row);

		answer_from_row(&row, found, fingerprint, now,
						Min(lease_end, now + IDEM_BUSY_RETRY_MS * INT64CONST(1000)),
						ans);
	}
	else
	{
		claim_locked(store, lk, fingerprint, now, lease_end, lease_given,
					 max_attempts, ans);
		/*
		 * Nothing claimed or written: let the next claimer in at once.  A
		 * row written here keeps its lock, as a completion's does, so that
		 * no claim waits on the row until this transaction ends.
		 */
		if (ans->decision != IDEM_DECISION_CLAIMED && !ans->wrote_row &&
			lockres == LOCKACQUIRE_OK)
			key_lock_release(&tag);
	}

	idem_stats_count_claim(ans->decision);
	if (ans->committed_row && (ans->decision == IDEM_DECISION_COMPLETED ||
							   ans->decision == IDEM_DECISION_FAILED_PERMANENT))
		repopulate(store, lk, generation,
				   ans->decision == IDEM_DECISION_COMPLETED ?
				   IDEM_STATUS_COMPLETED : IDEM_STATUS_FAILED_PERMANENT,
				   ans->attempt, fingerprint, ans->outcome, ans->expires_at);
}

/* The four columns of idem_claim_result. */
void
ledger_answer_values(const ClaimAnswer *ans, Datum *values, bool *nulls)
{
	values[0] = CStringGetTextDatum(idem_decision_names[ans->decision]);
	nulls[0] = false;
	values[1] = Int32GetDatum(ans->attempt);
	nulls[1] = ans->attempt == 0;
	values[2] = ans->outcome;
	nulls[2] = ans->outcome == (Datum) 0;
	values[3] = TimestampTzGetDatum(ans->expires_at);
	nulls[3] = false;
}

static Datum
ledger_claim(FunctionCallInfo fcinfo, LedgerKind kind)
{
	CallCache  *cc = call_cache(fcinfo, true);
	LedgerKey	lk;
	uint8		fingerprint[IDEM_DIGEST_LEN];
	TimestampTz now = GetCurrentTimestamp();
	TimestampTz lease_end;
	LedgerStore *store;
	ClaimAnswer ans;
	Datum		values[5];
	bool		nulls[5];
	int			next;

	/* The claim's row is written later, at complete or at pre-commit. */
	PreventCommandIfReadOnly(kind == LEDGER_TENANT ? "idem_claim()" : "idem_platform_claim()");
	next = key_args(fcinfo, kind, &lk);
	digest_arg(fcinfo, next, "fingerprint", fingerprint);
	lease_end = deadline_arg(fcinfo, next + 1, "lease", idem_lease_ms, now);
	store = ledger_store_open_key(cc->nsp, &lk);

	ledger_claim_key(store, &lk, fingerprint, now, lease_end,
					 !PG_ARGISNULL(next + 1), idem_max_attempts, &ans);

	/* A new key's fence: the id its row will be written with. */
	if (ans.decision == IDEM_DECISION_CLAIMED && ans.fence == 0)
	{
		PendingClaim *mine = pending_find(&lk);

		if (mine != NULL)
		{
			if (mine->fence == 0)
				mine->fence = ledger_new_fence(store);
			ans.fence = mine->fence;
		}
	}

	ledger_answer_values(&ans, values, nulls);
	/* fence: the fifth column since 0.4 (before ALTER EXTENSION, four) */
	values[4] = Int64GetDatum(ans.fence);
	nulls[4] = ans.fence == 0;
	PG_RETURN_DATUM(HeapTupleGetDatum(heap_form_tuple(cc->tupdesc, values, nulls)));
}

/*
 * complete / fail: give a key this transaction claimed (or a committed
 * processing row, in lease mode) its final status, and queue a terminal
 * result for the Valkey copy made after commit.
 *
 * Lease mode is fenced, so that a holder whose lease ended and whose key
 * was taken over never completes the later claim with its own outcome.
 * The _fenced functions take the claim's fence (fenced: the argument after
 * the key), the id of the claim's row, which no later claim of any key
 * has: a takeover gives the row a new id, and a row purged and claimed
 * again is a new row.  The others take an optional attempt, which a later
 * claim of a purged key has again (idem.min_purge_grace bounds that).
 */
static void
ledger_settle(FunctionCallInfo fcinfo, LedgerKind kind, const char *what,
			  bool is_fail, bool fenced)
{
	CallCache  *cc = call_cache(fcinfo, false);
	LedgerKey	lk;
	TimestampTz now = GetCurrentTimestamp();
	TimestampTz retention_end;
	Jsonb	   *outcome;
	char	   *outcome_text;
	IdemStatus	status = IDEM_STATUS_COMPLETED;
	int32		fence_attempt = 0;
	int64		fence = 0;
	int			next;

	next = key_args(fcinfo, kind, &lk);
	if (fenced)
	{
		idem_require_arg(fcinfo, next, "fence");
		fence = PG_GETARG_INT64(next);
		if (fence <= 0)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("fence must be positive, not %lld", (long long) fence),
					 errhint("Pass the fence idem_claim() answered with the key.")));
		next++;
	}
	outcome_text = outcome_arg(fcinfo, next, is_fail ? "detail" : "outcome", &outcome);
	next++;
	if (is_fail)
	{
		idem_require_arg(fcinfo, next, "retryable");
		status = PG_GETARG_BOOL(next) ?
			IDEM_STATUS_FAILED_RETRYABLE : IDEM_STATUS_FAILED_PERMANENT;
		next++;
	}
	retention_end = ledger_retention_end(PG_ARGISNULL(next) ? NULL :
										 PG_GETARG_INTERVAL_P(next), now);
	next++;
	if (!fenced && !PG_ARGISNULL(next))
	{
		fence_attempt = PG_GETARG_INT32(next);
		if (fence_attempt <= 0)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("attempt must be positive, not %d", fence_attempt)));
	}
	ledger_settle_key(ledger_store_open_key(cc->nsp, &lk), &lk, what, status,
					  outcome, outcome_text, retention_end, fence_attempt, fence);
}

/*
 * The keys whose rows ledger_settle_key is writing now, innermost first (a
 * trigger fired by a write may settle other keys), or NULL.
 */
typedef struct SettlingKey
{
	const LedgerKey *lk;
	const struct SettlingKey *outer;
} SettlingKey;

static const SettlingKey *settling = NULL;

/* A completion refused because another claim holds the key now. */
static void
settle_fenced_off(const char *what, int32 fence_attempt, int64 fence,
				  int32 attempt_now)
{
	if (fence != 0)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("cannot %s idempotency key with fence %lld: another claim holds it now",
						what, (long long) fence),
				 errdetail("The claim with that fence lost the key: its lease ended and the key was taken over, or its row was purged and the key claimed again (attempt %d holds it now).",
						   attempt_now),
				 errhint("Make leases longer than the effect takes; in lease mode the effect may have run twice.")));
	ereport(ERROR,
			(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
			 errmsg("cannot %s idempotency key as attempt %d: attempt %d holds it now",
					what, fence_attempt, attempt_now),
			 errdetail("The lease of attempt %d ended and the key was taken over.", fence_attempt),
			 errhint("Make leases longer than the effect takes; in lease mode the effect may have run twice.")));
}

/*
 * One key's completion or failure (status), after its arguments were
 * checked.  fence_attempt, fence 0: none given.  Shared by idem_complete /
 * idem_fail (and _fenced), idem_apply and the batches (ledger_batch.c).
 */
void
ledger_settle_key(LedgerStore *store, const LedgerKey *lk, const char *what,
				  IdemStatus status, Jsonb *outcome, const char *outcome_text,
				  TimestampTz retention_end, int32 fence_attempt, int64 fence)
{
	PendingClaim *mine;
	int32		attempt;
	uint8		fingerprint[IDEM_DIGEST_LEN];
	bool		is_fail = status != IDEM_STATUS_COMPLETED;
	SettlingKey this_key;
	const SettlingKey *s;

	/*
	 * A trigger on the ledger that settles the key whose row this backend
	 * is writing now: that write is not done, and it is the key's one
	 * settlement (another would fail on the unique key, 23505).
	 */
	for (s = settling; s != NULL; s = s->outer)
		if (s->lk->kind == lk->kind && s->lk->tenant_id == lk->tenant_id &&
			memcmp(s->lk->key, lk->key, IDEM_DIGEST_LEN) == 0)
			ereport(ERROR,
					(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
					 errmsg("cannot %s idempotency key: this transaction is settling it now", what),
					 errdetail("A trigger fired by the key's ledger row called idem for the same key."),
					 errhint("Do not complete or fail a key in a trigger on the ledger.")));

	mine = pending_find(lk);
	if (mine && fence_attempt > 1)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("cannot %s idempotency key as attempt %d: this transaction claimed attempt 1",
						what, fence_attempt)));
	if (mine && fence != 0 && fence != mine->fence)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("cannot %s idempotency key with fence %lld: this transaction's claim of it has another",
						what, (long long) fence)));

	this_key.lk = lk;
	this_key.outer = settling;
	settling = &this_key;
	PG_TRY();
	{
		if (mine)
		{
			/* Claimed in this transaction: the row's one and only write. */
			pending_check_change(what);
			memcpy(fingerprint, mine->fingerprint, IDEM_DIGEST_LEN);
			attempt = 1;
			ledger_insert(store, lk, mine->fence, fingerprint, status, attempt,
						  JsonbPGetDatum(outcome), retention_end);
			pending_settle(mine);
		}
		else
		{
			LOCKTAG		tag;

			key_locktag(&tag, lk);
			if (key_lock_acquire(&tag) == LOCKACQUIRE_NOT_AVAIL)
				ereport(ERROR,
						(errcode(ERRCODE_LOCK_NOT_AVAILABLE),
						 errmsg("cannot %s idempotency key: another transaction holds it", what),
						 errhint("Only the transaction that claimed a key, or a later one after it committed, can %s it.",
								 what)));
			if (!ledger_finish(store, lk, status, JsonbPGetDatum(outcome),
							   retention_end, fence_attempt, fence, &attempt,
							   fingerprint))
			{
				LedgerRow	row;

				if (!ledger_probe(store, lk, GetTransactionSnapshot(), &row))
					ereport(ERROR,
							(errcode(ERRCODE_NO_DATA_FOUND),
							 errmsg("cannot %s idempotency key: it has not been claimed", what),
							 errhint("Call idem_claim() for the key first, in this transaction.")));
				if (row.status == IDEM_STATUS_PROCESSING)
					settle_fenced_off(what, fence_attempt, fence, row.attempt);
				ereport(ERROR,
						(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
						 errmsg("cannot %s idempotency key: its status is already %s",
								what, idem_status_names[row.status]),
						 row.status == IDEM_STATUS_FAILED_RETRYABLE ?
						 errhint("Claim the key again before completing or failing it.") : 0));
			}
			/* taken over by this transaction: held no more */
			pending_settle_taken(lk);
		}
	}
	PG_FINALLY();
	{
		settling = this_key.outer;
	}
	PG_END_TRY();

	/* a failure deletes the messages the claim emitted in this transaction */
	idem_outbox_claim_settled(lk, is_fail);
	if (status != IDEM_STATUS_FAILED_RETRYABLE)
		idem_copies_add(lk->kind == LEDGER_PLATFORM, lk->tenant_id, lk->key,
						is_fail ? IDEM_CACHE_FAILED_PERMANENT : IDEM_CACHE_COMPLETED,
						attempt, fingerprint, outcome_text,
						(int) strlen(outcome_text), retention_end);
}

/* idem_lookup / idem_platform_lookup: zero or one row, read-only. */
static Datum
ledger_lookup(FunctionCallInfo fcinfo, LedgerKind kind)
{
	FuncCallContext *funcctx;

	if (SRF_IS_FIRSTCALL())
	{
		LedgerKey	lk;
		LedgerStore *store;
		LedgerRow	row;
		PendingClaim *mine;
		MemoryContext oldcxt;
		TupleDesc	tupdesc;
		bool		found;
		/* before the probe: what a copy of the row read is stamped with */
		uint64		generation = idem_renewal_stamp();

		funcctx = SRF_FIRSTCALL_INIT();
		oldcxt = MemoryContextSwitchTo(funcctx->multi_call_memory_ctx);
		key_args(fcinfo, kind, &lk);
		if (get_call_result_type(fcinfo, NULL, &tupdesc) != TYPEFUNC_COMPOSITE)
			ereport(ERROR,
					(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
					 errmsg("function returning record called in context that cannot accept type record")));
		store = ledger_store_open_key(get_func_namespace(fcinfo->flinfo->fn_oid), &lk);
		mine = pending_find(&lk);
		if (mine)
		{
			/* Claimed in this transaction, not written yet. */
			pending_as_row(mine, &row);
			found = true;
		}
		else
			found = ledger_probe(store, &lk, GetTransactionSnapshot(), &row);
		if (found && !row.ours)
		{
			repopulate(store, &lk, generation, row.status, row.attempt,
					   row.fingerprint, row.outcome, row.expires_at);
			/* a final status the caller may act on: see ledger_claim_key */
			if (row.status == IDEM_STATUS_COMPLETED ||
				row.status == IDEM_STATUS_FAILED_PERMANENT)
				idem_replay_durable(idem_commit_lsn(row.writer));
		}
		if (found)
		{
			Datum		values[5];
			bool		nulls[5] = {false, false, false, false, false};

			values[0] = CStringGetTextDatum(idem_status_names[row.status]);
			values[1] = Int32GetDatum(row.attempt);
			values[2] = row.outcome;
			values[3] = PointerGetDatum(idem_digest_bytea(row.fingerprint, NULL));
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
	ledger_settle(fcinfo, LEDGER_TENANT, "complete", false, false);
	PG_RETURN_VOID();
}

Datum
idem_platform_complete(PG_FUNCTION_ARGS)
{
	ledger_settle(fcinfo, LEDGER_PLATFORM, "complete", false, false);
	PG_RETURN_VOID();
}

Datum
idem_fail(PG_FUNCTION_ARGS)
{
	ledger_settle(fcinfo, LEDGER_TENANT, "fail", true, false);
	PG_RETURN_VOID();
}

Datum
idem_platform_fail(PG_FUNCTION_ARGS)
{
	ledger_settle(fcinfo, LEDGER_PLATFORM, "fail", true, false);
	PG_RETURN_VOID();
}

Datum
idem_complete_fenced(PG_FUNCTION_ARGS)
{
	ledger_settle(fcinfo, LEDGER_TENANT, "complete", false, true);
	PG_RETURN_VOID();
}

Datum
idem_platform_complete_fenced(PG_FUNCTION_ARGS)
{
	ledger_settle(fcinfo, LEDGER_PLATFORM, "complete", false, true);
	PG_RETURN_VOID();
}

Datum
idem_fail_fenced(PG_FUNCTION_ARGS)
{
	ledger_settle(fcinfo, LEDGER_TENANT, "fail", true, true);
	PG_RETURN_VOID();
}

Datum
idem_platform_fail_fenced(PG_FUNCTION_ARGS)
{
	ledger_settle(fcinfo, LEDGER_PLATFORM, "fail", true, true);
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
 * their retention (and finished at least idem.min_retention ago, whatever
 * retention they were given), and processing rows whose lease ended more
 * than idem.purge_grace ago, and never less than idem.min_purge_grace ago:
 * a processing row holds the lease-mode fence (its attempt), so purging it
 * while a stale holder may still complete would let that holder's
 * idem_complete(..., attempt => 1) complete the key's next claim.  Rows
 * locked by a running claim or completion are skipped (SKIP LOCKED), so the
 * purge never waits for them.  Call it again until it returns 0; each call
 * is one short batch.
 */
Datum
idem_purge(PG_FUNCTION_ARGS)
{
	CallCache  *cc = call_cache(fcinfo, false);
	int32		batch;
	TimestampTz now = GetCurrentTimestamp();
	int64		deleted = 0;
	int			kind;
	int			grace_s = Max(idem_purge_grace_s, idem_min_purge_grace_s);

	idem_require_arg(fcinfo, 0, "batch_size");
	batch = PG_GETARG_INT32(0);
	if (batch <= 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("batch_size must be positive, not %d", batch)));

	for (kind = 0; kind < LEDGER_KINDS; kind++)
		deleted += ledger_purge(ledger_store_open(cc->nsp, (LedgerKind) kind), now,
								now - (int64) grace_s * USECS_PER_SEC,
								now - (int64) idem_min_retention_s * USECS_PER_SEC,
								batch);
	PG_RETURN_INT64(deleted);
}
