# test/lib/citus.sh: Citus for the citus suite (test/citus), built once per
# machine.  Source it after common.sh; it defines functions only.
#
# Citus is not packaged for Debian 12.  When the machine's PostgreSQL has no
# Citus, its source (IDEM_CITUS_SRC, else shared/deps beside the checkout)
# is built once, against the machine's PostgreSQL (without JIT bitcode,
# which only costs build time here), and staged with
# make install DESTDIR= in a cache outside the checkout (IDEM_CITUS_CACHE,
# default /var/cache/idem).  Each run then copies the staged library and
# extension files into the private PostgreSQL copy (idem_pg_private), which
# is made anew every run.
#
#   idem_citus_prepare ROOT   make Citus available in IDEM_PG_ROOT; on
#                             failure sets IDEM_CITUS_SKIP to the reason
#                             and returns 1

IDEM_CITUS_VERSION=13.2.2

# The source tarball, or nothing.
idem_citus_src() {
	local root=$1 f
	for f in "${IDEM_CITUS_SRC:-}" "$root/../shared/deps/citus-$IDEM_CITUS_VERSION.tar.gz"; do
		[ -n "$f" ] && [ -e "$f" ] && { (cd "$(dirname "$f")" && echo "$PWD/$(basename "$f")"); return 0; }
	done
	return 1
}

idem_citus_cache() {
	local base=${IDEM_CITUS_CACHE:-/var/cache/idem} pgver
	if ! { mkdir -p "$base" && [ -w "$base" ]; } 2>/dev/null; then
		base=${XDG_CACHE_HOME:-$HOME/.cache}/idem
		mkdir -p "$base" || return 1
	fi
	# Built against this PostgreSQL's headers: its exact version names the build.
	pgver=$(/usr/lib/postgresql/$IDEM_PG_MAJOR/bin/pg_config --version | awk '{print $2}')
	echo "$base/citus-$IDEM_CITUS_VERSION-pg$pgver"
}

# idem_citus_build SRC CACHE: configure, build and stage Citus; the staged
# tree is CACHE/stage, complete once CACHE/stage.ok exists.
idem_citus_build() {
	local src=$1 cache=$2 patch build log
	log=$cache/build.log
	build=$cache/build
	rm -rf "$build" "$cache/stage" "$cache/stage.ok"
	mkdir -p "$build" || return 1
	echo "idem: building Citus $IDEM_CITUS_VERSION once for this machine (a few minutes; log: $log)"
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
			make install with_llvm=no DESTDIR="$cache/stage"
	} >"$log" 2>&1 || { echo "idem: the Citus build failed; see $log" >&2; tail -n 20 "$log" >&2; return 1; }
	rm -rf "$build"
	touch "$cache/stage.ok"
}

idem_citus_prepare() {
	local root=$1 m=$IDEM_PG_MAJOR src cache
	IDEM_CITUS_SKIP=
	# The machine's PostgreSQL has Citus: the private copy has it too.
	if [ -f "/usr/lib/postgresql/$m/lib/citus.so" ]; then
		[ -f "$IDEM_PG_ROOT/usr/lib/postgresql/$m/lib/citus.so" ] && return 0
	fi
	cache=$(idem_citus_cache) || { IDEM_CITUS_SKIP="no writable cache directory for the Citus build"; return 1; }
	if [ ! -f "$cache/stage.ok" ]; then
		if ! src=$(idem_citus_src "$root"); then
			IDEM_CITUS_SKIP="Citus is not installed and its source is not available (set IDEM_CITUS_SRC to citus-$IDEM_CITUS_VERSION.tar.gz, or put it in ../shared/deps)"
			return 1
		fi
		IDEM_EXTRA_PACKAGES="liblz4-dev:/usr/include/lz4.h libzstd-dev:/usr/include/zstd.h libkrb5-dev:/usr/include/krb5.h ${IDEM_EXTRA_PACKAGES:-}" \
			idem_ensure_deps || { IDEM_CITUS_SKIP="could not install Citus's build dependencies"; return 1; }
		(
			exec 8>>"$cache.lock"
			flock 8
			[ -f "$cache/stage.ok" ] || idem_citus_build "$src" "$cache"
		) || { IDEM_CITUS_SKIP="the Citus build failed (see $cache/build.log)"; return 1; }
	fi
	# Libraries and extension files only: include/ in the copy is a link
	# to the machine's own headers.
	cp -a "$cache/stage/usr/lib/postgresql/$m/lib/." "$IDEM_PG_ROOT/usr/lib/postgresql/$m/lib/" &&
		cp -a "$cache/stage/usr/share/postgresql/$m/extension/." "$IDEM_PG_ROOT/usr/share/postgresql/$m/extension/" &&
		chmod -R a+rX "$IDEM_PG_ROOT/usr/lib/postgresql/$m/lib" "$IDEM_PG_ROOT/usr/share/postgresql/$m/extension" ||
		{ IDEM_CITUS_SKIP="could not install Citus into $IDEM_PG_ROOT"; return 1; }
}
