#!/usr/bin/env bash
# The apt entry for bookworm-backports that idem_ensure_deps writes, derived
# from the system's own Debian entry, on copies of /etc/apt in a temp folder
# (never the machine's own).  TAP.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
. "$ROOT/test/lib/common.sh"
T=$(mktemp -d "${TMPDIR:-/tmp}/idem-backports.XXXXXX")
trap 'rm -rf "$T"' EXIT
n=0
check() {
	local name=$1 want=$2 have=$3
	n=$((n + 1))
	if [ "$want" = "$have" ]; then
		echo "ok $n - $name"
	else
		echo "not ok $n - $name"
		diff <(printf '%s\n' "$want") <(printf '%s\n' "$have") | sed 's/^/# /'
	fi
}

# deb822, as a Debian 12 image ships it: main suite and security stanzas.
mkdir -p "$T/a/sources.list.d"
cat >"$T/a/sources.list.d/debian.sources" <<'EOT'
Types: deb
# a comment inside the stanza
URIs: http://mirror.example/debian
Suites: bookworm bookworm-updates
Components: main contrib
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://mirror.example/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOT
idem_enable_backports "$T/a" bookworm
check "deb822: same URIs, components and keyring, suite bookworm-backports" \
"# Written by idem (test/lib/common.sh) from the system's own Debian entry.
Types: deb
URIs: http://mirror.example/debian
Suites: bookworm-backports
Components: main contrib
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg" \
	"$(cat "$T/a/sources.list.d/idem-backports.sources" 2>&1)"
check "deb822: a second run finds the suite listed and writes nothing" \
	"" "$(idem_backports_entry "$T/a" bookworm)"

# The security stanza first must not be taken: its suite is not "bookworm".
mkdir -p "$T/b/sources.list.d"
sed -n '7,11p' "$T/a/sources.list.d/debian.sources" >"$T/b/sources.list.d/debian.sources"
printf '\nTypes: deb deb-src\nURIs: http://other.example/debian\nSuites: bookworm\nComponents: main\n' \
	>>"$T/b/sources.list.d/debian.sources"
check "deb822: the stanza for the release itself, without Signed-By" \
"Types: deb
URIs: http://other.example/debian
Suites: bookworm-backports
Components: main" "$(idem_backports_entry "$T/b" bookworm)"

# One-line sources.list, with options.
mkdir -p "$T/c"
cat >"$T/c/sources.list" <<'EOT'
# deb http://commented.example/debian bookworm main
deb [arch=amd64 signed-by=/etc/apt/keyrings/k.gpg] http://mirror.example/debian bookworm main non-free-firmware
deb http://mirror.example/debian-security bookworm-security main
EOT
check "one-line: same URI, components and signed-by" \
"Types: deb
URIs: http://mirror.example/debian
Suites: bookworm-backports
Components: main non-free-firmware
Signed-By: /etc/apt/keyrings/k.gpg" "$(idem_backports_entry "$T/c" bookworm)"

echo "deb http://mirror.example/debian bookworm-backports main" >>"$T/c/sources.list"
check "one-line: already listed, nothing to write" "" "$(idem_backports_entry "$T/c" bookworm)"

mkdir -p "$T/d"
if idem_enable_backports "$T/d" bookworm 2>/dev/null; then
	check "no Debian entry: refuses" "fail" "ok"
else
	check "no Debian entry: refuses" "fail" "fail"
fi

# This machine's own entry, on a copy without any backports file.
if [ -d /etc/apt/sources.list.d ] && [ -r /etc/os-release ]; then
	mkdir -p "$T/e/sources.list.d"
	[ -f /etc/apt/sources.list ] && cp /etc/apt/sources.list "$T/e/"
	for f in /etc/apt/sources.list.d/*; do
		[ -f "$f" ] || continue
		grep -qE 'backports' "$f" || cp "$f" "$T/e/sources.list.d/"
	done
	if entry=$(idem_backports_entry "$T/e"); then
		n=$((n + 1))
		if grep -qE '^Suites: [a-z]+-backports$' <<<"$entry" &&
			grep -q '^URIs: ' <<<"$entry"; then
			echo "ok $n - this machine's Debian entry gives a backports entry"
		else
			echo "not ok $n - this machine's Debian entry gives a backports entry"
			printf '%s\n' "$entry" | sed 's/^/# /'
		fi
	fi
fi
echo "1..$n"
