/*-------------------------------------------------------------------------
 *
 * cache_secret.c
 *	  The secret that authenticates every value idem writes to Valkey and
 *	  the history epoch that names its keyspace: their file, their copy in
 *	  shared memory, rotation, the epoch's renewal and takeover, and the
 *	  HMAC over the secret.
 *
 * Each secret is 32 random bytes (pg_strong_random) with a key id (1, 2,
 * ...).  Values carry the key id and HMAC-SHA-256(secret, <key> 0x00 <rest>)
 * (cache_format.h); readers accept the current secret and the one before
 * it, so a rotation needs no downtime.
 *
 * The file $PGDATA/idem_cache_secret (mode 0600) holds a line "timeline
 * <N>" (the timeline its secrets were made on; absent if made during
 * recovery, by a standby that had no file), a line "epoch <16 hex>" (the
 * history epoch, below), perhaps a line "token <16 hex>" (the last start
 * that took the epoch over), perhaps a line "stop <system identifier> <16
 * hex>" (the last clean stop, below), up to IDEM_EPOCH_DEAD_MAX lines
 * "retire <timeline> <16 hex>" (the dead epochs, below, newest first), then
 * at most two lines "<key id> <secret as 64 hex>", the previous secret
 * first, the current one last.
 * It is created the first time a process needs it (the worker at its start,
 * so a primary has it before any base backup is taken, and pg_basebackup
 * copies it to standbys), written to a temporary file, synced and renamed
 * into place, so a crash leaves the old or the new file, never a torn one
 * (and perhaps the temporary file, removed at the first load after the
 * restart).
 *
 * A new timeline gets new secrets.  A rotation is not WAL-logged, so a
 * standby keeps the secrets it was made with, which its primary may have
 * rotated out since (after a leak).  When a server that is not in recovery
 * finds its secrets made on an older timeline (it was promoted, or restored
 * to a point in time), it replaces them with one new secret, the next key
 * id, and no previous one: nothing is written on the new timeline yet (the
 * keyspace names it), so no value needs the old secrets, and none made
 * elsewhere is accepted.  Secrets made during recovery are replaced too:
 * nothing was MACed with them (nothing is copied and there is no keyspace
 * during recovery), and pg_basebackup may have copied them from the
 * standby that made them to another, and that standby, promoted first,
 * rotated them out since.  Every reader of the shared copy checks the
 * timeline, so the first one after the promotion (the worker, or a runner
 * asking for the secrets) makes the change.  Without preloading nothing is
 * copied, but runners still read Valkey with these secrets, so each reader
 * of the file makes the change itself, without a lock: two at once may
 * each install a secret, the last rename wins, and a runner that learnt
 * the other one only has its markers ignored by the others (PostgreSQL
 * decides) until it learns again.
 *
 * The history epoch.  A database can go back in time or fork without a
 * new timeline: a base backup or a snapshot started as it is, a copy of
 * the data directory, two servers started from one backup.  Each copy has
 * this file, so the secret and the keyspace alone would let it read what
 * another history wrote: a result its own database does not hold, and a
 * lost effect.  So the keyspace also names an epoch, a random 64-bit
 * number made with a new secret (next key id, no previous one), and a
 * server replaces both (a new epoch) whenever its history may differ from
 * what Valkey saw:
 *	  - after a start that ran recovery: pg_control not cleanly shut down
 *		(a crash, a snapshot or copy of a running server), or a
 *		backup_label, recovery.signal or standby.signal file (read when
 *		shared memory is made, before the startup process runs);
 *	  - after a start whose pg_control says shut down, but not at the last
 *		clean stop: the postmaster records the system identifier and the
 *		shutdown checkpoint in this file as it exits (secret_record_stop),
 *		and a start compares them with pg_control (pg_resetwal after a
 *		crash marks pg_control shut down although the database went back);
 *	  - on a new timeline (a promotion, a point-in-time restore);
 *	  - when the worker finds in Valkey that another start took the epoch
 *		over since this data directory last did (below): a copy of a
 *		stopped server, started here or there;
 *	  - when a transaction removed ledger rows outside idem_purge, logical
 *		replication wrote a ledger, or idem_renew_epoch() was called
 *		(ledger_guard.c); the copies queued before it are never written
 *		into the new epoch, and the commit waits until the old one is
 *		retired (epoch_renewal.c).
 * A clean restart of the same server keeps its epoch, its secret and so its
 * warm cache.
 *
 * The takeover.  Before the worker copies anything after a start, it sets
 * the epoch owner key (cache_format.h) to a new random token with SET ...
 * GET, and keeps the epoch only if the value it replaced is the token this
 * file recorded (or none, for an epoch no start took yet); it then records
 * the new token here.  Two copies of one data directory hold the same
 * token, and only the first start of either finds it in Valkey: the other
 * finds the first one's token and makes a new epoch.  A Valkey that lost
 * the key makes a new epoch too (a cold cache, never a wrong answer).
 * Until the takeover succeeded, idem_cache_keyspace() refuses to name a
 * keyspace, so no runner reads Valkey for a history not yet confirmed.
 *
 * Retiring.  Runners that learnt an epoch before it was replaced may still
 * hold it (behind a pooler that keeps their connection), so they check, in
 * the round trip of every lookup, that the epoch owner key still holds the
 * token idem_cache_secrets() told them.  When a new epoch replaces one
 * because this server's history may have diverged (a start that ran
 * recovery or did not match the last clean stop, a new timeline, ledger
 * rows removed), the file adds the old epoch to its dead epochs ("retire"),
 * also one never taken over here (a copy of this file may have), and the
 * worker overwrites their owner keys with a retired marker (cache_format.h)
 * before it takes the new epoch over: every runner still on them stops
 * trusting them at its next lookup.  The marker is written whatever the key
 * held: a restored backup or a promoted standby holds the token of the
 * start it was copied from, which may have restarted since.  An epoch
 * replaced because another start took it over is not retired (it is not
 * ours).  The worker checks the dead epochs again at each owner check: a
 * Valkey restored from an older snapshot brings them back
 * (worker_dead_keep_retired).
 *
 * The epoch list.  This file names the epoch of the moment it was copied;
 * the original may have made newer ones since (a crash, a DELETE).  So
 * every takeover also lists its epoch in Valkey (the last
 * IDEM_EPOCH_DEAD_MAX, <prefix><system identifier>:epochs), and the first
 * takeover after a start that cannot show it continues Valkey's history
 * (a new epoch) retires every listed epoch and adds it to the dead ones;
 * so does any takeover, and a standby's worker, for a listed epoch taken
 * over on a branch of history its timeline left (an old primary after a
 * failover, then rewound by pg_rewind, which overwrites this file).  A
 * running server's renewal retires only its own epoch, so a server whose
 * epoch a copy took over does not retire the copy's in turn
 * (worker_take_epoch, worker_check_list).
 * A worker whose owner key holds something else than its token (checked
 * every IDEM_OWNER_CHECK_MS and after each connect: a copy of this server
 * retired it or took it over) makes a new epoch: of two servers from one
 * backup, neither answers for the other's history, and each gets a cold
 * cache at worst.  A key Valkey lost is set again (worker_check_owner()).
 *
 * The secret is never shared by two servers: it is made at random here,
 * kept in this file and in shared memory only (never in a table, so
 * pg_dump does not copy it), and a copy of the file that base backups take
 * is replaced by the first of the rules above that the copy meets.
 *
 * Shared memory (when idem is preloaded) holds a copy, loaded from the file
 * on first use.  Locking: the LWLock of the "idem cache secret" tranche
 * protects the copy and the file.  Readers take it shared; whoever finds the
 * copy not loaded yet, and idem_rotate_cache_secret(), take it exclusive,
 * and only they read or write the file.  Without preloading there is no
 * shared copy: idem_cache_secrets() reads the file each time (creating it
 * without overwriting one another process made first), and rotation is
 * refused.
 *
 * idem_cache_secrets() (cache_sql.c) hands the secrets to roles granted
 * EXECUTE on it (the client's handler role); PUBLIC may not execute it.
 * The secrets never appear in the log.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "access/htup_details.h"
#include "access/xlog.h"
#include "catalog/pg_control.h"
#include "common/controldata_utils.h"
#include "common/cryptohash.h"
#include "miscadmin.h"
#include "storage/fd.h"
#include "storage/ipc.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "utils/builtins.h"

#include "cache_secret.h"
#include "cache_format.h"
#include "compat.h"
#include "epoch_renewal.h"
#include "sha256.h"

#define IDEM_SECRET_FILE		"idem_cache_secret"
/*
 * The longest file: the timeline, epoch, token and stop lines, the retire
 * lines, two secrets.
 */
#define SECRET_FILE_MAX	(21 + 2 * (6 + 16 + 1) + (5 + 20 + 1 + 16 + 1) + \
						 IDEM_EPOCH_DEAD_MAX * (7 + 10 + 1 + 16 + 1) + \
						 2 * (11 + 2 * IDEM_MAC_LEN + 1))

typedef struct IdemSecretShared
{
	bool		loaded;			/* secrets holds the file's content */
	/* a new epoch is due at the next load outside recovery, and why */
	IdemEpochReason renew;		/* 0: none */
	bool		confirmed;		/* the worker took secrets.epoch over */
	bool		taken_since_start;	/* it took an epoch over since the start */
	bool		tokens_out;		/* runners may hold a token of one of its
								 * epochs: one was taken over since the
								 * start, or the file named a token */
	IdemCacheSecrets secrets;
} IdemSecretShared;

static IdemSecretShared *secret_shared = NULL;
static LWLock *secret_lock = NULL;

static bool secret_read_file(IdemCacheSecrets *out);
static void secret_install(const IdemCacheSecrets *s);

/*
 * In the postmaster: pg_control's checkpoint when this server first made
 * shared memory (InvalidXLogRecPtr: it never did), for secret_record_stop.
 */
static XLogRecPtr secret_start_checkpoint = InvalidXLogRecPtr;

/*
 * Does the secret file record the clean stop pg_control describes?  True
 * if there is no file yet (no epoch to keep).  Asked by the postmaster, so
 * a file it cannot read counts as a no (the worker reports it later).
 */
static bool
secret_stop_recorded(const ControlFileData *control)
{
	IdemCacheSecrets s;
	volatile bool recorded = false;
	MemoryContext cxt = CurrentMemoryContext;

	PG_TRY();
	{
		recorded = !secret_read_file(&s) ||
			(s.stop_sysid == control->system_identifier &&
			 s.stop_checkpoint == control->checkPoint);
	}
	PG_CATCH();
	{
		MemoryContextSwitchTo(cxt);
		FlushErrorState();
	}
	PG_END_TRY();
	explicit_bzero(&s, sizeof(s));
	return recorded;
}

/*
 * Why this start needs a new epoch, if it does (0 if not).  Asked when
 * shared memory is made (by the postmaster, at its start and after a crash
 * of a backend), before the startup process runs, so pg_control still says
 * how the server last stopped.  Anything but a clean shutdown of a server
 * that was not in recovery, or a file that asks for recovery, is a start
 * that runs recovery.  A clean shutdown that is not the last one
 * secret_record_stop() recorded (pg_resetwal marks pg_control shut down
 * after a crash) cannot be trusted either.
 */
static IdemEpochReason
secret_start_renews(void)
{
	ControlFileData *control;
	bool		crc_ok;
	IdemEpochReason why = 0;
	struct stat st;

	control = get_controlfile(DataDir, &crc_ok);
	if (XLogRecPtrIsInvalid(secret_start_checkpoint))
		secret_start_checkpoint = crc_ok ? control->checkPoint : 1;
	if (!crc_ok || control->state != DB_SHUTDOWNED ||
		stat(BACKUP_LABEL_FILE, &st) == 0 ||
		stat(RECOVERY_SIGNAL_FILE, &st) == 0 ||
		stat(STANDBY_SIGNAL_FILE, &st) == 0)
		why = IDEM_EPOCH_RECOVERED_START;
	else if (!secret_stop_recorded(control))
		why = IDEM_EPOCH_UNRECORDED_STOP;
	pfree(control);
	return why;
}

/*
 * At the postmaster's exit (on_proc_exit, registered by _PG_init): if the
 * server was shut down cleanly, record in the secret file the system
 * identifier and the shutdown checkpoint pg_control names, which the next
 * start compares (secret_start_renews).  Only a shutdown checkpoint this
 * server wrote counts: a start that failed before (the port in use, a bad
 * setting) must not bless what it found, say a pg_control pg_resetwal
 * marked shut down.  Every child has exited, so nothing else writes the
 * file.  Never raises an ERROR: a failure is logged and the next start
 * makes a new epoch.
 */
static void
secret_record_stop(int code, Datum arg)
{
	MemoryContext cxt = CurrentMemoryContext;

	PG_TRY();
	{
		ControlFileData *control;
		bool		crc_ok;
		IdemCacheSecrets s;

		control = get_controlfile(DataDir, &crc_ok);
		if (crc_ok && control->state == DB_SHUTDOWNED &&
			!XLogRecPtrIsInvalid(secret_start_checkpoint) &&
			control->checkPoint != secret_start_checkpoint &&
			secret_read_file(&s))
		{
			s.stop_sysid = control->system_identifier;
			s.stop_checkpoint = control->checkPoint;
			secret_install(&s);
		}
		explicit_bzero(&s, sizeof(s));
		pfree(control);
	}
	PG_CATCH();
	{
		MemoryContextSwitchTo(cxt);
		EmitErrorReport();
		FlushErrorState();
	}
	PG_END_TRY();
}

/* From _PG_init in the postmaster: record each clean stop at its exit. */
void
idem_cache_secret_register_stop(void)
{
	on_proc_exit(secret_record_stop, (Datum) 0);
}

Size
idem_cache_secret_shmem_size(void)
{
	return MAXALIGN(sizeof(IdemSecretShared));
}

/* From shmem.c's startup hook, with AddinShmemInitLock held. */
void
idem_cache_secret_shmem_init(void)
{
	bool		found;

	secret_shared = ShmemInitStruct("idem cache secret",
									sizeof(IdemSecretShared), &found);
	if (!found)
	{
		memset(secret_shared, 0, sizeof(IdemSecretShared));
		secret_shared->renew = secret_start_renews();
	}
	secret_lock = &(GetNamedLWLockTranche(IDEM_CACHE_SECRET_TRANCHE))->lock;
}

/* 16 lower-case hex digits and a newline at p, as a number. */
static bool
secret_parse_hex64(const char *p, uint64 *out)
{
	uint8		bytes[8];
	int			i;

	if (strlen(p) < 17 || p[16] != '\n' || idem_cache_unhex(bytes, p, 8) != 0)
		return false;
	*out = 0;
	for (i = 0; i < 8; i++)
		*out = (*out << 8) | bytes[i];
	return true;
}

/*
 * Parse the file's content into *out.  Returns false, with the reason in
 * *why, for anything but an optional timeline line, then one or two
 * well-formed lines with increasing ids.
 */
static bool
secret_parse(const char *text, IdemCacheSecrets *out, const char **why)
{
	const char *p = text;
	int			nlines = 0;
	int32		ids[2] = {0, 0};
	uint8		keys[2][IDEM_MAC_LEN];
	TimeLineID	timeline = 0;
	uint64		epoch = 0;
	uint64		token = 0;
	uint64		stop_sysid = 0;
	uint64		stop_checkpoint = 0;
	int			ndead = 0;
	IdemEpochName dead[IDEM_EPOCH_DEAD_MAX];

	if (strncmp(p, "timeline ", 9) == 0)
	{
		char	   *end;
		unsigned long tli;

		errno = 0;
		tli = strtoul(p + 9, &end, 10);
		if (errno != 0 || end == p + 9 || p[9] < '1' || p[9] > '9' ||
			tli > PG_UINT32_MAX || *end != '\n')
		{
			*why = "the timeline is not a number between 1 and 4294967295";
			return false;
		}
		timeline = (TimeLineID) tli;
		p = end + 1;
	}
	if (strncmp(p, "epoch ", 6) == 0)
	{
		if (!secret_parse_hex64(p + 6, &epoch) || epoch == 0)
		{
			*why = "the epoch is not 16 lower-case hex digits (not all zero) ending a line";
			return false;
		}
		p += 6 + 16 + 1;
	}
	if (strncmp(p, "token ", 6) == 0)
	{
		if (!secret_parse_hex64(p + 6, &token) || token == 0)
		{
			*why = "the token is not 16 lower-case hex digits (not all zero) ending a line";
			return false;
		}
		p += 6 + 16 + 1;
	}
	if (strncmp(p, "stop ", 5) == 0)
	{
		char	   *end;

		errno = 0;
		stop_sysid = strtou64(p + 5, &end, 10);
		if (errno != 0 || end == p + 5 || p[5] < '0' || p[5] > '9' ||
			*end != ' ' || !secret_parse_hex64(end + 1, &stop_checkpoint))
		{
			*why = "the stop line is not a system identifier and 16 lower-case hex digits";
			return false;
		}
		p = end + 1 + 16 + 1;
	}
	while (strncmp(p, "retire ", 7) == 0)
	{
		char	   *end;
		unsigned long tli;

		errno = 0;
		tli = strtoul(p + 7, &end, 10);
		if (ndead == IDEM_EPOCH_DEAD_MAX)
		{
			*why = "too many retire lines";
			return false;
		}
		if (errno != 0 || end == p + 7 || p[7] < '1' || p[7] > '9' ||
			tli > PG_UINT32_MAX || *end != ' ' ||
			!secret_parse_hex64(end + 1, &dead[ndead].epoch) ||
			dead[ndead].epoch == 0)
		{
			*why = "a retire line is not a timeline and 16 lower-case hex digits";
			return false;
		}
		dead[ndead++].timeline = (TimeLineID) tli;
		p = end + 1 + 16 + 1;
	}
	while (*p != '\0')
	{
		char	   *end;
		long		id;

		if (nlines == 2)
		{
			*why = "more than two lines";
			return false;
		}
		errno = 0;
		id = strtol(p, &end, 10);
		if (errno != 0 || end == p || *p < '1' || *p > '9' ||
			id > PG_INT32_MAX || *end != ' ')
		{
			*why = "a key id is not a number between 1 and 2147483647";
			return false;
		}
		p = end + 1;
		if (strlen(p) < 2 * IDEM_MAC_LEN + 1 || p[2 * IDEM_MAC_LEN] != '\n' ||
			idem_cache_unhex(keys[nlines], p, IDEM_MAC_LEN) != 0)
		{
			*why = "a secret is not 64 lower-case hex digits ending a line";
			return false;
		}
		ids[nlines++] = (int32) id;
		p += 2 * IDEM_MAC_LEN + 1;
	}
	if (nlines == 0 || (nlines == 2 && ids[0] >= ids[1]))
	{
		*why = nlines == 0 ? "it is empty" : "the key ids do not increase";
		return false;
	}
	memset(out, 0, sizeof(*out));
	out->timeline = timeline;
	out->epoch = epoch;
	out->token = token;
	out->stop_sysid = stop_sysid;
	out->stop_checkpoint = (XLogRecPtr) stop_checkpoint;
	out->ndead = ndead;
	memcpy(out->dead, dead, ndead * sizeof(IdemEpochName));
	out->current_id = ids[nlines - 1];
	memcpy(out->current, keys[nlines - 1], IDEM_MAC_LEN);
	if (nlines == 2)
	{
		out->previous_id = ids[0];
		memcpy(out->previous, keys[0], IDEM_MAC_LEN);
	}
	return true;
}

/* Read the file; false if it does not exist.  Errors for anything else. */
static bool
secret_read_file(IdemCacheSecrets *out)
{
	char		text[SECRET_FILE_MAX + 1];
	int			fd;
	int			n;
	int			total = 0;
	const char *why;

	fd = OpenTransientFile(IDEM_SECRET_FILE, O_RDONLY | PG_BINARY);
	if (fd < 0)
	{
		if (errno == ENOENT)
			return false;
		ereport(ERROR,
				(errcode_for_file_access(),
				 errmsg("could not open file \"%s\": %m", IDEM_SECRET_FILE)));
	}
	while ((n = read(fd, text + total, sizeof(text) - 1 - total)) > 0)
		total += n;
	if (n < 0)
		ereport(ERROR,
				(errcode_for_file_access(),
				 errmsg("could not read file \"%s\": %m", IDEM_SECRET_FILE)));
	CloseTransientFile(fd);
	text[total] = '\0';
	if (!secret_parse(text, out, &why))
		ereport(ERROR,
				(errcode(ERRCODE_DATA_CORRUPTED),
				 errmsg("file \"%s\" is malformed: %s", IDEM_SECRET_FILE, why),
				 errhint("Remove the file to have idem generate a new secret; values in Valkey written with the old one are then ignored.")));
	return true;
}

/*
 * Write secrets to a new temporary file, synced.  Its name is returned in
 * tmp (MAXPGPATH bytes).
 */
static void
secret_write_tmp(const IdemCacheSecrets *s, char *tmp)
{
	char		text[SECRET_FILE_MAX + 1];
	char		hex[2 * IDEM_MAC_LEN + 1];
	int			len = 0;
	int			fd;

	if (s->timeline > 0)
		len += snprintf(text + len, sizeof(text) - len, "timeline %u\n",
						s->timeline);
	if (s->epoch != 0)
		len += snprintf(text + len, sizeof(text) - len, "epoch %016llx\n",
						(unsigned long long) s->epoch);
	if (s->token != 0)
		len += snprintf(text + len, sizeof(text) - len, "token %016llx\n",
						(unsigned long long) s->token);
	if (s->stop_sysid != 0)
		len += snprintf(text + len, sizeof(text) - len, "stop " UINT64_FORMAT " %016llx\n",
						s->stop_sysid,
						(unsigned long long) s->stop_checkpoint);
	for (int i = 0; i < s->ndead; i++)
		len += snprintf(text + len, sizeof(text) - len, "retire %u %016llx\n",
						s->dead[i].timeline,
						(unsigned long long) s->dead[i].epoch);
	if (s->previous_id > 0)
	{
		idem_cache_hex(hex, s->previous, IDEM_MAC_LEN);
		hex[2 * IDEM_MAC_LEN] = '\0';
		len += snprintf(text + len, sizeof(text) - len, "%d %s\n",
						s->previous_id, hex);
	}
	idem_cache_hex(hex, s->current, IDEM_MAC_LEN);
	hex[2 * IDEM_MAC_LEN] = '\0';
	len += snprintf(text + len, sizeof(text) - len, "%d %s\n",
					s->current_id, hex);

	snprintf(tmp, MAXPGPATH, "%s.%d.tmp", IDEM_SECRET_FILE, MyProcPid);
	fd = OpenTransientFilePerm(tmp, O_WRONLY | O_CREAT | O_TRUNC | PG_BINARY,
							   S_IRUSR | S_IWUSR);
	if (fd < 0)
		ereport(ERROR,
				(errcode_for_file_access(),
				 errmsg("could not create file \"%s\": %m", tmp)));
	errno = 0;
	if (write(fd, text, len) != len)
	{
		if (errno == 0)
			errno = ENOSPC;
		ereport(ERROR,
				(errcode_for_file_access(),
				 errmsg("could not write file \"%s\": %m", tmp)));
	}
	if (pg_fsync(fd) != 0)
		ereport(data_sync_elevel(ERROR),
				(errcode_for_file_access(),
				 errmsg("could not fsync file \"%s\": %m", tmp)));
	if (CloseTransientFile(fd) != 0)
		ereport(ERROR,
				(errcode_for_file_access(),
				 errmsg("could not close file \"%s\": %m", tmp)));
}

static void
secret_generate(uint8 *secret)
{
	if (!pg_strong_random(secret, IDEM_MAC_LEN))
		ereport(ERROR,
				(errcode(ERRCODE_INTERNAL_ERROR),
				 errmsg("could not generate a random cache secret")));
}

/* Replace the file with secrets s: a new file, synced, renamed into place. */
static void
secret_install(const IdemCacheSecrets *s)
{
	char		tmp[MAXPGPATH];

	secret_write_tmp(s, tmp);
	if (durable_rename(tmp, IDEM_SECRET_FILE, ERROR) != 0)
		elog(ERROR, "durable_rename returned without an error");
}

/* The timeline new secrets are made on: 0 (unknown) during recovery. */
static TimeLineID
secret_timeline(void)
{
	return RecoveryInProgress() ? 0 : GetWALInsertionTimeLine();
}

/* A random epoch or token: 64 bits, never 0 (0 means none). */
static uint64
secret_random64(void)
{
	uint64		v = 0;

	while (v == 0)
		if (!pg_strong_random(&v, sizeof(v)))
			ereport(ERROR,
					(errcode(ERRCODE_INTERNAL_ERROR),
					 errmsg("could not generate a random history epoch")));
	return v;
}

/*
 * Add epoch *e to the dead epochs of *s, newest first, unless it is there
 * already; the oldest is forgotten past IDEM_EPOCH_DEAD_MAX.  True if it
 * was added.
 */
static bool
secret_dead_add(IdemCacheSecrets *s, const IdemEpochName *e)
{
	for (int i = 0; i < s->ndead; i++)
		if (s->dead[i].epoch == e->epoch && s->dead[i].timeline == e->timeline)
			return false;
	if (s->ndead == IDEM_EPOCH_DEAD_MAX)
		s->ndead--;
	memmove(&s->dead[1], &s->dead[0], s->ndead * sizeof(IdemEpochName));
	s->dead[0] = *e;
	s->ndead++;
	return true;
}

/*
 * Why the secrets *s must make way for a new epoch now (see the file
 * header), as a log detail; NULL if they need not.  Never during recovery:
 * nothing is copied or read then, and the promotion that ends it brings a
 * new timeline.  renew is the shared copy's pending reason (0 if none).
 */
static const char *
secret_renew_why(const IdemCacheSecrets *s, IdemEpochReason renew)
{
	TimeLineID	now = secret_timeline();

	if (now == 0)
		return NULL;
	if (s->timeline < now)
		return s->timeline != 0 ?
			"The secrets were made on an older timeline: this server was promoted, or restored to a point in time." :
			"The secrets were made during recovery, by a standby.";
	switch (renew)
	{
		case IDEM_EPOCH_RECOVERED_START:
			return "The server started with recovery (after a crash, from a base backup or a snapshot, or with archive recovery): its history may differ from what Valkey holds.";
		case IDEM_EPOCH_TAKEN_ELSEWHERE:
			return "Another server started with a copy of this data directory took the epoch over in Valkey, or Valkey lost its owner key.";
		case IDEM_EPOCH_LEDGER_ROWS_REMOVED:
			return "A transaction removed ledger rows outside idem_purge() (DELETE, UPDATE, MERGE, INSERT ... ON CONFLICT DO UPDATE, TRUNCATE, or a ledger dropped or replaced).";
		case IDEM_EPOCH_LEDGER_ROWS_REPLICATED:
			return "Logical replication applied a transaction that wrote a ledger: it may have removed or changed rows whose results Valkey holds.";
		case IDEM_EPOCH_RENEW_REQUESTED:
			return "idem_renew_epoch() was called.";
		case IDEM_EPOCH_UNRECORDED_STOP:
			return "pg_control says the server was shut down cleanly, but not at the last clean stop idem recorded (pg_resetwal, or a data directory put together by hand): its history may differ from what Valkey holds.";
	}
	if (s->epoch == 0)
		return "The file was made by an older idem, without an epoch.";
	return NULL;
}

/*
 * Replace the secrets *s (from the file) by a new epoch if they must make
 * way for one (secret_renew_why), rewriting the file.  The caller holds the
 * shared copy's lock exclusive (or there is no shared copy); renew is the
 * shared copy's pending reason.  True if it did.
 */
static bool
secret_fit(IdemCacheSecrets *s, IdemEpochReason renew)
{
	const char *why = secret_renew_why(s, renew);
	IdemCacheSecrets next;

	if (why == NULL)
		return false;
	memset(&next, 0, sizeof(next));
	next.timeline = secret_timeline();
	next.epoch = secret_random64();
	next.current_id = s->current_id == PG_INT32_MAX ? 1 : s->current_id + 1;
	next.stop_sysid = s->stop_sysid;
	next.stop_checkpoint = s->stop_checkpoint;
	next.ndead = s->ndead;
	memcpy(next.dead, s->dead, sizeof(next.dead));
	/* the removals it follows: read after their renewal (epoch_renewal.c) */
	next.generation = idem_renewal_generation();

	/*
	 * Retire the epoch being replaced if it is ours to retire (see the file
	 * header): not one another start took over.  One this data directory
	 * never took over is retired too: a copy of it may have (a backup taken
	 * while Valkey was out of reach, restored to a point in time).
	 */
	if (s->epoch != 0 && s->timeline != 0 &&
		renew != IDEM_EPOCH_TAKEN_ELSEWHERE)
	{
		IdemEpochName old = {s->timeline, s->epoch};

		secret_dead_add(&next, &old);
	}
	secret_generate(next.current);
	secret_install(&next);
	ereport(LOG,
			(errmsg("new history epoch %016llx (key id %d) on timeline %u",
					(unsigned long long) next.epoch, next.current_id,
					next.timeline),
			 errdetail_internal("%s Values in Valkey written before are never read again; they expire.",
								why)));
	*s = next;
	explicit_bzero(&next, sizeof(next));
	return true;
}

/*
 * The secrets in the file, creating it (key id 1) if there is none.  When
 * two processes create it at once, link() lets exactly one file win and
 * both return its content.
 */
static void
secret_load_or_create(IdemCacheSecrets *out)
{
	IdemCacheSecrets fresh;
	char		tmp[MAXPGPATH];

	if (secret_read_file(out))
		return;

	memset(&fresh, 0, sizeof(fresh));
	fresh.current_id = 1;
	fresh.timeline = secret_timeline();
	fresh.epoch = secret_random64();
	secret_generate(fresh.current);
	secret_write_tmp(&fresh, tmp);
	if (link(tmp, IDEM_SECRET_FILE) != 0 && errno != EEXIST)
		ereport(ERROR,
				(errcode_for_file_access(),
				 errmsg("could not link file \"%s\" to \"%s\": %m",
						tmp, IDEM_SECRET_FILE)));
	if (unlink(tmp) != 0)
		ereport(WARNING,
				(errcode_for_file_access(),
				 errmsg("could not remove file \"%s\": %m", tmp)));
	fsync_fname(".", true);
	if (!secret_read_file(out))
		ereport(ERROR,
				(errcode_for_file_access(),
				 errmsg("could not open file \"%s\": %m", IDEM_SECRET_FILE)));
	explicit_bzero(&fresh, sizeof(fresh));
}

/*
 * Load the file into the shared copy, the first time since the server
 * started.  The caller holds the lock exclusive, and every writer of the
 * file holds it too, so a temporary file left now was left by a process
 * that died before renaming it (its secret was never used): remove it,
 * rather than leave a secret lying in the data directory for every base
 * backup to copy.
 */
static void
secret_shared_load(void)
{
	DIR		   *dir;
	struct dirent *de;
	size_t		prefix = strlen(IDEM_SECRET_FILE ".");

	if (secret_shared->loaded)
		return;
	dir = AllocateDir(".");
	while ((de = ReadDir(dir, ".")) != NULL)
	{
		size_t		len = strlen(de->d_name);

		if (len > prefix + 4 &&
			strncmp(de->d_name, IDEM_SECRET_FILE ".", prefix) == 0 &&
			strcmp(de->d_name + len - 4, ".tmp") == 0 &&
			strspn(de->d_name + prefix, "0123456789") == len - prefix - 4 &&
			unlink(de->d_name) != 0 && errno != ENOENT)
			ereport(WARNING,
					(errcode_for_file_access(),
					 errmsg("could not remove file \"%s\": %m", de->d_name)));
	}
	FreeDir(dir);
	secret_load_or_create(&secret_shared->secrets);
	secret_shared->loaded = true;
	if (secret_shared->secrets.token != 0)
		secret_shared->tokens_out = true;
}

/*
 * Bring the shared copy up to date (secret_fit) with its pending reason,
 * which a new epoch settles (during recovery the reason waits for its
 * end); a new epoch waits for the worker's takeover.
 * The caller holds the lock exclusive, the copy loaded.
 */
static void
secret_shared_fit(void)
{
	if (secret_fit(&secret_shared->secrets, secret_shared->renew))
	{
		secret_shared->confirmed = false;
		secret_shared->renew = 0;
	}
}

/*
 * The current and previous secrets.  Loads the file into shared memory on
 * first use.  May raise an ERROR (file trouble), never with the lock held
 * after it returns.
 */
void
idem_cache_secrets_get(IdemCacheSecrets *out)
{
	if (secret_shared == NULL)
	{
		/* no lock: see the file header */
		secret_load_or_create(out);
		secret_fit(out, 0);
		return;
	}

	LWLockAcquire(secret_lock, LW_SHARED);
	if (!secret_shared->loaded ||
		secret_renew_why(&secret_shared->secrets, secret_shared->renew) != NULL)
	{
		LWLockRelease(secret_lock);
		LWLockAcquire(secret_lock, LW_EXCLUSIVE);
		/* An ERROR here releases the lock in the abort path. */
		secret_shared_load();
		secret_shared_fit();
	}
	*out = secret_shared->secrets;
	LWLockRelease(secret_lock);
}

/*
 * The epoch runners may use now: true, with *epoch, once the worker took it
 * over since the start (and no renewal is pending); false without
 * preloading (there is no worker to do that).
 */
bool
idem_cache_epoch_confirmed(uint64 *epoch)
{
	bool		ok;

	if (secret_shared == NULL)
		return false;
	LWLockAcquire(secret_lock, LW_SHARED);
	ok = secret_shared->loaded && secret_shared->confirmed &&
		secret_shared->renew == 0;
	*epoch = secret_shared->secrets.epoch;
	LWLockRelease(secret_lock);
	return ok;
}

/*
 * The worker, before it copies anything: is there an epoch to take over
 * (see the file header)?  If so, fills *t (a new token included) and
 * returns true.  The current secrets are brought up to date first.
 */
bool
idem_cache_epoch_takeover(IdemEpochTakeover *t)
{
	IdemCacheSecrets s;
	bool		pending;

	Assert(secret_shared != NULL);
	idem_cache_secrets_get(&s);
	explicit_bzero(s.current, sizeof(s.current));
	explicit_bzero(s.previous, sizeof(s.previous));
	LWLockAcquire(secret_lock, LW_SHARED);
	pending = !secret_shared->confirmed &&
		secret_shared->secrets.epoch == s.epoch;
	LWLockRelease(secret_lock);
	if (!pending || RecoveryInProgress())
		return false;
	t->epoch = s.epoch;
	t->timeline = s.timeline;
	t->expect_token = s.token;
	t->new_token = secret_random64();
	t->ndead = s.ndead;
	memcpy(t->dead, s.dead, sizeof(t->dead));
	LWLockAcquire(secret_lock, LW_SHARED);
	t->first = !secret_shared->taken_since_start;
	LWLockRelease(secret_lock);
	return true;
}

/*
 * The epoch runners use now, and the token this server holds its owner key
 * with: true, with *t filled (new_token is the token; no retire), once the
 * worker took it over; false otherwise.  The worker checks its owner key
 * with it; idem_cache_secrets() tells runners.
 */
bool
idem_cache_epoch_owned(IdemEpochTakeover *t)
{
	bool		ok;

	memset(t, 0, sizeof(*t));
	if (secret_shared == NULL)
		return false;
	LWLockAcquire(secret_lock, LW_SHARED);
	ok = secret_shared->loaded && secret_shared->confirmed &&
		secret_shared->renew == 0 && secret_shared->secrets.token != 0;
	if (ok)
	{
		t->epoch = secret_shared->secrets.epoch;
		t->timeline = secret_shared->secrets.timeline;
		t->new_token = secret_shared->secrets.token;
		t->generation = secret_shared->secrets.generation;
	}
	LWLockRelease(secret_lock);
	return ok;
}

/*
 * The worker found the token it expected under the epoch owner key and
 * replaced it with t->new_token: record that token and let runners use the
 * epoch.  Nothing happens if the epoch changed meanwhile.
 */
void
idem_cache_epoch_taken(const IdemEpochTakeover *t)
{
	IdemCacheSecrets next;

	LWLockAcquire(secret_lock, LW_EXCLUSIVE);
	if (secret_shared->secrets.epoch == t->epoch && secret_shared->renew == 0)
	{
		next = secret_shared->secrets;
		next.token = t->new_token;
		/* An ERROR here releases the lock in the abort path. */
		secret_install(&next);
		secret_shared->secrets = next;
		secret_shared->confirmed = true;
		secret_shared->taken_since_start = true;
		secret_shared->tokens_out = true;
		explicit_bzero(&next, sizeof(next));
	}
	LWLockRelease(secret_lock);
}

/*
 * Epoch epoch must make way for a new one (reason).  Runners are refused a
 * keyspace from now on, until the worker took the next epoch over; the new
 * secrets are made by the next process that needs them (the worker, woken
 * by the caller or by its own loop), so that this never raises an ERROR:
 * it is called after a commit, too.  Nothing happens if the epoch changed
 * already.
 *
 * Ledger rows removed or changed (by SQL, by logical replication, or as
 * idem_renew_epoch() reports): a new renewal generation first, then the
 * renewal, so that the epoch made for it counts the change
 * (epoch_renewal.c).
 * Returns the generation to wait for until the worker has retired the
 * epoch replaced (idem_renewal_wait), or 0 when no runner can hold a token
 * of this data directory's epochs (none was taken over since the start,
 * and the file named none).
 */
uint64
idem_cache_epoch_renew(uint64 epoch, IdemEpochReason reason)
{
	uint64		generation = 0;
	bool		trusted;

	if (secret_shared == NULL)
		return 0;
	if (reason == IDEM_EPOCH_LEDGER_ROWS_REMOVED ||
		reason == IDEM_EPOCH_LEDGER_ROWS_REPLICATED ||
		reason == IDEM_EPOCH_RENEW_REQUESTED)
		generation = idem_renewal_bump();
	LWLockAcquire(secret_lock, LW_EXCLUSIVE);
	trusted = !secret_shared->loaded || secret_shared->tokens_out;
	if (!secret_shared->loaded || secret_shared->secrets.epoch == epoch ||
		epoch == 0)
	{
		if (secret_shared->renew == 0)
			secret_shared->renew = reason;
		secret_shared->confirmed = false;
	}
	LWLockRelease(secret_lock);
	return trusted ? generation : 0;
}

/*
 * The worker retired epoch *dead (not this data directory's own: one that
 * Valkey's epoch list named, see the file header): remember it
 * in the file, so that it is retired again if Valkey brings it back, and
 * so that a backup taken from now on knows it.
 */
void
idem_cache_epoch_note_dead(const IdemEpochName *dead)
{
	IdemCacheSecrets next;

	Assert(secret_shared != NULL);
	LWLockAcquire(secret_lock, LW_EXCLUSIVE);
	/* An ERROR here releases the lock in the abort path. */
	secret_shared_load();
	next = secret_shared->secrets;
	if (secret_dead_add(&next, dead))
	{
		secret_install(&next);
		secret_shared->secrets = next;
	}
	explicit_bzero(&next, sizeof(next));
	LWLockRelease(secret_lock);
}

/*
 * The epochs this history knows are dead (at most IDEM_EPOCH_DEAD_MAX, into
 * dead), for the worker to retire them again; returns how many.
 */
int
idem_cache_epoch_dead(IdemEpochName *dead)
{
	int			n = 0;

	if (secret_shared == NULL)
		return 0;
	LWLockAcquire(secret_lock, LW_SHARED);
	if (secret_shared->loaded)
	{
		n = secret_shared->secrets.ndead;
		memcpy(dead, secret_shared->secrets.dead, n * sizeof(IdemEpochName));
	}
	LWLockRelease(secret_lock);
	return n;
}

/*
 * Prepare the current secret of *secrets as an HMAC-SHA-256 key (sha256.h:
 * its inner and outer pads hashed once), for idem_cache_sign().  The
 * caller wipes *mac_key when done, as it wipes the secrets.
 */
void
idem_cache_mac_key(idem_hmac *mac_key, const IdemCacheSecrets *secrets)
{
	idem_hmac_key(mac_key, secrets->current, IDEM_MAC_LEN);
}

/*
 * Fill in the MAC of an encoded value (cache_format.h) stored under key,
 * with the secret mac_key was prepared from (idem_cache_mac_key).  Returns
 * false, with the reason in *why, if the value cannot be MACed.  No
 * allocation and no library call: the worker signs every value it copies.
 */
bool
idem_cache_sign(const idem_hmac *mac_key, const char *key, int keylen,
				char *value, int valuelen, const char **why)
{
	char		input[IDEM_CACHE_MAC_INPUT_MAX];
	uint8		mac[IDEM_MAC_LEN];
	int			n;

	n = idem_cache_mac_input(input, sizeof(input), key, keylen, value, valuelen);
	if (n < 0)
	{
		*why = "the value is too long to MAC";
		return false;
	}
	idem_hmac_sha256(mac_key, input, n, mac);
	idem_cache_set_mac(value, mac);
	return true;
}

PG_FUNCTION_INFO_V1(idem_rotate_cache_secret);

/*
 * idem_rotate_cache_secret() RETURNS integer: a new current secret with the
 * next key id; the current one becomes the previous (still accepted by
 * readers), the previous one is forgotten.  Not transactional: a rollback
 * does not undo it.
 */
Datum
idem_rotate_cache_secret(PG_FUNCTION_ARGS)
{
	IdemCacheSecrets next;
	int32		new_id;

	if (RecoveryInProgress())
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("recovery is in progress"),
				 errhint("Rotate the cache secret on the primary.")));
	if (secret_shared == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idem is not in shared_preload_libraries"),
				 errdetail("Rotating the cache secret needs the worker's shared copy of it.")));

	LWLockAcquire(secret_lock, LW_EXCLUSIVE);
	secret_shared_load();
	secret_shared_fit();
	if (secret_shared->secrets.current_id == PG_INT32_MAX)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("the cache secret's key id cannot grow past %d",
						PG_INT32_MAX),
				 errhint("Remove the file \"%s\" and restart the server to start again from key id 1.",
						 IDEM_SECRET_FILE)));
	memset(&next, 0, sizeof(next));
	next.timeline = secret_shared->secrets.timeline;
	next.epoch = secret_shared->secrets.epoch;
	next.token = secret_shared->secrets.token;
	next.stop_sysid = secret_shared->secrets.stop_sysid;
	next.stop_checkpoint = secret_shared->secrets.stop_checkpoint;
	next.ndead = secret_shared->secrets.ndead;
	memcpy(next.dead, secret_shared->secrets.dead, sizeof(next.dead));
	next.generation = secret_shared->secrets.generation;
	next.previous_id = secret_shared->secrets.current_id;
	memcpy(next.previous, secret_shared->secrets.current, IDEM_MAC_LEN);
	next.current_id = next.previous_id + 1;
	secret_generate(next.current);
	secret_install(&next);
	secret_shared->secrets = next;
	LWLockRelease(secret_lock);
	new_id = next.current_id;
	explicit_bzero(&next, sizeof(next));

	ereport(LOG,
			(errmsg("rotated the cache secret to key id %d", new_id)));
	PG_RETURN_INT32(new_id);
}
