#!/usr/bin/env bash
# The client as make install leaves it: a program built with nothing but
# `pkg-config --cflags --libs idemclient` links libidemclient.so.1 by its
# soname and computes the same key as SQL's idem_key.  TAP.
#   IDEM_CLIENT_PREFIX  where make install put the client (the harness sets
#                       it to the private PostgreSQL copy's usr/local, which
#                       the dynamic linker does not search: the program runs
#                       with LD_LIBRARY_PATH, as make install says there)
#   --system            (as root: test/run's root pass) what a user's
#                       `sudo make install` does instead: the client into
#                       /usr/local, for real, in a mount namespace of its
#                       own whose /usr/local and /etc are overlays on the
#                       machine's (ldconfig's cache too: nothing of the
#                       machine's changes); the program is then built and
#                       run as a user's shell would, with no PKG_CONFIG_PATH
#                       and no LD_LIBRARY_PATH.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
SYSTEM=
[ "${1:-}" != --system ] || SYSTEM=1
if [ -n "$SYSTEM" ] && [ -z "${IDEM_CLIENT_NS:-}" ]; then
	if [ "$(id -u)" -ne 0 ] || ! command -v unshare >/dev/null 2>&1; then
		echo "1..0 # SKIP --system needs root and unshare"
		exit 0
	fi
	exec unshare -m --propagation private env IDEM_CLIENT_NS=1 bash "$0" --system
fi
. "$ROOT/test/lib/common.sh"
T=$(mktemp -d "${TMPDIR:-/tmp}/idem-client-install.XXXXXX")
trap '[ -z "$SYSTEM" ] || umount /usr/local /etc 2>/dev/null; rm -rf "$T"' EXIT
n=0
ok() {
	n=$((n + 1))
	if [ "$1" -eq 0 ]; then echo "ok $n - $2"; else echo "not ok $n - $2"; fi
}

if [ -n "$SYSTEM" ]; then
	for d in /usr/local /etc; do
		mkdir -p "$T/ov$d/up" "$T/ov$d/work"
		mount -t overlay overlay -o "lowerdir=$d,upperdir=$T/ov$d/up,workdir=$T/ov$d/work" "$d" ||
			{ echo "1..0 # SKIP cannot lay an overlay on $d here"; exit 0; }
	done
	prefix=/usr/local
	make -s -C "$ROOT" install-client PG_CONFIG="$(idem_pg_config)" >"$T/install.log" 2>&1
	ok $? "make install-client as root, into make install's default prefix $prefix"
	sed 's/^/# /' "$T/install.log"
	unset PKG_CONFIG_PATH LD_LIBRARY_PATH
else
	prefix=${IDEM_CLIENT_PREFIX:-/usr/local}
	export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
fi
flags=$(pkg-config --cflags --libs idemclient 2>"$T/pc.err")
ok $? "pkg-config finds idemclient under $prefix"
[ -s "$T/pc.err" ] && sed 's/^/# /' "$T/pc.err"

cat >"$T/app.c" <<'EOT'
#include <stdio.h>
#include <idem_client.h>

int
main(void)
{
	uint8_t k[IDEM_DIGEST_BYTES];
	int i;

	if (idem_key("billing.charge", "run-42", k) != 0)
		return 1;
	for (i = 0; i < IDEM_DIGEST_BYTES; i++)
		printf("%02x", k[i]);
	printf("\n");
	return 0;
}
EOT
cc -Wall -Werror -o "$T/app" "$T/app.c" $flags 2>"$T/cc.err"
ok $? "a program builds with \`pkg-config --cflags --libs idemclient\`"
sed 's/^/# /' "$T/cc.err"

soname=$(readelf -d "$prefix/lib/libidemclient.so" 2>/dev/null | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[ "$soname" = libidemclient.so.1 ]
ok $? "the installed library's soname is libidemclient.so.1 (got '$soname')"
# The file is named for the soname's major (.so.1.MINOR.PATCH), with
# .so.1 and .so linking to it, as ldconfig and the linker expect.
real=$(readlink -f "$prefix/lib/libidemclient.so")
[[ $(basename "$real") =~ ^libidemclient\.so\.1\.[0-9]+\.[0-9]+$ ]] &&
	[ "$(readlink -f "$prefix/lib/libidemclient.so.1")" = "$real" ]
ok $? "the installed file is libidemclient.so.1.x.y, .so.1 and .so link to it (got '$(basename "$real")')"
needed=$(readelf -d "$T/app" 2>/dev/null | sed -n 's/.*(NEEDED).*\[\(libidemclient[^]]*\)\]/\1/p')
[ "$needed" = libidemclient.so.1 ]
ok $? "the program needs libidemclient.so.1 by soname (got '$needed')"

if [ -n "$SYSTEM" ]; then
	out=$("$T/app" 2>&1)
else
	out=$(LD_LIBRARY_PATH=$(pkg-config --variable=libdir idemclient) "$T/app" 2>&1)
fi
[ "$out" = 5c76c6f58eff897da07846a990b77e88e8a0d282df751a06dfd7653c771f32cd ]
ok $? "it runs against the installed library${SYSTEM:+ with no LD_LIBRARY_PATH} and gets SQL's key"
[ -n "$out" ] && [ ${#out} -ne 64 ] && printf '%s\n' "$out" | sed 's/^/# /'
echo "1..$n"
