/*-------------------------------------------------------------------------
 *
 * guc.c
 *	  Every idem.* setting.  The README's GUC table documents the same list;
 *	  keep the two in step.
 *
 *	  Ledger settings (any user, per session or transaction):
 *		idem.lease, idem.retention, idem.purge_grace, idem.max_attempts
 *	  Commit settings (any user, per session or transaction):
 *		idem.epoch_retire_timeout
 *	  Ledger settings (superuser, or GRANT SET):
 *		idem.min_retention, idem.min_purge_grace
 *	  Worker settings (postgresql.conf, applied on reload):
 *		idem.valkey_host, idem.valkey_port, idem.valkey_password,
 *		idem.valkey_password_file,
 *		idem.valkey_db, idem.valkey_prefix, idem.valkey_connect_timeout,
 *		idem.valkey_command_timeout, idem.valkey_batch_delay,
 *		idem.standby_slots, idem.valkey_nodes, idem.valkey_cluster
 *	  Publisher settings (postgresql.conf, applied on reload):
 *		idem.outbox_valkey_host, idem.outbox_valkey_port,
 *		idem.outbox_valkey_nodes, idem.outbox_valkey_password,
 *		idem.outbox_valkey_password_file, idem.outbox_valkey_db
 *	  Server start only:
 *		idem.queue_size
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <ctype.h>
#include <limits.h>

#include "miscadmin.h"
#include "replication/slot.h"
#include "utils/guc.h"
#include "utils/varlena.h"

#include "guc.h"
#include "cache_format.h"
#include "valkey_endpoint.h"	/* idem_vc_parse_endpoint: pure, no I/O */

int			idem_lease_ms = 30 * 1000;
int			idem_retention_s = 24 * 60 * 60;
int			idem_purge_grace_s = 60 * 60;
int			idem_min_retention_s = 60 * 60;
int			idem_min_purge_grace_s = 60 * 60;
int			idem_max_attempts = 0;
int			idem_epoch_retire_timeout_ms = 5000;
char	   *idem_valkey_host = NULL;
int			idem_valkey_port = 6379;
char	   *idem_valkey_password = NULL;
char	   *idem_valkey_password_file = NULL;
int			idem_valkey_db = 0;
char	   *idem_valkey_prefix = NULL;
int			idem_valkey_connect_timeout_ms = 1000;
int			idem_valkey_command_timeout_ms = 1000;
int			idem_valkey_batch_delay_ms = 1;
char	   *idem_valkey_nodes = NULL;
int			idem_valkey_cluster = IDEM_VALKEY_CLUSTER_AUTO;
char	   *idem_outbox_valkey_host = NULL;
int			idem_outbox_valkey_port = 6379;
char	   *idem_outbox_valkey_nodes = NULL;
char	   *idem_outbox_valkey_password = NULL;
char	   *idem_outbox_valkey_password_file = NULL;
int			idem_outbox_valkey_db = 0;

static const struct config_enum_entry valkey_cluster_options[] = {
	{"auto", IDEM_VALKEY_CLUSTER_AUTO, false},
	{"on", IDEM_VALKEY_CLUSTER_ON, false},
	{"off", IDEM_VALKEY_CLUSTER_OFF, false},
	{"true", IDEM_VALKEY_CLUSTER_ON, true},
	{"false", IDEM_VALKEY_CLUSTER_OFF, true},
	{NULL, 0, false}
};
int			idem_queue_size = 65536;
char	   *idem_standby_slots = NULL;

static bool
check_valkey_host(char **newval, void **extra, GucSource source)
{
	if (*newval == NULL || (*newval)[0] == '\0')
	{
		GUC_check_errdetail("idem.valkey_host must not be empty.");
		return false;
	}
	return true;
}

/*
 * idem.outbox_valkey_host: empty (the cache's Valkey publishes), or a host
 * name or address without blanks.
 */
static bool
check_outbox_valkey_host(char **newval, void **extra, GucSource source)
{
	const char *p;

	for (p = *newval ? *newval : ""; *p; p++)
	{
		if (!isgraph((unsigned char) *p))
		{
			GUC_check_errdetail("idem.outbox_valkey_host may contain only printable ASCII characters other than space.");
			return false;
		}
	}
	return true;
}

/* The prefix goes verbatim into every key: printable ASCII, no blanks. */
static bool
check_valkey_prefix(char **newval, void **extra, GucSource source)
{
	const char *p;

	if (*newval == NULL)
		return true;
	if (strlen(*newval) > IDEM_CACHE_PREFIX_MAX)
	{
		GUC_check_errdetail("idem.valkey_prefix is longer than %d bytes.",
							IDEM_CACHE_PREFIX_MAX);
		return false;
	}
	for (p = *newval; *p; p++)
	{
		if (!isgraph((unsigned char) *p))
		{
			GUC_check_errdetail("idem.valkey_prefix may contain only printable ASCII characters other than space.");
			return false;
		}
	}
	return true;
}

/*
 * Items separated by commas or spaces: host:port, host, [IPv6 address]:port
 * (idem_vc_parse_endpoint: the worker's router reads the list the same way).
 */
static bool
check_valkey_nodes(char **newval, void **extra, GucSource source)
{
	const char *p = *newval ? *newval : "";

	while (*p)
	{
		size_t		len = strcspn(p, ", ");
		char		host[IDEM_VC_HOST_MAX];
		int			port;

		if (len > 0)
		{
			if (idem_vc_parse_endpoint(p, len, 1, host, sizeof(host), &port) != 0)
			{
				GUC_check_errdetail("\"%.*s\" is not host:port, host, or [IPv6 address]:port.",
									(int) Min(len, 80), p);
				return false;
			}
			p += len;
		}
		else
			p++;
	}
	return true;
}

/* Check hook of idem.standby_slots: a list of valid slot names. */
static bool
idem_check_standby_slots(char **newval, void **extra, GucSource source)
{
	char	   *raw;
	List	   *names;
	ListCell   *lc;
	bool		ok = true;

	if (*newval == NULL || (*newval)[0] == '\0' ||
		strcmp(*newval, IDEM_ALL_STANDBY_SLOTS) == 0)
		return true;
	raw = pstrdup(*newval);
	if (!SplitIdentifierString(raw, ',', &names))
	{
		GUC_check_errdetail("List syntax is invalid.");
		ok = false;
	}
	else
	{
		foreach(lc, names)
		{
			if (strcmp((char *) lfirst(lc), IDEM_ALL_STANDBY_SLOTS) == 0)
			{
				GUC_check_errdetail("\"%s\" (every physical slot) cannot be combined with slot names.",
									IDEM_ALL_STANDBY_SLOTS);
				ok = false;
				break;
			}
			if (!ReplicationSlotValidateName((char *) lfirst(lc), DEBUG1))
			{
				GUC_check_errdetail("\"%s\" is not a valid replication slot name.",
									(char *) lfirst(lc));
				ok = false;
				break;
			}
		}
	}
	list_free(names);
	pfree(raw);
	return ok;
}

void
idem_define_gucs(void)
{
	DefineCustomIntVariable("idem.lease",
							"Lease given to a claim when idem_claim() is called without one.",
							"While a committed claim is still processing, other claims of the key answer busy until the lease ends; after it they take the key over.",
							&idem_lease_ms,
							30 * 1000, 1, INT_MAX,
							PGC_USERSET, GUC_UNIT_MS,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idem.retention",
							"How long a completed or failed result is kept when no retention is given.",
							"idem_purge() deletes results older than this; Valkey copies never outlive it.",
							&idem_retention_s,
							24 * 60 * 60, 1, INT_MAX,
							PGC_USERSET, GUC_UNIT_S,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idem.purge_grace",
							"How long idem_purge() keeps a processing row after its lease ended.",
							NULL,
							&idem_purge_grace_s,
							60 * 60, 0, INT_MAX,
							PGC_USERSET, GUC_UNIT_S,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idem.max_attempts",
							"Attempts a key gets before a retryable failure becomes permanent; 0 means no limit.",
							"Set it per transaction (SET LOCAL) for one call: the claim after the last attempt failed retryably records failed_permanent, with the last failure's detail, instead of claiming the key again.",
							&idem_max_attempts,
							0, 0, INT_MAX,
							PGC_USERSET, 0,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idem.epoch_retire_timeout",
							"How long a commit that removed ledger rows waits for the worker to retire the history epoch it replaced.",
							"Until then runners connected before the commit may replay the removed rows' results from Valkey.  On timeout the commit returns with a WARNING.  0 does not wait.",
							&idem_epoch_retire_timeout_ms,
							5000, 0, INT_MAX,
							PGC_USERSET, GUC_UNIT_MS,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idem.min_retention",
							"Shortest retention idem_complete() and idem_fail() accept, and the youngest result idem_purge() deletes.",
							"A redelivery that arrives after its key was purged runs the effect again: set this above the queue's longest redelivery window.",
							&idem_min_retention_s,
							60 * 60, 0, INT_MAX,
							PGC_SUSET, GUC_UNIT_S,
							NULL, NULL, NULL);

	/*
	 * The attempt fence of idem_complete(..., attempt => n) lives in the
	 * processing row: purged, the key's next claim is attempt 1 again and a
	 * stale holder's attempt => 1 would complete it (the claim's fence of
	 * idem_complete_fenced is never reused and needs no floor).
	 * idem.purge_grace is any user's, so the floor under it is the
	 * administrator's.
	 */
	DefineCustomIntVariable("idem.min_purge_grace",
							"Shortest time after its lease ended that idem_purge() keeps a processing row, whatever idem.purge_grace says.",
							"Set it above the longest time a lease-mode holder may still complete after its lease ended with idem_complete(..., attempt => n): such a holder that completes after its key's processing row was purged and claimed again completes the new claim (idem_complete_fenced does not).",
							&idem_min_purge_grace_s,
							60 * 60, 0, INT_MAX,
							PGC_SUSET, GUC_UNIT_S,
							NULL, NULL, NULL);

	DefineCustomStringVariable("idem.valkey_host",
							   "Host name or address of the Valkey server the worker copies results to.",
							   NULL,
							   &idem_valkey_host,
							   "127.0.0.1",
							   PGC_SIGHUP, 0,
							   check_valkey_host, NULL, NULL);

	DefineCustomIntVariable("idem.valkey_port",
							"TCP port of the Valkey server.",
							NULL,
							&idem_valkey_port,
							6379, 1, 65535,
							PGC_SIGHUP, 0,
							NULL, NULL, NULL);

	DefineCustomStringVariable("idem.valkey_password",
							   "Password the worker sends with AUTH; empty for none.",
							   NULL,
							   &idem_valkey_password,
							   "",
							   PGC_SIGHUP, GUC_SUPERUSER_ONLY | GUC_NO_SHOW_ALL | GUC_NOT_IN_SAMPLE,
							   NULL, NULL, NULL);

	DefineCustomStringVariable("idem.valkey_password_file",
							   "File whose first line is the AUTH password, read at each connect; used when idem.valkey_password is empty.",
							   "Unlike idem.valkey_password, the password never appears in the server log when it changes.",
							   &idem_valkey_password_file,
							   "",
							   PGC_SIGHUP, GUC_SUPERUSER_ONLY,
							   NULL, NULL, NULL);

	DefineCustomIntVariable("idem.valkey_db",
							"Valkey logical database the worker SELECTs (0 on Valkey Cluster).",
							NULL,
							&idem_valkey_db,
							0, 0, 1023,
							PGC_SIGHUP, 0,
							NULL, NULL, NULL);

	DefineCustomStringVariable("idem.valkey_prefix",
							   "Prefix of every Valkey key idem writes, so several databases can share one Valkey.",
							   NULL,
							   &idem_valkey_prefix,
							   "idem:",
							   PGC_SIGHUP, 0,
							   check_valkey_prefix, NULL, NULL);

	DefineCustomIntVariable("idem.valkey_connect_timeout",
							"How long the worker waits for a Valkey connection.",
							NULL,
							&idem_valkey_connect_timeout_ms,
							1000, 1, 60 * 1000,
							PGC_SIGHUP, GUC_UNIT_MS,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idem.valkey_command_timeout",
							"How long the worker waits for Valkey to answer a batch before it reconnects.",
							NULL,
							&idem_valkey_command_timeout_ms,
							1000, 1, 60 * 1000,
							PGC_SIGHUP, GUC_UNIT_MS,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idem.valkey_batch_delay",
							"The least time between two batches the worker sends to Valkey.",
							"Results queued while a batch is in flight go out together once its replies are in; a positive delay also keeps batches this far apart (unless 256 results wait), which saves Valkey and worker wakeups under load and adds up to this much copy latency.  A lone result after a quiet spell goes out at once.  0 adds no wait.",
							&idem_valkey_batch_delay_ms,
							1, 0, 1000,
							PGC_SIGHUP, GUC_UNIT_MS,
							NULL, NULL, NULL);

	DefineCustomStringVariable("idem.standby_slots",
							   "Physical replication slots whose standbys must have flushed a commit before its result is copied to Valkey.",
							   "A failover to one of these standbys cannot lose a result Valkey holds.  '*' (the default): every physical slot that a standby has used.  A list of names: those slots (a missing or unused one holds every copy back).  Empty: no standby is waited for but the synchronous ones.  Each copy waits for the slowest of them; commits never wait.",
							   &idem_standby_slots,
							   IDEM_ALL_STANDBY_SLOTS,
							   PGC_SIGHUP, GUC_LIST_INPUT,
							   idem_check_standby_slots, NULL, NULL);

	DefineCustomStringVariable("idem.valkey_nodes",
							   "More nodes of the same Valkey Cluster, tried when idem.valkey_host:idem.valkey_port does not answer.",
							   "A list of host:port (a host alone takes idem.valkey_port), separated by commas.  The worker reads the slot map from the first node that answers.",
							   &idem_valkey_nodes,
							   "",
							   PGC_SIGHUP, 0,
							   check_valkey_nodes, NULL, NULL);

	DefineCustomEnumVariable("idem.valkey_cluster",
							 "Whether the worker talks to a Valkey Cluster: auto (ask the node), on, or off.",
							 "auto asks INFO cluster at every connect; in cluster mode every SET goes to the master of its key's slot, redirects are followed, and idem.valkey_db must be 0.",
							 &idem_valkey_cluster,
							 IDEM_VALKEY_CLUSTER_AUTO,
							 valkey_cluster_options,
							 PGC_SIGHUP, 0,
							 NULL, NULL, NULL);

	DefineCustomStringVariable("idem.outbox_valkey_host",
							   "Host name or address of the Valkey server the outbox publishers send messages to; empty: the cache's (idem.valkey_host).",
							   "After the XADD a message lives only in its stream: give this Valkey persistence (appendonly) and replicas, unlike a cache.  With neither this nor idem.outbox_valkey_nodes set, the publishers use the cache's Valkey and all of its idem.valkey_* settings.",
							   &idem_outbox_valkey_host,
							   "",
							   PGC_SIGHUP, 0,
							   check_outbox_valkey_host, NULL, NULL);

	DefineCustomIntVariable("idem.outbox_valkey_port",
							"TCP port of the outbox's Valkey server.",
							NULL,
							&idem_outbox_valkey_port,
							6379, 1, 65535,
							PGC_SIGHUP, 0,
							NULL, NULL, NULL);

	DefineCustomStringVariable("idem.outbox_valkey_nodes",
							   "Nodes of the outbox's Valkey Cluster, tried after idem.outbox_valkey_host:idem.outbox_valkey_port (or alone).",
							   "A list of host:port (a host alone takes idem.outbox_valkey_port), separated by commas.  Whether it is a cluster is asked at every connect.",
							   &idem_outbox_valkey_nodes,
							   "",
							   PGC_SIGHUP, 0,
							   check_valkey_nodes, NULL, NULL);

	DefineCustomStringVariable("idem.outbox_valkey_password",
							   "Password the outbox publishers send with AUTH to the outbox's Valkey; empty for none.",
							   NULL,
							   &idem_outbox_valkey_password,
							   "",
							   PGC_SIGHUP, GUC_SUPERUSER_ONLY | GUC_NO_SHOW_ALL | GUC_NOT_IN_SAMPLE,
							   NULL, NULL, NULL);

	DefineCustomStringVariable("idem.outbox_valkey_password_file",
							   "File whose first line is the outbox Valkey's AUTH password, read at each connect; used when idem.outbox_valkey_password is empty.",
							   "Unlike idem.outbox_valkey_password, the password never appears in the server log when it changes.",
							   &idem_outbox_valkey_password_file,
							   "",
							   PGC_SIGHUP, GUC_SUPERUSER_ONLY,
							   NULL, NULL, NULL);

	DefineCustomIntVariable("idem.outbox_valkey_db",
							"Valkey logical database the outbox publishers SELECT on the outbox's Valkey (0 on Valkey Cluster).",
							NULL,
							&idem_outbox_valkey_db,
							0, 0, 1023,
							PGC_SIGHUP, 0,
							NULL, NULL, NULL);

	/*
	 * PostgreSQL refuses (FATAL) to define a PGC_POSTMASTER setting after
	 * startup, so the queue size exists only when idem is preloaded, which is
	 * also the only case with a queue.
	 */
	if (process_shared_preload_libraries_in_progress)
		DefineCustomIntVariable("idem.queue_size",
								"Number of results the commit ring holds before it drops copies.",
								"A dropped copy is counted in idem_stats(); the result stays in PostgreSQL and repopulates Valkey on the next miss.  The ring reserves " CppAsString2(IDEM_RING_BYTES_PER_RECORD) " bytes of shared memory per result.",
								&idem_queue_size,
								65536, 16, 1024 * 1024,
								PGC_POSTMASTER, 0,
								NULL, NULL, NULL);

	MarkGUCPrefixReserved("idem");
}
