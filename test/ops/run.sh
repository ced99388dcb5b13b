#!/usr/bin/env bash
# The operations suite: idem with the tools users already run, all Debian
# packages, for real, against one throwaway cluster (idem and pg_cron
# preloaded) and a Valkey.  TAP.
#
#   pg_cron (postgresql-15-cron)     idem_purge scheduled from the cron
#                                    database into idem's; expired rows go
#   prometheus-postgres-exporter     ops/postgres_exporter.yaml: every
#                                    counter of idem_stats() on the
#                                    exporter's /metrics page
#   pgbouncer, transaction pooling   the C runner's exactly-once check
#                                    (itest contention) through it, and two
#                                    psycopg clients whose statements must
#                                    not mix (pooled_clients.py)
#
# idem is installed in the database "app", as in the README; pg_cron lives
# in "postgres" (cron.database_name).  What the README shows for these
# tools (its blocks after "<!-- test/ops/run.sh: ... -->") is run as
# written, with this server's port.
#
# Runs as the unprivileged test user, from test/suites (WORK=$1).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
. "$ROOT/test/lib/common.sh"
W=$(mktemp -d "${1:-/tmp}/ops.XXXXXX")
BIN=$(idem_pg_bindir)
. "$ROOT/test/lib/tap.sh"
cleanup() {
	[ -f "$W/exporter.pid" ] && kill "$(cat "$W/exporter.pid")" 2>/dev/null
	[ -f "$W/pgbouncer.pid" ] && kill "$(cat "$W/pgbouncer.pid")" 2>/dev/null
	idem_valkey_stop "$W"
	idem_pg_stop "$W"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
PSQL() { "$BIN/psql" -X -q -At -v ON_ERROR_STOP=1 -h "$W" -p "$PGPORT" -U postgres "$@"; }
APP() { PSQL -d app "$@"; }
# readme_block NAME: the lines of the README's block (of any language) that
# follows the line "<!-- test/ops/run.sh: NAME -->"
readme_block() {
	awk -v m="<!-- test/ops/run.sh: $1 -->" '
		state == 0 && $0 == m { state = 1; next }
		state == 1 && /^```/ { state = 2; next }
		state == 1 && $0 != "" { exit }
		state == 2 && /^```/ { exit }
		state == 2 { print }' "$ROOT/README.md"
}
# wait_for SECONDS CMD...: until CMD succeeds
wait_for() {
	local t=$1 end
	shift
	end=$((SECONDS + t))
	while [ $SECONDS -lt $end ]; do
		"$@" && return 0
		sleep 0.5
	done
	return 1
}
http_get() {	# http_get PORT PATH: the body
	perl -MIO::Socket::INET -e '
		my $s = IO::Socket::INET->new(PeerAddr => "127.0.0.1", PeerPort => $ARGV[0],
			Timeout => 10) or exit 1;
		print $s "GET $ARGV[1] HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
		local $/; my $r = <$s> // ""; $r =~ s/^.*?\r\n\r\n//s; print $r;' "$@"
}

VKPORT=$(idem_free_port)
PGPORT=$(idem_free_port)
idem_valkey_start "$W" "$VKPORT" || { echo "Bail out! Valkey did not start"; exit 1; }
idem_pg_start "$W" "$PGPORT" "shared_preload_libraries = 'idem,pg_cron'" \
	"cron.database_name = 'postgres'" "cron.use_background_workers = on" \
	"max_worker_processes = 16" "max_connections = 60" \
	"idem.valkey_port = $VKPORT" || { echo "Bail out! PostgreSQL did not start"; exit 1; }
[ "$(id -un)" = postgres ] || PSQL -c "CREATE ROLE \"$(id -un)\" SUPERUSER LOGIN" >/dev/null
{ PSQL -c 'CREATE EXTENSION pg_cron' && PSQL -c 'CREATE DATABASE app'; } >/dev/null ||
	{ echo "Bail out! setup failed"; exit 1; }
APP <<'SQL' || { echo "Bail out! setup failed"; exit 1; }
CREATE EXTENSION idem;
CREATE TABLE tenants (id bigint PRIMARY KEY);
INSERT INTO tenants VALUES (1);
SELECT idem_install('tenants');
SQL

# ---- pg_cron: the purge on a schedule ----
# Debian 12's pg_cron is 1.4: minutes are its finest schedule (1.5 added
# "N seconds"), so the job runs at the next minute boundary.  Schedule it
# first, check the rest meanwhile, and at the end poll until that boundary
# (plus a few seconds for the run), not longer.
APP <<'SQL' >/dev/null
SELECT idem_claim(1, idem_key('ops', n::text), idem_fingerprint('{}'))
  FROM generate_series(1, 5) n;
SELECT idem_complete(1, idem_key('ops', n::text), '{"done": true}')
  FROM generate_series(1, 5) n;
-- three of them past their retention (and finished before idem.min_retention), two not
UPDATE idempotency_keys SET expires_at = now() - interval '1 hour',
       updated_at = now() - interval '1 day'
 WHERE idempotency_key IN (SELECT idem_key('ops', n::text) FROM generate_series(1, 3) n);
SQL
# The README's statement, as it is written there, in pg_cron's database.
readme_block pg_cron >"$W/cron.sql"
grep -q "'app'" "$W/cron.sql"
ok $? "the README's pg_cron statement schedules the purge in idem's database, app"
job=$(PSQL -tA -f "$W/cron.sql" 2>&1)
scheduled=$(date +%s)
[[ $job =~ ^[0-9]+$ ]]
ok $? "pg_cron schedules idem_purge (job $job)"

# ---- prometheus-postgres-exporter ----
# The README's role and grants, run in idem's database as written; then its
# command as written, with this server's port, the queries file of this
# tree, and a free port to listen on.
readme_block "exporter grants" >"$W/exporter.sql"
APP -f "$W/exporter.sql" >"$W/exporter-sql.log" 2>&1
ok $? "the README's exporter role and grants run as written in app"
sed 's/^/# /' "$W/exporter-sql.log"
EXPORT_PORT=$(idem_free_port)
cmd=$(readme_block "exporter command" | sed -e ':a;/\\$/{N;s/\\\n//;ba}')
cmd=${cmd//127.0.0.1:5432/127.0.0.1:$PGPORT}
cmd=${cmd//\/path\/to\/ops\/postgres_exporter.yaml/$ROOT/ops/postgres_exporter.yaml}
[[ $cmd == *"/app?"* && $cmd == *"$ROOT/ops/postgres_exporter.yaml"* ]]
ok $? "the README's exporter command connects to app with ops/postgres_exporter.yaml"
echo "# $cmd"
(eval "exec env $cmd --web.listen-address=127.0.0.1:$EXPORT_PORT") >"$W/exporter.log" 2>&1 &
echo $! >"$W/exporter.pid"
metrics_ready() { http_get "$EXPORT_PORT" /metrics >"$W/metrics.txt" 2>/dev/null && grep -q '^idem_copied' "$W/metrics.txt"; }
wait_for 30 metrics_ready
ok $? "the exporter's /metrics page has idem's metrics"
grep -q '^idem_preloaded{.*} 1$\|^idem_preloaded 1$' "$W/metrics.txt"
ok $? "... idem_preloaded is 1"
claimed=$(sed -nE 's/^idem_claims_claimed(\{[^}]*\})? ([0-9.e+]+)$/\2/p' "$W/metrics.txt" | head -n 1)
[ -n "$claimed" ] && awk -v c="$claimed" 'BEGIN { exit !(c >= 5) }'
ok $? "... idem_claims_claimed counts the claims made ($claimed)"
# Every column of idem_stats() but the two texts is a metric (queue_age and
# outbox_age, intervals, as idem_queue_age_seconds and idem_outbox_age_seconds).
cols=$(APP -c "SELECT string_agg(a.name, ' ' ORDER BY a.n)
	FROM pg_proc p, unnest(p.proargnames, p.proargmodes::text[]) WITH ORDINALITY a(name, mode, n)
	WHERE p.oid = 'idem_stats()'::regprocedure AND a.mode = 'o'
	  AND a.name NOT IN ('last_error', 'valkey_nodes')")
missing=
for m in $cols; do
	[ "$m" != queue_age ] || m=queue_age_seconds
	[ "$m" != outbox_age ] || m=outbox_age_seconds
	grep -q "^idem_$m[{ ]" "$W/metrics.txt" || missing="$missing idem_$m"
done
[ -n "$cols" ] && [ -z "$missing" ]
ok $? "... and every counter of idem_stats(): $(echo $cols | wc -w) columns${missing:+ (missing:$missing)}"
for m in rejected valkey_cluster valkey_redirects valkey_map_refreshes valkey_node_errors valkey_cluster_retries \
	skipped skipped_expired skipped_unjoined skipped_epoch queue_age; do
	[[ " $cols " == *" $m "* ]] || { echo "# idem_stats() has no column $m"; false; } || break
done
ok $? "... rejected, the cluster counters, the skipped reasons and queue_age among them"
if ! grep -q '^idem_copied' "$W/metrics.txt"; then
	sed 's/^/# exporter: /' "$W/exporter.log" | tail -n 15
fi

# ---- pgbouncer, transaction pooling, the C runner ----
BPORT=$(idem_free_port)
printf '"%s" ""\n' "$(id -un)" postgres >"$W/userlist.txt"
cat >"$W/pgbouncer.ini" <<EOT
[databases]
* = host=127.0.0.1 port=$PGPORT
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $BPORT
unix_socket_dir =
auth_type = trust
auth_file = $W/userlist.txt
pool_mode = transaction
; fewer server connections than runners: each transaction may land on
; another server connection than the last
default_pool_size = 2
max_client_conn = 50
ignore_startup_parameters = extra_float_digits
logfile = $W/pgbouncer.log
pidfile = $W/pgbouncer.pid
EOT
/usr/sbin/pgbouncer -d "$W/pgbouncer.ini" >/dev/null 2>&1
bouncer_up() { "$BIN/psql" -X -At -h 127.0.0.1 -p "$BPORT" -U postgres -c 'SELECT 1' postgres >/dev/null 2>&1; }
wait_for 20 bouncer_up
ok $? "pgbouncer $(/usr/sbin/pgbouncer --version | head -n 1 | awk '{print $2}') in transaction pooling mode"

# Two psycopg clients through it, connected as the README says
# (prepare_threshold=None): their statements do not mix.
/usr/bin/python3 "$ROOT/test/ops/pooled_clients.py" \
	"host=127.0.0.1 port=$BPORT dbname=app user=postgres connect_timeout=10" \
	>"$W/pooled.out" 2>"$W/pooled.err"
st=$?
while read -r line; do
	case $line in
	"not ok "*) ok 1 "psycopg through pgbouncer: ${line#not ok [0-9]* - }" ;;
	"ok "*) ok 0 "psycopg through pgbouncer: ${line#ok [0-9]* - }" ;;
	esac
done <"$W/pooled.out"
[ $st -eq 0 ] || { tail -n 10 "$W/pooled.err" | sed 's/^/# /'; }
grep -q 'prepare_threshold=None' "$ROOT/README.md"
ok $? "the README gives that setting (prepare_threshold=None)"

ITEST=$ROOT/client/build/itest
if [ ! -x "$ITEST" ]; then
	make -s -C "$ROOT/client" PG_CONFIG="$BIN/pg_config" build/itest >"$W/build.log" 2>&1 ||
		{ sed 's/^/# /' "$W/build.log" | tail -n 20; }
fi
export IDEM_TEST_PGHOST=127.0.0.1 IDEM_TEST_DB=idemtest IDEM_TEST_VALKEY_PORT=$VKPORT \
	IDEM_TEST_WORKDIR=$W PGCONNECT_TIMEOUT=10
# The database and the tables the test needs, made directly; then every
# connection of the check (four runner processes, the checks) goes through
# pgbouncer.
IDEM_TEST_PGPORT=$PGPORT "$ITEST" setup >"$W/setup.log" 2>&1
ok $? "the runner's test database is set up"
IDEM_TEST_PGPORT=$BPORT timeout 240 "$ITEST" contention clean >"$W/contention.out" 2>"$W/contention.err"
st=$?
sed -nE 's/^(not ok|ok)( [0-9]+)?( -)? ?(.*)/\1 \4/p' "$W/contention.out" | while read -r line; do
	case $line in
	"not ok "*) echo "not ok $((n += 1)) - through pgbouncer: ${line#not ok }" ;;
	*) echo "ok $((n += 1)) - through pgbouncer: ${line#ok }" ;;
	esac
done
n=$((n + $(grep -cE '^(not )?ok' "$W/contention.out")))
[ $st -eq 0 ]
ok $? "the runner's exactly-once check passes through pgbouncer (exit $st)"
[ $st -eq 0 ] || { tail -n 20 "$W/contention.err" | sed 's/^/# /'; tail -n 10 "$W/pgbouncer.log" | sed 's/^/# pgbouncer: /'; }

# ---- pg_cron, at the end: the purge has run ----
purged() {
	[ "$(APP -c "SELECT count(*) FROM idempotency_keys WHERE idempotency_key IN (SELECT idem_key('ops', n::text) FROM generate_series(1, 5) n)")" = 2 ] &&
		[ "$(PSQL -c "SELECT count(*) > 0 FROM cron.job_run_details WHERE jobid = $job AND status = 'succeeded'")" = t ]
}
# The first minute boundary after the schedule (the one after it, if the
# schedule came in its last 2 s), plus 10 s for the run.
deadline=$((((scheduled + 2) / 60 + 1) * 60 + 10))
until purged || [ "$(date +%s)" -ge "$deadline" ]; do sleep 0.2; done
runs=$(PSQL -c "SELECT count(*) FROM cron.job_run_details WHERE jobid = $job AND status = 'succeeded'" 2>/dev/null)
[ "$(APP -c "SELECT count(*) FROM idempotency_keys WHERE idempotency_key IN (SELECT idem_key('ops', n::text) FROM generate_series(1, 5) n)")" = 2 ]
ok $? "pg_cron's idem_purge removed the 3 expired rows and kept the 2 others (by $(($(date +%s) - scheduled)) s after scheduling)"
[ "${runs:-0}" -ge 1 ]
ok $? "cron.job_run_details shows the job succeeded ($runs runs)"
echo "1..$n"
