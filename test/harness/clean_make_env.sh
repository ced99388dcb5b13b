#!/usr/bin/env bash
# Third-party builds (PostgreSQL 18, Citus: idem_cached_build in
# test/lib/cache.sh) run as top-level makes even when make test or make
# demo calls them from inside make: a small fake source tree whose Makefile
# fails under an inherited MAKELEVEL or command-line variable (as
# PostgreSQL's header generation does at MAKELEVEL > 0), built through
# idem_cached_build into a temporary IDEM_CACHE_DIR.  TAP.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
. "$ROOT/test/lib/common.sh"
. "$ROOT/test/lib/cache.sh"
T=$(mktemp -d "${TMPDIR:-/tmp}/idem-clean-make.XXXXXX")
trap 'rm -rf "$T"' EXIT
. "$ROOT/test/lib/tap.sh"

# The fake third party: like PostgreSQL's src/Makefile.global, it makes
# what the rest needs only at MAKELEVEL 0, and it must not see the calling
# make's command-line variables.
mkdir -p "$T/src"
cat >"$T/src/Makefile" <<'EOT'
PREFIX = /nonexistent
all:
ifneq ($(MAKELEVEL),0)
	@echo "fake: at MAKELEVEL $(MAKELEVEL): generated.h is not made" >&2; exit 1
endif
ifneq ($(origin PG_CONFIG),undefined)
	@echo "fake: PG_CONFIG came from the calling make ($(origin PG_CONFIG))" >&2; exit 1
endif
	@echo built >generated.h
install: all
	@mkdir -p $(PREFIX) && cp generated.h $(PREFIX)/
EOT
_fake_make() {
	local prefix=$1 tmp=$2
	cp -a "$T/src/." "$tmp/" &&
		make -C "$tmp" >"$tmp/build.log" 2>&1 &&
		make -C "$tmp" install PREFIX="$prefix" >>"$tmp/build.log" 2>&1 ||
		{ cat "$tmp/build.log" >&2; return 1; }
}

# What a recipe of `make -j2 test PG_CONFIG=x` has in its environment
# (make test's own, when this runs there), and the same given to the
# function alone (VAR=value fn: a scope of its own over the environment).
dir=$(export IDEM_CACHE_DIR="$T/cache" MAKELEVEL=1 MFLAGS=-j2 \
	MAKEFLAGS=" -j2 --jobserver-auth=3,4 -- PG_CONFIG=x" \
	MAKEOVERRIDES='${-*-command-variables-*-}' GNUMAKEFLAGS=--no-print-directory
	MAKELEVEL=2 MAKEFLAGS="-- PG_CONFIG=y" idem_cached_build fake-1 _fake_make 2>"$T/err")
ok $? "a cached build run from inside make builds as a top-level make"
sed 's/^/# /' "$T/err"
[ "$dir" = "$T/cache/fake-1" ] && [ -f "$dir/generated.h" ] && [ -e "$dir/.idem-complete" ]
ok $? "... and is cached complete in IDEM_CACHE_DIR"
secs=$(IDEM_CACHE_DIR="$T/cache" idem_built_here fake-1)
ok $? "... and says this script built it, in ${secs:-?} s (idem_built_here)"
(
	export MAKELEVEL=1 MAKEFLAGS=-j2 MFLAGS=-j2
	idem_clean_make_env 2>/dev/null
	! env | grep -qE '^(MAKELEVEL|MAKEFLAGS|MFLAGS)='
)
ok $? "idem_clean_make_env leaves no make variable in the environment"
# Both real builds go through idem_cached_build (which cleans the
# environment), never straight to their make functions.
calls=$(grep -hE '_idem_(pg18|citus)_make' "$ROOT/test/lib/cache.sh" "$ROOT/test/lib/citus.sh" |
	grep -vE '^[[:space:]]*#|^_idem_(pg18|citus)_make\(\)' | grep -vc 'idem_cached_build')
[ "$calls" -eq 0 ]
ok $? "the PostgreSQL 18 and Citus builds are made only through idem_cached_build"
echo "1..$n"
