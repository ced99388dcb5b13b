# test/lib/tap.sh: TAP lines for the shell tests (test/harness/*.sh,
# test/ops/run.sh).  Source it where the count starts: it sets n=0.
#
#   ok STATUS NAME   "ok N - NAME" when STATUS is 0, else "not ok N - NAME"
#
# The script ends with echo "1..$n".
n=0
ok() {
	n=$((n + 1))
	if [ "$1" -eq 0 ]; then echo "ok $n - $2"; else echo "not ok $n - $2"; fi
}
