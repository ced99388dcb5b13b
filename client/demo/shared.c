/*
 * shared.c
 *	  What the parent and its worker processes share: the demo_shared block
 *	  (mapped before the first fork, so every child sees the same one), the
 *	  sum of the workers' counters, the last error, the clock, and the
 *	  runner every worker and consumer opens.  Every
 *	  other file of the demo stands on it; it calls none of them.
 */
#include "demo.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>

demo_shared *g_shared;

/* Map the shared block, zeroed; 0, or -1 after saying why on stderr. */
int
demo_shared_open(void)
{
	g_shared = mmap(NULL, sizeof(demo_shared), PROT_READ | PROT_WRITE,
					MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (g_shared == MAP_FAILED)
	{
		perror("idem-demo: mmap");
		return -1;
	}
	memset(g_shared, 0, sizeof(*g_shared));
	return 0;
}

void
demo_shared_close(void)
{
	munmap(g_shared, sizeof(demo_shared));
	g_shared = NULL;
}

int64_t
demo_now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t) ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void
demo_note_error(const char *fmt,...)
{
	va_list		ap;

	va_start(ap, fmt);
	vsnprintf(g_shared->last_error, sizeof(g_shared->last_error), fmt, ap);
	va_end(ap);
}

void
demo_counters_sum(demo_counters *out)
{
	int			i;
	size_t		j,
				n = sizeof(demo_counters) / sizeof(long);

	memset(out, 0, sizeof(*out));
	for (i = 0; i < DEMO_MAX_WORKERS; i++)
	{
		const long *src = (const long *) &g_shared->slot[i];
		long	   *dst = (long *) out;

		for (j = 0; j < n; j++)
			dst[j] += __atomic_load_n(&src[j], __ATOMIC_RELAXED);
	}
}

/* A runner with the demo's options (lease, cache); NULL on failure. */
idem_runner *
demo_runner_open(const demo_config *cfg)
{
	idem_options opts;

	idem_options_init(&opts);
	opts.lease_ms = cfg->lease_ms;
	opts.valkey_db = cfg->cache_db;
	opts.valkey_retry_ms = 300;
	opts.valkey_nodes = cfg->cache_nodes;
	return idem_runner_open(cfg->pg, cfg->cache_host[0] ? cfg->cache_host : NULL,
							cfg->cache_port, &opts);
}
