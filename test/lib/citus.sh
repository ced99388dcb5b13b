# test/lib/citus.sh: Citus for the citus suite (test/citus), built once per
# machine.  Source it after common.sh and cache.sh (it sources cache.sh if
# that is not loaded yet); it defines functions only.
#
# Citus is not packaged for Debian 12.  When the machine's PostgreSQL has no
# Citus, its source (IDEM_CITUS_SRC, else shared/deps beside the checkout)
# is built once, against the machine's PostgreSQL (without JIT bitcode,
# which only costs build time here), and staged with make install DESTDIR=
# as a cached build (idem_cached_build, test/lib/cache.sh), in
# $(idem_cache_dir)/citus-VERSION-pgPGVERSION/stage.  Each run then copies
# the staged library and extension files into the private PostgreSQL copy
# (idem_pg_private), which is made anew every run.
#
#   idem_citus_prepare ROOT   make Citus available in IDEM_PG_ROOT; on
#                             failure sets IDEM_CITUS_SKIP to the reason
#                             and returns 1

declare -F idem_cached_build >/dev/null || . "$(dirname "${BASH_SOURCE[0]}")/cache.sh"

IDEM_CITUS_VERSION=13.2.2

# The source tarball, or nothing.
idem_citus_src() {
	local root=$1 f deps
	deps=$(idem_deps_dir "$root") || deps=$root/../shared/deps
	for f in "${IDEM_CITUS_SRC:-}" "$deps/citus-$IDEM_CITUS_VERSION.tar.gz"; do
		[ -n "$f" ] && [ -e "$f" ] && { (cd "$(dirname "$f")" && echo "$PWD/$(basename "$f")"); return 0; }
	done
	return 1
}

# The cache key: Citus's version and the exact version of the PostgreSQL
# whose headers it is built against.
idem_citus_name() {
	local pgver
	pgver=$(/usr/lib/postgresql/$IDEM_PG_MAJOR/bin/pg_config --version | awk '{print $2}')
	echo "citus-$IDEM_CITUS_VERSION-pg$pgver"
}

# _idem_citus_make PREFIX TMP (for idem_cached_build): configure and build
# Citus in TMP, stage it in PREFIX/stage.
_idem_citus_make() {
	local prefix=$1 tmp=$2 src=$_IDEM_CITUS_SRC patch build=$2/build log=$2/build.log
	mkdir -p "$build" || return 1
	echo "idem: building Citus $IDEM_CITUS_VERSION once for this machine (a few minutes; log: $log)" >&2
	{
		if [ -d "$src" ]; then
			cp -a "$src/." "$build/"
		else
			tar -xzf "$src" -C "$build" --strip-components=1
		fi &&
			patch=$(dirname "$src")/citus-$IDEM_CITUS_VERSION-pg15.20.patch &&
			{ [ ! -f "$patch" ] || grep -q 'PG_VERSION_NUM < 150020' "$build/src/include/pg_version_compat.h" ||
				(cd "$build" && patch -p1 <"$patch"); } &&
			cd "$build" &&
			./configure --without-libcurl PG_CONFIG=/usr/lib/postgresql/$IDEM_PG_MAJOR/bin/pg_config &&
			make -j"$(nproc)" with_llvm=no &&
			make install with_llvm=no DESTDIR="$prefix/stage"
	} >"$log" 2>&1 || { echo "idem: the Citus build failed:" >&2; tail -n 20 "$log" >&2; return 1; }
	# What earlier versions of this file took as the mark of a complete build.
	touch "$prefix/stage.ok"
}

idem_citus_prepare() {
	local root=$1 m=$IDEM_PG_MAJOR cache
	IDEM_CITUS_SKIP=
	# The machine's PostgreSQL has Citus: the private copy has it too.
	if [ -f "/usr/lib/postgresql/$m/lib/citus.so" ]; then
		[ -f "$IDEM_PG_ROOT/usr/lib/postgresql/$m/lib/citus.so" ] && return 0
	fi
	cache=$(idem_cache_dir)/$(idem_citus_name)
	# A build staged by an earlier version of this file (stage.ok, no
	# .idem-complete) is the same build: keep it.
	[ -f "$cache/stage.ok" ] && [ ! -e "$cache/.idem-complete" ] && touch "$cache/.idem-complete" 2>/dev/null
	if [ ! -e "$cache/.idem-complete" ]; then
		if ! _IDEM_CITUS_SRC=$(idem_citus_src "$root"); then
			IDEM_CITUS_SKIP="Citus is not installed and its source is not available (set IDEM_CITUS_SRC to citus-$IDEM_CITUS_VERSION.tar.gz, or put it in ../shared/deps)"
			return 1
		fi
		IDEM_EXTRA_PACKAGES="liblz4-dev:/usr/include/lz4.h libzstd-dev:/usr/include/zstd.h libkrb5-dev:/usr/include/krb5.h ${IDEM_EXTRA_PACKAGES:-}" \
			idem_ensure_deps || { IDEM_CITUS_SKIP="could not install Citus's build dependencies"; return 1; }
	fi
	cache=$(idem_cached_build "$(idem_citus_name)" _idem_citus_make) ||
		{ IDEM_CITUS_SKIP="the Citus build failed (see the log above)"; return 1; }
	# Libraries and extension files only: include/ in the copy is a link
	# to the machine's own headers.
	cp -a "$cache/stage/usr/lib/postgresql/$m/lib/." "$IDEM_PG_ROOT/usr/lib/postgresql/$m/lib/" &&
		cp -a "$cache/stage/usr/share/postgresql/$m/extension/." "$IDEM_PG_ROOT/usr/share/postgresql/$m/extension/" &&
		chmod -R a+rX "$IDEM_PG_ROOT/usr/lib/postgresql/$m/lib" "$IDEM_PG_ROOT/usr/share/postgresql/$m/extension" ||
		{ IDEM_CITUS_SKIP="could not install Citus into $IDEM_PG_ROOT"; return 1; }
}
