# test/lib/common.sh: shared shell helpers for make test, make demo and
# make bench.  Source it; it defines functions and sets nothing else.
#
#   idem_ensure_deps      install missing Debian packages (root), or print the
#                         exact apt-get line and fail (not root)
#   idem_build_install    build the extension and the client, install the
#                         extension into PostgreSQL's directories
#   idem_test_user        the unprivileged OS user that runs throwaway clusters
#   idem_as_test_user     run a command as that user (directly if not root)
#   idem_free_port        a free TCP port on 127.0.0.1
#   idem_valkey_server    path of the RESP server: $IDEM_VALKEY_SERVER, else
#                         valkey-server
#   idem_valkey_version   "Valkey 8.0.1" (name and version of that server)
#   idem_backports_entry  an apt source entry for bookworm-backports, derived
#                         from the system's own Debian entry
#   idem_pg_bindir        PostgreSQL 15's bindir
#   idem_serialize LOCK   one run at a time per checkout
#   idem_private_dir ROOT  the checkout's folder for what the test user must
#                         read or run, outside the checkout
#   idem_private_take ROOT  that folder, held while the calling shell lives
#                         (IDEM_PRIVATE_DIR); removes those of deleted checkouts
#   idem_private_remove ROOT  remove that folder (make clean-test)
#   idem_pg_private DIR   a private copy of PostgreSQL to install and test in
#   idem_pg_private_for ROOT   that copy, in the checkout's private folder
#   idem_pg_install_ledgers DIR PORT   idem, tenant 1 and the ledgers
#   idem_stop_orphans     stop the test user's servers whose folder was
#                         deleted (a run killed from outside)

IDEM_PG_MAJOR=${IDEM_PG_MAJOR:-15}

# Debian packages the suites need, as "package:file-that-proves-it" pairs.
idem_required_packages() {
	cat <<EOT
postgresql-$IDEM_PG_MAJOR:/usr/lib/postgresql/$IDEM_PG_MAJOR/bin/postgres
postgresql-server-dev-$IDEM_PG_MAJOR:/usr/include/postgresql/$IDEM_PG_MAJOR/server/postgres.h
libpq-dev:/usr/include/postgresql/libpq-fe.h
libhiredis-dev:/usr/include/hiredis/hiredis.h
libssl-dev:/usr/include/openssl/evp.h
libipc-run-perl:/usr/share/perl5/IPC/Run.pm
spin:/usr/bin/spin
gcc:/usr/bin/gcc
make:/usr/bin/make
valgrind:/usr/bin/valgrind
sqlsmith:/usr/bin/sqlsmith
pkgconf:/usr/bin/pkg-config
python3-psycopg:/usr/lib/python3/dist-packages/psycopg/__init__.py
python3-redis:/usr/lib/python3/dist-packages/redis/__init__.py
python3-hiredis:/usr/lib/python3/dist-packages/hiredis/__init__.py
python3-setuptools:/usr/lib/python3/dist-packages/setuptools/__init__.py
python3-pip:/usr/lib/python3/dist-packages/pip/__init__.py
python3-wheel:/usr/lib/python3/dist-packages/wheel/__init__.py
EOT
	# The operations suite (test/ops): the tools it runs idem with.
	if [ -n "${IDEM_NEED_OPS:-}" ]; then
		echo "postgresql-$IDEM_PG_MAJOR-cron:/usr/lib/postgresql/$IDEM_PG_MAJOR/lib/pg_cron.so"
		echo "prometheus-postgres-exporter:/usr/bin/prometheus-postgres-exporter"
		echo "pgbouncer:/usr/sbin/pgbouncer"
	fi
	# The Python suite: its queue tests (test/python/rabbitmq.sh, consumers
	# killed mid-message on a real broker; aio-pika consumers), the runner
	# behind pgbouncer, and mypy --strict on the package.
	if [ -n "${IDEM_NEED_RABBITMQ:-}" ]; then
		echo "rabbitmq-server:/usr/lib/rabbitmq/bin/rabbitmq-server"
		echo "python3-pika:/usr/lib/python3/dist-packages/pika/__init__.py"
		echo "python3-aio-pika:/usr/lib/python3/dist-packages/aio_pika/__init__.py"
		echo "pgbouncer:/usr/sbin/pgbouncer"
		echo "python3-mypy:/usr/lib/python3/dist-packages/mypy/__init__.py"
	fi
	# Building PostgreSQL 18 (test/lib/cache.sh), when it is not cached yet.
	if [ -n "${IDEM_NEED_PG_BUILD:-}" ]; then
		echo "bison:/usr/bin/bison"
		echo "flex:/usr/bin/flex"
		echo "zlib1g-dev:/usr/include/zlib.h"
	fi
	# Valkey 8 (bookworm-backports, see idem_ensure_deps), unless the user
	# names another RESP server.
	if [ -z "${IDEM_VALKEY_SERVER:-}" ]; then
		echo "valkey-server:/usr/bin/valkey-server"
		echo "valkey-tools:/usr/bin/valkey-cli"
	fi
}

# Packages that come from bookworm-backports on Debian 12.
idem_backports_packages() {
	echo "valkey-server valkey-tools"
}

# idem_backports_entry ETC_APT [CODENAME]: print a deb822 entry for the backports suite
# of this Debian release, derived from the system's own Debian entry in
# ETC_APT (sources.list.d/debian.sources, or a one-line sources.list): the
# same URIs, components and Signed-By, suite CODENAME-backports.  Prints
# nothing if ETC_APT already lists that suite or has no Debian entry.
idem_backports_entry() {
	local etc=$1 codename=${2:-} f
	if [ -z "$codename" ]; then
		codename=$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")
	fi
	[ -n "$codename" ] || return 1
	for f in "$etc"/sources.list "$etc"/sources.list.d/*.list "$etc"/sources.list.d/*.sources; do
		[ -f "$f" ] || continue
		grep -qE "^[^#]*[[:space:]]$codename-backports([[:space:]]|$)|^Suites:.*[[:space:]]$codename-backports([[:space:]]|$)" "$f" &&
			return 0
	done
	# deb822: the first stanza of type deb whose suites include CODENAME.
	for f in "$etc"/sources.list.d/*.sources; do
		[ -f "$f" ] || continue
		awk -v cn="$codename" '
			function flush() {
				if (!done && types ~ /(^| )deb( |$)/ && (" " suites " ") ~ (" " cn " ")) {
					print "Types: deb"
					print "URIs: " uris
					print "Suites: " cn "-backports"
					print "Components: " comps
					if (signed != "") print "Signed-By: " signed
					done = 1
				}
				types = uris = suites = comps = signed = ""; field = ""
			}
			/^#/ { next }
			/^[ 	]*$/ { flush(); next }
			/^[ 	]/ { if (field == "signed-by") signed = signed "\n" $0; next }
			{
				field = tolower(substr($0, 1, index($0, ":") - 1))
				val = substr($0, index($0, ":") + 1); sub(/^[ 	]+/, "", val); sub(/[ 	]+$/, "", val)
				if (field == "types") types = val
				else if (field == "uris") uris = val
				else if (field == "suites") suites = val
				else if (field == "components") comps = val
				else if (field == "signed-by") signed = val
			}
			END { flush() }' "$f" | grep . && return 0
	done
	# One-line format: deb [options] URI CODENAME COMPONENTS...
	for f in "$etc"/sources.list "$etc"/sources.list.d/*.list; do
		[ -f "$f" ] || continue
		awk -v cn="$codename" '
			/^[ 	]*deb[ 	]/ {
				line = $0; sub(/^[ 	]*deb[ 	]+/, "", line)
				opts = ""
				if (line ~ /^\[/) {
					opts = substr(line, 2, index(line, "]") - 2)
					line = substr(line, index(line, "]") + 1); sub(/^[ 	]+/, "", line)
				}
				n = split(line, w, /[ 	]+/)
				if (n < 3 || w[2] != cn) next
				comps = w[3]; for (i = 4; i <= n; i++) comps = comps " " w[i]
				print "Types: deb"; print "URIs: " w[1]
				print "Suites: " cn "-backports"; print "Components: " comps
				m = split(opts, o, /[ 	]+/)
				for (i = 1; i <= m; i++)
					if (o[i] ~ /^signed-by=/) print "Signed-By: " substr(o[i], 11)
				exit
			}' "$f" | grep . && return 0
	done
	return 1
}

# idem_enable_backports ETC_APT [CODENAME]: write ETC_APT/sources.list.d/
# idem-backports.sources from idem_backports_entry, if the suite is not
# there yet.  Returns 0 if the suite is (now) listed.
idem_enable_backports() {
	local etc=${1:-/etc/apt} entry
	entry=$(idem_backports_entry "$etc" "${2:-}") || {
		echo "idem: no Debian source entry in $etc to derive backports from" >&2
		return 1
	}
	[ -z "$entry" ] && return 0
	mkdir -p "$etc/sources.list.d" &&
		printf '# Written by idem (test/lib/common.sh) from the system'"'"'s own Debian entry.\n%s\n' \
			"$entry" >"$etc/sources.list.d/idem-backports.sources"
}

idem_missing_packages() {
	local pair pkg file
	for pair in $(idem_required_packages) ${IDEM_EXTRA_PACKAGES:-}; do
		pkg=${pair%%:*}
		file=${pair#*:}
		[ -e "$file" ] || printf '%s ' "$pkg"
	done
}

idem_ensure_deps() {
	local missing
	missing=$(idem_missing_packages)
	[ -z "$missing" ] && return 0
	if [ "$(id -u)" -eq 0 ]; then
		echo "idem: installing missing packages: $missing"
		export DEBIAN_FRONTEND=noninteractive
		# The tests start their own servers: keep the packages' postinst
		# from starting (or failing to start) Debian's, where there is no init.
		local policy=""
		if [ ! -e /usr/sbin/policy-rc.d ]; then
			policy=/usr/sbin/policy-rc.d
			printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy"
		fi
		# Valkey 8 is in bookworm-backports on Debian 12: enable that suite
		# (derived from the system's own entry) and take those from it.
		local bp="" p plain="" ok=0 codename
		codename=$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")
		for p in $missing; do
			if [ "$codename" = bookworm ] && [[ " $(idem_backports_packages) " == *" $p "* ]]; then
				bp="$bp $p"
			else
				plain="$plain $p"
			fi
		done
		if [ -n "$bp" ]; then
			local had
			had=$(ls /etc/apt/sources.list.d/idem-backports.sources 2>/dev/null)
			idem_enable_backports /etc/apt || return 1
			[ -n "$had" ] || [ ! -e /etc/apt/sources.list.d/idem-backports.sources ] ||
				echo "idem: enabled bookworm-backports (/etc/apt/sources.list.d/idem-backports.sources)"
		fi
		# -o DPkg::Lock::Timeout: wait for another apt run rather than fail.
		local apt="apt-get -y -q -o DPkg::Lock::Timeout=600 --no-install-recommends"
		_idem_apt() {
			{ [ -z "$plain" ] || $apt install $plain; } &&
				{ [ -z "$bp" ] || $apt install -t "$codename-backports" $bp; }
		}
		if _idem_apt >/tmp/idem-apt.log 2>&1; then
			ok=1
		else
			apt-get update -q -o DPkg::Lock::Timeout=600 >>/tmp/idem-apt.log 2>&1
			_idem_apt >>/tmp/idem-apt.log 2>&1 && ok=1
		fi
		[ -n "$policy" ] && rm -f "$policy"
		if [ $ok -ne 1 ]; then
			echo "idem: apt-get install failed; see /tmp/idem-apt.log" >&2
			tail -n 20 /tmp/idem-apt.log >&2
			return 1
		fi
		missing=$(idem_missing_packages)
		[ -z "$missing" ] || { echo "idem: still missing after install: $missing" >&2; return 1; }
		return 0
	fi
	echo "idem: missing packages. Run as root:" >&2
	echo "  apt-get install -y $missing" >&2
	return 1
}

# Tests install idem into a private copy of the machine's PostgreSQL (see
# idem_pg_private), one per checkout; two runs in the same checkout would
# still share it, so each run holds that checkout's lock until it exits
# (fd 9 stays open; servers are started without it, so that one left
# running cannot hold the lock).  Runs in different checkouts do not wait.
idem_serialize() {
	local lock=$1
	command -v flock >/dev/null 2>&1 || return 0
	exec 9>>"$lock" || return 0
	if ! flock -n 9; then
		echo "idem: waiting for another run in this checkout ($lock)"
		flock 9
	fi
}

# idem_pg_private DIR: make DIR a fresh relocated copy of the machine's
# PostgreSQL $IDEM_PG_MAJOR (binaries, libraries, share; headers and libpq
# linked, not copied) and point IDEM_PG_ROOT at it, so that installing and
# testing idem never touches the system's own PostgreSQL directories and
# two checkouts can test at once.  DIR must lie where the test user can
# enter, with no spaces in its path (pg_config's path goes into PGXS):
# idem_pg_private_for picks it.  PostgreSQL finds its share and lib
# directories relative to its binaries, so the copy works where it lies.
# Made anew each run (about 50 MB): packages installed since are in it.
idem_pg_private() {
	local dir=$1 m=$IDEM_PG_MAJOR libdir
	libdir=$(/usr/lib/postgresql/$m/bin/pg_config --libdir)
	rm -rf "$dir"
	mkdir -p "$dir/usr/lib/postgresql" "$dir/usr/share/postgresql" || return 1
	cp -a "/usr/lib/postgresql/$m" "$dir/usr/lib/postgresql/" &&
		cp -a "/usr/share/postgresql/$m" "$dir/usr/share/postgresql/" &&
		ln -s /usr/include "$dir/usr/include" &&
		ln -s "$libdir" "$dir$libdir" ||
		{ echo "idem: could not copy PostgreSQL $m into $dir" >&2; return 1; }
	chmod -R a+rX "$dir"
	export IDEM_PG_ROOT=$dir
}

# idem_private_dir ROOT: print the folder (made if missing) that holds what
# the test user must read or run for the checkout ROOT: the private copies
# of PostgreSQL (idem_pg_private_for, test/run's PostgreSQL 18 copy) and
# what is installed into them.  Never inside the checkout: a checkout may
# lie where that user cannot enter (under /root, in a mktemp -d folder,
# below any 0700 folder).  /var/tmp/idem-UID-HASH, HASH from ROOT's path, so
# each checkout has its own (runs in one checkout wait for each other,
# idem_serialize); mode 755, and it must be a real folder of the caller's
# (/var/tmp is sticky: nobody else can swap it).  IDEM_PRIVATE_BASE
# replaces /var/tmp.  The folder records ROOT in .idem-checkout, which
# marks it as one of these (idem_private_prune).
_idem_private_path() {
	echo "${IDEM_PRIVATE_BASE:-/var/tmp}/idem-$(id -u)-$(printf '%s' "$1" | sha256sum | cut -c1-12)"
}
idem_private_dir() {
	local root=$1 dir
	dir=$(_idem_private_path "$root")
	[ -d "$dir" ] || mkdir -m 755 "$dir" 2>/dev/null || [ -d "$dir" ] ||
		{ echo "idem: cannot make $dir" >&2; return 1; }
	if [ -L "$dir" ] || [ ! -O "$dir" ]; then
		echo "idem: $dir is not a folder of $(id -un)'s; remove it" >&2
		return 1
	fi
	if [ "$(cat "$dir/.idem-checkout" 2>/dev/null)" != "$root" ]; then
		printf '%s\n' "$root" >"$dir/.idem-checkout.$$" &&
			mv -f "$dir/.idem-checkout.$$" "$dir/.idem-checkout" || return 1
	fi
	chmod 755 "$dir" && echo "$dir"
}

# idem_private_take ROOT: idem_private_dir, in IDEM_PRIVATE_DIR, held
# until the calling shell and what it starts end: a shared lock on its
# .idem-lock (fd 7; servers keep it, as they run from the folder), which
# idem_private_prune and idem_private_remove need exclusively.  A folder
# pruned between its making and the lock is made again.  Then removes the
# folders of checkouts that no longer exist (idem_private_prune): each
# clone of a CI run leaves one behind.
idem_private_take() {
	local root=$1 dir try
	for try in 1 2 3 4 5; do
		dir=$(idem_private_dir "$root") || return 1
		command -v flock >/dev/null 2>&1 || break
		exec 7>>"$dir/.idem-lock" || continue
		flock -s 7
		# still the folder's lock, not one a pruner moved away meanwhile
		[ "$(stat -L -c %d:%i /dev/fd/7)" = "$(stat -c %d:%i "$dir/.idem-lock" 2>/dev/null)" ] && break
		exec 7>&-
		dir=""
	done
	[ -n "$dir" ] || { echo "idem: could not hold $(_idem_private_path "$root")" >&2; return 1; }
	IDEM_PRIVATE_DIR=$dir
	idem_private_prune
}

# _idem_gone PATH: PATH surely does not exist (not merely hidden: the
# nearest folder above it that exists can be searched).
_idem_gone() {
	local p=$1
	[ ! -e "$p" ] || return 1
	while [ "$p" != / ] && [ "$p" != . ]; do
		p=$(dirname "$p")
		[ -e "$p" ] && { [ -x "$p" ]; return; }
	done
	return 1
}

# idem_private_prune: remove the caller's private folders (idem_private_dir,
# under IDEM_PRIVATE_BASE or /var/tmp) whose checkout no longer exists.
# Only folders of the caller's, not links, that bear .idem-checkout and
# whose name is that checkout's; never one a run holds (idem_private_take):
# the exclusive lock is taken without waiting, and the folder is moved
# aside under it, then removed.  Folders made before the marker existed are
# left alone (make clean-test in their checkout, or rm -rf).
idem_private_prune() {
	local base=${IDEM_PRIVATE_BASE:-/var/tmp} dir root gone
	command -v flock >/dev/null 2>&1 || return 0
	for dir in "$base/idem-$(id -u)-"*; do
		[ -d "$dir" ] && [ ! -L "$dir" ] && [ -O "$dir" ] || continue
		if [[ $dir == "$base/idem-$(id -u)-gone."* ]]; then
			rm -rf "$dir" 2>/dev/null	# moved aside by a prune that did not finish
			continue
		fi
		[ -f "$dir/.idem-checkout" ] && [ ! -L "$dir/.idem-checkout" ] || continue
		root=$(cat "$dir/.idem-checkout" 2>/dev/null) && [ -n "$root" ] || continue
		[ "$dir" = "$(_idem_private_path "$root")" ] && _idem_gone "$root" || continue
		gone=$(mktemp -u "$base/idem-$(id -u)-gone.XXXXXX")
		(
			exec 6>>"$dir/.idem-lock" && flock -n -x 6 &&
				[ "$(stat -L -c %d:%i /dev/fd/6)" = "$(stat -c %d:%i "$dir/.idem-lock" 2>/dev/null)" ] &&
				_idem_gone "$root" && mv -T "$dir" "$gone"
		) 2>/dev/null || continue
		rm -rf "$gone" 2>/dev/null
		echo "idem: removed $dir (the private copies of $root, which no longer exists)" >&2
	done
}

# idem_private_remove ROOT: remove the checkout's private folder
# (idem_private_dir) and the throwaway trees left by runs that were killed,
# unless a run in that checkout holds its lock (idem_serialize) or the
# folder's (idem_private_take).  make clean-test.
idem_private_remove() {
	local root=$1 dir
	dir=$(_idem_private_path "$root")
	if command -v flock >/dev/null 2>&1 && { { [ -e "$root/tmp_pgroot.lock" ] &&
		! flock -n "$root/tmp_pgroot.lock" true; } || { [ -f "$dir/.idem-lock" ] && [ ! -L "$dir" ] &&
		! flock -n "$dir/.idem-lock" true; }; }; then
		echo "idem: a run in this checkout is using $dir; try again when it ends" >&2
		return 1
	fi
	if [ -L "$dir" ] || { [ -e "$dir" ] && [ ! -O "$dir" ]; }; then
		echo "idem: $dir is not a folder of $(id -un)'s; not removed" >&2
		return 1
	fi
	if [ -d "$dir" ]; then
		rm -rf "$dir" && echo "idem: removed $dir ($(basename "$root")'s private PostgreSQL copies)"
	else
		echo "idem: nothing to remove ($dir does not exist)"
	fi
}

# idem_pg_private_for ROOT: idem_pg_private in the checkout's private
# folder (idem_private_dir), the copy make test, make demo and make bench
# install idem into.
idem_pg_private_for() {
	idem_private_take "$1" || return 1
	idem_pg_private "$IDEM_PRIVATE_DIR/pgroot"
}

idem_pg_bindir() {
	if [ -n "${IDEM_PG_BINDIR:-}" ]; then
		echo "$IDEM_PG_BINDIR"	# another build (PostgreSQL 18, cache.sh)
	else
		echo "${IDEM_PG_ROOT:-}/usr/lib/postgresql/$IDEM_PG_MAJOR/bin"
	fi
}

# The warnings every build of idem must pass without (pgvector's set).
IDEM_WARNING_FLAGS="-Wall -Wextra -Werror -Wno-unused-parameter -Wno-sign-compare"

idem_pg_config() {
	echo "$(idem_pg_bindir)/pg_config"
}

idem_valkey_server() {
	if [ -n "${IDEM_VALKEY_SERVER:-}" ]; then
		[ -x "$IDEM_VALKEY_SERVER" ] || return 1
		echo "$IDEM_VALKEY_SERVER"
	elif command -v valkey-server >/dev/null 2>&1; then
		command -v valkey-server
	else
		return 1
	fi
}

# "Valkey 8.0.1": the name and version the server reports for itself.
idem_valkey_version() {
	local server out
	server=$(idem_valkey_server) || { echo "no RESP server"; return 1; }
	out=$("$server" --version 2>/dev/null | head -n 1)
	case $out in
	"Valkey server v="*) out=${out#Valkey server v=}; echo "Valkey ${out%% *} ($server)" ;;
	"Redis server v="*) out=${out#Redis server v=}; echo "Redis ${out%% *} ($server)" ;;
	*) echo "${out:-unknown} ($server)" ;;
	esac
}

# The CLI that comes with the server: the valkey-cli (or redis-cli) beside
# it, else valkey-cli on PATH.
idem_valkey_cli() {
	local dir
	dir=$(dirname "$(idem_valkey_server)")
	if [ -x "$dir/valkey-cli" ]; then
		echo "$dir/valkey-cli"
	elif [ -x "$dir/redis-cli" ]; then
		echo "$dir/redis-cli"
	else
		echo valkey-cli
	fi
}

idem_build_install() {
	local root=$1 pgc
	pgc=$(idem_pg_config)
	# one job per core: the build is the one step every suite waits for
	make -C "$root" -s -j"$(nproc 2>/dev/null || echo 2)" PG_CONFIG="$pgc" \
		COPT="$IDEM_WARNING_FLAGS" all || return 1
	if [ -f "$root/client/Makefile" ]; then
		make -C "$root/client" -s -j"$(nproc 2>/dev/null || echo 2)" PG_CONFIG="$pgc" IDEM_WERROR=yes all || return 1
	fi
	# The client goes beside the private PostgreSQL copy, not /usr/local.
	local client_prefix=${IDEM_CLIENT_PREFIX:-${IDEM_PG_ROOT:+$IDEM_PG_ROOT/usr/local}}
	if [ -w "$("$pgc" --pkglibdir)" ]; then
		make -C "$root" -s PG_CONFIG="$pgc" ${client_prefix:+CLIENT_PREFIX="$client_prefix"} \
			install >/dev/null || return 1
	else
		echo "idem: cannot write $("$pgc" --pkglibdir); run as root (or sudo make install) first" >&2
		return 1
	fi
}

idem_test_user() {
	if [ "$(id -u)" -ne 0 ]; then
		id -un
		return
	fi
	# initdb refuses root: throwaway clusters run as this unprivileged user.
	if ! id idemtest >/dev/null 2>&1; then
		useradd --system --create-home --home-dir /var/lib/idemtest \
			--shell /bin/bash idemtest || return 1
	fi
	echo idemtest
}

# idem_as_test_user CMD...: environment is passed through explicitly.
idem_as_test_user() {
	if [ "$(id -u)" -ne 0 ]; then
		"$@"
	else
		runuser -u "$(idem_test_user)" -- env HOME=/var/lib/idemtest "$@"
	fi
}

# A copy of the tree that the test user owns: pg_regress writes results/
# beside the tests, and the checkout may belong to root.
idem_test_tree() {
	local root=$1 dest=$2
	mkdir -p "$dest"
	(cd "$root" && tar --exclude=.git --exclude=tmp_check --exclude=tmp_pgroot \
		--exclude=tmp_pgroot18 --exclude=results -cf - .) |
		(cd "$dest" && tar -xf -) || return 1
	if [ "$(id -u)" -eq 0 ]; then
		chown -R "$(idem_test_user)" "$dest"
	fi
}

# idem_free_port: a free TCP port on 127.0.0.1.  With PG_TEST_PORT_DIR
# (test/run sets it) the port is also reserved there for the calling
# script ($$), as PostgreSQL::Test::Cluster's get_free_port reserves its
# ports (DIR/PORT.rsv holding the owner's pid; a dead owner's reservation
# lapses): suites side by side never hand out the same port.
idem_free_port() {
	perl -MIO::Socket::INET -MFcntl=:DEFAULT,:flock -e '
		my ($dir, $owner) = @ARGV;
		for (1 .. 200) {
			my $s = IO::Socket::INET->new(Listen => 1, LocalAddr => "127.0.0.1",
				LocalPort => 0, ReuseAddr => 1) or die "no free port: $!\n";
			my $port = $s->sockport;
			close $s;
			if ($dir eq "") { print "$port\n"; exit 0; }
			sysopen(my $f, "$dir/$port.rsv", O_RDWR | O_CREAT)
				or die "opening $dir/$port.rsv: $!\n";
			flock($f, LOCK_EX) or die "locking $dir/$port.rsv: $!\n";
			my $pid = <$f> // "0";
			$pid =~ s/\s+//g;
			if ($pid =~ /^\d+$/ && $pid > 0 && kill(0, $pid)) { close $f; next; }
			seek($f, 0, 0);
			print $f sprintf("%10d\n", $owner);
			close $f;
			print "$port\n";
			exit 0;
		}
		die "no free port that is not reserved in $dir\n";' "${PG_TEST_PORT_DIR:-}" "$$"
}

# idem_leftover_pids DIR...: the processes still running from under a DIR:
# their working directory is there (a server started with its data or
# --dir there: PostgreSQL, Valkey, which rewrites its title and so no
# longer shows its arguments), or a path under DIR is in their command
# line.  The caller and its ancestors are left out (they may run from
# under DIR).
idem_leftover_pids() {
	local dir dirs=()
	for dir in "$@"; do
		dir=$(cd "$dir" 2>/dev/null && pwd -P) && dirs+=("$dir")
	done
	[ "${#dirs[@]}" -gt 0 ] || return 0
	perl -e '
		my @dirs = @ARGV;
		my %mine;	# this scan and its ancestors
		for (my $p = $$; $p > 1;) {
			$mine{$p} = 1;
			open(my $st, "<", "/proc/$p/stat") or last;
			my $line = <$st> // last;
			($p) = $line =~ /\) \S+ (\d+)/ or last;
		}
		opendir(my $proc, "/proc") or exit 0;
		PID: foreach my $pid (grep { /^\d+$/ && !$mine{$_} } readdir($proc)) {
			my $cwd = readlink("/proc/$pid/cwd");
			my $cmd = "";
			if (open(my $f, "<", "/proc/$pid/cmdline")) { local $/; $cmd = <$f> // ""; }
			foreach my $dir (@dirs) {
				# a path boundary after DIR: not a sibling DIR-b
				if ((defined $cwd && index("$cwd/", "$dir/") == 0) ||
					$cmd =~ m{\Q$dir\E(?:/|\0|\z)}) {
					print "$pid\n";
					next PID;
				}
			}
		}' "${dirs[@]}"
}

# idem_stop_listed WHAT LISTER [ARG...]: stop the processes LISTER ARG...
# prints (one pid a line): SIGTERM, then SIGKILL to what it still prints
# after 3 s.  Says how many it stopped, and WHAT they are, on stderr.
idem_stop_listed() {
	local what=$1 pids i
	shift
	pids=$("$@")
	[ -n "$pids" ] || return 0
	echo "idem: stopping $(wc -w <<<"$pids") processes $what" >&2
	# shellcheck disable=SC2086
	kill -TERM $pids 2>/dev/null
	for i in $(seq 1 30); do
		pids=$("$@")
		[ -n "$pids" ] || return 0
		sleep 0.1
	done
	# shellcheck disable=SC2086
	kill -KILL $pids 2>/dev/null
	return 0
}

# idem_stop_leftovers DIR...: stop what a suite left running from under a
# DIR (idem_leftover_pids): the servers of a suite that failed, or that hit
# its time limit (timeout signals the suite's process group, which a
# daemonized server has left).
idem_stop_leftovers() {
	idem_stop_listed "left running under $*" idem_leftover_pids "$@"
}

# idem_orphan_pids: the servers of the test user (idem_test_user: Valkey,
# Redis, PostgreSQL, pgbouncer, RabbitMQ's beam.smp) whose folder no
# longer exists: their working directory (a server's data or --dir) was
# deleted, as when a run killed from outside never stopped them and its
# temp folder was removed since.  A live run's servers have their folders;
# other users' processes, and the test user's that are not servers, are
# never listed.  With DIRs, only those whose folder was under one of them.
idem_orphan_pids() {
	local uid
	uid=$(id -u "$(idem_test_user)" 2>/dev/null) || return 0
	perl -e '
		my $uid = shift;
		my @dirs = @ARGV;
		opendir(my $proc, "/proc") or exit 0;
		foreach my $pid (grep { /^\d+$/ } readdir($proc)) {
			my @st = stat("/proc/$pid") or next;
			next unless $st[4] == $uid;
			open(my $c, "<", "/proc/$pid/comm") or next;
			my $comm = <$c> // "";
			chomp $comm;
			next unless $comm =~ /^(valkey-server|redis-server|postgres|pgbouncer|beam\.smp)$/;
			my $cwd = readlink("/proc/$pid/cwd") // next;
			next unless $cwd =~ /^(.*) \(deleted\)$/ && !-e $1;
			my $gone = "$1/";
			print "$pid\n" if !@dirs || grep { index($gone, "$_/") == 0 } @dirs;
		}' "$uid" "$@"
}

# idem_stop_orphans [DIR...]: stop the test user's servers whose folder no
# longer exists (idem_orphan_pids DIR...), at the start of a run.
idem_stop_orphans() {
	idem_stop_listed "of $(idem_test_user) whose folder no longer exists" idem_orphan_pids "$@"
}

# idem_limited SECONDS DIR COMMAND...: COMMAND with a time limit (timeout:
# its process group gets SIGTERM, SIGKILL 10 s later), then what it left
# running under DIR is stopped (idem_stop_leftovers), whether it passed,
# failed or hit the limit.  Returns COMMAND's status (124: the limit).
idem_limited() {
	local secs=$1 dir=$2 st
	shift 2
	timeout -k 10 "$secs" "$@"
	st=$?
	idem_stop_leftovers "$dir"
	return $st
}

# idem_pg_start DIR PORT [CONF-LINE...]: a throwaway cluster in DIR/pg,
# listening on 127.0.0.1:PORT and on a socket in DIR, preloading idem.
# Runs as the test user; DIR must be writable by it.
idem_pg_start() {
	local dir=$1 port=$2 bindir
	shift 2
	bindir=$(idem_pg_bindir)
	idem_as_test_user "$bindir/initdb" -D "$dir/pg" -A trust -U postgres \
		--no-sync >"$dir/initdb.log" 2>&1 || { cat "$dir/initdb.log" >&2; return 1; }
	{
		echo "port = $port"
		echo "listen_addresses = '127.0.0.1'"
		echo "unix_socket_directories = '$dir'"
		echo "shared_preload_libraries = 'idem'"
		echo "fsync = on"
		for line in "$@"; do echo "$line"; done
	} | idem_as_test_user tee -a "$dir/pg/postgresql.conf" >/dev/null
	idem_as_test_user "$bindir/pg_ctl" -D "$dir/pg" -l "$dir/pg.log" -w -t 60 start \
		>/dev/null 9>&- || { tail -n 20 "$dir/pg.log" >&2; return 1; }
}

# idem_pg_install_ledgers DIR PORT: in the cluster idem_pg_start started,
# CREATE EXTENSION idem, a tenants table with tenant 1, and the ledgers.
idem_pg_install_ledgers() {
	idem_as_test_user "$(idem_pg_bindir)/psql" -X -q -v ON_ERROR_STOP=1 -h "$1" \
		-p "$2" -U postgres -d postgres >/dev/null <<-'SQL'
		CREATE EXTENSION idem;
		CREATE TABLE tenants (id bigint PRIMARY KEY);
		INSERT INTO tenants VALUES (1);
		SELECT idem_install('tenants');
	SQL
}

# idem_pg_crash DATADIR BINDIR LOG: a crash of the server started on
# DATADIR: kill -9 of its postmaster and of each of its processes at once
# (what only shared memory held, WAL not yet written out among it, is
# lost), then a start, which recovers from the WAL written.  Run as the
# server's user.
idem_pg_crash() {
	local data=$1 bindir=$2 log=$3 pm pids p alive
	pm=$(head -n 1 "$data/postmaster.pid" 2>/dev/null) && [ -n "$pm" ] || return 1
	pids="$pm $(ps -o pid= --ppid "$pm")"
	# shellcheck disable=SC2086
	kill -9 $pids 2>/dev/null
	# gone, the postmaster reaped too (a new one refuses to start while
	# its pid answers kill -0, even as a zombie)
	for _ in $(seq 1 1000); do
		alive=no
		kill -0 "$pm" 2>/dev/null && alive=yes
		for p in $pids; do
			case $(ps -o stat= -p "$p" 2>/dev/null) in
				""|Z*) ;;
				*) alive=yes ;;
			esac
		done
		[ "$alive" = no ] && break
		sleep 0.02
	done
	"$bindir/pg_ctl" -D "$data" -l "$log" -w -t 120 start >/dev/null 2>&1
}

idem_pg_stop() {
	local dir=$1
	[ -f "$dir/pg/postmaster.pid" ] || return 0
	idem_as_test_user "$(idem_pg_bindir)/pg_ctl" -D "$dir/pg" -m fast -w stop >/dev/null 2>&1
}

# idem_valkey_start DIR PORT: a RESP server (Valkey, or IDEM_VALKEY_SERVER)
# on 127.0.0.1:PORT with no persistence; its pid in DIR/valkey.pid.
idem_valkey_start() {
	local dir=$1 port=$2 server
	server=$(idem_valkey_server) || { echo "idem: no valkey-server (or IDEM_VALKEY_SERVER)" >&2; return 1; }
	mkdir -p "$dir/valkey"
	"$server" --port "$port" --bind 127.0.0.1 --save '' --appendonly no \
		--dir "$dir/valkey" --daemonize yes --pidfile "$dir/valkey.pid" \
		--logfile "$dir/valkey.log" >/dev/null 9>&- || return 1
	for _ in $(seq 1 50); do
		"$(idem_valkey_cli)" -p "$port" ping 2>/dev/null | grep -q PONG && return 0
		sleep 0.1
	done
	echo "idem: RESP server did not start on port $port" >&2
	return 1
}

idem_valkey_stop() {
	local dir=$1
	[ -f "$dir/valkey.pid" ] && kill "$(cat "$dir/valkey.pid")" 2>/dev/null
	rm -f "$dir/valkey.pid"
}

# idem_valkey_restart DIR PORT [DOWN_SECONDS]: crash the RESP server that
# idem_valkey_start started in DIR (SIGKILL, no persistence: it comes back
# empty), keep it down for a moment, start it again on the same port.
idem_valkey_restart() {
	local dir=$1 port=$2 down=${3:-0.2} pid
	if [ -f "$dir/valkey.pid" ]; then
		pid=$(cat "$dir/valkey.pid")
		kill -KILL "$pid" 2>/dev/null
		# gone, or a zombie (a daemon's parent may be an init that never reaps)
		for _ in $(seq 1 50); do
			kill -0 "$pid" 2>/dev/null || break
			case $(cut -d' ' -f3 "/proc/$pid/stat" 2>/dev/null) in Z|X|"") break ;; esac
			sleep 0.05
		done
		rm -f "$dir/valkey.pid"
	fi
	sleep "$down"
	idem_valkey_start "$dir" "$port"
}

# ---- a throwaway Valkey Cluster (make demo --cache-cluster, make bench) ----
# idem_valkey_cluster_start DIR [MASTERS]: MASTERS masters (default 3) with
# one replica each on free loopback ports, cluster-node-timeout 1000 ms, in
# DIR/node*/; DIR/ports lists "port" per node.  0 when cluster_state is ok.
# cluster-require-full-coverage no, as a cache should run: while one shard
# fails over, the others keep serving their slots.
idem_valkey_cluster_start() {
	local dir=$1 masters=${2:-3} server cli i port addrs=()
	server=$(idem_valkey_server) || return 1
	cli=$(idem_valkey_cli)
	: >"$dir/ports"
	for i in $(seq 1 $((masters * 2))); do
		port=$(idem_free_port)
		echo "$port" >>"$dir/ports"
		idem_valkey_cluster_node_start "$dir" "$port" || return 1
		addrs+=("127.0.0.1:$port")
	done
	"$cli" --cluster create "${addrs[@]}" --cluster-replicas 1 --cluster-yes \
		>"$dir/create.log" 2>&1 || { cat "$dir/create.log" >&2; return 1; }
	idem_valkey_cluster_wait_ok "$dir"
}

# Start (or restart: nodes.conf keeps its identity) the node on PORT.
idem_valkey_cluster_node_start() {
	local dir=$1 port=$2 server
	server=$(idem_valkey_server) || return 1
	mkdir -p "$dir/node$port"
	# the bus port is explicit: PORT + 10000 may be out of range
	"$server" --port "$port" --bind 127.0.0.1 --save '' --appendonly no \
		--cluster-enabled yes --cluster-config-file nodes.conf \
		--cluster-port "$(idem_free_port)" \
		--cluster-node-timeout 1000 --cluster-replica-validity-factor 0 \
		--cluster-require-full-coverage no \
		--dir "$dir/node$port" --daemonize yes \
		--pidfile "$dir/node$port/valkey.pid" \
		--logfile "$dir/node$port/valkey.log" >/dev/null || return 1
	for _ in $(seq 1 50); do
		"$(idem_valkey_cli)" -p "$port" ping 2>/dev/null | grep -q PONG && return 0
		sleep 0.1
	done
	return 1
}

# Every live node says cluster_state:ok (30 s at most).
idem_valkey_cluster_wait_ok() {
	local dir=$1 port ok
	for _ in $(seq 1 300); do
		ok=1
		while read -r port; do
			[ -f "$dir/node$port/valkey.pid" ] || continue
			"$(idem_valkey_cli)" -p "$port" cluster info 2>/dev/null |
				grep -q 'cluster_state:ok' || { ok=0; break; }
		done <"$dir/ports"
		[ $ok -eq 1 ] && return 0
		sleep 0.1
	done
	echo "idem: Valkey Cluster in $dir is not ok" >&2
	return 1
}

# "host:port,..." of every node but the first (the runners' extra seeds).
idem_valkey_cluster_others() {
	tail -n +2 "$1/ports" | sed 's/^/127.0.0.1:/' | paste -sd, -
}

idem_valkey_cluster_first() { head -n 1 "$1/ports"; }

# Kill a master with SIGKILL (its replica takes over), wait for the
# failover, start the node again (it comes back as a replica).
idem_valkey_cluster_kill_master() {
	local dir=$1 port pid victim=
	while read -r port; do
		[ -f "$dir/node$port/valkey.pid" ] || continue
		victim=$("$(idem_valkey_cli)" -p "$port" cluster nodes 2>/dev/null |
			awk '$3 ~ /master/ && $3 !~ /fail/ && $8 == "connected" && NF > 8 { split($2, a, "[:@]"); print a[2] }' |
			shuf -n 1)
		[ -n "$victim" ] && break
	done <"$dir/ports"
	[ -n "$victim" ] || return 1
	pid=$(cat "$dir/node$victim/valkey.pid" 2>/dev/null) || return 1
	kill -KILL "$pid" 2>/dev/null
	rm -f "$dir/node$victim/valkey.pid"
	# until the others have marked it failed and promoted its replica
	port=$(grep -vx "$victim" "$dir/ports" | head -n 1)
	for _ in $(seq 1 300); do
		"$(idem_valkey_cli)" -p "$port" cluster nodes 2>/dev/null |
			grep -q "127.0.0.1:$victim@[0-9]* master,fail" && break
		sleep 0.1
	done
	idem_valkey_cluster_wait_ok "$dir" || return 1
	idem_valkey_cluster_node_start "$dir" "$victim"
}

idem_valkey_cluster_stop() {
	local dir=$1 port
	[ -f "$dir/ports" ] || return 0
	while read -r port; do
		[ -f "$dir/node$port/valkey.pid" ] && kill "$(cat "$dir/node$port/valkey.pid")" 2>/dev/null
		rm -f "$dir/node$port/valkey.pid"
	done <"$dir/ports"
}
