#!/usr/bin/env bash
# Part of make bench (called by bench/run with BENCH_WORK, BENCH_PGPORT,
# BENCH_VKPORT set): the C runner on new keys and on half duplicates next
# to the hand-written ledger of variant (3) (v3_hand() as a prepared call,
# one round trip), in the same process model (one process per client),
# alternating rounds, median kept, for each synchronous_commit value.
#
#   BENCH_RUNNER_BASE=<commit>   also the runner of the library at <commit>
#                                (built in a temporary git worktree), for a
#                                before/after in the same run: every mode
#                                of BENCH_RUNNER_MODES again as base:MODE
#                                (only run-new and run-dup if that library
#                                lacks the options the others use)
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$ROOT/bench/lib.sh"
SECS=${BENCH_SECONDS:-5}
ROUNDS=${BENCH_ROUNDS:-3}
CLIENTS=${BENCH_CLIENTS:-1 8 32}
SYNCS=${BENCH_SYNC:-off on}
BIN=$BENCH_WORK/runner_bench
PSQL=$(command -v psql || echo "$(pg_config --bindir)/psql")
bench_client_bench "$BIN" || exit 1
# BENCH_RUNNER_MODES: which columns (client_bench modes; hand-new and
# hand-dup are always run, as the references of new-key and duplicate
# modes, and hand-late with any -late mode).  A -dup mode runs every key
# twice in a row; a -late mode redelivers every other run a key acknowledged
# BENCH_REDELIVERY_MS (default 500) before, as a queue's redelivery comes.
# c-ledger-new and c-ledger-dup are (3)'s ledger written in C around a C
# handler, in the two round trips a C handler needs: with them, each
# C-handler column (run-*, not -sql) also shows its ratio to them as
# [C 0.95].
# MODE@DELAY (say run-new-sql-first@2ms) runs MODE with the server's
# idem.valkey_batch_delay set to DELAY (ALTER SYSTEM and a reload before
# the mode's rounds; the other modes run with the server's default), so
# that delays are compared side by side in one run.
RMODES=${BENCH_RUNNER_MODES:-run-new run-new-first run-new-pipe run-new-pipe-first run-new-sql run-new-sql-first run-dup run-dup-pipe run-dup-sql run-late run-late-first run-late-sql-first}
MODES="hand-new hand-dup"
[[ " $RMODES" == *-late* ]] && MODES="$MODES hand-late"
MODES="$MODES $RMODES"
BASE=""
if [ -n "${BENCH_RUNNER_BASE:-}" ]; then
	bench_base_tree "$BENCH_RUNNER_BASE" runner
	# A base whose library has every option the modes use runs each mode
	# asked for; an older one (built with -DBENCH_BASELINE) run-new and
	# run-dup only.
	if bench_client_bench "$BIN-base" "$SRC" 2>/dev/null; then
		for m in $RMODES; do MODES="$MODES base:$m"; done
	else
		bench_client_bench "$BIN-base" "$SRC" -DBENCH_BASELINE || exit 1
		MODES="$MODES base:run-new base:run-dup"
	fi
fi

# CPU ticks of a process: its own (utime, stime) and those of the children
# it has reaped (cutime, cstime): the postmaster reaps the clients'
# backends, this shell the client processes.  The comm field has no spaces.
ticks() { awk '{print $14 + $15 + $16 + $17}' "/proc/$1/stat" 2>/dev/null || echo 0; }
HZ=$(getconf CLK_TCK)
PM=$(head -1 "$BENCH_WORK/pg/postmaster.pid" 2>/dev/null)
VK=$(cat "$BENCH_WORK/valkey.pid" 2>/dev/null)
# The idem workers (they copy each committed result to Valkey) live as long
# as the server: the postmaster has not reaped them, so their CPU is read
# from their own stat, around each round (a worker that exits within the
# round counts in the postmaster's reaped share instead).
workers() { for p in $(pgrep -P "$PM" 2>/dev/null); do
	tr '\0' ' ' 2>/dev/null <"/proc/$p/cmdline" | grep -q 'idem.*worker' && echo "$p"; done; }
wticks() { local p t=0; for p in $1; do t=$(( t + $(ticks "$p") )); done; echo "$t"; }

# Statements of the bench's own (psql -c ...), as postgres; exits on failure.
DB="host=$BENCH_WORK port=$BENCH_PGPORT user=postgres dbname=postgres"
admin() { "$PSQL" -Xq "$DB" "$@" >/dev/null || exit 1; }

# The server's idem.valkey_batch_delay for the next mode: DELAY, or its
# default when empty.  Set only when it changes; the worker re-reads its
# settings on the reload's signal.
cur_delay=""
set_delay() {
	[ "$1" = "$cur_delay" ] && return 0
	local q="ALTER SYSTEM RESET idem.valkey_batch_delay"
	[ -z "$1" ] || q="ALTER SYSTEM SET idem.valkey_batch_delay = '$1'"
	admin -c "$q" -c "SELECT pg_reload_conf()"
	sleep 0.3
	cur_delay=$1
}

# Every mode's round starts from the same tables: the ledgers and the
# effect's table emptied, then a checkpoint (so that every round writes
# its pages' first images after one).  Otherwise idem's ledger, which more
# modes write, grows past shared_buffers sooner than (3)'s and the last
# cells measure table size, not the runs: at 32 clients with
# synchronous_commit = on, the last cell of a full run, the one-statement
# run fell to 0.78 of (3).  BENCH_RUNNER_FRESH=no keeps the rows.
fresh() {
	[ "${BENCH_RUNNER_FRESH:-yes}" = no ] && return 0
	admin -c "TRUNCATE idempotency_keys, hand_keys, transfers" -c "CHECKPOINT"
}

# µs of CPU per run: TICKS over a round at RATE runs/s
us_per_run() { awk -v t="$1" -v hz="$HZ" -v r="$2" -v s="$SECS" \
	'BEGIN { printf "%.1f", (r > 0 ? t / hz * 1e6 / (r * s) : 0) }'; }

echo "runner vs the hand-written ledger (3): runs/s, median of $ROUNDS x ${SECS}s, ratios to (3) in the same run (hand-new for new keys, hand-dup for duplicates, hand-late for late redeliveries)${BASE:+; base = the runner at $BASE}"
COLS=""
for m in $MODES; do [[ $m == hand-* ]] || COLS="$COLS $m"; done
REFS="hand-new hand-dup"
[[ $MODES == *hand-late* ]] && REFS="$REFS hand-late"
hdr="| sync | clients | (3) new | (3) half dup |"
[[ $REFS == *hand-late* ]] && hdr="$hdr (3) late |"
for m in $COLS; do hdr="$hdr $m |"; done
echo "$hdr"
cpus=()
lates=()
LATE_RE='late [^ ]+ [0-9]+ ([0-9]+) ([0-9]+) ([0-9]+)'
for sync in $SYNCS; do
	PG="$DB options=-csynchronous_commit=$sync"
	for c in $CLIENTS; do
		declare -A runs=() cpu=() wcpu=() vcpu=() late_runs=() late_re=() late_vk=()
		for r in $(seq 1 "$ROUNDS"); do
			for m in $MODES; do
				bin=$BIN mode=$m
				if [[ $m == base:* ]]; then bin=$BIN-base mode=${m#base:}; fi
				delay=""
				if [[ $mode == *@* ]]; then delay=${mode#*@} mode=${mode%@*}; fi
				set_delay "$delay"
				fresh
				WK=$(workers)
				w0=$(wticks "$WK")
				v0=$(ticks "$VK")
				t0=$(( $(ticks $$) + $(ticks "$PM") + $(ticks "$VK") + w0 ))
				out=$("$bin" "$mode" "$c" "$SECS" "$PG" 127.0.0.1 "$BENCH_VKPORT") ||
					{ echo "runner.sh: $m failed" >&2; exit 1; }
				sleep 0.3		# the backends exit and are reaped
				# the worker's copies of this round's commits are this round's
				w=$(wticks "$WK")
				for _ in $(seq 1 50); do
					sleep 0.2; w1=$(wticks "$WK"); [ "$w1" = "$w" ] && break; w=$w1
				done
				t1=$(( $(ticks $$) + $(ticks "$PM") + $(ticks "$VK") + $(wticks "$WK") ))
				runs[$m]+="${out##* } "
				if [[ $out =~ $LATE_RE ]]; then
					late_runs[$m]=$(( ${late_runs[$m]:-0} + BASH_REMATCH[1] ))
					late_re[$m]=$(( ${late_re[$m]:-0} + BASH_REMATCH[2] ))
					late_vk[$m]=$(( ${late_vk[$m]:-0} + BASH_REMATCH[3] ))
				fi
				wcpu[$m]+="$(us_per_run $(( $(wticks "$WK") - w0 )) "${out##* }") "
				vcpu[$m]+="$(us_per_run $(( $(ticks "$VK") - v0 )) "${out##* }") "
				cpu[$m]+="$(us_per_run $((t1 - t0)) "${out##* }") "
			done
		done
		declare -A med=()
		for m in $MODES; do
			med[$m]=$(echo "${runs[$m]}" | median)
		done
		cell() { awk -v v="${med[$1]}" -v b="${med[$2]}" 'BEGIN { printf "%.0f (%.2f)", v, v / b }'; }
		# a C-handler run (no -sql) also against the C client's ledger
		# in the same two round trips (c-ledger-new, -dup), when it ran
		cref() {
			[[ $1 == run-* && $1 != *-sql* && -n ${med[$2]:-} ]] || return 0
			awk -v v="${med[$1]}" -v b="${med[$2]}" 'BEGIN { printf " [C %.2f]", v / b }'
		}
		row="| $sync | $c |"
		for m in $REFS; do row="$row ${med[$m]%.*} |"; done
		for m in $COLS; do
			case $m in
			*dup*) row="$row $(cell "$m" hand-dup)$(cref "$m" c-ledger-dup) |" ;;
			*late*) row="$row $(cell "$m" hand-late) |" ;;
			*) row="$row $(cell "$m" hand-new)$(cref "$m" c-ledger-new) |" ;;
			esac
		done
		echo "$row"
		row="| $sync | $c | CPU µs/run |"
		for m in $REFS $COLS; do
			row="$row $(echo "${cpu[$m]}" | median) (w $(echo "${wcpu[$m]}" | median), v $(echo "${vcpu[$m]}" | median)) |"
		done
		cpus+=("$row")
		for m in "${!late_runs[@]}"; do
			lates+=("| $sync | $c | $m | ${late_re[$m]} of ${late_runs[$m]} | ${late_vk[$m]} |")
		done
		unset runs med cpu wcpu vcpu late_runs late_re late_vk
	done
done
echo
echo "CPU per run, µs (the clients, their backends, the idem worker and Valkey, with the worker's share as w and Valkey's as v; median of $ROUNDS; load-independent but for contention)"
hdr="| sync | clients | | (3) new | (3) half dup |"
[[ $REFS == *hand-late* ]] && hdr="$hdr (3) late |"
for m in $COLS; do hdr="$hdr $m |"; done
echo "$hdr"
printf '%s\n' "${cpus[@]}"
if [ ${#lates[@]} -gt 0 ]; then
	echo
	echo "Late redeliveries (${BENCH_REDELIVERY_MS:-500} ms or more after the first run's ack), all rounds: how many runs were redeliveries, and how many of those the Valkey cache answered"
	echo "| sync | clients | mode | redeliveries | from Valkey |"
	printf '%s\n' "${lates[@]}"
fi
# the replay keys bench/setup.sql made, for whatever runs after
if [ "${BENCH_RUNNER_FRESH:-yes}" != no ]; then
	admin -c "CALL bench_fill_replays(10000)"
fi
