#!/usr/bin/env bash
# readme_block.sh README FILE (both paths from the tree's root): the ```c
# block that follows the line "<!-- FILE -->" in README is FILE, byte for byte (the README shows the
# example programs verbatim, so that they cannot drift apart).  Exit 0 when
# equal; otherwise 1 and the diff (README's block as "a", the file as "b").
set -uo pipefail
readme=$1 file=$2
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
rel=$file
block=$(awk -v m="<!-- $rel -->" '
	state == 0 && $0 == m { state = 1; next }
	state == 1 && $0 == "```c" { state = 2; next }
	state == 1 && $0 != "" { exit }
	state == 2 && $0 == "```" { exit }
	state == 2 { print }' "$readme")
if [ -z "$block" ]; then
	echo "no \`\`\`c block after \"<!-- $rel -->\" in $readme"
	exit 1
fi
diff -u --label "$readme" --label "$rel" <(printf '%s\n' "$block") "$file"
