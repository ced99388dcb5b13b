#!/usr/bin/env bash
# Part of make bench (called by bench/run with BENCH_WORK, BENCH_PGPORT,
# BENCH_VKPORT set): the client runner's paths next to what they are built
# on, same process model and concurrency, alternating rounds, median kept.
#
#   BENCH_CLIENT_BASE=<commit>   also the library at <commit> (built in a
#                                temporary git worktree) against the same
#                                server, in the same rounds: each runner
#                                mode again as base:MODE, and new/base ratios
#   BENCH_CLIENT_MODES           the modes (default all below)
#   BENCH_CLIENT_COST=1          also the system calls and instructions of
#                                one replay from Valkey (strace, callgrind;
#                                the base's too)
#   BENCH_CLIENT_COST_DIR=<dir>  keep the callgrind files there
#                                (callgrind_annotate them)
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$ROOT/bench/lib.sh"
SECS=${BENCH_SECONDS:-5}
ROUNDS=${BENCH_ROUNDS:-3}
BIN=$BENCH_WORK/client_bench
bench_client_bench "$BIN" || exit 1
# synchronous_commit=off, as the pgbench variants run at their headline figure.
PG="host=$BENCH_WORK port=$BENCH_PGPORT user=postgres dbname=postgres options=-csynchronous_commit=off"

# the idem2 copies of the replay keys, as the worker writes them (where absent)
"$BIN" fill-cache 1 0 "$PG" 127.0.0.1 "$BENCH_VKPORT" >/dev/null || { echo "client_bench fill-cache failed" >&2; exit 1; }
printf '%-15s %7s %10s %14s\n' mode clients ops/s "client CPU us"
declare -A med=() cmed=()
MODES=${BENCH_CLIENT_MODES:-valkey-replay valkey-replay-redelivery raw-get pg-replay pg-select run-new run-dup}
BASE=""
if [ -n "${BENCH_CLIENT_BASE:-}" ]; then
	bench_base_tree "$BENCH_CLIENT_BASE" client
	bench_client_bench "$BIN-base" "$SRC" || exit 1
	for m in $MODES; do
		case $m in raw-get|pg-select) ;; *) MODES="$MODES base:$m" ;; esac
	done
fi
for c in ${BENCH_CLIENTS:-1 8 32}; do
	declare -A runs=() cpus=()
	for r in $(seq 1 "$ROUNDS"); do
		for m in $MODES; do
			bin=$BIN mode=$m
			if [[ $m == base:* ]]; then bin=$BIN-base mode=${m#base:}; fi
			out=$("$bin" "$mode" "$c" "$SECS" "$PG" 127.0.0.1 "$BENCH_VKPORT") || { echo "client_bench $m failed" >&2; exit 1; }
			runs[$m]+="$(echo "$out" | awk -v m="$mode" '$1 == m { print $3 }') "
			cpus[$m]+="$(echo "$out" | awk '$1 == "cpu" { print $4 }') "
		done
	done
	# ops/s, and the clients' own CPU per operation (user + system: less
	# sensitive to other load on the machine than the rate)
	for m in $MODES; do
		med[$m]=$(echo "${runs[$m]}" | median)
		cmed[$m]=$(echo "${cpus[$m]}" | median)
		printf '%-15s %7s %10.0f %14.2f\n' "$m" "$c" "${med[$m]}" "${cmed[$m]}"
	done
	for m in $MODES; do
		[[ $m == base:* ]] || continue
		awk -v c="$c" -v m="${m#base:}" -v n="${med[${m#base:}]}" -v b="${med[$m]}" \
			'BEGIN { printf "%-15s %7s  new/base (%s): %.2f\n", m, c, "'"$BASE"'", n / b }'
	done
	[ -n "${med[valkey-replay]:-}" ] && [ -n "${med[raw-get]:-}" ] &&
	awk -v c="$c" -v vr="${med[valkey-replay]}" -v rg="${med[raw-get]}" \
		-v vd="${med[valkey-replay-redelivery]:-0}" \
		-v pr="${med[pg-replay]:-0}" -v ps="${med[pg-select]:-1}" 'BEGIN {
		printf "%-15s %7s  targets: valkey replay (MAC verified)/raw GET %.2f, as a redelivery %.2f (>= 0.90); client pg replay/bare SELECT %.2f\n",
			"", c, vr / rg, vd / rg, pr / ps }'
	unset runs cpus
done

# BENCH_CLIENT_COST=1: what one replay from Valkey costs the client, steadier
# than a rate on a shared machine: system calls (strace -c) and user-space
# instructions (callgrind) per operation of valkey-replay with one client,
# the difference between a 1 s and a 3 s run (connects and exit cancel).
cost() {
	local bin=$1 what=$2 secs ops1 ops3 c1 c3 i1 i3
	declare -A calls=()
	for secs in 1 3; do
		local out
		out=$(strace -f -c -o "$BENCH_WORK/strace.$secs" "$bin" valkey-replay 1 "$secs" "$PG" 127.0.0.1 "$BENCH_VKPORT") || return 1
		calls[ops$secs]=$(echo "$out" | tail -1 | awk -v s="$secs" '{ print $3 * s }')
		for sc in total sendto recvfrom poll setsockopt; do
			calls[$sc$secs]=$(awk -v sc="$sc" '$NF == sc { print $4; exit }' "$BENCH_WORK/strace.$secs")
		done
	done
	for secs in 1 3; do
		rm -f "$BENCH_WORK"/cg.*
		valgrind --tool=callgrind --trace-children=yes --callgrind-out-file="$BENCH_WORK/cg.%p" \
			"$bin" valkey-replay 1 "$secs" "$PG" 127.0.0.1 "$BENCH_VKPORT" >"$BENCH_WORK/cg.out" 2>/dev/null || return 1
		calls[vops$secs]=$(tail -1 "$BENCH_WORK/cg.out" | awk -v s="$secs" '{ print $3 * s }')
		calls[ir$secs]=$(cat "$BENCH_WORK"/cg.[0-9]* | awk '/^summary:/ { t += $2 } END { print t }')
		if [ -n "${BENCH_CLIENT_COST_DIR:-}" ]; then
			mkdir -p "$BENCH_CLIENT_COST_DIR" &&
			for f in "$BENCH_WORK"/cg.[0-9]*; do
				cp "$f" "$BENCH_CLIENT_COST_DIR/callgrind.${what%% *}.${secs}s.${f##*.}"
			done
		fi
	done
	awk -v w="$what" -v o1="${calls[ops1]}" -v o3="${calls[ops3]}" \
		-v t1="${calls[total1]:-0}" -v t3="${calls[total3]:-0}" \
		-v s1="${calls[sendto1]:-0}" -v s3="${calls[sendto3]:-0}" \
		-v r1="${calls[recvfrom1]:-0}" -v r3="${calls[recvfrom3]:-0}" \
		-v p1="${calls[poll1]:-0}" -v p3="${calls[poll3]:-0}" \
		-v k1="${calls[setsockopt1]:-0}" -v k3="${calls[setsockopt3]:-0}" \
		-v v1="${calls[vops1]}" -v v3="${calls[vops3]}" -v i1="${calls[ir1]}" -v i3="${calls[ir3]}" 'BEGIN {
		d = o3 - o1; v = v3 - v1
		printf "%-28s system calls per replay %.2f (sendto %.2f, recvfrom %.2f, poll %.2f, setsockopt %.2f); instructions per replay %.0f\n",
			w, (t3 - t1) / d, (s3 - s1) / d, (r3 - r1) / d, (p3 - p1) / d, (k3 - k1) / d, (v > 0 ? (i3 - i1) / v : 0) }'
}
if [ -n "${BENCH_CLIENT_COST:-}" ]; then
	echo
	cost "$BIN" "this tree" || echo "client.sh: the cost run failed" >&2
	[ -z "$BASE" ] || cost "$BIN-base" "base ($BASE)" || echo "client.sh: the base's cost run failed" >&2
fi
