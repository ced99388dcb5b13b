/*-------------------------------------------------------------------------
 *
 * outbox_launch.c
 *	  Which databases have messages to publish, and the launcher that
 *	  starts one publisher (outbox_publish.c) per such database.
 *
 * The worker that copies results (worker.c) has no database connection,
 * and a publisher must read and delete a database's outbox: so each
 * database with messages gets a dynamic background worker connected to
 * it, started by the launcher, a static background worker connected to no
 * database (as PostgreSQL's logical replication launcher is, which reads
 * pg_database the same way).
 *
 *	  - A committing backend whose transaction emitted flags its database
 *		(idem_outbox_notify, after the commit record: a spinlock, no
 *		allocation, no error, no wait) and sets the latch of the database's
 *		publisher if it sleeps (an awake one looks at the flag before it
 *		sleeps: idem_outbox_publisher_sleepy), or of the launcher when none
 *		runs.
 *	  - The launcher starts a publisher for every flagged database that has
 *		none; at its start (after a restart, a crash, a promotion: the
 *		flags live in shared memory) it flags every database that accepts
 *		connections and is not a template, once, so that what waited in
 *		any outbox goes out.
 *	  - A publisher clears its database's flag before each look at the
 *		outbox; when it finds the outbox empty and the flag still clear
 *		after IDEM_PUBLISHER_LINGER_MS, it leaves (idem_outbox_publisher_idle,
 *		under the spinlock, so that a commit flagging the database meanwhile
 *		either keeps it or wakes the launcher).  A publisher that leaves
 *		otherwise (an error, SIGTERM) leaves its database flagged: the
 *		launcher starts another after IDEM_PUBLISHER_RESTART_MS.
 *	  - A database that has too many others ahead of it in the slots
 *		(IDEM_OUTBOX_DBS) makes the launcher look at every database again.
 *
 * A publisher stays connected to its database only while messages wait
 * (and IDEM_PUBLISHER_LINGER_MS after): DROP DATABASE, which waits 5 s for
 * other sessions, then goes through.  While Valkey is down it stays.
 *
 * Locking: IdemOutboxShared.mutex, a spinlock, covers the slots and the
 * procnos; held for a few loads and stores only, never across a call.
 * The launcher's handles are its own (process-local).  Nothing here is a
 * pointer.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "catalog/pg_database.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "postmaster/bgworker.h"
#include "postmaster/interrupt.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "storage/proc.h"
#include "storage/shmem.h"
#include "storage/spin.h"
#include "tcop/tcopprot.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

#include "outbox_publish.h"

/* Databases that can be flagged at once; more make the launcher scan. */
#define IDEM_OUTBOX_DBS				64
#define IDEM_OUTBOX_NO_PROC			UINT32_MAX
#define IDEM_LAUNCHER_RESTART_S		2
#define IDEM_LAUNCHER_WAIT_MS		10000
#define IDEM_PUBLISHER_RESTART_MS	1000
#define IDEM_PUBLISHER_LINGER_MS	1000

typedef struct IdemOutboxDb
{
	Oid			dboid;			/* InvalidOid: a free slot */
	bool		wanted;			/* messages may wait: a publisher must look */
	bool		running;		/* a publisher is registered (launcher) and
								 * has not left */
	uint32		publisher_procno;	/* once it attached */
	bool		publisher_sleeping; /* waits for a commit to wake it */
	uint32		prepared;		/* bumped by each PREPARE TRANSACTION that
								 * emitted; 0: none since the publisher saw
								 * no prepared transaction left */
} IdemOutboxDb;

typedef struct IdemOutboxShared
{
	slock_t		mutex;
	uint32		launcher_procno;
	bool		scan_all;		/* a database found no free slot */
	IdemOutboxDb dbs[IDEM_OUTBOX_DBS];
} IdemOutboxShared;

static IdemOutboxShared *outbox_shared = NULL;

Size
idem_outbox_shmem_size(void)
{
	return MAXALIGN(sizeof(IdemOutboxShared));
}

/* Called from shmem.c's startup hook, with AddinShmemInitLock held. */
void
idem_outbox_shmem_init(void)
{
	bool		found;
	int			i;

	outbox_shared = ShmemInitStruct("idem outbox", sizeof(IdemOutboxShared),
									&found);
	if (found)
		return;
	SpinLockInit(&outbox_shared->mutex);
	outbox_shared->launcher_procno = IDEM_OUTBOX_NO_PROC;
	outbox_shared->scan_all = false;
	for (i = 0; i < IDEM_OUTBOX_DBS; i++)
	{
		outbox_shared->dbs[i].dboid = InvalidOid;
		outbox_shared->dbs[i].wanted = false;
		outbox_shared->dbs[i].running = false;
		outbox_shared->dbs[i].publisher_procno = IDEM_OUTBOX_NO_PROC;
		outbox_shared->dbs[i].publisher_sleeping = false;
		outbox_shared->dbs[i].prepared = 0;
	}
}

/* The slot of dboid, or a free one made its (NULL: none); mutex held. */
static IdemOutboxDb *
outbox_slot(Oid dboid, bool take)
{
	IdemOutboxDb *free_slot = NULL;
	int			i;

	for (i = 0; i < IDEM_OUTBOX_DBS; i++)
	{
		IdemOutboxDb *db = &outbox_shared->dbs[i];

		if (db->dboid == dboid)
			return db;
		if (free_slot == NULL && db->dboid == InvalidOid)
			free_slot = db;
	}
	if (!take || free_slot == NULL)
		return NULL;
	free_slot->dboid = dboid;
	free_slot->wanted = false;
	free_slot->running = false;
	free_slot->publisher_procno = IDEM_OUTBOX_NO_PROC;
	free_slot->publisher_sleeping = false;
	free_slot->prepared = 0;
	return free_slot;
}

/* Flag dboid under the mutex; the procno to wake. */
static uint32
outbox_flag(Oid dboid)
{
	IdemOutboxDb *db = outbox_slot(dboid, true);

	if (db == NULL)
	{
		outbox_shared->scan_all = true;
		return outbox_shared->launcher_procno;
	}
	db->wanted = true;
	/* an awake publisher looks again before it sleeps: no wakeup per commit */
	if (db->running && db->publisher_procno != IDEM_OUTBOX_NO_PROC)
		return db->publisher_sleeping ? db->publisher_procno : IDEM_OUTBOX_NO_PROC;
	return db->running ? IDEM_OUTBOX_NO_PROC : outbox_shared->launcher_procno;
}

/*
 * The commit path (idem_outbox_xact_event): messages of dboid committed.
 * A spinlock and a latch: no allocation, no error, no wait.
 */
void
idem_outbox_notify(Oid dboid)
{
	uint32		procno;

	if (outbox_shared == NULL)
		return;
	SpinLockAcquire(&outbox_shared->mutex);
	procno = outbox_flag(dboid);
	SpinLockRelease(&outbox_shared->mutex);
	if (procno != IDEM_OUTBOX_NO_PROC)
		SetLatch(&GetPGProcByNumber(procno)->procLatch);
}

/*
 * The prepare path: a transaction of dboid that emitted was prepared.  Its
 * COMMIT PREPARED, in any session or after a restart, wakes nobody: the
 * database's publisher is started and polls while prepared transactions
 * remain (idem_outbox_publisher_prepared).  As idem_outbox_notify: no
 * allocation, no error, no wait.
 */
void
idem_outbox_notify_prepared(Oid dboid)
{
	IdemOutboxDb *db;
	uint32		procno;

	if (outbox_shared == NULL)
		return;
	SpinLockAcquire(&outbox_shared->mutex);
	procno = outbox_flag(dboid);
	db = outbox_slot(dboid, false);
	if (db != NULL)
		db->prepared = db->prepared + 1 == 0 ? 1 : db->prepared + 1;
	SpinLockRelease(&outbox_shared->mutex);
	if (procno != IDEM_OUTBOX_NO_PROC)
		SetLatch(&GetPGProcByNumber(procno)->procLatch);
}

/* ---------- the publisher's side ---------- */

/*
 * Whether prepared transactions of the database may hold messages: the
 * generation to pass to idem_outbox_publisher_prepared_gone, or 0.
 * some (the publisher found prepared transactions itself, after a start)
 * marks it so.
 */
uint32
idem_outbox_publisher_prepared(Oid dboid, bool some)
{
	IdemOutboxDb *db;
	uint32		gen = 0;

	SpinLockAcquire(&outbox_shared->mutex);
	db = outbox_slot(dboid, false);
	if (db != NULL)
	{
		if (some && db->prepared == 0)
			db->prepared = 1;
		gen = db->prepared;
	}
	SpinLockRelease(&outbox_shared->mutex);
	return gen;
}

/* No prepared transaction was left once gen was read: stop polling. */
void
idem_outbox_publisher_prepared_gone(Oid dboid, uint32 gen)
{
	IdemOutboxDb *db;

	SpinLockAcquire(&outbox_shared->mutex);
	db = outbox_slot(dboid, false);
	if (db != NULL && db->prepared == gen)
		db->prepared = 0;
	SpinLockRelease(&outbox_shared->mutex);
}

/* The publisher of dboid starts; false if another one runs already. */
bool
idem_outbox_publisher_attach(Oid dboid)
{
	IdemOutboxDb *db;
	bool		ok = false;

	SpinLockAcquire(&outbox_shared->mutex);
	db = outbox_slot(dboid, true);
	if (db != NULL && db->publisher_procno == IDEM_OUTBOX_NO_PROC)
	{
		db->running = true;
		db->publisher_procno = IDEM_MY_PROCNO;
		db->wanted = false;
		ok = true;
	}
	SpinLockRelease(&outbox_shared->mutex);
	return ok;
}

/*
 * The publisher found the outbox empty and would sleep until a commit
 * wakes it: false if a commit flagged the database since its last look
 * (look again at once), else true, and commits wake it from now on, until
 * idem_outbox_publisher_awake.
 */
bool
idem_outbox_publisher_sleepy(Oid dboid)
{
	IdemOutboxDb *db;
	bool		sleep = true;

	SpinLockAcquire(&outbox_shared->mutex);
	db = outbox_slot(dboid, false);
	if (db != NULL)
	{
		if (db->wanted)
		{
			db->wanted = false;
			sleep = false;
		}
		else
			db->publisher_sleeping = true;
	}
	SpinLockRelease(&outbox_shared->mutex);
	return sleep;
}

void
idem_outbox_publisher_awake(Oid dboid)
{
	IdemOutboxDb *db;

	SpinLockAcquire(&outbox_shared->mutex);
	db = outbox_slot(dboid, false);
	if (db != NULL)
		db->publisher_sleeping = false;
	SpinLockRelease(&outbox_shared->mutex);
}

/*
 * The outbox was found empty after the flag was cleared.  If no commit
 * flagged the database since, the publisher leaves: true, and it is no
 * longer running.  Else the flag is cleared again for the next look.
 */
bool
idem_outbox_publisher_idle(Oid dboid)
{
	IdemOutboxDb *db;
	bool		leave = true;

	SpinLockAcquire(&outbox_shared->mutex);
	db = outbox_slot(dboid, false);
	if (db != NULL)
	{
		if (db->wanted)
		{
			db->wanted = false;
			leave = false;
		}
		else
		{
			db->running = false;
			db->publisher_procno = IDEM_OUTBOX_NO_PROC;
			db->dboid = InvalidOid;	/* free the slot */
		}
	}
	SpinLockRelease(&outbox_shared->mutex);
	return leave;
}

/* The publisher leaves (wanted: messages may still wait). */
void
idem_outbox_publisher_detach(Oid dboid, bool wanted)
{
	IdemOutboxDb *db;
	uint32		procno = IDEM_OUTBOX_NO_PROC;

	if (outbox_shared == NULL)
		return;
	SpinLockAcquire(&outbox_shared->mutex);
	db = outbox_slot(dboid, false);
	if (db != NULL && db->publisher_procno == IDEM_MY_PROCNO)
	{
		db->running = false;
		db->publisher_procno = IDEM_OUTBOX_NO_PROC;
		if (wanted)
		{
			db->wanted = true;
			procno = outbox_shared->launcher_procno;
		}
	}
	SpinLockRelease(&outbox_shared->mutex);
	if (procno != IDEM_OUTBOX_NO_PROC)
		SetLatch(&GetPGProcByNumber(procno)->procLatch);
}

/* ---------- the launcher ---------- */

void
idem_outbox_launcher_register(void)
{
	BackgroundWorker worker;

	memset(&worker, 0, sizeof(worker));
	worker.bgw_flags = BGWORKER_SHMEM_ACCESS |
		BGWORKER_BACKEND_DATABASE_CONNECTION;
	/* a standby publishes nothing: its outbox is the primary's */
	worker.bgw_start_time = BgWorkerStart_RecoveryFinished;
	worker.bgw_restart_time = IDEM_LAUNCHER_RESTART_S;
	strlcpy(worker.bgw_library_name, "idem", BGW_MAXLEN);
	strlcpy(worker.bgw_function_name, "idem_outbox_launcher_main", BGW_MAXLEN);
	strlcpy(worker.bgw_name, "idem outbox launcher", BGW_MAXLEN);
	strlcpy(worker.bgw_type, "idem outbox launcher", BGW_MAXLEN);
	RegisterBackgroundWorker(&worker);
}

/* The launcher's handles of the publishers it started, by slot. */
static BackgroundWorkerHandle *launcher_handles[IDEM_OUTBOX_DBS];
static TimestampTz launcher_retry_at[IDEM_OUTBOX_DBS];

/*
 * The databases a publisher can connect to: accepting connections, not a
 * template (pg_database read with a heap scan, as PostgreSQL's logical
 * replication launcher reads it: this process has no database).
 */
static List *
launcher_databases(void)
{
	Relation	rel;
	TableScanDesc scan;
	HeapTuple	tup;
	List	   *oids = NIL;
	MemoryContext cxt = CurrentMemoryContext;

	StartTransactionCommand();
	PushActiveSnapshot(GetTransactionSnapshot());
	rel = table_open(DatabaseRelationId, AccessShareLock);
	scan = table_beginscan_catalog(rel, 0, NULL);
	while ((tup = heap_getnext(scan, ForwardScanDirection)) != NULL)
	{
		Form_pg_database db = (Form_pg_database) GETSTRUCT(tup);

		if (db->datallowconn && !db->datistemplate)
		{
			MemoryContext old = MemoryContextSwitchTo(cxt);

			oids = lappend_oid(oids, db->oid);
			MemoryContextSwitchTo(old);
		}
	}
	table_endscan(scan);
	table_close(rel, AccessShareLock);
	PopActiveSnapshot();
	CommitTransactionCommand();
	MemoryContextSwitchTo(cxt);
	return oids;
}

/* Flag every database (after a start, or when the slots overflowed). */
static void
launcher_scan_databases(void)
{
	List	   *oids = launcher_databases();
	ListCell   *lc;

	SpinLockAcquire(&outbox_shared->mutex);
	outbox_shared->scan_all = false;
	foreach(lc, oids)
		(void) outbox_flag(lfirst_oid(lc));
	SpinLockRelease(&outbox_shared->mutex);
	list_free(oids);
}

/* Whether a publisher can connect to database dboid. */
static bool
launcher_database_exists(Oid dboid)
{
	List	   *oids = launcher_databases();
	bool		exists = list_member_oid(oids, dboid);

	list_free(oids);
	return exists;
}

static void
launcher_start_publisher(int i, Oid dboid)
{
	BackgroundWorker worker;

	memset(&worker, 0, sizeof(worker));
	worker.bgw_flags = BGWORKER_SHMEM_ACCESS |
		BGWORKER_BACKEND_DATABASE_CONNECTION;
	worker.bgw_start_time = BgWorkerStart_RecoveryFinished;
	worker.bgw_restart_time = BGW_NEVER_RESTART;
	strlcpy(worker.bgw_library_name, "idem", BGW_MAXLEN);
	strlcpy(worker.bgw_function_name, "idem_outbox_publisher_main", BGW_MAXLEN);
	snprintf(worker.bgw_name, BGW_MAXLEN, "idem outbox publisher %u", dboid);
	strlcpy(worker.bgw_type, "idem outbox publisher", BGW_MAXLEN);
	worker.bgw_main_arg = ObjectIdGetDatum(dboid);
	worker.bgw_notify_pid = MyProcPid;
	if (launcher_handles[i] != NULL)
		pfree(launcher_handles[i]);
	launcher_handles[i] = NULL;
	if (!RegisterDynamicBackgroundWorker(&worker, &launcher_handles[i]))
	{
		/* no free background worker slot: try again later */
		launcher_retry_at[i] = TimestampTzPlusMilliseconds(GetCurrentTimestamp(),
														   IDEM_PUBLISHER_RESTART_MS);
		return;
	}
	SpinLockAcquire(&outbox_shared->mutex);
	if (outbox_shared->dbs[i].dboid == dboid)
		outbox_shared->dbs[i].running = true;
	SpinLockRelease(&outbox_shared->mutex);
}

/* One look at every slot: start what is wanted, forget what stopped. */
static void
launcher_pass(void)
{
	int			i;
	TimestampTz now = GetCurrentTimestamp();

	for (i = 0; i < IDEM_OUTBOX_DBS; i++)
	{
		IdemOutboxDb copy;
		pid_t		pid;

		SpinLockAcquire(&outbox_shared->mutex);
		copy = outbox_shared->dbs[i];
		SpinLockRelease(&outbox_shared->mutex);
		if (copy.dboid == InvalidOid)
			continue;

		/* a publisher that stopped without leaving (it never started) */
		if (copy.running && launcher_handles[i] != NULL &&
			GetBackgroundWorkerPid(launcher_handles[i], &pid) == BGWH_STOPPED)
		{
			pfree(launcher_handles[i]);
			launcher_handles[i] = NULL;
			SpinLockAcquire(&outbox_shared->mutex);
			if (outbox_shared->dbs[i].dboid == copy.dboid &&
				outbox_shared->dbs[i].publisher_procno == IDEM_OUTBOX_NO_PROC)
				outbox_shared->dbs[i].running = false;
			copy = outbox_shared->dbs[i];
			SpinLockRelease(&outbox_shared->mutex);
			launcher_retry_at[i] = TimestampTzPlusMilliseconds(now,
															   IDEM_PUBLISHER_RESTART_MS);
		}
		if (!copy.wanted || copy.running || now < launcher_retry_at[i])
			continue;
		if (!launcher_database_exists(copy.dboid))
		{
			SpinLockAcquire(&outbox_shared->mutex);
			if (outbox_shared->dbs[i].dboid == copy.dboid &&
				!outbox_shared->dbs[i].running)
				outbox_shared->dbs[i].dboid = InvalidOid;
			SpinLockRelease(&outbox_shared->mutex);
			continue;
		}
		launcher_start_publisher(i, copy.dboid);
		/* a publisher that left with messages waiting: not at once again */
		launcher_retry_at[i] = TimestampTzPlusMilliseconds(now,
														   IDEM_PUBLISHER_RESTART_MS);
	}
}

static void
launcher_on_exit(int code, Datum arg)
{
	SpinLockAcquire(&outbox_shared->mutex);
	if (outbox_shared->launcher_procno == IDEM_MY_PROCNO)
		outbox_shared->launcher_procno = IDEM_OUTBOX_NO_PROC;
	SpinLockRelease(&outbox_shared->mutex);
}

void
idem_outbox_launcher_main(Datum main_arg)
{
	pqsignal(SIGHUP, SignalHandlerForConfigReload);
	pqsignal(SIGTERM, SignalHandlerForShutdownRequest);
	BackgroundWorkerUnblockSignals();
	if (outbox_shared == NULL)
		proc_exit(0);
	/* no database: pg_database only, as the logical replication launcher */
	BackgroundWorkerInitializeConnection(NULL, NULL, 0);

	before_shmem_exit(launcher_on_exit, (Datum) 0);
	SpinLockAcquire(&outbox_shared->mutex);
	outbox_shared->launcher_procno = IDEM_MY_PROCNO;
	SpinLockRelease(&outbox_shared->mutex);

	/* after a start, every database's outbox is looked at once */
	launcher_scan_databases();

	while (!ShutdownRequestPending)
	{
		bool		scan_all;
		long		wait_ms = IDEM_LAUNCHER_WAIT_MS;
		int			i;
		TimestampTz now;

		CHECK_FOR_INTERRUPTS();
		if (ConfigReloadPending)
		{
			ConfigReloadPending = false;
			ProcessConfigFile(PGC_SIGHUP);
		}
		SpinLockAcquire(&outbox_shared->mutex);
		scan_all = outbox_shared->scan_all;
		SpinLockRelease(&outbox_shared->mutex);
		if (scan_all)
			launcher_scan_databases();
		launcher_pass();

		/* wake for the next retry due, if any */
		now = GetCurrentTimestamp();
		for (i = 0; i < IDEM_OUTBOX_DBS; i++)
		{
			bool		pending;

			SpinLockAcquire(&outbox_shared->mutex);
			pending = outbox_shared->dbs[i].dboid != InvalidOid &&
				(outbox_shared->dbs[i].running || outbox_shared->dbs[i].wanted);
			SpinLockRelease(&outbox_shared->mutex);
			if (pending && launcher_retry_at[i] > now)
				wait_ms = Min(wait_ms,
							  TimestampDifferenceMilliseconds(now, launcher_retry_at[i]) + 1);
			else if (pending)
				wait_ms = Min(wait_ms, IDEM_PUBLISHER_RESTART_MS);
		}
		(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
						 wait_ms, PG_WAIT_EXTENSION);
		ResetLatch(MyLatch);
	}
	proc_exit(0);
}
