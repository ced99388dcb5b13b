#!/usr/bin/env bash
# A suite that hits its time limit, or fails, leaves no server running
# (idem_limited in test/lib/common.sh, which test/suites runs each suite
# with, and test/run's cleanup).  A fake suite starts a daemonized Valkey
# (idem_valkey_start: --daemonize takes it out of the suite's process
# group, which is all that timeout signals), a child of its own, and
# hangs: after its limit nothing of it is left.  The same suite under a
# bare timeout leaves its Valkey answering (what make test used to leave
# behind for hours).  A suite that fails at once leaves nothing either;
# a sibling folder's process is not touched.
# TAP.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
. "$ROOT/test/lib/common.sh"
T=$(mktemp -d "${TMPDIR:-/tmp}/idem-leftovers.XXXXXX")
trap 'idem_stop_leftovers "$T" 2>/dev/null; rm -rf "$T"' EXIT
. "$ROOT/test/lib/tap.sh"
answers() { "$(idem_valkey_cli)" -p "$1" ping 2>/dev/null | grep -q PONG; }

# fake_suite DIR PORT hang|fail: a suite's script that starts a Valkey on
# PORT and a child in DIR, then hangs or fails.
fake_suite() {
	mkdir -p "$1"
	cat >"$1/suite.sh" <<EOT
. "$ROOT/test/lib/common.sh"
cd "$1" || exit 3
idem_valkey_start "$1" $2 || exit 3
sleep 600 &
echo started >"$1/started"
[ "$3" = hang ] && sleep 600
exit 1
EOT
}

# A bare timeout: the daemonized server outlives the suite.
port=$(idem_free_port)
fake_suite "$T/bare" "$port" hang
timeout -k 5 3 bash "$T/bare/suite.sh" >/dev/null 2>&1
[ -f "$T/bare/started" ]
ok $? "a bare timeout ends a suite that hangs after starting its servers"
answers "$port"
ok $? "... but its daemonized Valkey still answers (the leak)"
idem_stop_leftovers "$T/bare" 2>/dev/null
! answers "$port"
ok $? "... until what runs from under its folder is stopped"

# What test/suites does: the suite hits its limit, and nothing is left.
# A process of a sibling folder (as 18's two streams run from tree and
# tree-b side by side) is not its leftover.
port=$(idem_free_port)
fake_suite "$T/hung" "$port" hang
mkdir -p "$T/hung-b"
(cd "$T/hung-b" && exec sleep 600) &
sibling=$!
idem_limited 3 "$T/hung" bash "$T/hung/suite.sh" >/dev/null 2>&1
st=$?
kill -0 "$sibling" 2>/dev/null
ok $? "a process running from a sibling folder ($T/hung-b) is left alone"
kill "$sibling" 2>/dev/null
[ "$st" -eq 124 ] && [ -f "$T/hung/started" ]
ok $? "a suite that hangs after starting its servers hits its time limit (status $st)"
! answers "$port"
ok $? "... its daemonized Valkey is stopped"
[ -z "$(idem_leftover_pids "$T/hung")" ]
ok $? "... and no process runs from under its folder"

# A suite that fails, leaving its server running.
port=$(idem_free_port)
fake_suite "$T/failed" "$port" fail
idem_limited 60 "$T/failed" bash "$T/failed/suite.sh" >/dev/null 2>&1
st=$?
[ "$st" -eq 1 ] && [ -f "$T/failed/started" ]
ok $? "a suite that fails returns its status ($st)"
! answers "$port" && [ -z "$(idem_leftover_pids "$T/failed")" ]
ok $? "... and leaves nothing running"
echo "1..$n"
