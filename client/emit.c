/*
 * emit.c
 *	  A C handler's outgoing messages (idem_call_emit): kept in the call
 *	  while the handler runs, then recorded by idem_emit in the run's last
 *	  pipeline (savepoint released; messages; completion; COMMIT), so that
 *	  they commit with the effect and its key, or not at all, at no round
 *	  trip of their own.  A handler that reports a failure emits nothing:
 *	  its messages are dropped with its writes.
 *
 *	  The messages are one JSON array parameter, [[stream, message], ...],
 *	  which one statement records in order, naming the run's key:
 *	  idem_emit_many(tenant, key, messages) for a tenant's run (on Citus,
 *	  delegated to the node that holds the claim), idem_emit(stream,
 *	  message, key) per element for the platform's.  Each message's id is
 *	  then "<the run's key in hex>-<n>", n its position among the run's
 *	  emits in the transaction.
 *
 *	  Nothing here talks to a server.  Locking: none (a call is its
 *	  runner's, used by one thread).
 */
#include "run.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Append n bytes to the call's array; 0, or -1 out of memory. */
static int
emits_put(idem_call *c, const char *s, size_t n)
{
	if (c->emits_len + n + 1 > c->emits_cap)
	{
		size_t		cap = c->emits_cap ? c->emits_cap : 256;
		char	   *grown;

		while (cap < c->emits_len + n + 1)
			cap *= 2;
		grown = realloc(c->emits, cap);
		if (grown == NULL)
			return -1;
		c->emits = grown;
		c->emits_cap = cap;
	}
	memcpy(c->emits + c->emits_len, s, n);
	c->emits_len += n;
	c->emits[c->emits_len] = '\0';
	return 0;
}

/* The stream's name as a JSON string ("..." with \", \\ and \u00XX), or
 * NULL out of memory. */
static char *
json_string(const char *s)
{
	size_t		n = strlen(s);
	char	   *out = malloc(n * 6 + 3);
	char	   *o = out;

	if (out == NULL)
		return NULL;
	*o++ = '"';
	for (; *s; s++)
	{
		unsigned char ch = (unsigned char) *s;

		if (ch == '"' || ch == '\\')
		{
			*o++ = '\\';
			*o++ = (char) ch;
		}
		else if (ch < 0x20)
			o += sprintf(o, "\\u%04x", ch);
		else
			*o++ = (char) ch;
	}
	*o++ = '"';
	*o = '\0';
	return out;
}

int
idem_call_emit(idem_call *c, const char *stream, const char *message_json)
{
	char	   *name;
	char	   *canon;
	char	   *check;
	size_t		clen;
	size_t		before;
	char		err[160];
	int			rc;

	if (c == NULL || stream == NULL || stream[0] == '\0' || message_json == NULL)
	{
		errno = EINVAL;
		return -1;
	}
	name = json_string(stream);
	if (name == NULL)
	{
		c->oom = 1;
		errno = ENOMEM;
		return -1;
	}
	/* the name must be UTF-8 and the message JSON, as jsonb takes them */
	errno = 0;
	check = idem_json_canonical(name, strlen(name), &clen, err, sizeof(err));
	canon = check ? idem_json_canonical(message_json, strlen(message_json),
										&clen, err, sizeof(err)) : NULL;
	free(check);
	if (canon == NULL)
	{
		free(name);
		if (errno == ENOMEM)
			c->oom = 1;
		else
			errno = EINVAL;
		return -1;
	}
	/* the array is kept closed: a message after the first replaces its "]" */
	before = c->emits_len;
	if (c->nemits > 0)
		c->emits_len--;
	rc = emits_put(c, c->nemits == 0 ? "[[" : ", [", c->nemits == 0 ? 2 : 3);
	if (rc == 0)
		rc = emits_put(c, name, strlen(name));
	if (rc == 0)
		rc = emits_put(c, ", ", 2);
	if (rc == 0)
		rc = emits_put(c, canon, clen);
	if (rc == 0)
		rc = emits_put(c, "]]", 2);
	free(name);
	free(canon);
	if (rc != 0)
	{
		/* as it was; the run fails for want of memory all the same */
		c->emits_len = before;
		if (c->emits && c->nemits > 0)
			c->emits[before - 1] = ']';
		if (c->emits)
			c->emits[before] = '\0';
		c->oom = 1;
		errno = ENOMEM;
		return -1;
	}
	c->nemits++;
	return 0;
}

void
idemc_emit_cmd(run_state *s, const idem_call *call, pg_cmd *c)
{
	int			i = idemc_run_params_key(s, c, STMT_EMIT_T);

	c->values[i++] = call->emits;
	c->nparams = i;
}
