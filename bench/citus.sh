#!/usr/bin/env bash
# bench/citus.sh (run by make bench after the main table): claim + effect +
# complete per transaction, on Citus (a coordinator and two workers, the
# handler sent to the coordinator and delegated to the tenant's worker)
# next to the single node bench/run started (BENCH_PGPORT).  All the nodes
# share this machine's cores, so the Citus figure is indicative only: it
# shows the cost of the extra hop, not how Citus scales out.
#
#   BENCH_SECONDS, BENCH_CITUS_CLIENTS (default "1 8")
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$ROOT/test/lib/common.sh"
. "$ROOT/test/lib/citus.sh"
SECONDS_PER=${BENCH_SECONDS:-5}
CLIENTS=${BENCH_CITUS_CLIENTS:-1 8}

if ! idem_citus_prepare "$ROOT"; then
	echo "citus bench skipped: $IDEM_CITUS_SKIP"
	exit 0
fi

WORK=$(mktemp -d /tmp/idem-bench-citus.XXXXXX)
chmod 755 "$WORK"
[ "$(id -u)" -ne 0 ] || chown "$(idem_test_user)" "$WORK"
cleanup() { for n in coord w1 w2; do idem_pg_stop "$WORK/$n"; done; rm -rf "$WORK"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

declare -A PORT
for n in coord w1 w2; do
	mkdir -p "$WORK/$n"
	[ "$(id -u)" -ne 0 ] || chown "$(idem_test_user)" "$WORK/$n"
	PORT[$n]=$(idem_free_port)
	idem_pg_start "$WORK/$n" "${PORT[$n]}" "shared_preload_libraries = 'citus,idem'" \
		"max_connections = 100" "shared_buffers = 128MB" "max_prepared_transactions = 100" \
		"citus.shard_count = 8" "idem.valkey_port = ${BENCH_VKPORT:-6379}" || exit 1
done
psql_on() {
	local n=$1
	shift
	idem_as_test_user "$(idem_pg_bindir)/psql" -X -q -At -v ON_ERROR_STOP=1 \
		-h 127.0.0.1 -p "${PORT[$n]}" -U postgres -d postgres "$@"
}
for n in coord w1 w2; do psql_on "$n" -c 'CREATE EXTENSION citus' >/dev/null || exit 1; done
psql_on coord >/dev/null <<SQL || exit 1
SELECT citus_set_coordinator_host('127.0.0.1', ${PORT[coord]});
SELECT citus_add_node('127.0.0.1', ${PORT[w1]});
SELECT citus_add_node('127.0.0.1', ${PORT[w2]});
CREATE TABLE tenants (id bigint PRIMARY KEY, name text NOT NULL DEFAULT '');
SELECT create_distributed_table('tenants', 'id');
INSERT INTO tenants (id) SELECT g FROM generate_series(1, 100) g;
CREATE EXTENSION idem;
SELECT idem_install('tenants');
CREATE TABLE ctransfers (id bigserial, tenant_id bigint NOT NULL REFERENCES tenants (id),
	amount bigint NOT NULL, PRIMARY KEY (tenant_id, id));
SELECT create_distributed_table('ctransfers', 'tenant_id', colocate_with => 'tenants');
SQL
# The same schema's effect table on the single node.
idem_as_test_user "$(idem_pg_bindir)/psql" -X -q -h "$BENCH_WORK" -p "$BENCH_PGPORT" -U postgres -d postgres \
	-c "CREATE TABLE IF NOT EXISTS ctransfers (id bigserial, tenant_id bigint NOT NULL REFERENCES tenants (id), amount bigint NOT NULL, PRIMARY KEY (tenant_id, id))" >/dev/null

cat >"$WORK/handler.sql" <<'SQL'
\set t random(1, 100)
\set run random(1, 2000000000)
BEGIN;
SELECT * FROM idem_claim(:t, idem_key('bench.citus', (:run)::text), idem_fingerprint('{}'));
INSERT INTO ctransfers (tenant_id, amount) VALUES (:t, 1);
SELECT idem_complete(:t, idem_key('bench.citus', (:run)::text), '{"ok": true}');
COMMIT;
SQL
chmod a+r "$WORK/handler.sql"

tps() {
	local out rc
	out=$(idem_as_test_user "$(idem_pg_bindir)/pgbench" -n -M prepared -h "$1" -p "$2" -U postgres \
		-c "$3" -j "$(($3 < 2 ? $3 : 2))" -T "$SECONDS_PER" -f "$WORK/handler.sql" postgres 2>&1)
	rc=$?
	# a client that aborts lowers the figure: say so rather than print it
	if [ $rc -ne 0 ]; then
		echo "citus bench: pgbench on port $2 exited $rc: $(echo "$out" | grep -m1 -iE 'error|abort')" >&2
		return
	fi
	echo "$out" | sed -nE 's/^tps = ([0-9.]+) \(without initial connection time\)/\1/p'
}
echo "claim + effect + complete per transaction (pgbench -M prepared, ${SECONDS_PER}s per run,"
echo "synchronous_commit on): one node vs a Citus coordinator + 2 workers on the same"
echo "machine. Indicative only: every node shares the same cores."
printf '%-8s %12s %12s %8s\n' clients single citus ratio
for c in $CLIENTS; do
	s=$(tps "$BENCH_WORK" "$BENCH_PGPORT" "$c")
	d=$(tps 127.0.0.1 "${PORT[coord]}" "$c")
	printf '%-8s %12.0f %12.0f %8.2f\n' "$c" "${s:-0}" "${d:-0}" \
		"$(awk -v a="${d:-0}" -v b="${s:-0}" 'BEGIN { print (b > 0 ? a / b : 0) }')"
done
