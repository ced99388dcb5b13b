#!/usr/bin/env bash
# Part of make bench (called by bench/run with BENCH_WORK, BENCH_PGPORT,
# BENCH_VKPORT set): Valkey Cluster (3 masters + 3 replicas on loopback)
# next to the single Valkey, alternating rounds, median kept:
#   drain      copies per second the worker writes (BENCH_DRAIN results
#              queued while it is away, timed from its first copy to an
#              empty queue)
#   replay     idem_run replays answered by the cache (client_bench
#              valkey-replay, BENCH_CLIENTS clients)
#   raw GET    valkey-benchmark GET (with --cluster on the cluster): the
#              reference the replay is built on
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$ROOT/bench/lib.sh"
SECS=${BENCH_SECONDS:-5}
ROUNDS=${BENCH_ROUNDS:-3}
DRAIN=${BENCH_DRAIN:-20000}
CL=$BENCH_WORK/cluster
mkdir -p "$CL"
chmod 777 "$CL"
trap 'idem_valkey_cluster_stop "$CL"' EXIT
cp "$ROOT/bench/drain.sql" "$BENCH_WORK/drain.sql"
chmod a+r "$BENCH_WORK/drain.sql"
idem_valkey_cluster_start "$CL" 3 || exit 1
CL_PORT=$(idem_valkey_cluster_first "$CL")
CL_NODES=$(idem_valkey_cluster_others "$CL")
BIN=$BENCH_WORK/client_bench
[ -x "$BIN" ] || bench_client_bench "$BIN" || exit 1
PG="host=$BENCH_WORK port=$BENCH_PGPORT user=postgres dbname=postgres options=-csynchronous_commit=off"
PSQL=(idem_as_test_user "$(idem_pg_bindir)/psql" -X -q -At -h "$BENCH_WORK" -p "$BENCH_PGPORT" -U postgres -d postgres)
"${PSQL[@]}" -f "$BENCH_WORK/drain.sql" >/dev/null || exit 1
CLI=$(idem_valkey_cli)
BENCHER=${CLI%-cli}-benchmark

# Point the worker at the single server or the cluster; wait until it is there.
use() {
	local port=$1 nodes=$2 want=$3
	"${PSQL[@]}" -c "ALTER SYSTEM SET idem.valkey_port = $port" \
		-c "ALTER SYSTEM SET idem.valkey_nodes = '$nodes'" -c "SELECT pg_reload_conf()" >/dev/null
	for _ in $(seq 1 200); do
		[ "$("${PSQL[@]}" -c "SELECT valkey_connected AND valkey_cluster = $want FROM idem_stats()")" = t ] && return 0
		sleep 0.05
	done
	echo "cluster.sh: the worker did not connect (cluster=$want)" >&2
	return 1
}

# Copies per second: with the worker pointed at a closed port, DRAIN results
# are committed and stay queued (in batches of max_locks_per_transaction
# claims: each claim holds a key lock until its transaction ends, and the
# lock table is sized by that setting); then the worker is pointed at the
# server under test, and idem_bench_drain() (bench/drain.sql) times the
# copies from the first to the last, so the reconnection is not counted.
drain() {
	local tag=$1 port=$2 nodes=$3
	"${PSQL[@]}" -c "ALTER SYSTEM SET idem.valkey_port = 1" \
		-c "ALTER SYSTEM SET idem.valkey_nodes = ''" -c "SELECT pg_reload_conf()" >/dev/null
	for _ in $(seq 1 200); do
		[ "$("${PSQL[@]}" -c "SELECT NOT valkey_connected FROM idem_stats()")" = t ] && break
		sleep 0.05
	done
	"${PSQL[@]}" -c "SET synchronous_commit = off" -c "DO \$\$
		DECLARE batch int := current_setting('max_locks_per_transaction')::int;
		BEGIN FOR i IN 1..$DRAIN LOOP
		PERFORM idem_claim(1 + i % 100, idem_key('bench.drain.$tag', i::text), idem_fingerprint('{}'));
		PERFORM idem_complete(1 + i % 100, idem_key('bench.drain.$tag', i::text), '{\"ok\": true}');
		IF i % batch = 0 THEN COMMIT; END IF;
		END LOOP; END \$\$" >/dev/null || return 1
	"${PSQL[@]}" -c "ALTER SYSTEM SET idem.valkey_port = $port" \
		-c "ALTER SYSTEM SET idem.valkey_nodes = '$nodes'" -c "SELECT pg_reload_conf()" \
		-c "SELECT idem_bench_drain()" | tail -n 1 |
		awk '{ if ($2 > 0) printf "%.0f\n", ($1 + 1) / $2 }'
}

replay() {
	local port=$1 nodes=$2 c=$3 out
	out=$("$BIN" valkey-replay "$c" "$SECS" "$PG" 127.0.0.1 "$port") || return 1
	echo "${out##* }"
}

rawget() {
	local port=$1 cluster=$2 c=$3
	"$BENCHER" -h 127.0.0.1 -p "$port" $cluster -t get -n $((c * 20000)) -c "$c" -r 10000 -q 2>/dev/null |
		awk '/GET/ { for (i = 1; i <= NF; i++) if ($i ~ /^[0-9.]+$/) { print $i; exit } }'
}

# Warm the cluster's cache: replays read PostgreSQL and the worker copies.
use "$CL_PORT" "$CL_NODES" true || exit 1
"${PSQL[@]}" -c "SELECT count(*) FROM generate_series(1, 10000) i, idem_lookup(1 + i % 100, idem_key('bench.replay', i::text))" >/dev/null
"$BIN" valkey-replay 4 "$SECS" "$PG" 127.0.0.1 "$CL_PORT" >/dev/null

declare -A runs=()
for r in $(seq 1 "$ROUNDS"); do
	runs[drain-single]+="$(drain "s$r" "$BENCH_VKPORT" "") "
	use "$BENCH_VKPORT" "" false || exit 1
	runs[drain-cluster]+="$(drain "c$r" "$CL_PORT" "$CL_NODES") "
	use "$CL_PORT" "$CL_NODES" true || exit 1
	for c in ${BENCH_CLIENTS:-1 8 32}; do
		runs[replay-single-$c]+="$(replay "$BENCH_VKPORT" "" "$c") "
		runs[replay-cluster-$c]+="$(replay "$CL_PORT" "$CL_NODES" "$c") "
		runs[get-single-$c]+="$(rawget "$BENCH_VKPORT" "" "$c") "
		runs[get-cluster-$c]+="$(rawget "$CL_PORT" --cluster "$c") "
	done
done
use "$BENCH_VKPORT" "" false

m() { echo "${runs[$1]}" | median; }
printf '%-28s %12s %12s %8s\n' "" single cluster ratio
printf '%-28s %12.0f %12.0f %8.2f\n' "worker drain (copies/s)" "$(m drain-single)" "$(m drain-cluster)" \
	"$(awk -v a="$(m drain-single)" -v b="$(m drain-cluster)" 'BEGIN { print b / a }')"
for c in ${BENCH_CLIENTS:-1 8 32}; do
	printf '%-28s %12.0f %12.0f %8.2f\n' "runner replay, $c clients" "$(m replay-single-$c)" "$(m replay-cluster-$c)" \
		"$(awk -v a="$(m replay-single-$c)" -v b="$(m replay-cluster-$c)" 'BEGIN { print b / a }')"
	printf '%-28s %12.0f %12.0f %8.2f\n' "valkey-benchmark GET, $c" "$(m get-single-$c)" "$(m get-cluster-$c)" \
		"$(awk -v a="$(m get-single-$c)" -v b="$(m get-cluster-$c)" 'BEGIN { print b / a }')"
done
