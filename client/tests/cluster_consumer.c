/*
 * cluster_consumer: the stream consumer on a real Valkey Cluster, for
 * test/cluster/070_consume.pl.  For each stream given, a consumer of group
 * "g" named "c" (the stream's name as the runs' scope, tenant 1, a handler
 * that inserts (scope, id) into effects), kept open across rounds.  COUNTS
 * is "N1,N2,...": in round r each consumer polls until it has acknowledged
 * N1 + ... + Nr entries in all (or 50 polls), then one line a stream,
 * "round <r> stream <name> read=<n> acked=<n> errors=<n>"; between rounds
 * it prints "next" and reads a line from stdin (the test changes the
 * cluster meanwhile).  A poll that fails prints "error <message>" on
 * stderr.
 *
 *   cluster_consumer CONNINFO HOST PORT NODES COUNTS STREAM...
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "idem_client.h"

#define MAX_STREAMS 16

static idem_handler_status
handler(PGconn *conn, idem_call *call, void *user_data)
{
	const char *p[2] = {idem_call_scope(call), idem_call_id(call)};
	PGresult   *r;
	int			ok;

	(void) user_data;
	r = PQexecParams(conn, "INSERT INTO effects (scope, id) VALUES ($1, $2)",
					 2, NULL, p, NULL, NULL, 0);
	ok = PQresultStatus(r) == PGRES_COMMAND_OK;
	PQclear(r);
	return ok ? IDEM_HANDLER_OK : IDEM_HANDLER_RETRYABLE;
}

int
main(int argc, char **argv)
{
	idem_runner *r;
	idem_consumer *c[MAX_STREAMS];
	int			nstreams = argc - 6;
	long		want = 0;
	char	   *counts;
	char	   *tok;
	char	   *save = NULL;
	int			round = 0;
	int			s;

	if (argc < 7 || nstreams > MAX_STREAMS)
	{
		fprintf(stderr, "usage: cluster_consumer CONNINFO HOST PORT NODES COUNTS STREAM...\n");
		return 2;
	}
	r = idem_runner_open(argv[1], argv[2], atoi(argv[3]), NULL);
	if (r == NULL)
		return 1;
	for (s = 0; s < nstreams; s++)
	{
		idem_consumer_options co;

		idem_consumer_options_init(&co);
		co.stream = argv[6 + s];
		co.group = "g";
		co.consumer = "c";
		co.task_scope = argv[6 + s];
		co.tenant_id = 1;
		co.handler = handler;
		co.block_ms = 100;
		co.valkey_nodes = argv[4][0] ? argv[4] : NULL;
		c[s] = idem_consumer_open(r, argv[2], atoi(argv[3]), &co);
		if (c[s] == NULL)
			return 1;
	}
	counts = strdup(argv[5]);
	for (tok = strtok_r(counts, ",", &save); tok; tok = strtok_r(NULL, ",", &save))
	{
		char		line[16];

		if (round++ > 0)
		{
			printf("next\n");
			fflush(stdout);
			if (fgets(line, sizeof(line), stdin) == NULL)
				break;
		}
		want += atol(tok);
		for (s = 0; s < nstreams; s++)
		{
			idem_consumer_stats st;
			int			i;

			idem_consumer_stats_init(&st);
			for (i = 0; i < 50; i++)
			{
				idem_consumer_get_stats(c[s], &st);
				if (st.acked >= want)
					break;
				if (idem_consumer_poll(c[s]) < 0)
					fprintf(stderr, "error %s\n", idem_consumer_error_message(c[s]));
			}
			idem_consumer_get_stats(c[s], &st);
			printf("round %d stream %s read=%ld acked=%ld errors=%ld\n", round,
				   argv[6 + s], st.read, st.acked, st.valkey_errors);
		}
		fflush(stdout);
	}
	free(counts);
	for (s = 0; s < nstreams; s++)
		idem_consumer_close(c[s]);
	idem_runner_close(r);
	return 0;
}
