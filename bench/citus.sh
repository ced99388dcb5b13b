#!/usr/bin/env bash
# bench/citus.sh (also run by make bench after the main table): idem on a
# Citus cluster (a coordinator and two workers on this machine), every
# figure measured through the coordinator, side by side on the same
# cluster, alternating rounds, median kept:
#
#   new keys  run-new-sql-first: the C runner's idem_apply with a SQL
#             handler (one statement, delegated to the tenant's worker)
#             against hand-new: the seed's ledger written by hand, the table
#             distributed by tenant and co-located, INSERT ... ON CONFLICT DO
#             NOTHING, the effect and UPDATE in one PL/pgSQL function
#             distributed by its tenant argument (one call, routed to the
#             worker): target >= 0.90
#   replays   valkey-replay: the runner's replays of completed keys, which
#             the workers copied into the cluster's cache (after a warm-up:
#             the first replay of a key is answered by PostgreSQL and copied)
#             against pg-replay: the same with Valkey down: target >= 2, with
#             >= 90 % of the replays answered by Valkey
#   node changes  a third worker added empty, shards rebalanced onto it,
#             drained and removed: a replay pass after each, >= 90 % from
#             Valkey (BENCH_CITUS_NODES=no skips them)
#
# All three nodes share this machine's cores: the figures show idem against
# the hand-written ledger on one cluster, not how Citus scales out.
#
#   BENCH_SECONDS (5), BENCH_ROUNDS (3), BENCH_CITUS_CLIENTS ("1 8"),
#   BENCH_VKPORT (a Valkey to use; one is started otherwise)
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$ROOT/bench/lib.sh"
. "$ROOT/test/lib/citus.sh"
SECS=${BENCH_SECONDS:-5}
ROUNDS=${BENCH_ROUNDS:-3}
CLIENTS=${BENCH_CITUS_CLIENTS:-1 8}

# Alone (not from bench/run): build and install idem into the private
# PostgreSQL copy first, as bench/run does.
bench_prepare
if ! idem_citus_prepare "$ROOT"; then
	echo "citus bench skipped: $IDEM_CITUS_SKIP"
	exit 0
fi

WORK=$(mktemp -d /tmp/idem-bench-citus.XXXXXX)
chmod 755 "$WORK"
[ "$(id -u)" -ne 0 ] || chown "$(idem_test_user)" "$WORK"
OWN_VK=
cleanup() {
	for n in coord w1 w2 w3; do [ ! -d "$WORK/$n" ] || idem_pg_stop "$WORK/$n"; done
	[ -z "$OWN_VK" ] || idem_valkey_stop "$WORK"
	rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

VKPORT=${BENCH_VKPORT:-}
if [ -z "$VKPORT" ]; then
	VKPORT=$(idem_free_port)
	OWN_VK=1
	idem_valkey_start "$WORK" "$VKPORT" || exit 1
fi

declare -A PORT
start_node() {
	local n=$1
	mkdir -p "$WORK/$n"
	[ "$(id -u)" -ne 0 ] || chown "$(idem_test_user)" "$WORK/$n"
	PORT[$n]=$(idem_free_port)
	idem_pg_start "$WORK/$n" "${PORT[$n]}" "shared_preload_libraries = 'citus,idem'" \
		"max_connections = 200" "shared_buffers = 128MB" "max_prepared_transactions = 100" \
		"citus.shard_count = 8" "idem.valkey_port = $VKPORT" \
		${BENCH_CITUS_DEBUG:+"log_min_duration_statement = 0"}
}
for n in coord w1 w2; do start_node "$n" || exit 1; done
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

-- The effect, co-located with its tenant.
CREATE TABLE transfers (id bigserial, tenant_id bigint NOT NULL REFERENCES tenants (id),
	amount bigint NOT NULL, created_at timestamptz NOT NULL DEFAULT now(),
	PRIMARY KEY (tenant_id, id));
SELECT create_distributed_table('transfers', 'tenant_id', colocate_with => 'tenants');

-- The seed's ledger, written by hand (make bench's variant (3)), distributed
-- the same way as idem's.
CREATE TABLE hand_keys (LIKE idempotency_keys INCLUDING ALL) WITH (fillfactor = 70);
SELECT create_distributed_table('hand_keys', 'tenant_id', colocate_with => 'tenants');
ALTER TABLE hand_keys ADD FOREIGN KEY (tenant_id) REFERENCES tenants (id);
CREATE FUNCTION v3_hand(t bigint, run bigint, amt bigint) RETURNS text
LANGUAGE plpgsql AS \$\$
DECLARE
  k  bytea := idem_key('bench.transfer', run::text);
  fp bytea := idem_fingerprint(jsonb_build_object('amount', amt));
  r  record;
  tid bigint;
BEGIN
  INSERT INTO hand_keys (tenant_id, idempotency_key, request_fingerprint, expires_at)
  VALUES (t, k, fp, now() + interval '30 seconds')
  ON CONFLICT (tenant_id, idempotency_key) DO NOTHING;
  IF NOT FOUND THEN
    SELECT status, outcome INTO r FROM hand_keys
     WHERE tenant_id = t AND idempotency_key = k;
    RETURN r.status;
  END IF;
  INSERT INTO transfers (tenant_id, amount) VALUES (t, amt) RETURNING id INTO tid;
  UPDATE hand_keys
     SET status = 'completed', outcome = jsonb_build_object('transfer_id', tid),
         expires_at = now() + interval '1 day', updated_at = now()
   WHERE tenant_id = t AND idempotency_key = k;
  RETURN 'applied';
END \$\$;
SELECT create_distributed_function('v3_hand(bigint, bigint, bigint)', 't',
	colocate_with => 'tenants');

-- The runner's effect as a SQL handler (idem_apply runs it on the worker).
CREATE FUNCTION bench_transfer(args jsonb) RETURNS jsonb
LANGUAGE plpgsql AS \$\$
DECLARE
  tid bigint;
BEGIN
  INSERT INTO transfers (tenant_id, amount)
  VALUES ((args->>'t')::bigint, (args->>'amount')::bigint) RETURNING id INTO tid;
  RETURN jsonb_build_object('transfer_id', tid);
END \$\$;
SELECT create_distributed_function('bench_transfer(jsonb)');
SQL

# A runner learns the cache keyspace on the coordinator before its first
# run, which joins the workers to the cluster's cache: do that first, so
# that the workers copy the replay keys as they complete them.
for _ in $(seq 1 20); do
	ks=$(psql_on coord -c 'SELECT idem_cache_keyspace()' 2>/dev/null)
	[ -n "$ks" ] && [ "$(psql_on w1 -c 'SELECT idem_cache_keyspace()' 2>/dev/null)" = "$ks" ] &&
		[ "$(psql_on w2 -c 'SELECT idem_cache_keyspace()' 2>/dev/null)" = "$ks" ] && break
	sleep 1
done
[ -n "$ks" ] || { echo "citus bench: the coordinator names no cache keyspace" >&2; exit 1; }

# The replay keys client_bench expects (bench/setup.sql's), completed
# through the coordinator, each call delegated to its tenant's worker.
seq 1 10000 | awk '{ printf "BEGIN; SELECT idem_claim(%d, idem_key('"'"'bench.replay'"'"', '"'"'%d'"'"'), idem_fingerprint('"'"'{\"amount\": 1}'"'"')); SELECT idem_complete(%d, idem_key('"'"'bench.replay'"'"', '"'"'%d'"'"'), jsonb_build_object('"'"'transfer_id'"'"', %d)); COMMIT;\n", 1 + $1 % 100, $1, 1 + $1 % 100, $1, $1 }' \
	>"$WORK/fill.sql"
chmod a+r "$WORK/fill.sql"
split -n l/4 -d "$WORK/fill.sql" "$WORK/fill.part."
chmod a+r "$WORK"/fill.part.*
for f in "$WORK"/fill.part.*; do psql_on coord -f "$f" >/dev/null & done
fill_ok=1
for _ in 1 2 3 4; do wait -n || fill_ok=; done
[ -n "$fill_ok" ] || { echo "citus bench: filling the replay keys failed" >&2; exit 1; }
psql_on coord -c 'VACUUM ANALYZE' >/dev/null

BIN=$WORK/client_bench
[ -f "$ROOT/client/build/libidemclient.a" ] || make -s -C "$ROOT/client" >/dev/null || exit 1
bench_client_bench "$BIN" || exit 1
PG="host=127.0.0.1 port=${PORT[coord]} user=postgres dbname=postgres"
bench() { idem_as_test_user "$BIN" "$1" "$2" "$3" "$PG" 127.0.0.1 "$VKPORT"; }

# Warm-up: replays until Valkey answers at least 95 % of them (each key's
# first replay is answered by PostgreSQL, and the worker copies it).
for _ in $(seq 1 "${BENCH_CITUS_WARMUPS:-10}"); do
	out=$(bench valkey-replay 8 "$SECS") || { echo "citus bench: warm-up failed" >&2; exit 1; }
	share=$(echo "$out" | awk '$1 == "valkey" { print ($4 > 0 ? $5 / $4 : 0) }')
	echo "warm-up: $(awk -v s="$share" 'BEGIN { printf "%.1f", 100 * s }') % of replays from Valkey, $("$(idem_valkey_cli)" -p "$VKPORT" dbsize) keys in Valkey"
	if [ -n "${BENCH_CITUS_DEBUG:-}" ]; then
		psql_on coord -c 'SELECT idem_cache_keyspace()'
		grep -h "idem" "$WORK"/*/pg.log | tail -n 20
	fi
	awk -v s="$share" 'BEGIN { exit !(s >= 0.95) }' && break
done

if [ -n "${BENCH_CITUS_HOLD:-}" ]; then
	echo "holding: coordinator ${PORT[coord]}, workers ${PORT[w1]} ${PORT[w2]}, Valkey $VKPORT, work $WORK"
	sleep "$BENCH_CITUS_HOLD"
fi
echo "Through the coordinator of a Citus cluster (coordinator + 2 workers, one machine),"
echo "client_bench, ${SECS} s per run, median of $ROUNDS alternating rounds."
MODES="run-new-sql-first hand-new valkey-replay pg-replay"
printf '%-18s %7s %10s %10s\n' mode clients ops/s from-valkey
for c in $CLIENTS; do
	declare -A runs=() vk=()
	for r in $(seq 1 "$ROUNDS"); do
		for m in $MODES; do
			out=$(bench "$m" "$c" "$SECS") || { echo "client_bench $m failed" >&2; exit 1; }
			runs[$m]+="$(echo "$out" | awk -v m="$m" '$1 == m { print $3 }') "
			vk[$m]+="$(echo "$out" | awk '$1 == "valkey" { print ($4 > 0 ? $5 / $4 : 0) }') "
		done
	done
	declare -A med=() vmed=()
	for m in $MODES; do
		med[$m]=$(echo "${runs[$m]}" | median)
		vmed[$m]=$(echo "${vk[$m]}" | median)
		printf '%-18s %7s %10.0f %10s\n' "$m" "$c" "${med[$m]}" \
			"$([ -n "${vmed[$m]}" ] && awk -v s="${vmed[$m]}" 'BEGIN { printf "%.1f %%", 100 * s }')"
	done
	awk -v c="$c" -v n="${med[run-new-sql-first]}" -v h="${med[hand-new]}" \
		-v v="${med[valkey-replay]}" -v p="${med[pg-replay]}" -v s="${vmed[valkey-replay]}" 'BEGIN {
		printf "%-18s %7s  targets: new keys idem/hand-written %.2f (>= 0.90); replays Valkey/PostgreSQL %.2f (>= 2), %.1f %% from Valkey (>= 90)\n",
			"", c, n / h, v / p, 100 * s }'
	unset runs vk med vmed
done

# Node changes (BENCH_CITUS_NODES=no skips them): a third worker added
# empty, the shards rebalanced onto it, then drained off it and the node
# removed; after each, one replay pass of BENCH_SECONDS at 8 clients, and
# the share of replays Valkey answered (target >= 90 %: a node that holds
# nothing it lost keeps the cache warm).
if [ "${BENCH_CITUS_NODES:-yes}" != no ]; then
	start_node w3 || exit 1
	psql_on w3 -c 'CREATE EXTENSION citus' >/dev/null || exit 1
	echo "Node changes: replays from Valkey after each, valkey-replay, 8 clients, ${SECS} s"
	printf '%-34s %10s %10s\n' change ops/s from-valkey
	node_change() {
		local what=$1 sql=$2 out
		psql_on coord <<<"$sql" >/dev/null || { echo "citus bench: $what failed" >&2; exit 1; }
		out=$(bench valkey-replay 8 "$SECS") || { echo "client_bench valkey-replay failed" >&2; exit 1; }
		printf '%-34s %10.0f %10s\n' "$what" \
			"$(echo "$out" | awk '$1 == "valkey-replay" { print $3 }')" \
			"$(echo "$out" | awk '$1 == "valkey" { printf "%.1f %%", ($4 > 0 ? 100 * $5 / $4 : 0) }')"
	}
	node_change "citus_add_node (empty worker)" "SELECT citus_add_node('127.0.0.1', ${PORT[w3]})"
	node_change "rebalance onto it (block_writes)" \
		"SELECT rebalance_table_shards(shard_transfer_mode => 'block_writes')"
	node_change "drained and removed" \
		"SELECT citus_drain_node('127.0.0.1', ${PORT[w3]}, shard_transfer_mode => 'block_writes'); SELECT citus_remove_node('127.0.0.1', ${PORT[w3]})"
fi
