# bench/lib.sh: what the bench scripts share.  Source it after setting ROOT
# (the checkout); it sources test/lib/common.sh and defines functions only.
#
#   median                 the median of the numbers on stdin (one a line,
#                          or several to a line between spaces)
#   bench_prepare          alone (not from bench/run): build idem and
#                          install it, as bench/run does
#   bench_server NAME [--no-valkey] CONF...
#                          the server to run against: WORK, PGPORT, VKPORT
#   bench_server_stop      stop and remove what bench_server started
#   bench_client_bench OUT [TREE [CFLAGS...]]
#                          build bench/client_bench.c into OUT
#   bench_base_tree COMMIT NAME
#                          a temporary worktree of COMMIT with its client
#                          library built, for a before/after in one run
. "$ROOT/test/lib/common.sh"

median() { tr -s ' \t' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

# bench_prepare: when the script runs alone (no BENCH_WORK), install what is
# missing, build idem and install it into the checkout's private copy of
# PostgreSQL (or the one IDEM_PG_ROOT names), one run at a time per
# checkout.  From bench/run (BENCH_WORK set), nothing: bench/run did it.
bench_prepare() {
	[ -z "${BENCH_WORK:-}" ] || return 0
	idem_ensure_deps || exit 2
	if [ -z "${IDEM_PG_ROOT:-}" ]; then
		idem_serialize "$ROOT/tmp_pgroot.lock"
		idem_pg_private_for "$ROOT" || exit 2
	fi
	idem_build_install "$ROOT" || exit 1
}

# bench_server NAME [--no-valkey] CONF...: sets WORK (the servers' folder),
# PGPORT and VKPORT.  From bench/run, its servers (BENCH_WORK, BENCH_PGPORT,
# BENCH_VKPORT).  Alone, after bench_prepare: a throwaway RESP server
# (none with --no-valkey: VKPORT is empty) and PostgreSQL preloading idem
# with CONF (postgresql.conf lines; idem.valkey_port added when there is a
# RESP server), the ledgers installed, in /tmp/idem-NAME.XXXXXX; OWN=1, and
# an EXIT trap (bench_server_stop) stops them and removes the folder.  A
# script with its own EXIT trap calls bench_server_stop from it.
bench_server() {
	local name=$1 valkey=1
	shift
	if [ "${1:-}" = --no-valkey ]; then
		valkey=""
		shift
	fi
	OWN=""
	if [ -n "${BENCH_WORK:-}" ]; then
		WORK=$BENCH_WORK
		PGPORT=$BENCH_PGPORT
		VKPORT=${BENCH_VKPORT:-}
		return 0
	fi
	bench_prepare
	WORK=$(mktemp -d "/tmp/idem-$name.XXXXXX")
	chmod 777 "$WORK"
	OWN=1
	trap bench_server_stop EXIT
	trap 'exit 130' INT TERM
	PGPORT=$(idem_free_port)
	VKPORT=""
	if [ -n "$valkey" ]; then
		VKPORT=$(idem_free_port)
		idem_valkey_start "$WORK" "$VKPORT" || exit 1
		set -- "$@" "idem.valkey_port = $VKPORT"
	fi
	idem_pg_start "$WORK" "$PGPORT" "$@" || exit 1
	idem_pg_install_ledgers "$WORK" "$PGPORT" || exit 1
}

bench_server_stop() {
	[ -n "${OWN:-}" ] || return 0
	idem_pg_stop "$WORK"
	idem_valkey_stop "$WORK"
	rm -rf "$WORK"
}

# bench_client_bench OUT [TREE [CFLAGS...]]: build bench/client_bench.c
# into OUT against the client library built in TREE (default this
# checkout: make test or bench/run built it), with more CFLAGS if given.
bench_client_bench() {
	local out=$1 tree=${2:-$ROOT}
	shift $(($# < 2 ? $# : 2))
	cc -O2 "$@" -I"$tree/client" -I"$tree/src/common" -I"$tree/src" \
		-I"$(pg_config --includedir 2>/dev/null || echo /usr/include/postgresql)" \
		-o "$out" "$ROOT/bench/client_bench.c" "$tree/client/build/libidemclient.a" \
		-lpq -lhiredis -lcrypto -pthread
}

# bench_base_tree COMMIT NAME: a worktree of COMMIT in $BENCH_WORK/NAME-base
# (SRC), removed at exit, with its client library built; BASE is COMMIT's
# short hash.  Exits when any of it fails.
bench_base_tree() {
	BASE=$(git -C "$ROOT" rev-parse --short "$1^{commit}") || exit 2
	SRC=$BENCH_WORK/$2-base
	git -C "$ROOT" worktree add -q --detach "$SRC" "$BASE" || exit 1
	trap 'git -C "$ROOT" worktree remove --force "$SRC" >/dev/null 2>&1' EXIT
	make -C "$SRC/client" -s >/dev/null 2>&1 || { echo "$2.sh: building the client at $BASE failed" >&2; exit 1; }
}
