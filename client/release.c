/*
 * release.c
 *	  Compare-and-delete of our own marker: a run that leaves no result
 *	  deletes its marker only if it is still ours, with a Lua script named
 *	  by its SHA-1 (EVALSHA).  The connect loads it (SCRIPT LOAD, checked
 *	  against the SHA-1, valkey_conn.c); a server that lost it (SCRIPT
 *	  FLUSH, restart) or a cluster node that never saw it answers NOSCRIPT,
 *	  and EVAL runs it (and caches it there).
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

/* EVALSHA, and EVAL if the server lost the script (SCRIPT FLUSH, restart). */
static redisReply *
eval(idem_gate *g, const char *sha, const char *script, int nargs,
	 const char **args)
{
	const char *argv[8];
	size_t		argvlen[8];
	redisReply *r;
	int			i;

	if (idemc_gate_ensure(g) != 0)
		return NULL;
	argv[0] = "EVALSHA";
	argv[1] = sha;
	argv[2] = "1";
	for (i = 0; i < nargs; i++)
		argv[3 + i] = args[i];
	for (i = 0; i < 3 + nargs; i++)
		argvlen[i] = strlen(argv[i]);
	r = idemc_vk_command(g, 3 + nargs, argv, argvlen);
	if (r && r->type == REDIS_REPLY_ERROR && strncmp(r->str, "NOSCRIPT", 8) == 0)
	{
		freeReplyObject(r);
		argv[0] = "EVAL";
		argv[1] = script;
		argvlen[0] = 4;
		argvlen[1] = strlen(script);
		r = idemc_vk_command(g, 3 + nargs, argv, argvlen);
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
