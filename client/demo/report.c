/*
 * report.c
 *	  The progress line (a bar on a terminal, plain periodic lines
 *	  otherwise), the final report, and THE CHECK, from PostgreSQL: every
 *	  enqueued task applied exactly once (none doubled, none missing, none
 *	  on a frozen account), every balance equal to its opening plus the sum
 *	  of its unique transfers, every invoice paid once, a terminal ledger row
 *	  per task, the queue drained; and for stage two (notices.c), every
 *	  applied transfer's notification applied exactly once to the ledger of
 *	  notices, none for a transfer that did not commit, the outbox and the
 *	  notice stream drained.
 */
#include "demo.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/ioctl.h>

void
progress_tick(const demo_config *cfg, const demo_plan *plan, int64_t started,
			  int final)
{
	demo_counters t;
	double		secs = (demo_now_ms() - started) / 1000.0;
	long		chaos_events = g_shared->kills + g_shared->terminate_events +
		g_shared->flushes + g_shared->cache_restarts + g_shared->notice_kills +
		g_shared->server_kills + g_shared->server_terms;
	double		frac;

	(void) cfg;
	demo_counters_sum(&t);
	frac = plan->nmsgs ? (double) t.acks / plan->nmsgs : 1.0;
	if (frac > 1)
		frac = 1;
	if (isatty(1))
	{
		char		bar[21],
					line[256];
		int			i,
					cols = 80,
					w = (int) (frac * 20);
		struct winsize ws;

		if (ioctl(1, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 20)
			cols = ws.ws_col;
		for (i = 0; i < 20; i++)
			bar[i] = i < w ? '#' : '.';
		bar[20] = '\0';
		snprintf(line, sizeof(line),
				 "  [%s] %3d%% %ld/%d  applied %ld  replays %ld  busy %ld  errors %ld  notices %ld  chaos %ld  %.0f/s",
				 bar, (int) (frac * 100), t.acks, plan->nmsgs, t.applied,
				 t.replay_valkey + t.replay_pg + t.replay_twin, t.busy_valkey + t.busy_pg,
				 t.err_connection + t.err_commit_unknown + t.err_other,
				 t.notice_applied, chaos_events, secs > 0 ? t.deliveries / secs : 0.0);
		if ((int) strlen(line) > cols - 1)
			line[cols - 1] = '\0';
		printf("\r%s\033[K", line);
		if (final)
			printf("\n\n");
		fflush(stdout);
	}
	else if (!final)
	{
		printf("  %5.1fs  acked %ld/%d (%d%%)  applied %ld  replays %ld  busy %ld  errors %ld  notices %ld  chaos events %ld\n",
			   secs, t.acks, plan->nmsgs, (int) (frac * 100), t.applied,
			   t.replay_valkey + t.replay_pg + t.replay_twin, t.busy_valkey + t.busy_pg,
			   t.err_connection + t.err_commit_unknown + t.err_other,
			   t.notice_applied, chaos_events);
		fflush(stdout);
	}
	else
		printf("\n");
}

/* Run a query returning one row of integers; -1 in each slot on error. */
static int
q_ints(PGconn *conn, const char *sql, long *out, int n)
{
	PGresult   *r = PQexec(conn, sql);
	int			i,
				ok = PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1 &&
		PQnfields(r) >= n;

	for (i = 0; i < n; i++)
		out[i] = ok && !PQgetisnull(r, 0, i) ? atol(PQgetvalue(r, 0, i)) : (ok ? 0 : -1);
	if (!ok)
		fprintf(stderr, "idem-demo: check query failed: %s", PQerrorMessage(conn));
	PQclear(r);
	return ok ? 0 : -1;
}

static int	failures;

static void
verdict(int ok, const char *fmt,...) __attribute__((format(printf, 2, 3)));

#include <stdarg.h>
static void
verdict(int ok, const char *fmt,...)
{
	va_list		ap;

	printf("    %s ", ok ? "[ok]  " : "[FAIL]");
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	printf("\n");
	if (!ok)
		failures++;
}

/* Print the rows behind a failed check, to reproduce and debug it. */
static void
show_rows(PGconn *conn, const char *title, const char *sql)
{
	PGresult   *r = PQexec(conn, sql);
	int			i,
				j;

	if (PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) > 0)
	{
		printf("           %s:\n", title);
		for (i = 0; i < PQntuples(r); i++)
		{
			printf("             ");
			for (j = 0; j < PQnfields(r); j++)
				printf("%s%s=%s", j ? " " : "", PQfname(r, j),
					   PQgetisnull(r, i, j) ? "NULL" : PQgetvalue(r, i, j));
			printf("\n");
		}
	}
	PQclear(r);
}

/*
 * Stage two's check, from PostgreSQL: every transfers row (an applied
 * transfer or invoice) has exactly one notice, carrying its transfer id;
 * each message id applied once; no notice without a committed transfer;
 * the outbox and the notice stream drained.  Counts into failures.
 */
static void
check_notices(PGconn *conn, const demo_config *cfg, queue *nq)
{
	long		v[7],
				other_ids,
				transfers,
				notices,
				ids,
				missing,
				doubled,
				orphans,
				outbox = -1,
				pending = -1;
	char		sql[2048],
				last[48] = "",
				delivered[48] = "";

	/*
	 * The tables read once each (CTEs), so that on Citus the correlated
	 * subqueries join the distributed tables' rows on the coordinator
	 */
	snprintf(sql, sizeof(sql),
			 "WITH tr AS MATERIALIZED (SELECT task_key, tenant_id, id FROM idem_demo.transfers),"
			 " ex AS MATERIALIZED (SELECT task_key, scope, id FROM idem_demo.expected),"
			 " no AS MATERIALIZED (SELECT task_key, tenant_id, transfer_id, message_id"
			 "   FROM idem_demo.notices)"
			 " SELECT (SELECT count(*) FROM tr),"
			 " count(*), count(DISTINCT message_id),"
			 " (SELECT count(*) FROM tr t WHERE NOT EXISTS"
			 "   (SELECT 1 FROM no n WHERE n.task_key = t.task_key)),"
			 " (SELECT count(*) FROM (SELECT task_key FROM no"
			 "   GROUP BY 1 HAVING count(*) > 1) d),"
			 " count(*) FILTER (WHERE NOT EXISTS (SELECT 1 FROM tr t"
			 "   WHERE t.task_key = n.task_key AND t.tenant_id = n.tenant_id"
			 "   AND t.id = n.transfer_id)),"
			 " count(*) FILTER (WHERE NOT EXISTS (SELECT 1 FROM ex e"
			 "   WHERE e.task_key = n.task_key AND n.message_id ="
			 "   encode(%s.idem_key(e.scope, e.id), 'hex') || '-1'))"
			 " FROM no n", cfg->schema);
	q_ints(conn, sql, v, 7);
	transfers = v[0];
	notices = v[1];
	ids = v[2];
	missing = v[3];
	doubled = v[4];
	orphans = v[5];
	other_ids = v[6];
	verdict(missing == 0 && doubled == 0 && orphans == 0 && other_ids == 0 &&
			notices == transfers && ids == transfers,
			"notifications exactly once: %ld transfers applied, %ld notices (%ld message ids); %ld missing, %ld doubled, %ld without a committed transfer, %ld not under their run's stable id",
			transfers, notices, ids, missing, doubled, orphans, other_ids);
	if (missing)
		show_rows(conn, "transfer without its notice",
				  "SELECT task_key, run_id, attempt, worker FROM idem_demo.transfers t "
				  "WHERE NOT EXISTS (SELECT 1 FROM idem_demo.notices n WHERE n.task_key = t.task_key) LIMIT 5");
	if (doubled)
		show_rows(conn, "notice applied more than once",
				  "SELECT message_id, task_key, attempt, consumer, applied_at FROM idem_demo.notices "
				  "WHERE task_key IN (SELECT task_key FROM idem_demo.notices GROUP BY 1 "
				  "HAVING count(*) > 1 LIMIT 5) ORDER BY task_key, id");
	q_ints(conn,
		   "SELECT count(*) FROM idem_demo.notices n JOIN idem_demo.expected e "
		   "ON e.task_key = n.task_key WHERE NOT e.should_apply", v, 1);
	verdict(v[0] == 0, "no notification for a refused transfer: %ld notices for frozen accounts", v[0]);
	notices_outbox_sql(cfg, sql, sizeof(sql));
	if (q_ints(conn, sql, v, 1) == 0)
		outbox = v[0];
	if (queue_last_id(nq, last, sizeof(last)) != 0 ||
		queue_group_state(nq, &pending, delivered, sizeof(delivered)) != 0)
		pending = -1;
	verdict(outbox == 0 && pending == 0 && strcmp(last, delivered) == 0,
			"notifications drained: %ld waiting in the outbox, %ld pending in the stream, all delivered: %s",
			outbox, pending, strcmp(last, delivered) == 0 ? "yes" : "no");
}

int
report_and_check(PGconn *conn, const demo_config *cfg, const demo_plan *plan,
				 double secs, long pending, int all_delivered, int timed_out,
				 queue *nq)
{
	demo_counters t;
	char		sql[2048];
	long		v[6],
				expected_apply,
				expected_frozen,
				rows,
				distinct_keys,
				doubled_keys,
				extra_rows,
				missing,
				unexpected;
	long		errors;

	failures = 0;
	demo_counters_sum(&t);
	errors = t.err_connection + t.err_commit_unknown + t.err_other;

	printf("Report (%.1f s%s)\n", secs, timed_out ? ", TIMED OUT" : "");
	printf("  Queue (Valkey Streams, consumer group)\n");
	printf("    messages enqueued        %7ld  (%d tasks, %d duplicates with the same run_id,\n"
		   "                                       %d invoice re-submissions with a new run_id)\n",
		   g_shared->enqueued, plan->ntasks, plan->n_dup_msgs,
		   plan->n_invoice_resubmits);
	printf("    deliveries               %7ld  (%ld redelivered by XAUTOCLAIM)\n",
		   t.deliveries, t.redeliveries);
	printf("    acknowledged (XACK)      %7ld  (all delivered: %s; %ld pending)\n",
		   all_delivered && pending >= 0 ? g_shared->enqueued - pending : t.acks,
		   all_delivered ? "yes" : "no", pending);
	printf("  Decisions of the runner\n");
	printf("    applied (handler ran)    %7ld  (%ld transfers, %ld invoices, %ld purges)\n",
		   t.applied, t.applied_transfer, t.applied_invoice, t.applied_purge);
	printf("    replayed from Valkey     %7ld\n", t.replay_valkey);
	printf("    replayed from PostgreSQL %7ld\n", t.replay_pg);
	printf("    replayed in the batch    %7ld  (a duplicate in its original's batch: that\n"
		   "                                       transaction's own result, read from neither)\n",
		   t.replay_twin);
	printf("    busy, left for redelivery%7ld  (%ld by the Valkey gate, %ld by PostgreSQL)\n",
		   t.busy_valkey + t.busy_pg, t.busy_valkey, t.busy_pg);
	printf("    failed, retryable        %7ld  (flaky first attempts, effects rolled back)\n",
		   t.failed_retryable);
	printf("    failed, permanent        %7ld  (frozen accounts; %ld more replayed)\n",
		   t.failed_permanent_now, t.failed_permanent_replay);
	printf("    mismatch                 %7ld\n", t.mismatch);
	printf("    errors, no decision      %7ld  (%ld connection lost, %ld commit unknown, %ld other)\n",
		   errors, t.err_connection, t.err_commit_unknown, t.err_other);
	printf("  Maintenance\n");
	printf("    maintenance.purge runs   %7ld  (%ld expired ledger rows deleted, of %d seeded)\n",
		   t.applied_purge, t.purge_deleted, cfg->seed_expired);
	if (cfg->notices > 0)
	{
		printf("  Stage two: notifications (outbox -> stream -> %d consumers%s)\n",
			   cfg->notices, cfg->broken_consumer ? ", BROKEN: ack first" : "");
		printf("    entries read             %7ld  (acknowledged %ld; the rest came back)\n",
			   t.notice_read, t.notice_acked);
		printf("    applied / replayed       %7ld / %ld\n",
			   t.notice_applied, t.notice_replayed);
		printf("    left pending             %7ld  (%ld flaky first attempts, %ld busy, %ld errors)\n",
			   t.notice_retryable + t.notice_busy + t.notice_errors,
			   t.notice_retryable, t.notice_busy, t.notice_errors);
	}
	if (cfg->chaos)
	{
		printf("  Chaos\n");
		printf("    workers killed (-9)      %7ld  (restarted; %ld unexpected exits)\n",
			   g_shared->kills, g_shared->worker_exits_unexpected);
		if (cfg->notices > 0)
		{
			printf("    consumers killed (-9)    %7ld  (stage two's; restarted)\n",
				   g_shared->notice_kills);
			printf("    server's idem killed (-9)%7ld  (its worker or publisher: PostgreSQL\n"
				   "                                       restarts every backend%s)\n",
				   g_shared->server_kills,
				   g_shared->server_terms ? "; some only terminated" : "");
		}
		printf("    backends terminated      %7ld  (in %ld pg_terminate_backend rounds)\n",
			   g_shared->backends_terminated, g_shared->terminate_events);
		if (cfg->cache_nodes)
			printf("    cache FLUSHALL           %7ld  (%ld masters emptied: %s)\n",
				   g_shared->flushes, g_shared->masters_flushed,
				   cfg->flush_all_masters ? "every master each time" :
				   "one each time, a node losing its data");
		else
			printf("    cache %-18s %7ld\n", cfg->shared_valkey ? "FLUSHDB" : "FLUSHALL",
				   g_shared->flushes);
		printf("    cache %-18s %7ld%s\n",
			   cfg->cache_nodes ? "masters killed" : "restarts",
			   g_shared->cache_restarts,
			   g_shared->cache_restart_failures ? "  (some failed)" :
			   cfg->notices > 0 && cfg->notice_in_cache ?
			   "  (none: the notifications' streams live there; flushes instead)" :
			   cfg->cache_nodes ? "  (SIGKILL; the replica promoted)" : "");
	}
	if (cfg->cache_host[0] && t.replay_pg > 0)
	{
		printf("  Why %ld replays missed Valkey (read from PostgreSQL instead)\n",
			   t.replay_pg);
		printf("    Valkey not asked         %7ld  (the key's node down or resting after a\n"
			   "                                       failure, or a first delivery's run)\n",
			   t.miss_not_asked);
		printf("    absent, commit unseen    %7ld  (its commit's worker was killed or lost\n"
			   "                                       the COMMIT reply: no timing)\n",
			   t.miss_unseen);
		printf("    absent after a flush     %7ld  (a FLUSHALL since its commit%s)\n",
			   t.miss_flushed, g_shared->server_kills ?
			   ",\n                                       or the server's crash: a new history epoch" : "");
		printf("    absent after a %-9s %7ld  (since its commit: the copy lost with the\n"
			   "                                       node or waiting for it)\n",
			   cfg->cache_nodes ? "failover" : "restart", t.miss_failover);
		printf("    absent, not copied yet   %7ld  (within 1 s of its commit, no fault between)\n",
			   t.miss_copy_lag);
		printf("    absent, not refilled     %7ld  (missed before, no fault since that replay)\n",
			   t.miss_not_refilled);
		printf("    absent, unexplained      %7ld\n", t.miss_unexplained);
	}
	printf("  Throughput\n");
	printf("    %.0f deliveries/s, %.0f tasks/s with %d workers; %.2f PostgreSQL and %.2f Valkey\n"
		   "    round trips per delivery; %ld runs went without Valkey\n",
		   secs > 0 ? t.deliveries / secs : 0.0,
		   secs > 0 ? plan->ntasks / secs : 0.0, cfg->workers,
		   t.deliveries ? (double) t.pg_round_trips / t.deliveries : 0.0,
		   t.deliveries ? (double) t.valkey_round_trips / t.deliveries : 0.0,
		   t.valkey_skipped);
	printf("    %.2f broker round trips per delivery; %ld batches of %.1f messages on\n"
		   "    average (--batch %d) ran %ld deliveries, the rest ran one by one\n",
		   t.deliveries ? (double) t.broker_round_trips / t.deliveries : 0.0,
		   t.batches, t.batches ? (double) t.batch_msgs / t.batches : 0.0,
		   cfg->batch, t.batch_msgs);
	snprintf(sql, sizeof(sql),
			 "SELECT to_regprocedure('%s.idem_stats()') IS NOT NULL", cfg->schema);
	{
		PGresult   *r = PQexec(conn, sql);
		int			has = PQresultStatus(r) == PGRES_TUPLES_OK &&
			PQntuples(r) == 1 && PQgetvalue(r, 0, 0)[0] == 't';

		PQclear(r);
		if (has)
		{
			snprintf(sql, sizeof(sql),
					 "SELECT copied, copy_errors, dropped FROM %s.idem_stats()",
					 cfg->schema);
			if (q_ints(conn, sql, v, 3) == 0)
				printf("    server worker: %ld results copied to Valkey after commit, %ld copy errors, %ld dropped\n",
					   v[0], v[1], v[2]);
		}
	}

	q_ints(conn, "SELECT count(*) FROM idem_demo.transfers", v, 1);
	printf("  Effects\n");
	printf("    effects in the database  %7ld  (transfers rows; applied by runs whose worker saw\n"
		   "                                       the commit: %ld; the rest committed just before\n"
		   "                                       a kill -9 or a lost COMMIT reply, then replayed)\n",
		   v[0], t.applied_transfer + t.applied_invoice);
	printf("  Check (from PostgreSQL)\n");
	q_ints(conn,
		   "SELECT count(*) FILTER (WHERE should_apply), count(*) FILTER (WHERE NOT should_apply) "
		   "FROM idem_demo.expected", v, 2);
	expected_apply = v[0];
	expected_frozen = v[1];
	q_ints(conn,
		   "SELECT count(*), count(DISTINCT task_key) FROM idem_demo.transfers", v, 2);
	rows = v[0];
	distinct_keys = v[1];
	q_ints(conn,
		   "SELECT count(*), coalesce(sum(n - 1), 0) FROM "
		   "(SELECT task_key, count(*) n FROM idem_demo.transfers GROUP BY 1 HAVING count(*) > 1) d",
		   v, 2);
	doubled_keys = v[0];
	extra_rows = v[1];
	q_ints(conn,
		   "SELECT count(*) FROM idem_demo.expected e WHERE should_apply AND NOT EXISTS "
		   "(SELECT 1 FROM idem_demo.transfers t WHERE t.tenant_id = e.tenant_id AND t.task_key = e.task_key)", v, 1);
	missing = v[0];
	q_ints(conn,
		   "SELECT count(*) FROM idem_demo.transfers t WHERE NOT EXISTS "
		   "(SELECT 1 FROM idem_demo.expected e WHERE e.tenant_id = t.tenant_id AND e.task_key = t.task_key"
		   " AND e.should_apply)",
		   v, 1);
	unexpected = v[0];
	verdict(doubled_keys == 0 && missing == 0 && unexpected == 0 &&
			rows == expected_apply && distinct_keys == expected_apply,
			"exactly once: %ld tasks to apply, %ld effects applied (%ld distinct); %ld doubled, %ld missing, %ld unexpected",
			expected_apply, rows, distinct_keys, doubled_keys, missing, unexpected);
	if (doubled_keys)
		show_rows(conn, "applied more than once",
				  "SELECT task_key, run_id, attempt, worker, applied_at FROM idem_demo.transfers "
				  "WHERE task_key IN (SELECT task_key FROM idem_demo.transfers GROUP BY 1 "
				  "HAVING count(*) > 1 LIMIT 5) ORDER BY task_key, id");
	if (missing)
		show_rows(conn, "never applied",
				  "SELECT task_key, tenant_id, from_account, to_account, amount FROM idem_demo.expected e "
				  "WHERE should_apply AND NOT EXISTS (SELECT 1 FROM idem_demo.transfers t "
				  "WHERE t.tenant_id = e.tenant_id AND t.task_key = e.task_key) LIMIT 5");
	(void) extra_rows;

	q_ints(conn,
		   "SELECT count(*) FROM idem_demo.transfers t JOIN idem_demo.expected e "
		   "ON e.tenant_id = t.tenant_id AND e.task_key = t.task_key WHERE NOT e.should_apply", v, 1);
	verdict(v[0] == 0, "frozen accounts: %ld tasks refused for good, %ld of them applied",
			expected_frozen, v[0]);

	q_ints(conn,
		   "WITH mv AS (SELECT tenant_id, from_account AS a, -amount AS d FROM idem_demo.expected WHERE should_apply "
		   "  UNION ALL SELECT tenant_id, to_account, amount FROM idem_demo.expected WHERE should_apply), "
		   "s AS (SELECT tenant_id, a, sum(d) AS d FROM mv GROUP BY 1, 2), "
		   "r AS (SELECT tenant_id, a, sum(d) AS d FROM ("
		   "  SELECT tenant_id, from_account AS a, -amount AS d FROM idem_demo.transfers "
		   "  UNION ALL SELECT tenant_id, to_account, amount FROM idem_demo.transfers) x GROUP BY 1, 2) "
		   "SELECT count(*), count(*) FILTER (WHERE ac.balance <> ac.opening + coalesce(s.d, 0)), "
		   "  count(*) FILTER (WHERE ac.balance <> ac.opening + coalesce(r.d, 0)), "
		   "  sum(ac.balance) - sum(ac.opening) "
		   "FROM idem_demo.accounts ac "
		   "LEFT JOIN s ON s.tenant_id = ac.tenant_id AND s.a = ac.account_no "
		   "LEFT JOIN r ON r.tenant_id = ac.tenant_id AND r.a = ac.account_no", v, 4);
	verdict(v[1] == 0 && v[2] == 0 && v[3] == 0,
			"balances: %ld accounts, %ld differ from opening + their unique transfers, %ld from their transfer rows; money created: %ld",
			v[0], v[1], v[2], v[3]);

	q_ints(conn,
		   "SELECT count(*), count(*) FILTER (WHERE paid_count = 1) FROM idem_demo.invoices", v, 2);
	verdict(v[0] == v[1], "invoices (keyed by business key, each enqueued twice): %ld paid exactly once, of %ld",
			v[1], v[0]);

	snprintf(sql, sizeof(sql),
			 "SELECT count(*), count(*) FILTER (WHERE k.status = CASE WHEN e.should_apply "
			 "THEN 'completed' ELSE 'failed_permanent' END) "
			 "FROM idem_demo.expected e LEFT JOIN %s.idempotency_keys k "
			 "ON k.tenant_id = e.tenant_id AND k.idempotency_key = %s.idem_key(e.scope, e.id)",
			 cfg->schema, cfg->schema);
	q_ints(conn, sql, v, 2);
	{
		long		ledger_tasks = v[0],
					ledger_ok = v[1];
		/* the purge tasks' ids are p<tag>-<i> (workload.c) */
		snprintf(sql, sizeof(sql),
				 "SELECT count(*) FROM %s.platform_idempotency_keys p "
				 "JOIN generate_series(0, %d) AS g(i) "
				 "ON p.idempotency_key = %s.idem_key('maintenance.purge', 'p%s-' || g.i) "
				 "WHERE p.status = 'completed'", cfg->schema, plan->n_purges - 1,
				 cfg->schema, cfg->tag);
		q_ints(conn, sql, v, 1);
		verdict(ledger_ok == ledger_tasks && v[0] == plan->n_purges,
				"ledger: %ld of %ld tenant tasks have their terminal row; %ld of %d purges completed in the platform ledger",
				ledger_ok, ledger_tasks, v[0], plan->n_purges);
	}
	if (cfg->cache_nodes && cfg->cache_host[0] && !cfg->without_idem)
	{
		/*
		 * A cluster is there to keep the cache through a node's loss: of
		 * the replays Valkey was asked for, most must come from it.  A
		 * replay not asked of Valkey (its node resting after chaos killed
		 * it, or a first delivery's run) says nothing of what the cache
		 * kept, and how many there are follows the chaos's timing.
		 */
		long		asked = t.replay_valkey + t.replay_pg - t.miss_not_asked;

		verdict(asked > 0 && 100 * t.replay_valkey > (long) cfg->min_valkey_share * asked,
				"Valkey Cluster cache: %ld of %ld replays of a stored result came from Valkey (%.0f%%; more than %d%% wanted) of those it was asked for; %ld not asked",
				t.replay_valkey, asked, asked > 0 ? 100.0 * t.replay_valkey / asked : 0.0,
				cfg->min_valkey_share, t.miss_not_asked);
	}
	else if (cfg->cache_host[0])
		printf("    [info] Valkey cache: %ld of %ld replays of a stored result came from Valkey (%.0f%%)\n",
			   t.replay_valkey, t.replay_valkey + t.replay_pg,
			   t.replay_valkey + t.replay_pg > 0 ?
			   100.0 * t.replay_valkey / (t.replay_valkey + t.replay_pg) : 0.0);
	verdict(!timed_out && pending == 0 && all_delivered &&
			g_shared->enqueued == plan->nmsgs,
			"queue drained: %ld of %d messages enqueued, all delivered: %s, %ld pending",
			g_shared->enqueued, plan->nmsgs, all_delivered ? "yes" : "no", pending);
	if (cfg->notices > 0)
		check_notices(conn, cfg, nq);
	if (g_shared->last_error[0] && (failures || cfg->verbose))
		printf("    last error noted: %s\n", g_shared->last_error);
	if (failures == 0)
		printf("\nPASS: every task took effect exactly once%s, under at-least-once delivery%s.\n",
			   cfg->notices > 0 ? ", and so did its notification" : "",
			   cfg->chaos ? " and chaos" : "");
	else
		printf("\nFAIL: the exactly-once check failed (see above).\n");
	return failures == 0 ? 0 : 1;
}
