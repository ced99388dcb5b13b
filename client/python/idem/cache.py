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
import hashlib
import hmac
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

COMPLETED = "c"
FAILED_PERMANENT = "f"
MARKER = "p"

_HEX = frozenset(b"0123456789abcdef")


def cache_key(keyspace: str, tenant_id: Optional[int], key: bytes) -> bytes:
    """The Valkey key of a ledger row (bytes); tenant_id None: platform."""
    if len(key) != DIGEST_LEN:
        raise ValueError("a key is 32 bytes")
    if tenant_id is None:
        return ("%sp:%s" % (keyspace, key.hex())).encode("ascii")
    return ("%st:%d:%s" % (keyspace, int(tenant_id), key.hex())).encode("ascii")


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


def compute_mac(secret: bytes, full_key: bytes, value: bytes) -> bytes:
    """HMAC-SHA-256 over <full key> 0x00 <the value's rest>."""
    return hmac.new(secret, full_key + b"\x00" + value[REST_OFFSET:],
                    hashlib.sha256).digest()


def _with_mac(secret: bytes, full_key: bytes, unsigned: bytes) -> bytes:
    mac = compute_mac(secret, full_key, unsigned)
    return unsigned[:6] + mac.hex().encode("ascii") + unsigned[6 + 2 * MAC_LEN:]


def _head() -> bytes:
    return VERSION_TAG + b" " + b"0" * (2 * MAC_LEN) + b" "


def encode_marker(secret: bytes, key_id: int, full_key: bytes, expires_ms: int,
                  token: bytes) -> bytes:
    """A processing marker, MACed: deadline expires_ms, 16-byte token."""
    if not (0 < key_id <= KEY_ID_MAX) or not (0 <= expires_ms <= EXPIRES_MAX) \
            or len(token) != TOKEN_LEN:
        raise ValueError("bad marker fields")
    v = _head() + b"%d p %d " % (key_id, expires_ms) + token.hex().encode("ascii")
    return _with_mac(secret, full_key, v)


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
    v = _head() + b"%d %s %d %d " % (key_id, kind.encode("ascii"), attempt, expires_ms) + \
        fingerprint.hex().encode("ascii") + b" " + outcome
    return _with_mac(secret, full_key, v)


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

    def __init__(self, **kw: Any) -> None:
        for k in self.__slots__:
            setattr(self, k, kw.get(k))

    def __repr__(self) -> str:
        return "Entry(%s)" % ", ".join("%s=%r" % (k, getattr(self, k)) for k in self.__slots__)


def _unhex(b: bytes) -> Optional[bytes]:
    if not all(c in _HEX for c in b):
        return None
    return bytes.fromhex(b.decode("ascii"))


def _decimal(buf: bytes, pos: int, maxdigits: int, allow_zero: bool) -> Optional[Tuple[int, int]]:
    """(value, next pos) of a decimal field ending at a blank, or None."""
    p = pos
    while p < len(buf) and 48 <= buf[p] <= 57 and p - pos < maxdigits:
        p += 1
    digits = p - pos
    if digits == 0 or p >= len(buf) or buf[p] != 32 or \
            (buf[pos] == 48 and not (allow_zero and digits == 1)):
        return None
    return int(buf[pos:p]), p + 1


def parse(value: bytes) -> Optional[Entry]:
    """Decode an idem2 value (bytes); None when malformed or another version."""
    buf = bytes(value)
    n = len(buf)
    if n < REST_OFFSET + 4 or buf[:6] != VERSION_TAG + b" " or buf[REST_OFFSET - 1] != 32:
        return None
    mac = _unhex(buf[6:6 + 2 * MAC_LEN])
    if mac is None:
        return None
    r = _decimal(buf, REST_OFFSET, 10, False)
    if r is None or r[0] > KEY_ID_MAX:
        return None
    key_id, pos = r
    if pos + 2 > n or buf[pos + 1] != 32:
        return None
    kind = chr(buf[pos])
    if kind == MARKER:
        r = _decimal(buf, pos + 2, 16, True)
        if r is None or r[0] > EXPIRES_MAX:
            return None
        expires, pos = r
        if n != pos + 2 * TOKEN_LEN:
            return None
        token = _unhex(buf[pos:])
        if token is None:
            return None
        return Entry(kind=MARKER, key_id=key_id, mac=mac, expires_ms=expires, token=token)
    if kind not in (COMPLETED, FAILED_PERMANENT):
        return None
    r = _decimal(buf, pos + 2, 10, False)
    if r is None or r[0] > INT32_MAX:
        return None
    attempt, pos = r
    r = _decimal(buf, pos, 16, True)
    if r is None or r[0] > EXPIRES_MAX:
        return None
    expires, pos = r
    if n < pos + 2 * DIGEST_LEN + 3:
        return None
    fp = _unhex(buf[pos:pos + 2 * DIGEST_LEN])
    if fp is None:
        return None
    pos += 2 * DIGEST_LEN
    if buf[pos] != 32 or buf[pos + 1] != 123 or buf[-1] != 125 or n - pos - 1 > OUTCOME_MAX:
        return None
    return Entry(kind=kind, key_id=key_id, mac=mac, expires_ms=expires,
                 attempt=attempt, fingerprint=fp, outcome=buf[pos + 1:])


def verify(secrets: Dict[int, bytes], full_key: bytes, value: bytes, entry: Entry) -> bool:
    """Whether entry (parsed from value) carries a MAC made with the secret
    of its key id over full_key; secrets maps key id to secret bytes."""
    secret = secrets.get(entry.key_id)
    if secret is None:
        return False
    return hmac.compare_digest(compute_mac(secret, full_key, bytes(value)), entry.mac)
