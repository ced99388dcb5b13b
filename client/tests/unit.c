/*
 * unit.c: client tests that need no server.
 *	  SHA-256 against the FIPS 180-2 examples; idem_key vectors (computed
 *	  independently, and equal to SQL idem_key: see itest.c); canonical JSON
 *	  vectors taken from PostgreSQL 15 output; invalid JSON refused; the idem2 cache format of
 *	  src/common/cache_format.h (keyspace, keys, values, the MAC input); the
 *	  API with NULLs, bad options and servers that are down: errors, no crash.
 */
#include <stdlib.h>
#include <string.h>

#include "idem_client.h"
#include "internal.h"
#include "tap.h"

static void
hex(const uint8_t *d, size_t n, char *out)
{
	idem_cache_hex(out, d, n);
	out[2 * n] = '\0';
}

static int
sha_is(const char *msg, size_t len, const char *want)
{
	idem_sha256 c;
	uint8_t		d[32];
	char		h[65];

	idem_sha256_init(&c);
	idem_sha256_update(&c, msg, len);
	idem_sha256_final(&c, d);
	hex(d, 32, h);
	return strcmp(h, want) == 0;
}

static void
test_sha256(const char *path)
{
	static const char *m2 =
		"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
	char	   *million;
	idem_sha256 c;
	uint8_t		d1[32],
				d2[32];
	size_t		i,
				split;
	int			same = 1;
	char		buf[300];

	tap_ok(sha_is("abc", 3, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"),
		   "sha256 (%s) FIPS 180-2 example 1 (abc)", path);
	tap_ok(sha_is("", 0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
		   "sha256 (%s) of the empty string", path);
	tap_ok(sha_is(m2, strlen(m2), "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"),
		   "sha256 (%s) FIPS 180-2 example 2 (448 bits)", path);
	million = malloc(1000000);
	memset(million, 'a', 1000000);
	tap_ok(sha_is(million, 1000000, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"),
		   "sha256 (%s) FIPS 180-2 example 3 (a million 'a')", path);
	free(million);
	for (i = 0; i < sizeof(buf); i++)
		buf[i] = (char) (i * 7 + 3);
	idem_sha256_init(&c);
	idem_sha256_update(&c, buf, sizeof(buf));
	idem_sha256_final(&c, d1);
	for (split = 0; split <= sizeof(buf); split += 13)
	{
		idem_sha256_init(&c);
		idem_sha256_update(&c, buf, split);
		idem_sha256_update(&c, buf + split, sizeof(buf) - split);
		idem_sha256_final(&c, d2);
		if (memcmp(d1, d2, 32) != 0)
			same = 0;
	}
	tap_ok(same, "sha256 (%s) incremental updates equal one-shot at every split", path);
}

/* The SHA-NI block function against the portable one, on random input of
 * every length up to 4 blocks and more (where the CPU has SHA-NI). */
static void
test_sha256_paths(void)
{
	uint8_t		buf[1100],
				d1[32],
				d2[32];
	unsigned	seed = 12345;
	size_t		len,
				i;
	int			same = 1;
	idem_sha256 c;

	if (!idem_sha256_accel(1))
	{
		tap_ok(1, "# SKIP this CPU has no SHA-NI: only the portable SHA-256");
		return;
	}
	test_sha256("SHA-NI");
	for (len = 0; len <= sizeof(buf); len += (len < 300 ? 1 : 97))
	{
		for (i = 0; i < len; i++)
			buf[i] = (uint8_t) rand_r(&seed);
		idem_sha256_accel(1);
		idem_sha256_init(&c);
		idem_sha256_update(&c, buf, len);
		idem_sha256_final(&c, d1);
		idem_sha256_accel(0);
		idem_sha256_init(&c);
		idem_sha256_update(&c, buf, len);
		idem_sha256_final(&c, d2);
		if (memcmp(d1, d2, 32) != 0)
			same = 0;
	}
	idem_sha256_accel(1);
	tap_ok(same, "sha256: SHA-NI and portable C agree on random input of 0..1100 bytes");
}

static int
key_is(const char *scope, const char *id, const char *want)
{
	uint8_t		k[32];
	char		h[65];

	if (idem_key(scope, id, k) != 0)
		return 0;
	hex(k, 32, h);
	return strcmp(h, want) == 0;
}

static int
hmac_is(const uint8_t *key, size_t keylen, const char *msg, const char *want)
{
	idem_hmac	h;
	uint8_t		d[32];
	char		x[65];

	idem_hmac_key(&h, key, keylen);
	idem_hmac_sha256(&h, msg, strlen(msg), d);
	hex(d, 32, x);
	return strcmp(x, want) == 0;
}

/* HMAC-SHA-256, RFC 4231 test cases 1, 2 and 6 (a key longer than a block). */
static void
test_hmac(void)
{
	uint8_t		k1[20],
				k6[131];

	memset(k1, 0x0b, sizeof(k1));
	memset(k6, 0xaa, sizeof(k6));
	tap_ok(hmac_is(k1, sizeof(k1), "Hi There",
				   "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"),
		   "hmac-sha256 RFC 4231 test case 1");
	tap_ok(hmac_is((const uint8_t *) "Jefe", 4, "what do ya want for nothing?",
				   "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"),
		   "hmac-sha256 RFC 4231 test case 2");
	tap_ok(hmac_is(k6, sizeof(k6), "Test Using Larger Than Block-Size Key - Hash Key First",
				   "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"),
		   "hmac-sha256 RFC 4231 test case 6 (key longer than a block)");
}

static void
test_keys(void)
{
	uint8_t		k[32];
	uint8_t		fp[32];
	char		h[65];

	tap_ok(key_is("billing.charge", "run-42", "5c76c6f58eff897da07846a990b77e88e8a0d282df751a06dfd7653c771f32cd"),
		   "idem_key('billing.charge', 'run-42') vector");
	tap_ok(key_is("", "", "af5570f5a1810b7af78caf4bc70a660f0df51e42baf91d4de5b2328de0e83dfc"),
		   "idem_key('', '') vector");
	tap_ok(key_is("\xc3\xa9", "\xc3\xbc\xf0\x9f\x98\x80", "72f1b540655b10e9fecac9e2de4b149b5eddf449aeb5cf6edd2ce2cbfc893fa8"),
		   "idem_key with multi-byte UTF-8 (lengths in bytes)");
	tap_ok(key_is("a", "bc", "b534ce16ac9c8b36823f39a395ce8e0e3c7ad9605b82b5444f18cadacd217a5d") &&
		   key_is("ab", "c", "f2939f903016e5bb29b1e4a61cdbd376220ca03a24180b39995f2d50f2e0a647"),
		   "idem_key('a','bc') and ('ab','c') differ (length-prefixed)");
	tap_ok(idem_key(NULL, "x", k) == -1 && idem_key("x", NULL, k) == -1 &&
		   idem_key("\xff", "x", k) == -1 && idem_key("x", "\xc3", k) == -1,
		   "idem_key refuses NULL and invalid UTF-8");
	tap_ok(idem_fingerprint("{ }", 3, fp, NULL, 0) == 0 &&
		   (hex(fp, 32, h), strcmp(h, "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a") == 0),
		   "idem_fingerprint('{ }') = sha256('{}')");
	tap_ok(idem_fingerprint("{\"a\":1.0e0}", 11, fp, NULL, 0) == 0 &&
		   idem_fingerprint("{\"a\": 1.0}", 10, k, NULL, 0) == 0 &&
		   memcmp(fp, k, 32) == 0,
		   "idem_fingerprint equal for equal jsonb documents");
}

static int
canon_is(const char *in, const char *want)
{
	size_t		n;
	char		err[200];
	char	   *c = idem_json_canonical(in, strlen(in), &n, err, sizeof(err));
	int			ok = c != NULL && strcmp(c, want) == 0 && n == strlen(want);

	if (!ok)
		tap_diag("canonical(%s) = %s (want %s) %s", in, c ? c : "NULL", want,
				 c ? "" : err);
	idem_free(c);
	return ok;
}

static int
canon_refused(const char *in, size_t len)
{
	size_t		n;
	char		err[200];
	char	   *c = idem_json_canonical(in, len, &n, err, sizeof(err));

	if (c != NULL)
	{
		tap_diag("canonical(%.*s) accepted: %s", (int) len, in, c);
		idem_free(c);
		return 0;
	}
	return err[0] != '\0';
}

static void
test_canonical(void)
{
	/* each pair was printed by PostgreSQL 15: SELECT $1::jsonb::text */
	static const char *const pairs[][2] = {
		{"{\"a\":1,\"a\":2,\"bb\":1,\"c\":{}}", "{\"a\": 2, \"c\": {}, \"bb\": 1}"},
		{"[1,2 ,{\"x\" :[]}]", "[1, 2, {\"x\": []}]"},
		{"\"\\u00e9\\u001f\\b/\"", "\"\xc3\xa9\\u001f\\b/\""},
		{"\"\\uD83D\\uDE00\"", "\"\xf0\x9f\x98\x80\""},
		{"\"\\u00E9\\/\"", "\"\xc3\xa9/\""},
		{"1e2", "100"}, {"1.50", "1.50"}, {"1.5e3", "1500"}, {"1e-2", "0.01"},
		{"-0", "0"}, {"0.0", "0.0"}, {"1.50e1", "15.0"}, {"1E+2", "100"},
		{"0.1e001", "1"}, {"-0.0e-3", "0.0000"}, {"1.0e-5", "0.000010"},
		{"-12.345e1", "-123.45"}, {"123e-5", "0.00123"}, {"0e100000", "0"},
		{"0.000e131075", "0"}, {" 1 ", "1"}, {"\t\r\n[ ]\n", "[]"},
		{"{}", "{}"}, {"true", "true"}, {"[null,false]", "[null, false]"},
		{"{\"b\":1,\"aa\":2,\"a\":3,\"\":0}", "{\"\": 0, \"a\": 3, \"b\": 1, \"aa\": 2}"},
		{"{\"\xc3\xa9\":1,\"z\":2,\"zz\":3}", "{\"z\": 2, \"zz\": 3, \"\xc3\xa9\": 1}"},
		{"\"tab\\there \\\"q\\\" back\\\\slash \\r\\n\\f\"", "\"tab\\there \\\"q\\\" back\\\\slash \\r\\n\\f\""},
		{"\"\\u007f\\u0001\"", "\"\x7f\\u0001\""},
		{"{\"k\":{\"b\":[1,{\"d\":1,\"c\":2}],\"a\":null}}", "{\"k\": {\"a\": null, \"b\": [1, {\"c\": 2, \"d\": 1}]}}"},
	};
	static const char *const bad[] = {
		"", " ", "01", "1.", ".5", "+1", "-", "1e", "1e+", "[1,2,]", "{\"a\":1,}",
		"tru", "truex", "nul", "True", "\"\\ud800\"", "\"\\udc00\"",
		"\"\\ud800\\u0041\"", "\"\\x\"", "\"\\U0041\"", "\"\\u0000\"", "\"a\nb\"",
		"{a:1}", "{\"a\" 1}", "[1 2]", "1 2", "\"unterminated", "0e-16384",
		"0.0e-16383", "1e2147483647", "0e1073741823", "0e-1073741822", "1e131072",
		"100e131070", "1e-16384", "'x'", "[", "{", "NaN", "Infinity", "[1]]",
		"\"\\u12\"", "1.5e3x",
	};
	size_t		i;
	int			all = 1;
	char		deep[2 * 600 + 1];

	for (i = 0; i < sizeof(pairs) / sizeof(pairs[0]); i++)
		if (!canon_is(pairs[i][0], pairs[i][1]))
			all = 0;
	tap_ok(all, "canonical JSON: %zu vectors printed by PostgreSQL 15",
		   sizeof(pairs) / sizeof(pairs[0]));
	all = 1;
	for (i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
		if (!canon_refused(bad[i], strlen(bad[i])))
			all = 0;
	tap_ok(all, "canonical JSON: %zu inputs jsonb refuses are refused, with a message",
		   sizeof(bad) / sizeof(bad[0]));
	tap_ok(canon_refused("\"\xff\"", 3) && canon_refused("\"\xed\xa0\x80\"", 5) &&
		   canon_refused("\"\xc0\xaf\"", 4) && canon_refused("\"a\0b\"", 5) &&
		   canon_refused("\"\xf4\x90\x80\x80\"", 6),
		   "canonical JSON: invalid UTF-8, encoded surrogates, overlongs, NUL refused");
	{
		size_t		n;
		char	   *c = idem_json_canonical("1e16383", 7, &n, NULL, 0);

		tap_ok(c && n == 16384 && c[0] == '1' && c[1] == '0' && c[16383] == '0',
			   "canonical JSON: 1e16383 prints 16384 digits");
		idem_free(c);
		c = idem_json_canonical("1e-16383", 8, &n, NULL, 0);
		tap_ok(c && n == 16385 && strncmp(c, "0.000", 5) == 0 && c[16384] == '1',
			   "canonical JSON: 1e-16383 prints 16383 decimals");
		idem_free(c);
	}
	for (i = 0; i < 600; i++)
	{
		deep[i] = '[';
		deep[1199 - i] = ']';
	}
	deep[1200] = '\0';
	tap_ok(canon_refused(deep, 1200), "canonical JSON: nesting deeper than 512 refused");
	deep[0] = '\0';
	for (i = 0; i < 500; i++)
		deep[i] = '[', deep[999 - i] = ']';
	{
		char	   *c = idem_json_canonical(deep, 1000, NULL, NULL, 0);

		tap_ok(c != NULL, "canonical JSON: 500 levels accepted");
		idem_free(c);
	}
}

/* The idem2 format of src/common/cache_format.h: keys, values, the MAC input. */
static void
test_cache_format(void)
{
	uint8_t		key[32],
				fp[32],
				mac[32],
				token[16];
	char		ks[IDEM_CACHE_KEYSPACE_MAX + 1];
	char		k[IDEM_CACHE_KEY_MAX];
	char		v[IDEM_CACHE_VALUE_MAX];
	char		v2[IDEM_CACHE_VALUE_MAX];
	char		in[IDEM_CACHE_MAC_INPUT_MAX];
	char		big[IDEM_OUTCOME_MAX + 2];
	char		prefix[IDEM_CACHE_PREFIX_MAX + 2];
	IdemCacheEntry e;
	int			kl,
				vl,
				il,
				n,
				all;
	size_t		i;

	for (i = 0; i < 32; i++)
	{
		key[i] = (uint8_t) i;
		fp[i] = (uint8_t) (0xff - i);
		mac[i] = (uint8_t) (0xa0 + i);
	}
	for (i = 0; i < 16; i++)
		token[i] = (uint8_t) (0x10 * (i % 16) + 1);

	n = idem_cache_keyspace(ks, sizeof(ks), "idem:", UINT64_C(7301234567890123456), 1,
							UINT64_C(0x0123456789abcdef), 16384);
	tap_ok(n > 0 && strcmp(ks, "idem:7301234567890123456.1.0123456789abcdef.16384:") == 0,
		   "keyspace: prefix, system identifier, timeline, epoch, database (%s)", ks);
	{
		char		ek[IDEM_CACHE_EPOCH_KEY_MAX];

		n = idem_cache_epoch_key(ek, sizeof(ek), "idem:", UINT64_C(7301234567890123456), 1,
								 UINT64_C(0x00000000000000ff));
		tap_ok(n > 0 && strcmp(ek, "idem:7301234567890123456.1.00000000000000ff:owner") == 0,
			   "epoch owner key: prefix, system identifier, timeline, epoch (%s)", ek);
		memset(prefix, 'x', sizeof(prefix));
		prefix[IDEM_CACHE_PREFIX_MAX] = '\0';
		n = idem_cache_epoch_key(ek, sizeof(ek), prefix, UINT64_MAX, UINT32_MAX, UINT64_MAX);
		tap_ok(n == IDEM_CACHE_EPOCH_KEY_MAX - 1,
			   "epoch owner key: the longest fits exactly (%d)", n);
	}
	memset(prefix, 'x', sizeof(prefix));
	prefix[IDEM_CACHE_PREFIX_MAX] = '\0';
	n = idem_cache_keyspace(ks, sizeof(ks), prefix, UINT64_MAX, UINT32_MAX, UINT64_MAX,
							UINT32_MAX);
	tap_ok(n == IDEM_CACHE_KEYSPACE_MAX &&
		   idem_cache_key(k, sizeof(k), ks, 0, INT64_MIN, key) == IDEM_CACHE_KEY_MAX - 1,
		   "keyspace and key: the longest fit exactly (%d, %d)", n, IDEM_CACHE_KEYSPACE_MAX);
	prefix[IDEM_CACHE_PREFIX_MAX] = 'x';
	prefix[IDEM_CACHE_PREFIX_MAX + 1] = '\0';
	tap_ok(idem_cache_keyspace(ks, sizeof(ks), prefix, 1, 1, 1, 1) == -1 &&
		   idem_cache_keyspace(ks, IDEM_CACHE_KEYSPACE_MAX, "idem:", 1, 1, 1, 1) == -1,
		   "keyspace: a prefix over the limit, a short buffer refused");

	idem_cache_keyspace(ks, sizeof(ks), "idem:", UINT64_C(7301234567890123456), 1,
						UINT64_C(0x0123456789abcdef), 16384);
	kl = idem_cache_key(k, sizeof(k), ks, 0, 7, key);
	tap_ok(kl > 0 && strcmp(k, "idem:7301234567890123456.1.0123456789abcdef.16384:t:7:"
							"000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f") == 0,
		   "tenant key in the keyspace");

	vl = idem_cache_encode_terminal(v, sizeof(v), 3, IDEM_CACHE_COMPLETED, 2,
									INT64_C(1790000000123), fp, "{\"a\": 1}", 8);
	tap_ok(vl > 0 && (size_t) vl == strlen(v) &&
		   strncmp(v, "idem2 0000000000000000000000000000000000000000000000000000000000000000 "
				   "3 c 2 1790000000123 fffefd", 97) == 0 &&
		   strcmp(v + vl - 9, " {\"a\": 1}") == 0,
		   "terminal: idem2, zero MAC placeholder, key id, kind, attempt, expiry, fingerprint, outcome");
	idem_cache_set_mac(v, mac);
	tap_ok(strncmp(v, "idem2 a0a1a2a3", 14) == 0 && v[IDEM_CACHE_REST_OFFSET - 1] == ' ' &&
		   v[IDEM_CACHE_REST_OFFSET] == '3',
		   "set_mac fills the MAC field only");
	tap_ok(idem_cache_parse(v, vl, &e) == 0 && e.kind == IDEM_CACHE_COMPLETED &&
		   e.key_id == 3 && e.attempt == 2 && e.expires_ms == INT64_C(1790000000123) &&
		   memcmp(e.fingerprint, fp, 32) == 0 && memcmp(e.mac, mac, 32) == 0 &&
		   e.outcome_len == 8 && memcmp(e.outcome, "{\"a\": 1}", 8) == 0 &&
		   e.rest == v + IDEM_CACHE_REST_OFFSET && e.rest_len == (size_t) vl - IDEM_CACHE_REST_OFFSET,
		   "terminal: parse gives back every field, and the rest the MAC covers");

	il = idem_cache_mac_input(in, sizeof(in), k, kl, v, vl);
	tap_ok(il == kl + 1 + vl - IDEM_CACHE_REST_OFFSET && memcmp(in, k, kl) == 0 &&
		   in[kl] == '\0' && memcmp(in + kl + 1, "3 c 2 1790000000123 ", 20) == 0 &&
		   memcmp(in + kl + 1, e.rest, e.rest_len) == 0,
		   "MAC input: the full key, one 0x00, the rest as stored");
	tap_ok(idem_cache_mac_input(in, kl + (size_t) vl - IDEM_CACHE_REST_OFFSET, k, kl, v, vl) == -1 &&
		   idem_cache_mac_input(in, sizeof(in), k, kl, v, IDEM_CACHE_REST_OFFSET) == -1,
		   "MAC input: a short buffer, a value without a rest refused");
	tap_ok(idem_cache_mac_equal(e.mac, mac) && (mac[31] ^= 1, !idem_cache_mac_equal(e.mac, mac)),
		   "mac_equal: equal, and one bit differs");
	mac[31] ^= 1;

	vl = idem_cache_encode_terminal(v2, sizeof(v2), 2147483647, IDEM_CACHE_FAILED_PERMANENT,
									2147483647, IDEM_CACHE_EXPIRES_MAX, fp, "{}", 2);
	tap_ok(vl > 0 && idem_cache_parse(v2, vl, &e) == 0 &&
		   e.kind == IDEM_CACHE_FAILED_PERMANENT && e.key_id == 2147483647 &&
		   e.attempt == 2147483647 && e.expires_ms == IDEM_CACHE_EXPIRES_MAX &&
		   e.outcome_len == 2,
		   "failed_permanent with the largest key id, attempt and expiry");
	memset(big, ' ', sizeof(big));
	big[0] = '{';
	big[IDEM_OUTCOME_MAX - 1] = '}';
	vl = idem_cache_encode_terminal(v2, sizeof(v2), 2147483647, IDEM_CACHE_COMPLETED,
									2147483647, IDEM_CACHE_EXPIRES_MAX, fp, big, IDEM_OUTCOME_MAX);
	tap_ok(vl == IDEM_CACHE_VALUE_MAX - 1 && idem_cache_parse(v2, vl, &e) == 0 &&
		   e.outcome_len == IDEM_OUTCOME_MAX,
		   "the longest value fits IDEM_CACHE_VALUE_MAX exactly");
	big[IDEM_OUTCOME_MAX] = '}';
	tap_ok(idem_cache_encode_terminal(v2, sizeof(v2), 1, IDEM_CACHE_COMPLETED, 1, 0, fp, big, IDEM_OUTCOME_MAX + 1) == -1 &&
		   idem_cache_encode_terminal(v2, sizeof(v2), 0, IDEM_CACHE_COMPLETED, 1, 0, fp, "{}", 2) == -1 &&
		   idem_cache_encode_terminal(v2, sizeof(v2), 1, IDEM_CACHE_MARKER, 1, 0, fp, "{}", 2) == -1 &&
		   idem_cache_encode_terminal(v2, sizeof(v2), 1, IDEM_CACHE_COMPLETED, 0, 0, fp, "{}", 2) == -1 &&
		   idem_cache_encode_terminal(v2, sizeof(v2), 1, IDEM_CACHE_COMPLETED, 1, -1, fp, "{}", 2) == -1 &&
		   idem_cache_encode_terminal(v2, sizeof(v2), 1, IDEM_CACHE_COMPLETED, 1,
									  IDEM_CACHE_EXPIRES_MAX + 1, fp, "{}", 2) == -1 &&
		   idem_cache_encode_terminal(v2, sizeof(v2), 1, IDEM_CACHE_COMPLETED, 1, 0, fp, "[]", 2) == -1 &&
		   idem_cache_encode_terminal(v2, 100, 1, IDEM_CACHE_COMPLETED, 1, 0, fp, "{}", 2) == -1,
		   "terminal encode refuses oversize outcome, key id 0, bad kind/attempt/expiry, non-object, short buffer");

	vl = idem_cache_encode_lease_marker(v2, sizeof(v2), 5, INT64_C(1790000030000), token);
	idem_cache_set_mac(v2, mac);
	tap_ok(vl > 0 && strcmp(v2 + IDEM_CACHE_REST_OFFSET, "5 p 1790000030000 01112131415161718191a1b1c1d1e1f1") == 0 &&
		   idem_cache_parse(v2, vl, &e) == 0 && e.kind == IDEM_CACHE_MARKER && e.key_id == 5 &&
		   e.expires_ms == INT64_C(1790000030000) && memcmp(e.token, token, 16) == 0 &&
		   memcmp(e.mac, mac, 32) == 0 && e.rest_len == strlen("5 p 1790000030000 ") + 32,
		   "marker: encode and parse (%s)", v2 + IDEM_CACHE_REST_OFFSET);
	tap_ok(idem_cache_encode_lease_marker(v2, sizeof(v2), 0, 1, token) == -1 &&
		   idem_cache_encode_lease_marker(v2, 80, 1, 1, token) == -1,
		   "marker encode refuses key id 0 and a short buffer");

	/* Everything malformed decodes as -1. */
	{
		static const char *const bad_rests[] = {
			"0 c 1 1 ", "03 c 1 1 ", "2147483648 c 1 1 ", "1 x 1 1 ", "1 c 0 1 ",
			"1 c 01 1 ", "1 c 2147483648 1 ", "1 c 1 01 ", "1 c 1 9007199254740993 ",
			"1 c 1 -1 ", "1 c 1 1  ", "1  c 1 1 ", "1 c 1 ", "1 p 01 ", "1 p 1  ",
		};
		static const char tail[] = "ffdefdfcfbfaf9f8f7f6f5f4f3f2f1f0efeeedecebeae9e8e7e6e5e4e3e2e1e0 {}";
		char		b[IDEM_CACHE_VALUE_MAX];
		size_t		j;

		all = 1;
		for (j = 0; j < sizeof(bad_rests) / sizeof(bad_rests[0]); j++)
		{
			idem_cache_put_head(b);
			snprintf(b + IDEM_CACHE_REST_OFFSET, sizeof(b) - IDEM_CACHE_REST_OFFSET, "%s%s",
					 bad_rests[j], bad_rests[j][2] == 'p' ? "01112131415161718191a1b1c1d1e1f1" : tail);
			if (idem_cache_parse(b, strlen(b), &e) != -1)
			{
				tap_diag("accepted: %s", b);
				all = 0;
			}
		}
		/* Control: the same construction with a good rest parses. */
		idem_cache_put_head(b);
		snprintf(b + IDEM_CACHE_REST_OFFSET, sizeof(b) - IDEM_CACHE_REST_OFFSET, "1 c 1 0 %s", tail);
		tap_ok(all && idem_cache_parse(b, strlen(b), &e) == 0,
			   "parse refuses leading zeros, out-of-range numbers, bad kind, blanks (%zu cases)",
			   sizeof(bad_rests) / sizeof(bad_rests[0]));
	}
	vl = (int) strlen(v);
	all = 1;
	for (n = 0; n < vl; n++)
		if (idem_cache_parse(v, n, &e) != -1)
			all = 0;
	tap_ok(all, "every truncation of a terminal value is refused");
	all = 1;
	for (n = 0; n < vl; n++)
	{
		char		c = v[n];

		v[n] = (char) (n < 6 ? 'X' : (c == 'f' ? 'F' : (c == '0' ? 'g' : (c == ' ' ? '_' : c))));
		if (n < IDEM_CACHE_REST_OFFSET + 62 && v[n] != c && idem_cache_parse(v, vl, &e) != -1)
		{
			tap_diag("accepted with byte %d changed", n);
			all = 0;
		}
		v[n] = c;
	}
	tap_ok(all, "a changed header byte (version, MAC, field, blank) is refused");
	tap_ok(idem_cache_parse(v, vl, &e) == 0 && idem_cache_parse("idem1 c 1 ff {}", 15, &e) == -1 &&
		   (v[4] = '1', idem_cache_parse(v, vl, &e) == -1),
		   "an idem1 value (or tag) is refused by the idem2 parser");
	v[4] = '2';
	tap_ok(idem_cache_parse(v, vl, &e) == 0 && (v[vl] = 'x', idem_cache_parse(v, vl + 1, &e) == -1),
		   "trailing bytes after the outcome are refused");
}

static idem_handler_status
never(PGconn *conn, idem_call *call, void *ud)
{
	(void) conn;
	(void) call;
	*(int *) ud = 1;
	return IDEM_HANDLER_OK;
}

static void
test_api_without_servers(void)
{
	idem_result res;
	idem_options o;
	idem_runner *r;
	int			ran = 0;
	idem_runner_stats st;

	tap_ok(idem_client_version() == IDEM_CLIENT_VERSION_NUM,
		   "idem_client_version() is IDEM_CLIENT_VERSION_NUM (%d)", idem_client_version());

	/* structs not set up by their _init function are refused, not written */
	memset(&res, 0, sizeof(res));
	res.status = IDEM_APPLIED;
	tap_ok(idem_run(NULL, 1, "s", "i", "{}", never, &ran, &res) == IDEM_ERROR &&
		   res.status == IDEM_APPLIED && res.struct_size == 0,
		   "idem_run with a result not from idem_result_init: error, result untouched");
	memset(&o, 0, sizeof(o));
	r = idem_runner_open("host=127.0.0.1 port=1 connect_timeout=1", NULL, 0, &o);
	tap_ok(r != NULL && strstr(idem_runner_error_message(r), "idem_options_init") != NULL,
		   "options not from idem_options_init: the runner says so (%s)",
		   r ? idem_runner_error_message(r) : "NULL");
	idem_result_init(&res);
	tap_ok(idem_run(r, 1, "s", "i", "{}", never, &ran, &res) == IDEM_ERROR &&
		   res.error_code == IDEM_ERR_ARGUMENT && ran == 0,
		   "... and every run is IDEM_ERR_ARGUMENT");
	res.struct_size = sizeof(res) - 8;
	tap_ok(idem_run(r, 1, "s", "i", "{}", never, &ran, &res) == IDEM_ERROR &&
		   res.struct_size == sizeof(res) - 8 && res.error_code == IDEM_ERR_ARGUMENT &&
		   strstr(idem_runner_error_message(r), "idem_result_init") != NULL,
		   "a result smaller than the first layout is not written, the runner says why");
	idem_runner_close(r);
	{
		/*
		 * A result and counters from a newer header (larger): accepted,
		 * written only within our fields; what lies beyond keeps what the
		 * caller's _init put there.
		 */
		size_t		big = sizeof(idem_result) + 64;
		unsigned char *b = malloc(big);
		idem_result *br = (idem_result *) b;
		size_t		i,
					untouched = 0;

		idem_result_init_size(br, big);
		memset(b + sizeof(idem_result), 0xab, 64);
		idem_run(NULL, 1, "s", "i", "{}", never, &ran, br);
		for (i = sizeof(idem_result); i < big; i++)
			untouched += b[i] == 0xab;
		tap_ok(br->struct_size == big && br->status == IDEM_ERROR &&
			   br->error_code == IDEM_ERR_ARGUMENT && untouched == 64,
			   "a result larger than ours (a newer header): filled, nothing written past our fields");
		free(b);

		/* an array of them: idem_cached_many steps by the caller's size */
		{
			unsigned char *arr = malloc(2 * big);
			int64_t		t[2] = {1, 1};
			const char *sc[2] = {"s", "s"};
			const char *ids[2] = {"a", "b"};
			const char *rq[2] = {"{}", "{}"};

			idem_result_init_size((idem_result *) arr, big);
			idem_result_init_size((idem_result *) (arr + big), big);
			memset(arr + sizeof(idem_result), 0xab, 64);
			memset(arr + big + sizeof(idem_result), 0xab, 64);
			((idem_result *) (arr + big))->attempt = 7;
			idem_cached_many(NULL, 2, t, sc, ids, rq, (idem_result *) arr);
			untouched = 0;
			for (i = 0; i < 64; i++)
				untouched += (arr[sizeof(idem_result) + i] == 0xab) +
					(arr[big + sizeof(idem_result) + i] == 0xab);
			tap_ok(((idem_result *) arr)->struct_size == big &&
				   ((idem_result *) (arr + big))->struct_size == big &&
				   ((idem_result *) (arr + big))->attempt == 0 &&
				   untouched == 128,
				   "idem_cached_many on an array of larger results: each reset at the caller's stride, nothing written past our fields");
			free(arr);
		}
	}
	memset(&st, 0xff, sizeof(st));
	st.struct_size = 0;
	idem_runner_get_stats(NULL, &st);
	tap_ok(st.runs == -1, "idem_runner_get_stats leaves stats not from idem_runner_stats_init alone");

	idem_result_init(&res);
	tap_ok(idem_run(NULL, 1, "s", "i", "{}", never, &ran, &res) == IDEM_ERROR &&
		   res.error_code == IDEM_ERR_ARGUMENT, "idem_run(NULL runner) is an error");
	tap_ok(idem_run(NULL, 1, "s", "i", "{}", never, &ran, NULL) == IDEM_ERROR,
		   "idem_run(NULL result) is an error");

	idem_options_init(&o);
	o.valkey_cluster = 1;
	o.valkey_db = 2;
	r = idem_runner_open("host=127.0.0.1 port=1 connect_timeout=1", "127.0.0.1", 1, &o);
	idem_result_init(&res);
	tap_ok(r != NULL && idem_run(r, 1, "s", "i", "{}", never, &ran, &res) == IDEM_ERROR &&
		   res.error_code == IDEM_ERR_ARGUMENT && ran == 0 &&
		   strstr(res.error_message, "valkey_db is 2 with valkey_cluster = 1") != NULL &&
		   strstr(idem_runner_error_message(r), "valkey_db is 2") != NULL,
		   "valkey_db other than 0 with valkey_cluster = 1: an invalid option, and every run says why (%s)",
		   res.error_message);
	idem_runner_close(r);

	idem_options_init(&o);
	o.valkey_prefix = "has space";
	r = idem_runner_open("host=127.0.0.1 port=1 connect_timeout=1", "127.0.0.1", 1, &o);
	tap_ok(r != NULL && strstr(idem_runner_error_message(r), "valkey_prefix") != NULL,
		   "bad prefix: runner opens, error message names it");
	tap_ok(idem_run(r, 1, "s", "i", "{}", never, &ran, &res) == IDEM_ERROR &&
		   res.error_code == IDEM_ERR_ARGUMENT && ran == 0,
		   "bad options: every run is IDEM_ERR_ARGUMENT, handler not called");
	idem_runner_close(r);

	/* both servers down (port 1 refuses): open works, runs report errors */
	idem_options_init(&o);
	o.valkey_retry_ms = 0;
	r = idem_runner_open("host=127.0.0.1 port=1 connect_timeout=1", "127.0.0.1", 1, &o);
	tap_ok(r != NULL, "runner opens with both servers down");
	tap_ok(idem_run(r, 1, "s", "i", "{}", never, &ran, &res) == IDEM_ERROR &&
		   res.error_code == IDEM_ERR_CONNECTION && ran == 0 &&
		   strstr(res.error_message, "PostgreSQL") != NULL,
		   "PostgreSQL down: IDEM_ERR_CONNECTION (%s)", res.error_message);
	tap_ok(idem_run(r, 1, "s", "i", "{", never, &ran, &res) == IDEM_ERROR &&
		   res.error_code == IDEM_ERR_REQUEST_JSON,
		   "invalid request JSON: IDEM_ERR_REQUEST_JSON (%s)", res.error_message);
	tap_ok(idem_run(r, 1, NULL, "i", "{}", never, &ran, &res) == IDEM_ERROR &&
		   res.error_code == IDEM_ERR_ARGUMENT &&
		   idem_run(r, 1, "s", "i", "{}", NULL, NULL, &res) == IDEM_ERROR &&
		   idem_run_platform(r, "s", "\xff", "{}", never, &ran, &res) == IDEM_ERROR,
		   "NULL scope, NULL handler, invalid UTF-8 id: IDEM_ERR_ARGUMENT");
	idem_runner_stats_init(&st);
	idem_runner_get_stats(r, &st);
	tap_ok(st.runs == 5 && st.valkey_skipped >= 1, "stats count runs (%ld) and skipped gates (%ld)",
		   st.runs, st.valkey_skipped);
	idem_runner_close(r);
	idem_runner_close(NULL);
	tap_ok(strcmp(idem_status_name(IDEM_BUSY), "busy") == 0 &&
		   strcmp(idem_source_name(IDEM_SOURCE_VALKEY), "valkey") == 0,
		   "status and source names");
}

void		test_cluster(void);	/* unit_cluster.c */
int			crypto_vs_openssl(int rounds, char *why, size_t whylen);	/* unit_crypto.c */
int			crypto_key_copies_on_stack(void);
int			crypto_rounds(int rounds);

/* SHA-256 and HMAC against OpenSSL in both block functions; the key wipe. */
static void
test_crypto(void)
{
	char		why[128];
	int			path,
				copies;

	for (path = 0; path <= 1; path++)
	{
		int			ni = idem_sha256_accel(path);

		tap_ok(crypto_vs_openssl(crypto_rounds(2000), why, sizeof(why)),
			   "sha256 and hmac-sha256 (%s) equal OpenSSL's: %s", ni ? "SHA-NI" : "portable", why);
	}
	copies = crypto_key_copies_on_stack();
	tap_ok(copies == 0, "idem_hmac_key leaves no copy of the key or its pads on the stack (%d found)",
		   copies);
	idem_sha256_accel(1);
}

/* secrets_max_age_ms: 0 and anything too long are capped, not "never". */
static void
test_trust_max_age(void)
{
	tap_ok(idemc_trust_max_age(-1) == 5000, "secrets_max_age_ms < 0: the default, 5000 ms");
	tap_ok(idemc_trust_max_age(1) == 1 && idemc_trust_max_age(5000) == 5000 &&
		   idemc_trust_max_age(IDEM_SECRETS_MAX_AGE_MAX_MS) == IDEM_SECRETS_MAX_AGE_MAX_MS,
		   "secrets_max_age_ms from 1 to the maximum: as given");
	tap_ok(idemc_trust_max_age(0) == IDEM_SECRETS_MAX_AGE_MAX_MS,
		   "secrets_max_age_ms 0 (once \"never\"): the maximum, %d ms", IDEM_SECRETS_MAX_AGE_MAX_MS);
	tap_ok(idemc_trust_max_age(3600000) == IDEM_SECRETS_MAX_AGE_MAX_MS,
		   "secrets_max_age_ms of an hour: the maximum");
}

/* idem_call_emit's messages: one JSON array, [[stream, message], ...], in
 * order, the stream name escaped, the messages canonical; refusals. */
static void
test_emit_array(void)
{
	idem_call	call;
	const char *want = "[[\"a\\\"b\\\\c\\u0001\", {\"x\": 1, \"yy\": [2]}], "
		"[\"s\", {\"n\": \"\u00e9\"}]]";
	int			rc1,
				rc2,
				bad1,
				bad2,
				bad3;

	memset(&call, 0, sizeof(call));
	rc1 = idem_call_emit(&call, "a\"b\\c\001", "{\"yy\":[2],  \"x\":1}");
	rc2 = idem_call_emit(&call, "s", "{\"n\": \"\u00e9\"}");
	bad1 = idem_call_emit(&call, "", "{}");
	bad2 = idem_call_emit(&call, "s", "{nope");
	bad3 = idem_call_emit(&call, "\xff", "{}");
	tap_ok(rc1 == 0 && rc2 == 0 && call.nemits == 2 && call.emits &&
		   strcmp(call.emits, want) == 0,
		   "idem_call_emit: the messages as one JSON array, in order, names escaped, messages canonical (%s)",
		   call.emits ? call.emits : "NULL");
	tap_ok(bad1 == -1 && bad2 == -1 && bad3 == -1 && call.nemits == 2 && !call.oom &&
		   strcmp(call.emits, want) == 0,
		   "idem_call_emit refuses an empty stream, a message that is not JSON, a name that is not UTF-8, and keeps the others");
	free(call.emits);
}

int
main(void)
{
	idem_sha256_accel(0);
	test_sha256("portable");
	test_sha256_paths();
	test_hmac();
	test_crypto();
	test_keys();
	test_canonical();
	test_cache_format();
	test_api_without_servers();
	test_cluster();
	test_trust_max_age();
	test_emit_array();
	return tap_done();
}
