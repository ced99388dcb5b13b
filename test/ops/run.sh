#!/usr/bin/env bash
# The operations suite: idem with the tools users already run, all Debian
# packages, for real, against one throwaway cluster (idem and pg_cron
# preloaded) and a Valkey.  TAP.
#
#   pg_cron (postgresql-15-cron)     idem_purge scheduled; expired rows go
#   prometheus-postgres-exporter     ops/postgres_exporter.yaml: idem_stats()
#                                    on the exporter's /metrics page
#   pgbouncer, transaction pooling   the C runner's exactly-once check
#                                    (itest contention) through it
#
# Runs as the unprivileged test user, from test/suites (WORK=$1).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
. "$ROOT/test/lib/common.sh"
W=$(mktemp -d "${1:-/tmp}/ops.XXXXXX")
BIN=$(idem_pg_bindir)
n=0
ok() {
	n=$((n + 1))
	if [ "$1" -eq 0 ]; then echo "ok $n - $2"; else echo "not ok $n - $2"; fi
}
cleanup() {
	[ -f "$W/exporter.pid" ] && kill "$(cat "$W/exporter.pid")" 2>/dev/null
	[ -f "$W/pgbouncer.pid" ] && kill "$(cat "$W/pgbouncer.pid")" 2>/dev/null
	idem_valkey_stop "$W"
	idem_pg_stop "$W"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
PSQL() { "$BIN/psql" -X -q -At -v ON_ERROR_STOP=1 -h "$W" -p "$PGPORT" -U postgres "$@"; }
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
PSQL <<'SQL' || { echo "Bail out! setup failed"; exit 1; }
CREATE EXTENSION idem;
CREATE EXTENSION pg_cron;
CREATE TABLE tenants (id bigint PRIMARY KEY);
INSERT INTO tenants VALUES (1);
SELECT idem_install('tenants');
SQL

# ---- pg_cron: the purge on a schedule ----
# Debian 12's pg_cron is 1.4: minutes are its finest schedule (1.5 added
# "N seconds"), so the job runs at the next minute boundary.  Schedule it
# first, check the rest meanwhile, and at the end poll until that boundary
# (plus a few seconds for the run), not longer.
PSQL <<'SQL' >/dev/null
SELECT idem_claim(1, idem_key('ops', n::text), idem_fingerprint('{}'))
  FROM generate_series(1, 5) n;
SELECT idem_complete(1, idem_key('ops', n::text), '{"done": true}')
  FROM generate_series(1, 5) n;
-- three of them past their retention (and finished before idem.min_retention), two not
UPDATE idempotency_keys SET expires_at = now() - interval '1 hour',
       updated_at = now() - interval '1 day'
 WHERE idempotency_key IN (SELECT idem_key('ops', n::text) FROM generate_series(1, 3) n);
SQL
# The README's statement, as it is written there ("app" is this database).
job=$(PSQL -tA <<'SQL' 2>&1
SELECT cron.schedule_in_database('idem-purge', '* * * * *',
  $job$DO $d$ BEGIN WHILE idem_purge(10000) > 0 LOOP END LOOP; END $d$$job$,
  'postgres');
SQL
)
scheduled=$(date +%s)
[[ $job =~ ^[0-9]+$ ]]
ok $? "pg_cron schedules idem_purge (job $job)"

# ---- prometheus-postgres-exporter ----
PSQL <<'SQL'
CREATE ROLE exporter LOGIN;
GRANT pg_monitor TO exporter;
GRANT EXECUTE ON FUNCTION idem_stats() TO exporter;
SQL
EXPORT_PORT=$(idem_free_port)
DATA_SOURCE_NAME="postgresql://exporter@127.0.0.1:$PGPORT/postgres?sslmode=disable" \
	prometheus-postgres-exporter --web.listen-address="127.0.0.1:$EXPORT_PORT" \
	--extend.query-path="$ROOT/ops/postgres_exporter.yaml" \
	>"$W/exporter.log" 2>&1 &
echo $! >"$W/exporter.pid"
metrics_ready() { http_get "$EXPORT_PORT" /metrics >"$W/metrics.txt" 2>/dev/null && grep -q '^idem_copied' "$W/metrics.txt"; }
wait_for 30 metrics_ready
ok $? "the exporter's /metrics page has idem's metrics"
grep -q '^idem_preloaded{.*} 1$\|^idem_preloaded 1$' "$W/metrics.txt"
ok $? "... idem_preloaded is 1"
claimed=$(sed -nE 's/^idem_claims_claimed(\{[^}]*\})? ([0-9.e+]+)$/\2/p' "$W/metrics.txt" | head -n 1)
[ -n "$claimed" ] && awk -v c="$claimed" 'BEGIN { exit !(c >= 5) }'
ok $? "... idem_claims_claimed counts the claims made ($claimed)"
for m in valkey_connected queued copied dropped copy_errors queue_stalls queue_depth claims_completed \
	claims_failed_permanent claims_busy claims_mismatch; do
	grep -q "^idem_$m" "$W/metrics.txt" || { echo "# missing: idem_$m"; false; } || break
done
ok $? "... and every counter of idem_stats()"
if [ "$n" -gt 0 ] && ! grep -q '^idem_copied' "$W/metrics.txt"; then
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
	[ "$(PSQL -c "SELECT count(*) FROM idempotency_keys WHERE idempotency_key IN (SELECT idem_key('ops', n::text) FROM generate_series(1, 5) n)")" = 2 ] &&
		[ "$(PSQL -c "SELECT count(*) > 0 FROM cron.job_run_details WHERE jobid = $job AND status = 'succeeded'")" = t ]
}
# The first minute boundary after the schedule (the one after it, if the
# schedule came in its last 2 s), plus 10 s for the run.
deadline=$((((scheduled + 2) / 60 + 1) * 60 + 10))
until purged || [ "$(date +%s)" -ge "$deadline" ]; do sleep 0.2; done
runs=$(PSQL -c "SELECT count(*) FROM cron.job_run_details WHERE jobid = $job AND status = 'succeeded'" 2>/dev/null)
[ "$(PSQL -c "SELECT count(*) FROM idempotency_keys WHERE idempotency_key IN (SELECT idem_key('ops', n::text) FROM generate_series(1, 5) n)")" = 2 ]
ok $? "pg_cron's idem_purge removed the 3 expired rows and kept the 2 others (by $(($(date +%s) - scheduled)) s after scheduling)"
[ "${runs:-0}" -ge 1 ]
ok $? "cron.job_run_details shows the job succeeded ($runs runs)"
echo "1..$n"
