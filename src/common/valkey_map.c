/*-------------------------------------------------------------------------
 *
 * valkey_map.c
 *	  The slot map, parsed from a CLUSTER SLOTS or CLUSTER SHARDS reply
 *	  (idem_vc_map).  Pure functions, unit tested on real RESP text.
 *
 *-------------------------------------------------------------------------
 */
#include "valkey_map.h"

#include <stdlib.h>
#include <string.h>

/* Index of host:port in map, added if new; -1 if it cannot be. */
static int
map_node(idem_vc_map *map, const char *host, size_t hostlen, long long port)
{
	int			n;

	if (hostlen == 0 || hostlen >= IDEM_VC_HOST_MAX || port <= 0 || port > 65535)
		return -1;
	for (n = 0; n < map->nnodes; n++)
		if (map->ports[n] == port &&
			strlen(map->hosts[n]) == hostlen &&
			memcmp(map->hosts[n], host, hostlen) == 0)
			return n;
	if (n == IDEM_VC_MAX_NODES)
		return -1;
	memcpy(map->hosts[n], host, hostlen);
	map->hosts[n][hostlen] = '\0';
	map->ports[n] = (int) port;
	map->nnodes++;
	return n;
}

/* Slots start..end to node n; the slots newly covered, or -1 if invalid. */
static int
map_cover(idem_vc_map *map, long long start, long long end, int n)
{
	int			s,
				covered = 0;

	if (start < 0 || end >= IDEM_VC_SLOTS || start > end)
		return -1;
	for (s = (int) start; s <= (int) end; s++)
	{
		if (map->slot_node[s] < 0)
			covered++;
		map->slot_node[s] = (int16_t) n;
	}
	return covered;
}

static void
map_init(idem_vc_map *map)
{
	int			i;

	map->nnodes = 0;
	for (i = 0; i < IDEM_VC_SLOTS; i++)
		map->slot_node[i] = -1;
}

int
idem_vc_parse_slots(const redisReply *r, const char *asked_host,
					idem_vc_map *map)
{
	size_t		i;
	int			covered = 0;

	map_init(map);
	if (r == NULL || r->type != REDIS_REPLY_ARRAY)
		return -1;
	for (i = 0; i < r->elements; i++)
	{
		const redisReply *e = r->element[i];
		const redisReply *m;
		const char *host;
		size_t		hostlen;
		int			n,
					c;

		if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 ||
			e->element[0]->type != REDIS_REPLY_INTEGER ||
			e->element[1]->type != REDIS_REPLY_INTEGER ||
			e->element[2]->type != REDIS_REPLY_ARRAY)
			return -1;
		m = e->element[2];
		if (m->elements < 2 ||
			m->element[0]->type != REDIS_REPLY_STRING ||
			m->element[1]->type != REDIS_REPLY_INTEGER)
			return -1;
		host = m->element[0]->str;
		hostlen = m->element[0]->len;
		if (hostlen == 0 || (hostlen == 1 && host[0] == '?'))
		{
			host = asked_host;
			hostlen = strlen(asked_host);
		}
		if ((n = map_node(map, host, hostlen, m->element[1]->integer)) < 0 ||
			(c = map_cover(map, e->element[0]->integer,
						   e->element[1]->integer, n)) < 0)
			return -1;
		covered += c;
	}
	return covered;
}

/* The value of name in a flat [name, value, ...] array (RESP2); NULL if none. */
static const redisReply *
field(const redisReply *a, const char *name)
{
	size_t		i;

	if (a == NULL || a->type != REDIS_REPLY_ARRAY)
		return NULL;
	for (i = 0; i + 1 < a->elements; i += 2)
		if (a->element[i]->type == REDIS_REPLY_STRING &&
			strcmp(a->element[i]->str, name) == 0)
			return a->element[i + 1];
	return NULL;
}

static int
field_is(const redisReply *a, const char *name, const char *value)
{
	const redisReply *v = field(a, name);

	return v != NULL && v->type == REDIS_REPLY_STRING && strcmp(v->str, value) == 0;
}

int
idem_vc_parse_shards(const redisReply *r, const char *asked_host,
					 idem_vc_map *map)
{
	size_t		i,
				j;
	int			covered = 0;

	map_init(map);
	if (r == NULL || r->type != REDIS_REPLY_ARRAY)
		return -1;
	for (i = 0; i < r->elements; i++)
	{
		const redisReply *e = r->element[i];
		const redisReply *slots = field(e, "slots");
		const redisReply *nodes = field(e, "nodes");
		const redisReply *master = NULL;
		const redisReply *h;
		const redisReply *port;
		const char *host = "";
		size_t		hostlen = 0;
		int			n,
					c;

		if (slots == NULL || slots->type != REDIS_REPLY_ARRAY ||
			slots->elements % 2 != 0 ||
			nodes == NULL || nodes->type != REDIS_REPLY_ARRAY)
			return -1;
		if (slots->elements == 0)
			continue;			/* a shard that serves no slot */
		/* its master: one that is online if the shard lists several */
		for (j = 0; j < nodes->elements; j++)
		{
			const redisReply *nd = nodes->element[j];

			if (!field_is(nd, "role", "master") && !field_is(nd, "role", "primary"))
				continue;
			if (master == NULL || field_is(nd, "health", "online"))
				master = nd;
			if (field_is(nd, "health", "online"))
				break;
		}
		if (master == NULL)
			continue;			/* no master now: its slots are not served */
		/* the preferred endpoint; "?" or empty: its ip; none: the node asked */
		h = field(master, "endpoint");
		if (h == NULL || h->type != REDIS_REPLY_STRING || h->len == 0 ||
			(h->len == 1 && h->str[0] == '?'))
			h = field(master, "ip");
		if (h != NULL && h->type == REDIS_REPLY_STRING)
		{
			host = h->str;
			hostlen = h->len;
		}
		if (hostlen == 0 || (hostlen == 1 && host[0] == '?'))
		{
			host = asked_host;
			hostlen = strlen(asked_host);
		}
		port = field(master, "port");
		if (port == NULL || port->type != REDIS_REPLY_INTEGER ||
			(n = map_node(map, host, hostlen, port->integer)) < 0)
			return -1;
		for (j = 0; j < slots->elements; j += 2)
		{
			if (slots->element[j]->type != REDIS_REPLY_INTEGER ||
				slots->element[j + 1]->type != REDIS_REPLY_INTEGER ||
				(c = map_cover(map, slots->element[j]->integer,
							   slots->element[j + 1]->integer, n)) < 0)
				return -1;
			covered += c;
		}
	}
	return covered;
}
