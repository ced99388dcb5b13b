#!/usr/bin/env bash
# An incremental make builds and links every object its list names, and
# only those, whatever the sources' mtimes: in a copy of the extension's
# and the client library's build (Makefile, src/, client/), a source file
# added to OBJS (client: SRCS) with an mtime older than the library, as a
# branch switch or a copy keeping mtimes leaves it, is compiled and linked
# (PGXS declares every target .SECONDARY, and make skipped such an object);
# taken out of the list again, it is no longer in the library; and a make
# with nothing changed relinks nothing.  TAP.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
. "$ROOT/test/lib/common.sh"
. "$ROOT/test/lib/cache.sh"
idem_clean_make_env	# make test runs this from inside make
T=$(mktemp -d "${TMPDIR:-/tmp}/idem-make-objects.XXXXXX")
trap '[ -n "${KEEP:-}" ] || rm -rf "$T"' EXIT
. "$ROOT/test/lib/tap.sh"
PGC=$(idem_pg_config)
# the copy keeps the mtimes of the build test/run made (if any)
mkdir -p "$T/tree"
(cd "$ROOT" && tar --exclude=client/python --exclude=client/build-asan -cf - \
	Makefile idem.control idem--*.sql src client $(ls idem.so idem.objs 2>/dev/null)) |
	(cd "$T/tree" && tar -xf -)
ok $? "a copy of the extension's and the client library's build"
mk() { make -C "$T/tree/$1" -s PG_CONFIG="$PGC" "${@:2}" >>"$T/make.log" 2>&1; }
mk . all && mk client build/libidemclient.a build/libidemclient.so
st=$?
ok $st "the copy builds"
[ $st -eq 0 ] || { tail -n 20 "$T/make.log" >&2; echo "Bail out! the copy does not build"; exit 1; }

has() { nm "$T/tree/$1" 2>/dev/null | grep -w "$2" >/dev/null; }	# no -q: pipefail, SIGPIPE
mtime() { stat -c %Y.%y "$T/tree/$1"; }
old='2001-01-01 00:00'

# The extension: src/zz_harness_probe.c, older than idem.so, added to OBJS.
cat >"$T/tree/src/zz_harness_probe.c" <<'EOT'
#include "postgres.h"
int			idem_zz_harness_probe(void);
int
idem_zz_harness_probe(void)
{
	return 42;
}
EOT
touch -d "$old" "$T/tree/src/zz_harness_probe.c"
sed -i 's|^OBJS = |OBJS = src/zz_harness_probe.o |' "$T/tree/Makefile"
grep -q '^OBJS = src/zz_harness_probe.o' "$T/tree/Makefile"
ok $? "a source file older than idem.so added to the Makefile's OBJS"
mk . all
[ -f "$T/tree/src/zz_harness_probe.o" ] && has idem.so idem_zz_harness_probe
ok $? "make compiles it and links it into idem.so"
before=$(mtime idem.so)
sleep 1.1
mk . all
[ "$(mtime idem.so)" = "$before" ]
ok $? "make again, nothing changed: idem.so is not relinked"
sed -i 's|^OBJS = src/zz_harness_probe.o |OBJS = |' "$T/tree/Makefile"
mk . all
! has idem.so idem_zz_harness_probe
ok $? "taken out of OBJS again: make relinks idem.so without it"

# The client library: zz_harness_probe.c, older than the libraries, in SRCS.
printf 'int idemc_zz_harness_probe(void);\nint idemc_zz_harness_probe(void) { return 42; }\n' \
	>"$T/tree/client/zz_harness_probe.c"
touch -d "$old" "$T/tree/client/zz_harness_probe.c"
sed -i 's|^SRCS = |SRCS = zz_harness_probe.c |' "$T/tree/client/Makefile"
grep -q '^SRCS = zz_harness_probe.c' "$T/tree/client/Makefile"
ok $? "a client source file older than the libraries added to client/Makefile's SRCS"
mk client build/libidemclient.a build/libidemclient.so
has client/build/libidemclient.a idemc_zz_harness_probe &&
	has client/build/libidemclient.so.1 idemc_zz_harness_probe
ok $? "make builds it into both libraries"
sed -i 's|^SRCS = zz_harness_probe.c |SRCS = |' "$T/tree/client/Makefile"
mk client build/libidemclient.a build/libidemclient.so
! has client/build/libidemclient.a idemc_zz_harness_probe &&
	! has client/build/libidemclient.so.1 idemc_zz_harness_probe
ok $? "taken out of SRCS again: neither library has it"
echo "1..$n"
