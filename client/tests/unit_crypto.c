/*
 * unit_crypto.c: idem's SHA-256 and HMAC-SHA-256 (src/common/sha256.c)
 * against OpenSSL's, on random keys and messages, in both block functions;
 * and the wipe of the key's copies that idem_hmac_key leaves on the stack.
 * The results are reported by unit.c (test_crypto), which owns the TAP
 * count.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/evp.h>
#include <openssl/hmac.h>

#ifdef HAVE_VALGRIND_MEMCHECK_H	/* client/Makefile */
#include <valgrind/memcheck.h>
#endif
#ifndef VALGRIND_MAKE_MEM_DEFINED
#define VALGRIND_MAKE_MEM_DEFINED(addr, len) ((void) (addr), (void) (len))
#endif
#ifndef RUNNING_ON_VALGRIND
#define RUNNING_ON_VALGRIND 0
#endif

#include "internal.h"

int			crypto_vs_openssl(int rounds, char *why, size_t whylen);
int			crypto_rounds(int rounds);
int			crypto_key_copies_on_stack(void);

/*
 * rounds random cases: a key of 0..200 bytes (longer than a block too) and
 * a message of 0..1100 bytes, hashed and MACed by both; 1 when every digest
 * and MAC is equal, else 0 with the first difference in why.
 */
int
crypto_vs_openssl(int rounds, char *why, size_t whylen)
{
	unsigned	seed = 20261201;
	uint8_t		key[200],
				msg[1100];
	int			r;

	for (r = 0; r < rounds; r++)
	{
		size_t		keylen = (size_t) rand_r(&seed) % (sizeof(key) + 1);
		size_t		len = (size_t) rand_r(&seed) % (sizeof(msg) + 1);
		uint8_t		ours[32],
					theirs[32];
		unsigned int theirs_len = 0;
		idem_sha256 c;
		idem_hmac	h;
		size_t		i;

		for (i = 0; i < keylen; i++)
			key[i] = (uint8_t) rand_r(&seed);
		for (i = 0; i < len; i++)
			msg[i] = (uint8_t) rand_r(&seed);

		idem_sha256_init(&c);
		idem_sha256_update(&c, msg, len / 3);
		idem_sha256_update(&c, msg + len / 3, len - len / 3);
		idem_sha256_final(&c, ours);
		if (EVP_Digest(msg, len, theirs, &theirs_len, EVP_sha256(), NULL) != 1 ||
			theirs_len != 32 || memcmp(ours, theirs, 32) != 0)
		{
			snprintf(why, whylen, "SHA-256 of %zu bytes differs", len);
			return 0;
		}

		idem_hmac_key(&h, key, keylen);
		idem_hmac_sha256(&h, msg, len, ours);
		if (HMAC(EVP_sha256(), key, (int) keylen, msg, len, theirs, &theirs_len) == NULL ||
			theirs_len != 32 || memcmp(ours, theirs, 32) != 0)
		{
			snprintf(why, whylen, "HMAC-SHA-256 with a %zu-byte key of %zu bytes differs",
					 keylen, len);
			return 0;
		}
	}
	snprintf(why, whylen, "%d random keys and messages", rounds);
	return 1;
}

/* rounds, or a tenth of them under valgrind (the client suite's time). */
int
crypto_rounds(int rounds)
{
	return RUNNING_ON_VALGRIND ? rounds / 10 : rounds;
}

/*
 * The prepared key is key material by design (its pads hashed); it lives
 * here, not on the stack that is searched.
 */
static idem_hmac wipe_prepared;

static void __attribute__((noinline))
wipe_prepare(const uint8_t *key, size_t keylen)
{
	idem_hmac_key(&wipe_prepared, key, keylen);
}

/*
 * How many times the first 32 bytes of key ^ 0x36 or key ^ 0x5c (the pads)
 * or the key itself lie in the stack that the calls before this one left:
 * this frame's uninitialised array covers the frames wipe_prepare and
 * idem_hmac_key used, at the same depth.
 */
static int __attribute__((noinline))
wipe_count(const uint8_t pats[3][32])
{
	volatile uint8_t area[16384];
	uint8_t    *a = (uint8_t *) area;
	size_t		i;
	int			p,
				found = 0;

	/*
	 * Reading these bytes without writing them is the point: they are what
	 * the earlier frames left.  Memcheck is told so; cppcheck, here.
	 */
	VALGRIND_MAKE_MEM_DEFINED(a, sizeof(area));
	for (i = 0; i + 32 <= sizeof(area); i++)
		for (p = 0; p < 3; p++)
			/* cppcheck-suppress uninitvar */
			if (a[i] == pats[p][0] && memcmp(a + i, pats[p], 32) == 0)
				found++;
	return found;
}

/* Copies of a 32-byte key (or of its pads) left on the stack: want 0. */
int
crypto_key_copies_on_stack(void)
{
	uint8_t    *key = malloc(32);	/* not on the stack itself */
	uint8_t		pats[3][32];
	int			i,
				found;

	for (i = 0; i < 32; i++)
	{
		key[i] = (uint8_t) (0xa0 + i);
		pats[0][i] = key[i];
		pats[1][i] = key[i] ^ 0x36;
		pats[2][i] = key[i] ^ 0x5c;
	}
	wipe_prepare(key, 32);
	found = wipe_count((const uint8_t (*)[32]) pats);
	free(key);
	return found;
}
