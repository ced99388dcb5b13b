/*-------------------------------------------------------------------------
 *
 * cache_format.h
 *	  The Valkey key and value format of idem, version 2 ("idem2").
 *
 * One definition, included by the extension's background worker (which
 * writes terminal results once their commit is durable) and by the client
 * helper (which reads them, and writes its processing marker).  Plain C99:
 * no PostgreSQL, hiredis or libpq headers, no allocation, no cryptography;
 * every function works on caller-provided buffers and returns an explicit
 * status.  Both sides compute HMAC-SHA-256 with sha256.h over what
 * idem_cache_mac_input() builds.
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
#include <stdio.h>
#include <string.h>

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

/*
 * Whether a terminal result is one the cache carries: a terminal kind, a
 * positive attempt, and an outcome of 1..IDEM_OUTCOME_MAX bytes of text that
 * is shaped like a JSON object.  The one check, for the encoders below and
 * for the extension's commit hook, which refuses to queue anything else.
 */
static inline int
idem_cache_result_ok(IdemCacheKind kind, int32_t attempt,
					 const char *outcome, size_t outcome_len)
{
	return (kind == IDEM_CACHE_COMPLETED || kind == IDEM_CACHE_FAILED_PERMANENT) &&
		attempt > 0 && outcome_len > 0 && outcome_len <= IDEM_OUTCOME_MAX &&
		outcome[0] == '{' && outcome[outcome_len - 1] == '}';
}

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

static inline void
idem_cache_hex(char *dst, const uint8_t *src, size_t n)
{
	static const char digits[] = "0123456789abcdef";
	size_t		i;

	for (i = 0; i < n; i++)
	{
		dst[2 * i] = digits[src[i] >> 4];
		dst[2 * i + 1] = digits[src[i] & 0x0f];
	}
}

/* Lower-case hex only; returns 0 on success, -1 on a bad digit. */
static inline int
idem_cache_unhex(uint8_t *dst, const char *src, size_t n)
{
	size_t		i;

	for (i = 0; i < 2 * n; i++)
	{
		char		c = src[i];
		int			v;

		if (c >= '0' && c <= '9')
			v = c - '0';
		else if (c >= 'a' && c <= 'f')
			v = c - 'a' + 10;
		else
			return -1;
		if (i % 2 == 0)
			dst[i / 2] = (uint8_t) (v << 4);
		else
			dst[i / 2] |= (uint8_t) v;
	}
	return 0;
}

/*
 * Write the keyspace of one database into buf (IDEM_CACHE_KEYSPACE_MAX + 1
 * bytes at least).  Returns its length, or -1 if the prefix is longer than
 * IDEM_CACHE_PREFIX_MAX or buf is short.
 */
static inline int
idem_cache_keyspace(char *buf, size_t buflen, const char *prefix,
					uint64_t system_id, uint32_t timeline, uint64_t epoch,
					uint32_t dboid)
{
	int			n;

	if (strlen(prefix) > IDEM_CACHE_PREFIX_MAX ||
		buflen < IDEM_CACHE_KEYSPACE_MAX + 1)
		return -1;
	n = snprintf(buf, buflen, "%s%llu.%lu.%016llx.%lu:", prefix,
				 (unsigned long long) system_id, (unsigned long) timeline,
				 (unsigned long long) epoch, (unsigned long) dboid);
	return (n < 0 || (size_t) n >= buflen) ? -1 : n;
}

/*
 * Write the epoch owner key (see the header) into buf
 * (IDEM_CACHE_EPOCH_KEY_MAX bytes at least).  Returns its length, or -1.
 */
static inline int
idem_cache_epoch_key(char *buf, size_t buflen, const char *prefix,
					 uint64_t system_id, uint32_t timeline, uint64_t epoch)
{
	int			n;

	if (strlen(prefix) > IDEM_CACHE_PREFIX_MAX ||
		buflen < IDEM_CACHE_EPOCH_KEY_MAX)
		return -1;
	n = snprintf(buf, buflen, "%s%llu.%lu.%016llx:owner", prefix,
				 (unsigned long long) system_id, (unsigned long) timeline,
				 (unsigned long long) epoch);
	return (n < 0 || (size_t) n >= buflen) ? -1 : n;
}

/*
 * Write the key of a ledger row into buf (IDEM_CACHE_KEY_MAX bytes).
 * tenant_id is ignored for the platform ledger.  Returns the key's length,
 * or -1 if the keyspace is longer than IDEM_CACHE_KEYSPACE_MAX or buf is
 * short.
 */
static inline int
idem_cache_key(char *buf, size_t buflen, const char *keyspace, int is_platform,
			   int64_t tenant_id, const uint8_t key[IDEM_DIGEST_LEN])
{
	size_t		plen = strlen(keyspace);
	int			n;

	if (plen > IDEM_CACHE_KEYSPACE_MAX || buflen < IDEM_CACHE_KEY_MAX)
		return -1;
	if (is_platform)
		n = snprintf(buf, buflen, "%sp:", keyspace);
	else
		n = snprintf(buf, buflen, "%st:%lld:", keyspace, (long long) tenant_id);
	if (n < 0 || (size_t) n + 2 * IDEM_DIGEST_LEN + 1 > buflen)
		return -1;
	idem_cache_hex(buf + n, key, IDEM_DIGEST_LEN);
	n += 2 * IDEM_DIGEST_LEN;
	buf[n] = '\0';
	return n;
}

/* Write "idem2 " and a MAC placeholder; the caller fills it in later. */
static inline void
idem_cache_put_head(char *buf)
{
	memcpy(buf, IDEM_CACHE_VERSION_TAG " ", 6);
	memset(buf + 6, '0', 2 * IDEM_MAC_LEN);
	buf[IDEM_CACHE_REST_OFFSET - 1] = ' ';
}

/*
 * Encode a terminal result, with an all-zero MAC: compute the MAC over
 * idem_cache_mac_input() and write it with idem_cache_set_mac() before
 * storing the value.  Returns the value's length (a NUL is written too), or
 * -1 for a bad key id, kind, attempt, expiry, outcome or a short buffer.
 */
static inline int
idem_cache_encode_terminal(char *buf, size_t buflen, int32_t key_id,
						   IdemCacheKind kind, int32_t attempt,
						   int64_t expires_ms,
						   const uint8_t fingerprint[IDEM_DIGEST_LEN],
						   const char *outcome, size_t outcome_len)
{
	int			n;

	if (!idem_cache_result_ok(kind, attempt, outcome, outcome_len) ||
		key_id <= 0 || expires_ms < 0 || expires_ms > IDEM_CACHE_EXPIRES_MAX ||
		buflen < IDEM_CACHE_REST_OFFSET)
		return -1;
	idem_cache_put_head(buf);
	n = snprintf(buf + IDEM_CACHE_REST_OFFSET, buflen - IDEM_CACHE_REST_OFFSET,
				 "%ld %c %ld %lld ", (long) key_id, (char) kind,
				 (long) attempt, (long long) expires_ms);
	if (n < 0)
		return -1;
	n += IDEM_CACHE_REST_OFFSET;
	if ((size_t) n + 2 * IDEM_DIGEST_LEN + 1 + outcome_len + 1 > buflen)
		return -1;
	idem_cache_hex(buf + n, fingerprint, IDEM_DIGEST_LEN);
	n += 2 * IDEM_DIGEST_LEN;
	buf[n++] = ' ';
	memcpy(buf + n, outcome, outcome_len);
	n += (int) outcome_len;
	buf[n] = '\0';
	return n;
}

/* Encode a processing marker (all-zero MAC); same conventions. */
static inline int
idem_cache_encode_lease_marker(char *buf, size_t buflen, int32_t key_id,
							   int64_t expires_ms,
							   const uint8_t token[IDEM_TOKEN_LEN])
{
	int			n;

	if (key_id <= 0 || expires_ms < 0 || expires_ms > IDEM_CACHE_EXPIRES_MAX ||
		buflen < IDEM_CACHE_REST_OFFSET)
		return -1;
	idem_cache_put_head(buf);
	n = snprintf(buf + IDEM_CACHE_REST_OFFSET, buflen - IDEM_CACHE_REST_OFFSET,
				 "%ld p %lld ", (long) key_id, (long long) expires_ms);
	if (n < 0)
		return -1;
	n += IDEM_CACHE_REST_OFFSET;
	if ((size_t) n + 2 * IDEM_TOKEN_LEN + 1 > buflen)
		return -1;
	idem_cache_hex(buf + n, token, IDEM_TOKEN_LEN);
	n += 2 * IDEM_TOKEN_LEN;
	buf[n] = '\0';
	return n;
}

/* Write a computed MAC into an encoded value's placeholder. */
static inline void
idem_cache_set_mac(char *value, const uint8_t mac[IDEM_MAC_LEN])
{
	idem_cache_hex(value + 6, mac, IDEM_MAC_LEN);
}

/*
 * Build the MAC input of a value stored under key: the key, one 0x00 byte,
 * then the value's rest (everything after the MAC field).  value is an
 * encoded value (its MAC field is not read).  Returns the input's length,
 * or -1 if the value is too short to have a rest or buf is short.  The
 * server and the client both MAC exactly these bytes.
 */
static inline int
idem_cache_mac_input(char *buf, size_t buflen, const char *key, size_t keylen,
					 const char *value, size_t valuelen)
{
	size_t		restlen;

	if (valuelen <= IDEM_CACHE_REST_OFFSET)
		return -1;
	restlen = valuelen - IDEM_CACHE_REST_OFFSET;
	if (keylen + 1 + restlen > buflen || keylen + 1 + restlen > INT32_MAX)
		return -1;
	memcpy(buf, key, keylen);
	buf[keylen] = '\0';
	memcpy(buf + keylen + 1, value + IDEM_CACHE_REST_OFFSET, restlen);
	return (int) (keylen + 1 + restlen);
}

/*
 * Compare two MACs in time independent of where they differ.  Returns 1
 * when equal.
 */
static inline int
idem_cache_mac_equal(const uint8_t a[IDEM_MAC_LEN], const uint8_t b[IDEM_MAC_LEN])
{
	uint8_t		d = 0;
	int			i;

	for (i = 0; i < IDEM_MAC_LEN; i++)
		d |= (uint8_t) (a[i] ^ b[i]);
	return d == 0;
}

/*
 * Parse a decimal field of 1..maxdigits digits, no leading zero unless
 * allow_zero and the field is "0", ending at a blank at *pos (consumed).
 * Returns 0 and sets *out, or -1.
 */
static inline int
idem_cache_parse_decimal(const char *buf, size_t len, size_t *pos,
						 int maxdigits, int allow_zero, int64_t *out)
{
	size_t		p = *pos;
	int64_t		v = 0;
	int			digits = 0;

	while (p < len && buf[p] >= '0' && buf[p] <= '9' && digits < maxdigits)
	{
		v = v * 10 + (buf[p] - '0');
		p++;
		digits++;
	}
	if (digits == 0 || p >= len || buf[p] != ' ' ||
		(buf[*pos] == '0' && !(allow_zero && digits == 1)))
		return -1;
	*pos = p + 1;
	*out = v;
	return 0;
}

/*
 * Decode an idem2 value read from Valkey.  Returns 0 and fills *out, or -1
 * when the value is malformed or of another version (the reader must then
 * ignore it).  Decoding does not verify the MAC: the reader computes it over
 * idem_cache_mac_input(key, value) with secret[out->key_id] and compares it
 * with out->mac (idem_cache_mac_equal) before trusting anything else.  The
 * outcome is only checked to look like a JSON object; callers that return
 * it to a user parse it as JSON.
 */
static inline int
idem_cache_parse(const char *buf, size_t len, IdemCacheEntry *out)
{
	size_t		pos = IDEM_CACHE_REST_OFFSET;
	int64_t		v;

	memset(out, 0, sizeof(*out));
	if (len < IDEM_CACHE_REST_OFFSET + 4 ||
		memcmp(buf, IDEM_CACHE_VERSION_TAG " ", 6) != 0 ||
		buf[IDEM_CACHE_REST_OFFSET - 1] != ' ' ||
		idem_cache_unhex(out->mac, buf + 6, IDEM_MAC_LEN) != 0)
		return -1;
	out->rest = buf + IDEM_CACHE_REST_OFFSET;
	out->rest_len = len - IDEM_CACHE_REST_OFFSET;

	if (idem_cache_parse_decimal(buf, len, &pos, 10, 0, &v) != 0 ||
		v > IDEM_CACHE_KEY_ID_MAX)
		return -1;
	out->key_id = (int32_t) v;
	if (pos + 2 > len || buf[pos + 1] != ' ')
		return -1;
	switch (buf[pos])
	{
		case IDEM_CACHE_MARKER:
			pos += 2;
			if (idem_cache_parse_decimal(buf, len, &pos, 16, 1, &v) != 0 ||
				v > IDEM_CACHE_EXPIRES_MAX ||
				len != pos + 2 * IDEM_TOKEN_LEN ||
				idem_cache_unhex(out->token, buf + pos, IDEM_TOKEN_LEN) != 0)
				return -1;
			out->kind = IDEM_CACHE_MARKER;
			out->expires_ms = v;
			return 0;
		case IDEM_CACHE_COMPLETED:
		case IDEM_CACHE_FAILED_PERMANENT:
			out->kind = (IdemCacheKind) buf[pos];
			pos += 2;
			break;
		default:
			return -1;
	}
	if (idem_cache_parse_decimal(buf, len, &pos, 10, 0, &v) != 0 ||
		v > INT32_MAX)
		return -1;
	out->attempt = (int32_t) v;
	if (idem_cache_parse_decimal(buf, len, &pos, 16, 1, &v) != 0 ||
		v > IDEM_CACHE_EXPIRES_MAX)
		return -1;
	out->expires_ms = v;
	if (len < pos + 2 * IDEM_DIGEST_LEN + 3 ||
		idem_cache_unhex(out->fingerprint, buf + pos, IDEM_DIGEST_LEN) != 0)
		return -1;
	pos += 2 * IDEM_DIGEST_LEN;
	if (buf[pos] != ' ' || buf[pos + 1] != '{' || buf[len - 1] != '}' ||
		len - pos - 1 > IDEM_OUTCOME_MAX)
		return -1;
	out->outcome = buf + pos + 1;
	out->outcome_len = len - pos - 1;
	return 0;
}

/*
 * Legacy: the idem1 format (no MAC, no expiry).  Nothing writes or trusts
 * it any more; the encoder stays for tests that plant idem1 values and
 * check that they are ignored.
 */
#define IDEM_CACHE_V1_TAG			"idem1"

/* A decoded idem1 value; pointers point into the decoded buffer. */
typedef struct IdemCacheValue
{
	IdemCacheKind kind;
	int32_t		attempt;
	uint8_t		fingerprint[IDEM_DIGEST_LEN];
	const char *outcome;
	size_t		outcome_len;
	uint8_t		token[IDEM_TOKEN_LEN];
} IdemCacheValue;

/*
 * Encode a terminal result.  Returns the value's length (without a NUL, which
 * is written too), or -1 for a bad kind, attempt, oversize outcome or short
 * buffer.
 */
static inline int
idem_cache_encode_result(char *buf, size_t buflen, IdemCacheKind kind,
						 int32_t attempt,
						 const uint8_t fingerprint[IDEM_DIGEST_LEN],
						 const char *outcome, size_t outcome_len)
{
	int			n;

	if (!idem_cache_result_ok(kind, attempt, outcome, outcome_len))
		return -1;
	n = snprintf(buf, buflen, IDEM_CACHE_V1_TAG " %c %d ",
				 (char) kind, (int) attempt);
	if (n < 0 || (size_t) n + 2 * IDEM_DIGEST_LEN + 1 + outcome_len + 1 > buflen)
		return -1;
	idem_cache_hex(buf + n, fingerprint, IDEM_DIGEST_LEN);
	n += 2 * IDEM_DIGEST_LEN;
	buf[n++] = ' ';
	memcpy(buf + n, outcome, outcome_len);
	n += (int) outcome_len;
	buf[n] = '\0';
	return n;
}

/* Encode a processing marker; same return convention. */
static inline int
idem_cache_encode_marker(char *buf, size_t buflen,
						 const uint8_t token[IDEM_TOKEN_LEN])
{
	int			n = (int) strlen(IDEM_CACHE_V1_TAG " p ");

	if (buflen < (size_t) n + 2 * IDEM_TOKEN_LEN + 1)
		return -1;
	memcpy(buf, IDEM_CACHE_V1_TAG " p ", n);
	idem_cache_hex(buf + n, token, IDEM_TOKEN_LEN);
	n += 2 * IDEM_TOKEN_LEN;
	buf[n] = '\0';
	return n;
}

/*
 * Decode a value read from Valkey.  Returns 0 and fills *out, or -1 when the
 * value is malformed or of another version (the reader must then ignore it).
 * The outcome is only checked to look like a JSON object; callers that
 * return it to a user parse it as JSON before trusting it.
 */
static inline int
idem_cache_decode(const char *buf, size_t len, IdemCacheValue *out)
{
	size_t		taglen = strlen(IDEM_CACHE_V1_TAG);
	size_t		pos;
	int64_t		attempt = 0;
	size_t		digits = 0;

	memset(out, 0, sizeof(*out));
	if (len < taglen + 3 || memcmp(buf, IDEM_CACHE_V1_TAG, taglen) != 0 ||
		buf[taglen] != ' ' || buf[taglen + 2] != ' ')
		return -1;
	pos = taglen + 3;
	switch (buf[taglen + 1])
	{
		case IDEM_CACHE_MARKER:
			if (len != pos + 2 * IDEM_TOKEN_LEN ||
				idem_cache_unhex(out->token, buf + pos, IDEM_TOKEN_LEN) != 0)
				return -1;
			out->kind = IDEM_CACHE_MARKER;
			return 0;
		case IDEM_CACHE_COMPLETED:
		case IDEM_CACHE_FAILED_PERMANENT:
			out->kind = (IdemCacheKind) buf[taglen + 1];
			break;
		default:
			return -1;
	}
	while (pos < len && buf[pos] >= '0' && buf[pos] <= '9' && digits < 10)
	{
		attempt = attempt * 10 + (buf[pos] - '0');
		pos++;
		digits++;
	}
	if (digits == 0 || buf[pos - digits] == '0' || attempt > INT32_MAX ||
		pos >= len || buf[pos] != ' ')
		return -1;
	pos++;
	if (len < pos + 2 * IDEM_DIGEST_LEN + 2 ||
		idem_cache_unhex(out->fingerprint, buf + pos, IDEM_DIGEST_LEN) != 0)
		return -1;
	pos += 2 * IDEM_DIGEST_LEN;
	if (buf[pos] != ' ' || buf[pos + 1] != '{' || buf[len - 1] != '}' ||
		len - pos - 1 > IDEM_OUTCOME_MAX)
		return -1;
	out->attempt = (int32_t) attempt;
	out->outcome = buf + pos + 1;
	out->outcome_len = len - pos - 1;
	return 0;
}

#endif							/* IDEM_CACHE_FORMAT_H */
