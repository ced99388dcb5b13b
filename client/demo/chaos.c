/*
 * chaos.c
 *	  Faults injected while the workers run: kill -9 of a random worker (the
 *	  parent restarts it; its pending messages are XAUTOCLAIMed by the others
 *	  after the lease), a restart of the cache Valkey (a shell command given
 *	  by test/demo: SIGKILL, down for a moment, back empty; on a cluster it
 *	  kills a master), FLUSHALL of the cache Valkey (FLUSHDB when it shares
 *	  a server with the queue; on a cluster, of one master), and
 *	  pg_terminate_backend of random worker backends.  With stage two
 *	  (notices.c) also kill -9 of its consumers, and kill -9 of the server's
 *	  idem worker or outbox publisher (PostgreSQL then restarts every
 *	  backend, as after any crash).  The queue's Valkey is never touched: it
 *	  is the at-least-once delivery that the demo relies on; nor are the
 *	  notifications' streams when the publisher puts them in the cache (its
 *	  flushes then delete every key but the streams, and stand in for its
 *	  restarts).
 */
#include "demo.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

typedef enum
{
	EV_KILL = 0, EV_TERMINATE, EV_FLUSH, EV_RESTART, EV_SERVER_KILL, EV_COUNT
} chaos_event;

struct chaos
{
	const demo_config *cfg;
	PGconn	   *admin;
	int64_t		next_at;
	int			order[EV_COUNT];	/* first events: each kind once */
	int			nfired;
	unsigned	rng;
	pid_t		restart_pid;	/* a cache restart in progress */
	int			server_kill_owed;	/* the last ones could not be done */
};

static void reap_restart(chaos *c, int wait);

static int
crand(chaos *c, int n)
{
	c->rng = c->rng * 1103515245u + 12345u;
	return n <= 0 ? 0 : (int) ((c->rng >> 8) % (unsigned) n);
}

static void
schedule(chaos *c)
{
	int			iv = c->cfg->chaos_interval_ms;

	c->next_at = demo_now_ms() + iv / 2 + crand(c, iv + 1);
}

chaos *
chaos_new(const demo_config *cfg)
{
	chaos	   *c = calloc(1, sizeof(chaos));
	int			i;

	if (c == NULL)
		return NULL;
	c->cfg = cfg;
	c->rng = cfg->seed ^ 0x5eed;
	for (i = 0; i < EV_COUNT; i++)
		c->order[i] = i;
	for (i = EV_COUNT - 1; i > 0; i--)
	{
		int			j = crand(c, i + 1),
					t = c->order[i];

		c->order[i] = c->order[j];
		c->order[j] = t;
	}
	/* the first fault once the workers are going */
	c->next_at = demo_now_ms() + cfg->chaos_interval_ms / 2;
	return c;
}

void
chaos_free(chaos *c)
{
	if (c == NULL)
		return;
	reap_restart(c, 1);			/* never leave the cache down */
	if (c->admin)
		PQfinish(c->admin);
	free(c);
}

/* The chaos's own PostgreSQL connection, (re)made; 0 when down. */
static int
admin_conn(chaos *c)
{
	if (c->admin == NULL || PQstatus(c->admin) != CONNECTION_OK)
	{
		if (c->admin)
			PQfinish(c->admin);
		c->admin = PQconnectdb(c->cfg->pg);
		if (PQstatus(c->admin) != CONNECTION_OK)
			return 0;
	}
	return 1;
}

static void
terminate_backends(chaos *c)
{
	PGresult   *r;
	char		sql[256];

	if (!admin_conn(c))
		return;
	snprintf(sql, sizeof(sql),
			 "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM "
			 "(SELECT pid FROM pg_stat_activity WHERE application_name ~ '^idem-demo-[wc]' "
			 "AND pid <> pg_backend_pid() ORDER BY random() LIMIT %d) s",
			 1 + crand(c, 2));
	r = PQexec(c->admin, sql);
	if (PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1)
	{
		g_shared->backends_terminated += atol(PQgetvalue(r, 0, 0));
		g_shared->terminate_events++;
	}
	PQclear(r);
}

/* FLUSHALL (FLUSHDB on a shared server) on one cache node; 1 if done. */
static int
flush_node(chaos *c, const char *host, int port)
{
	struct timeval tv = {1, 0};
	redisContext *rc;
	redisReply *r;
	int			done;

	rc = redisConnectWithTimeout(host, port, tv);
	if (rc == NULL || rc->err)
	{
		if (rc)
			redisFree(rc);
		return 0;
	}
	redisSetTimeout(rc, tv);
	if (c->cfg->shared_valkey)
	{
		/* one server for queue and cache: flush only the cache's database */
		r = redisCommand(rc, "SELECT %d", c->cfg->cache_db);
		if (r)
			freeReplyObject(r);
		r = redisCommand(rc, "FLUSHDB");
	}
	else if (c->cfg->notices > 0 && c->cfg->notice_in_cache)
	{
		/* the notifications' streams live here: every other key goes */
		r = redisCommand(rc, "EVAL %s 0",
						 "for _, k in ipairs(redis.call('KEYS', '*')) do "
						 "if redis.call('TYPE', k).ok ~= 'stream' then "
						 "redis.call('DEL', k) end end return 'OK'");
		if (r && r->type == REDIS_REPLY_STRING)
			r->type = REDIS_REPLY_STATUS;
	}
	else
		r = redisCommand(rc, "FLUSHALL");
	done = r && r->type == REDIS_REPLY_STATUS;
	if (r)
		freeReplyObject(r);
	redisFree(rc);
	return done;
}

/* The cache's nodes: the seed, then --valkey-nodes; 0 when past the end. */
static int
cache_node(const chaos *c, int i, char *host, size_t hostlen, int *port)
{
	const char *p = c->cfg->cache_nodes;

	if (i == 0)
	{
		snprintf(host, hostlen, "%s", c->cfg->cache_host);
		*port = c->cfg->cache_port;
		return 1;
	}
	while (p && *p)
	{
		size_t		len = strcspn(p, ",");
		const char *colon = len ? memrchr(p, ':', len) : NULL;

		if (colon && --i == 0)
		{
			/* [v6]:port */
			const char *h = p,
					   *he = colon;

			if (*h == '[' && he > h && he[-1] == ']')
			{
				h++;
				he--;
			}
			snprintf(host, hostlen, "%.*s", (int) (he - h), h);
			*port = atoi(colon + 1);
			return 1;
		}
		p += len;
		if (*p == ',')
			p++;
	}
	return 0;
}

/*
 * Flush the cache.  One server: FLUSHALL.  A cluster: by default one
 * master, chosen at random (a node that loses its data; its replica
 * follows), or every master (--cluster-flush all: the whole cache lost at
 * once, a harsher fault than a cluster is built for).  Replicas refuse
 * FLUSHALL, so nodes are tried from a random one until a master takes it.
 */
static void
flush_cache(chaos *c)
{
	char		host[128];
	int			port,
				n = 0,
				i,
				done = 0;

	if (c->cfg->cache_nodes == NULL)
		done = flush_node(c, c->cfg->cache_host, c->cfg->cache_port);
	else
	{
		int			start;

		while (cache_node(c, n, host, sizeof(host), &port))
			n++;
		start = crand(c, n);
		for (i = 0; i < n; i++)
		{
			if (!cache_node(c, (start + i) % n, host, sizeof(host), &port) ||
				!flush_node(c, host, port))
				continue;
			done++;
			if (!c->cfg->flush_all_masters)
				break;
		}
	}
	if (done)
	{
		g_shared->flushes++;
		g_shared->masters_flushed += c->cfg->cache_nodes ? done : 0;
		misses_note_event(DEMO_EV_FLUSH, demo_now_ms(), demo_now_ms());
	}
}

/* The restart runs in the background (it takes a moment); one at a time. */
static void
restart_cache(chaos *c)
{
	pid_t		pid;

	if (c->cfg->cache_restart_cmd == NULL || c->cfg->shared_valkey ||
		c->restart_pid > 0 || (c->cfg->notices > 0 && c->cfg->notice_in_cache))
	{
		flush_cache(c);			/* the closest thing we may do */
		return;
	}
	fflush(stdout);
	fflush(stderr);
	pid = fork();
	if (pid == 0)
	{
		execl("/bin/sh", "sh", "-c", c->cfg->cache_restart_cmd, (char *) NULL);
		_exit(127);
	}
	if (pid > 0)
	{
		c->restart_pid = pid;
		/* down (or failing over) until the command is done */
		misses_note_event(DEMO_EV_FAILOVER, demo_now_ms(), 0);
	}
}

static void
reap_restart(chaos *c, int wait)
{
	int			st;

	if (c->restart_pid <= 0)
		return;
	if (waitpid(c->restart_pid, &st, wait ? 0 : WNOHANG) != c->restart_pid)
		return;
	c->restart_pid = 0;
	misses_event_ended(DEMO_EV_FAILOVER, demo_now_ms());
	if (WIFEXITED(st) && WEXITSTATUS(st) == 0)
		g_shared->cache_restarts++;
	else
	{
		g_shared->cache_restart_failures++;
		demo_note_error("cache restart command failed (status %d)", st);
	}
}

/*
 * kill -9 of the server's idem worker or of a publisher, at random.  When
 * the demo may not signal the server's processes (another user's server),
 * pg_terminate_backend instead.
 */
static int
kill_server_idem(chaos *c)
{
	PGresult   *r;
	pid_t		pid;

	if (!admin_conn(c))
		return 0;				/* down: the crash restart of the last one */
	r = PQexec(c->admin,
			   "SELECT pid FROM pg_stat_activity WHERE backend_type IN "
			   "('idem worker', 'idem outbox publisher') ORDER BY random() LIMIT 1");
	if (PQresultStatus(r) != PGRES_TUPLES_OK || PQntuples(r) != 1)
	{
		demo_note_error("chaos: no idem process of the server to kill: %s",
						PQresultStatus(r) == PGRES_TUPLES_OK ? "none running" :
						PQerrorMessage(c->admin));
		PQclear(r);
		return 0;
	}
	pid = (pid_t) atol(PQgetvalue(r, 0, 0));
	PQclear(r);
	if (kill(pid, SIGKILL) == 0)
	{
		/* the restart after the crash starts a new history epoch: what
		 * Valkey held is never read again, as after a flush */
		misses_note_event(DEMO_EV_FLUSH, demo_now_ms(), demo_now_ms());
		g_shared->server_kills++;
		PQfinish(c->admin);		/* the crash restart ends it */
		c->admin = NULL;
	}
	else
	{
		char		sql[64];

		snprintf(sql, sizeof(sql), "SELECT pg_terminate_backend(%d)", (int) pid);
		r = PQexec(c->admin, sql);
		if (PQresultStatus(r) == PGRES_TUPLES_OK)
			g_shared->server_terms++;
		PQclear(r);
	}
	return 1;
}

int
chaos_tick(chaos *c, pid_t *pids, int n, int nworkers)
{
	int			ev,
				killed = -1;
	int64_t		t0;

	reap_restart(c, 0);
	if (demo_now_ms() < c->next_at)
		return -1;
	ev = c->nfired < EV_COUNT ? c->order[c->nfired] :
		crand(c, 100) < 4 ? EV_SERVER_KILL : crand(c, 100) < 35 ? EV_KILL :
		crand(c, 100) < 50 ? EV_TERMINATE : crand(c, 100) < 60 ? EV_FLUSH : EV_RESTART;
	if (c->server_kill_owed > 0)
		ev = EV_SERVER_KILL;
	if (ev == EV_SERVER_KILL && c->cfg->notices == 0)
		ev = EV_KILL;			/* stage one's chaos, as before stage two */
	c->nfired++;
	t0 = demo_now_ms();
	switch (ev)
	{
		case EV_KILL:
			{
				int			s = crand(c, n);

				if (pids[s] > 0 && kill(pids[s], SIGKILL) == 0)
				{
					if (s < nworkers)
						g_shared->kills++;
					else
						g_shared->notice_kills++;
					killed = s;
				}
				break;
			}
		case EV_SERVER_KILL:
			/*
			 * Not done (the server still restarting, its idem worker not
			 * back yet): the next event tries again, three times at most.
			 */
			if (kill_server_idem(c) || ++c->server_kill_owed > 3)
				c->server_kill_owed = 0;
			break;
		case EV_TERMINATE:
			terminate_backends(c);
			break;
		case EV_FLUSH:
			flush_cache(c);
			break;
		case EV_RESTART:
			restart_cache(c);
			break;
	}
	if (c->cfg->verbose)
		fprintf(stderr, "chaos: %s (%lld ms)\n",
				ev == EV_KILL ? "kill -9 a worker or consumer" :
				ev == EV_SERVER_KILL ? "kill -9 the server's idem worker or publisher" :
				ev == EV_TERMINATE ?
				"terminate backends" : ev == EV_FLUSH ?
				(c->cfg->cache_nodes && !c->cfg->flush_all_masters ?
				 "flush a cache master" : "flush the cache") :
				c->cfg->cache_nodes ? "kill a cache master" : "restart the cache", (long long) (demo_now_ms() - t0));
	schedule(c);
	return killed;
}

void
chaos_describe(const chaos *c, char *buf, size_t len)
{
	snprintf(buf, len, "%ld kill -9, %ld backends terminated, %ld FLUSHALL%s, %ld %s",
			 g_shared->kills, g_shared->backends_terminated, g_shared->flushes,
			 c->cfg->cache_nodes ? c->cfg->flush_all_masters ?
			 " (every master)" : " (one master each)" : "",
			 g_shared->cache_restarts,
			 c->cfg->cache_nodes ? "cache masters killed (failovers)" : "cache restarts");
	(void) c;
}
