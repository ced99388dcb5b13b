/*
 * abi_first.c: a program built against the first idem_client.h with
 * struct_size (tests/abi_first/, frozen), run against this library, as a
 * program built before later fields were added and never rebuilt.  Its
 * structs are smaller than the library's; each is allocated at exactly its
 * size, so that AddressSanitizer (the asan pass links the instrumented
 * static library) reports any write past it.  The library must accept
 * them, fill them, and touch nothing beyond.
 *
 * Needs the servers of tests/run.sh (IDEM_TEST_PGHOST, _PGPORT, _DB,
 * _VALKEY_PORT, _SUFFIX).
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "idem_client.h"		/* tests/abi_first/idem_client.h */
#include "../tap.h"

static const char *
env_or(const char *name, const char *dflt)
{
	const char *v = getenv(name);

	return v && v[0] ? v : dflt;
}

static idem_handler_status
handler(PGconn *conn, idem_call *call, void *ud)
{
	(void) conn;
	(*(int *) ud)++;
	idem_call_set_json(call, "{\"v\": 1}");
	return IDEM_HANDLER_OK;
}

int
main(void)
{
	char		ci[512],
				scope[64],
				id[64];
	idem_options *o = malloc(sizeof(idem_options));
	idem_result *res = malloc(sizeof(idem_result));
	idem_runner_stats *st = malloc(sizeof(idem_runner_stats));
	idem_runner *r;
	int			calls = 0;

	if (!o || !res || !st)
		return 1;
	snprintf(ci, sizeof(ci), "host=%s port=%s dbname=%s connect_timeout=5",
			 env_or("IDEM_TEST_PGHOST", "127.0.0.1"),
			 env_or("IDEM_TEST_PGPORT", "5432"), env_or("IDEM_TEST_DB", "idemtest"));
	snprintf(scope, sizeof(scope), "abi%s", env_or("IDEM_TEST_SUFFIX", ""));
	snprintf(id, sizeof(id), "first-%d-%ld", (int) getpid(), (long) time(NULL));

	tap_diag("the first layouts: idem_options %zu, idem_result %zu, idem_runner_stats %zu bytes",
			 sizeof(idem_options), sizeof(idem_result), sizeof(idem_runner_stats));
	idem_options_init(o);
	tap_ok(o->struct_size == sizeof(idem_options) && o->lease_ms == 30000 &&
		   o->lookup_first == 1 && o->prepared_statements == -1,
		   "idem_options_init (the library's) sets up the caller's layout with its defaults (struct_size %zu)",
		   o->struct_size);
	o->lease_ms = 5000;
	r = idem_runner_open(ci, "127.0.0.1", atoi(env_or("IDEM_TEST_VALKEY_PORT", "6379")), o);
	idem_result_init(res);
	tap_ok(res->struct_size == sizeof(idem_result),
		   "idem_result_init sets up the caller's layout (struct_size %zu)", res->struct_size);
	idem_run(r, 1, scope, id, "{\"n\": 1}", handler, &calls, res);
	tap_ok(res->status == IDEM_APPLIED && calls == 1 && strcmp(res->outcome, "{\"v\": 1}") == 0 &&
		   res->struct_size == sizeof(idem_result),
		   "a run with options and a result of the first layout: applied (%s %s)",
		   idem_status_name(res->status), res->error_message);
	idem_run(r, 1, scope, id, "{\"n\": 1}", handler, &calls, res);
	tap_ok(res->status == IDEM_REPLAYED && calls == 1 && strcmp(res->outcome, "{\"v\": 1}") == 0,
		   "its redelivery: replayed (%s %s)", idem_status_name(res->status), res->error_message);
	idem_runner_stats_init(st);
	idem_runner_get_stats(r, st);
	tap_ok(st->struct_size == sizeof(idem_runner_stats) && st->runs == 2 &&
		   st->pg_connects >= 1,
		   "idem_runner_get_stats fills the first layout (runs %ld, pg_connects %ld)",
		   st->runs, st->pg_connects);
	idem_runner_close(r);
	free(o);
	free(res);
	free(st);
	return tap_done();
}
