"""A run's outgoing messages (``run.emit``): kept on the Run while its
block runs, then recorded by the extension's idem_emit in the run's last
round trip (the savepoint released, the messages, the completion,
COMMIT), so that they commit with the effect and its key, or not at all,
at no round trip of their own.  A run that fails emits nothing.

Every message names its run's key (idem_emit's ``key`` argument), so one
statement serves a run and a batch of runs alike: the messages are one
JSON array, ``[[stream, message, key in hex], ...]``, recorded in order.
A tenant's single run records its messages with idem_emit_many(tenant,
key, [[stream, message], ...]) instead, which Citus delegates to the node
that holds the run's claim (the key form would run on the coordinator).
The server gives each the id ``<key in hex>-<n>``, n = 1, 2, ... the
message's position among its run's emits in the transaction.  The C
client's idem_call_emit does the same.  A leaf: it talks to no server."""
import json
from typing import Any, Iterable, List, Optional, Tuple

from .canonical import RequestError, canonical_json
from .errors import IdemError

# One statement for a tenant's run (%s: the schema).
RUN_SQL = "SELECT %s.idem_emit_many(%%s::bigint, %%s::bytea, %%s::jsonb)"

# One statement for all the messages of a transaction (%s: the schema).
EMIT_SQL = ("SELECT %s.idem_emit(e.value->>0, e.value->1, decode(e.value->>2, 'hex')) "
            "FROM jsonb_array_elements(%%s::jsonb) AS e")


def message_id(key: bytes, n: int) -> str:
    """The id idem_emit gives a run's n-th message."""
    return "%s-%d" % (key.hex(), n)


def check(stream: Any, message: Any) -> Tuple[str, str]:
    """(stream, the message's canonical JSON text), or IdemError("argument")."""
    if not isinstance(stream, str) or not stream or "\x00" in stream:
        raise IdemError("argument", "the stream is a non-empty str without NUL, not %r"
                        % (stream,))
    try:
        stream.encode("utf-8")
    except UnicodeEncodeError:
        raise IdemError("argument", "the stream name is not valid UTF-8") from None
    try:
        return stream, canonical_json(message)
    except RequestError as e:
        raise IdemError("argument", "the message: %s" % e) from None


def array_text(messages: Iterable[Tuple[bytes, str, str]]) -> Optional[str]:
    """The statement's parameter for (key, stream, message text) in order,
    or None when there is none."""
    parts = ["[%s, %s, \"%s\"]" % (json.dumps(stream, ensure_ascii=False), text, key.hex())
             for key, stream, text in messages]
    return "[%s]" % ", ".join(parts) if parts else None


def statement(schema: str, messages: List[Tuple[bytes, str, str]]
              ) -> List[Tuple[str, Optional[List[Any]]]]:
    """The statements (none, or one) that record messages."""
    text = array_text(messages)
    return [] if text is None else [(EMIT_SQL % schema, [text])]


def run_statement(schema: str, tenant_id: Optional[int], key: bytes,
                  messages: List[Tuple[bytes, str, str]]
                  ) -> List[Tuple[str, Optional[List[Any]]]]:
    """The statements (none, or one) that record one run's messages: for a
    tenant, one call Citus delegates; for the platform, statement()'s."""
    if tenant_id is None or not messages:
        return statement(schema, messages)
    pairs = ["[%s, %s]" % (json.dumps(stream, ensure_ascii=False), text)
             for _, stream, text in messages]
    return [(RUN_SQL % schema, [tenant_id, key, "[%s]" % ", ".join(pairs)])]
