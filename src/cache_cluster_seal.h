/*-------------------------------------------------------------------------
 *
 * cache_cluster_seal.h
 *	  The seal of a Citus cluster's cache secrets for one node
 *	  (cache_cluster_seal.c): AES-256-GCM under the node's one-time key,
 *	  with what the seal is for (node, cluster keyspace, database) as
 *	  associated data.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_CACHE_CLUSTER_SEAL_H
#define IDEM_CACHE_CLUSTER_SEAL_H

#include "cache_secret.h"

/* The node's one-time key (idem_cache_node). */
#define IDEM_SEAL_KEY_LEN	32
#define IDEM_SEAL_NONCE_LEN	12
#define IDEM_SEAL_TAG_LEN	16
/* current id, current secret, previous id, previous secret */
#define IDEM_SEAL_PLAIN_LEN	(4 + IDEM_MAC_LEN + 4 + IDEM_MAC_LEN)
/* version, nonce, ciphertext, tag: 101 bytes (202 hex digits) */
#define IDEM_SEAL_LEN \
	(1 + IDEM_SEAL_NONCE_LEN + IDEM_SEAL_PLAIN_LEN + IDEM_SEAL_TAG_LEN)
/* The first byte of a seal: its format. */
#define IDEM_SEAL_VERSION	2
/* The length of a seal of idem 0.3 (HMAC stream and tag), refused. */
#define IDEM_SEAL_V1_LEN	(16 + IDEM_SEAL_PLAIN_LEN + IDEM_MAC_LEN)

/* What a seal is for: each must be the same to open it. */
typedef struct IdemSealFor
{
	const char *identity;		/* the node's: system id, timeline, epoch */
	const char *keyspace;		/* the cluster keyspace it joins */
	const char *database;		/* the database's name (the same on every
								 * node of a Citus cluster) */
} IdemSealFor;

typedef enum IdemSealResult
{
	IDEM_SEAL_OK = 0,
	IDEM_SEAL_REFUSED,			/* another key, another purpose, or changed */
	IDEM_SEAL_MALFORMED,		/* not a seal's length or version */
	IDEM_SEAL_OLD_FORMAT,		/* a seal of idem 0.3 */
	IDEM_SEAL_FAILED			/* OpenSSL failed (out of memory) */
} IdemSealResult;

extern IdemSealResult idem_seal_secrets(const uint8 *key, const uint8 *nonce,
										const IdemCacheSecrets *s,
										const IdemSealFor *what, uint8 *out);
extern IdemSealResult idem_seal_open(const uint8 *key, const uint8 *sealed,
									 size_t len, const IdemSealFor *what,
									 IdemCacheSecrets *s);

#endif							/* IDEM_CACHE_CLUSTER_SEAL_H */
