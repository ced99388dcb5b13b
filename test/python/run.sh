#!/usr/bin/env bash
# test/python/run.sh WORK [MODULE...]: the Python package (client/python)
# against real servers.  Runs as the unprivileged test user (test/suites).
# Checks the package with mypy --strict, starts a throwaway PostgreSQL 15
# with idem preloaded and its worker pointed at a throwaway Valkey on
# loopback, and pgbouncer in transaction mode in front of it, builds the C
# runner's one-shot program (test/t/idem_run_once.c, for the mixed fleet),
# installs the package as its README says (pip, offline, a venv), and
# runs the unit and integration tests (client/python/tests; MODULE...:
# only those, as tests/tap.py takes them) printing TAP lines.
set -uo pipefail
WORK=$1
shift
TREE=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
. "$TREE/test/lib/common.sh"
. "$TREE/test/python/rabbitmq.sh"
PY=${IDEM_PYTHON:-/usr/bin/python3}

dir=$(mktemp -d "$WORK/python.XXXXXX")
chmod 755 "$dir"
cleanup() {
	idem_rabbitmq_stop "$dir/rabbitmq"
	idem_pg_stop "$dir"
	idem_valkey_stop "$dir"
	idem_pg_stop "$dir/c"
	idem_valkey_cluster_stop "$dir/vcluster"
	[ -f "$dir/pgbouncer.pid" ] && kill "$(cat "$dir/pgbouncer.pid")" 2>/dev/null
}
trap cleanup EXIT

n=0
tap() {	# tap OK|NOTOK description
	n=$((n + 1))
	if [ "$1" = ok ]; then echo "ok $n - $2"; else echo "not ok $n - $2"; fi
}

# 1. the package README's install commands as written (but apt-get: make
#    test installed those packages), in a copy of the checkout: pip installs
#    offline into a venv that sees Debian's psycopg and redis
#    (--system-site-packages; Debian's pip runs in it).  The block is the
#    one after the line "<!-- test/python/run.sh: install -->".
cp -r "$TREE/client/python" "$dir/pkg"
mkdir -p "$dir/checkout/client"
cp -r "$TREE/client/python" "$dir/checkout/client/python"
install=$(awk '
	state == 0 && $0 == "<!-- test/python/run.sh: install -->" { state = 1; next }
	state == 1 && /^```/ { state = 2; next }
	state == 2 && /^```/ { exit }
	state == 2 && !/^sudo apt-get / { print }' "$TREE/client/python/README.md")
venv=$dir/checkout/env
if [ -n "$install" ] && (cd "$dir/checkout" && set -e && eval "$install") >"$dir/pip.log" 2>&1 &&
	(cd "$dir" && "$venv/bin/python" -c 'import idem, sys; sys.exit(0 if idem.__file__.startswith(sys.prefix) else 1)') \
		>>"$dir/pip.log" 2>&1; then
	tap ok "the package README's install commands work as written, offline (setuptools from Debian): $(tail -n 1 "$dir/pip.log")"
else
	tap notok "the package README's install commands work as written, offline"
	{ echo "$install"; sed 's/^/# /' "$dir/pip.log" | tail -n 20; } >&2
fi

# ... and type-checked as its users' checkers see it (py.typed): Debian's
# mypy, strict, on the package alone
if "$PY" -m mypy --version >/dev/null 2>&1; then
	if (cd "$dir/pkg" && "$PY" -m mypy --strict --cache-dir "$dir/mypy-cache" idem) \
		>"$dir/mypy.log" 2>&1; then
		tap ok "mypy --strict on the package: $(tail -n 1 "$dir/mypy.log")"
	else
		tap notok "mypy --strict on the package"
		sed 's/^/# /' "$dir/mypy.log" | tail -n 30 >&2
	fi
fi

# 2. the servers
vport=$(idem_free_port)
pgport=$(idem_free_port)
idem_valkey_start "$dir" "$vport" || { echo "Bail out! Valkey did not start"; exit 1; }
idem_pg_start "$dir" "$pgport" "idem.valkey_host = '127.0.0.1'" "idem.valkey_port = $vport" \
	"synchronous_commit = off" "max_connections = 60" ||
	{ echo "Bail out! PostgreSQL did not start"; exit 1; }
idem_pg_install_ledgers "$dir" "$pgport" || { echo "Bail out! could not install idem"; exit 1; }
"$(idem_pg_bindir)/psql" -X -q -h "$dir" -p "$pgport" -U postgres -d postgres \
	-c "INSERT INTO tenants VALUES (2); CREATE TABLE effects (scope text, id text, node text DEFAULT 'c', at timestamptz DEFAULT clock_timestamp())" >/dev/null ||
	{ echo "Bail out! could not create the effects table"; exit 1; }

# ... and a Valkey Cluster (3 masters, 3 replicas) with a second server
# whose worker copies into it, for the runner's routing by slot
mkdir -p "$dir/vcluster" "$dir/c"
if idem_valkey_cluster_start "$dir/vcluster" 3 &&
	cport=$(idem_free_port) &&
	idem_pg_start "$dir/c" "$cport" "idem.valkey_host = '127.0.0.1'" \
		"idem.valkey_port = $(idem_valkey_cluster_first "$dir/vcluster")" \
		"idem.valkey_nodes = '$(idem_valkey_cluster_others "$dir/vcluster")'" \
		"synchronous_commit = off" "max_connections = 30" &&
	idem_pg_install_ledgers "$dir/c" "$cport" &&
	"$(idem_pg_bindir)/psql" -X -q -h "$dir/c" -p "$cport" -U postgres -d postgres \
		-c "CREATE TABLE effects (scope text, id text, node text DEFAULT 'c', at timestamptz DEFAULT clock_timestamp())" >/dev/null; then
	export IDEM_PG_CLUSTER_DSN="host=127.0.0.1 port=$cport user=postgres dbname=postgres"
	export IDEM_VALKEY_CLUSTER_PORT=$(idem_valkey_cluster_first "$dir/vcluster")
	tap ok "a Valkey Cluster and a server whose worker copies into it start"
else
	tap notok "a Valkey Cluster and a server whose worker copies into it start"
fi

# ... and pgbouncer in transaction mode in front of it, 2 server
# connections for more clients: each transaction may land on another
# server connection than the last (tests/test_pooler.py)
if [ -x /usr/sbin/pgbouncer ]; then
	bport=$(idem_free_port)
	printf '"%s" ""\n' postgres >"$dir/userlist.txt"
	cat >"$dir/pgbouncer.ini" <<EOT
[databases]
* = host=127.0.0.1 port=$pgport
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $bport
unix_socket_dir =
auth_type = trust
auth_file = $dir/userlist.txt
pool_mode = transaction
default_pool_size = 2
max_client_conn = 50
logfile = $dir/pgbouncer.log
pidfile = $dir/pgbouncer.pid
EOT
	if /usr/sbin/pgbouncer -d "$dir/pgbouncer.ini" >/dev/null 2>&1; then
		for _ in $(seq 1 50); do
			"$(idem_pg_bindir)/psql" -X -At -h 127.0.0.1 -p "$bport" -U postgres -c 'SELECT 1' \
				postgres >/dev/null 2>&1 && break
			sleep 0.2
		done
		export IDEM_PGBOUNCER_DSN="host=127.0.0.1 port=$bport user=postgres dbname=postgres"
		export IDEM_PGBOUNCER_LOG="$dir/pgbouncer.log"
		tap ok "pgbouncer $(/usr/sbin/pgbouncer --version | head -n 1 | awk '{print $2}') in transaction mode in front of it"
	else
		tap notok "pgbouncer starts in transaction mode"
	fi
fi

# 3. the C runner for the mixed fleet
if gcc -O1 -o "$dir/idem_run_once" "$TREE/test/t/idem_run_once.c" \
	"$TREE/client/build/libidemclient.a" -I"$TREE/client" \
	-I"$("$(idem_pg_config)" --includedir)" -lpq -lhiredis -lpthread >"$dir/cc.log" 2>&1; then
	export IDEM_RUN_ONCE="$dir/idem_run_once"
	tap ok "the C runner for the mixed fleet builds (test/t/idem_run_once.c, libidemclient.a)"
else
	tap notok "the C runner for the mixed fleet builds (test/t/idem_run_once.c, libidemclient.a)"
	sed 's/^/# /' "$dir/cc.log" | tail -n 10 >&2
fi

# 4. a RabbitMQ broker for the consumers killed mid-message (when
#    rabbitmq-server is installed: make test installs it for this suite)
if [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ]; then
	if idem_rabbitmq_start "$dir/rabbitmq"; then
		export IDEM_RABBITMQ_PORT=$(cat "$dir/rabbitmq/amqp_port")
		tap ok "a throwaway RabbitMQ broker starts on loopback"
	else
		tap notok "a throwaway RabbitMQ broker starts on loopback"
	fi
fi

# ... and a crash of the first server (kill -9 of its processes), then its
# start: tests/test_consume.py's Crash
printf '#!/bin/bash\n. "%s/test/lib/common.sh"\nidem_pg_crash "%s/pg" "%s" "%s/pg.log"\n' \
	"$TREE" "$dir" "$(idem_pg_bindir)" "$dir" >"$dir/pg-crash.sh"
chmod +x "$dir/pg-crash.sh"
export IDEM_PG_CRASH="$dir/pg-crash.sh"

# 5. the tests, on the package pip installed (else on the checkout's)
py=$PY
pypath=$TREE/client/python/tests:$TREE/client/python
if (cd "$dir" && "$venv/bin/python" -c 'import idem') 2>/dev/null; then
	py=$venv/bin/python
	pypath=$TREE/client/python/tests
fi
cd "$dir"
IDEM_PG_DSN="host=127.0.0.1 port=$pgport user=postgres dbname=postgres" \
	IDEM_VALKEY_PORT=$vport IDEM_VALKEY_DIR="$dir" \
	IDEM_VALKEY_SERVER_BIN="$(idem_valkey_server)" \
	IDEM_PACKAGE_README="$TREE/client/python/README.md" IDEM_PG_LOG="$dir/pg.log" \
	PYTHONPATH="$pypath" \
	timeout 900 "$py" "$TREE/client/python/tests/tap.py" --first $((n + 1)) "$@"
rc=$?
# A failure says what the servers saw: the end of each server's log.
if [ "$rc" -ne 0 ]; then
	[ "$rc" -ne 124 ] || echo "not ok $((n + 1)) - python: the tests ended within 900 s"
	for log in "$dir/pg.log" "$dir/c/pg.log"; do
		[ -f "$log" ] && tail -n 25 "$log" | sed "s|^|# ${log#"$dir"/}: |" >&2
	done
fi
exit "$rc"
