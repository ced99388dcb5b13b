/*-------------------------------------------------------------------------
 *
 * cache_format.h
 *	  The Valkey key and value format of idem, version 2 ("idem2").
 *
 * One definition (the code in cache_format.c), compiled into the
 * extension's background worker (which writes terminal results once their
 * commit is durable) and into the client library (which reads them, and
 * writes its processing marker).  Plain C99: no PostgreSQL, hiredis or
 * libpq headers, no allocation, no cryptography; every function works on
 * caller-provided buffers and returns an explicit status.  Both sides
 * compute HMAC-SHA-256 with sha256.h over what idem_cache_mac_input()
 * builds.
 *
 * Keys (one Valkey key per ledger row; no hash tags, so each key hashes to
 * its own Valkey Cluster slot):
 *
 *	  tenant ledger:    <keyspace>t:<tenant_id in decimal>:<key as 64 hex>
 *	  platform ledger:  <keyspace>p:<key as 64 hex>
 *	  keyspace:         <idem.valkey_prefix><system identifier>.<timeline>.
 *	                    <epoch>.<database oid>:
 *	  epoch owner:      <idem.valkey_prefix><system identifier>.<timeline>.
 *	                    <epoch>:owner
 *
 * (the system identifier, timeline and OID in decimal, the epoch as 16
 * lower-case hex digits; no blank), so two databases, two clusters, or one
 * cluster before and after a promotion never share a key.  The epoch names
 * the server's history: a random number that the server replaces whenever
 * that history may have diverged from what Valkey saw (a start that ran
 * recovery, a copy of the data directory, rows removed outside idem_purge;
 * cache_secret.c), so a restored or cloned server never reads what another
 * history wrote.  The epoch owner key holds the token of the last start
 * that took the epoch over, or, once a newer epoch replaced it, a retired
 * marker.  The server tells the client its keyspace (SQL
 * idem_cache_keyspace()), and the owner key and token (idem_cache_secrets()):
 * a client trusts a value only if the owner key, read in the same round
 * trip, still holds that token.
 *
 * Values are one line of ASCII, then the outcome for terminal results:
 *
 *	  idem2 <mac: 64 hex> <rest>
 *	  rest, terminal:  <key_id> <c|f> <attempt> <expires_ms> <fingerprint: 64 hex> <outcome>
 *	  rest, marker:    <key_id> p <expires_ms> <token: 32 hex>
 *
 *	  key_id, attempt	decimal 1..2147483647, no leading zero
 *	  c, f				completed, failed_permanent
 *	  expires_ms		Unix epoch milliseconds, decimal 0..2^53; terminal:
 *						the row's expires_at; marker: the lease deadline
 *	  outcome			jsonb text of a JSON object, 1..4096 bytes
 *	  mac				HMAC-SHA-256(secret[key_id],
 *							<full key> || 0x00 || <rest as stored>)
 *
 * Anything else (another version such as idem1, bad hex, a leading zero,
 * trailing bytes, an outcome that does not look like an object) decodes as
 * malformed; a reader ignores it, as it ignores a value whose MAC does not
 * verify: the cache is never the authority.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_CACHE_FORMAT_H
#define IDEM_CACHE_FORMAT_H

#include <stddef.h>
#include <stdint.h>

#define IDEM_CACHE_VERSION_TAG		"idem2"
#define IDEM_DIGEST_LEN				32
#define IDEM_MAC_LEN				32
#define IDEM_OUTCOME_MAX			4096
#define IDEM_TOKEN_LEN				16
#define IDEM_CACHE_PREFIX_MAX		64
#define IDEM_CACHE_KEY_ID_MAX		2147483647
/* expires_ms above this is refused (2^53: exact in a double, year 285616). */
#define IDEM_CACHE_EXPIRES_MAX		INT64_C(9007199254740992)

/*
 * prefix + 20-digit system identifier "." 10-digit TLI "." 16 hex epoch "."
 * 10-digit OID ":"
 */
#define IDEM_CACHE_KEYSPACE_MAX		(IDEM_CACHE_PREFIX_MAX + 20 + 1 + 10 + 1 + 16 + 1 + 10 + 1)
/* The epoch owner key: prefix, system identifier, TLI, epoch, ":owner". */
#define IDEM_CACHE_EPOCH_KEY_MAX	(IDEM_CACHE_PREFIX_MAX + 20 + 1 + 10 + 1 + 16 + 6 + 1)
/* An epoch owner's token: 16 lower-case hex digits. */
#define IDEM_CACHE_EPOCH_TOKEN_LEN	16
/*
 * What a retired epoch's owner key holds instead of a token: this, then the
 * timeline and epoch that replaced it ("<tli>.<epoch: 16 hex>").  Never a
 * token, so no reader's check matches it.
 */
#define IDEM_CACHE_EPOCH_RETIRED	"retired "
/* Longest key: keyspace + "t:" + 20-digit int64 + ":" + 64 hex, and a NUL. */
#define IDEM_CACHE_KEY_MAX	(IDEM_CACHE_KEYSPACE_MAX + 2 + 20 + 1 + 64 + 1)
/* Where <rest> starts in a value: after "idem2 " + 64 hex + " ". */
#define IDEM_CACHE_REST_OFFSET		(5 + 1 + 2 * IDEM_MAC_LEN + 1)
/* Longest rest: key_id, kind, attempt, expires_ms, fingerprint, outcome. */
#define IDEM_CACHE_REST_MAX	(10 + 3 + 10 + 1 + 16 + 1 + 64 + 1 + IDEM_OUTCOME_MAX)
/* Longest value, with a NUL. */
#define IDEM_CACHE_VALUE_MAX	(IDEM_CACHE_REST_OFFSET + IDEM_CACHE_REST_MAX + 1)
/* Longest MAC input: key, 0x00, rest. */
#define IDEM_CACHE_MAC_INPUT_MAX	(IDEM_CACHE_KEY_MAX + IDEM_CACHE_REST_MAX)

typedef enum IdemCacheKind
{
	IDEM_CACHE_COMPLETED = 'c',
	IDEM_CACHE_FAILED_PERMANENT = 'f',
	IDEM_CACHE_MARKER = 'p'
} IdemCacheKind;

/* A decoded idem2 value; pointers point into the decoded buffer. */
typedef struct IdemCacheEntry
{
	IdemCacheKind kind;
	int32_t		key_id;			/* which secret the MAC was made with */
	uint8_t		mac[IDEM_MAC_LEN];
	const char *rest;			/* what the MAC covers after the key */
	size_t		rest_len;
	int64_t		expires_ms;		/* retention end, or the lease deadline */
	int32_t		attempt;		/* terminal kinds only */
	uint8_t		fingerprint[IDEM_DIGEST_LEN];	/* terminal kinds only */
	const char *outcome;		/* terminal kinds only; not NUL-terminated */
	size_t		outcome_len;
	uint8_t		token[IDEM_TOKEN_LEN];	/* marker only */
} IdemCacheEntry;

/* cache_format.c */
extern int	idem_cache_result_ok(IdemCacheKind kind, int32_t attempt,
								 const char *outcome, size_t outcome_len);
extern void idem_cache_hex(char *dst, const uint8_t *src, size_t n);
extern int	idem_cache_unhex(uint8_t *dst, const char *src, size_t n);
extern int	idem_cache_keyspace(char *buf, size_t buflen, const char *prefix,
								uint64_t system_id, uint32_t timeline,
								uint64_t epoch, uint32_t dboid);
extern int	idem_cache_epoch_key(char *buf, size_t buflen, const char *prefix,
								 uint64_t system_id, uint32_t timeline,
								 uint64_t epoch);
extern int	idem_cache_key(char *buf, size_t buflen, const char *keyspace,
						   int is_platform, int64_t tenant_id,
						   const uint8_t key[IDEM_DIGEST_LEN]);
extern void idem_cache_put_head(char *buf);
extern int	idem_cache_encode_terminal(char *buf, size_t buflen, int32_t key_id,
									   IdemCacheKind kind, int32_t attempt,
									   int64_t expires_ms,
									   const uint8_t fingerprint[IDEM_DIGEST_LEN],
									   const char *outcome, size_t outcome_len);
extern int	idem_cache_encode_lease_marker(char *buf, size_t buflen,
										   int32_t key_id, int64_t expires_ms,
										   const uint8_t token[IDEM_TOKEN_LEN]);
extern void idem_cache_set_mac(char *value, const uint8_t mac[IDEM_MAC_LEN]);
extern int	idem_cache_mac_input(char *buf, size_t buflen, const char *key,
								 size_t keylen, const char *value,
								 size_t valuelen);
extern int	idem_cache_mac_equal(const uint8_t a[IDEM_MAC_LEN],
								 const uint8_t b[IDEM_MAC_LEN]);
extern int	idem_cache_parse(const char *buf, size_t len, IdemCacheEntry *out);

#endif							/* IDEM_CACHE_FORMAT_H */
