/*-------------------------------------------------------------------------
 *
 * standby_slots.c
 *	  Which servers hold a commit: what the worker waits for before it
 *	  copies a result to Valkey, and what a replay waits for before it is
 *	  answered from another transaction's row.
 *
 * The copy (idem_standby_slots_flushed) waits for every standby that can
 * be promoted, so that a failover cannot lose a result the cache holds:
 *
 *	- the synchronous standbys, whenever synchronous_standby_names is set:
 *	  their flush position as syncrep.c keeps it (WalSndCtl->lsn, under
 *	  SyncRepLock).  A COMMIT whose wait for synchronous replication was
 *	  cancelled is committed locally but may be missing on the synchronous
 *	  standby that a failover promotes;
 *	- the standbys of idem.standby_slots (in the spirit of PostgreSQL 17's
 *	  synchronized_standby_slots): by default '*', every physical
 *	  replication slot that has a flush position; or the named physical
 *	  slots; or none ('').
 *
 * A physical slot's restart_lsn is the flush position its standby last
 * reported.  A named slot that is missing, logical, invalidated or not yet
 * used holds every copy back (the copies wait in the queue, and are dropped
 * and counted once it is full): the worker never guesses that a standby has
 * what it did not report.  The reason is given to the caller for
 * idem_stats() and the log.  With '*', a slot without a flush position
 * (never used, or invalidated) is not waited for: no standby follows it.
 *
 * A replay (idem_replay_durable) read from another transaction's row may
 * be an asynchronous commit not flushed yet, or a commit whose wait for
 * synchronous replication was cancelled: before it is answered, WAL is
 * made as durable as the asking session's synchronous_commit makes its own
 * commits, as if the replay had committed a write.
 *
 * Locking: ReplicationSlotControlLock shared, and each slot's spinlock
 * while its fields are read, as slot.c's readers do; SyncRepLock shared for
 * the synchronous standbys' position.  The parsed list is process-local,
 * re-parsed when the setting changes.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/transam.h"
#include "access/xact.h"
#include "access/xlog.h"
#include "miscadmin.h"
#include "replication/slot.h"
#include "replication/syncrep.h"
#include "replication/walsender_private.h"
#include "storage/lwlock.h"
#include "storage/spin.h"
#include "utils/builtins.h"
#include "utils/memutils.h"
#include "utils/varlena.h"

#include "standby_slots.h"
#include "compat.h"
#include "guc.h"
#include "commit_copies.h"

static char *parsed_from = NULL;	/* the setting the list was parsed from */
static List *slot_names = NIL;		/* of char *, in TopMemoryContext */
static bool all_slots = false;		/* '*': every physical slot in use */

static void
parse_setting(void)
{
	const char *cur = idem_standby_slots ? idem_standby_slots : "";
	MemoryContext old;
	char	   *raw;
	List	   *names = NIL;
	ListCell   *lc;

	if (parsed_from != NULL && strcmp(parsed_from, cur) == 0)
		return;
	list_free_deep(slot_names);
	slot_names = NIL;
	if (parsed_from)
		pfree(parsed_from);

	old = MemoryContextSwitchTo(TopMemoryContext);
	parsed_from = pstrdup(cur);
	all_slots = strcmp(cur, IDEM_ALL_STANDBY_SLOTS) == 0;
	if (all_slots)
	{
		MemoryContextSwitchTo(old);
		return;
	}
	raw = pstrdup(cur);
	/* The check hook (guc.c) has accepted it. */
	(void) SplitIdentifierString(raw, ',', &names);
	foreach(lc, names)
		slot_names = lappend(slot_names, pstrdup((char *) lfirst(lc)));
	list_free(names);
	pfree(raw);
	MemoryContextSwitchTo(old);
}

/*
 * Whether synchronous standbys are configured, as the walsenders and the
 * committing backends see it, and how far they have confirmed WAL in mode
 * (SYNC_REP_WAIT_WRITE or SYNC_REP_WAIT_FLUSH).  Read under SyncRepLock, as
 * SyncRepWaitForLSN reads it; before the checkpointer has first processed
 * synchronous_standby_names, this process's own value of it decides, as
 * there.
 */
static bool
sync_standbys_confirmed(int mode, XLogRecPtr *lsn)
{
	bool		defined;

	LWLockAcquire(SyncRepLock, LW_SHARED);
	if (IDEM_SYNC_STANDBYS_KNOWN(WalSndCtl))
		defined = IDEM_SYNC_STANDBYS_DEFINED(WalSndCtl);
	else
		defined = SyncRepStandbyNames != NULL && SyncRepStandbyNames[0] != '\0';
	*lsn = WalSndCtl->lsn[mode];
	LWLockRelease(SyncRepLock);
	return defined;
}

/* Lower *lsn to what every physical slot with a flush position reported. */
static void
all_slots_flushed(XLogRecPtr *lsn)
{
	int			i;

	LWLockAcquire(ReplicationSlotControlLock, LW_SHARED);
	for (i = 0; i < max_replication_slots; i++)
	{
		ReplicationSlot *s = &ReplicationSlotCtl->replication_slots[i];
		bool		physical;
		bool		invalidated;
		XLogRecPtr	flushed;

		if (!s->in_use)
			continue;
		SpinLockAcquire(&s->mutex);
		physical = SlotIsPhysical(s);
		invalidated = IDEM_SLOT_INVALIDATED(s);
		flushed = s->data.restart_lsn;
		SpinLockRelease(&s->mutex);
		if (physical && !invalidated && !XLogRecPtrIsInvalid(flushed) &&
			flushed < *lsn)
			*lsn = flushed;
	}
	LWLockRelease(ReplicationSlotControlLock);
}

/*
 * Lower *lsn to the least flush position the synchronous standbys and the
 * standbys of idem.standby_slots reported.  Returns false, with the reason
 * in why (whylen bytes), when a named slot cannot be used; *lsn is then
 * InvalidXLogRecPtr (nothing is durable).
 */
bool
idem_standby_slots_flushed(XLogRecPtr *lsn, char *why, size_t whylen)
{
	ListCell   *lc;
	XLogRecPtr	sync_flushed;

	if (sync_standbys_confirmed(SYNC_REP_WAIT_FLUSH, &sync_flushed) &&
		sync_flushed < *lsn)
		*lsn = sync_flushed;

	parse_setting();
	if (all_slots)
	{
		if (ReplicationSlotCtl != NULL)
			all_slots_flushed(lsn);
		return true;
	}
	if (slot_names == NIL)
		return true;
	if (ReplicationSlotCtl == NULL)
	{
		snprintf(why, whylen, "idem.standby_slots is set but max_replication_slots is 0");
		*lsn = InvalidXLogRecPtr;
		return false;
	}

	LWLockAcquire(ReplicationSlotControlLock, LW_SHARED);
	foreach(lc, slot_names)
	{
		const char *name = (const char *) lfirst(lc);
		const char *problem = "does not exist";
		XLogRecPtr	flushed = InvalidXLogRecPtr;
		int			i;

		for (i = 0; i < max_replication_slots; i++)
		{
			ReplicationSlot *s = &ReplicationSlotCtl->replication_slots[i];
			bool		physical;
			bool		invalidated;

			if (!s->in_use || strcmp(NameStr(s->data.name), name) != 0)
				continue;
			SpinLockAcquire(&s->mutex);
			physical = SlotIsPhysical(s);
			invalidated = IDEM_SLOT_INVALIDATED(s);
			flushed = s->data.restart_lsn;
			SpinLockRelease(&s->mutex);
			if (!physical)
				problem = "is a logical slot";
			else if (invalidated || XLogRecPtrIsInvalid(flushed))
				problem = "has no flush position (not used yet, or invalidated)";
			else
				problem = NULL;
			break;
		}
		if (problem != NULL)
		{
			LWLockRelease(ReplicationSlotControlLock);
			snprintf(why, whylen, "replication slot \"%s\" named in idem.standby_slots %s",
					 name, problem);
			*lsn = InvalidXLogRecPtr;
			return false;
		}
		if (flushed < *lsn)
			*lsn = flushed;
	}
	LWLockRelease(ReplicationSlotControlLock);
	return true;
}

/* idem_replay_durable is in SyncRepWaitForLSN: see replay_wait_log_hook. */
static bool replay_waiting = false;
static emit_log_hook_type prev_emit_log_hook = NULL;

/*
 * Drop the warnings SyncRepWaitForLSN gives when a replay's wait is
 * cancelled or the backend terminated ("... has already committed
 * locally"): a replay committed nothing.
 */
static void
replay_wait_log_hook(ErrorData *edata)
{
	if (replay_waiting && edata->elevel == WARNING &&
		edata->funcname != NULL &&
		strcmp(edata->funcname, "SyncRepWaitForLSN") == 0)
	{
		edata->output_to_client = false;
		edata->output_to_server = false;
	}
	if (prev_emit_log_hook)
		prev_emit_log_hook(edata);
}

/* From _PG_init: the log hook of idem_replay_durable's wait. */
void
idem_standby_slots_register(void)
{
	prev_emit_log_hook = emit_log_hook;
	emit_log_hook = replay_wait_log_hook;
}

/*
 * Copies wait and WAL is durable only up to durable (as
 * idem_standby_slots_flushed() computed it): say what holds it there, in
 * what (whatlen bytes), for the log and idem_stats().  The physical slot
 * whose standby reported no further, the synchronous standbys, or this
 * server's own flush; read again now, so it may have moved meanwhile.
 */
void
idem_standby_slots_holder(XLogRecPtr durable, char *what, size_t whatlen)
{
	XLogRecPtr	sync_flushed;
	int			i;

	snprintf(what, whatlen,
			 "WAL is flushed only up to %X/%X here (asynchronous commits wait for the WAL writer), or a committing backend has not written its copy yet",
			 LSN_FORMAT_ARGS(durable));
	if (GetFlushRecPtr(NULL) <= durable)
		return;
	if (sync_standbys_confirmed(SYNC_REP_WAIT_FLUSH, &sync_flushed) &&
		sync_flushed <= durable)
	{
		snprintf(what, whatlen,
				 "the synchronous standbys have confirmed WAL only up to %X/%X",
				 LSN_FORMAT_ARGS(sync_flushed));
		return;
	}
	if (ReplicationSlotCtl == NULL)
		return;
	LWLockAcquire(ReplicationSlotControlLock, LW_SHARED);
	for (i = 0; i < max_replication_slots; i++)
	{
		ReplicationSlot *s = &ReplicationSlotCtl->replication_slots[i];
		XLogRecPtr	flushed;
		pid_t		pid;
		bool		physical;

		if (!s->in_use)
			continue;
		SpinLockAcquire(&s->mutex);
		physical = SlotIsPhysical(s);
		flushed = s->data.restart_lsn;
		pid = s->active_pid;
		SpinLockRelease(&s->mutex);
		if (!physical || XLogRecPtrIsInvalid(flushed) || flushed > durable)
			continue;
		snprintf(what, whatlen,
				 "the standby of replication slot \"%s\" has flushed WAL only up to %X/%X%s",
				 NameStr(s->data.name), LSN_FORMAT_ARGS(flushed),
				 pid == 0 ? " (no standby is connected to it)" : "");
		break;
	}
	LWLockRelease(ReplicationSlotControlLock);
}

/*
 * Where the commit of writer ends if it may not be flushed yet, else
 * InvalidXLogRecPtr.  A synchronous commit is flushed before it becomes
 * visible; the clog keeps the LSN of asynchronous ones (the greatest of a
 * group of transactions, for as long as the clog page is in memory: WAL is
 * flushed that far before the page is written out), as SetHintBits reads
 * it before it trusts another transaction's commit.
 */
XLogRecPtr
idem_commit_lsn(TransactionId writer)
{
	if (!TransactionIdIsNormal(writer))
		return InvalidXLogRecPtr;
	return TransactionIdGetCommitLSN(writer);
}

/*
 * Before a replay read from another transaction's row is answered: make
 * that commit as durable as this session's synchronous_commit makes its
 * own commits, as if answering had committed a write.  The row's commit
 * may be asynchronous and not flushed yet (commit_lsn, from
 * idem_commit_lsn(): an immediate stop or a crash would lose it after the
 * caller acknowledged the message), or committed locally while its wait
 * for synchronous replication was cancelled (a failover would lose it).
 * The commit record of the latter is not known, only that it is older
 * than the WAL inserted so far: with synchronous replication, that is
 * what the synchronous standbys must confirm.  Each wait returns at once
 * when its position is already reached.
 *
 * The wait is SyncRepWaitForLSN's, made for a commit: cancelled, it warns
 * that "the transaction has already committed locally", which is not true
 * of a replay (nothing committed).  While idem waits there, its log hook
 * (replay_wait_log_hook) drops that warning; the replay's own error says
 * what happened.
 */
void
idem_replay_durable(XLogRecPtr commit_lsn)
{
	XLogRecPtr	lsn;
	XLogRecPtr	confirmed;
	int			mode;

	if (synchronous_commit <= SYNCHRONOUS_COMMIT_OFF || RecoveryInProgress())
		return;
	if (!XLogRecPtrIsInvalid(commit_lsn))
		XLogFlush(commit_lsn);

	if (!SyncRepRequested())
		return;
	mode = synchronous_commit == SYNCHRONOUS_COMMIT_REMOTE_WRITE ?
		SYNC_REP_WAIT_WRITE : SYNC_REP_WAIT_FLUSH;
	lsn = idem_insert_end_lsn();
	if (!sync_standbys_confirmed(mode, &confirmed) || confirmed >= lsn)
		return;
	/* the standbys are sent only what is flushed here */
	XLogFlush(lsn);
	HOLD_INTERRUPTS();
	replay_waiting = true;
	PG_TRY();
	{
		SyncRepWaitForLSN(lsn, false);
	}
	PG_FINALLY();
	{
		replay_waiting = false;
	}
	PG_END_TRY();
	RESUME_INTERRUPTS();
	/* terminated while waiting: go now, answering nothing */
	CHECK_FOR_INTERRUPTS();

	/* A cancelled wait returns with a WARNING: do not answer then either. */
	if (sync_standbys_confirmed(mode, &confirmed) && confirmed < lsn)
		ereport(ERROR,
				(errcode(ERRCODE_QUERY_CANCELED),
				 errmsg("canceling the idem replay while it waited for synchronous replication"),
				 errdetail("The result was read from a transaction that the synchronous standbys have not confirmed yet."),
				 errhint("Retry: the key is answered once its result is replicated.")));
}
