/*-------------------------------------------------------------------------
 *
 * worker_encode.c
 *	  Queued records as Valkey commands: each one a SET <key> <value> PX
 *	  <ms until the row's expires_at>, its idem2 value in its database's
 *	  keyspace on this timeline, MACed with the current secret (or a Citus
 *	  cluster keyspace's); a record whose retention already ended is
 *	  skipped, and so is one read under an older renewal generation than
 *	  the epoch's (epoch_renewal.c).  The prepared HMAC keys are wiped once a batch is encoded.
 *
 *	  Locking: none; the secrets are copied out of shared memory under
 *	  cache_secret.c's lock.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "utils/datetime.h"
#include "utils/timestamp.h"

#include "cache_cluster.h"
#include "cache_format.h"
#include "cache_keyspace.h"
#include "cache_secret.h"
#include "commit_ring.h"
#include "worker_router.h"
#include "worker_int.h"

/* Unix epoch milliseconds of a timestamp. */
static int64
worker_epoch_ms(TimestampTz t)
{
	return t / 1000 +
		(int64) (POSTGRES_EPOCH_JDATE - UNIX_EPOCH_JDATE) * SECS_PER_DAY * 1000;
}

void
worker_encoder_init(WorkerEncoder *enc, TimeLineID timeline)
{
	IdemCacheSecrets secrets;

	enc->now = GetCurrentTimestamp();
	enc->timeline = timeline;
	enc->keyspace_db = InvalidOid;
	memset(&enc->skips, 0, sizeof(enc->skips));
	idem_cache_secrets_get(&secrets);
	enc->epoch = secrets.epoch;
	enc->generation = secrets.generation;
	enc->own_key_id = secrets.current_id;
	idem_cache_mac_key(&enc->own_mac_key, &secrets);
	explicit_bzero(&secrets, sizeof(secrets));
}

/* The batch is encoded: wipe the key. */
void
worker_encoder_done(WorkerEncoder *enc)
{
	explicit_bzero(&enc->mac_key, sizeof(enc->mac_key));
	explicit_bzero(&enc->own_mac_key, sizeof(enc->own_mac_key));
}

/*
 * One record as SET key value PX ttl (both modes use this): an idem2 value
 * in its database's keyspace on this timeline, MACed with the current
 * secret.  1 done, 0 nothing to copy (the row's retention already ended,
 * its database copies nothing now: cache_cluster.c, or it was read before
 * ledger rows were removed and the epoch renewed since; counted by reason
 * in enc->skips), -1 it cannot be encoded (worker_errbuf says why).
 */
int
worker_encode_record(void *arg, const IdemRingRecord *rec,
					 char *key, int *keylen, char *value, int *valuelen,
					 char *ttl, size_t ttllen)
{
	WorkerEncoder *enc = (WorkerEncoder *) arg;
	int64		ttl_ms = (rec->expires_at - enc->now) / 1000;	/* rounds down */
	const char *why = "could not encode a queued result";

	if (ttl_ms < 1)
	{
		worker_skip(&enc->skips, IDEM_STAT_SKIPPED_EXPIRED);
		return 0;
	}
	/* read before a removal this epoch follows (epoch_renewal.c) */
	if (rec->generation < enc->generation)
	{
		worker_skip(&enc->skips, IDEM_STAT_SKIPPED_EPOCH);
		return 0;
	}
	*keylen = -1;
	if (rec->dboid != enc->keyspace_db)
	{
		/* a Citus cluster's database: its keyspace and secret, or nothing */
		int			c = idem_cache_cluster_encoder(rec->dboid, enc->timeline,
												   enc->epoch, enc->keyspace,
												   &enc->key_id, &enc->mac_key);

		enc->skip_db = c < 0;
		if (c == 0)
		{
			enc->key_id = enc->own_key_id;
			enc->mac_key = enc->own_mac_key;
		}
		if (c != 0 ||
			idem_cache_keyspace_of(enc->keyspace, sizeof(enc->keyspace), rec->dboid,
								   enc->timeline, enc->epoch) >= 0)
			enc->keyspace_db = rec->dboid;
	}
	if (rec->dboid == enc->keyspace_db && enc->skip_db)
	{
		worker_skip(&enc->skips, IDEM_STAT_SKIPPED_UNJOINED);
		return 0;
	}
	if (rec->dboid == enc->keyspace_db)
		*keylen = idem_cache_key(key, IDEM_CACHE_KEY_MAX, enc->keyspace,
								 rec->is_platform, rec->tenant_id, rec->key);
	*valuelen = idem_cache_encode_terminal(value, IDEM_CACHE_VALUE_MAX,
										   enc->key_id,
										   (IdemCacheKind) rec->kind,
										   rec->attempt,
										   worker_epoch_ms(rec->expires_at),
										   rec->fingerprint,
										   rec->outcome, rec->outcome_len);
	if (*keylen < 0 || *valuelen < 0 ||
		!idem_cache_sign(&enc->mac_key, key, *keylen, value, *valuelen, &why))
	{
		snprintf(worker_errbuf, sizeof(worker_errbuf), "%s", why);
		return -1;
	}
	snprintf(ttl, ttllen, INT64_FORMAT, ttl_ms);
	return 1;
}

/*
 * Append SETs for records[] to the connection's output buffer
 * (worker_encode_record).  Records not to copy are skipped (counted in
 * enc->skips), and one that cannot be encoded is counted in *errors.  Returns the number
 * of commands appended, or -1.
 */
int
worker_append_batch(const IdemRingRecord **records, int n, WorkerEncoder *enc,
					uint64 *errors)
{
	char		key[IDEM_CACHE_KEY_MAX];
	char		value[IDEM_CACHE_VALUE_MAX];
	char		ttl[32];
	int			nsent = 0;
	int			i;

	for (i = 0; i < n; i++)
	{
		int			keylen;
		int			valuelen;
		const char *argv[5];
		size_t		argvlen[5];
		int			rc;

		rc = worker_encode_record(enc, records[i], key, &keylen, value, &valuelen,
								  ttl, sizeof(ttl));
		if (rc == 0)
			continue;			/* skipped, and counted in enc->skips */
		if (rc < 0)
		{
			(*errors)++;		/* worker_errbuf says why */
			continue;
		}
		argv[0] = "SET";
		argvlen[0] = 3;
		argv[1] = key;
		argvlen[1] = keylen;
		argv[2] = value;
		argvlen[2] = valuelen;
		argv[3] = "PX";
		argvlen[3] = 2;
		argv[4] = ttl;
		argvlen[4] = strlen(ttl);
		if (worker_router_single_append(5, argv, argvlen, worker_errbuf, sizeof(worker_errbuf)) != 0)
			return -1;
		nsent++;
	}
	return nsent;
}
