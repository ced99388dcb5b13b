/*
 * idem_run_once: one message through the C runner (client/, libidemclient),
 * for the TAP tests that need the real client against real servers.
 *
 *   idem_run_once <conninfo> <valkey port> <tenant> <scope> <id> <request>
 *
 * The handler's effect is one row in the table "effects" (scope, id) of the
 * database it runs in; its outcome names that server and database:
 * {"node": <cluster_name>, "db": <database>}.  Prints one line,
 * "<status> <source> <outcome>", and exits 0 unless the run is an error.
 *
 * With id "-", one runner (one connection to each server, for its whole
 * life) runs a message for each id read from standard input, one a line,
 * and prints each one's line; the line "rejected" prints the runner's
 * cache_rejected counter instead.  It ends at the end of its input.
 * IDEM_SECRETS_MAX_AGE_MS in the environment sets secrets_max_age_ms.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "idem_client.h"

static idem_handler_status
effect(PGconn *conn, idem_call *call, void *ud)
{
	const char *params[2] = {idem_call_scope(call), idem_call_id(call)};
	PGresult   *r;

	(void) ud;
	r = PQexecParams(conn,
					 "INSERT INTO effects (scope, id) VALUES ($1, $2) "
					 "RETURNING json_build_object('node', current_setting('cluster_name'), "
					 "'db', current_database())::text",
					 2, NULL, params, NULL, NULL, 0);
	if (PQresultStatus(r) != PGRES_TUPLES_OK)
	{
		fprintf(stderr, "effect failed: %s", PQerrorMessage(conn));
		PQclear(r);
		idem_call_set_json(call, "{\"error\": \"effect failed\"}");
		return IDEM_HANDLER_RETRYABLE;
	}
	idem_call_set_json(call, PQgetvalue(r, 0, 0));
	PQclear(r);
	return IDEM_HANDLER_OK;
}

static void
report(idem_status st, const idem_result *res)
{
	if (st == IDEM_ERROR)
		printf("error %s\n", res->error_message);
	else
		printf("%s %s %.*s\n", idem_status_name(st), idem_source_name(res->source),
			   (int) res->outcome_len, res->outcome);
}

int
main(int argc, char **argv)
{
	idem_options o;
	idem_runner *r;
	idem_result res;
	idem_status st;

	if (argc != 7)
	{
		fprintf(stderr, "usage: %s conninfo valkey_port tenant scope id request\n",
				argv[0]);
		return 2;
	}
	idem_options_init(&o);
	if (getenv("IDEM_SECRETS_MAX_AGE_MS") != NULL)
		o.secrets_max_age_ms = atoi(getenv("IDEM_SECRETS_MAX_AGE_MS"));
	idem_result_init(&res);
	r = idem_runner_open(argv[1], "127.0.0.1", atoi(argv[2]), &o);
	if (r == NULL)
	{
		fprintf(stderr, "idem_runner_open failed\n");
		return 2;
	}
	if (strcmp(argv[5], "-") == 0)
	{
		char		line[256];

		while (fgets(line, sizeof(line), stdin) != NULL)
		{
			line[strcspn(line, "\n")] = '\0';
			if (strcmp(line, "rejected") == 0)
			{
				idem_runner_stats stats;

				idem_runner_stats_init(&stats);
				idem_runner_get_stats(r, &stats);
				printf("rejected %ld\n", stats.cache_rejected);
			}
			else
				report(idem_run(r, atoll(argv[3]), argv[4], line, argv[6],
								effect, NULL, &res), &res);
			fflush(stdout);
		}
		idem_runner_close(r);
		return 0;
	}
	st = idem_run(r, atoll(argv[3]), argv[4], argv[5], argv[6], effect, NULL, &res);
	report(st, &res);
	idem_runner_close(r);
	return st == IDEM_ERROR ? 1 : 0;
}
