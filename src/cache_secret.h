/*-------------------------------------------------------------------------
 *
 * cache_secret.h
 *	  The secret that MACs cached values, and the history epoch
 *	  (cache_secret.c): the shared copy, the worker's takeover of the epoch
 *	  in Valkey, and its renewal when the server's history may diverge.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_CACHE_SECRET_H
#define IDEM_CACHE_SECRET_H

#include "access/xlogdefs.h"

#include "cache_format.h"
#include "sha256.h"

/*
 * How many dead epochs the secret file remembers (cache_secret.c): the
 * worker retires them before each takeover and again at each owner check,
 * so that a Valkey restored from an older snapshot does not bring one back.
 */
#define IDEM_EPOCH_DEAD_MAX		8

/* An epoch and the timeline it was made on (its owner key's name). */
typedef struct IdemEpochName
{
	TimeLineID	timeline;
	uint64		epoch;
} IdemEpochName;

typedef struct IdemCacheSecrets
{
	int32		current_id;		/* the key id values are written with */
	uint8		current[IDEM_MAC_LEN];
	int32		previous_id;	/* still accepted by readers; 0 if none */
	uint8		previous[IDEM_MAC_LEN];
	TimeLineID	timeline;		/* made on it (cache_secret.c); 0 unknown */
	uint64		epoch;			/* the history epoch (cache_format.h); 0:
								 * none yet */
	uint64		token;			/* the token of the last start that took
								 * the epoch over in Valkey; 0: none */
	/* the last clean stop (system identifier, checkpoint); 0: none known */
	uint64		stop_sysid;
	XLogRecPtr	stop_checkpoint;
	int			ndead;			/* epochs this history knows are dead, */
	IdemEpochName dead[IDEM_EPOCH_DEAD_MAX];	/* newest first */
	uint64		generation;		/* the renewal generation the epoch was
								 * made at (epoch_renewal.c); shared memory
								 * only, not in the file */
} IdemCacheSecrets;

/*
 * The worker's takeover of the epoch after a start (cache_secret.c): the
 * epoch owner key must show expect_token (0: the key must not exist), and
 * gets new_token.
 */
typedef struct IdemEpochTakeover
{
	uint64		epoch;
	TimeLineID	timeline;
	uint64		expect_token;
	uint64		new_token;
	bool		first;			/* no takeover yet since the server started */
	int			ndead;			/* retire these owner keys first */
	IdemEpochName dead[IDEM_EPOCH_DEAD_MAX];
	uint64		generation;		/* the epoch's renewal generation */
} IdemEpochTakeover;

/* Why an epoch is replaced while the server runs (idem_cache_epoch_renew). */
typedef enum IdemEpochReason
{
	IDEM_EPOCH_RECOVERED_START = 1,	/* the start ran recovery */
	IDEM_EPOCH_TAKEN_ELSEWHERE,	/* Valkey: another start took it over */
	IDEM_EPOCH_LEDGER_ROWS_REMOVED,	/* DELETE, TRUNCATE, DROP of a ledger */
	IDEM_EPOCH_LEDGER_ROWS_REPLICATED,	/* logical replication wrote one */
	IDEM_EPOCH_RENEW_REQUESTED,	/* idem_renew_epoch() */
	IDEM_EPOCH_UNRECORDED_STOP	/* pg_control: not the clean stop recorded */
} IdemEpochReason;

/* The named LWLock tranche of the shared copy (one lock), for shmem.c. */
#define IDEM_CACHE_SECRET_TRANCHE	"idem cache secret"

extern Size idem_cache_secret_shmem_size(void);
extern void idem_cache_secret_shmem_init(void);
extern void idem_cache_secrets_get(IdemCacheSecrets *out);
extern void idem_cache_mac_key(idem_hmac *mac_key,
							   const IdemCacheSecrets *secrets);
extern bool idem_cache_sign(const idem_hmac *mac_key, const char *key,
							int keylen, char *value, int valuelen,
							const char **why);
extern bool idem_cache_epoch_confirmed(uint64 *epoch);
extern bool idem_cache_epoch_takeover(IdemEpochTakeover *t);
extern void idem_cache_epoch_taken(const IdemEpochTakeover *t);
extern uint64 idem_cache_epoch_renew(uint64 epoch, IdemEpochReason reason);
extern bool idem_cache_epoch_owned(IdemEpochTakeover *t);
extern void idem_cache_epoch_note_dead(const IdemEpochName *dead);
extern int	idem_cache_epoch_dead(IdemEpochName *dead);
extern void idem_cache_secret_register_stop(void);

#endif							/* IDEM_CACHE_SECRET_H */
