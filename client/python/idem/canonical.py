"""The canonical JSON text of a request, its fingerprint, and the key.

These reproduce, byte for byte, what the server computes:

* ``canonical_json(text)`` is what PostgreSQL 15 prints for ``text::jsonb``:
  duplicate keys keep the last value; keys are sorted by UTF-8 byte length,
  then bytewise; ``", "`` and ``": "`` separate; strings are escaped as
  ``escape_json()`` does (``\\" \\\\ \\b \\f \\n \\r \\t``, other bytes below
  0x20 as ``\\u00xx``, everything else as is); numbers are printed as
  ``numeric_out(numeric_in(text))``: no exponent, display scale = fraction
  digits minus exponent (at least 0), ``-0`` is ``0``, PostgreSQL's numeric
  range limits refused alike.
* ``fingerprint(request)`` = SHA-256 of that text (SQL ``idem_fingerprint``).
* ``idem_key(scope, id)`` = SHA-256(be32(len scope) || scope || be32(len id)
  || id), lengths in UTF-8 bytes (SQL ``idem_key``).

The C client does the same in ``client/canonical_json.c``; the tests compare
this module with the server over a generated corpus.
"""
import hashlib
import json
import re
import struct
from typing import Any, Dict, List, NoReturn, Optional, Tuple

MAX_DEPTH = 512                 # as the C client: deeper nesting is refused
NUMERIC_DSCALE_MAX = 16383
NUMERIC_INT_DIGITS_MAX = 131072
EXPONENT_LIMIT = 1073741823     # INT_MAX / 2


class RequestError(ValueError):
    """The request is not JSON that jsonb accepts (or is nested too deep)."""


class _Canon:
    """Canonical text of a value already converted (a number or an object)."""
    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def canonical_number(s: str) -> str:
    """``numeric_out(numeric_in(s))`` for a JSON number token ``s``."""
    neg = s[0] == "-"
    body = s[1:] if neg else s
    m = re.fullmatch(r"(0|[1-9][0-9]*)(?:\.([0-9]+))?(?:[eE]([+-]?[0-9]+))?", body)
    if m is None:
        raise RequestError("invalid number: %r" % s)
    ip, fp, ex = m.group(1), m.group(2) or "", m.group(3)
    exp = 0
    if ex is not None:
        digits = ex.lstrip("+-").lstrip("0")
        if len(digits) > 10:
            raise RequestError("number overflows numeric format")
        exp = int(digits or "0")
        if ex.startswith("-"):
            exp = -exp
    if exp >= EXPONENT_LIMIT or exp <= -EXPONENT_LIMIT:
        raise RequestError("number overflows numeric format")
    dig = ip + fp
    ndig = len(dig)
    dscale = max(0, len(fp) - exp)
    if dscale > NUMERIC_DSCALE_MAX:
        raise RequestError("number overflows numeric format")
    p = len(ip) + exp               # the decimal point, after p digits
    z = len(dig) - len(dig.lstrip("0"))
    allzero = z == ndig
    if not allzero and p > z and p - z > NUMERIC_INT_DIGITS_MAX:
        raise RequestError("number overflows numeric format")
    out = "-" if (neg and not allzero) else ""
    if allzero or p <= z:
        out += "0"
    else:
        out += dig[z:min(p, ndig)] + "0" * max(0, p - ndig)
    if dscale > 0:
        out += "."
        if allzero:
            out += "0" * dscale
        else:
            out += "0" * max(0, -p) + dig[max(p, 0):]
    return out


_ESC = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n",
        "\r": "\\r", "\t": "\\t"}
_NEEDS_ESC = re.compile(r'["\\\x00-\x1f]')


def _string(s: str) -> str:
    if s.isascii() and _NEEDS_ESC.search(s) is None:
        return '"' + s + '"'        # the common text: nothing to check or escape
    if "\x00" in s:
        raise RequestError("unsupported Unicode escape sequence: \\u0000 cannot be converted to text")
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError("invalid Unicode escape (a lone surrogate)") from None
    return '"' + _NEEDS_ESC.sub(
        lambda m: _ESC.get(m.group(0)) or "\\u%04x" % ord(m.group(0)), s) + '"'


def _emit(v: Any) -> str:
    if isinstance(v, _Canon):
        return v.text
    if isinstance(v, str):
        return _string(v)
    if v is True:
        return "true"
    if v is False:
        return "false"
    if v is None:
        return "null"
    if isinstance(v, list):
        parts = []
        for x in v:             # a loop, not a generator: one frame per level
            parts.append(_emit(x))
        return "[" + ", ".join(parts) + "]"
    raise RequestError("unexpected value %r" % (v,))


def _object(pairs: List[Tuple[str, Any]]) -> _Canon:
    members: Dict[str, Any] = {}
    for k, v in pairs:
        members[k] = v              # the last duplicate wins, as in jsonb
    enc = []
    for k, v in members.items():
        ks = _string(k)
        enc.append((len(k.encode("utf-8")), k.encode("utf-8"), ks, v))
    enc.sort(key=lambda e: (e[0], e[1]))
    return _Canon("{" + ", ".join(e[2] + ": " + _emit(e[3]) for e in enc) + "}")


def _constant(name: str) -> NoReturn:
    raise RequestError("invalid input syntax for type json: %s" % name)


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)


def _check_depth(text: str) -> None:
    depth = 0
    for ch in _STRINGS.sub("", text):
        if ch in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise RequestError("JSON nested deeper than %d levels" % MAX_DEPTH)
        elif ch in "]}":
            depth -= 1


class _Other(Exception):
    """_direct met what only json.dumps knows how to serialise."""


# A dict key's (length in UTF-8, UTF-8, canonical text or None if it has
# none: _string raises, in the keys' order), for _direct, kept for the
# keys met (a request's keys are few and repeat).
_KEYS: Dict[str, Tuple[int, bytes, Optional[str]]] = {}


def _key(k: str) -> Tuple[int, bytes, Optional[str]]:
    e = _KEYS.get(k)
    if e is None:
        kb = k.encode("utf-8", "surrogatepass")
        try:
            text: Optional[str] = _string(k)
        except RequestError:
            text = None
        e = (len(kb), kb, text)
        if len(_KEYS) >= 4096:
            _KEYS.clear()
        _KEYS[k] = e
    return e


def _direct(v: Any, depth: int) -> str:
    """The canonical text of a value json.loads could have made (dict with
    str keys, list, str, int, float, bool, None, _Canon), straight from it:
    what _object and _emit print for json.loads(json.dumps(v)).  Anything
    else (a tuple, a subclass, a key that is not a str...) raises _Other."""
    t = type(v)
    if t is dict:
        if depth >= MAX_DEPTH:
            raise _Other
        enc = []
        for k, x in v.items():
            if type(k) is not str:
                raise _Other
            enc.append((_key(k), k, x))
        # by length, then bytes: distinct keys differ there, so the sort
        # never compares the rest of a tuple
        enc.sort()
        parts = []
        for e, k, x in enc:     # a loop, not a generator: one frame per level
            t = type(x)
            parts.append((e[2] or _string(k)) + ": " + (
                str(x) if t is int else _string(x) if t is str else _direct(x, depth + 1)))
        return "{" + ", ".join(parts) + "}"
    if t is str or t is bool or v is None or t is _Canon:
        return _emit(v)
    if t is int:
        return str(v)       # ValueError past Python's digit limit: the long way
    if t is list:
        if depth >= MAX_DEPTH:
            raise _Other
        return "[" + ", ".join([_direct(x, depth + 1) for x in v]) + "]"
    if t is float:
        if v != v or v in (float("inf"), float("-inf")):
            raise _Other
        return canonical_number(repr(v))
    raise _Other


def canonical_json(request: Any) -> str:
    """The canonical jsonb text of ``request`` (str).

    ``request`` is JSON text (``str``, or ``bytes`` in UTF-8), or a Python
    value that ``json.dumps`` serialises (dict, list, str, int, float, bool,
    None; NaN and infinities refused).  Raises RequestError for anything
    jsonb would refuse.
    """
    plain = type(request) is dict       # the common request, first
    if not plain and isinstance(request, (bytes, bytearray, memoryview)):
        try:
            text = bytes(request).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError("request is not valid UTF-8: %s" % e) from None
    elif not plain and isinstance(request, str):
        text = request
    else:
        # the common request, a dict of plain values: printed directly, as
        # the long way below would print it; anything else the long way
        try:
            return _direct(request, 1)
        except (_Other, RequestError, ValueError, RecursionError):
            pass
        try:
            text = json.dumps(request, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise RequestError("request cannot be serialised as JSON: %s" % e) from None
    if "\x00" in text:
        raise RequestError("request contains a NUL character")
    if text.count("[") + text.count("{") > MAX_DEPTH:
        _check_depth(text)
    try:
        # objects as dicts (the last duplicate wins, as in jsonb), integers
        # as ints (their text is canonical), other numbers canonical here
        return _direct(json.loads(text, parse_float=lambda s: _Canon(canonical_number(s)),
                                  parse_constant=_constant), 1)
    except RequestError:
        raise
    except (_Other, ValueError, RecursionError):
        pass        # not JSON, nested deep, or an integer past Python's digit limit
    try:
        value = json.loads(text, object_pairs_hook=_object,
                           parse_float=lambda s: _Canon(canonical_number(s)),
                           parse_int=lambda s: _Canon(canonical_number(s)),
                           parse_constant=_constant)
        return _emit(value)
    except RequestError:
        raise
    except (ValueError, RecursionError) as e:
        raise RequestError("request is not valid JSON: %s" % e) from None


def fingerprint(request: Any) -> bytes:
    """SHA-256 of the canonical text: SQL ``idem_fingerprint(request::jsonb)``."""
    return hashlib.sha256(canonical_json(request).encode("utf-8")).digest()


def _text_bytes(s: Any, what: str) -> bytes:
    if type(s) is str and s.isascii() and "\x00" not in s:
        return s.encode("ascii")    # the common text
    if not isinstance(s, str):
        raise TypeError("%s must be a str" % what)
    if "\x00" in s:
        raise ValueError("%s contains a NUL character" % what)
    try:
        return s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("%s is not valid Unicode (a lone surrogate)" % what) from None


# Each scope's hash after its length and text (idem_key), kept for the
# scopes met (a program has few).
_SCOPES: Dict[str, "hashlib._Hash"] = {}


def idem_key(scope: str, id: str) -> bytes:
    """SQL ``idem_key(scope, id)``: 32 bytes."""
    if type(id) is str and id.isascii() and "\x00" not in id:
        h = _SCOPES.get(scope) if type(scope) is str else None
        if h is not None:
            b = id.encode("ascii")      # _text_bytes's common text
            h = h.copy()
            h.update(_be32(len(b)) + b)
            return h.digest()
    a, b = _text_bytes(scope, "scope"), _text_bytes(id, "id")
    h = hashlib.sha256(_be32(len(a)) + a)
    if type(scope) is str:
        if len(_SCOPES) >= 1024:
            _SCOPES.clear()
        _SCOPES[scope] = h.copy()
    h.update(_be32(len(b)) + b)
    return h.digest()


_be32 = struct.Struct(">I").pack
