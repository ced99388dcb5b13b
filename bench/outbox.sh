#!/usr/bin/env bash
# bench/outbox.sh: what emitting a message costs, how fast the publisher
# sends, and the same against a hand-written outbox (issue 40).
#
#   1. a run (claim, effect, complete) that emits one message (idem_emit)
#      against the same run without, and against the same run writing the
#      message into a hand-written outbox table, pgbench side by side in
#      alternating rounds, each with its publisher running; the backlog
#      left when each run ends is printed beside it; then the three again
#      with no publisher sending (idem's worker and publisher pointed at a
#      closed port, the hand-written one stopped): what the message costs
#      the committing transaction itself;
#   2. publish throughput: a backlog of BENCH_OUTBOX_DRAIN messages put
#      into idem's outbox (and into the hand-written one) while no publisher
#      runs, then drained: messages/s from the first XADD to an empty table;
#   3. commit -> stream lag (p50/p99) at steady rates: each message carries
#      the clock_timestamp() of its emit, just before COMMIT, and a reader
#      on the stream (XREAD BLOCK) stamps its arrival, on this machine's
#      one clock.
#
# The hand-written outbox is what teams write: a table written in the
# effect's transaction, drained by a polling publisher (bench/outbox_bench.py
# publisher): SELECT ... ORDER BY id LIMIT n FOR UPDATE SKIP LOCKED, XADD
# each row (pipelined, or one round trip each),
# DELETE, COMMIT; it sleeps BENCH_OUTBOX_POLL_MS when it found nothing.
#
# Run by `make bench` (bench/run passes its server in BENCH_WORK,
# BENCH_PGPORT, BENCH_VKPORT), or alone: it then starts its own throwaway
# PostgreSQL (preloading idem) and Valkey, and stops them at the end.
#
#   BENCH_SECONDS             seconds per pgbench run of part 1  (default 5)
#   BENCH_ROUNDS              alternating rounds, median kept    (default 3)
#   BENCH_OUTBOX_CLIENTS      pgbench clients                    (default 8)
#   BENCH_OUTBOX_SYNC         synchronous_commit of part 1       (default "off on")
#   BENCH_OUTBOX_DRAIN        messages in the backlog of part 2  (default 20000)
#   BENCH_OUTBOX_RATE         offered commits/s of part 3        (default "500 2000")
#   BENCH_OUTBOX_LAT_SECONDS  seconds per paced run of part 3    (default 10)
#   BENCH_OUTBOX_POLL_MS      the hand-written publisher's poll  (default 10)
#   BENCH_OUTBOX_BATCH        its rows per transaction           (default 256, as idem's)
#   BENCH_OUTBOX_BASE=<commit>  part 1 also runs the run without a message
#                             and the emit with idem.so built at <commit>
#                             (in a git worktree), in the same alternating
#                             rounds: the server restarts with each library.
#                             Only alone (its own server).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$ROOT/bench/lib.sh"
SECS=${BENCH_SECONDS:-5}
ROUNDS=${BENCH_ROUNDS:-3}
CLIENTS=${BENCH_OUTBOX_CLIENTS:-8}
SYNCS=${BENCH_OUTBOX_SYNC:-off on}
DRAIN_N=${BENCH_OUTBOX_DRAIN:-20000}
RATES=${BENCH_OUTBOX_RATE:-500 2000}
LAT_SECS=${BENCH_OUTBOX_LAT_SECONDS:-10}
POLL_MS=${BENCH_OUTBOX_POLL_MS:-10}
BATCH=${BENCH_OUTBOX_BATCH:-256}
PY=${BENCH_PYTHON:-/usr/bin/python3}

hand_pub=""
bench_server outbox "max_connections = 100" "shared_buffers = 256MB" "max_wal_size = 4GB"
"$PY" -c 'import psycopg, redis' 2>/dev/null ||
	{ echo "outbox.sh: needs python3-psycopg and python3-redis (make test installs them)" >&2; exit 1; }

# BENCH_OUTBOX_BASE: the base's idem.so beside this tree's, swapped in by
# a restart (a new file, never the mapped one overwritten).
BASE=""
if [ -n "${BENCH_OUTBOX_BASE:-}" ]; then
	[ -n "$OWN" ] || { echo "outbox.sh: BENCH_OUTBOX_BASE needs its own server: run bench/outbox.sh alone" >&2; exit 2; }
	BASE=$(git -C "$ROOT" rev-parse --short "$BENCH_OUTBOX_BASE^{commit}") || exit 2
	LIBDIR=$("$(idem_pg_config)" --pkglibdir)
	git -C "$ROOT" worktree add -q --detach "$WORK/base-src" "$BASE" || exit 1
	make -C "$WORK/base-src" -s -j"$(nproc 2>/dev/null || echo 2)" PG_CONFIG="$(idem_pg_config)" all >/dev/null 2>&1 ||
		{ echo "outbox.sh: building idem at $BASE failed" >&2; git -C "$ROOT" worktree remove --force "$WORK/base-src"; exit 1; }
	cp "$WORK/base-src/idem.so" "$WORK/idem-base.so" && cp "$LIBDIR/idem.so" "$WORK/idem-new.so" || exit 1
	git -C "$ROOT" worktree remove --force "$WORK/base-src"
fi
use_so() {
	cp "$WORK/idem-$1.so" "$LIBDIR/idem.so.bench" && mv -f "$LIBDIR/idem.so.bench" "$LIBDIR/idem.so" || return 1
	idem_as_test_user "$(idem_pg_bindir)/pg_ctl" -D "$WORK/pg" -l "$WORK/pg.log" -w -t 60 restart >/dev/null 9>&-
}

PG="host=$WORK port=$PGPORT user=postgres dbname=postgres"
OB="$ROOT/bench/outbox_bench.py"
PSQL=(idem_as_test_user "$(idem_pg_bindir)/psql" -X -q -At -h "$WORK" -p "$PGPORT" -U postgres -d postgres)
VKCLI=("$(idem_valkey_cli)" -p "$VKPORT")

"$PY" "$OB" setup "$PG" || { echo "outbox.sh: setup failed" >&2; exit 1; }
mkdir -p "$WORK/outbox"
for v in plain emit hand; do
	printf '\\set run random(1, 9000000000000000000)\nSELECT ob_%s(1, :run, 5);\n' "$v" \
		>"$WORK/outbox/$v.sql"
done
chmod -R a+rX "$WORK/outbox"

# pgb SYNC ARGS... -> pgbench's output
pgb() {
	local sync=$1
	shift
	idem_as_test_user env PGOPTIONS="-c synchronous_commit=$sync" \
		"$(idem_pg_bindir)/pgbench" -n -M prepared -h "$WORK" -p "$PGPORT" -U postgres \
		-c "$CLIENTS" -j 2 "$@" postgres 2>&1
}
tps() { sed -nE 's/^tps = ([0-9.]+) \(without initial connection time\)/\1/p'; }
idem_waiting() { "${PSQL[@]}" -c "SELECT outbox_waiting FROM idem_stats()"; }
hand_waiting() { "${PSQL[@]}" -c "SELECT count(*) FROM hand_outbox"; }
# wait (at most 60 s) for both outboxes to be empty; the streams go
wait_empty() {
	for _ in $(seq 1 600); do
		[ "$(idem_waiting)" = 0 ] && [ "$(hand_waiting)" = 0 ] && break
		sleep 0.1
	done
	"${VKCLI[@]}" del bench.idem bench.hand bench.drain >/dev/null
}
hand_start() {
	rm -f "$WORK/outbox/ready"
	OB_READY=$WORK/outbox/ready "$PY" "$OB" publisher "$PG" "$VKPORT" "$BATCH" "$POLL_MS" "${1:-pipe}" &
	hand_pub=$!
	# connected before the load starts
	for _ in $(seq 1 300); do
		[ -f "$WORK/outbox/ready" ] && break
		sleep 0.05
	done
}
hand_stop() {
	# let it drain what its run left, then stop it
	for _ in $(seq 1 600); do
		[ "$(hand_waiting)" = 0 ] && break
		sleep 0.1
	done
	kill "$hand_pub" 2>/dev/null
	wait "$hand_pub" 2>/dev/null
	hand_pub=""
}
cleanup() {
	[ -z "$hand_pub" ] || kill "$hand_pub" 2>/dev/null
	[ -z "$BASE" ] || use_so new
	bench_server_stop
}
trap cleanup EXIT

echo "load average at the start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "idem at $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?'); hand-written publisher: batch $BATCH, poll ${POLL_MS} ms, pipelined XADDs"

# 1. The write path: tps, and the backlog each run left.  Then the same
# two runs with idem's worker and publisher pointed at a closed port (they
# send nothing): what the emit itself costs the committing transaction.
away() {
	if [ "$1" = on ]; then
		"${PSQL[@]}" -c "ALTER SYSTEM SET idem.valkey_port = 1" -c "SELECT pg_reload_conf()" >/dev/null
	else
		"${PSQL[@]}" -c "ALTER SYSTEM RESET idem.valkey_port" -c "SELECT pg_reload_conf()" >/dev/null
	fi
	sleep 0.5
}
printf '\n1. claim + effect + complete, %s clients, median of %s x %ss rounds (backlog: messages waiting when the run ended; paired: median of the rounds'"'"' own ratios)\n' \
	"$CLIENTS" "$ROUNDS" "$SECS"
printf '%-6s %-34s %9s %9s %12s %8s\n' sync run tps backlog "/no message" paired
for sync in $SYNCS; do
	declare -A t=() b=()
	for r in $(seq 1 "$ROUNDS"); do
		if [ -n "$BASE" ]; then
			use_so base
			t[base_plain]+="$(pgb "$sync" -T "$SECS" -f "$WORK/outbox/plain.sql" | tps) "
			t[base_emit]+="$(pgb "$sync" -T "$SECS" -f "$WORK/outbox/emit.sql" | tps) "
			b[base_emit]+="$(idem_waiting) "
			wait_empty
			use_so new
		fi
		t[plain]+="$(pgb "$sync" -T "$SECS" -f "$WORK/outbox/plain.sql" | tps) "
		t[emit]+="$(pgb "$sync" -T "$SECS" -f "$WORK/outbox/emit.sql" | tps) "
		b[emit]+="$(idem_waiting) "
		wait_empty # its backlog drained before the next run, not during it
		hand_start pipe
		t[hand]+="$(pgb "$sync" -T "$SECS" -f "$WORK/outbox/hand.sql" | tps) "
		b[hand]+="$(hand_waiting) "
		hand_stop
		wait_empty
		away on
		t[plain_away]+="$(pgb "$sync" -T "$SECS" -f "$WORK/outbox/plain.sql" | tps) "
		t[emit_away]+="$(pgb "$sync" -T "$SECS" -f "$WORK/outbox/emit.sql" | tps) "
		t[hand_away]+="$(pgb "$sync" -T "$SECS" -f "$WORK/outbox/hand.sql" | tps) "
		"${PSQL[@]}" -c "TRUNCATE hand_outbox" >/dev/null
		away off
		wait_empty
		"${PSQL[@]}" -c "VACUUM ob_effects, hand_outbox" >/dev/null
	done
	declare -A m=()
	for v in plain emit hand plain_away emit_away hand_away ${BASE:+base_plain base_emit}; do m[$v]=$(echo "${t[$v]}" | median); done
	# paired: the median of each round's ratio to the run without a message
	# of that round (run just before it): steadier than the ratio of the
	# medians while the machine's speed drifts
	paired() {
		paste <(echo "${t[$1]}" | tr ' ' '\n' | grep .) <(echo "${t[$2]}" | tr ' ' '\n' | grep .) |
			awk '$2 > 0 { print $1 / $2 }' | median
	}
	row() { # label run backlog base-run
		printf '%-6s %-34s %9.0f %9s %12.2f %8.2f\n' "$sync" "$1" "${m[$2]}" "$3" \
			"$(awk -v a="${m[$2]}" -v b="${m[$4]}" 'BEGIN { print a / b }')" "$(paired "$2" "$4")"
	}
	row "no message" plain - plain
	row "idem_emit" emit "$(echo "${b[emit]}" | median)" plain
	row "hand-written outbox" hand "$(echo "${b[hand]}" | median)" plain
	row "no message, Valkey away" plain_away - plain_away
	row "idem_emit, Valkey away" emit_away - plain_away
	row "hand-written outbox, no publisher" hand_away - plain_away
	if [ -n "$BASE" ]; then
		row "no message, idem at $BASE" base_plain - base_plain
		row "idem_emit, idem at $BASE" base_emit "$(echo "${b[base_emit]}" | median)" base_plain
		row "no message at $BASE / this one" base_plain - plain
	fi
	unset t b m
done
echo "   target: idem_emit >= 0.90 x no message"

# 2. Publish throughput: a backlog put into the table while no publisher
# runs (rows written directly: what is measured is the publishing), then
# drained.  idem's publisher is woken by one emitting commit.
fill_idem() {
	"${PSQL[@]}" -c "INSERT INTO idem_outbox (stream, message_id, body)
		SELECT 'bench.drain', encode(sha256(g::text::bytea), 'hex') || '-1',
		       jsonb_build_object('transfer_id', g, 'amount', 5, 'at', extract(epoch FROM clock_timestamp()))
		FROM generate_series(1, $DRAIN_N) g" >/dev/null
}
fill_hand() {
	"${PSQL[@]}" -c "INSERT INTO hand_outbox (stream, message)
		SELECT 'bench.drain',
		       jsonb_build_object('transfer_id', g, 'amount', 5, 'at', extract(epoch FROM clock_timestamp()))
		FROM generate_series(1, $DRAIN_N) g" >/dev/null
}
rate() { awk '{ if ($2 > 0) printf "%.0f", $1 / $2; else print 0 }'; }
declare -A d=()
for r in $(seq 1 "$ROUNDS"); do
	sleep 2 # idem's publisher leaves a second after its last message
	fill_idem
	"$PY" "$OB" idem-drain "$PG" >"$WORK/outbox/drain.out" &
	watcher=$!
	sleep 0.2
	pgb on -t 1 -c 1 -f "$WORK/outbox/emit.sql" >/dev/null
	wait "$watcher"
	d[idem]+="$(rate <"$WORK/outbox/drain.out") "
	wait_empty
	for mode in one pipe; do
		fill_hand
		d[$mode]+="$("$PY" "$OB" publisher "$PG" "$VKPORT" "$BATCH" "$POLL_MS" "$mode" drain | rate) "
		wait_empty
	done
done
printf '\n2. publish throughput: a backlog of %s messages drained, median of %s rounds (messages/s)\n' "$DRAIN_N" "$ROUNDS"
printf '   idem publisher %10.0f\n' "$(echo "${d[idem]}" | median)"
printf '   hand-written, one XADD per round trip %10.0f\n' "$(echo "${d[one]}" | median)"
printf '   hand-written, pipelined XADDs         %10.0f\n' "$(echo "${d[pipe]}" | median)"
unset d

# 3. Commit -> stream lag at steady rates, synchronous_commit=on.
printf '\n3. emit -> on the stream, synchronous_commit=on, %s clients, %ss per run, median of %s rounds (ms)\n' \
	"$CLIENTS" "$LAT_SECS" "$ROUNDS"
printf '%8s %-12s %9s %9s %9s %9s %6s\n' rate outbox messages p50 p99 max dups
for rate in $RATES; do
	declare -A n=() p50=() p99=() mx=() dup=()
	for r in $(seq 1 "$ROUNDS"); do
		for v in idem hand; do
			[ "$v" = hand ] && hand_start pipe
			"$PY" "$OB" reader "$VKPORT" "bench.$v" 30 >"$WORK/outbox/lag.out" &
			rd=$!
			sleep 0.3
			pgb on -T "$LAT_SECS" -R "$rate" -f "$WORK/outbox/$([ $v = idem ] && echo emit || echo hand).sql" >/dev/null
			wait "$rd"
			[ "$v" = hand ] && hand_stop
			read -r a b c e f <"$WORK/outbox/lag.out"
			n[$v]+="$a " p50[$v]+="$b " p99[$v]+="$c " mx[$v]+="$e " dup[$v]+="$f "
			wait_empty
		done
	done
	for v in idem hand; do
		printf '%8s %-12s %9.0f %9.2f %9.2f %9.2f %6s\n' "$rate" "$v" "$(echo "${n[$v]}" | median)" \
			"$(echo "${p50[$v]}" | median)" "$(echo "${p99[$v]}" | median)" "$(echo "${mx[$v]}" | median)" \
			"$(echo "${dup[$v]}" | median)"
	done
	unset n p50 p99 mx dup
done
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
