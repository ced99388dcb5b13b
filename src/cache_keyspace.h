/*-------------------------------------------------------------------------
 *
 * cache_keyspace.h
 *	  The Valkey keyspace of a database, and the epoch owner key
 *	  (cache_keyspace.c), from idem.valkey_prefix and this server's identity.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_CACHE_KEYSPACE_H
#define IDEM_CACHE_KEYSPACE_H

#include "access/xlogdefs.h"

extern int	idem_cache_keyspace_of(char *buf, size_t buflen, Oid dboid,
								   TimeLineID timeline, uint64 epoch);
extern int	idem_cache_epoch_key_of(char *buf, size_t buflen,
									TimeLineID timeline, uint64 epoch);
extern int	idem_cache_epoch_list_of(char *buf, size_t buflen);

#endif							/* IDEM_CACHE_KEYSPACE_H */
