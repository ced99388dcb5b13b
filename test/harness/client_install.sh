#!/usr/bin/env bash
# The client as make install leaves it: a program built with nothing but
# `pkg-config --cflags --libs idemclient` links libidemclient.so.1 by its
# soname and computes the same key as SQL's idem_key; the example programs
# the READMEs show (examples/*.c, each README block checked against its
# file) build with the README's own cc line and, on a throwaway PostgreSQL
# with idem preloaded and a real Valkey, apply a message once and replay
# its redelivery.  TAP.
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
trap '[ -z "$SYSTEM" ] || umount /usr/local /etc 2>/dev/null; idem_pg_stop "$T"; idem_valkey_stop "$T"; rm -rf "$T"' EXIT
. "$ROOT/test/lib/tap.sh"

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

# The examples: once, as a user of make install without sudo (the --system
# pass has shown the system install already).
if [ -n "$SYSTEM" ]; then
	echo "1..$n"
	exit 0
fi
EXAMPLES="runner_sql_handler:client/README.md runner_c_handler:client/README.md"
built=
ln -s "$ROOT/examples" "$T/examples"
for e in $EXAMPLES; do
	ex=${e%%:*} readme=${e#*:}
	bash "$ROOT/test/harness/readme_block.sh" "$readme" "examples/$ex.c" >"$T/block.diff" 2>&1
	ok $? "$readme shows examples/$ex.c as it is"
	sed 's/^/# /' "$T/block.diff"
	# The README's build line, run as written (from the tree's root).
	line=$(grep -E "^cc .*examples/$ex\.c" "$ROOT/$readme")
	[ "$(printf '%s\n' "$line" | grep -c .)" -eq 1 ] &&
		[[ $line == *'$(pkg-config --cflags --libs idemclient)'* ]]
	ok $? "$readme gives one cc line for examples/$ex.c, through pkg-config: $line"
	rm -f "$T/$ex"
	(cd "$T" && eval "$line") >"$T/cc.err" 2>&1 && [ -x "$T/$ex" ]
	st=$?
	ok $st "examples/$ex.c builds with that line"
	sed 's/^/# /' "$T/cc.err"
	[ $st -eq 0 ] && built="$built $ex"
	cc -Wall -Wextra -Werror -fsyntax-only "$ROOT/examples/$ex.c" $flags >"$T/cc.err" 2>&1
	ok $? "... and compiles with -Wall -Wextra -Werror"
	sed 's/^/# /' "$T/cc.err"
done

chmod 777 "$T"	# the servers run as the test user
PGPORT=$(idem_free_port)
VKPORT=$(idem_free_port)
if idem_valkey_start "$T" "$VKPORT" && idem_pg_start "$T" "$PGPORT" "idem.valkey_port = $VKPORT" &&
	idem_pg_install_ledgers "$T" "$PGPORT"; then
	servers=0
else
	servers=1
fi
ok $servers "a PostgreSQL with idem preloaded and a Valkey for the examples"
PSQL=(idem_as_test_user "$(idem_pg_bindir)/psql" -X -q -At -v ON_ERROR_STOP=1 -h "$T" -p "$PGPORT" -U postgres -d postgres)
# The account and charge(jsonb) of the README's "One statement".
"${PSQL[@]}" >/dev/null 2>"$T/sql.err" <<'SQL'
CREATE TABLE accounts (id int PRIMARY KEY, balance int NOT NULL);
INSERT INTO accounts VALUES (7, 100);
CREATE FUNCTION charge(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
BEGIN
  UPDATE accounts SET balance = balance - (args->>'amount')::int WHERE id = (args->>'account')::int;
  RETURN jsonb_build_object('charged', args->'amount');        -- the outcome
END $$;
SQL
ok $? "the README's accounts and charge(jsonb)"
sed 's/^/# /' "$T/sql.err"

# example TENANT RUN_ID REQUEST: its output and exit status, "OUT|STATUS"
example() {
	local out
	out=$(idem_as_test_user env LD_LIBRARY_PATH="$(pkg-config --variable=libdir idemclient)" \
		IDEM_PG="host=127.0.0.1 port=$PGPORT user=postgres dbname=postgres connect_timeout=2" \
		IDEM_VALKEY=127.0.0.1 IDEM_VALKEY_PORT="$VKPORT" "$T/$ex" "$@" 2>"$T/run.err")
	echo "$out|$?"
}
balance() { "${PSQL[@]}" -c "SELECT balance FROM accounts WHERE id = 7"; }
req='{"account": 7, "amount": 5}'
for ex in $built; do
	[ $servers -eq 0 ] || break
	before=$(balance)
	got=$(example 1 "run-$ex" "$req")
	[ "$got" = 'applied {"charged": 5}|0' ]
	ok $? "$ex: a message is applied (got '$got')"
	sed 's/^/# /' "$T/run.err"
	got=$(example 1 "run-$ex" "$req")
	[ "$got" = 'replayed {"charged": 5}|0' ]
	ok $? "$ex: its redelivery is replayed (got '$got')"
	after=$(balance)
	[ "$after" = $((before - 5)) ]
	ok $? "$ex: the account is charged once ($before, then $after)"
	got=$(example 1 "run-$ex" '{"account": 7, "amount": 6}')
	[ "${got%%|*}" = "mismatch " ] && [ "${got##*|}" = 65 ]
	ok $? "$ex: the run id with another request is a mismatch, dead-lettered (got '$got')"
	got=$(example x "run-$ex" "$req")
	[ "${got##*|}" = 2 ]
	ok $? "$ex: a bad tenant id is refused (got '$got')"
done
echo "1..$n"
