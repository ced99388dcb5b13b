#!/bin/bash
# client/tests/run.sh: the client's tests on real servers.
#
# Starts a throwaway PostgreSQL 15 (idem preloaded, its worker pointed at the
# RESP server) and a RESP server ($IDEM_VALKEY_SERVER, else valkey-server on
# PATH) on free loopback ports in a temp folder,
# runs the unit and integration tests, and always stops both servers.
#
# PostgreSQL refuses to run as root: as root, the script copies the test
# binaries to a temp folder and runs itself as $IDEM_TEST_USER (default
# idemtest, created if missing).
#
# Output: TAP ("ok N - ..."), numbered across all test programs, then the
# plan and an "N passed, N failed" line.  Exit status 1 on any failure.
#
# Then, when make built them (build-asan/), the same programs compiled with
# AddressSanitizer and UndefinedBehaviorSanitizer (any report is a failure),
# and the same programs again under valgrind memcheck (leaks and invalid
# accesses are failures).  IDEM_CLIENT_VALGRIND=0 leaves the valgrind pass
# out, IDEM_CLIENT_VALGRIND=only runs only it (make valgrind).
set -u

here=$(cd "$(dirname "$0")" && pwd)

if [ "${1:-}" != "--inner" ]; then
	client=$(cd "$here/.." && pwd)
	top=$(cd "$client/.." && pwd)
	for b in unit itest so_smoke abi_first_so; do
		if [ ! -x "$client/build/$b" ]; then
			echo "Bail out! $client/build/$b is missing: run make -C client first"
			exit 1
		fi
	done
	sharedir=$(pg_config --sharedir 2>/dev/null)
	if [ ! -f "$sharedir/extension/idem.control" ]; then
		if [ "$(id -u)" = 0 ]; then
			make -C "$top" install >/dev/null || { echo "Bail out! make install of the extension failed"; exit 1; }
		else
			echo "Bail out! the idem extension is not installed: run 'make install' as root in $top"
			exit 1
		fi
	fi
	parent=${IDEM_TEST_PARENT_WORK:-}
	[ -n "$parent" ] && [ -d "$parent" ] && [ -w "$parent" ] || parent=/tmp
	work=$(mktemp -d "$parent/idem-client-test.XXXXXX") || exit 1
	chmod 755 "$work"
	mkdir "$work/bin"
	cp "$client/build/unit" "$client/build/itest" "$client/build/so_smoke" \
		"$client/build/abi_first_so" "$client/build/libidemclient.a" \
		"$client/exports.map" "$here/exports.sh" \
		"$client/build/libidemclient.so.1" "$here/run.sh" \
		"$top/test/lib/common.sh" "$work/bin/"
	for b in unit itest abi_first; do
		[ -x "$client/build-asan/$b" ] && cp "$client/build-asan/$b" "$work/bin/$b-asan"
	done
	if [ "$(id -u)" = 0 ]; then
		user=${IDEM_TEST_USER:-idemtest}
		if ! id "$user" >/dev/null 2>&1; then
			useradd --system --user-group --no-create-home --shell /usr/sbin/nologin "$user" || exit 1
		fi
		chown -R "$user" "$work"
		runuser -u "$user" -- bash "$work/bin/run.sh" --inner "$work"
		rc=$?
	else
		bash "$work/bin/run.sh" --inner "$work"
		rc=$?
	fi
	rm -rf "$work"
	exit $rc
fi

# ---- inner: as an unprivileged user, in $work ----
work=$2
bin=$work/bin
pgbin=$(pg_config --bindir)

# idem_free_port: a port the kernel hands out as free on 127.0.0.1
. "$bin/common.sh"

resp_server=${IDEM_VALKEY_SERVER:-}
if [ -z "$resp_server" ]; then
	resp_server=$(command -v valkey-server || true)
fi
if [ -z "$resp_server" ]; then
	echo "Bail out! no RESP server: install valkey-server (or set IDEM_VALKEY_SERVER)"
	exit 1
fi

cleanup() {
	if [ -f "$work/valkey.pid" ]; then
		kill -CONT "$(cat "$work/valkey.pid")" 2>/dev/null
		kill -9 "$(cat "$work/valkey.pid")" 2>/dev/null
	fi
	if [ -f "$work/pg/postmaster.pid" ]; then
		"$pgbin/pg_ctl" -D "$work/pg" -m immediate -w stop >/dev/null 2>&1
	fi
}
trap cleanup EXIT
trap 'exit 1' INT TERM

"$pgbin/initdb" -D "$work/pg" -E UTF8 --locale=C -A trust -U "$(id -un)" >"$work/initdb.log" 2>&1 ||
	{ echo "Bail out! initdb failed"; sed 's/^/# /' "$work/initdb.log"; exit 1; }
cp "$work/pg/postgresql.conf" "$work/postgresql.conf.orig"

# start_servers: the RESP server and PostgreSQL on two fresh ports.  A port
# free when asked can be taken before the server binds it (by another
# program's server, or as a client's ephemeral port), so a failed start is
# retried on other ports; each failure's log is printed as comments.
start_servers() {
	pgport=$(idem_free_port) && vport=$(idem_free_port) || return 1
	[ "$vport" != "$pgport" ] || return 1
	# the RESP server, (re)startable by the tests
	cat > "$work/valkey-start.sh" <<EOF
#!/bin/bash
mkdir -p "$work/valkey"
"$resp_server" --port $vport --bind 127.0.0.1 --save '' --appendonly no \\
	--dir "$work/valkey" --daemonize no >>"$work/valkey.log" 2>&1 &
echo \$! > "$work/valkey.pid"
for _ in \$(seq 1 500); do
	if (exec 3<>/dev/tcp/127.0.0.1/$vport) 2>/dev/null; then exit 0; fi
	kill -0 \$(cat "$work/valkey.pid") 2>/dev/null || exit 1
	sleep 0.02
done
exit 1
EOF
	chmod +x "$work/valkey-start.sh"
	if ! "$work/valkey-start.sh"; then
		echo "# $(basename "$resp_server") did not start on port $vport:"
		tail -n 5 "$work/valkey.log" | sed 's/^/#   /'
		cleanup
		rm -f "$work/valkey.pid"
		return 1
	fi
	cp "$work/postgresql.conf.orig" "$work/pg/postgresql.conf"
	cat >> "$work/pg/postgresql.conf" <<EOF
port = $pgport
listen_addresses = '127.0.0.1'
unix_socket_directories = '$work'
fsync = off
synchronous_commit = off
full_page_writes = off
autovacuum = off
max_connections = 60
shared_preload_libraries = 'idem'
idem.valkey_host = '127.0.0.1'
idem.valkey_port = $vport
EOF
	if ! "$pgbin/pg_ctl" -D "$work/pg" -l "$work/pg.log" -w -t 120 start >/dev/null 2>&1; then
		echo "# PostgreSQL did not start on port $pgport:"
		tail -n 5 "$work/pg.log" | sed 's/^/#   /'
		cleanup
		rm -f "$work/valkey.pid"
		return 1
	fi
	return 0
}

started=no
for attempt in 1 2 3; do
	start_servers && { started=yes; break; }
done
[ "$started" = yes ] || { echo "Bail out! the servers did not start (3 attempts; their logs are above)"; exit 1; }

export IDEM_TEST_PGHOST=127.0.0.1 IDEM_TEST_PGPORT=$pgport IDEM_TEST_DB=idemtest
export IDEM_TEST_VALKEY_PORT=$vport IDEM_TEST_VALKEY_START="$work/valkey-start.sh"
export IDEM_TEST_VALKEY_PIDFILE="$work/valkey.pid" IDEM_TEST_WORKDIR=$work IDEM_TEST_PGBIN=$pgbin
export IDEM_TEST_VALKEY_SERVER=$resp_server
# a crash of PostgreSQL and its restart (itest consume)
printf '#!/bin/bash\n. "%s/common.sh"\nidem_pg_crash "%s/pg" "%s" "%s/pg.log"\n' \
	"$bin" "$work" "$pgbin" "$work" >"$work/pg-crash.sh"
chmod +x "$work/pg-crash.sh"
export IDEM_TEST_PG_CRASH="$work/pg-crash.sh"
export PGCONNECT_TIMEOUT=10

"$bin/itest" setup >"$work/setup.log" 2>&1 || { echo "Bail out! test database setup failed"; cat "$work/setup.log"; exit 1; }

n=0
pass=0
fail=0

# run a TAP program, renumbering its lines into the common sequence
# (IDEM_CLIENT_TESTS="trust asan-trust ...": only those)
tap() {
	local name=$1
	shift
	if [ -n "${IDEM_CLIENT_TESTS:-}" ] && [[ " $IDEM_CLIENT_TESTS " != *" $name "* ]]; then
		return 0
	fi
	local line rc=0 before=$fail seen=0
	while IFS= read -r line; do
		case "$line" in
			"ok "*|"not ok "*)
				local rest=${line#*ok [0-9]* }
				rest=${rest#- }
				n=$((n + 1))
				seen=$((seen + 1))
				if [ "${line%%ok*}" = "not " ]; then
					fail=$((fail + 1))
					echo "not ok $n - $name: $rest"
				else
					pass=$((pass + 1))
					echo "ok $n - $name: $rest"
				fi
				;;
			"__EXIT__ "*) rc=${line#__EXIT__ } ;;
			1..*) ;;
			*) echo "$line" ;;
		esac
	done < <("$@" 2>"$work/stderr-$name.log"; echo "__EXIT__ $?")
	if [ "$rc" != 0 ] && [ "$fail" = "$before" ]; then
		n=$((n + 1))
		fail=$((fail + 1))
		echo "not ok $n - $name exited with status $rc"
	fi
	# under a sanitizer, any report (forked children included) is a failure
	if [ -n "${ASAN_OPTIONS:-}" ] &&
		grep -qE 'ERROR: (Address|Leak)Sanitizer|runtime error:' "$work/stderr-$name.log"; then
		n=$((n + 1))
		fail=$((fail + 1))
		echo "not ok $n - $name: a sanitizer reported errors"
		rc=98
	fi
	# under valgrind, any report (forked children included) is a failure
	if [ ${#vg[@]} -gt 0 ] && grep -q '^==[0-9]*== ' "$work/stderr-$name.log"; then
		n=$((n + 1))
		fail=$((fail + 1))
		echo "not ok $n - $name: valgrind memcheck reported errors"
		rc=99
	elif [ ${#vg[@]} -gt 0 ]; then
		n=$((n + 1))
		pass=$((pass + 1))
		echo "ok $n - $name: clean under valgrind memcheck (no leaks, no invalid accesses)"
	fi
	if [ "$rc" != 0 ] || [ "$seen" = 0 ]; then
		[ "$seen" = 0 ] && { n=$((n + 1)); fail=$((fail + 1)); echo "not ok $n - $name ran no test"; }
		sed 's/^/# stderr: /' "$work/stderr-$name.log" | tail -20
	fi
}

vg=()
mode=${IDEM_CLIENT_VALGRIND:-1}		# 0: no valgrind pass; 1: both; only

echo "# PostgreSQL $("$pgbin/postgres" --version | awk '{print $3}') on 127.0.0.1:$pgport, $(basename "$resp_server") on 127.0.0.1:$vport"
if [ "$mode" != only ]; then
	tap unit "$bin/unit"
	tap shared "$bin/so_smoke"
	tap exports bash "$bin/exports.sh" "$bin/libidemclient.a" "$bin/libidemclient.so.1" "$bin/exports.map"
	tap abi "$bin/abi_first_so"
	tap diff "$bin/itest" diff
	tap scenario "$bin/itest" scenario
	tap contention "$bin/itest" contention clean
	tap faults "$bin/itest" contention faults
	tap trust "$bin/itest" trust
	tap router "$bin/itest" router
	tap honesty "$bin/itest" honesty
	tap health "$bin/itest" health
	tap consume "$bin/itest" consume
fi
if [ "$mode" != only ] && [ -x "$bin/itest-asan" ]; then
	# the same programs (own keys) built with -fsanitize=address,undefined
	echo "# built with AddressSanitizer and UndefinedBehaviorSanitizer"
	export IDEM_TEST_SUFFIX=.asan
	# leaks are the valgrind pass's job: LeakSanitizer needs ptrace, which
	# some containers forbid
	export ASAN_OPTIONS=detect_leaks=0:exitcode=98
	export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:exitcode=98
	tap asan-unit "$bin/unit-asan"
	[ -x "$bin/abi_first-asan" ] && tap asan-abi "$bin/abi_first-asan"
	tap asan-diff "$bin/itest-asan" diff
	tap asan-scenario "$bin/itest-asan" scenario
	tap asan-contention "$bin/itest-asan" contention clean
	tap asan-trust "$bin/itest-asan" trust
	tap asan-router "$bin/itest-asan" router
	tap asan-honesty "$bin/itest-asan" honesty
	tap asan-health "$bin/itest-asan" health
	tap asan-consume "$bin/itest-asan" consume
	unset IDEM_TEST_SUFFIX ASAN_OPTIONS UBSAN_OPTIONS
fi
if [ "$mode" != 0 ]; then
	if command -v valgrind >/dev/null 2>&1; then
		# the same programs (smaller counts, own keys) under memcheck; the
		# contention workers are forked, so they run under it too
		export IDEM_TEST_SLOW=1 IDEM_TEST_SUFFIX=.vg
		vg=(valgrind --quiet --error-exitcode=99 --leak-check=full
			--errors-for-leak-kinds=definite,indirect --show-leak-kinds=definite,indirect
			--track-origins=yes)
		echo "# under valgrind memcheck: $(valgrind --version)"
		tap valgrind-unit "${vg[@]}" "$bin/unit"
		tap valgrind-shared "${vg[@]}" "$bin/so_smoke"
		tap valgrind-abi "${vg[@]}" "$bin/abi_first_so"
		tap valgrind-diff "${vg[@]}" "$bin/itest" diff
		tap valgrind-scenario "${vg[@]}" "$bin/itest" scenario
		tap valgrind-contention "${vg[@]}" "$bin/itest" contention clean
		tap valgrind-trust "${vg[@]}" "$bin/itest" trust
		tap valgrind-honesty "${vg[@]}" "$bin/itest" honesty
		tap valgrind-health "${vg[@]}" "$bin/itest" health
		tap valgrind-consume "${vg[@]}" "$bin/itest" consume
	else
		n=$((n + 1))
		pass=$((pass + 1))
		echo "ok $n - # SKIP valgrind is not installed (apt-get install valgrind)"
	fi
fi

echo "1..$n"
echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
