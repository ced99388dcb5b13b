/*
 * gate.c
 *	  The gate and the owner check: the Valkey commands a run and a lookup
 *	  send, and what their replies mean.  The client writes no terminal
 *	  value (the server's worker does, once the commit is durable).
 *	  Connections: valkey_conn.c; the release of a marker: release.c.
 *
 *	  The gate is one native command, SET <key> <marker> NX PX <lease> GET:
 *	  atomically, an existing value is returned (and nothing is set), an
 *	  absent key gets our marker.  A replay costs Valkey what a GET costs.
 *	  No TTL comes back: a marker's deadline is in its MACed content
 *	  (trust.c bounds it by our own lease).
 *
 *	  The gate and the read-only lookups carry, in the same round trip, a
 *	  GET of the history epoch's owner key (trust.c): the caller is told
 *	  whether it still holds the token the server gave.  On one node the
 *	  two commands are pipelined; on a cluster the owner key usually lives
 *	  in another slot, and the router sends each node its share before
 *	  reading any reply, so the round trip is the slower node's.  Both go
 *	  through idemc_gate_pipeline (valkey_conn.c).
 *
 *	  Every command touches one key (Valkey Cluster: one slot), and only
 *	  commands that both Redis >= 7.0 and Valkey have are used: GET,
 *	  SET NX PX GET (NX with GET needs 7.0), DEL inside EVAL/EVALSHA,
 *	  SCRIPT LOAD, AUTH, SELECT.
 *
 *	  A failure never fails a run: the gate is skipped and PostgreSQL
 *	  decides.
 */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

#include <hiredis/hiredis.h>

#include "valkey_router.h"
#include "valkey_conn.h"

/* What the check key's reply says (gate_reply.checked). */
static int
check_holds(const redisReply *r, const char *value)
{
	if (r == NULL)
		return GATE_CHECK_NOREPLY;
	if (value == NULL || r->type != REDIS_REPLY_STRING)
		return GATE_CHECK_ABSENT;
	return (r->len == strlen(value) && memcmp(r->str, value, r->len) == 0) ?
		GATE_CHECK_HOLDS : GATE_CHECK_OTHER;
}

/* A GET (or SET ... GET) reply into a gate_reply: GATE_VALUE for a string,
 * GATE_ABSENT for nil (the node answered: the key is not there). */
static void
take_value(gate_reply *out, const redisReply *r)
{
	if (r != NULL && r->type == REDIS_REPLY_NIL)
		out->answer = GATE_ABSENT;
	if (r == NULL || r->type != REDIS_REPLY_STRING ||
		(out->value = malloc(r->len + 1)) == NULL)
		return;
	memcpy(out->value, r->str, r->len);
	out->value[r->len] = '\0';
	out->value_len = r->len;
	out->answer = GATE_VALUE;
}

/* One single-key command of a pipeline, its key argv[1]. */
static void
cmd_init(idem_vc_cmd *c, int argc, const char **argv)
{
	memset(c, 0, sizeof(*c));
	c->key = argv[1];
	c->keylen = strlen(argv[1]);
	c->argc = argc;
	c->argv = argv;
}

void
idemc_gate_enter(idem_gate *g, const char *key, const char *marker,
				const char *lease_ms, const char *check_key,
				const char *check_value, gate_reply *out)
{
	const char *argv[7];
	const char *get[2];
	idem_vc_cmd cmds[2];
	size_t		marker_len = strlen(marker);
	redisReply *r;

	memset(out, 0, sizeof(*out));
	out->answer = GATE_SKIPPED;
	out->checked = GATE_CHECK_NOREPLY;
	if (g == NULL || idemc_gate_resting(g))
		return;
	argv[0] = "SET";
	argv[1] = key;
	argv[2] = marker;
	argv[3] = "NX";
	argv[4] = "PX";
	argv[5] = lease_ms;
	argv[6] = "GET";
	get[0] = "GET";
	get[1] = check_key;
	cmd_init(&cmds[0], 7, argv);
	if (check_key)
		cmd_init(&cmds[1], 2, get);
	idemc_gate_pipeline(g, cmds, check_key ? 2 : 1);
	if (check_key)
	{
		out->checked = check_holds(cmds[1].reply, check_value);
		if (cmds[1].reply)
			freeReplyObject(cmds[1].reply);
	}
	r = cmds[0].reply;
	if (r == NULL)
		return;
	if (r->type == REDIS_REPLY_NIL)
		out->answer = GATE_ACQUIRED;	/* absent: our marker is set */
	else
	{
		take_value(out, r);
		/* our own marker, from a command resent after a dead connection */
		if (out->answer == GATE_VALUE && out->value_len == marker_len &&
			memcmp(out->value, marker, out->value_len) == 0)
		{
			free(out->value);
			out->value = NULL;
			out->value_len = 0;
			out->answer = GATE_ACQUIRED;
		}
	}

	/*
	 * Anything else is an error reply (say WRONGTYPE for a key of another
	 * type, or a server older than Redis 7.0 refusing NX with GET): Valkey
	 * answered but has nothing usable; skip the gate.
	 */
	freeReplyObject(r);
}

void
idemc_gate_get_many(idem_gate *g, const char *const *keys, int n,
				   const char *check_key, const char *check_value,
				   gate_reply *out, int *checked)
{
	int			i;
	int			ncmd = n + (check_key != NULL);
	idem_vc_cmd *cmds;
	const char **argv;

	memset(out, 0, sizeof(*out) * (n > 0 ? n : 0));	/* GATE_SKIPPED */
	*checked = GATE_CHECK_NOREPLY;
	if (g == NULL || n <= 0 || idemc_gate_resting(g))
		return;
	/* split per node by the router; a node that fails skips its keys */
	cmds = malloc(sizeof(idem_vc_cmd) * (size_t) ncmd);
	argv = malloc(sizeof(char *) * 2 * (size_t) ncmd);
	if (cmds != NULL && argv != NULL)
	{
		for (i = 0; i < ncmd; i++)
		{
			argv[2 * i] = "GET";
			argv[2 * i + 1] = i < n ? keys[i] : check_key;
			cmd_init(&cmds[i], 2, &argv[2 * i]);
		}
		idemc_gate_pipeline(g, cmds, ncmd);
		for (i = 0; i < ncmd; i++)
		{
			if (i < n)
				take_value(&out[i], cmds[i].reply);
			else
				*checked = check_holds(cmds[i].reply, check_value);
			if (cmds[i].reply)
				freeReplyObject(cmds[i].reply);
		}
	}
	free(cmds);
	free(argv);
}
