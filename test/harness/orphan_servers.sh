#!/usr/bin/env bash
# The test user's servers whose folder no longer exists, as a run killed
# from outside leaves them once its temp folder is removed, are stopped at
# the start of the next run (idem_stop_orphans, which test/run calls
# first); the servers of a run still going, whose folders exist, are left
# alone, and so is a process of the test user that is not a server.
# TAP.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
. "$ROOT/test/lib/common.sh"
T=$(mktemp -d "${TMPDIR:-/tmp}/idem-orphans.XXXXXX")
chmod 755 "$T"
mkdir "$T/gone" "$T/live" "$T/other"
[ "$(id -u)" -eq 0 ] && chown "$(idem_test_user)" "$T/gone" "$T/live" "$T/other"
other_pid=""
trap 'idem_stop_leftovers "$T" 2>/dev/null; [ -n "$other_pid" ] && kill "$other_pid" 2>/dev/null; rm -rf "$T"' EXIT
. "$ROOT/test/lib/tap.sh"
answers() { "$(idem_valkey_cli)" -p "$1" ping 2>/dev/null | grep -q PONG; }

# Two servers of the test user, as two runs' suites start them.
gone_port=$(idem_free_port)
live_port=$(idem_free_port)
idem_as_test_user bash -c ". '$ROOT/test/lib/common.sh'; idem_valkey_start '$T/gone' $gone_port" &&
	idem_as_test_user bash -c ". '$ROOT/test/lib/common.sh'; idem_valkey_start '$T/live' $live_port"
ok $? "two Valkeys of $(idem_test_user) start"
gone_pid=$(cat "$T/gone/valkey.pid")
# A process of the test user that is not a server, its folder deleted too.
idem_as_test_user bash -c "cd '$T/other' && exec sleep 600" 2>/dev/null &
other_pid=$!
sleep 0.3
# The run killed from outside: its folder removed, its server still up.
rm -rf "$T/gone" "$T/other"
answers "$gone_port"
ok $? "a Valkey whose folder was removed still answers (the leak)"
idem_orphan_pids | grep -qx "$gone_pid"
ok $? "... and is listed as an orphan"

# (only this test's: what the start of a run stops, bounded to our folder)
idem_stop_orphans "$T" 2>/dev/null
! answers "$gone_port"
ok $? "the next run's start stops it"
answers "$live_port"
ok $? "... and leaves the Valkey of a run still going, whose folder exists"
kill -0 "$other_pid" 2>/dev/null
ok $? "... and a process of $(idem_test_user) that is not a server"
grep -q '^idem_stop_orphans$' "$ROOT/test/run"
ok $? "test/run calls idem_stop_orphans"
idem_valkey_stop "$T/live"
echo "1..$n"
