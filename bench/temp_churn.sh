#!/usr/bin/env bash
# bench/temp_churn.sh: claim+complete throughput with and without another
# session creating and dropping temporary tables in a loop.
#
# Every temporary table creates a row type, and every backend hears of it
# (a pg_type invalidation).  The direct row write (src/ledger_insert.c)
# keeps the ledger's prepared defaults and checks until a function or type
# *they use* changes, so this churn should cost the writers next to
# nothing; before that narrowing, every such invalidation threw the
# prepared state away and the next write rebuilt it.
#
# Run by `make bench` (bench/run passes its server in BENCH_WORK,
# BENCH_PGPORT, BENCH_VKPORT), or alone: it then starts its own throwaway
# PostgreSQL (preloading idem), and stops it at the end.  Rounds alternate
# quiet and churning runs; the medians and their ratio are printed.
#
#   BENCH_CHURN_SECONDS   seconds per run       (default 5)
#   BENCH_CHURN_ROUNDS    alternating rounds    (default 3)
#   BENCH_CHURN_CLIENTS   claim+complete clients (default 2)
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$ROOT/bench/lib.sh"
SECS=${BENCH_CHURN_SECONDS:-5}
ROUNDS=${BENCH_CHURN_ROUNDS:-3}
CLIENTS=${BENCH_CHURN_CLIENTS:-2}

bench_server churn --no-valkey "max_connections = 50" "idem.valkey_port = 1"

mkdir -p "$WORK/churn"
cat >"$WORK/churn/idem.sql" <<'EOF2'
\set run random(1, 9000000000000000000)
BEGIN;
SELECT decision FROM idem_claim(1, idem_key('churn', :run::text), '\x0000000000000000000000000000000000000000000000000000000000000000');
SELECT idem_complete(1, idem_key('churn', :run::text), '{"ok": true}');
COMMIT;
EOF2
cat >"$WORK/churn/temp.sql" <<'EOF2'
CREATE TEMP TABLE churn_t (a int, b text);
DROP TABLE churn_t;
EOF2
chmod -R a+rX "$WORK/churn"

pgb() {
	idem_as_test_user env PGOPTIONS="-c synchronous_commit=off" \
		"$(idem_pg_bindir)/pgbench" -n -h "$WORK" -p "$PGPORT" -U postgres "$@" postgres 2>&1
}
tps() { sed -nE 's/^tps = ([0-9.]+) \(without initial connection time\)/\1/p'; }

quiet="" churning="" churn_tps=""
for r in $(seq 1 "$ROUNDS"); do
	quiet+="$(pgb -M prepared -c "$CLIENTS" -j "$CLIENTS" -T "$SECS" -f "$WORK/churn/idem.sql" | tps) "
	pgb -c 1 -T $((SECS + 1)) -f "$WORK/churn/temp.sql" >"$WORK/churn/temp.out" &
	churner=$!
	sleep 0.5
	churning+="$(pgb -M prepared -c "$CLIENTS" -j "$CLIENTS" -T "$SECS" -f "$WORK/churn/idem.sql" | tps) "
	wait "$churner"
	churn_tps+="$(tps <"$WORK/churn/temp.out") "
done
q=$(echo "$quiet" | median)
c=$(echo "$churning" | median)
t=$(echo "$churn_tps" | median)
printf 'claim+complete, %s clients, synchronous_commit=off, median of %s x %ss runs:\n' "$CLIENTS" "$ROUNDS" "$SECS"
printf '  quiet                                        %10.0f tps\n' "$q"
printf '  beside a session creating temp tables (%5.0f/s) %7.0f tps\n' "$t" "$c"
awk -v q="$q" -v c="$c" 'BEGIN { printf "  ratio churning / quiet                       %10.2f\n", c / q }'
