/*-------------------------------------------------------------------------
 *
 * sha256.c
 *	  SHA-256 (FIPS 180-4) and HMAC-SHA-256 (RFC 2104) with a prepared key
 *	  (sha256.h), compiled into both the worker (the MAC of each copy) and
 *	  the client library (keys, fingerprints, the MAC of each value it reads
 *	  and of its marker).  No allocation, no state but the choice of block
 *	  function (made once, from CPUID); thread-safe.
 *
 *	  Why not OpenSSL (which every libpq program has loaded) or the server's
 *	  pg_cryptohash/pg_hmac (OpenSSL underneath): measured, the same client
 *	  library built on OpenSSL 3's EVP (the digest and MAC fetched once, a
 *	  MAC key prepared once and duplicated per value) spent 7 to 11 us more
 *	  client CPU per replay (about a third more) and replayed 0.85-1.0x as
 *	  often, and its worker spent about a tenth more CPU per copy (a
 *	  quarter more in small batches); every EVP call allocates and frees a
 *	  context, which this file never does.  The figures: bench/README.md,
 *	  "SHA-256 and HMAC".
 *
 *	  On x86-64 CPUs with the SHA extensions (Intel since Goldmont and Ice
 *	  Lake, AMD since Zen), blocks go through the SHA-NI instructions, about
 *	  6x faster than the portable C: a Valkey replay hashes about ten
 *	  blocks (the key, the fingerprint, our marker's MAC and the value's MAC
 *	  check).  idem_sha256_accel() lets the tests force the portable path.
 *
 *	  A prepared key (idem_hmac) holds the key's inner and outer pads
 *	  hashed, so that each MAC costs two SHA-256 finalisations beyond the
 *	  message itself; the pads are key material and stay in the caller's
 *	  struct.  Every copy of the key or of a hash state derived from it on
 *	  the stack is wiped with explicit_bzero, which the compiler may not
 *	  remove as it removes a memset of memory that is not read again.
 *
 *	  Tested in client/tests: the FIPS 180-2 and RFC 4231 examples, both
 *	  block functions against each other, SHA-256 and HMAC against OpenSSL
 *	  on random keys and messages (unit_crypto.c), and the key wipe.
 *
 *-------------------------------------------------------------------------
 */
#include "sha256.h"

#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define IDEM_SHA_NI 1
#include <cpuid.h>
#include <immintrin.h>
#endif

static const uint32_t K[64] = {
	0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1,
	0x923f82a4, 0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3,
	0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786,
	0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
	0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147,
	0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13,
	0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
	0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
	0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a,
	0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208,
	0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2
};

#define ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void
sha256_block_c(idem_sha256 *c, const uint8_t *p)
{
	uint32_t	w[64];
	uint32_t	a, b, cc, d, e, f, g, h;
	int			i;

	for (i = 0; i < 16; i++)
		w[i] = ((uint32_t) p[4 * i] << 24) | ((uint32_t) p[4 * i + 1] << 16) |
			((uint32_t) p[4 * i + 2] << 8) | (uint32_t) p[4 * i + 3];
	for (i = 16; i < 64; i++)
	{
		uint32_t	s0 = ROTR(w[i - 15], 7) ^ ROTR(w[i - 15], 18) ^ (w[i - 15] >> 3);
		uint32_t	s1 = ROTR(w[i - 2], 17) ^ ROTR(w[i - 2], 19) ^ (w[i - 2] >> 10);

		w[i] = w[i - 16] + s0 + w[i - 7] + s1;
	}
	a = c->h[0]; b = c->h[1]; cc = c->h[2]; d = c->h[3];
	e = c->h[4]; f = c->h[5]; g = c->h[6]; h = c->h[7];
	for (i = 0; i < 64; i++)
	{
		uint32_t	S1 = ROTR(e, 6) ^ ROTR(e, 11) ^ ROTR(e, 25);
		uint32_t	ch = (e & f) ^ (~e & g);
		uint32_t	t1 = h + S1 + ch + K[i] + w[i];
		uint32_t	S0 = ROTR(a, 2) ^ ROTR(a, 13) ^ ROTR(a, 22);
		uint32_t	maj = (a & b) ^ (a & cc) ^ (b & cc);
		uint32_t	t2 = S0 + maj;

		h = g; g = f; f = e; e = d + t1;
		d = cc; cc = b; b = a; a = t1 + t2;
	}
	c->h[0] += a; c->h[1] += b; c->h[2] += cc; c->h[3] += d;
	c->h[4] += e; c->h[5] += f; c->h[6] += g; c->h[7] += h;
}

#ifdef IDEM_SHA_NI
/*
 * One block with the SHA-NI instructions (the state kept as ABEF/CDGH, as
 * SHA256RNDS2 wants it; after Intel's and Jeffrey Walton's public-domain
 * sha256-x86.c).  Message words 16..63 four at a time:
 * W[j] = msg2(msg1(W[j-4], W[j-3]) + W[j-1]:W[j-2] >> 4 bytes, W[j-1]).
 */
__attribute__((target("sha,sse4.1,ssse3")))
static void
sha256_block_ni(idem_sha256 *c, const uint8_t *p)
{
	const __m128i mask = _mm_set_epi64x(0x0c0d0e0f08090a0bULL,
										0x0405060700010203ULL);
	__m128i		st0,
				st1,
				tmp,
				msg,
				abef,
				cdgh;
	__m128i		w[4];
	int			j;

	tmp = _mm_loadu_si128((const __m128i *) &c->h[0]);
	st1 = _mm_loadu_si128((const __m128i *) &c->h[4]);
	tmp = _mm_shuffle_epi32(tmp, 0xB1);	/* CDAB */
	st1 = _mm_shuffle_epi32(st1, 0x1B);	/* EFGH */
	st0 = _mm_alignr_epi8(tmp, st1, 8);	/* ABEF */
	st1 = _mm_blend_epi16(st1, tmp, 0xF0);	/* CDGH */
	abef = st0;
	cdgh = st1;
	for (j = 0; j < 4; j++)
		w[j] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *) (p + 16 * j)),
								mask);
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC unroll 16
#endif
	for (j = 0; j < 16; j++)
	{
		if (j >= 4)
			w[j & 3] = _mm_sha256msg2_epu32(
				_mm_add_epi32(_mm_sha256msg1_epu32(w[j & 3], w[(j + 1) & 3]),
							  _mm_alignr_epi8(w[(j + 3) & 3], w[(j + 2) & 3], 4)),
				w[(j + 3) & 3]);
		msg = _mm_add_epi32(w[j & 3], _mm_loadu_si128((const __m128i *) &K[4 * j]));
		st1 = _mm_sha256rnds2_epu32(st1, st0, msg);
		msg = _mm_shuffle_epi32(msg, 0x0E);
		st0 = _mm_sha256rnds2_epu32(st0, st1, msg);
	}
	st0 = _mm_add_epi32(st0, abef);
	st1 = _mm_add_epi32(st1, cdgh);
	tmp = _mm_shuffle_epi32(st0, 0x1B);	/* FEBA */
	st1 = _mm_shuffle_epi32(st1, 0xB1);	/* DCHG */
	st0 = _mm_blend_epi16(tmp, st1, 0xF0);	/* DCBA */
	st1 = _mm_alignr_epi8(st1, tmp, 8);	/* ABEF */
	_mm_storeu_si128((__m128i *) &c->h[0], st0);
	_mm_storeu_si128((__m128i *) &c->h[4], st1);
}

/* CPUID: SHA (leaf 7, EBX bit 29), SSSE3 and SSE4.1 (leaf 1, ECX 9, 19). */
static int
cpu_has_sha_ni(void)
{
	unsigned int a,
				b,
				c,
				d;

	if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 9)) || !(c & (1u << 19)))
		return 0;
	if (!__get_cpuid_count(7, 0, &a, &b, &c, &d))
		return 0;
	return (b & (1u << 29)) != 0;
}
#endif

/* 1 SHA-NI, 0 portable, -1 not chosen yet (racing first calls agree). */
static int	accel = -1;

int
idem_sha256_accel(int mode)
{
	if (mode >= 0)
		__atomic_store_n(&accel, -1, __ATOMIC_RELAXED);
	if (mode == 0)
		__atomic_store_n(&accel, 0, __ATOMIC_RELAXED);
	if (__atomic_load_n(&accel, __ATOMIC_RELAXED) < 0)
	{
#ifdef IDEM_SHA_NI
		__atomic_store_n(&accel, cpu_has_sha_ni(), __ATOMIC_RELAXED);
#else
		__atomic_store_n(&accel, 0, __ATOMIC_RELAXED);
#endif
	}
	return __atomic_load_n(&accel, __ATOMIC_RELAXED);
}

static inline void
sha256_block(idem_sha256 *c, const uint8_t *p)
{
#ifdef IDEM_SHA_NI
	int			a = __atomic_load_n(&accel, __ATOMIC_RELAXED);

	if (a < 0)
		a = idem_sha256_accel(-1);
	if (a)
	{
		sha256_block_ni(c, p);
		return;
	}
#endif
	sha256_block_c(c, p);
}

void
idem_sha256_init(idem_sha256 *c)
{
	static const uint32_t h0[8] = {
		0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
		0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19
	};

	memcpy(c->h, h0, sizeof(h0));
	c->total = 0;
	c->used = 0;
}

void
idem_sha256_update(idem_sha256 *c, const void *data, size_t len)
{
	const uint8_t *p = data;

	c->total += len;
	if (c->used > 0)
	{
		size_t		take = 64 - c->used;

		if (take > len)
			take = len;
		memcpy(c->buf + c->used, p, take);
		c->used += take;
		p += take;
		len -= take;
		if (c->used < 64)
			return;
		sha256_block(c, c->buf);
		c->used = 0;
	}
	while (len >= 64)
	{
		sha256_block(c, p);
		p += 64;
		len -= 64;
	}
	memcpy(c->buf, p, len);
	c->used = len;
}

void
idem_sha256_final(idem_sha256 *c, uint8_t out[32])
{
	uint64_t	bits = c->total * 8;
	int			i;

	c->buf[c->used++] = 0x80;
	if (c->used > 56)
	{
		memset(c->buf + c->used, 0, 64 - c->used);
		sha256_block(c, c->buf);
		c->used = 0;
	}
	memset(c->buf + c->used, 0, 56 - c->used);
	for (i = 0; i < 8; i++)
		c->buf[56 + i] = (uint8_t) (bits >> (56 - 8 * i));
	sha256_block(c, c->buf);
	for (i = 0; i < 8; i++)
	{
		out[4 * i] = (uint8_t) (c->h[i] >> 24);
		out[4 * i + 1] = (uint8_t) (c->h[i] >> 16);
		out[4 * i + 2] = (uint8_t) (c->h[i] >> 8);
		out[4 * i + 3] = (uint8_t) c->h[i];
	}
	explicit_bzero(c, sizeof(*c));
}

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
		idem_sha256_final(&c, block);	/* wipes c */
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
	explicit_bzero(block, sizeof(block));
	explicit_bzero(pad, sizeof(pad));
}

void
idem_hmac_sha256(const idem_hmac *h, const void *msg, size_t len, uint8_t out[32])
{
	idem_sha256 c = h->inner;
	uint8_t		inner[32];

	idem_sha256_update(&c, msg, len);
	idem_sha256_final(&c, inner);	/* wipes c */
	c = h->outer;
	idem_sha256_update(&c, inner, sizeof(inner));
	idem_sha256_final(&c, out);
}
