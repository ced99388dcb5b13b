/*
 * misses.c
 *	  Why a replay missed Valkey: every replay of a stored result that came
 *	  from PostgreSQL is put in one bucket, so the report can say what the
 *	  cache lost and why (and a defect that makes replays miss shows up as
 *	  "absent, no known cause").
 *
 *	  Shared memory, written before fork: per task, when a worker first saw
 *	  its result committed (monotonic ms; 0: not seen yet) and when it last
 *	  missed; per chaos event, when it happened (the parent appends, the
 *	  workers read; one writer, so plain stores are enough).
 *
 *	  Buckets, first match wins:
 *	    not asked     Valkey was not asked: the key's node down or resting
 *	                  after a failure (the gate fell back), or no gate for
 *	                  a first delivery
 *	    unseen        the node answered "not there"; no worker saw the
 *	                  result committed (a kill -9 or a lost COMMIT reply
 *	                  right after it): no timing to judge by
 *	    flushed       the node answered "not there" and a flush happened
 *	                  since the result's commit
 *	    failover      ... a master was killed (or its failover still ran)
 *	                  since the commit: a copy lost with the node, or
 *	                  waiting for the replica's promotion
 *	    copy lag      ... within 1 s of the commit, no chaos between: the
 *	                  server's worker had not copied it yet
 *	    not refilled  ... missed before, and no chaos since that miss's
 *	                  replay from PostgreSQL (which should have copied the
 *	                  result back)
 *	    unexplained   ... none of the above
 */
#include "demo.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define COPY_LAG_MS 1000

static int64_t *task_done_ms;	/* per task: result seen committed */
static int64_t *task_miss_ms;	/* per task: last replay from PostgreSQL */
static int	ntasks;

int
misses_init(int n)
{
	size_t		sz = sizeof(int64_t) * (size_t) (n > 0 ? n : 1);

	task_done_ms = mmap(NULL, 2 * sz, PROT_READ | PROT_WRITE,
						MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (task_done_ms == MAP_FAILED)
	{
		task_done_ms = NULL;
		return -1;
	}
	memset(task_done_ms, 0, 2 * sz);
	task_miss_ms = task_done_ms + (n > 0 ? n : 1);
	ntasks = n;
	return 0;
}

/* The task's index in the plan, from its id (workload.c: r<tag>-<i>,
 * INV-<tag>-<i>); -1 for a purge or anything else. */
static int
task_index(const queue_msg *m)
{
	const char *id = strcmp(m->kind, "invoice.pay") == 0 ? m->invoice :
		strcmp(m->kind, "transfer.create") == 0 ? m->run_id : NULL;
	const char *dash = id ? strrchr(id, '-') : NULL;
	long		i;

	if (dash == NULL)
		return -1;
	i = strtol(dash + 1, NULL, 10);
	return i >= 0 && i < ntasks ? (int) i : -1;
}

void
misses_note_done(const queue_msg *m)
{
	int			i = task_index(m);
	int64_t		zero = 0;

	if (i >= 0 && task_done_ms)
		__atomic_compare_exchange_n(&task_done_ms[i], &zero, demo_now_ms(), 0,
									__ATOMIC_RELAXED, __ATOMIC_RELAXED);
}

void
misses_note_event(int kind, int64_t start_ms, int64_t end_ms)
{
	int			n = g_shared->nevents;

	if (n >= DEMO_MAX_EVENTS)
		return;
	g_shared->events[n].kind = kind;
	g_shared->events[n].start_ms = start_ms;
	g_shared->events[n].end_ms = end_ms;
	__atomic_store_n(&g_shared->nevents, n + 1, __ATOMIC_RELEASE);
}

/* The parent: the event it started (a failover) is over. */
void
misses_event_ended(int kind, int64_t end_ms)
{
	int			n = g_shared->nevents;

	while (n-- > 0)
		if (g_shared->events[n].kind == kind && g_shared->events[n].end_ms == 0)
		{
			__atomic_store_n(&g_shared->events[n].end_ms, end_ms, __ATOMIC_RELEASE);
			return;
		}
}

/* Did an event of this kind happen (or still run) within (from, to]? */
static int
event_between(int kind, int64_t from, int64_t to)
{
	int			n = __atomic_load_n(&g_shared->nevents, __ATOMIC_ACQUIRE),
				i;

	for (i = 0; i < n; i++)
	{
		const demo_event *e = &g_shared->events[i];
		int64_t		end = __atomic_load_n(&e->end_ms, __ATOMIC_ACQUIRE);

		if (e->kind != kind)
			continue;
		if (end == 0)
			end = to;			/* still going */
		if (e->start_ms <= to && end > from)
			return 1;
	}
	return 0;
}

void
misses_note_pg_replay(demo_counters *c, const queue_msg *m, int valkey_asked)
{
	int			i = task_index(m);
	int64_t		now = demo_now_ms(),
				done = i >= 0 && task_done_ms ? task_done_ms[i] : 0,
				prev = i >= 0 && task_miss_ms ? task_miss_ms[i] : 0;
	long	   *bucket;

	if (!valkey_asked)
		bucket = &c->miss_not_asked;
	else if (done == 0)
		bucket = &c->miss_unseen;	/* its commit was not seen */
	else if (event_between(DEMO_EV_FLUSH, done, now))
		bucket = &c->miss_flushed;
	else if (event_between(DEMO_EV_FAILOVER, done, now))
		bucket = &c->miss_failover;
	else if (now - done < COPY_LAG_MS)
		bucket = &c->miss_copy_lag;
	else if (prev > done && !event_between(DEMO_EV_FLUSH, prev, now) &&
			 !event_between(DEMO_EV_FAILOVER, prev, now))
		bucket = &c->miss_not_refilled;
	else
		bucket = &c->miss_unexplained;
	__atomic_add_fetch(bucket, 1, __ATOMIC_RELAXED);
	if (i >= 0 && task_miss_ms)
		__atomic_store_n(&task_miss_ms[i], now, __ATOMIC_RELAXED);
	misses_note_done(m);		/* PostgreSQL holds it now, at the latest */
}
