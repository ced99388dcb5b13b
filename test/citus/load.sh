#!/usr/bin/env bash
# load.sh CONNINFO TAG TASKS KEYS TENANTS OUT: an at-least-once consumer for
# the citus suite.  Each task is a (tenant, key) pair drawn with repeats (the
# duplicates of a queue); each is handled as the README's handler does, one
# psql transaction per delivery, and delivered again until it is completed
# (an error, a busy answer, a shard that moved: all redelivered).  The
# effect: tenants.n + 1 and one effects row.  Appends "tenant key" per task
# to OUT.
set -u
CONN=$1 TAG=$2 TASKS=$3 KEYS=$4 TENANTS=$5 OUT=$6
for ((i = 0; i < TASKS; i++)); do
	t=$((RANDOM % TENANTS + 1))
	k=$((RANDOM % KEYS))
	for ((try = 0; try < 200; try++)); do
		d=$(psql -X -q -At -v ON_ERROR_STOP=1 "$CONN" 2>>"$OUT.err" <<-SQL
			BEGIN;
			SELECT decision, decision = 'claimed' AS c FROM idem_claim($t, idem_key('$TAG', '$k'), idem_fingerprint('{}')) \gset
			\if :c
			UPDATE tenants SET n = n + 1 WHERE id = $t;
			INSERT INTO effects (tenant_id, k) VALUES ($t, '$TAG:$k');
			SELECT idem_complete($t, idem_key('$TAG', '$k'), '{"done": true}') \gset
			\endif
			COMMIT;
			\echo :decision
		SQL
		)
		case $d in
			claimed|completed) break ;;
		esac
		sleep 0.05
	done
	echo "$t $TAG:$k $d" >>"$OUT"
done
