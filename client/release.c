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

/* One EVALSHA or EVAL of the script on KEYS[1] = args[0]. */
static redisReply *
eval_one(idem_gate *g, const char *verb, const char *body, int nargs,
		 const char **args)
{
	const char *argv[8];
	size_t		argvlen[8];
	idem_vc_cmd cmd;
	int			i;

	argv[0] = verb;
	argv[1] = body;
	argv[2] = "1";
	for (i = 0; i < nargs; i++)
		argv[3 + i] = args[i];
	for (i = 0; i < 3 + nargs; i++)
		argvlen[i] = strlen(argv[i]);
	memset(&cmd, 0, sizeof(cmd));
	cmd.key = argv[3];
	cmd.keylen = argvlen[3];
	cmd.argc = 3 + nargs;
	cmd.argv = argv;
	cmd.argvlen = argvlen;
	idemc_gate_pipeline(g, &cmd, 1);
	return cmd.reply;
}

/* EVALSHA, and EVAL if the server lost the script (SCRIPT FLUSH). */
static redisReply *
eval(idem_gate *g, const char *sha, const char *script, int nargs,
	 const char **args)
{
	redisReply *r = eval_one(g, "EVALSHA", sha, nargs, args);

	if (r && r->type == REDIS_REPLY_ERROR &&
		idem_vk_error_code_is(r->str, r->len, "NOSCRIPT"))
	{
		freeReplyObject(r);
		r = eval_one(g, "EVAL", script, nargs, args);
	}
	return r;
}

int
idemc_gate_release(idem_gate *g, const char *key, const char *marker)
{
	const char *args[2];
	redisReply *r;
	int			rc = -1;

	if (g == NULL || idemc_gate_resting(g))
		return -1;
	args[0] = key;
	args[1] = marker;
	r = eval(g, idemc_cad_sha1, idemc_cad_script, 2, args);
	if (r == NULL)
		return -1;
	if (r->type == REDIS_REPLY_INTEGER)
		rc = r->integer > 0 ? 1 : 0;
	freeReplyObject(r);
	return rc;
}
