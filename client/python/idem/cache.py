"""The Valkey key and value format "idem2" (src/common/cache_format.h), in Python.

Keys::

    tenant ledger:    <keyspace>t:<tenant_id in decimal>:<key as 64 hex>
    platform ledger:  <keyspace>p:<key as 64 hex>

Values (one line of ASCII)::

    idem2 <mac: 64 hex> <rest>
    rest, terminal:  <key_id> <c|f> <attempt> <expires_ms> <fingerprint: 64 hex> <outcome>
    rest, marker:    <key_id> p <expires_ms> <token: 32 hex>
    mac = HMAC-SHA-256(secret[key_id], <full key> 0x00 <rest as stored>)

``parse`` accepts exactly what the C parser accepts and returns None for
anything else; it does not verify the MAC (``verify`` does).
"""
import binascii
import hashlib
import hmac
import re
from typing import Any, Dict, Optional, Tuple

VERSION_TAG = b"idem2"
DIGEST_LEN = 32
MAC_LEN = 32
TOKEN_LEN = 16
OUTCOME_MAX = 4096
KEY_ID_MAX = 2147483647
INT32_MAX = 2147483647
EXPIRES_MAX = 9007199254740992          # 2^53
REST_OFFSET = 5 + 1 + 2 * MAC_LEN + 1   # after "idem2 " + 64 hex + " "
_TAG = VERSION_TAG + b" "
_hexlify = binascii.hexlify
_unhex = binascii.unhexlify      # of lower-case hex digits (_VALUE matched them)
_compare = hmac.compare_digest

COMPLETED = "c"
FAILED_PERMANENT = "f"
MARKER = "p"

def key_prefix(keyspace: str, tenant_id: Optional[int]) -> bytes:
    """What the Valkey key of a ledger row has before its key's hex digits
    (the same for every key of one tenant); tenant_id None: platform."""
    if tenant_id is None:
        return ("%sp:" % keyspace).encode("ascii")
    return ("%st:%d:" % (keyspace, int(tenant_id))).encode("ascii")


def cache_key(keyspace: str, tenant_id: Optional[int], key: bytes) -> bytes:
    """The Valkey key of a ledger row (bytes); tenant_id None: platform."""
    if len(key) != DIGEST_LEN:
        raise ValueError("a key is 32 bytes")
    return key_prefix(keyspace, tenant_id) + _hexlify(key)


def owner_ok(keyspace: str, owner_key: Optional[str], owner_token: Optional[str]) -> bool:
    """Are the epoch owner key and token idem_cache_secrets() gave usable
    with keyspace: both present, the token 16 lower-case hex digits, and
    the key that of the keyspace's epoch (the keyspace minus
    ".<database oid>:" is the key minus ":owner")?"""
    if owner_key is None or owner_token is None or not owner_key.endswith(":owner"):
        return False
    base = owner_key[:-len(":owner")]
    return (len(base) > 0 and keyspace.startswith(base + ".") and
            len(owner_token) == 16 and set(owner_token) <= set("0123456789abcdef"))


class Signer:
    """HMAC-SHA-256 with one secret over <full key> 0x00 <rest> (RFC
    2104), and the values it signs: its inner and outer hashes after the
    key block are made once, so that a MAC costs two copies and two short
    hashes, not the key's setup each time.  One per secret (signer_of)."""
    __slots__ = ("inner", "outer")

    def __init__(self, secret: bytes) -> None:
        block = (hashlib.sha256(secret).digest() if len(secret) > 64 else secret).ljust(64, b"\0")
        self.inner = hashlib.sha256(bytes(b ^ 0x36 for b in block))
        self.outer = hashlib.sha256(bytes(b ^ 0x5c for b in block))

    def mac(self, full_key: bytes, rest: bytes) -> bytes:
        """The MAC of rest under full_key (32 bytes)."""
        h = self.inner.copy()
        h.update(full_key + b"\x00" + rest)
        o = self.outer.copy()
        o.update(h.digest())
        mac: bytes = o.digest()
        return mac

    def sign(self, full_key: bytes, rest: bytes) -> bytes:
        """The value: the version tag, rest's MAC in hex, rest."""
        return _TAG + _hexlify(self.mac(full_key, rest)) + b" " + rest

    def verifies(self, full_key: bytes, value: bytes, mac_hex: bytes) -> bool:
        """Does value (an idem2 value) carry mac_hex, its rest's MAC in hex?"""
        return _compare(_hexlify(self.mac(full_key, value[REST_OFFSET:])), mac_hex)


# Secrets are few (the current one, the previous): their signers are kept.
_SIGNERS: Dict[bytes, Signer] = {}


def signer_of(secret: bytes) -> Signer:
    """The Signer of secret."""
    s = _SIGNERS.get(secret)
    if s is None:
        s = Signer(secret)
        if len(_SIGNERS) >= 64:
            _SIGNERS.clear()
        _SIGNERS[secret] = s
    return s


def _rest_mac(secret: bytes, full_key: bytes, rest: bytes) -> bytes:
    """HMAC-SHA-256 over <full key> 0x00 <rest>."""
    return signer_of(secret).mac(full_key, rest)


def compute_mac(secret: bytes, full_key: bytes, value: bytes) -> bytes:
    """HMAC-SHA-256 over <full key> 0x00 <the value's rest>."""
    return _rest_mac(secret, full_key, value[REST_OFFSET:])


def _with_mac(secret: bytes, full_key: bytes, rest: bytes) -> bytes:
    """The value: the version tag, rest's MAC in hex, rest."""
    return signer_of(secret).sign(full_key, rest)


def marker_rest(key_id: int, expires_ms: int, token_hex: bytes) -> bytes:
    """A marker's rest: key id, "p", its deadline, its token in hex."""
    return b"%d p %d %s" % (key_id, expires_ms, token_hex)


def encode_marker(secret: bytes, key_id: int, full_key: bytes, expires_ms: int,
                  token: bytes) -> bytes:
    """A processing marker, MACed: deadline expires_ms, 16-byte token."""
    if not (0 < key_id <= KEY_ID_MAX) or not (0 <= expires_ms <= EXPIRES_MAX) \
            or len(token) != TOKEN_LEN:
        raise ValueError("bad marker fields")
    return _with_mac(secret, full_key, marker_rest(key_id, expires_ms, _hexlify(token)))


def encode_terminal(secret: bytes, key_id: int, full_key: bytes, kind: str, attempt: int,
                    expires_ms: int, fingerprint: bytes, outcome: Any) -> bytes:
    """A terminal result, MACed (the worker writes these; tests plant them)."""
    if isinstance(outcome, str):
        outcome = outcome.encode("utf-8")
    if kind not in (COMPLETED, FAILED_PERMANENT) or attempt <= 0 or \
            not (0 < len(outcome) <= OUTCOME_MAX) or outcome[:1] != b"{" or \
            outcome[-1:] != b"}" or not (0 < key_id <= KEY_ID_MAX) or \
            not (0 <= expires_ms <= EXPIRES_MAX) or len(fingerprint) != DIGEST_LEN:
        raise ValueError("bad terminal fields")
    return _with_mac(secret, full_key, b"%d %s %d %d " % (
        key_id, kind.encode("ascii"), attempt, expires_ms) +
        fingerprint.hex().encode("ascii") + b" " + outcome)


class Entry:
    """A decoded idem2 value."""
    __slots__ = ("kind", "key_id", "mac", "expires_ms", "attempt",
                 "fingerprint", "outcome", "token")

    kind: str
    key_id: int
    mac: bytes
    expires_ms: int
    attempt: Optional[int]
    fingerprint: Optional[bytes]
    outcome: Optional[bytes]
    token: Optional[bytes]

    def __init__(self, kind: str, key_id: int, mac: bytes, expires_ms: int,
                 attempt: Optional[int] = None, fingerprint: Optional[bytes] = None,
                 outcome: Optional[bytes] = None, token: Optional[bytes] = None) -> None:
        self.kind, self.key_id, self.mac, self.expires_ms = kind, key_id, mac, expires_ms
        self.attempt, self.fingerprint, self.outcome, self.token = \
            attempt, fingerprint, outcome, token

    def __repr__(self) -> str:
        return "Entry(%s)" % ", ".join("%s=%r" % (k, getattr(self, k)) for k in self.__slots__)


# The whole grammar of a value, as the C parser reads it: decimals without
# leading zeros (an expiry may be 0) and of at most 10 (key id, attempt) or
# 16 (expiry) digits, lower-case hex, a marker's token ending the value.
# One match instead of a scan per field; the limits are checked after it.
_VALUE = re.compile(
    rb"idem2 ([0-9a-f]{64}) ([1-9][0-9]{0,9}) (?:"
    rb"p (0|[1-9][0-9]{0,15}) ([0-9a-f]{32})"
    rb"|([cf]) ([1-9][0-9]{0,9}) (0|[1-9][0-9]{0,15}) ([0-9a-f]{64}) (\{.*\}))\Z", re.S)


_KINDS = {b"c": COMPLETED, b"f": FAILED_PERMANENT}


def parse(value: bytes) -> Optional[Entry]:
    """Decode an idem2 value (bytes); None when malformed or another version."""
    m = _VALUE.match(value)
    if m is None:
        return None
    mac, key_id, expires, token, kind, attempt, t_expires, fp, outcome = m.groups()
    key_id = int(key_id)
    if key_id > KEY_ID_MAX:
        return None
    if token is not None:
        expires = int(expires)
        if expires > EXPIRES_MAX:
            return None
        return Entry(MARKER, key_id, _unhex(mac), expires, None, None, None, _unhex(token))
    attempt, expires = int(attempt), int(t_expires)
    if attempt > INT32_MAX or expires > EXPIRES_MAX or len(outcome) > OUTCOME_MAX:
        return None
    return Entry(_KINDS[kind], key_id, _unhex(mac), expires, attempt, _unhex(fp), bytes(outcome))


def verify(secrets: Dict[int, bytes], full_key: bytes, value: bytes, entry: Entry) -> bool:
    """Whether entry (parsed from value) carries a MAC made with the secret
    of its key id over full_key; secrets maps key id to secret bytes."""
    secret = secrets.get(entry.key_id)
    if secret is None:
        return False
    return _compare(_rest_mac(secret, full_key, bytes(value[REST_OFFSET:])), entry.mac)
