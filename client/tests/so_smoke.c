/*
 * so_smoke.c: the shared library, linked as an application would link it
 * (only idem_client.h, -lidemclient): the public symbols resolve, the
 * internal ones are not exported, and the digests match the static build's
 * test vectors.
 */
#include <dlfcn.h>
#include <string.h>

#include "idem_client.h"
#include "tap.h"

int
main(void)
{
	uint8_t		k[IDEM_DIGEST_BYTES];
	char		h[65];
	size_t		n,
				i;
	char	   *c;
	idem_options o;
	idem_runner *r;

	tap_ok(idem_key("billing.charge", "run-42", k) == 0, "idem_key through the shared library");
	for (i = 0; i < 32; i++)
		snprintf(h + 2 * i, 3, "%02x", k[i]);
	tap_ok(strcmp(h, "5c76c6f58eff897da07846a990b77e88e8a0d282df751a06dfd7653c771f32cd") == 0,
		   "same key bytes as the static library and SQL");
	c = idem_json_canonical("{\"b\":1,\"a\":[1e2]}", 17, &n, NULL, 0);
	tap_ok(c && strcmp(c, "{\"a\": [100], \"b\": 1}") == 0, "idem_json_canonical through the shared library");
	idem_free(c);
	idem_options_init(&o);
	r = idem_runner_open("host=127.0.0.1 port=1 connect_timeout=1", NULL, 0, &o);
	tap_ok(r != NULL, "idem_runner_open without Valkey");
	idem_runner_close(r);
	tap_ok(idem_client_version() == IDEM_CLIENT_VERSION_NUM,
		   "the library's version is the header's (%d)", idem_client_version());
	tap_ok(dlsym(RTLD_DEFAULT, "idemc_gate_enter") == NULL &&
		   dlsym(RTLD_DEFAULT, "idem_sha256_init") == NULL &&
		   dlsym(RTLD_DEFAULT, "idem_run") != NULL,
		   "only the public API is exported");
	return tap_done();
}
