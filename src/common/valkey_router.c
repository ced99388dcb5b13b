/*-------------------------------------------------------------------------
 *
 * valkey_router.c
 *	  Valkey routing on hiredis (valkey_router.h): the router, for a Valkey
 *	  Cluster and a single Valkey (a one-node map) alike.  It
 *	  opens (seeds, cluster or single node), reads and installs the slot
 *	  map, closes, and answers what the caller asks of it; its parts are
 *	  listed in valkey_router_int.h.
 *
 *-------------------------------------------------------------------------
 */
#include "valkey_router_int.h"

#include <stdio.h>
#include <stdlib.h>

/*
 * Read the slot map from node i and install it: CLUSTER SHARDS, or CLUSTER
 * SLOTS from a server that has no SHARDS (before Redis 7) or refuses it
 * (an ACL); that server is not asked for SHARDS again.  0, -1, -2.
 */
static int
refresh_from(idem_vc *vc, int i, int64_t deadline)
{
	const char *argv[2] = {"CLUSTER", vc->use_slots ? "SLOTS" : "SHARDS"};
	vc_node    *n = &vc->nodes[i];
	idem_vc_map *map;
	redisReply *r;
	int			rc,
				s,
				k;
	int			idx[IDEM_VC_MAX_NODES];

	rc = idem_vc_node_ensure(vc, n, deadline);
	if (rc != 0)
		return rc;
	rc = idem_vc_node_call(vc, n, 2, argv, deadline, &r);
	if (rc != 0)
	{
		if (rc == -1)
			idem_vc_node_failed(vc, n, "reading the slot map from");
		else
			idem_vc_node_drop(vc, n);
		return rc;
	}
	if (!vc->use_slots && r->type == REDIS_REPLY_ERROR &&
		(idem_vk_error_code_is(r->str, r->len, "ERR") || idem_vk_error_code_is(r->str, r->len, "NOPERM")))
	{
		freeReplyObject(r);
		vc->use_slots = 1;
		return refresh_from(vc, i, deadline);
	}
	map = malloc(sizeof(idem_vc_map));
	if (map == NULL)
	{
		freeReplyObject(r);
		idem_vc_set_err(vc, "out of memory");
		return -1;
	}
	rc = vc->use_slots ? idem_vc_parse_slots(r, n->host, map) :
		idem_vc_parse_shards(r, n->host, map);
	if (rc <= 0)
	{
		if (r->type == REDIS_REPLY_ERROR)
			idem_vc_set_err(vc, "CLUSTER %s from %s: %.*s", argv[1], n->name, (int) r->len, r->str);
		else
			idem_vc_set_err(vc, "CLUSTER %s from %s: no slot map", argv[1], n->name);
		freeReplyObject(r);
		free(map);
		return -1;
	}
	freeReplyObject(r);
	for (k = 0; k < map->nnodes; k++)
	{
		idx[k] = idem_vc_node_get(vc, map->hosts[k], map->ports[k]);
		if (idx[k] < 0)
		{
			idem_vc_set_err(vc, "more than %d nodes", IDEM_VC_MAX_NODES);
			free(map);
			return -1;
		}
	}
	for (k = 0; k < vc->nnodes; k++)
		vc->nodes[k].in_map = 0;
	for (s = 0; s < IDEM_VC_SLOTS; s++)
	{
		int			m = map->slot_node[s];

		vc->slot_node[s] = m < 0 ? -1 : (int16_t) idx[m];
		if (m >= 0)
			vc->nodes[idx[m]].in_map = 1;
	}
	free(map);
	vc->stats.refreshes++;
	vc->need_refresh = 0;
	vc->refreshed_at = idem_vc_now_ms();
	return 0;
}

/* Read the slot map from a connected master, else any node, else a seed. */
int
idem_vc_refresh(idem_vc *vc, int64_t deadline)
{
	int			pass,
				i,
				rc;

	for (pass = 0; pass < 2; pass++)
	{
		for (i = 0; i < vc->nnodes; i++)
		{
			vc_node    *n = &vc->nodes[i];

			if ((pass == 0) != (n->fd >= 0 && n->in_map))
				continue;
			if (n->nexpect > 0)
				continue;
			rc = refresh_from(vc, i, deadline);
			if (rc == 0 || rc == -2)
				return rc;
			if (idem_vc_now_ms() >= deadline)
				return -1;
		}
	}
	return -1;
}

/* ---- public ---- */

idem_vc *
idem_vc_new(const idem_vc_options *opt, const idem_vc_io *io, char *err,
			size_t errlen)
{
	idem_vc    *vc = calloc(1, sizeof(idem_vc));
	const char *p;
	int			s;

	if (vc == NULL)
	{
		idem_vc_copy_err(err, errlen, "out of memory");
		return NULL;
	}
	vc->io = *io;
	vc->mode = opt->mode;
	vc->db = opt->db;
	vc->connect_timeout_ms = opt->connect_timeout_ms;
	vc->retry_ms = opt->retry_ms;
	vc->blocking_reads = opt->blocking_reads;
	vc->reconnect_dead = opt->reconnect_dead;
	if (opt->nsetup < 0 || opt->nsetup > VC_MAX_SETUP)
	{
		snprintf(err, errlen, "at most %d setup commands", VC_MAX_SETUP);
		free(vc);
		return NULL;
	}
	vc->nsetup = opt->nsetup;
	vc->setup_argc = opt->setup_argc;
	for (s = 0; s < opt->nsetup; s++)
		vc->setup_argv[s] = opt->setup_argv[s];
	vc->setup_check = opt->setup_check;
	for (s = 0; s < IDEM_VC_SLOTS; s++)
		vc->slot_node[s] = -1;
	if (opt->password && opt->password[0])
	{
		vc->password = strdup(opt->password);
		if (vc->password == NULL)
		{
			idem_vc_copy_err(err, errlen, "out of memory");
			free(vc);
			return NULL;
		}
	}
	p = opt->seeds ? opt->seeds : "";
	while (*p)
	{
		char		host[IDEM_VC_HOST_MAX];
		size_t		len = strcspn(p, ", ");
		int			port;
		int			i;

		if (len == 0)
		{
			p++;
			continue;
		}
		if (idem_vc_parse_endpoint(p, len, opt->default_port, host,
								   sizeof(host), &port) != 0)
		{
			snprintf(err, errlen, "invalid Valkey node \"%.*s\": expected host:port, host, or [IPv6 address]:port",
					 (int) len, p);
			idem_vc_free(vc);
			return NULL;
		}
		i = idem_vc_node_get(vc, host, port);
		if (i < 0)
		{
			snprintf(err, errlen, "too many Valkey nodes");
			idem_vc_free(vc);
			return NULL;
		}
		vc->seeds[vc->nseeds++] = i;
		p += len;
	}
	if (vc->nseeds == 0)
	{
		idem_vc_copy_err(err, errlen, "no Valkey node given");
		idem_vc_free(vc);
		return NULL;
	}
	return vc;
}

void
idem_vc_close_all(idem_vc *vc)
{
	int			i;

	if (vc == NULL)
		return;
	for (i = 0; i < vc->nnodes; i++)
		idem_vc_node_drop(vc, &vc->nodes[i]);
}

void
idem_vc_free(idem_vc *vc)
{
	int			i;

	if (vc == NULL)
		return;
	idem_vc_close_all(vc);
	for (i = 0; i < vc->nnodes; i++)
	{
		free(vc->nodes[i].obuf);
		free(vc->nodes[i].expect);
	}
	free(vc->password);
	free(vc);
}

int
idem_vc_open(idem_vc *vc, int seed_budget_ms, char *err, size_t errlen)
{
	int			k;

	vc->is_open = 0;
	vc->err[0] = '\0';
	for (k = 0; k < vc->nseeds; k++)
	{
		vc_node    *n = &vc->nodes[vc->seeds[k]];
		int64_t		deadline_ms = idem_vc_now_ms() + seed_budget_ms;
		int			rc;
		int			cluster;

		/*
		 * In auto mode the connect's setup asks INFO cluster before its
		 * SELECT, in the same round trip (a cluster refuses SELECT).
		 */
		vc->cluster = vc->mode == IDEM_VC_MODE_CLUSTER;
		vc->ask_cluster = vc->mode == IDEM_VC_MODE_AUTO;
		vc->said_cluster = -1;
		n->down_until = 0;
		rc = idem_vc_node_ensure(vc, n, deadline_ms);
		vc->ask_cluster = 0;
		if (rc == -2)
			return -3;
		if (rc != 0)
			continue;
		if (vc->mode == IDEM_VC_MODE_AUTO && vc->said_cluster < 0)
		{
			/* connected before this open: ask now */
			const char *argv[2] = {"INFO", "cluster"};
			redisReply *r;

			rc = idem_vc_node_call(vc, n, 2, argv, deadline_ms, &r);
			if (rc == -2)
			{
				idem_vc_node_drop(vc, n);
				return -3;
			}
			if (rc != 0)
			{
				idem_vc_node_failed(vc, n, "asking");
				continue;
			}
			vc->said_cluster = r->type == REDIS_REPLY_STRING &&
				strstr(r->str, "cluster_enabled:1") != NULL;
			freeReplyObject(r);
		}
		if (vc->mode == IDEM_VC_MODE_AUTO)
			cluster = vc->said_cluster;
		else
			cluster = vc->mode == IDEM_VC_MODE_CLUSTER;
		vc->cluster = cluster;
		if (cluster)
		{
			if (vc->db != 0)
			{
				idem_vc_close_all(vc);
				idem_vc_copy_err(err, errlen,
						 "Valkey at the given node is a cluster, which has only database 0");
				return -2;
			}
			rc = refresh_from(vc, vc->seeds[k], deadline_ms);
			if (rc == -2)
				return -3;
			if (rc != 0)
				continue;
		}
		else
		{
			int			s;

			for (s = 0; s < IDEM_VC_SLOTS; s++)
				vc->slot_node[s] = (int16_t) vc->seeds[k];
			n->in_map = 1;
		}
		vc->is_open = 1;
		return 0;
	}
	idem_vc_copy_err(err, errlen, vc->err[0] ? vc->err : "no Valkey node answered");
	return -1;
}

int
idem_vc_is_cluster(const idem_vc *vc)
{
	return vc != NULL && vc->is_open && vc->cluster;
}

int
idem_vc_is_open(const idem_vc *vc)
{
	return vc != NULL && vc->is_open;
}

int
idem_vc_all_resting(const idem_vc *vc)
{
	int64_t		now;
	int			i;

	if (!idem_vc_is_open(vc))
		return 0;
	now = idem_vc_now_ms();
	for (i = 0; i < vc->nnodes; i++)
	{
		const vc_node *n = &vc->nodes[i];

		if (n->in_map && (n->fd >= 0 || now >= n->down_until))
			return 0;
	}
	return 1;
}


const idem_vc_stats *
idem_vc_get_stats(const idem_vc *vc)
{
	return &vc->stats;
}

int
idem_vc_nnodes(const idem_vc *vc)
{
	return vc->nnodes;
}

const char *
idem_vc_node_name(const idem_vc *vc, int i)
{
	return vc->nodes[i].name;
}

long long
idem_vc_node_errors(const idem_vc *vc, int i)
{
	return vc->nodes[i].errors;
}

int
idem_vc_node_in_map(const idem_vc *vc, int i)
{
	return vc->nodes[i].in_map;
}

const char *
idem_vc_last_error(const idem_vc *vc)
{
	return vc->err;
}
