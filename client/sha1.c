/*
 * sha1.c
 *	  SHA-1 (FIPS 180-4) of a whole buffer, as lowercase hex: the name Valkey
 *	  gives a script (EVALSHA).  Knowing it locally spares a SCRIPT LOAD on a
 *	  node that may be the one that hangs; a node that lacks the script says
 *	  NOSCRIPT and is sent EVAL.  Not used for anything that needs a secure
 *	  hash.  Tested against the FIPS example vectors in tests/unit.c.
 */
#include "internal.h"

#include <string.h>

#define ROTL(x, n) (((x) << (n)) | ((x) >> (32 - (n))))

static void
sha1_block(uint32_t h[5], const uint8_t *p)
{
	uint32_t	w[80];
	uint32_t	a = h[0],
				b = h[1],
				c = h[2],
				d = h[3],
				e = h[4];
	int			i;

	for (i = 0; i < 16; i++)
		w[i] = ((uint32_t) p[4 * i] << 24) | ((uint32_t) p[4 * i + 1] << 16) |
			((uint32_t) p[4 * i + 2] << 8) | (uint32_t) p[4 * i + 3];
	for (i = 16; i < 80; i++)
		w[i] = ROTL(w[i - 3] ^ w[i - 8] ^ w[i - 14] ^ w[i - 16], 1);
	for (i = 0; i < 80; i++)
	{
		uint32_t	f,
					k,
					t;

		if (i < 20)
			f = (b & c) | (~b & d), k = 0x5a827999;
		else if (i < 40)
			f = b ^ c ^ d, k = 0x6ed9eba1;
		else if (i < 60)
			f = (b & c) | (b & d) | (c & d), k = 0x8f1bbcdc;
		else
			f = b ^ c ^ d, k = 0xca62c1d6;
		t = ROTL(a, 5) + f + e + k + w[i];
		e = d;
		d = c;
		c = ROTL(b, 30);
		b = a;
		a = t;
	}
	h[0] += a;
	h[1] += b;
	h[2] += c;
	h[3] += d;
	h[4] += e;
}

void
idemc_sha1_hex(const void *data, size_t len, char out[41])
{
	static const char hex[] = "0123456789abcdef";
	uint32_t	h[5] = {0x67452301, 0xefcdab89, 0x98badcfe, 0x10325476, 0xc3d2e1f0};
	const uint8_t *p = data;
	uint8_t		tail[128];
	size_t		rest = len % 64,
				tlen = rest < 56 ? 64 : 128,
				i;
	uint64_t	bits = (uint64_t) len * 8;

	for (i = 0; i + 64 <= len; i += 64)
		sha1_block(h, p + i);
	memset(tail, 0, sizeof(tail));
	memcpy(tail, p + i, rest);
	tail[rest] = 0x80;
	for (i = 0; i < 8; i++)
		tail[tlen - 1 - i] = (uint8_t) (bits >> (8 * i));
	for (i = 0; i < tlen; i += 64)
		sha1_block(h, tail + i);
	for (i = 0; i < 20; i++)
	{
		uint8_t		byte = (uint8_t) (h[i / 4] >> (24 - 8 * (i % 4)));

		out[2 * i] = hex[byte >> 4];
		out[2 * i + 1] = hex[byte & 15];
	}
	out[40] = '\0';
}
