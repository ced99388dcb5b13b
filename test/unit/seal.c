/*
 * seal.c: the seal of a Citus cluster's cache secrets (idem_seal_secrets,
 * idem_seal_open), built against the extension's own source with OpenSSL:
 * a known answer computed apart (Python's cryptography, AESGCM, on the
 * associated data the seal's header comment describes), then every seal
 * that must not open: each byte changed, each shorter length, a longer
 * one, another node, keyspace or database, fields shifted across their
 * NULs, another join's key (a replayed seal), and a seal of idem 0.3.
 * TAP.  test/unit/run.sh builds and runs it.
 */
#include "postgres.h"

#include <stdio.h>

#include "cache_cluster_seal.h"

/* port.h sends these to libpgport, which this program does not link */
#undef printf
#undef snprintf

static int	n = 0;
static int	failed = 0;

static void
ok(int cond, const char *what)
{
	n++;
	if (!cond)
		failed++;
	printf("%sok %d - %s\n", cond ? "" : "not ", n, what);
}

static void
unhex(uint8 *out, const char *hex, size_t len)
{
	for (size_t i = 0; i < len; i++)
		sscanf(hex + 2 * i, "%2hhx", &out[i]);
}

/* The known answer, computed apart (see the header). */
static const char *const known =
"02a0a1a2a3a4a5a6a7a8a9aaabe6187c2a54da13ae737496c2166bd1cf61bd48"
"0183a6537d8d1f37976eba6410c36756eeaf22533b7dbe26ea2b58a1db653964"
"6a40f2385c637c297c8652a792969ea74d1287c6c264db5c2322380e2468dcce"
"65ad1282d8";

static int
same_secrets(const IdemCacheSecrets *a, const IdemCacheSecrets *b)
{
	return a->current_id == b->current_id &&
		memcmp(a->current, b->current, IDEM_MAC_LEN) == 0 &&
		a->previous_id == b->previous_id &&
		memcmp(a->previous, b->previous, IDEM_MAC_LEN) == 0;
}

static int
zeroed(const IdemCacheSecrets *s)
{
	static const IdemCacheSecrets zero;

	return memcmp(s, &zero, sizeof(zero)) == 0;
}

int
main(void)
{
	uint8		key[IDEM_SEAL_KEY_LEN];
	uint8		other_key[IDEM_SEAL_KEY_LEN];
	uint8		nonce[IDEM_SEAL_NONCE_LEN];
	uint8		expect[IDEM_SEAL_LEN];
	uint8		sealed[IDEM_SEAL_LEN + 1];
	uint8		copy[IDEM_SEAL_LEN + 1];
	uint8		mine[IDEM_SEAL_LEN];
	uint8		v1[IDEM_SEAL_V1_LEN];
	IdemCacheSecrets s;
	IdemCacheSecrets got;
	IdemSealFor what = {
		"7312345678901234567.1.00000000000000ff",
		"idem:7312345678901234567.1.0123456789abcdef.16384:",
		"postgres"
	};
	IdemSealFor other;
	int			bad;
	int			why_ok;
	char		line[200];

	for (int i = 0; i < IDEM_SEAL_KEY_LEN; i++)
	{
		key[i] = (uint8) i;
		other_key[i] = (uint8) (i + 1);
	}
	for (int i = 0; i < IDEM_SEAL_NONCE_LEN; i++)
		nonce[i] = (uint8) (0xa0 + i);
	memset(&s, 0, sizeof(s));
	s.current_id = 7;
	memset(s.current, 0x11, IDEM_MAC_LEN);
	s.previous_id = 6;
	memset(s.previous, 0x22, IDEM_MAC_LEN);
	unhex(expect, known, IDEM_SEAL_LEN);

	printf("1..16\n");
	ok(strlen(known) == 2 * IDEM_SEAL_LEN, "a seal is 101 bytes");
	ok(idem_seal_secrets(key, nonce, &s, &what, sealed) == IDEM_SEAL_OK &&
	   memcmp(sealed, expect, IDEM_SEAL_LEN) == 0,
	   "the seal of known secrets, key, nonce and purpose is the known answer (AES-256-GCM)");
	ok(idem_seal_open(key, expect, IDEM_SEAL_LEN, &what, &got) == IDEM_SEAL_OK &&
	   same_secrets(&got, &s), "the known answer opens to the secrets");

	/* each byte changed: refused, and nothing of the secrets handed out */
	bad = 0;
	why_ok = 1;
	for (int i = 0; i < IDEM_SEAL_LEN; i++)
		for (int bit = 0; bit < 8; bit++)
		{
			IdemSealResult r;

			memcpy(copy, expect, IDEM_SEAL_LEN);
			copy[i] ^= (uint8) (1 << bit);
			memset(&got, 0x55, sizeof(got));
			r = idem_seal_open(key, copy, IDEM_SEAL_LEN, &what, &got);
			if (r == IDEM_SEAL_OK || !zeroed(&got))
				bad++;
			if (r != (i == 0 ? IDEM_SEAL_MALFORMED : IDEM_SEAL_REFUSED))
				why_ok = 0;
		}
	snprintf(line, sizeof(line),
			 "each of its %d bits flipped: refused, the secrets zeroed (%d opened)",
			 8 * IDEM_SEAL_LEN, bad);
	ok(bad == 0, line);
	ok(why_ok, "... as malformed for the version byte, refused for the rest");

	/* truncated, extended */
	bad = 0;
	for (size_t len = 0; len < IDEM_SEAL_LEN; len++)
		if (idem_seal_open(key, expect, len, &what, &got) != IDEM_SEAL_MALFORMED ||
			!zeroed(&got))
			bad++;
	ok(bad == 0, "each shorter length (0 to 100 bytes): malformed");
	memcpy(copy, expect, IDEM_SEAL_LEN);
	copy[IDEM_SEAL_LEN] = 0;
	ok(idem_seal_open(key, copy, IDEM_SEAL_LEN + 1, &what, &got) == IDEM_SEAL_MALFORMED,
	   "one byte longer: malformed");

	/* another purpose (a seal of this code: the same bytes as the known
	 * answer when the test above holds) */
	idem_seal_secrets(key, nonce, &s, &what, mine);
	other = what;
	other.identity = "7312345678901234567.1.0000000000000100";
	ok(idem_seal_open(key, mine, IDEM_SEAL_LEN, &other, &got) == IDEM_SEAL_REFUSED &&
	   zeroed(&got), "for another identity of the node (its epoch changed): refused");
	other = what;
	other.identity = "7312345678901234568.1.00000000000000ff";
	ok(idem_seal_open(key, mine, IDEM_SEAL_LEN, &other, &got) == IDEM_SEAL_REFUSED,
	   "for another node: refused");
	other = what;
	other.keyspace = "idem:7312345678901234567.1.0123456789abcdee.16384:";
	ok(idem_seal_open(key, mine, IDEM_SEAL_LEN, &other, &got) == IDEM_SEAL_REFUSED,
	   "for another cluster keyspace: refused");
	other = what;
	other.database = "postgres2";
	ok(idem_seal_open(key, mine, IDEM_SEAL_LEN, &other, &got) == IDEM_SEAL_REFUSED,
	   "for another database: refused");
	{
		IdemSealFor a = {"n1", "ks", "db"};
		IdemSealFor b = {"n", "1ks", "db"};

		ok(idem_seal_secrets(key, nonce, &s, &a, sealed) == IDEM_SEAL_OK &&
		   idem_seal_open(key, sealed, IDEM_SEAL_LEN, &b, &got) == IDEM_SEAL_REFUSED,
		   "the same bytes split otherwise between identity and keyspace: refused");
	}

	/* another join's key: a seal replayed after its one-time key was used */
	ok(idem_seal_open(other_key, expect, IDEM_SEAL_LEN, &what, &got) == IDEM_SEAL_REFUSED &&
	   zeroed(&got), "under the one-time key of another join (a replayed seal): refused");

	/* a fresh nonce: another seal, which opens */
	nonce[0] ^= 1;
	ok(idem_seal_secrets(key, nonce, &s, &what, sealed) == IDEM_SEAL_OK &&
	   memcmp(sealed, expect, IDEM_SEAL_LEN) != 0 &&
	   idem_seal_open(key, sealed, IDEM_SEAL_LEN, &what, &got) == IDEM_SEAL_OK &&
	   same_secrets(&got, &s), "another nonce: another seal of the same secrets, which opens");
	/* ... whose nonce does not go with the first one's ciphertext */
	memcpy(copy, expect, IDEM_SEAL_LEN);
	memcpy(copy + 1, sealed + 1, IDEM_SEAL_NONCE_LEN);
	ok(idem_seal_open(key, copy, IDEM_SEAL_LEN, &what, &got) == IDEM_SEAL_REFUSED,
	   "a seal with another seal's nonce: refused");

	/* a seal of idem 0.3: 120 bytes, whatever they hold */
	memset(v1, 0xab, sizeof(v1));
	ok(idem_seal_open(key, v1, sizeof(v1), &what, &got) == IDEM_SEAL_OLD_FORMAT &&
	   zeroed(&got), "a seal of idem 0.3 (120 bytes): refused as the old format");
	return failed == 0 ? 0 : 1;
}
