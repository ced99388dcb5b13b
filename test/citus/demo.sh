#!/usr/bin/env bash
# test/citus/demo.sh: the main job (client/demo, unchanged C runner) against
# a Citus coordinator with two workers, all preloading citus and idem, each
# idem worker copying into the cache Valkey and each node's publisher
# sending stage two's notifications (emitted on the tenant's worker) to the
# broker.  idem-demo distributes its tables itself when it finds Citus.
# Besides the demo's own chaos (worker processes killed, coordinator
# backends terminated, the cache restarted and flushed), this script terminates the worker nodes' backends that serve the
# coordinator, and moves a shard between the workers mid-run.
#
#   bash test/citus/demo.sh [idem-demo options, e.g. --short]
#
# Needs the extension and Citus installed in the PostgreSQL that
# idem_pg_bindir names (make test does that); run as the test user or root.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
. "$ROOT/test/lib/common.sh"

PGC=$(idem_pg_config)
[ -f "$("$PGC" --pkglibdir)/citus.so" ] || { echo "idem: Citus is not installed in $("$PGC" --pkglibdir)" >&2; exit 2; }
[ -f "$ROOT/client/build/libidemclient.a" ] || make -C "$ROOT/client" -s PG_CONFIG="$PGC" build/libidemclient.a || exit 2
make -C "$ROOT/client/demo" -s PG_CONFIG="$PGC" >/dev/null || exit 2

WORK=$(mktemp -d /tmp/idem-citus-demo.XXXXXX)
chmod 755 "$WORK"
[ "$(id -u)" -ne 0 ] || chown "$(idem_test_user)" "$WORK"
BG=()
status=1
cleanup() {
	for p in "${BG[@]}"; do kill "$p" 2>/dev/null; done
	for n in coord w1 w2; do idem_pg_stop "$WORK/$n"; done
	idem_valkey_stop "$WORK/cache"
	idem_valkey_stop "$WORK/broker"
	if [ "$status" -ne 0 ]; then
		for n in coord w1 w2; do
			echo "--- $n log (last lines) ---" >&2
			grep -v 'terminating connection due to administrator command' "$WORK/$n/pg.log" 2>/dev/null | tail -n 15 >&2
		done
		[ -f "$WORK/chaos.log" ] && { echo "--- chaos ---" >&2; tail -n 20 "$WORK/chaos.log" "$WORK/move.log" >&2; }
	fi
	[ -n "${IDEM_DEMO_KEEP:-}" ] && echo "idem: kept $WORK" >&2 || rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mkdir -p "$WORK/cache" "$WORK/broker"
CACHE_PORT=$(idem_free_port)
BROKER_PORT=$(idem_free_port)
idem_valkey_start "$WORK/cache" "$CACHE_PORT" || exit 2
idem_valkey_start "$WORK/broker" "$BROKER_PORT" || exit 2
cat >"$WORK/restart-cache.sh" <<EOT
. "$ROOT/test/lib/common.sh"
idem_valkey_restart "$WORK/cache" $CACHE_PORT >/dev/null
EOT

declare -A PORT
for n in coord w1 w2; do
	mkdir -p "$WORK/$n"
	[ "$(id -u)" -ne 0 ] || chown "$(idem_test_user)" "$WORK/$n"
	PORT[$n]=$(idem_free_port)
	idem_pg_start "$WORK/$n" "${PORT[$n]}" \
		"shared_preload_libraries = 'citus,idem'" "max_connections = 200" \
		"max_prepared_transactions = 200" "wal_level = logical" \
		"max_wal_senders = 20" "max_replication_slots = 20" "citus.shard_count = 8" \
		"citus.node_conninfo = 'sslmode=disable'" "idem.min_retention = 0" \
		"idem.valkey_host = '127.0.0.1'" "idem.valkey_port = $CACHE_PORT" \
		"idem.outbox_valkey_host = '127.0.0.1'" "idem.outbox_valkey_port = $BROKER_PORT" || exit 2
done
psql_on() { local n=$1; shift; "$(idem_pg_bindir)/psql" -X -At -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "${PORT[$n]}" -U postgres -d postgres "$@"; }
for n in coord w1 w2; do psql_on "$n" -c 'CREATE EXTENSION citus' >/dev/null || exit 2; done
psql_on coord -c "SELECT citus_set_coordinator_host('127.0.0.1', ${PORT[coord]})" \
	-c "SELECT citus_add_node('127.0.0.1', ${PORT[w1]})" \
	-c "SELECT citus_add_node('127.0.0.1', ${PORT[w2]})" >/dev/null || exit 2

# Chaos on the workers, once the demo's setup is done (it prints its
# banner; the setup's own claims are not the run's): terminate a worker
# backend in the middle of a handler (one that holds an idem key lock),
# about twice a second, and, a second in, move the shard of tenant 1
# to the other worker while the terminations go on.
wait_banner() {
	until grep -q '^idem demo:' "$WORK/demo.out" 2>/dev/null; do sleep 0.2; done
}
(
	wait_banner
	killed=0
	while ! grep -q '^Report' "$WORK/demo.out" 2>/dev/null; do
		n=w$((RANDOM % 2 + 1))
		k=$(psql_on "$n" -c "SELECT count(pg_terminate_backend(pid)) FROM (SELECT DISTINCT pid FROM pg_locks
			WHERE locktype = 'advisory' AND objsubid = 478 AND granted ORDER BY 1 LIMIT 1) s" 2>/dev/null)
		if [ "${k:-0}" -gt 0 ]; then
			killed=$((killed + k))
			echo "terminated a backend on $n (total $killed)"
			sleep 0.$((RANDOM % 5 + 3))
		else
			sleep 0.05
		fi
	done
) >"$WORK/chaos.log" 2>&1 &
BG+=($!)
# The move, as an operator would make it: Citus may cancel it (its
# distributed deadlock detection picks the move as the victim when it
# waits on the handlers' transactions, more often on a loaded machine), and
# then it is tried again, up to five times while the run goes on.
(
	wait_banner
	sleep 1
	moved=""
	for try in 1 2 3 4 5; do
		grep -q '^Report' "$WORK/demo.out" && break
		if psql_on coord -c "SELECT citus_move_shard_placement(s, '127.0.0.1', f.nodeport, '127.0.0.1', t.nodeport)
			FROM (SELECT get_shard_id_for_distribution_column('public.tenants', 1::bigint) s) x,
			LATERAL (SELECT nodeport FROM pg_dist_placement JOIN pg_dist_node USING (groupid) WHERE shardid = s) f,
			LATERAL (SELECT nodeport FROM pg_dist_node WHERE noderole = 'primary' AND groupid > 0 AND nodeport <> f.nodeport) t"; then
			moved=yes
			break
		fi
		echo "shard move attempt $try failed; trying again"
		sleep 1
	done
	if [ -z "$moved" ]; then
		echo "shard move failed"
	elif grep -q '^Report' "$WORK/demo.out"; then
		echo "moved the shard of tenant 1, but only after the run"
	else
		echo "moved the shard of tenant 1 mid-run"
	fi
) >"$WORK/move.log" 2>&1 &
MOVER=$!
BG+=($MOVER)

# --batch 1: one message per transaction, through idem_claim / idem_complete
# (the batch API is refused on Citus: a batch's tenants span workers).
"$ROOT/client/demo/build/idem-demo" --batch 1 \
	--pg "host=127.0.0.1 port=${PORT[coord]} user=postgres dbname=postgres" \
	--valkey "127.0.0.1:$CACHE_PORT" --broker "127.0.0.1:$BROKER_PORT" \
	--notice-valkey "127.0.0.1:$BROKER_PORT" \
	--cache-restart-cmd "bash '$WORK/restart-cache.sh'" "$@" | tee "$WORK/demo.out"
status=${PIPESTATUS[0]}
wait "$MOVER"
cat "$WORK/move.log"
killed=$(grep -c '^terminated' "$WORK/chaos.log")
echo "worker backends terminated mid-handler: $killed"
if ! grep -q "^moved the shard of tenant 1 mid-run" "$WORK/move.log"; then
	echo "idem: the shard move did not happen during the run" >&2
	status=1
fi
if [ "$killed" -eq 0 ]; then
	echo "idem: no worker backend was terminated in the middle of a handler" >&2
	status=1
fi
exit $status
