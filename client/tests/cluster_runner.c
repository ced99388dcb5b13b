/*
 * cluster_runner: runs of tenant 1's (scope, id-1..id-N) through one runner,
 * for test/cluster/020_runner.pl: one line per run
 * ("run <id> <status> <source> <valkey_used>"), then the runner's counters
 * ("stats <name>=<value> ...").
 *
 *   cluster_runner CONNINFO HOST PORT NODES MODE SCOPE N [FIRST [DB]]
 *
 * NODES "" for none; MODE 0 auto, 1 cluster, -1 not; DB the valkey_db
 * option (default 0).  The handler does no effect besides its outcome
 * {"i": <id>}.  What the runner tells its notice hook is printed as
 * "notice <message>"; a run that fails prints its message on stderr.
 *
 * With IDEM_TEST_WARM set, the runs are made once first with nothing
 * printed (every master's connection made and used), then "warm" is
 * printed and a line is read from stdin before the runs that count: the
 * test can make a node hang on an established connection.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "idem_client.h"

static void
notice(void *arg, const char *message)
{
	(void) arg;
	printf("notice %s\n", message);
}

static idem_handler_status
handler(PGconn *conn, idem_call *call, void *user_data)
{
	char		json[64];

	(void) conn;
	(void) user_data;
	snprintf(json, sizeof(json), "{\"i\": \"%s\"}", idem_call_id(call));
	idem_call_set_json(call, json);
	return IDEM_HANDLER_OK;
}

/* Run id i of scope. */
static idem_result
run_one(idem_runner *r, const char *scope, int i)
{
	char		id[32];
	idem_result res;

	idem_result_init(&res);
	snprintf(id, sizeof(id), "%d", i);
	idem_run(r, 1, scope, id, "{}", handler, NULL, &res);
	return res;
}

int
main(int argc, char **argv)
{
	idem_options o;
	idem_runner *r;
	idem_runner_stats st;
	int			n,
				first,
				i;

	if (argc < 8)
	{
		fprintf(stderr, "usage: cluster_runner CONNINFO HOST PORT NODES MODE SCOPE N [FIRST [DB]]\n");
		return 2;
	}
	idem_options_init(&o);
	o.valkey_nodes = argv[4];
	o.valkey_cluster = atoi(argv[5]);
	o.valkey_command_timeout_ms = 300;
	n = atoi(argv[7]);
	first = argc > 8 ? atoi(argv[8]) : 1;
	o.valkey_db = argc > 9 ? atoi(argv[9]) : 0;
	o.notice = notice;
	r = idem_runner_open(argv[1], argv[2], atoi(argv[3]), &o);
	if (r == NULL)
		return 1;
	if (getenv("IDEM_TEST_WARM") != NULL)
	{
		char		line[16];

		for (i = first; i < first + n; i++)
			(void) run_one(r, argv[6], i);
		printf("warm\n");
		fflush(stdout);
		if (fgets(line, sizeof(line), stdin) == NULL)
			return 1;
	}
	for (i = first; i < first + n; i++)
	{
		idem_result res = run_one(r, argv[6], i);

		printf("run %d %s %s %d\n", i, idem_status_name(res.status),
			   idem_source_name(res.source), res.valkey_used);
		if (res.status == IDEM_ERROR)
			fprintf(stderr, "run %d: %s\n", i, res.error_message);
	}
	idem_runner_stats_init(&st);
	idem_runner_get_stats(r, &st);
	printf("stats redirects=%ld refreshes=%ld node_errors=%ld skipped=%ld connects=%ld\n",
		   st.valkey_redirects, st.valkey_map_refreshes, st.valkey_node_errors,
		   st.valkey_skipped, st.valkey_connects);
	idem_runner_close(r);
	return 0;
}
