#!/usr/bin/env bash
# The private folders outside the checkouts (idem_private_dir: test/run's,
# make demo's and make bench's copies of PostgreSQL) do not pile up: taking
# a checkout's folder (idem_private_take, as test/run does) removes those
# of checkouts that no longer exist, and only those: not one a run holds,
# not one without the marker that records its checkout (made before it, or
# not by idem), nor one whose marker names another checkout than its name,
# nor a link.  make clean-test refuses a held folder.  All under a
# temporary IDEM_PRIVATE_BASE.  TAP.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
. "$ROOT/test/lib/common.sh"
T=$(mktemp -d "${TMPDIR:-/tmp}/idem-private-prune.XXXXXX")
holder=""
trap '[ -z "$holder" ] || kill "$holder" 2>/dev/null; rm -rf "$T"' EXIT
. "$ROOT/test/lib/tap.sh"
export IDEM_PRIVATE_BASE=$T/base
mkdir -p "$IDEM_PRIVATE_BASE" "$T/co/a" "$T/co/b" "$T/co/c" "$T/co/d" "$T/co/e" "$T/elsewhere"
P() { _idem_private_path "$T/co/$1"; }

# a, b, c: folders that runs took, each with a copy in it.
for c in a b c; do
	(idem_private_take "$T/co/$c" && mkdir "$IDEM_PRIVATE_DIR/pgroot" &&
		echo x >"$IDEM_PRIVATE_DIR/pgroot/x") 2>"$T/err" || { cat "$T/err" >&2; }
done
[ -f "$(P a)/pgroot/x" ] && [ "$(cat "$(P a)/.idem-checkout")" = "$T/co/a" ]
ok $? "a taken folder records its checkout (.idem-checkout)"
# d: a folder made before the marker; e: a marker naming another checkout
# than its folder's name; a link named as a folder would be, to a folder
# that is not one.
mkdir -p "$(P d)/pgroot" "$(P e)/pgroot"
echo "$T/co/gone" >"$(P e)/.idem-checkout"
ln -s "$T/elsewhere" "$IDEM_PRIVATE_BASE/idem-$(id -u)-0123456789ab"
echo "$T/co/gone" >"$T/elsewhere/.idem-checkout"
# What a prune left moved aside when it was stopped mid-way.
mkdir -p "$IDEM_PRIVATE_BASE/idem-$(id -u)-gone.Ab12Cd/pgroot"
# c is held by a run that goes on (its checkout deleted under it).
(idem_private_take "$T/co/c" 2>/dev/null && echo held >"$T/held" && exec sleep 300) &
holder=$!
for _ in $(seq 1 100); do [ -s "$T/held" ] && break; sleep 0.1; done
[ -s "$T/held" ]
ok $? "a run holds c's folder"
rm -rf "$T/co/a" "$T/co/c" "$T/co/d" "$T/co/e"

# What test/run does in checkout b.
(idem_private_take "$T/co/b" && echo "$IDEM_PRIVATE_DIR" >"$T/took") 2>"$T/err"
st=$?
sed 's/^/# /' "$T/err"
[ $st -eq 0 ] && [ "$(cat "$T/took")" = "$(P b)" ] && [ -f "$(P b)/pgroot/x" ]
ok $? "test/run's take in checkout b: b's folder, kept"
[ ! -e "$(P a)" ]
ok $? "the folder of a, whose checkout was deleted, is removed"
grep -qF "$(P a)" "$T/err"
ok $? "... and the removal is said"
[ -f "$(P c)/pgroot/x" ]
ok $? "the folder of c, deleted but held by a run, is kept"
[ -d "$(P d)/pgroot" ] && [ -d "$(P e)/pgroot" ]
ok $? "a folder with no marker, and one whose marker names another checkout, are kept"
[ -L "$IDEM_PRIVATE_BASE/idem-$(id -u)-0123456789ab" ] && [ -f "$T/elsewhere/.idem-checkout" ]
ok $? "a link named as a private folder, and what it points to, are kept"
left=$(find "$IDEM_PRIVATE_BASE" -mindepth 1 -maxdepth 1 -name "idem-$(id -u)-gone.*" | wc -l)
[ "$left" -eq 0 ]
ok $? "nothing moved aside by a prune is left (nor what one stopped mid-way left)"

# make clean-test refuses c while the run holds it.
! idem_private_remove "$T/co/c" >/dev/null 2>&1 && [ -d "$(P c)" ]
ok $? "make clean-test (idem_private_remove) refuses a held folder"

# The run ends: the next take removes c's folder.
kill "$holder" && wait "$holder" 2>/dev/null
holder=""
(idem_private_take "$T/co/b") 2>/dev/null
[ ! -e "$(P c)" ] && [ -d "$(P b)" ]
ok $? "once that run ended, the next take removes c's folder"
# A take that waits while a prune holds the folder, and finds it moved
# aside once the lock is released, makes it again.
(exec 6>>"$(P b)/.idem-lock" && flock -x 6 && echo locked >"$T/xlocked" &&
	while [ ! -e "$T/go" ]; do sleep 0.05; done && mv -T "$(P b)" "$T/moved-b") &
mover=$!
for _ in $(seq 1 100); do [ -s "$T/xlocked" ] && break; sleep 0.1; done
(idem_private_take "$T/co/b" 2>/dev/null &&
	[ "$(stat -L -c %d:%i /dev/fd/7)" = "$(stat -c %d:%i "$IDEM_PRIVATE_DIR/.idem-lock")" ] &&
	echo "$IDEM_PRIVATE_DIR" >"$T/took2") &
taker=$!
sleep 0.5
touch "$T/go"
wait "$mover" "$taker"
[ -d "$T/moved-b" ] && [ "$(cat "$T/took2" 2>/dev/null)" = "$(P b)" ] && [ -f "$(P b)/.idem-checkout" ]
ok $? "a take that waited on a folder a prune moved aside holds a new one"
echo "1..$n"
