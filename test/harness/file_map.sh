#!/usr/bin/env bash
# CONTRIBUTING.md's source-layout table is the project's one file map: every
# source file the Makefiles compile is in it, and every file it names
# exists.  The lists come from the Makefiles themselves (the extension's
# OBJS, and the client library's OBJS with the folders its pattern rules
# take sources from), so a file added, moved or renamed without the table
# fails here.  TAP.
#
#   file_map.sh [FILE]   (default CONTRIBUTING.md of the tree)
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
MAP=${1:-$ROOT/CONTRIBUTING.md}
. "$ROOT/test/lib/tap.sh"
# make_var DIR VAR: the value of VAR as the Makefile in DIR computes it
make_var() {
	make -s --no-print-directory -C "$1" --eval "idem-print-var: ; @echo \$($2)" \
		idem-print-var 2>/dev/null
}

# The paths in the table's first column (between backquotes), one a line.
table=$(awk '
	/^##+ Source layout/ { on = 1; next }
	on && /^##/ { exit }
	on && /^\| `/ { print }' "$MAP" |
	awk -F'|' '{ print $2 }' | grep -o '`[^`]*`' | tr -d '`')
[ -n "$table" ]
ok $? "$(basename "$MAP") has a source-layout table ($(printf '%s\n' "$table" | grep -c .) paths)"

# Every path the table names exists (globs and folders too).
stale=
while IFS= read -r p; do
	[ -n "$p" ] || continue
	compgen -G "$ROOT/$p" >/dev/null || stale="$stale $p"
done <<<"$table"
[ -z "$stale" ]
ok $? "every file the table names exists${stale:+ (missing:$stale)}"

# The extension: each object of OBJS, as its source under the tree.
objs=$(make_var "$ROOT" OBJS)
[ -n "$objs" ]
ok $? "the Makefile's OBJS ($(echo $objs | wc -w) objects)"
missing=
for o in $objs; do
	src=${o%.o}.c
	grep -qxF -- "$src" <<<"$table" || missing="$missing $src"
done
[ -n "$objs" ] && [ -z "$missing" ]
ok $? "every source of the extension's OBJS is in the table${missing:+ (missing:$missing)}"

# The client library: each object of client/Makefile's OBJS comes from a
# source in client/ or in one of the folders its pattern rules name
# ("$(B)/%.o: ../src/%.c"); the table must name that source.
cobjs=$(make_var "$ROOT/client" OBJS)
[ -n "$cobjs" ]
ok $? "client/Makefile's OBJS ($(echo $cobjs | wc -w) objects)"
dirs=". $(sed -nE 's|^\$\(B\)/([^:]*/)?%\.o: *([^ ]*/)?%\.c.*|\2|p' "$ROOT/client/Makefile" | grep . | sort -u | tr '\n' ' ')"
missing=
for o in $cobjs; do
	base=$(basename "${o%.o}")
	found=
	for d in $dirs; do
		[ -f "$ROOT/client/$d/$base.c" ] || continue
		found=$(realpath --relative-to="$ROOT" "$ROOT/client/$d/$base.c")
		break
	done
	if [ -z "$found" ]; then
		missing="$missing $base.c(no source found)"
	elif ! grep -qxF -- "$found" <<<"$table"; then
		missing="$missing $found"
	fi
done
[ -n "$cobjs" ] && [ -z "$missing" ]
ok $? "every source of the client library is in the table${missing:+ (missing:$missing)}"
echo "1..$n"
