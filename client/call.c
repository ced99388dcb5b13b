/*
 * call.c
 *	  What a handler sees of its run (the idem_call accessors and
 *	  idem_call_set_json), and the names of the statuses and sources.
 *	  pg_step() fills the idem_call; nothing here talks to a server.
 */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

/* ---- names ---- */

const char *
idem_status_name(idem_status s)
{
	switch (s)
	{
		case IDEM_APPLIED:
			return "applied";
		case IDEM_REPLAYED:
			return "replayed";
		case IDEM_BUSY:
			return "busy";
		case IDEM_MISMATCH:
			return "mismatch";
		case IDEM_FAILED_PERMANENT:
			return "failed_permanent";
		case IDEM_FAILED_RETRYABLE:
			return "failed_retryable";
		case IDEM_ERROR:
			return "error";
	}
	return "unknown";
}

const char *
idem_source_name(idem_source s)
{
	switch (s)
	{
		case IDEM_SOURCE_NONE:
			return "none";
		case IDEM_SOURCE_HANDLER:
			return "handler";
		case IDEM_SOURCE_VALKEY:
			return "valkey";
		case IDEM_SOURCE_POSTGRES:
			return "postgres";
	}
	return "unknown";
}

/* ---- the handler's call ---- */

int
idem_call_attempt(const idem_call *c)
{
	return c ? c->attempt : 0;
}

int
idem_call_is_platform(const idem_call *c)
{
	return c ? c->is_platform : 0;
}

int64_t
idem_call_tenant_id(const idem_call *c)
{
	return c ? c->tenant_id : 0;
}

const char *
idem_call_scope(const idem_call *c)
{
	return c ? c->scope : NULL;
}

const char *
idem_call_id(const idem_call *c)
{
	return c ? c->id : NULL;
}

const char *
idem_call_request(const idem_call *c)
{
	return c ? c->request : NULL;
}

const uint8_t *
idem_call_key(const idem_call *c)
{
	return c ? c->key : NULL;
}

const PGresult *
idem_call_first_result(const idem_call *c)
{
	return c ? c->first : NULL;
}

int
idem_call_set_json(idem_call *c, const char *json)
{
	char	   *copy;

	if (c == NULL)
		return -1;
	copy = strdup(json ? json : "");
	if (copy == NULL)
	{
		c->oom = 1;
		return -1;
	}
	free(c->json);
	c->json = copy;
	return 0;
}
