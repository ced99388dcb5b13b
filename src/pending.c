/*-------------------------------------------------------------------------
 *
 * pending.c
 *	  The claims the running transaction holds: those whose ledger row is
 *	  not written yet, and those taken over.
 *
 *	  A claim of a new key holds the key lock and records the claim here;
 *	  idem_complete / idem_fail then write the row once, with its final
 *	  status.  A claim still open when the transaction commits (lease mode:
 *	  the effect happens outside PostgreSQL) is written at pre-commit as a
 *	  processing row, so it is durable exactly when the transaction is.
 *
 *	  A claim that takes a key over (ledger_reclaim: a retry, or a lease
 *	  that ran out) writes its row at once; it is recorded here too, marked
 *	  taken, so that this table is the one list of the claims a transaction
 *	  holds: idem_emit asks it which run a message belongs to
 *	  (pending_held, or pending_holds for the tenant form), at the emit, so
 *	  that a claim costs the outbox nothing.
 *	  pending_find and the write at commit pass taken claims by.
 *
 *	  Claims follow their subtransaction: a rolled-back savepoint forgets
 *	  the claims made inside it (and PostgreSQL releases their key locks
 *	  with it); a released one hands them to its parent.  A claim whose row
 *	  was written is only marked settled, at the level that wrote it, so
 *	  that rolling back that write (ROLLBACK TO) makes it open again.
 *
 *	  Claims follow their subtransaction by xact.c's rule
 *	  (idem_subxact_follow), applied to both levels of a claim.  The events
 *	  arrive from xact.c, which owns the transaction callbacks.
 *
 *	  The table is backend-local, in TopTransactionContext.  It must not
 *	  change while pending_flush walks it (a dynahash scan is undefined
 *	  when entries are added or others removed): the rows it writes fire
 *	  the ledger's triggers, and a user trigger may call idem.  Claims,
 *	  completions and failures of open claims are refused meanwhile
 *	  (pending_check_change), before the commit record.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xact.h"
#include "commands/trigger.h"
#include "utils/builtins.h"
#include "utils/hsearch.h"
#include "utils/jsonb.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"

#include "pending.h"
#include "cache_format.h"
#include "ledger_row.h"
#include "ledger_store.h"
#include "subxact.h"

/* This transaction's open claims; NULL when there are none. */
static HTAB *pending = NULL;

/* pending_flush is walking the table (and firing the ledger's triggers). */
static bool pending_walking = false;

/*
 * The ledger (kind, tenant) of the table's first claim, and whether any
 * claim since was of another: while not, a key names at most one claim,
 * found by one lookup (pending_held).
 */
static LedgerKind pending_kind;
static int64 pending_tenant;
static bool pending_mixed = false;

static void
pending_reset(void)
{
	/* The table lives in TopTransactionContext, which goes with the xact. */
	pending = NULL;
	pending_walking = false;
}

/*
 * Refuse a change to the table while pending_flush walks it: a trigger on
 * the ledger (or a deferred trigger its rows queued) that claims a key or
 * settles an open claim at commit.  Still before the commit record: the
 * transaction aborts.
 */
void
pending_check_change(const char *what)
{
	if (pending_walking)
		ereport(ERROR,
				(errcode(ERRCODE_TRIGGERED_ACTION_EXCEPTION),
				 errmsg("cannot %s an idempotency key while idem writes this transaction's open claims at commit", what),
				 errdetail("A trigger fired by the processing rows idem writes at commit (lease mode) called idem."),
				 errhint("Do not claim, complete or fail keys in triggers on the ledger; do it in the transaction before COMMIT.")));
}

/* The table's key of a claim: padding zeroed (the hash reads all bytes). */
static void
pending_hash_key(LedgerKey *k, LedgerKind kind, int64 tenant_id, const uint8 *key)
{
	memset(k, 0, sizeof(*k));
	k->kind = kind;
	k->tenant_id = tenant_id;
	memcpy(k->key, key, IDEM_DIGEST_LEN);
}

/* The entry of lk, if any (settled or not, taken or not). */
static PendingClaim *
pending_lookup(const LedgerKey *lk)
{
	LedgerKey	k;

	if (pending == NULL)
		return NULL;
	pending_hash_key(&k, lk->kind, lk->tenant_id, lk->key);
	return (PendingClaim *) hash_search(pending, &k, HASH_FIND, NULL);
}

/* The open (not yet written) claim of this key by this transaction. */
PendingClaim *
pending_find(const LedgerKey *lk)
{
	PendingClaim *claim = pending_lookup(lk);

	return (claim && claim->settled_level == 0 && !claim->taken) ? claim : NULL;
}

/* The entry of lk, made if missing. */
static PendingClaim *
pending_enter(const LedgerKey *lk)
{
	LedgerKey	k;

	pending_check_change("claim");
	if (pending == NULL)
	{
		HASHCTL		ctl;

		ctl.keysize = sizeof(LedgerKey);
		ctl.entrysize = sizeof(PendingClaim);
		ctl.hcxt = TopTransactionContext;
		pending = hash_create("idem pending claims", 16, &ctl,
							  HASH_ELEM | HASH_BLOBS | HASH_CONTEXT);
		pending_kind = lk->kind;
		pending_tenant = lk->tenant_id;
		pending_mixed = false;
	}
	else if (lk->kind != pending_kind || lk->tenant_id != pending_tenant)
		pending_mixed = true;
	pending_hash_key(&k, lk->kind, lk->tenant_id, lk->key);
	return (PendingClaim *) hash_search(pending, &k, HASH_ENTER, NULL);
}

void
pending_add(const LedgerKey *lk, const uint8 *fingerprint,
			TimestampTz lease_end, bool lease_given, Oid relid)
{
	PendingClaim *claim = pending_enter(lk);

	/* found: settled before, and its row since deleted (idem_purge in this
	 * transaction): the key is new again */
	memcpy(claim->fingerprint, fingerprint, IDEM_DIGEST_LEN);
	claim->lease_end = lease_end;
	claim->lease_given = lease_given;
	claim->fence = 0;
	claim->relid = relid;
	claim->nest_level = GetCurrentTransactionNestLevel();
	claim->settled_level = 0;
	claim->taken = false;
}

/*
 * A claim that took lk over (its processing row written by ledger_reclaim):
 * held until completed or failed (pending_settle_taken).
 */
void
pending_add_taken(const LedgerKey *lk, Oid relid)
{
	PendingClaim *claim = pending_enter(lk);

	memset(claim->fingerprint, 0, IDEM_DIGEST_LEN);
	claim->lease_end = 0;
	claim->lease_given = true;
	claim->fence = 0;
	claim->relid = relid;
	claim->nest_level = GetCurrentTransactionNestLevel();
	claim->settled_level = 0;
	claim->taken = true;
}

/*
 * The claim's row was written by the current subtransaction.  Written by
 * the top level, no rollback short of the transaction's can open it again:
 * forget it, so that a transaction's memory does not grow with every key
 * it completes.  The caller must not use the claim afterwards.
 */
void
pending_settle(PendingClaim *claim)
{
	int			level = GetCurrentTransactionNestLevel();

	pending_check_change("settle");
	if (level <= 1)
		hash_search(pending, &claim->lk, HASH_REMOVE, NULL);
	else
		claim->settled_level = level;
}

/*
 * A key completed or failed through its row (ledger_finish): if this
 * transaction took it over, it holds it no more.  Not refused while
 * pending_flush walks the table (a trigger may settle such a key, as
 * before taken claims were recorded here): marked settled then, not
 * removed, which the walk allows.
 */
void
pending_settle_taken(const LedgerKey *lk)
{
	PendingClaim *claim = pending_lookup(lk);
	int			level = GetCurrentTransactionNestLevel();

	if (claim == NULL || !claim->taken || claim->settled_level != 0)
		return;
	if (level <= 1 && !pending_walking)
		hash_search(pending, &claim->lk, HASH_REMOVE, NULL);
	else
		claim->settled_level = level;
}

/*
 * The claims this transaction holds (not completed or failed) of key, or
 * of any key when key is NULL: how many, and one of them in *found.  One
 * lookup while every claim is of one ledger (and tenant); a walk of the
 * table otherwise, or for key NULL with more than one claim.
 */
int
pending_held(const uint8 *key, LedgerKey *found)
{
	HASH_SEQ_STATUS seq;
	PendingClaim *claim;
	int			n = 0;

	if (pending == NULL)
		return 0;
	if (key != NULL && !pending_mixed)
	{
		LedgerKey	k;

		pending_hash_key(&k, pending_kind, pending_tenant, key);
		claim = (PendingClaim *) hash_search(pending, &k, HASH_FIND, NULL);
		if (claim == NULL || claim->settled_level != 0)
			return 0;
		*found = claim->lk;
		return 1;
	}
	hash_seq_init(&seq, pending);
	while ((claim = (PendingClaim *) hash_seq_search(&seq)) != NULL)
	{
		if (claim->settled_level != 0 ||
			(key != NULL && memcmp(claim->lk.key, key, IDEM_DIGEST_LEN) != 0))
			continue;
		*found = claim->lk;
		n++;
	}
	return n;
}

/*
 * Whether this transaction holds the claim lk (not completed or failed):
 * one lookup, for the tenant form of idem_emit, which names the claim.
 */
bool
pending_holds(const LedgerKey *lk)
{
	PendingClaim *claim = pending_lookup(lk);

	return claim != NULL && claim->settled_level == 0;
}

/* Write every open claim as a processing row (lease mode). */
static void
pending_flush(void)
{
	HASH_SEQ_STATUS seq;
	PendingClaim *claim;
	Datum		empty;
	int			by_accident = 0;

	if (pending == NULL || hash_get_num_entries(pending) == 0)
		return;
	empty = DirectFunctionCall1(jsonb_in, CStringGetDatum("{}"));
	/* Pre-commit runs after the last statement: SPI needs a snapshot. */
	PushActiveSnapshot(GetTransactionSnapshot());
	pending_walking = true;
	hash_seq_init(&seq, pending);
	while ((claim = (PendingClaim *) hash_seq_search(&seq)) != NULL)
	{
		if (claim->settled_level != 0 || claim->taken)
			continue;
		ledger_insert(ledger_store_for(claim->lk.kind, claim->relid), &claim->lk,
					  claim->fence, claim->fingerprint, IDEM_STATUS_PROCESSING,
					  1, empty, claim->lease_end);
		if (!claim->lease_given)
			by_accident++;
	}

	/*
	 * Outside a transaction block, the statement's own transaction commits
	 * the claim alone: lease mode, although nothing asked for it (no lease
	 * given).  Most likely a handler that forgot BEGIN and runs its effect
	 * in the next statements, after the claim committed.
	 */
	if (by_accident > 0 && !IsTransactionBlock())
		ereport(WARNING,
				(errmsg_plural("%d idempotency key claimed outside a transaction block was committed in lease mode",
							   "%d idempotency keys claimed outside a transaction block were committed in lease mode",
							   by_accident, by_accident),
				 errdetail("The claim committed alone, as a processing row with the default lease (idem.lease); the effect will not commit with it."),
				 errhint("Claim, run the effect and complete in one transaction (BEGIN ... COMMIT); for lease mode on purpose, pass the lease explicitly.")));

	/*
	 * Pre-commit comes after the transaction's deferred triggers fired:
	 * fire the ones these rows queued (a DEFERRABLE INITIALLY DEFERRED
	 * foreign key to tenants, a deferred constraint trigger), or they
	 * would be dropped unchecked and commit, say, an orphan row.
	 */
	AfterTriggerFireDeferred();
	PopActiveSnapshot();
	pending_reset();
}

/* A transaction event, from xact.c. */
void
idem_pending_xact_event(XactEvent event)
{
	switch (event)
	{
		case XACT_EVENT_PRE_COMMIT:
		case XACT_EVENT_PRE_PREPARE:
			/* Still inside the transaction: a failure here aborts it. */
			pending_flush();
			break;
		case XACT_EVENT_COMMIT:
		case XACT_EVENT_ABORT:
		case XACT_EVENT_PREPARE:
		case XACT_EVENT_PARALLEL_COMMIT:
		case XACT_EVENT_PARALLEL_ABORT:
			pending_reset();
			break;
		default:
			break;
	}
}

/* The subtransaction at level ended (committed or aborted), from xact.c. */
void
idem_pending_subxact_end(bool committed, int level)
{
	HASH_SEQ_STATUS seq;
	PendingClaim *claim;

	if (pending == NULL)
		return;
	hash_seq_init(&seq, pending);
	while ((claim = (PendingClaim *) hash_seq_search(&seq)) != NULL)
	{
		if (!idem_subxact_follow(&claim->nest_level, committed, level))
			hash_search(pending, &claim->lk, HASH_REMOVE, NULL);
		else if (!idem_subxact_follow(&claim->settled_level, committed, level))
			claim->settled_level = 0;	/* its row was rolled back */
	}
}
