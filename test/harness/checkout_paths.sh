#!/usr/bin/env bash
# make demo from a checkout where the test user cannot go: a copy of this
# tree (its objects included, so little is rebuilt) under a 0700 folder,
# below a read-only parent (a read-only bind mount, in a mount namespace of
# its own) and with spaces in its path.  Runs as root, the way a user runs
# make demo: the throwaway PostgreSQL runs as the test user, from the
# private copy that the setup makes (idem_pg_private_for), which must lie
# where that user can read and run it.  TAP; skipped when not root.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
. "$ROOT/test/lib/tap.sh"
if [ "$(id -u)" -ne 0 ]; then
	echo "1..0 # SKIP needs root (make test runs it as root)"
	exit 0
fi
command -v unshare >/dev/null 2>&1 || { echo "1..0 # SKIP no unshare (util-linux)"; exit 0; }
T=$(mktemp -d /tmp/idem-checkout-paths.XXXXXX)
chmod 755 "$T"
trap 'rm -rf "$T"' EXIT

# $T/private (0700) / ro parent (read-only) / idem checkout (writable: the
# build writes objects into it, as any checkout's does).
P="$T/private/ro parent"
C="$P/idem checkout"
mkdir -p "$C" "$T/real/idem checkout" && chmod 700 "$T/private"
(cd "$ROOT" && tar --exclude=.git --exclude=tmp_check --exclude='tmp_pgroot*' \
	--exclude=results -cf - .) | (cd "$T/real/idem checkout" && tar -xf -)
ok $? "a copy of the tree at '$C' ($T/private is 0700, '$P' read-only)"

# The private copies go to a folder of the test's own (removed with it).
unshare -m --propagation private env -u IDEM_PG_ROOT -u IDEM_PG_BINDIR \
	IDEM_PRIVATE_BASE="$T" P="$P" C="$C" R="$T/real/idem checkout" bash -c '
	mount --bind "$P" "$P" && mount -o remount,ro,bind "$P" &&
		mount --bind "$R" "$C" || exit 3
	! touch "$P/.w" 2>/dev/null || { echo "the parent is writable" >&2; exit 3; }
	cd "$C" && timeout 300 bash test/demo --short' >"$T/demo.out" 2>&1
st=$?
ok $st "make demo's script from there: a short run of the main job verifies exactly-once"
[ $st -eq 0 ] || tail -n 25 "$T/demo.out" | sed 's/^/# /'
leftover=$(cd "$T/real/idem checkout" && ls -d tmp_pgroot* 2>/dev/null | grep -vx 'tmp_pgroot.lock')
[ -z "$leftover" ]
ok $? "nothing that the test user runs was put in the checkout (${leftover:-none})"
echo "1..$n"
