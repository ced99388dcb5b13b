"""Unit tests: canonical JSON, key and fingerprint vectors, idem2 values, MAC,
and what the package shares with the C client's source."""
import codecs
import hashlib
import hmac
import os
import re
import unittest

from idem import RequestError, canonical_json, fingerprint, idem_key
from idem import cache


class CanonicalJson(unittest.TestCase):
    def test_vectors(self):
        """canonical JSON: numbers, strings, key order, duplicates, as jsonb prints them"""
        cases = [
            ('{}', '{}'), ('[]', '[]'), (' [ ] ', '[]'),
            ('{"b":1,"a":[1,2.50,"x"]}', '{"a": [1, 2.50, "x"], "b": 1}'),
            ('{"aa":1,"b":2,"a":3}', '{"a": 3, "b": 2, "aa": 1}'),      # length, then bytes
            ('{"a":1,"a":2}', '{"a": 2}'),                              # the last one wins
            ('{"a":{"z":1,"z":{"y":[]}}}', '{"a": {"z": {"y": []}}}'),
            ('-0', '0'), ('-0.0', '0.0'), ('0e5', '0'), ('0.00e-2', '0.0000'),
            ('1e3', '1000'), ('1E+3', '1000'), ('1.5e2', '150'), ('1.50e1', '15.0'),
            ('1e-3', '0.001'), ('-12.3400', '-12.3400'), ('123.456e-5', '0.00123456'),
            ('100e-2', '1.00'), ('0.1', '0.1'), ('-1e-1', '-0.1'),
            ('12345678901234567890123456789', '12345678901234567890123456789'),
            ('"\\u00e9\\n\\t\\b\\f\\r\\"\\\\\\/"', '"\u00e9\\n\\t\\b\\f\\r\\"\\\\/"'),
            ('"\\u001f\\u007f"', '"\\u001f\x7f"'),
            ('"\\ud83d\\ude00"', '"\U0001F600"'),
            ('{"\u00e9":1,"z":2,"\u00e0a":3}', '{"z": 2, "\u00e9": 1, "\u00e0a": 3}'),
            ('[true,false,null]', '[true, false, null]'),
        ]
        for text, want in cases:
            self.assertEqual(canonical_json(text), want, text)

    def test_python_values(self):
        """a Python value is serialised with json.dumps, then made canonical"""
        self.assertEqual(canonical_json({"b": 1.0, "a": [True, None, "x"]}),
                         '{"a": [true, null, "x"], "b": 1.0}')
        self.assertEqual(canonical_json({"n": 1e20}), '{"n": 100000000000000000000}')
        self.assertEqual(canonical_json(b'{"a": 1}'), '{"a": 1}')

    def test_refused(self):
        """what jsonb refuses is refused: NaN, lone surrogates, \\u0000, bad UTF-8, too deep, too big"""
        bad = ['', '{', '[1,]', '{"a"}', 'NaN', 'Infinity', '-Infinity', '01', '1.', '.5',
               '"\\ud800"', '"\\u0000"', '{"a":1}x', 'tru', '"\x01"', '1e1073741823',
               '1e-1073741823', '[' * 513 + ']' * 513, '1e131072', 'True', "'a'"]
        for text in bad:
            with self.assertRaises(RequestError, msg=repr(text[:40])):
                canonical_json(text)
        with self.assertRaises(RequestError):
            canonical_json(b'"\xff"')
        with self.assertRaises(RequestError):
            canonical_json({"x": float("nan")})
        self.assertEqual(canonical_json('[' * 512 + ']' * 512)[:3], '[[[')

    def test_digest_vectors(self):
        """idem_key and idem_fingerprint: the shared test vectors (docs/cache-format.md)"""
        self.assertEqual(idem_key("", "").hex(),
                         "af5570f5a1810b7af78caf4bc70a660f0df51e42baf91d4de5b2328de0e83dfc")
        self.assertEqual(idem_key("payments.transfer", "run-1").hex(),
                         "ffebc256921d2300f60fad5353e5acdad788eca9acdae8385533ddd9e6bf10f0")
        self.assertEqual(fingerprint("{}").hex(),
                         "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a")
        self.assertEqual(fingerprint('{"b": 1, "a": [1, 2.50, "x"]}').hex(),
                         "50847ac0916d0c687463688b99771fad7dfec7573b724374f6a2bcf7914f5358")
        self.assertNotEqual(idem_key("ab", "c"), idem_key("a", "bc"))


SECRET = bytes(range(32))
KEY = b"idem:1.1.00000000000000aa.5:t:42:" + b"ab" * 32


class Values(unittest.TestCase):
    def test_round_trip(self):
        """idem2 values: a marker and a terminal result encode, parse and verify"""
        m = cache.encode_marker(SECRET, 3, KEY, 1700000000000, bytes(range(16)))
        self.assertRegex(m, rb"^idem2 [0-9a-f]{64} 3 p 1700000000000 000102030405060708090a0b0c0d0e0f$")
        e = cache.parse(m)
        self.assertEqual((e.kind, e.key_id, e.expires_ms, e.token),
                         ("p", 3, 1700000000000, bytes(range(16))))
        self.assertTrue(cache.verify({3: SECRET}, KEY, m, e))
        fp = hashlib.sha256(b"{}").digest()
        t = cache.encode_terminal(SECRET, 1, KEY, "c", 2, 0, fp, '{"a": 1}')
        e = cache.parse(t)
        self.assertEqual((e.kind, e.attempt, e.expires_ms, e.fingerprint, e.outcome),
                         ("c", 2, 0, fp, b'{"a": 1}'))
        self.assertTrue(cache.verify({1: SECRET}, KEY, t, e))
        self.assertEqual(cache.cache_key("ks:", 42, b"\xab" * 32), b"ks:t:42:" + b"ab" * 32)
        self.assertEqual(cache.cache_key("ks:", None, b"\xab" * 32), b"ks:p:" + b"ab" * 32)

    def test_mac(self):
        """the MAC is HMAC-SHA-256(secret, full key 0x00 rest), by RFC 2104 from first principles"""
        t = cache.encode_terminal(SECRET, 1, KEY, "f", 1, 5, b"\x01" * 32, '{}')
        rest = t[cache.REST_OFFSET:]
        k = SECRET + b"\x00" * (64 - len(SECRET))
        inner = hashlib.sha256(bytes(x ^ 0x36 for x in k) + KEY + b"\x00" + rest).digest()
        outer = hashlib.sha256(bytes(x ^ 0x5c for x in k) + inner).hexdigest()
        self.assertEqual(t[6:70].decode(), outer)
        # RFC 4231 test case 2
        self.assertEqual(hmac.new(b"Jefe", b"what do ya want for nothing?", hashlib.sha256).hexdigest(),
                         "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843")
        e = cache.parse(t)
        self.assertFalse(cache.verify({1: SECRET}, KEY[:-1] + b"c", t, e))   # another key
        self.assertFalse(cache.verify({1: b"\x00" * 32}, KEY, t, e))         # another secret
        self.assertFalse(cache.verify({2: SECRET}, KEY, t, e))               # unknown key id
        forged = t[:-2] + b'{ }'
        self.assertFalse(cache.verify({1: SECRET}, KEY, forged, cache.parse(forged)))

    def test_malformed(self):
        """malformed values parse as None: idem1, bad hex, leading zeros, trailing bytes, limits"""
        good = cache.encode_terminal(SECRET, 1, KEY, "c", 1, 7, b"\xab" * 32, '{"x": 1}')
        mark = cache.encode_marker(SECRET, 1, KEY, 7, b"\x03" * 16)
        self.assertIsNotNone(cache.parse(good))
        self.assertIsNotNone(cache.parse(mark))
        head = good[:71]
        fp = b"ab" * 32
        bad = [
            b"idem1 c 1 " + fp + b' {"x": 1}',
            b"idem1 p " + b"03" * 16,
            good.replace(b"idem2", b"idem3"),
            head[:6] + head[6:70].upper() + head[70:] + good[71:],
            head + b"01 c 1 7 " + fp + b' {"x": 1}',            # leading zero key id
            head + b"0 c 1 7 " + fp + b' {"x": 1}',             # key id 0
            head + b"1 c 0 7 " + fp + b' {"x": 1}',             # attempt 0
            head + b"1 c 1 07 " + fp + b' {"x": 1}',            # leading zero expiry
            head + b"1 c 1 9007199254740993 " + fp + b' {"x": 1}',
            head + b"2147483648 c 1 7 " + fp + b' {"x": 1}',
            head + b"1 x 1 7 " + fp + b' {"x": 1}',
            head + b"1 c 1 7 " + fp + b' [1]',
            head + b"1 c 1 7 " + fp + b' {"x": 1} ',
            head + b"1 c 1 7 " + fp.upper() + b' {"x": 1}',
            head + b"1 c 1 7 " + fp + b' {"' + b"x" * 4096 + b'"}',
            mark + b"0",
            mark[:-1],
            mark[:-1] + b"G",
            head + b"1 p 07 " + b"03" * 16,
            b"",
            good[:70],
        ]
        for v in bad:
            self.assertIsNone(cache.parse(v), v[:120])
        self.assertIsNotNone(cache.parse(head + b"1 p 0 " + b"03" * 16))   # expiry 0 is allowed


if __name__ == "__main__":
    unittest.main()


# The C client's source, beside the package in the checkout these tests
# come from (client/release.c).
C_CLIENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def c_string(source, name):
    """The bytes of the C string constant NAME (const char NAME[] = "..." "...";)."""
    m = re.search(r"\bconst\s+char\s+" + re.escape(name) + r"\s*\[\s*\]\s*=\s*((?:\s*\"(?:[^\"\\\n]|\\.)*\")+)\s*;",
                  source)
    if m is None:
        raise AssertionError("no string constant %s in the C source" % name)
    parts = re.findall(r'"((?:[^"\\\n]|\\.)*)"', m.group(1))
    return codecs.decode("".join(parts), "unicode_escape").encode("latin-1")


class GateBytes(unittest.TestCase):
    def test_gate_as_redis_py_packs_it(self):
        """the gate's two commands (resp.Gate, made once per lease and owner key) are the bytes redis-py's pipeline sends for them, and its marker is encode_marker's"""
        from redis.connection import Connection
        from idem import resp
        conn = Connection()
        for lease_ms, owner in ((30000, b"idem:1:owner"), (1, b"o"), (2147483647, b"x" * 300)):
            gate = resp.Gate(lease_ms, owner)
            for key, token in ((KEY, bytes(16)), (b"ks:p:" + b"0" * 64, bytes(range(16)))):
                marker = cache.signer_of(SECRET).sign(
                    key, cache.marker_rest(3, 1700000000000 + lease_ms, token.hex().encode()))
                self.assertEqual(marker, cache.encode_marker(SECRET, 3, key, 1700000000000 + lease_ms,
                                                             token))
                want = b"".join(conn.pack_command("SET", key, marker, "NX", "PX", str(lease_ms),
                                                  "GET") + conn.pack_command("GET", owner))
                self.assertEqual(gate.pack(key, marker), want)
                self.assertEqual(resp.pack(b"GET", owner), b"".join(conn.pack_command("GET", owner)))

    def test_kept_state_changes_nothing(self):
        """what canonical JSON and the key keep between calls (a key's text, a scope's hash) gives what a first call gives, errors included, in jsonb's key order"""
        from idem import canonical
        for _ in range(2):
            self.assertEqual(canonical_json({"b": 1, "aa": "x", "a": [True, None]}),
                             '{"a": [true, null], "b": 1, "aa": "x"}')
            self.assertEqual(idem_key("scope", "id"), hashlib.sha256(
                b"\x00\x00\x00\x05scope\x00\x00\x00\x02id").digest())
            # "a\x00" (2 bytes) comes before "\ud800" (3 bytes): its error is the one told
            for req in ({"\ud800": 1, "a\x00": 2}, {"a\x00": 2, "\ud800": 1}):
                with self.assertRaisesRegex(RequestError, "u0000"):
                    canonical_json(req)
        canonical._KEYS.clear()
        canonical._SCOPES.clear()


class SharedWithC(unittest.TestCase):
    def test_release_script(self):
        """the marker's compare-and-delete script is client/release.c's to the byte, and so is its SHA-1 (EVALSHA)"""
        import redis
        from idem import runner
        with open(os.path.join(C_CLIENT, "release.c"), encoding="utf-8") as f:
            source = f.read()
        script = c_string(source, "idemc_cad_script")
        sha1 = c_string(source, "idemc_cad_sha1").decode()
        self.assertEqual(runner.CAD_SCRIPT.encode(), script)
        # the C constant is the script's SHA-1, and the runner's EVALSHA name
        self.assertEqual(hashlib.sha1(script).hexdigest(), sha1)
        # (port 1: refused, the runner then decides on PostgreSQL alone)
        r = runner.Runner(valkey=redis.Redis(host="127.0.0.1", port=1))
        self.assertEqual(r._cad.sha, sha1)
        from idem import aio            # the asyncio runner's EVALSHA name too
        self.assertEqual(aio.AsyncRunner(("127.0.0.1", 1))._cad.sha, sha1)


class Durations(unittest.TestCase):
    def test_seconds_everywhere(self):
        """every duration of the API is in seconds (int or float): lease, retention, valkey_timeout, valkey_retry, secrets_max_age; the old *_ms options are refused"""
        import datetime
        import idem
        r = idem.Runner(None, lease=1.5, retention=7 * 86400, valkey_retry=0.25,
                        valkey_timeout=0.05, secrets_max_age=0)
        self.assertEqual((r.lease_ms, r.valkey_retry_ms, r.secrets_max_age_ms), (1500, 250, 60000))
        self.assertEqual(r.retention, datetime.timedelta(days=7))
        self.assertEqual(idem.Runner(None).lease_ms, 30000)
        for bad in ({"lease": 0}, {"lease": "30s"}, {"retention": "7 days"}, {"lease": True},
                    {"valkey_timeout": -1}):
            with self.assertRaises(idem.IdemError, msg=repr(bad)) as cm:
                idem.Runner(None, **bad)
            self.assertEqual(cm.exception.code, "argument")
        for old in ("lease_ms", "valkey_retry_ms", "valkey_timeout_ms", "secrets_max_age_ms"):
            with self.assertRaises(TypeError, msg=old):
                idem.Runner(None, **{old: 1000})
        run = idem.Run(1, "s", "i", "{}", b"k" * 32, b"f" * 32)
        run._busy_for(1250)
        self.assertEqual(run.retry_after, 1.25)
        self.assertFalse(hasattr(run, "retry_after_ms"))


class RelearnBound(unittest.TestCase):
    def test_capped(self):
        """secrets_max_age: 0 and anything longer than a minute mean a minute, not never"""
        import idem
        from idem.runner import SECRETS_MAX_AGE_MAX_MS
        self.assertEqual(SECRETS_MAX_AGE_MAX_MS, 60000)
        for given, used in ((5, 5000), (0.001, 1), (60, 60000), (0, 60000), (3600, 60000)):
            self.assertEqual(idem.Runner(None, secrets_max_age=given).secrets_max_age_ms, used,
                             given)
        with self.assertRaises(idem.IdemError):
            idem.Runner(None, secrets_max_age=-1)


class RespReader(unittest.TestCase):
    REPLIES = (b"$5\r\nhello\r\n$-1\r\n+OK\r\n-ERR bad thing\r\n:42\r\n"
               b"*3\r\n$1\r\na\r\n*1\r\n:-1\r\n$-1\r\n*-1\r\n$0\r\n\r\n"
               b"-NOAUTH Authentication required.\r\n$12\r\nidem2 \r\n{}\r\n\r\n")

    def read(self, reader, chunk):
        out = []
        for i in range(0, len(self.REPLIES), chunk):
            reader.feed(self.REPLIES[i:i + chunk])
            while True:
                r = reader.gets()
                if r is False:
                    break
                out.append(r)
        return out

    def shape(self, replies):
        return [(type(r).__name__, str(r)) if isinstance(r, Exception) else r for r in replies]

    def test_reader(self):
        """the gate's own RESP reader (without python3-hiredis) reads what hiredis reads, whole or a byte at a time: bulk, nil, simple, integer, nested arrays, error replies as redis-py's exceptions"""
        import redis.exceptions as rex
        from redis.connection import BaseParser
        from idem import resp
        errors = BaseParser().parse_error
        want = [b"hello", None, b"OK", ("ResponseError", "bad thing"), 42,
                [b"a", [-1], None], None, b"", ("AuthenticationError", "Authentication required."),
                b"idem2 \r\n{}\r\n"]
        for chunk in (len(self.REPLIES), 7, 1):
            got = self.read(resp.Reader(errors, rex.InvalidResponse), chunk)
            self.assertEqual(self.shape(got), want, chunk)
        try:
            import hiredis
        except ImportError:
            return
        got = self.read(hiredis.Reader(protocolError=rex.InvalidResponse, replyError=errors), 3)
        self.assertEqual(self.shape(got), want)
        with self.assertRaises(rex.InvalidResponse):
            r = resp.Reader(errors, rex.InvalidResponse)
            r.feed(b"?what\r\n")
            r.gets()
