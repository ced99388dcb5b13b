#!/usr/bin/env bash
# bench/commit_latency.sh: how fast committed results reach Valkey.
#
#   1. commit -> visible in Valkey latency (p50/p99) while pgbench offers a
#      sustained rate of claim+complete transactions, at each of a list of
#      rates: from idem_complete() and from the commit's acknowledgement,
#      the worker's and Valkey's CPU per copy, and the commit latency of
#      that run next to the same run with the worker copying nothing;
#   2. the worker's drain rate (SETs/s) emptying a full queue, next to the
#      same server's raw pipelined SET rate (valkey-benchmark -P 16),
#      in the same run.
#
# Run by `make bench` (bench/run passes its server in BENCH_WORK,
# BENCH_PGPORT, BENCH_VKPORT), or alone: it then starts its own throwaway
# PostgreSQL (preloading idem) and RESP server, and stops them at the end.
# Not a timed test.
#
#   BENCH_RATE              offered commits/s, a list    (default "1000 2000 3000 5000")
#   BENCH_LATENCY_SECONDS   length of each latency run   (default 10)
#   BENCH_LATENCY_CLIENTS   pgbench clients              (default 8)
#   BENCH_DRAIN_N           results queued for the drain (default 50000)
#   BENCH_SYNC_COMMIT       synchronous_commit of the load (default on)
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$ROOT/bench/lib.sh"

bench_server latency "max_connections = 100" "shared_buffers = 256MB"

BENCHMARK=$(dirname "$(idem_valkey_server)")/valkey-benchmark
[ -x "$BENCHMARK" ] || BENCHMARK=$(command -v valkey-benchmark)

cp "$ROOT/bench/commit_latency.pl" "$WORK/commit_latency.pl"
cp "$ROOT/test/t/IdemResp.pm" "$WORK/IdemResp.pm"
cp "$ROOT/bench/drain.sql" "$WORK/drain.sql"
chmod a+r "$WORK/commit_latency.pl" "$WORK/IdemResp.pm" "$WORK/drain.sql"
idem_as_test_user env PATH="$(idem_pg_bindir):$PATH" perl "$WORK/commit_latency.pl" \
	--dir "$WORK" --pgport "$PGPORT" --vkport "$VKPORT" --benchmark "$BENCHMARK" --server "$(idem_valkey_version)" \
	--rate "${BENCH_RATE:-1000 2000 3000 5000}" --seconds "${BENCH_LATENCY_SECONDS:-10}" \
	--clients "${BENCH_LATENCY_CLIENTS:-8}" --drain "${BENCH_DRAIN_N:-50000}" \
	--sync "${BENCH_SYNC_COMMIT:-on}"
