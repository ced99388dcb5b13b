#!/usr/bin/env bash
# Part of make bench (called by bench/run with BENCH_WORK, BENCH_PGPORT,
# BENCH_VKPORT set; alone: BENCH_TABLE=no BENCH_EXTRAS=python make bench):
# the Python runner (client/python, Debian's psycopg 3 and redis-py) next to
# what it is built on, in the same process model (one process per client,
# synchronous calls), alternating rounds, median kept
# (bench/python_bench.py says what each mode does):
#   replays: the runner answered by Valkey against a redis-py GET of the
#   same value, and the runner's PostgreSQL replay (Valkey down) against a
#   prepared psycopg SELECT of the same row;
#   new keys: the runner (also flagged first deliveries, and with the effect
#   as a SQL handler) against the same handler written by hand with psycopg
#   on the seed's table.
# Each client count ends with the ratios of ops/s, and of the clients' CPU
# per operation against the targets (replay <= 1.5x the GET, first
# delivery <= 1.3x and gated run <= 1.5x the hand-written transaction).
# Prints the load average before and after: the machine may be shared.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$ROOT/bench/lib.sh"
SECS=${BENCH_SECONDS:-5}
ROUNDS=${BENCH_ROUNDS:-3}
PY=${BENCH_PYTHON:-/usr/bin/python3}
# synchronous_commit=off, as the pgbench variants run at their headline figure.
PG="host=$BENCH_WORK port=$BENCH_PGPORT user=postgres dbname=postgres options=-csynchronous_commit=off"
export PYTHONPATH=$ROOT/client/python${PYTHONPATH:+:$PYTHONPATH}
BENCH=$ROOT/bench/python_bench.py

"$PY" -c 'import psycopg, redis' 2>/dev/null ||
	{ echo "python.sh: needs python3-psycopg and python3-redis (make test installs them)" >&2; exit 1; }

echo "load average at the start: $(cut -d' ' -f1-3 /proc/loadavg)"
"$PY" "$BENCH" fill "$PG" "$BENCH_VKPORT" || { echo "python_bench fill failed" >&2; exit 1; }
MODES=${BENCH_PYTHON_MODES:-valkey-replay raw-get pg-replay pg-select run-new run-new-first apply-new hand-new}
printf '%-15s %7s %10s %14s\n' mode clients ops/s "client CPU us"
for c in ${BENCH_CLIENTS:-1 8}; do
	declare -A runs=() cpus=() med=() medc=()
	for r in $(seq 1 "$ROUNDS"); do
		for m in $MODES; do
			out=$("$PY" "$BENCH" "$m" "$c" "$SECS" "$PG" "$BENCH_VKPORT") ||
				{ echo "python_bench $m failed" >&2; exit 1; }
			runs[$m]+="$(echo "$out" | awk -v m="$m" '$1 == m { print $3 }') "
			cpus[$m]+="$(echo "$out" | awk '$1 == "cpu" { print $4 }') "
		done
	done
	for m in $MODES; do
		med[$m]=$(echo "${runs[$m]}" | median)
		medc[$m]=$(echo "${cpus[$m]}" | median)
		printf '%-15s %7s %10.0f %14.1f\n' "$m" "$c" "${med[$m]}" "${medc[$m]}"
	done
	# the targets are on the clients' CPU per operation, measured in the
	# same rounds: lower is better
	awk -v c="$c" -v vr="${medc[valkey-replay]:-0}" -v rg="${medc[raw-get]:-0}" \
		-v rf="${medc[run-new-first]:-0}" -v rn="${medc[run-new]:-0}" \
		-v hn="${medc[hand-new]:-0}" 'BEGIN {
		printf "%-15s %7s  client CPU per op: valkey replay/redis-py GET %.2f (<= 1.50), first delivery/hand-written %.2f (<= 1.30), gated/hand-written %.2f (<= 1.50)\n",
			"", c, rg ? vr / rg : 0, hn ? rf / hn : 0, hn ? rn / hn : 0 }'
	awk -v c="$c" -v vr="${med[valkey-replay]:-0}" -v rg="${med[raw-get]:-1}" \
		-v pr="${med[pg-replay]:-0}" -v ps="${med[pg-select]:-1}" \
		-v rn="${med[run-new]:-0}" -v rf="${med[run-new-first]:-0}" \
		-v an="${med[apply-new]:-0}" -v hn="${med[hand-new]:-1}" 'BEGIN {
		printf "%-15s %7s  ratios: valkey replay/redis-py GET %.2f, valkey replay/pg replay %.2f, pg replay/psycopg SELECT %.2f; new keys/hand-written: runner %.2f, first deliveries %.2f, sql handler %.2f\n",
			"", c, vr / rg, vr / (pr ? pr : 1), pr / ps, rn / hn, rf / hn, an / hn }'
	unset runs cpus med medc
done
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
