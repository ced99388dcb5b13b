#!/bin/bash
# exports.sh LIB.a LIB.so EXPORTS.MAP: what the libraries export (TAP).
# The public API is the names exports.map lists; under the idem_ prefix
# the static library defines those and nothing else (its internal
# functions are idemc_*), and the shared library exports exactly those.
set -u
a=$1 so=$2 map=$3
n=0 fail=0
ok() {
	n=$((n + 1))
	if [ "$1" = 0 ]; then echo "ok $n - $2"; else fail=$((fail + 1)); echo "not ok $n - $2"; fi
}
public=$(sed -n 's/^[[:space:]]*\(idem_[a-z0-9_]*\);.*/\1/p' "$map" | sort -u)
static=$(nm -g --defined-only "$a" | awk 'NF == 3 {print $3}' | sort -u)
shared=$(nm -D --defined-only "$so" | awk 'NF == 3 {print $3}' | sed 's/@.*//' | grep -v '^IDEMCLIENT_' | sort -u)

extra=$(comm -13 <(echo "$public") <(echo "$static" | grep '^idem_'))
other=$(echo "$static" | grep -v -e '^idem_' -e '^idemc_')
missing=$(comm -23 <(echo "$public") <(echo "$static"))
ok "$([ -z "$extra" ] && echo 0 || echo 1)" "the static library defines no idem_ name outside the public API${extra:+: $(echo $extra)}"
ok "$([ -z "$other" ] && echo 0 || echo 1)" "its other global names are idemc_*${other:+: $(echo $other)}"
ok "$([ -z "$missing" ] && echo 0 || echo 1)" "it defines the whole public API ($(echo "$public" | wc -l) names)${missing:+; missing: $(echo $missing)}"
ok "$([ "$shared" = "$public" ] && echo 0 || echo 1)" "the shared library exports exactly the public API$( [ "$shared" = "$public" ] || echo ": $(diff <(echo "$public") <(echo "$shared") | grep '^[<>]' | tr '\n' ' ')")"
echo "1..$n"
[ "$fail" = 0 ]
