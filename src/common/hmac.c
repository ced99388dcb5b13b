/*
 * hmac.c
 *	  HMAC-SHA-256 (RFC 2104) over idem's own SHA-256 (sha256.c), for the
 *	  MAC of idem2 values (cache_format.h), in the worker and the client
 *	  (sha256.h).  A key is prepared once (its inner and outer pads hashed),
 *	  so that each MAC costs two SHA-256 finalisations beyond the message
 *	  itself.  Tested against RFC 4231 in client/tests/unit.c.  No state of
 *	  its own; thread-safe.
 */
#include "sha256.h"

#include <string.h>

void
idem_hmac_key(idem_hmac *h, const uint8_t *key, size_t keylen)
{
	uint8_t		block[64];
	uint8_t		pad[64];
	int			i;

	memset(block, 0, sizeof(block));
	if (keylen > sizeof(block))
	{
		idem_sha256 c;

		idem_sha256_init(&c);
		idem_sha256_update(&c, key, keylen);
		idem_sha256_final(&c, block);
	}
	else if (keylen > 0)
		memcpy(block, key, keylen);
	for (i = 0; i < 64; i++)
		pad[i] = block[i] ^ 0x36;
	idem_sha256_init(&h->inner);
	idem_sha256_update(&h->inner, pad, sizeof(pad));
	for (i = 0; i < 64; i++)
		pad[i] = block[i] ^ 0x5c;
	idem_sha256_init(&h->outer);
	idem_sha256_update(&h->outer, pad, sizeof(pad));
	memset(block, 0, sizeof(block));
	memset(pad, 0, sizeof(pad));
}

void
idem_hmac_sha256(const idem_hmac *h, const void *msg, size_t len, uint8_t out[32])
{
	idem_sha256 c = h->inner;
	uint8_t		inner[32];

	idem_sha256_update(&c, msg, len);
	idem_sha256_final(&c, inner);
	c = h->outer;
	idem_sha256_update(&c, inner, sizeof(inner));
	idem_sha256_final(&c, out);
}
