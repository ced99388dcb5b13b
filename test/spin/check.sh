#!/usr/bin/env bash
# check.sh -- model-check idem's exactly-once protocol with spin (issue 7).
#
# Runs every check of test/spin/ in a temporary folder (always removed):
# spin -a, gcc, pan; exhaustive search (no bitstate), fails if pan truncates
# the search (depth or memory).  Prints the state-space figures of each
# check as TAP comments and one TAP line per check on stdout.  Exits non-zero
# if the real model fails any property or a broken variant passes.
#
#   test/spin/check.sh            all checks, two at a time
#   SPIN_JOBS=1 test/spin/check.sh
#   SPIN_TRAILS=1 ...             also print every counterexample's trail
#   SPIN_ONLY=TEXT ...            only the checks whose line contains TEXT
#   SPIN_CACHE=DIR ...            keep each pan binary in DIR, named for what
#                                 built it, and reuse it (test/run sets it)
#
# Needs spin (Debian package `spin`) and gcc; no root, writes nothing in the
# source tree.
set -u

here=$(cd "$(dirname "$0")" && pwd)
jobs=${SPIN_JOBS:-2}

for tool in spin gcc; do
	if ! command -v "$tool" >/dev/null 2>&1; then
		echo "1..0"
		echo "Bail out! $tool not found (apt-get install spin gcc)"
		exit 1
	fi
done

tmp=$(mktemp -d "${TMPDIR:-/tmp}/idem-spin.XXXXXX") || exit 1
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$tmp"' EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------------------
# The checks: expect | mode | model file | -D flags | description
#   (fields are separated by '|', so a <text> must not contain one)
#   expect  pass             no error, complete exhaustive search
#           pass:long        the same, for a search of more than about 6 s
#                            of CPU at -O2 (millions of states, fewer in a
#                            liveness search): pan.c built with -O2
#           fail:<text>      a counterexample whose violated assertion (or
#                            acceptance cycle) contains <text>
#   mode    safety           assertions + invalid end states (-DSAFETY)
#           live             LTL eventually_applied, pan -a -f (weak fairness)
# ---------------------------------------------------------------------------
checks=(
"pass|safety|idem.pml|-DNRUN=2 -DNDELIV=4 -DNFAULT=3 -DPERM_FAIL|real model, in-transaction effect, 2 runners, 4 deliveries, 3 faults: safety (at most once, none lost, replay = committed, cache = truth)"
"pass:long|safety|idem.pml|-DNRUN=3 -DNDELIV=3 -DNFAULT=2 -DPERM_FAIL|real model, in-transaction effect, 3 runners, 3 deliveries, 2 faults: safety (at most once, none lost, replay = committed, cache = truth)"
"pass|safety|idem.pml|-DNRUN=2 -DNDELIV=3 -DNFAULT=2 -DPERM_FAIL -DNO_LOOKUP_FIRST|real model without the lookup before the claim (lookup_first off; the demo's batches, which claim without the gate): safety"
"pass|safety|idem.pml|-DNRUN=2 -DNDELIV=3 -DNFAULT=2 -DPERM_FAIL -DFIRST_DELIVERY|real model, any delivery (duplicates included) may skip the gate (flagged as a first delivery, or in the runner's stretch of new keys), 2 runners, 3 deliveries, 2 faults: safety"
"pass:long|safety|idem.pml|-DNRUN=2 -DNDELIV=4 -DNFAULT=3 -DPERM_FAIL -DFIRST_IN_CLAIM|real model, the handler's first statement sent with the claim (run option first_sql) and rolled back to the savepoint when the key is not ours, 2 runners, 4 deliveries, 3 faults: safety"
"pass:long|live|idem.pml|-DLIVENESS -DNRUN=2 -DNFAULT=3 -DFIRST_IN_CLAIM|real model, the handler's first statement sent with the claim, faults cease after 3: liveness <> effect applied (weak fairness)"
"fail:effects<=1|safety|idem.pml|-DNRUN=2 -DNDELIV=3 -DNFAULT=2 -DFIRST_IN_CLAIM -DBROKEN_FIRST_KEPT|broken: the first statement sent with the claim but not rolled back when the key is not ours (COMMIT alone) -- counterexample: doubled effect"
"pass:long|live|idem.pml|-DLIVENESS -DNRUN=2 -DNFAULT=3 -DFIRST_DELIVERY|real model, any delivery may skip the gate (flagged first, or a stretch of new keys), faults cease after 3: liveness <> effect applied (weak fairness)"
"pass:long|safety|idem.pml|-DNRUN=2 -DNDELIV=4 -DNFAULT=3 -DLEASE_MODE|real model, lease mode, 2 runners, 4 deliveries, 3 faults: one unexpired lease at a time, no completion overwritten, replay = committed"
"pass:long|safety|idem.pml|-DNRUN=3 -DNDELIV=3 -DNFAULT=1 -DLEASE_MODE|real model, lease mode, 3 runners, 3 deliveries, 1 fault: one unexpired lease at a time, no completion overwritten, replay = committed"
"pass|live|idem.pml|-DLIVENESS -DNRUN=2 -DNFAULT=3 -DNO_MARKER_PX|real model, a dead runner's marker outlives every redelivery (no PX within the run; runners killed between their marker and their claim, and after the claim): liveness <> effect applied, the marker answers busy for its first second only"
"fail:acceptance cycle|live|idem.pml|-DLIVENESS -DNRUN=2 -DNFAULT=3 -DNO_MARKER_PX -DMARKER_BUSY_WHOLE_LEASE -DNO_BUSY_BOUND|broken: another run's marker busy for its whole lease (idem before issue 26) -- counterexample: a runner killed after setting its marker, every redelivery busy from Valkey, the effect never applied"
"fail:vk_orphan|safety|idem.pml|-DNRUN=2 -DNDELIV=3 -DNFAULT=2 -DMARKER_BUSY_WHOLE_LEASE|broken: another run's marker busy for its whole lease (idem before issue 26) -- counterexample: a dead run's marker answers busy past its first second"
"pass|live|idem.pml|-DLIVENESS -DNRUN=2 -DNFAULT=3|real model, in-transaction effect, 2 runners, faults cease after 3: liveness <> effect applied (weak fairness)"
"pass:long|live|idem.pml|-DLIVENESS -DNRUN=3 -DNFAULT=2|real model, in-transaction effect, 3 runners, faults cease after 2: liveness <> effect applied (weak fairness)"
"pass|live|idem.pml|-DLIVENESS -DNRUN=2 -DNFAULT=2 -DLEASE_MODE|real model, lease mode, 2 runners, faults (lease overruns included) cease after 2: liveness <> completed (weak fairness)"
"fail:acceptance cycle|live|idem.pml|-DLIVENESS -DNRUN=2 -DNFAULT=2 -DLEASE_MODE -DLEASE_OVERRUN_FREE|lease mode needs leases longer than the effect: if every holder may overrun its lease, spin finds a livelock (takeover after takeover, each stale idem_complete refused)"
"fail:acceptance cycle|live|idem.pml|-DLIVENESS -DNRUN=2 -DNFAULT=2 -DNO_BACKEND_TIMEOUT|liveness is not vacuous: if a dead client's backend is never terminated (no idle_in_transaction_session_timeout) it keeps the try-lock and spin finds a fair cycle with no effect"
"pass|safety|idem.pml|-DNRUN=2 -DNDELIV=3 -DNFAULT=3 -DLEASE_MODE -DLEASE_FENCE -DCHECK_COMPLETION_ATTEMPT|lease mode, idem_complete(..., attempt) as implemented: the stored outcome is always the recorded attempt's"
"pass|safety|idem.pml|-DNRUN=2 -DNDELIV=3 -DNFAULT=3 -DLEASE_MODE -DLEASE_FENCE -DCHECK_COMPLETION_ATTEMPT -DLEASE_PURGE|lease mode with idem_purge of expired processing rows kept for idem.min_purge_grace: the stored outcome is always the recorded attempt's, in its own claim's row"
"fail:row_holder==me|safety|idem.pml|-DNRUN=2 -DNDELIV=3 -DNFAULT=3 -DLEASE_MODE -DLEASE_FENCE -DCHECK_COMPLETION_ATTEMPT -DLEASE_PURGE -DPURGE_NO_FLOOR|broken: lease mode with idem_purge and no floor under idem.purge_grace (idem 0.3, purge_grace = 0) -- counterexample: the purged key is claimed again as attempt 1 and the stale holder's attempt 1 completes it"
"pass:long|safety|idem.pml|-DNRUN=2 -DNDELIV=3 -DNFAULT=3 -DLEASE_MODE -DLEASE_FENCE -DFENCE_ID -DCHECK_COMPLETION_ATTEMPT -DLEASE_PURGE -DPURGE_NO_FLOOR|lease mode fenced by the claim's fence (idem_complete_fenced: the row's id, never reused), with idem_purge taking an expired processing row at any time (no floor): the stored outcome is always the recorded attempt's, in its own claim's row"
"pass:long|safety|idem.pml|-DNRUN=2 -DNDELIV=3 -DNFAULT=2 -DPERM_FAIL -DDURABILITY -DFAILOVER -DRELEARN_AT_GATE|real model, crash and promotion of a lagging asynchronous standby, every gate on the current keyspace: safety (the timeline in the keyspace fences the old cache)"
"pass:long|safety|idem.pml|-DNRUN=2 -DNDELIV=3 -DNFAULT=2 -DPERM_FAIL -DDURABILITY -DREWIND -DRELEARN_AT_GATE|real model, the history rewound (a backup or a copy started as it is, in place or beside): safety with the history epoch (a new keyspace), every gate on the current keyspace"
"fail:(vk_val==row_out)|safety|idem.pml|-DNRUN=2 -DNDELIV=3 -DNFAULT=2 -DPERM_FAIL -DDURABILITY -DREWIND -DRELEARN_AT_GATE -DNO_EPOCH|broken: the history rewound and no history epoch in the keyspace (idem 0.3) -- counterexample: Valkey holds, for the current keyspace, a result the restored database lacks"
"pass:long|safety|idem.pml|-DNRUN=2 -DNDELIV=3 -DNFAULT=2 -DPERM_FAIL -DDURABILITY -DREWIND|real model, the history rewound, runners that have not re-learnt their keyspace since (no PostgreSQL round trip): safety (the old epoch's owner key is retired, and every gate reads it)"
"fail:(row_out==got_val)|safety|idem.pml|-DNRUN=2 -DNDELIV=3 -DNFAULT=2 -DPERM_FAIL -DDURABILITY -DREWIND -DNO_OWNER_CHECK|broken: the history rewound, and a gate that does not read the epoch owner key (idem 0.3 before it) -- counterexample: a runner that has not re-learnt since replays from the old epoch"
# The promotion check below also proves two models that once had checks of
# their own, whose every state and step it searches with the same
# assertions: DURABILITY alone (crashes; FAILOVER adds one more fault step,
# the promotion, enabled only while faults remain -- when a Valkey fault is
# always enabled too, so no end state differs) and STANDBY_SLOTS /
# SYNC_CANCELLED (one model: the worker copies only once the standby has
# flushed too, a stronger guard on that one step; where it blocks the copy,
# the standby's catch-up step is enabled, so no end state differs).
"pass:long|safety|idem.pml|-DNRUN=2 -DNDELIV=3 -DNFAULT=2 -DPERM_FAIL -DDURABILITY -DFAILOVER|real model, promotion of an asynchronous standby not in idem.standby_slots, clients that have not re-learnt their keyspace since: safety (the promoted standby retires the old primary's epoch; the commit the promotion lost is PostgreSQL's own limit); this search also covers the crash-only model (DURABILITY alone) and a standby the worker waits for (idem.standby_slots, or a synchronous one whose COMMIT wait was cancelled): see above"
"fail:(row_out==got_val)|safety|idem.pml|-DNRUN=2 -DNDELIV=3 -DNFAULT=2 -DPERM_FAIL -DDURABILITY -DFAILOVER -DNO_OWNER_CHECK|broken: promotion of an asynchronous standby not in idem.standby_slots, and a gate that does not read the epoch owner key -- counterexample: a client that has not re-learnt since replays what the promotion lost"
"pass:long|safety|idem.pml|-DNRUN=2 -DNDELIV=3 -DNFAULT=2 -DPERM_FAIL -DDURABILITY -DFAILOVER -DSTANDBY_SLOTS -DNO_OWNER_CHECK|a standby the worker waits for (idem.standby_slots, or a synchronous one whose COMMIT wait was cancelled) promoted, and a gate that does not read the epoch owner key: safety all the same (Valkey never holds a copy the promoted standby lacks); the check above without idem.standby_slots is its counterexample"
"fail:(vk_val==row_out)|safety|broken_copy_before_flush.pml|-DNRUN=2 -DNDELIV=3 -DNFAULT=2 -DPERM_FAIL -DDURABILITY|broken variant copy_before_flush (the old cache design) rejected with counterexample: a crash loses a commit whose result Valkey keeps"
"fail:(vk_val==row_out)|safety|broken_copy_before_flush.pml|-DNRUN=2 -DNDELIV=3 -DNFAULT=2 -DPERM_FAIL -DDURABILITY -DONLY_COPY_AT_COMMIT|broken variant copy_before_flush, only the worker copying before the flush: rejected"
"fail:(vk_val==row_out)|safety|broken_copy_before_flush.pml|-DNRUN=2 -DNDELIV=3 -DNFAULT=2 -DPERM_FAIL -DDURABILITY -DONLY_CLIENT_SETS|broken variant copy_before_flush, only the client SETting terminal values: rejected"
"fail:(vk_val==row_out)|safety|broken_copy_before_flush.pml|-DNRUN=2 -DNDELIV=3 -DNFAULT=2 -DPERM_FAIL -DDURABILITY -DONLY_NS_WITHOUT_TIMELINE -DFAILOVER -DRELEARN_AT_GATE|broken variant copy_before_flush, only a keyspace without the timeline: rejected after a promotion"
"fail:row_att==att|safety|idem.pml|-DNRUN=2 -DNDELIV=3 -DNFAULT=2 -DLEASE_MODE -DCHECK_COMPLETION_ATTEMPT|lease mode without the attempt argument: a stale lease holder completes a row taken over by attempt+1 -- counterexample found (why idem_complete takes the attempt)"
"fail:ext_effects<=1|safety|idem.pml|-DNRUN=2 -DNDELIV=3 -DNFAULT=2 -DLEASE_MODE -DEXT_AT_MOST_ONCE|documented limit, lease mode: an effect outside PostgreSQL is at-least-once (spin shows the second effect)"
"pass|safety|epoch_history.pml||the history epoch across restores from a stale secret file, crashes, DELETEs, Valkey out of reach and a Valkey snapshot loaded later: a runner that learnt an epoch never replays what the server's database lacks (the epoch list, the dead epochs retired again)"
"fail:db_m|safety|epoch_history.pml|-DNO_LIST|broken: a takeover that retires only the epoch its secret file names (idem before the epoch list) -- counterexample: a restore from a stale secret file leaves the original's newer epoch trusted"
"fail:db_m|safety|epoch_history.pml|-DLIST_OF_ONE|broken: the epoch list holds the newest epoch only -- counterexample: a Valkey snapshot brings back an older epoch of the original the restored server never learnt was dead"
"fail:db_m|safety|epoch_history.pml|-DNO_RERETIRE|broken: the dead epochs are not retired again at the owner check -- counterexample: a Valkey snapshot taken before a retirement brings the epoch back to life"
"pass|safety|epoch_history.pml|-DRETIRE_ONLY_TAKEN|the epoch list alone covers a backup taken while the newest epoch waited for its takeover (an epoch never taken over is not retired with its file): safety"
"fail:effects<=1|safety|broken_key_outside_tx.pml|-DNRUN=2 -DNDELIV=3 -DNFAULT=2|broken variant key_outside_tx (effect committed, key in a later tx) rejected with counterexample: doubled effect"
"fail:(row_st!=2)|safety|broken_key_outside_tx.pml|-DNRUN=2 -DNDELIV=3 -DNFAULT=2 -DKEY_FIRST|broken variant key_outside_tx (key completed, effect in a later tx) rejected with counterexample: lost effect"
"pass|safety|epoch_stamp.pml|-DNFAULT=2|a ledger row removed by hand while its copy waits in the commit ring, a reader repopulates Valkey (READ COMMITTED or an older REPEATABLE READ snapshot), the worker loses Valkey, runners connected before: safety (nothing read before the removal reaches the epoch made for it; once the DELETE returns nothing replays the row, unless its wait timed out, and then only within the runner's re-learn bound)"
"fail:(my<=rm_ep)|safety|epoch_stamp.pml|-DNFAULT=2 -DNO_STAMP|broken: queued copies carry no renewal generation (idem before 0.4) -- counterexample: a copy queued before the DELETE is written into the new epoch and replayed"
"fail:(my<=rm_ep)|safety|epoch_stamp.pml|-DNFAULT=2 -DNO_RECHECK|broken: a REPEATABLE READ reader repopulates from its snapshot without probing again -- counterexample: a snapshot older than the DELETE puts the row into the new epoch"
"fail:timed_out|safety|epoch_stamp.pml|-DNFAULT=2 -DNO_WAIT|broken: the DELETE's commit returns before the worker retired the old epoch -- counterexample: a runner connected before replays the removed row after the DELETE returned"
"fail:timed_out|safety|epoch_stamp.pml|-DNFAULT=2 -DNO_BOUND|broken: secrets_max_age_ms 0 meaning never (before the cap) -- counterexample: while the server cannot reach Valkey a runner connected before replays the removed row past its bound"
"pass|safety|outbox.pml|-DNDELIV=3 -DNFAULT=2|the exactly-once pipeline (issue 40): a run that emits one message, its publisher, two consumers of the stream (sessions with synchronous_commit=off, durable runs) running it through idem keyed by its id, with crashes (unflushed commits lost), deaths and a claim of a live consumer's entry: safety (each effect at most once, no message for a rolled-back or lost effect, one id, none lost whenever nothing is left to run)"
"fail:(slen==0)|safety|outbox.pml|-DNDELIV=3 -DNFAULT=2 -DPUBLISH_IN_HANDLER|broken: the handler XADDs itself before COMMIT (no outbox) -- counterexample: a message on the stream for an effect that rolled back"
"fail:(dn_eff==1)|safety|outbox.pml|-DNDELIV=3 -DNFAULT=2 -DPUBLISH_AFTER_COMMIT -DSYNC_COMMIT|broken: the handler XADDs itself after COMMIT (no outbox) -- counterexample: the runner dies in between, the redelivery replays, the message is lost"
"fail:(slen==0)|safety|outbox.pml|-DNDELIV=3 -DNFAULT=2 -DPUBLISH_BEFORE_FLUSH|broken: the publisher sends a committed message before its WAL is flushed -- counterexample: a crash loses the effect whose message was published"
"fail:(dn_eff==1)|safety|outbox.pml|-DNDELIV=3 -DNFAULT=2 -DACK_BEFORE_RUN|broken: the consumer XACKs on receipt, before its run settles -- counterexample: it dies, the message is never applied"
"fail:(dn_eff<=1)|safety|outbox.pml|-DNDELIV=3 -DNFAULT=2 -DCONSUMER_NO_CLAIM|broken: the consumer applies the message without idem's claim -- counterexample: a message published again (same id) applied twice"
"pass|safety|outbox.pml|-DNDELIV=3 -DNFAULT=2 -DDN_FOREIGN|the pipeline with a writer of the message's key that is no durable consumer (synchronous_commit=off, no XACK): the durable consumer's replay of its row flushes it first: safety"
"fail:(dn_eff==1)|safety|outbox.pml|-DNDELIV=3 -DNFAULT=2 -DNO_DURABLE_RUN|broken: the consumer's runs commit as its session has them, synchronous_commit=off (idem before durable runs) -- counterexample: a crash after the XACK loses the downstream effect, the message is gone"
"fail:(dn_eff==1)|safety|outbox.pml|-DNDELIV=3 -DNFAULT=2 -DDN_FOREIGN -DNO_DURABLE_REPLAY|broken: a replay answered without flushing its row's commit first -- counterexample: the foreign writer's row, not flushed, replayed and acknowledged, then lost in a crash"
"fail:effects<=1|safety|broken_get_then_set.pml|-DNRUN=2 -DNDELIV=3 -DNFAULT=2 -DNO_VALKEY_FAULTS|broken variant get_then_set (GET-then-SET gate, no try-lock/unique key, Valkey never fails) rejected with counterexample: doubled effect"
"pass|safety|broken_get_then_set.pml|-DNRUN=2 -DNDELIV=3 -DNFAULT=2 -DNO_VALKEY_FAULTS -DCONTROL_ATOMIC_GATE|control for get_then_set: the atomic gate instead, same unprotected claim, Valkey never fails: safe (the race is GET-then-SET)"
"pass|safety|broken_get_then_set.pml|-DNRUN=2 -DNDELIV=4 -DNFAULT=3 -DCONTROL_PG_CLAIM|control for get_then_set: GET-then-SET gate with the real idem_claim, with Valkey faults: safe (PostgreSQL is the authority)"
"fail:effects<=1|safety|broken_get_then_set.pml|-DNRUN=2 -DNDELIV=3 -DNFAULT=2 -DCONTROL_ATOMIC_GATE|control for get_then_set: atomic gate without the PostgreSQL try-lock/unique key, with Valkey faults: rejected (Valkey alone is no authority)"
)

# cpu_of FILE CMD...  -> runs CMD; writes its CPU time (user + system, in
# seconds) to FILE: the suite's cost is CPU, not wall time, on a machine
# whose other suites run at the same time
cpu_of() {
	local f=$1 st
	shift
	local TIMEFORMAT='%U %S'
	{ time "$@" 2>&3; } 3>&2 2>"$f.t"
	st=$?
	awk '{ printf "%.1f", $1 + $2 }' "$f.t" >"$f"
	return $st
}

# SPIN_CACHE: pan.c of an unchanged model and flags compiles to the same
# program every run (7 s of gcc for a long search): keep each binary under
# the SHA-256 of its sources (the pan.* files spin writes), the gcc flags and
# gcc's version, and copy it back instead of compiling.  Written under a
# temporary name, then renamed; entries unused for 30 days are removed.
cache=${SPIN_CACHE:-}
gcc_id=""
if [ -n "$cache" ]; then
	if mkdir -p "$cache" 2>/dev/null && [ -w "$cache" ]; then
		find "$cache" -maxdepth 1 -type f -mtime +30 -delete 2>/dev/null
		gcc_id=$(gcc --version | head -n 1)
	else
		# (a cache folder under a private one, say IDEM_CACHE_DIR=/root/...)
		echo "# SPIN_CACHE $cache is not a folder $(id -un) can write: every check is compiled"
		cache=""
	fi
fi

# build_pan CFLAGS  -> ./pan, from the cache or gcc; gcc.cpu says which
build_pan() {
	local key=""
	if [ -n "$cache" ]; then
		key=$({ printf '%s\n%s\n' "$gcc_id" "$1"; cat pan.b pan.c pan.h pan.m pan.p pan.t; } |
			sha256sum | cut -c1-40)
		if [ -f "$cache/$key" ] && cp "$cache/$key" pan 2>/dev/null && chmod u+x pan; then
			touch "$cache/$key"
			echo "none, cached" >gcc.cpu
			return 0
		fi
	fi
	# shellcheck disable=SC2086
	cpu_of gcc.cpu gcc $1 -o pan pan.c || return 1
	echo " s" >>gcc.cpu
	if [ -n "$key" ] && cp pan "$cache/$key.$BASHPID" 2>/dev/null; then
		mv -f "$cache/$key.$BASHPID" "$cache/$key"
	fi
	return 0
}

# run_check N SPEC  -> writes $tmp/N.tap (TAP line + comments), $tmp/N.rc
run_check() {
	local n=$1 spec=$2
	local expect mode file defs desc
	IFS='|' read -r expect mode file defs desc <<<"$spec"
	local d="$tmp/c$n" out="$tmp/$n.tap" ok=1 why=""
	mkdir -p "$d"
	cp "$here"/*.pml "$d"/
	# shellcheck disable=SC2086
	{
		cd "$d" || exit 1
		# gcc -O2 costs 7 s of CPU on pan.c, -O0 1 s, and pan at -O0 runs
		# about half as fast: -O2 pays only for the long searches (pass:long,
		# more than about 6 s of search at -O2).  Every other check -- the
		# counterexamples (which stop at the first one, within a second) and
		# the shorter passes -- is built without optimisation.  A long
		# search gets a hash table of 2^24 slots (128 MB): on the largest,
		# -O2 and 2^24 cut pan's CPU time by about a fifth against -O1 and
		# 2^22.
		local cflags="-DCOLLAPSE -DMEMLIM=2048 -DVECTORSZ=2048"
		local panflags="-m1000000"
		if [ "$expect" = pass:long ]; then
			cflags="-O2 $cflags"
			panflags="$panflags -w24"
		else
			cflags="-O0 $cflags"
			panflags="$panflags -w22"
		fi
		if [ "$mode" = safety ]; then
			cflags="$cflags -DSAFETY -DNOCLAIM"
		else
			cflags="$cflags -DNFAIR=3"
			panflags="$panflags -a -f"
		fi
		local t0 t1
		t0=$(date +%s.%N)
		if ! spin -a $defs "$file" >spin.log 2>&1; then
			ok=0; why="spin -a failed: $(grep -m3 -i error spin.log | tr '\n' ' ')"
		elif ! build_pan "$cflags" >gcc.log 2>&1; then
			ok=0; why="gcc failed: $(grep -m3 error gcc.log | tr '\n' ' ')"
		else
			cpu_of pan.cpu ./pan $panflags >pan.log 2>&1
			t1=$(date +%s.%N)
			local errors stored trans depth mem
			errors=$(sed -n 's/.*errors: \([0-9]*\).*/\1/p' pan.log | head -1)
			stored=$(sed -n 's/^ *\([0-9.e+]*\) states, stored.*/\1/p' pan.log | head -1)
			trans=$(sed -n 's/^ *\([0-9.e+]*\) transitions.*/\1/p' pan.log | head -1)
			depth=$(sed -n 's/.*depth reached \([0-9]*\).*/\1/p' pan.log | head -1)
			mem=$(sed -n 's/^ *\([0-9.]*\)[[:space:]]*total actual memory usage.*/\1/p' pan.log | head -1)
			printf '# %s: spin -a %s; pan %s\n' "$file" "$defs" "$panflags" >>"$out.c"
			printf '#   states stored %s, transitions %s, depth reached %s, memory %s MB, %.1f s (cpu: gcc %s, pan %s s)\n' \
				"${stored:-?}" "${trans:-?}" "${depth:-?}" "${mem:-?}" \
				"$(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }')" \
				"$(tr -d '\n' <gcc.cpu)" "$(cat pan.cpu)" >>"$out.c"
			if grep -q "max search depth too small" pan.log; then
				ok=0; why="search depth truncated (-m too small)"
			elif grep -qi "reached -DMEMLIM bound\|out of memory" pan.log; then
				ok=0; why="memory bound reached: search incomplete"
			elif [ -z "$errors" ]; then
				ok=0; why="could not read pan's result"
			elif [ "${expect%:long}" = pass ]; then
				if [ "$errors" != 0 ]; then
					ok=0; why="property violated: $(grep -m1 -E 'assertion violated|acceptance cycle|invalid end state' pan.log)"
				elif grep -q "Search not completed" pan.log; then
					ok=0; why="search not completed"
				fi
			else
				local want=${expect#fail:}
				local viol
				viol=$(grep -m1 -E 'assertion violated|acceptance cycle|invalid end state' pan.log)
				if [ "$errors" = 0 ]; then
					ok=0; why="expected a counterexample, none found (a broken variant or a negative check passed)"
				elif ! grep -m1 -E 'assertion violated|acceptance cycle' pan.log | grep -qF -- "$want"; then
					ok=0; why="counterexample of the wrong kind: $viol (wanted: $want)"
				elif ! spin -t $defs "$file" >trail.log 2>&1 || ! grep -qE 'assertion violated|START OF CYCLE' trail.log; then
					ok=0; why="the counterexample trail does not replay"
				else
					printf '#   counterexample (trail replayed by spin -t): %s\n' "$viol" >>"$out.c"
					if [ -n "${SPIN_TRAILS:-}" ]; then
						spin -t -p $defs "$file" 2>&1 | sed 's/^/#     /' >>"$out.c"
					fi
				fi
			fi
		fi
	}
	if [ "$ok" = 1 ]; then
		echo "ok $n - $desc" >"$out"
		echo 0 >"$tmp/$n.rc"
	else
		echo "not ok $n - $desc" >"$out"
		echo "#   FAILED: $why" >>"$out.c"
		echo 1 >"$tmp/$n.rc"
	fi
	rm -rf "$d"
}

if [ -n "${SPIN_ONLY:-}" ]; then
	kept=()
	for c in "${checks[@]}"; do [[ $c == *"$SPIN_ONLY"* ]] && kept+=("$c"); done
	checks=("${kept[@]}")
fi
total=${#checks[@]}
echo "1..$total"
start=$(date +%s)

# Start the longest searches first, so that the last to end is a short one
# and no core waits idle at the end: the long searches (the durability,
# rewind and failover models first, up to half a minute of CPU each), then
# the other passes, then the counterexamples (seconds each).
weight() {
	local w=0
	case $1 in pass:long*) w=$((w + 8)) ;; pass*) w=$((w + 4)) ;; esac
	case $1 in *DURABILITY*) w=$((w + 2)) ;; esac
	case $1 in *REWIND* | *FAILOVER*) w=$((w + 2)) ;; esac
	case $1 in *NRUN=3*) w=$((w + 1)) ;; esac
	echo "$w"
}
order=$(for i in "${!checks[@]}"; do
	printf '%s %s\n' "$(weight "${checks[$i]}")" "$i"; done | sort -s -k1,1nr | cut -d' ' -f2)

running=0
for i in $order; do
	n=$((i + 1))
	run_check "$n" "${checks[$i]}" &
	running=$((running + 1))
	if [ "$running" -ge "$jobs" ]; then
		wait -n
		running=$((running - 1))
	fi
done
wait

failed=0
for n in $(seq 1 "$total"); do
	[ -f "$tmp/$n.tap.c" ] && cat "$tmp/$n.tap.c"
	if [ -f "$tmp/$n.tap" ]; then
		cat "$tmp/$n.tap"
	else
		echo "not ok $n - check $n did not report"
	fi
	rc=$(cat "$tmp/$n.rc" 2>/dev/null || echo 1)
	[ "$rc" = 0 ] || failed=$((failed + 1))
done

# the CPU time of every process the checks ran (the second line of `times`)
times >"$tmp/times"
cpu=$(awk 'NR == 2 { n = 0; for (i = 1; i <= 2; i++) { split($i, t, /[ms]/); n += t[1] * 60 + t[2] } printf "%.0f", n }' "$tmp/times")
echo "# spin checks: $((total - failed)) passed, $failed failed ($(($(date +%s) - start)) s, cpu $cpu s)"
[ "$failed" = 0 ]
