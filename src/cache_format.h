/*-------------------------------------------------------------------------
 *
 * cache_format.h
 *	  The Valkey key and value format of idem, version 1.
 *
 * One definition, included by the extension's background worker (which
 * writes terminal results after commit) and by the client helper (which
 * reads them, and writes its processing marker and repopulated results).
 * Plain C99: no PostgreSQL, hiredis or libpq headers, no allocation; every
 * function works on caller-provided buffers and returns an explicit status.
 *
 * Keys (one Valkey key per ledger row; no hash tags, so each key hashes to
 * its own Valkey Cluster slot):
 *
 *	  tenant ledger:    <prefix>t:<tenant_id in decimal>:<key as 64 hex digits>
 *	  platform ledger:  <prefix>p:<key as 64 hex digits>
 *
 * The prefix (GUC idem.valkey_prefix, default "idem:") namespaces databases
 * that share one Valkey.  "t:" and "p:" keep tenant and platform keys apart.
 *
 * Values are one line of ASCII header followed by the JSON outcome:
 *
 *	  terminal result:  idem1 <kind> <attempt> <fingerprint hex 64> <outcome>
 *	                    kind 'c' = completed, 'f' = failed_permanent;
 *	                    attempt in decimal (1..2147483647); outcome is the
 *	                    jsonb text of a JSON object, at most 4096 bytes.
 *	  processing marker: idem1 p <token hex 32>
 *	                    written by a client's gate with SET NX PX <lease>.
 *
 * Anything else (other version, bad hex, trailing bytes, an outcome that does
 * not start with '{') decodes as malformed and must be ignored by readers:
 * the cache is never the authority (SPEC 4.7).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_CACHE_FORMAT_H
#define IDEM_CACHE_FORMAT_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define IDEM_CACHE_VERSION_TAG		"idem1"
#define IDEM_DIGEST_LEN				32
#define IDEM_OUTCOME_MAX			4096
#define IDEM_TOKEN_LEN				16
#define IDEM_CACHE_PREFIX_MAX		64

/* Longest key: prefix + "t:" + 20-digit int64 + ":" + 64 hex digits. */
#define IDEM_CACHE_KEY_MAX	(IDEM_CACHE_PREFIX_MAX + 2 + 20 + 1 + 64 + 1)
/* Longest value: "idem1 c " + 10 digits + " " + 64 hex + " " + outcome. */
#define IDEM_CACHE_VALUE_MAX	(8 + 10 + 1 + 64 + 1 + IDEM_OUTCOME_MAX + 1)

typedef enum IdemCacheKind
{
	IDEM_CACHE_COMPLETED = 'c',
	IDEM_CACHE_FAILED_PERMANENT = 'f',
	IDEM_CACHE_MARKER = 'p'
} IdemCacheKind;

/* A decoded value; pointers point into the decoded buffer. */
typedef struct IdemCacheValue
{
	IdemCacheKind kind;
	int32_t		attempt;		/* terminal kinds only */
	uint8_t		fingerprint[IDEM_DIGEST_LEN];	/* terminal kinds only */
	const char *outcome;		/* terminal kinds only; not NUL-terminated */
	size_t		outcome_len;
	uint8_t		token[IDEM_TOKEN_LEN];	/* marker only */
} IdemCacheValue;

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
 * Write the key of a ledger row into buf.  tenant_id is ignored for the
 * platform ledger.  Returns the key's length, or -1 if the prefix is longer
 * than IDEM_CACHE_PREFIX_MAX or buf (of IDEM_CACHE_KEY_MAX bytes) is short.
 */
static inline int
idem_cache_key(char *buf, size_t buflen, const char *prefix, int is_platform,
			   int64_t tenant_id, const uint8_t key[IDEM_DIGEST_LEN])
{
	size_t		plen = strlen(prefix);
	int			n;

	if (plen > IDEM_CACHE_PREFIX_MAX || buflen < IDEM_CACHE_KEY_MAX)
		return -1;
	if (is_platform)
		n = snprintf(buf, buflen, "%sp:", prefix);
	else
		n = snprintf(buf, buflen, "%st:%lld:", prefix, (long long) tenant_id);
	if (n < 0 || (size_t) n + 2 * IDEM_DIGEST_LEN + 1 > buflen)
		return -1;
	idem_cache_hex(buf + n, key, IDEM_DIGEST_LEN);
	n += 2 * IDEM_DIGEST_LEN;
	buf[n] = '\0';
	return n;
}

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

	if ((kind != IDEM_CACHE_COMPLETED && kind != IDEM_CACHE_FAILED_PERMANENT) ||
		attempt <= 0 || outcome_len == 0 || outcome_len > IDEM_OUTCOME_MAX ||
		outcome[0] != '{')
		return -1;
	n = snprintf(buf, buflen, IDEM_CACHE_VERSION_TAG " %c %d ",
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
	int			n = (int) strlen(IDEM_CACHE_VERSION_TAG " p ");

	if (buflen < (size_t) n + 2 * IDEM_TOKEN_LEN + 1)
		return -1;
	memcpy(buf, IDEM_CACHE_VERSION_TAG " p ", n);
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
	size_t		taglen = strlen(IDEM_CACHE_VERSION_TAG);
	size_t		pos;
	int64_t		attempt = 0;
	size_t		digits = 0;

	memset(out, 0, sizeof(*out));
	if (len < taglen + 3 || memcmp(buf, IDEM_CACHE_VERSION_TAG, taglen) != 0 ||
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
