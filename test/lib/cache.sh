# test/lib/cache.sh: builds that take minutes, made once per machine and
# kept outside the checkout.  Source it after common.sh.
#
#   idem_cache_dir              where cached builds live: $IDEM_CACHE_DIR, else
#                               /var/cache/idem (root) or ~/.cache/idem
#   idem_cached_build NAME FN   the directory $(idem_cache_dir)/NAME, built by
#                               "FN PREFIX TMP" if it is not there yet, in a
#                               clean make environment
#   idem_built_here NAME        the seconds NAME's build took, if this script
#                               (its pid) made it
#   idem_clean_make_env         forget the make that called us (MAKELEVEL,
#                               MAKEFLAGS, ...), for a third-party build
#   idem_deps_dir ROOT          the shared/deps folder beside the checkout
#   idem_verify_dsc FILE        FILE's SHA-256 matches a .dsc beside it
#   idem_pg18_build             PostgreSQL 18.6 with assertions (cached)
#   idem_pg18_private DIR       a per-checkout copy of that build
#
# A cached build is never modified once made: anything that installs into
# a PostgreSQL (idem itself) works on a per-checkout copy, so checkouts can
# test at the same time.  Builds of the same NAME wait for each other
# (flock on NAME.lock); a build that did not finish leaves no NAME behind.

idem_cache_dir() {
	if [ -n "${IDEM_CACHE_DIR:-}" ]; then
		echo "$IDEM_CACHE_DIR"
	elif [ "$(id -u)" -eq 0 ]; then
		echo /var/cache/idem
	else
		echo "${XDG_CACHE_HOME:-$HOME/.cache}/idem"
	fi
}

# idem_clean_make_env: unset what a calling make exports to its recipes
# (MAKELEVEL, MAKEFLAGS and the rest), in the current shell: call it in the
# subshell a third-party build runs in.  `make test` and `make demo` run the
# harness from inside make; a build started from there would otherwise act
# as a sub-make: PostgreSQL generates its headers (utils/errcodes.h, ...)
# only at MAKELEVEL 0, so its build stopped in src/common on a cold
# machine, and the caller's flags and command-line variables (MAKEFLAGS,
# MAKEOVERRIDES) would reach Citus's and PostgreSQL's own makes too.
# Each is unset until no scope has it: a function called as VAR=value fn
# has its own, over the environment's.
idem_clean_make_env() {
	local v
	for v in MAKELEVEL MAKEFLAGS MFLAGS MAKEOVERRIDES GNUMAKEFLAGS MAKEFILES \
		MAKE_TERMOUT MAKE_TERMERR MAKE_RESTARTS MAKECMDGOALS; do
		while [ -n "${!v+set}" ]; do unset "$v" || break; done
	done
}

# idem_cached_build NAME FN: FN PREFIX must build and install into PREFIX
# (an empty directory that becomes the cached one) and return 0.  Prints the
# cached directory.  The key in NAME must change whenever FN's result would.
idem_cached_build() {
	local name=$1 fn=$2 cache dir tmp began
	cache=$(idem_cache_dir)
	dir=$cache/$name
	mkdir -p "$cache" || return 1
	if [ ! -e "$dir/.idem-complete" ]; then
		(
			exec 8>>"$cache/$name.lock"
			flock 8
			[ -e "$dir/.idem-complete" ] && exit 0
			rm -rf "$dir" "$dir.building"
			tmp=$dir.building
			mkdir -p "$tmp" || exit 1
			# The build installs into its final path (PostgreSQL records
			# it), then marks itself complete.  Third-party makes must run
			# as top-level makes, whoever called us.
			idem_clean_make_env
			began=$SECONDS
			"$fn" "$dir" "$tmp" || exit 1
			# Who built it (the calling script's pid) and in how long, for
			# that script's report (test/run's time line).
			echo "$$ $((SECONDS - began))" >"$dir/.idem-built"
			echo "idem: built $name in $((SECONDS - began)) s" >&2
			touch "$dir/.idem-complete"
			rm -rf "$tmp"
		) || { echo "idem: cached build $name failed" >&2; return 1; }
	fi
	echo "$dir"
}

# idem_built_here NAME: print how many seconds the cached build NAME took,
# and succeed, if the calling script made it (not another run it waited for).
idem_built_here() {
	local by secs
	read -r by secs 2>/dev/null <"$(idem_cache_dir)/$1/.idem-built" || return 1
	[ "$by" = "$$" ] && echo "$secs"
}

# idem_deps_dir ROOT: third-party sources for tests, in shared/deps beside
# the checkout (or beside the main checkout, for a git worktree).
idem_deps_dir() {
	local root=$1 common d
	for d in "$root/../shared/deps"; do
		[ -d "$d" ] && { (cd "$d" && pwd); return 0; }
	done
	common=$(git -C "$root" rev-parse --path-format=absolute --git-common-dir 2>/dev/null) || return 1
	d=$(dirname "$common")/../shared/deps
	[ -d "$d" ] && { (cd "$d" && pwd); return 0; }
	return 1
}

# idem_verify_dsc FILE: the SHA-256 of FILE is the one a Debian source
# description (*.dsc) beside it lists for its name.
idem_verify_dsc() {
	local file=$1 base want have dsc
	base=$(basename "$file")
	for dsc in "$(dirname "$file")"/*.dsc; do
		[ -f "$dsc" ] || continue
		want=$(awk -v f="$base" '/^Checksums-Sha256:/ {on = 1; next}
			/^[^ ]/ {on = 0} on && $3 == f {print $1}' "$dsc")
		[ -n "$want" ] && break
	done
	if [ -z "$want" ]; then
		echo "idem: no .dsc beside $file lists its SHA-256" >&2
		return 1
	fi
	have=$(sha256sum "$file" | cut -d' ' -f1)
	if [ "$have" != "$want" ]; then
		echo "idem: $file: SHA-256 $have, expected $want" >&2
		return 1
	fi
}

IDEM_PG18_VERSION=18.6
IDEM_PG18_CONFIGURE="--enable-tap-tests --enable-cassert --enable-debug --enable-injection-points --without-icu --without-readline"
# Contrib modules the suites use (regress ddl: dblink), built into it too,
# and test modules (tap 019_ring_order: injection_points).
IDEM_PG18_CONTRIB="dblink"
IDEM_PG18_TEST_MODULES="injection_points"

# The tarball: $IDEM_PG18_SRC, else shared/deps beside the checkout.
idem_pg18_tarball() {
	local root=$1 deps
	if [ -n "${IDEM_PG18_SRC:-}" ]; then
		echo "$IDEM_PG18_SRC"
		return 0
	fi
	deps=$(idem_deps_dir "$root") || return 1
	[ -f "$deps/postgresql-18_$IDEM_PG18_VERSION.orig.tar.bz2" ] || return 1
	echo "$deps/postgresql-18_$IDEM_PG18_VERSION.orig.tar.bz2"
}

# The cache key: the version, the configure flags, the contrib and test
# modules and the compiler.
idem_pg18_name() {
	local key
	key=$(printf '%s\n%s\n%s\n%s\n%s\n' "$IDEM_PG18_VERSION" "$IDEM_PG18_CONFIGURE" \
		"$(gcc -dumpfullversion 2>/dev/null)" "$IDEM_PG18_CONTRIB" \
		"$IDEM_PG18_TEST_MODULES" | sha256sum | cut -c1-12)
	echo "pg-$IDEM_PG18_VERSION-$key"
}

_idem_pg18_make() {
	local prefix=$1 tmp=$2 jobs
	jobs=$(nproc 2>/dev/null || echo 2)
	echo "idem: building PostgreSQL $IDEM_PG18_VERSION into $prefix (log: $tmp/build.log)" >&2
	idem_verify_dsc "$_IDEM_PG18_TARBALL" || return 1
	tar -xjf "$_IDEM_PG18_TARBALL" -C "$tmp" || return 1
	(
		cd "$tmp/postgresql-$IDEM_PG18_VERSION" &&
			./configure --prefix="$prefix" $IDEM_PG18_CONFIGURE &&
			make -j"$jobs" &&
			make install &&
			make -C src/test/isolation install &&
			make -C src/test/perl install &&
			for c in $IDEM_PG18_CONTRIB; do make -C "contrib/$c" install || exit 1; done &&
			for m in $IDEM_PG18_TEST_MODULES; do make -C "src/test/modules/$m" install || exit 1; done
	) >"$tmp/build.log" 2>&1 || {
		echo "idem: PostgreSQL $IDEM_PG18_VERSION build failed:" >&2
		tail -n 30 "$tmp/build.log" >&2
		return 1
	}
	# The build tree's pg_isolation_regress and isolationtester.
	cp "$tmp/postgresql-$IDEM_PG18_VERSION/src/test/isolation/pg_isolation_regress" \
		"$tmp/postgresql-$IDEM_PG18_VERSION/src/test/isolation/isolationtester" \
		"$prefix/lib/pgxs/src/test/isolation/" 2>/dev/null
	chmod -R a+rX "$prefix"
}

# idem_pg18_build ROOT: the cached PostgreSQL 18 build, made if missing.
# Prints its directory; fails (with the reason on stderr) if there is no
# tarball or no bison/flex.
idem_pg18_build() {
	local root=$1
	_IDEM_PG18_TARBALL=$(idem_pg18_tarball "$root") || {
		echo "no PostgreSQL $IDEM_PG18_VERSION tarball (set IDEM_PG18_SRC, or put shared/deps beside the checkout)" >&2
		return 1
	}
	idem_cached_build "$(idem_pg18_name)" _idem_pg18_make
}

# idem_pg18_private CACHED DIR: DIR becomes a fresh copy of the cached build
# (about 60 MB), for idem to be installed into.
idem_pg18_private() {
	local cached=$1 dir=$2
	rm -rf "$dir"
	mkdir -p "$(dirname "$dir")" && cp -a "$cached" "$dir" || {
		echo "idem: could not copy $cached into $dir" >&2
		return 1
	}
	chmod -R a+rX "$dir"
}
