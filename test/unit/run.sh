#!/usr/bin/env bash
# Unit tests of the extension's C code that need no server: each
# test/unit/NAME.c is built with the extension's sources it names, against
# the server's headers and OpenSSL, plainly and with AddressSanitizer and
# UndefinedBehaviorSanitizer, and run (TAP).
#   seal.c   idem_seal_secrets / idem_seal_open (src/cache_cluster_seal.c)
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
. "$ROOT/test/lib/common.sh"
PGC=$(idem_pg_config)
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
CC=$("$PGC" --cc 2>/dev/null | awk '{print $1}')
CC=${CC:-cc}
INC="-I$ROOT/src -I$ROOT/src/common -I$("$PGC" --includedir-server)"
rc=0
for variant in plain asan; do
	flags="-O1 -g $IDEM_WARNING_FLAGS"
	[ $variant = asan ] && flags="$flags -fsanitize=address,undefined -fno-sanitize-recover=all"
	if ! "$CC" $flags $INC -o "$T/seal-$variant" "$ROOT/test/unit/seal.c" \
		"$ROOT/src/cache_cluster_seal.c" -lcrypto >"$T/cc.log" 2>&1; then
		echo "not ok - seal ($variant): builds"
		sed 's/^/# /' "$T/cc.log" | head -n 20 >&2
		rc=1
		continue
	fi
	"$T/seal-$variant" | sed -E "s/^(not ok|ok) [0-9]+ - /\1 - seal ($variant): /"
	[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
done
exit $rc
