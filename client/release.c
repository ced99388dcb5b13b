/*
 * release.c
 *	  Compare-and-delete of our own marker: a run that leaves no result
 *	  deletes its marker only if it is still ours, with a Lua script named
 *	  by its SHA-1 (EVALSHA).  Every connection's setup loads it (SCRIPT
 *	  LOAD, checked against the SHA-1, valkey_conn.c); a server that lost
 *	  it since (SCRIPT FLUSH) answers NOSCRIPT, and EVAL runs it (and
 *	  caches it there).
 *
 *	  The Python client (client/python/idem/runner.py, CAD_SCRIPT) sends the
 *	  same text, so the same SHA-1: its unit tests compare both constants
 *	  here with it, byte for byte.
 */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

#include <hiredis/hiredis.h>

#include "valkey_conn.h"
#include "valkey_reply.h"

/* KEYS[1] = key, ARGV[1] = our marker: delete it only if it is still ours. */
const char idemc_cad_script[] =
"if redis.call('GET', KEYS[1]) == ARGV[1] then\n"
"  return redis.call('DEL', KEYS[1])\n"
"end\n"
"return 0\n";

/*
 * idemc_cad_script's SHA-1: its EVALSHA name.  The connect checks it against what
 * SCRIPT LOAD answers, so a script changed without it fails every connect.
 */
const char idemc_cad_sha1[] = "c89cee65b7ab260d98c281f3c3eb6fa7c992cdd2";

/* One EVALSHA or EVAL of the script (body: its SHA-1 or its text). */
static redisReply *
eval_one(idem_gate *g, const char *verb, const char *body, const char *key,
		 const char *marker)
{
	const char *argv[5] = {verb, body, "1", key, marker};
	idem_vc_cmd cmd;

	memset(&cmd, 0, sizeof(cmd));
	cmd.key = key;
	cmd.keylen = strlen(key);
	cmd.argc = 5;
	cmd.argv = argv;
	idemc_gate_pipeline(g, &cmd, 1);
	return cmd.reply;
}

int
idemc_gate_release(idem_gate *g, const char *key, const char *marker)
{
	redisReply *r;
	int			rc = -1;

	if (g == NULL || idemc_gate_resting(g))
		return -1;
	r = eval_one(g, "EVALSHA", idemc_cad_sha1, key, marker);
	/* the server lost the script since the connect (SCRIPT FLUSH) */
	if (r && r->type == REDIS_REPLY_ERROR &&
		idem_vk_error_code_is(r->str, r->len, "NOSCRIPT"))
	{
		freeReplyObject(r);
		r = eval_one(g, "EVAL", idemc_cad_script, key, marker);
	}
	if (r == NULL)
		return -1;
	if (r->type == REDIS_REPLY_INTEGER)
		rc = r->integer > 0 ? 1 : 0;
	freeReplyObject(r);
	return rc;
}
