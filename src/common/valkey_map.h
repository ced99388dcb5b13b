/*-------------------------------------------------------------------------
 *
 * valkey_map.h
 *	  The slot map of a Valkey Cluster, parsed from a CLUSTER SLOTS or
 *	  CLUSTER SHARDS reply (valkey_map.c).  Pure functions, unit tested on
 *	  real RESP text.  Plain C: compiled into idem.so and libidemclient.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_VALKEY_MAP_H
#define IDEM_VALKEY_MAP_H

#include <stdint.h>

#include <hiredis/hiredis.h>

#include "valkey_endpoint.h"
#include "valkey_slots.h"

#define IDEM_VC_MAX_NODES	64

/* A parsed slot map: slot -> index into hosts/ports, or -1. */
typedef struct idem_vc_map
{
	int			nnodes;
	char		hosts[IDEM_VC_MAX_NODES][IDEM_VC_HOST_MAX];
	int			ports[IDEM_VC_MAX_NODES];
	int16_t		slot_node[IDEM_VC_SLOTS];
} idem_vc_map;

/*
 * Fill map from a CLUSTER SLOTS reply (masters only).  An empty or "?" host
 * means the node that was asked (asked_host).  Returns the number of slots
 * covered, or -1 if the reply is not a slot map.
 */
int			idem_vc_parse_slots(const redisReply *r, const char *asked_host,
								idem_vc_map *map);

/*
 * The same from a CLUSTER SHARDS reply (Redis 7+, Valkey): each shard's
 * slot ranges go to its master (an online one if it lists several; a
 * shard with no master is left uncovered), addressed by its endpoint (its
 * ip if the endpoint is "?" or empty; the node asked if neither is given).
 */
int			idem_vc_parse_shards(const redisReply *r, const char *asked_host,
								 idem_vc_map *map);

#endif							/* IDEM_VALKEY_MAP_H */
