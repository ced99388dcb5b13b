#!/usr/bin/env bash
# The client as make install leaves it: a program built with nothing but
# `pkg-config --cflags --libs idemclient` links libidemclient.so.1 by its
# soname and computes the same key as SQL's idem_key.  TAP.
#   IDEM_CLIENT_PREFIX  where make install put the client (the harness sets
#                       it to the private PostgreSQL copy's usr/local)
set -uo pipefail
prefix=${IDEM_CLIENT_PREFIX:-/usr/local}
T=$(mktemp -d "${TMPDIR:-/tmp}/idem-client-install.XXXXXX")
trap 'rm -rf "$T"' EXIT
n=0
ok() {
	n=$((n + 1))
	if [ "$1" -eq 0 ]; then echo "ok $n - $2"; else echo "not ok $n - $2"; fi
}

export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
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

out=$(LD_LIBRARY_PATH=$(pkg-config --variable=libdir idemclient) "$T/app" 2>&1)
[ "$out" = 5c76c6f58eff897da07846a990b77e88e8a0d282df751a06dfd7653c771f32cd ]
ok $? "it runs against the installed library and gets SQL's key"
echo "1..$n"
