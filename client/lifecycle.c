/*
 * lifecycle.c
 *	  A runner's life: its options, opening it (and the first connect to
 *	  both servers, neither of which has to be up), closing it, its last
 *	  error and its counters.  What a run does with it is in runner.c; the
 *	  connections themselves are kept by pg.c and valkey_conn.c, which reconnect
 *	  on the next run after a failure.
 */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

int
idem_client_version(void)
{
	return IDEM_CLIENT_VERSION_NUM;
}

/* ---- options ---- */

/* The defaults, in a struct of this library's size. */
static void
options_defaults(idem_options *o)
{
	memset(o, 0, sizeof(*o));
	o->struct_size = sizeof(idem_options);
	o->valkey_connect_timeout_ms = 200;
	o->valkey_command_timeout_ms = 200;
	o->valkey_retry_ms = 1000;
	o->lease_ms = 30000;
	o->retention_ms = 0;
	o->cache_results = 1;		/* ignored since 0.3: the worker copies */
	o->lookup_first = 1;
	o->prepared_statements = -1;
	o->secrets_max_age_ms = 5000;
}

void
idem_options_init_size(idem_options *o, size_t size)
{
	idem_options d;

	options_defaults(&d);
	idemc_struct_init(o, size, IDEM_OPTIONS_SIZE_MIN, &d, sizeof(d));
}

/* The function of the headers that passed no size: the first layout. */
void
(idem_options_init) (idem_options *o)
{
	idem_options_init_size(o, IDEM_OPTIONS_SIZE_MIN);
}

static int
prefix_ok(const char *p)
{
	size_t		n = strlen(p);
	size_t		i;

	if (n > IDEM_CACHE_PREFIX_MAX)
		return 0;
	for (i = 0; i < n; i++)
		if (p[i] <= ' ' || p[i] > '~')
			return 0;
	return 1;
}

idem_runner *
idem_runner_open(const char *pg_conninfo, const char *valkey_host,
				 int valkey_port, const idem_options *opts)
{
	idem_options o;
	int			opts_ok = opts == NULL ||
		IDEM_STRUCT_SIZE_OK(opts->struct_size, IDEM_OPTIONS_SIZE_MIN);
	idem_runner *r = calloc(1, sizeof(idem_runner));

	if (r == NULL)
		return NULL;
	r->stats.struct_size = sizeof(idem_runner_stats);
	/* the caller's fields, and defaults for those its size does not have */
	options_defaults(&o);
	if (opts && opts_ok)
	{
		memcpy(&o, opts, IDEM_MIN_SIZE(opts->struct_size, sizeof(o)));
		o.struct_size = sizeof(o);
	}
	idemc_pg_init(&r->pg);
	r->pg.conninfo = strdup(pg_conninfo ? pg_conninfo : "");
	if (r->pg.conninfo == NULL)
		goto oom;
	if (o.schema && o.schema[0])
	{
		r->pg.schema_opt = strdup(o.schema);
		if (r->pg.schema_opt == NULL)
			goto oom;
	}
	r->pg.trace = o.pg_trace;
	r->pg.named_opt = o.prepared_statements;
	r->lease_ms = o.lease_ms > 0 ? o.lease_ms : 30000;
	r->retention_ms = o.retention_ms;
	/* the texts every run sends, made once */
	snprintf(r->lease_txt, sizeof(r->lease_txt), "%d milliseconds", r->lease_ms);
	snprintf(r->lease_ms_txt, sizeof(r->lease_ms_txt), "%d", r->lease_ms);
	if (r->retention_ms > 0)
		snprintf(r->retention_txt, sizeof(r->retention_txt), "%d milliseconds",
				 r->retention_ms);
	r->lookup_first = o.lookup_first;
	r->notice = o.notice;
	r->notice_arg = o.notice_arg;
	idemc_trust_init(&r->trust);
	r->trust.max_age_ms = idemc_trust_max_age(o.secrets_max_age_ms);
	if (o.valkey_connect_timeout_ms <= 0)
		o.valkey_connect_timeout_ms = 200;
	if (o.valkey_command_timeout_ms <= 0)
		o.valkey_command_timeout_ms = 200;
	if (o.valkey_retry_ms < 0)
		o.valkey_retry_ms = 1000;

	if (!opts_ok)
	{
		r->broken = 1;
		idemc_set_err(r->errmsg, sizeof(r->errmsg),
					 "options were not initialised by idem_options_init() (struct_size %zu, expected %zu to %d)",
					 opts->struct_size, (size_t) IDEM_OPTIONS_SIZE_MIN,
					 IDEM_STRUCT_SIZE_MAX);
	}
	else if (pg_conninfo == NULL)
	{
		r->broken = 1;
		idemc_set_err(r->errmsg, sizeof(r->errmsg), "pg_conninfo is NULL");
	}
	else if (o.retention_ms < 0)
	{
		r->broken = 1;
		idemc_set_err(r->errmsg, sizeof(r->errmsg),
					 "retention_ms must not be negative");
	}
	else if (o.valkey_prefix && !prefix_ok(o.valkey_prefix))
	{
		r->broken = 1;
		idemc_set_err(r->errmsg, sizeof(r->errmsg),
					 "valkey_prefix must be at most %d printable ASCII characters without spaces",
					 IDEM_CACHE_PREFIX_MAX);
	}
	else if (valkey_host && (valkey_port <= 0 || valkey_port > 65535))
	{
		r->broken = 1;
		idemc_set_err(r->errmsg, sizeof(r->errmsg),
					 "valkey_port %d is out of range", valkey_port);
	}
	else if (valkey_host && o.valkey_cluster > 0 && o.valkey_db != 0)
	{
		r->broken = 1;
		idemc_set_err(r->errmsg, sizeof(r->errmsg),
					 "valkey_db is %d with valkey_cluster = 1, but a Valkey Cluster has only database 0: set valkey_db = 0",
					 o.valkey_db);
	}
	if (r->broken)
		return r;

	if (valkey_host && valkey_host[0])
	{
		r->gate = idemc_gate_new(valkey_host, valkey_port, o.valkey_password,
								o.valkey_db, o.valkey_connect_timeout_ms,
								o.valkey_command_timeout_ms,
								o.valkey_retry_ms);
		if (r->gate == NULL ||
			idemc_gate_set_cluster(r->gate, o.valkey_nodes,
								  o.valkey_cluster) != 0)
			goto oom;
		idemc_gate_set_report(r->gate, idemc_health_report, r);
		idemc_gate_connect(r->gate);
	}
	{
		int			fresh;

		/* a server that is down is not an error here */
		if (idemc_pg_ensure(&r->pg, &fresh, r->errmsg, sizeof(r->errmsg)) == 0)
			r->errmsg[0] = '\0';
	}
	return r;

oom:
	idem_runner_close(r);
	return NULL;
}

void
idem_runner_close(idem_runner *r)
{
	if (r == NULL)
		return;
	idemc_pg_close(&r->pg);
	idemc_gate_free(r->gate);
	idemc_trust_clear(&r->trust);
	free(r);
}

const char *
idem_runner_error_message(const idem_runner *r)
{
	return r ? r->errmsg : "runner is NULL";
}

void
idem_runner_stats_init_size(idem_runner_stats *st, size_t size)
{
	idemc_struct_init(st, size, IDEM_STATS_SIZE_MIN, NULL, 0);
}

/* The function of the headers that passed no size: the first layout. */
void
(idem_runner_stats_init) (idem_runner_stats *st)
{
	idem_runner_stats_init_size(st, IDEM_STATS_SIZE_MIN);
}

void
idem_runner_get_stats(const idem_runner *r, idem_runner_stats *out)
{
	idem_runner_stats full;

	if (out == NULL || !IDEM_STRUCT_SIZE_OK(out->struct_size, IDEM_STATS_SIZE_MIN))
		return;
	idem_runner_stats_init(&full);
	if (r != NULL)
	{
		full = r->stats;
		full.pg_round_trips = r->pg.round_trips;
		full.pg_connects = r->pg.connects;
		full.valkey_round_trips = idemc_gate_round_trips(r->gate);
		full.valkey_connects = idemc_gate_connects(r->gate);
		full.cache_rejected = r->trust.rejected;
		full.valkey_owner_mismatches = r->trust.owner_mismatches;
		idemc_gate_cluster_stats(r->gate, &full.valkey_redirects,
								&full.valkey_map_refreshes,
								&full.valkey_node_errors);
	}
	idemc_struct_copy_out(out, &full, sizeof(full));
}

/*
 * Before the gate: the keyspace and secrets of the server we are connected
 * to, learnt on each new connection (one round trip).  Returns 1 when the
 * cache may be used.  Without them the run goes to PostgreSQL; a role that
 * may not read them runs without the cache, and the notice hook hears it
 * once.
 */
int
idemc_runner_trust_ready(idem_runner *r)
{
	char		msg[400];
	int			fresh;

	if (!idemc_trust_stale(&r->trust, &r->pg))
		return r->trust.state == TRUST_READY && !r->trust.owner_suspect;
	msg[0] = '\0';
	if (idemc_pg_ensure(&r->pg, &fresh, msg, sizeof(msg)) != 0 ||
		PQtransactionStatus(r->pg.conn) != PQTRANS_IDLE)
		return 0;				/* the claim reports it */
	msg[0] = '\0';
	if (idemc_trust_learn(&r->trust, &r->pg, msg, sizeof(msg)) == TRUST_DENIED &&
		!r->cache_off_said)
	{
		r->cache_off_said = 1;
		idemc_runner_notice(r, msg);
	}
	return r->trust.state == TRUST_READY && !r->trust.owner_suspect;
}
