/*-------------------------------------------------------------------------
 *
 * sha256.h
 *	  SHA-256 and HMAC-SHA-256 with a prepared key (sha256.c): one
 *	  definition, compiled into both the extension's background worker (the
 *	  MAC of each value it copies to Valkey) and the client library (keys,
 *	  fingerprints, the MAC of values it reads and of its marker).
 *
 * Plain C11: no PostgreSQL or libpq headers, no allocation, no state but
 * the choice of block function (made once, from CPUID).  Thread-safe.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_SHA256_H
#define IDEM_SHA256_H

#include <stddef.h>
#include <stdint.h>

typedef struct idem_sha256
{
	uint32_t	h[8];
	uint64_t	total;
	size_t		used;
	uint8_t		buf[64];
} idem_sha256;

void		idem_sha256_init(idem_sha256 *c);
void		idem_sha256_update(idem_sha256 *c, const void *data, size_t len);
void		idem_sha256_final(idem_sha256 *c, uint8_t out[32]);
/* Which block function: mode 1 the fastest this CPU has (the default),
 * 0 the portable C (tests), -1 ask.  Returns 1 if SHA-NI is in use. */
int			idem_sha256_accel(int mode);

/* HMAC-SHA-256 with a prepared key. */
typedef struct idem_hmac
{
	idem_sha256 inner;			/* after the key ^ ipad block */
	idem_sha256 outer;			/* after the key ^ opad block */
} idem_hmac;

void		idem_hmac_key(idem_hmac *h, const uint8_t *key, size_t keylen);
void		idem_hmac_sha256(const idem_hmac *h, const void *msg, size_t len,
							 uint8_t out[32]);

#endif							/* IDEM_SHA256_H */
