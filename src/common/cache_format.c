/*-------------------------------------------------------------------------
 *
 * cache_format.c
 *	  The Valkey key and value format "idem2" (cache_format.h, where the
 *	  format is written out): keys, encoding, the MAC input, decoding.
 *
 *	  Plain C: no PostgreSQL, hiredis or libpq headers, no allocation, no
 *	  cryptography, no state; every function works on caller-provided
 *	  buffers and returns an explicit status.  Compiled into both idem.so
 *	  and libidemclient.
 *
 *-------------------------------------------------------------------------
 */
#include "cache_format.h"

#include <stdio.h>
#include <string.h>

/*
 * Whether a terminal result is one the cache carries: a terminal kind, a
 * positive attempt, and an outcome of 1..IDEM_OUTCOME_MAX bytes of text that
 * is shaped like a JSON object.  The one check, for the encoders below and
 * for the extension's commit hook, which refuses to queue anything else.
 */
int
idem_cache_result_ok(IdemCacheKind kind, int32_t attempt,
					 const char *outcome, size_t outcome_len)
{
	return (kind == IDEM_CACHE_COMPLETED || kind == IDEM_CACHE_FAILED_PERMANENT) &&
		attempt > 0 && outcome_len > 0 && outcome_len <= IDEM_OUTCOME_MAX &&
		outcome[0] == '{' && outcome[outcome_len - 1] == '}';
}

/* n bytes as 2n lower-case hex digits into dst (no NUL written). */
void
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
int
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
int
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
int
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
int
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
void
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
int
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
int
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
void
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
int
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
int
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
static int
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
int
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
