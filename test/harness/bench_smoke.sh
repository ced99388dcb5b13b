#!/usr/bin/env bash
# make bench's runner client (bench/client_bench.c, which the runner figures
# in bench/README.md come from) still builds against the client library
# without warnings, and its modes do what the README says they do, on a
# throwaway PostgreSQL and Valkey: c-ledger-dup (the C client's own
# ledger) completes each key once with one transfer, the one-statement run
# and (3) apply new keys, a producer's duplicate is replayed by PostgreSQL,
# and late redeliveries are answered by Valkey.  A few seconds of runs, no
# measurement.  TAP.  Needs the harness's environment (IDEM_PG_ROOT or
# IDEM_PG_BINDIR, the extension installed there, the client built).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
. "$ROOT/bench/lib.sh"	# test/lib/common.sh, and how make bench builds client_bench
T=$(mktemp -d /tmp/idem-bench-smoke.XXXXXX)
chmod 777 "$T"
cleanup() { idem_pg_stop "$T"; idem_valkey_stop "$T"; rm -rf "$T"; }
trap cleanup EXIT
. "$ROOT/test/lib/tap.sh"

bench_client_bench "$T/client_bench" "$ROOT" -Wall -Wextra -Werror -Wno-missing-field-initializers 2>"$T/cc.err"
ok $? "bench/client_bench.c builds with -Wall -Wextra -Werror"
sed 's/^/# /' "$T/cc.err"
[ -x "$T/client_bench" ] || { echo "1..$n"; exit 1; }

PGPORT=$(idem_free_port)
VKPORT=$(idem_free_port)
idem_valkey_start "$T" "$VKPORT" || exit 1
idem_pg_start "$T" "$PGPORT" "idem.valkey_port = $VKPORT" || exit 1
cp "$ROOT/bench/setup.sql" "$T/" && chmod a+r "$T/setup.sql"
PSQL=(idem_as_test_user "$(idem_pg_bindir)/psql" -X -q -At -h "$T" -p "$PGPORT" -U postgres -d postgres)
"${PSQL[@]}" -v ON_ERROR_STOP=1 -f "$T/setup.sql" >/dev/null
ok $? "bench/setup.sql loads"
CONN="host=$T port=$PGPORT user=postgres dbname=postgres options=-csynchronous_commit=on"

# run MODE SECONDS: the mode's runs/s (0 when it failed); its output in $T/MODE
run() {
	BENCH_REDELIVERY_MS=100 idem_as_test_user "$T/client_bench" "$1" 2 "$2" "$CONN" \
		127.0.0.1 "$VKPORT" >"$T/$1" 2>"$T/$1.err" || { sed 's/^/# /' "$T/$1.err"; echo 0; return; }
	tail -1 "$T/$1" | awk '{print int($3)}'
}
q() { "${PSQL[@]}" -c "$1"; }

rate=$(run c-ledger-dup 1)
ok $(( rate > 0 ? 0 : 1 )) "c-ledger-dup runs ($rate runs/s)"
got=$(q "SELECT count(*) = count(*) FILTER (WHERE status = 'completed')
	  AND count(*) = (SELECT count(*) FROM transfers)
	  AND count(*) = count(*) FILTER (WHERE (outcome->>'transfer_id')::bigint IN (SELECT id FROM transfers))
	  AND count(*) > 0 FROM hand_keys")
ok $([ "$got" = t ] && echo 0 || echo 1) "... every key completed once, with its one transfer"
rows=$(q "SELECT count(*) FROM hand_keys")
ok $(( rows > 0 && rows * 2 <= rate + 2 ? 0 : 1 )) "... every key run twice ($rate runs, $rows keys)"
q "TRUNCATE hand_keys, transfers"

for m in hand-new run-new-sql-first run-new-pipe-first; do
	rate=$(run $m 1)
	ok $(( rate > 0 ? 0 : 1 )) "$m runs ($rate runs/s)"
done
keys=$(q "SELECT count(*) FROM idempotency_keys")
rate=$(run run-dup-sql-first 1)
added=$(( $(q "SELECT count(*) FROM idempotency_keys") - keys ))
runs=$(awk '{print int($3)}' <(tail -1 "$T/run-dup-sql-first"))
ok $(( rate > 0 && added > 0 && added * 2 <= runs + 2 ? 0 : 1 )) \
	"run-dup-sql-first: every key twice, one ledger row ($runs runs, $added rows)"

run run-late-sql-first 2 >/dev/null
read -r _ _ _ total redel from_vk <<<"$(grep '^late ' "$T/run-late-sql-first")"
ok $(( ${redel:-0} > 0 && ${from_vk:-0} > 0 ? 0 : 1 )) \
	"run-late-sql-first: redeliveries answered by Valkey (${from_vk:-0} of ${redel:-0}, ${total:-0} runs)"
echo "1..$n"
