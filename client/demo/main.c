/*
 * main.c
 *	  idem-demo: the main job of idem.  Options, setup of the database and
 *	  the stream, the producer, K worker processes and stage two's
 *	  consumers (fork), and the parent's loop: restart killed workers and
 *	  consumers, inject chaos, show progress, stop when every message is
 *	  acknowledged and every notification published and acknowledged (or
 *	  stage two stalls); then the report and the check.
 *	  Exit status: 0 when the check passes, 1 when it fails, 2 on a setup
 *	  error.
 */
#include "demo.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/prctl.h>
#include <sys/wait.h>

static volatile sig_atomic_t interrupted = 0;

/* The parent's broker connection: a child closes its copy (only the fd; the
 * parent's PostgreSQL connection is left alone: PQfinish would end the
 * parent's session for it). */
static queue *parent_q;
static queue *parent_nq;		/* the notice stream's */

static void
quiet_notices(void *arg, const char *message)
{
	(void) arg;
	(void) message;
}

static void
on_interrupt(int sig)
{
	(void) sig;
	interrupted = 1;
}

static void
usage(FILE *f)
{
	fprintf(f,
			"Usage: idem-demo --pg CONNINFO --valkey HOST:PORT [--broker HOST:PORT] [options]\n"
			"\n"
			"A queue (Valkey Streams, consumer group) delivers money transfers at least\n"
			"once to K worker processes; each runs its handler through an idem runner\n"
			"while faults are injected; then the database is checked: every effect\n"
			"exactly once.  (make demo / test/demo start throwaway servers for you.)\n"
			"\n"
			"  -n, --tasks N           logical tasks (default 20000; --short 3000)\n"
			"  -k, --workers K         worker processes (default 4; --short 3)\n"
			"  -t, --tenants T         tenants (default 50; --short 12)\n"
			"      --accounts A        accounts per tenant (default 8, at least 3)\n"
			"  -d, --dup-ratio R       share of tasks whose message is enqueued again\n"
			"                          with the same run_id (default 0.25; --short 0.3)\n"
			"      --chaos on|off      inject faults (default on); --no-chaos = off\n"
			"      --chaos-interval MS mean time between faults (default 600)\n"
			"      --short             a run of a few seconds (make test)\n"
			"      --pg CONNINFO       PostgreSQL with idem installable (superuser)\n"
			"      --valkey HOST:PORT  the cache Valkey idem's gate uses ('none': no cache)\n"
			"      --broker HOST:PORT  the queue's Valkey (default: the cache server,\n"
			"                          database 1; chaos then uses FLUSHDB, no restarts)\n"
			"      --valkey-nodes LIST the cache is a Valkey Cluster: its other nodes,\n"
			"                          host:port,... (the runners' seeds)\n"
			"      --cache-restart-cmd CMD  shell command that restarts the cache Valkey\n"
			"                          (a cluster: kills a master, its replica takes over)\n"
			"      --cluster-flush one|all  a cluster's chaos FLUSHALL empties one master\n"
			"                          (default: a node losing its data) or every master\n"
			"      --min-valkey-share P  a cluster's check: more than P%% of the replays of\n"
			"                          a stored result that Valkey was asked for come\n"
			"                          from it (default 50)\n"
			"      --lease MS          claim lease / Valkey marker TTL (default 1500;\n"
			"                          --short 800); redelivery after lease + 200 ms\n"
			"      --purges P          maintenance.purge tasks (default 6)\n"
			"      --seed S            random seed (default: from the clock)\n"
			"      --max-seconds S     give up after S seconds (default 300; --short 120)\n"
			"      --handler-sleep MS  handlers sleep up to MS after the effect, inside\n"
			"                          the transaction (kills land mid-handler; above\n"
			"                          --lease, runs outlive their lease)\n"
			"      --batch N           read up to N new messages at once and run their\n"
			"                          transfers in one transaction with the batch API\n"
			"                          (idem_claim_many; default 32, at most 64);\n"
			"                          1: one message at a time through the runner\n"
			"      --without-idem      negative control: the handlers' effects run\n"
			"                          directly, without the runner; the check must FAIL\n"
			"      --notices N         stage two: each transfer emits a notification that\n"
			"                          N consumer processes apply to a ledger of notices\n"
			"                          (default 2; 0: no stage two)\n"
			"      --notice-valkey HOST:PORT  the Valkey the server's publisher XADDs the\n"
			"                          notifications to (default: the cache's; then the\n"
			"                          chaos spares its streams)\n"
			"      --broken-consumer   stage two acks each entry before its run: a\n"
			"                          negative control, the check must FAIL\n"
			"  -v, --verbose           print every run error\n");
}

static int
parse_hostport(const char *s, char *host, size_t hostlen, int *port)
{
	const char *colon = strrchr(s, ':');

	if (colon == NULL || colon == s)
		return -1;
	if (s[0] == '[' && colon[-1] == ']')	/* [IPv6 address]:port */
		snprintf(host, hostlen, "%.*s", (int) (colon - s - 2), s + 1);
	else
		snprintf(host, hostlen, "%.*s", (int) (colon - s), s);
	*port = atoi(colon + 1);
	return *port > 0 && *port < 65536 ? 0 : -1;
}

/* slot < cfg->workers: a worker; above: one of stage two's consumers */
static pid_t
spawn_worker(const demo_config *cfg, int slot, int gen)
{
	pid_t		pid;

	fflush(stdout);
	fflush(stderr);
	pid = fork();
	if (pid == 0)
	{
		prctl(PR_SET_PDEATHSIG, SIGTERM);	/* never outlive the parent */
		queue_close(parent_q);
		queue_close(parent_nq);
		if (slot >= cfg->workers)
			consumer_main(cfg, slot, gen);
		worker_main(cfg, slot, gen);
	}
	return pid;
}

int
main(int argc, char **argv)
{
	demo_config cfg;
	demo_plan	plan;
	PGconn	   *conn;
	queue	   *q;
	chaos	   *ch = NULL;
	pid_t		pids[DEMO_MAX_WORKERS],
				producer;
	int			gens[DEMO_MAX_WORKERS];
	char		err[1024];
	int			i,
				explicit_n = 0,
				explicit_k = 0,
				explicit_t = 0,
				explicit_d = 0,
				explicit_lease = 0,
				explicit_max = 0,
				explicit_iv = 0,
				explicit_p = 0,
				timed_out = 0,
				all_delivered = 0,
				rc,
				producer_status = -1;
	int64_t		started,
				next_progress = 0,
				next_drain_check = 0;
	const char *valkey = NULL,
			   *broker = NULL,
			   *notice_valkey = NULL;
	int			nprocs,
				stage_one_done = 0;
	long		notice_seen = -1;
	int64_t		notice_progress_at = 0;
	queue	   *nq = NULL;
	long		pending;

	memset(&cfg, 0, sizeof(cfg));
	cfg.ntasks = 20000;
	cfg.workers = 4;
	cfg.tenants = 50;
	cfg.accounts = 8;
	cfg.dup_ratio = 0.25;
	cfg.chaos = 1;
	cfg.lease_ms = 1500;
	cfg.batch = 32;
	cfg.max_seconds = 300;
	cfg.chaos_interval_ms = 600;
	cfg.purges = 6;
	cfg.min_valkey_share = 50;
	cfg.notices = 2;
	cfg.seed = (unsigned) time(NULL) ^ (unsigned) getpid();

	for (i = 1; i < argc; i++)
	{
		const char *a = argv[i];
		const char *v = i + 1 < argc ? argv[i + 1] : NULL;

#define NEEDV() do { if (v == NULL) { fprintf(stderr, "idem-demo: %s needs a value\n", a); return 2; } i++; } while (0)
		if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0)
		{
			usage(stdout);
			return 0;
		}
		else if (strcmp(a, "-n") == 0 || strcmp(a, "--tasks") == 0)
		{
			NEEDV();
			cfg.ntasks = atoi(v);
			explicit_n = 1;
		}
		else if (strcmp(a, "-k") == 0 || strcmp(a, "--workers") == 0)
		{
			NEEDV();
			cfg.workers = atoi(v);
			explicit_k = 1;
		}
		else if (strcmp(a, "-t") == 0 || strcmp(a, "--tenants") == 0)
		{
			NEEDV();
			cfg.tenants = atoi(v);
			explicit_t = 1;
		}
		else if (strcmp(a, "--accounts") == 0)
		{
			NEEDV();
			cfg.accounts = atoi(v);
		}
		else if (strcmp(a, "-d") == 0 || strcmp(a, "--dup-ratio") == 0)
		{
			NEEDV();
			cfg.dup_ratio = atof(v);
			explicit_d = 1;
		}
		else if (strcmp(a, "--chaos") == 0)
		{
			NEEDV();
			cfg.chaos = strcmp(v, "off") != 0 && strcmp(v, "0") != 0 &&
				strcmp(v, "no") != 0;
		}
		else if (strcmp(a, "--no-chaos") == 0)
			cfg.chaos = 0;
		else if (strcmp(a, "--chaos-interval") == 0)
		{
			NEEDV();
			cfg.chaos_interval_ms = atoi(v);
			explicit_iv = 1;
		}
		else if (strcmp(a, "--short") == 0)
			cfg.short_mode = 1;
		else if (strcmp(a, "--pg") == 0)
		{
			NEEDV();
			cfg.pg = v;
		}
		else if (strcmp(a, "--valkey") == 0)
		{
			NEEDV();
			valkey = v;
		}
		else if (strcmp(a, "--broker") == 0)
		{
			NEEDV();
			broker = v;
		}
		else if (strcmp(a, "--valkey-nodes") == 0)
		{
			NEEDV();
			cfg.cache_nodes = v;
		}
		else if (strcmp(a, "--cluster-flush") == 0)
		{
			NEEDV();
			if (strcmp(v, "one") != 0 && strcmp(v, "all") != 0)
			{
				fprintf(stderr, "idem-demo: --cluster-flush wants one or all\n");
				return 2;
			}
			cfg.flush_all_masters = strcmp(v, "all") == 0;
		}
		else if (strcmp(a, "--min-valkey-share") == 0)
		{
			NEEDV();
			cfg.min_valkey_share = atoi(v);
		}
		else if (strcmp(a, "--cache-restart-cmd") == 0)
		{
			NEEDV();
			cfg.cache_restart_cmd = v;
		}
		else if (strcmp(a, "--lease") == 0)
		{
			NEEDV();
			cfg.lease_ms = atoi(v);
			explicit_lease = 1;
		}
		else if (strcmp(a, "--purges") == 0)
		{
			NEEDV();
			cfg.purges = atoi(v);
			explicit_p = 1;
		}
		else if (strcmp(a, "--seed") == 0)
		{
			NEEDV();
			cfg.seed = (unsigned) strtoul(v, NULL, 10);
		}
		else if (strcmp(a, "--max-seconds") == 0)
		{
			NEEDV();
			cfg.max_seconds = atoi(v);
			explicit_max = 1;
		}
		else if (strcmp(a, "--without-idem") == 0)
			cfg.without_idem = 1;
		else if (strcmp(a, "--notices") == 0)
		{
			NEEDV();
			cfg.notices = atoi(v);
		}
		else if (strcmp(a, "--notice-valkey") == 0)
		{
			NEEDV();
			notice_valkey = v;
		}
		else if (strcmp(a, "--broken-consumer") == 0)
			cfg.broken_consumer = 1;
		else if (strcmp(a, "--batch") == 0)
		{
			NEEDV();
			cfg.batch = atoi(v);
			if (cfg.batch < 1 || cfg.batch > 64)
			{
				fprintf(stderr, "idem-demo: --batch must be 1..64\n");
				return 2;
			}
		}
		else if (strcmp(a, "--handler-sleep") == 0)
		{
			NEEDV();
			cfg.handler_sleep_ms = atoi(v);
		}
		else if (strcmp(a, "-v") == 0 || strcmp(a, "--verbose") == 0)
			cfg.verbose = 1;
		else
		{
			fprintf(stderr, "idem-demo: unknown option %s\n", a);
			usage(stderr);
			return 2;
		}
#undef NEEDV
	}
	if (cfg.short_mode)
	{
		if (!explicit_n)
			cfg.ntasks = 3000;
		if (!explicit_k)
			cfg.workers = 3;
		if (!explicit_t)
			cfg.tenants = 12;
		if (!explicit_d)
			cfg.dup_ratio = 0.3;
		if (!explicit_lease)
			cfg.lease_ms = 800;
		if (!explicit_max)
			cfg.max_seconds = 120;
		if (!explicit_iv)
			cfg.chaos_interval_ms = 300;
		if (!explicit_p)
			cfg.purges = 3;
	}
	cfg.seed_expired = cfg.short_mode ? 100 : 300;
	if (cfg.pg == NULL || valkey == NULL)
	{
		fprintf(stderr, "idem-demo: --pg and --valkey are required (make demo starts throwaway servers)\n");
		usage(stderr);
		return 2;
	}
	if (cfg.ntasks < 1 || cfg.workers < 1 || cfg.workers > DEMO_MAX_WORKERS ||
		cfg.tenants < 1 || cfg.accounts < 3 || cfg.dup_ratio < 0 ||
		cfg.dup_ratio > 1 || cfg.lease_ms < 100 || cfg.purges < 0 ||
		cfg.chaos_interval_ms < 10 || cfg.max_seconds < 1 ||
		cfg.min_valkey_share < 0 || cfg.min_valkey_share > 100 ||
		cfg.notices < 0 || cfg.workers + cfg.notices > DEMO_MAX_WORKERS)
	{
		fprintf(stderr, "idem-demo: an option is out of range (workers + notices 1..%d, accounts >= 3, dup-ratio 0..1, lease >= 100)\n",
				DEMO_MAX_WORKERS);
		return 2;
	}
	if (strcmp(valkey, "none") == 0)
		cfg.cache_host[0] = '\0';
	else if (parse_hostport(valkey, cfg.cache_host, sizeof(cfg.cache_host),
							&cfg.cache_port) != 0)
	{
		fprintf(stderr, "idem-demo: --valkey wants HOST:PORT\n");
		return 2;
	}
	if (broker)
	{
		if (parse_hostport(broker, cfg.broker_host, sizeof(cfg.broker_host),
						   &cfg.broker_port) != 0)
		{
			fprintf(stderr, "idem-demo: --broker wants HOST:PORT\n");
			return 2;
		}
		cfg.shared_valkey = cfg.cache_host[0] &&
			strcmp(cfg.broker_host, cfg.cache_host) == 0 &&
			cfg.broker_port == cfg.cache_port;
	}
	else
	{
		if (!cfg.cache_host[0])
		{
			fprintf(stderr, "idem-demo: --valkey none needs --broker\n");
			return 2;
		}
		snprintf(cfg.broker_host, sizeof(cfg.broker_host), "%s", cfg.cache_host);
		cfg.broker_port = cfg.cache_port;
		cfg.shared_valkey = 1;
	}
	if (cfg.shared_valkey)
		cfg.broker_db = cfg.cache_db + 1;
	/* stage two: its stream lives where the server's publisher puts it */
	if (cfg.without_idem)
		cfg.notices = 0;
	if (notice_valkey)
	{
		if (parse_hostport(notice_valkey, cfg.notice_host, sizeof(cfg.notice_host),
						   &cfg.notice_port) != 0)
		{
			fprintf(stderr, "idem-demo: --notice-valkey wants HOST:PORT\n");
			return 2;
		}
	}
	else if (cfg.cache_host[0] && cfg.cache_nodes == NULL)
	{
		snprintf(cfg.notice_host, sizeof(cfg.notice_host), "%s", cfg.cache_host);
		cfg.notice_port = cfg.cache_port;
	}
	else if (cfg.notices > 0)
	{
		/* no Valkey for the publisher, or a cluster the chaos fails over */
		printf("idem-demo: no stage two: %s\n", cfg.cache_host[0] ?
			   "the cache is a cluster; name a single Valkey for the notifications with --notice-valkey" :
			   "no Valkey for the notifications (--notice-valkey)");
		cfg.notices = 0;
	}
	cfg.notice_in_cache = cfg.cache_host[0] &&
		strcmp(cfg.notice_host, cfg.cache_host) == 0 &&
		cfg.notice_port == cfg.cache_port;
	snprintf(cfg.tag, sizeof(cfg.tag), "%06x", (cfg.seed * 2654435761u) & 0xffffff);
	snprintf(cfg.stream, sizeof(cfg.stream), "idem-demo:%s", cfg.tag);
	snprintf(cfg.group, sizeof(cfg.group), "workers");
	snprintf(cfg.notice_stream, sizeof(cfg.notice_stream), "idem-demo:%s:notices", cfg.tag);
	snprintf(cfg.notice_group, sizeof(cfg.notice_group), "notices");
	setvbuf(stdout, NULL, _IOLBF, 0);

	if (demo_shared_open() != 0)
		return 2;
	if (plan_build(&cfg, &plan) != 0 || misses_init(plan.ntasks) != 0)
	{
		fprintf(stderr, "idem-demo: out of memory\n");
		return 2;
	}

	/* the database: extension, ledgers, tenants, accounts, expectations */
	conn = PQconnectdb(cfg.pg);
	if (PQstatus(conn) != CONNECTION_OK)
	{
		fprintf(stderr, "idem-demo: cannot connect to PostgreSQL: %s", PQerrorMessage(conn));
		PQfinish(conn);
		return 2;
	}
	if (db_setup(conn, &cfg, &plan, err, sizeof(err)) != 0)
	{
		fprintf(stderr, "idem-demo: database setup failed: %s", err);
		PQfinish(conn);
		return 2;
	}
	setenv("IDEM_DEMO_SCHEMA", cfg.schema, 1);
	/* the chaos's crash restarts would print a WARNING on it */
	PQsetNoticeProcessor(conn, quiet_notices, NULL);

	/* the queue */
	q = queue_open(cfg.broker_host, cfg.broker_port, cfg.broker_db, cfg.stream,
				   cfg.group, err, sizeof(err));
	if (q == NULL || queue_create_group(q, err, sizeof(err)) != 0)
	{
		fprintf(stderr, "idem-demo: %s\n", err);
		PQfinish(conn);
		return 2;
	}

	/* stage two's stream */
	if (cfg.notices > 0)
	{
		nq = queue_open(cfg.notice_host, cfg.notice_port, cfg.notice_db,
						cfg.notice_stream, cfg.notice_group, err, sizeof(err));
		if (nq == NULL)
		{
			fprintf(stderr, "idem-demo: %s\n", err);
			PQfinish(conn);
			return 2;
		}
	}
	nprocs = cfg.workers + cfg.notices;

	printf("idem demo: exactly-once effects over at-least-once delivery\n");
	printf("  queue    Valkey Streams at %s:%d%s, stream %s, group %s\n",
		   cfg.broker_host, cfg.broker_port,
		   cfg.shared_valkey ? " (db 1, shares the cache's server)" : "",
		   cfg.stream, cfg.group);
	if (cfg.cache_host[0])
		printf("  cache    Valkey at %s:%d: idem's gate and replay cache\n",
			   cfg.cache_host, cfg.cache_port);
	else
		printf("  cache    none: PostgreSQL alone\n");
	printf("  truth    PostgreSQL (idem in schema %s)\n", cfg.schema);
	printf("  plan     %d tasks: %d transfers (%d flaky, %d on frozen accounts), %d invoices, %d purges;\n"
		   "           %d messages: %d duplicates (same run_id), %d invoice re-submissions (new run_id)\n",
		   plan.ntasks, plan.n_transfers, plan.n_flaky, plan.n_frozen_tasks,
		   plan.n_invoices, plan.n_purges, plan.nmsgs, plan.n_dup_msgs,
		   plan.n_invoice_resubmits);
	printf("  workers  %d processes, %d tenants x %d accounts, lease %d ms, chaos %s, seed %u%s\n",
		   cfg.workers, cfg.tenants, cfg.accounts, cfg.lease_ms,
		   cfg.chaos ? "on" : "off", cfg.seed, cfg.short_mode ? ", short run" : "");
	if (cfg.notices > 0)
		printf("  stage 2  each transfer emits a notification; %d consumers apply it to a\n"
			   "           ledger of notices (stream %s at %s:%d%s)%s\n",
			   cfg.notices, cfg.notice_stream, cfg.notice_host, cfg.notice_port,
			   cfg.notice_in_cache ? ",\n           the cache's server: its chaos spares streams and restarts" : "",
			   cfg.broken_consumer ? "\n           BROKEN CONSUMER: acks before the run, the check should fail" : "");
	if (cfg.without_idem)
		printf("  WITHOUT IDEM: a negative control; effects run directly, the check should fail\n");
	printf("\n");

	signal(SIGINT, on_interrupt);
	signal(SIGTERM, on_interrupt);
	signal(SIGPIPE, SIG_IGN);

	started = demo_now_ms();
	fflush(stdout);
	parent_q = q;
	parent_nq = nq;
	producer = fork();
	if (producer == 0)
	{
		prctl(PR_SET_PDEATHSIG, SIGTERM);
		queue_close(parent_q);
		producer_main(&cfg, &plan);
	}
	for (i = 0; i < nprocs; i++)
	{
		gens[i] = 0;
		pids[i] = spawn_worker(&cfg, i, 0);
	}
	if (cfg.chaos)
		ch = chaos_new(&cfg);

	for (;;)
	{
		demo_counters tot;
		int			st;

		if (interrupted)
			break;
		/* reap: a worker that died is restarted (a killed one, or a crash) */
		for (i = 0; i < nprocs; i++)
		{
			if (pids[i] > 0 && waitpid(pids[i], &st, WNOHANG) == pids[i])
			{
				if (!(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL))
				{
					g_shared->worker_exits_unexpected++;
					demo_note_error("%s %d exited unexpectedly (status %d)",
									i < cfg.workers ? "worker" : "consumer",
									i < cfg.workers ? i : i - cfg.workers, st);
				}
				pids[i] = spawn_worker(&cfg, i, ++gens[i]);
				g_shared->restarts++;
			}
		}
		if (producer > 0 && waitpid(producer, &st, WNOHANG) == producer)
		{
			producer_status = WIFEXITED(st) ? WEXITSTATUS(st) : 128;
			producer = 0;
			if (producer_status != 0)
			{
				fprintf(stderr, "idem-demo: the producer failed: %s\n", g_shared->last_error);
				break;
			}
		}
		/* done: everything enqueued was handed out and acknowledged (the
		 * broker says so; the workers' own counts may miss an XACK whose
		 * worker was killed before it counted it) */
		demo_counters_sum(&tot);
		if (producer_status == 0 && tot.acks + g_shared->kills >= plan.nmsgs &&
			demo_now_ms() >= next_drain_check)
		{
			long		pend;
			char		last[48];

			next_drain_check = demo_now_ms() + 50;
			if (!stage_one_done &&
				queue_group_state(q, &pend, last, sizeof(last)) == 0 &&
				pend == 0 && strcmp(last, g_shared->last_id) == 0)
				stage_one_done = 1;
			/* then stage two: every notification published and applied */
			if (stage_one_done && nq == NULL)
				break;
			if (stage_one_done)
			{
				long		seen = tot.notice_read + tot.notice_acked;

				next_drain_check = demo_now_ms() + 200;
				if (notices_drained(conn, nq, &cfg))
					break;
				/*
				 * Stage two redelivers within a lease; nothing for 15 s is
				 * a stall (--broken-consumer's lost entries): the check
				 * says what is missing.
				 */
				if (seen != notice_seen)
				{
					notice_seen = seen;
					notice_progress_at = demo_now_ms();
				}
				else if (demo_now_ms() - notice_progress_at > 15000)
				{
					printf("  stage two made no progress for 15 s: stopping\n");
					break;
				}
			}
		}
		if (demo_now_ms() - started > (int64_t) cfg.max_seconds * 1000)
		{
			timed_out = 1;
			break;
		}
		if (ch)
			chaos_tick(ch, pids, nprocs, cfg.workers);
		if (demo_now_ms() >= next_progress)
		{
			progress_tick(&cfg, &plan, started, 0);
			next_progress = demo_now_ms() + (isatty(1) ? 100 : 1000);
		}
		usleep(10 * 1000);
	}
	{
		double		secs = (demo_now_ms() - started) / 1000.0;
		int64_t		deadline;

		/* stop the workers; a clean exit after the message at hand */
		for (i = 0; i < nprocs; i++)
			if (pids[i] > 0)
				kill(pids[i], SIGTERM);
		if (producer > 0)
			kill(producer, SIGTERM);
		deadline = demo_now_ms() + 5000;
		for (i = 0; i < nprocs; i++)
		{
			while (pids[i] > 0)
			{
				int			st;

				pid_t		w = waitpid(pids[i], &st, WNOHANG);

				if (w == pids[i] || (w < 0 && errno == ECHILD))
					pids[i] = 0;
				else if (demo_now_ms() > deadline)
				{
					kill(pids[i], SIGKILL);
					waitpid(pids[i], &st, 0);
					pids[i] = 0;
				}
				else
					usleep(10 * 1000);
			}
		}
		if (producer > 0)
			waitpid(producer, NULL, 0);
		chaos_free(ch);			/* waits for a cache restart in progress */
		ch = NULL;
		progress_tick(&cfg, &plan, started, 1);
		if (interrupted)
		{
			fprintf(stderr, "idem-demo: interrupted\n");
			chaos_free(ch);
			queue_drop_stream(q);
			queue_close(q);
			if (nq)
				queue_drop_stream(nq);
			queue_close(nq);
			PQfinish(conn);
			plan_free(&plan);
			return 130;
		}
		{
			char		last[48] = "";

			if (queue_group_state(q, &pending, last, sizeof(last)) != 0)
				pending = -1;
			all_delivered = g_shared->producer_done &&
				strcmp(last, g_shared->last_id) == 0;
		}
		if (PQstatus(conn) != CONNECTION_OK)
			PQreset(conn);
		rc = report_and_check(conn, &cfg, &plan, secs, pending, all_delivered,
							  timed_out, nq);
	}
	chaos_free(ch);
	queue_drop_stream(q);
	queue_close(q);
	if (nq)
		queue_drop_stream(nq);
	queue_close(nq);
	PQfinish(conn);
	plan_free(&plan);
	demo_shared_close();
	return rc == 0 ? 0 : 1;
}
