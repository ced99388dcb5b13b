#!/usr/bin/env bash
# The extension's headers, as PostgreSQL's own (src/tools/pginclude): one
# header per file that exports something, each of which compiles on its
# own, and each file includes what it uses.  What a compiler cannot see is
# checked here:
#   - every header of src/ compiles alone after postgres.h, and every
#     header of src/common/ alone (plain C: no server header);
#   - every .c of src/ includes postgres.h first;
#   - no source file of src/, src/common/ or client/ includes a header twice;
#   - every .c that declares a symbol PostgreSQL looks up by name
#     (PG_FUNCTION_INFO_V1, PG_MODULE_MAGIC, IDEM_EXPORT) includes compat.h
#     itself: without it the symbol compiles but stays hidden on 15.
# TAP.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
. "$ROOT/test/lib/common.sh"
PGC=$(idem_pg_config)
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
. "$ROOT/test/lib/tap.sh"
CC=$("$PGC" --cc 2>/dev/null | awk '{print $1}')
CC=${CC:-cc}
FLAGS="-fsyntax-only $IDEM_WARNING_FLAGS -Wno-unused-function"

# compiles_alone PRELUDE HEADER...: the names of those that do not
compiles_alone() {
	local prelude=$1 h bad=
	shift
	for h in "$@"; do
		printf '%s#include "%s"\n' "$prelude" "$(basename "$h")" >"$T/h.c"
		if ! "$CC" $FLAGS -I"$ROOT/src" -I"$ROOT/src/common" \
			-I"$("$PGC" --includedir-server)" -I"$("$PGC" --includedir)" \
			"$T/h.c" >"$T/h.log" 2>&1; then
			bad="$bad $(basename "$h")"
			sed 's/^/# /' "$T/h.log" | head -5 >&2
		fi
	done
	echo "$bad"
}

hdrs=$(ls "$ROOT"/src/*.h)
bad=$(compiles_alone '#include "postgres.h"
' $hdrs)
[ -z "$bad" ]
ok $? "every header of src/ compiles alone after postgres.h ($(echo $hdrs | wc -w))${bad:+ (not:$bad)}"

hdrs=$(ls "$ROOT"/src/common/*.h)
bad=$(compiles_alone '' $hdrs)
[ -z "$bad" ]
ok $? "every header of src/common/ compiles alone, with no server header ($(echo $hdrs | wc -w))${bad:+ (not:$bad)}"

bad=
for f in "$ROOT"/src/*.c; do
	first=$(grep -m1 '^#include' "$f")
	[ "$first" = '#include "postgres.h"' ] || bad="$bad $(basename "$f")"
done
[ -z "$bad" ]
ok $? "every .c of src/ includes postgres.h first${bad:+ (not:$bad)}"

bad=
for f in "$ROOT"/src/*.[ch] "$ROOT"/src/common/*.[ch] "$ROOT"/client/*.[ch]; do
	dup=$(grep -E '^#include' "$f" | sort | uniq -d | head -n 1)
	[ -z "$dup" ] || bad="$bad $(basename "$f")(${dup#\#include })"
done
[ -z "$bad" ]
ok $? "no source file includes a header twice${bad:+ (not:$bad)}"

bad=
for f in "$ROOT"/src/*.c; do
	grep -qE '^(PG_FUNCTION_INFO_V1|PG_MODULE_MAGIC)|IDEM_EXPORT' "$f" || continue
	grep -q '^#include "compat.h"' "$f" || bad="$bad $(basename "$f")"
done
[ -z "$bad" ]
ok $? "every .c that declares a symbol PostgreSQL looks up includes compat.h${bad:+ (not:$bad)}"

echo "1..$n"
