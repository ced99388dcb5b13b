# idem on Citus: a coordinator and two workers on loopback, tenants
# distributed by id.  Install, delegation of the tenant API to the worker
# holding the tenant's shard, the Valkey copy made there, calls Citus did
# not delegate, a multi-node (two-phase) transaction, a worker backend
# terminated mid-transaction, a shard move and a rebalance under load, and
# the purge of every shard.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;
use lib "$FindBin::RealBin/../t";

use IdemCitus;
use IdemValkey;
use IPC::Run;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time usleep);

my $valkey = IdemValkey->new(name => 'valkey')->start;
my $cl = IdemCitus->new(valkey => $valkey);
my $c = $cl->coord;

# ---------- install ----------
$cl->install_tenants(columns => "name text NOT NULL DEFAULT '', ", effects => 1);

is( $c->safe_psql('postgres', q{
		SELECT partmethod::text || ' ' || column_to_column_name(logicalrelid, partkey) || ' '
		  || (colocationid = (SELECT colocationid FROM pg_dist_partition
		                      WHERE logicalrelid = 'tenants'::regclass))
		FROM pg_dist_partition WHERE logicalrelid = 'idempotency_keys'::regclass}),
	'h tenant_id true',
	'install: idempotency_keys is distributed by tenant_id, co-located with tenants');
is( $c->safe_psql('postgres', q{
		SELECT count(*) FROM pg_dist_partition
		WHERE logicalrelid = 'platform_idempotency_keys'::regclass}),
	'0', 'install: platform_idempotency_keys stays a local table of the coordinator');
is($cl->w1->safe_psql('postgres', "SELECT to_regclass('platform_idempotency_keys') IS NULL"),
	't', '... which the workers do not have');

# The one Citus-forced difference from the single-node ledger: the primary
# key includes the distribution column.  Everything else is the same.
is( $c->safe_psql('postgres', q{
		SELECT string_agg(conname || ': ' || pg_get_constraintdef(oid), E'\n' ORDER BY conname)
		FROM pg_constraint WHERE conrelid = 'idempotency_keys'::regclass}),
	join("\n",
		'idempotency_keys_attempt_check: CHECK ((attempt > 0))',
		q{idempotency_keys_check: CHECK (((status <> 'processing'::text) OR (outcome = '{}'::jsonb)))},
		'idempotency_keys_idempotency_key_check: CHECK ((octet_length(idempotency_key) = 32))',
		q{idempotency_keys_outcome_check: CHECK (((jsonb_typeof(outcome) = 'object'::text) AND (octet_length((outcome)::text) <= 4096)))},
		'idempotency_keys_owner_key: UNIQUE (tenant_id, idempotency_key)',
		'idempotency_keys_pkey: PRIMARY KEY (tenant_id, id)',
		'idempotency_keys_request_fingerprint_check: CHECK ((octet_length(request_fingerprint) = 32))',
		q{idempotency_keys_status_check: CHECK ((status = ANY (ARRAY['processing'::text, 'completed'::text, 'failed_retryable'::text, 'failed_permanent'::text])))},
		'idempotency_keys_tenant_id_fkey: FOREIGN KEY (tenant_id) REFERENCES tenants(id)'),
	'install: on Citus the primary key is (tenant_id, id); every other constraint is the single-node ledger\'s');
is( $c->safe_psql('postgres', q{
		SELECT pg_get_constraintdef(oid) FROM pg_constraint
		WHERE conname = 'platform_idempotency_keys_pkey'}),
	'PRIMARY KEY (id)', '... and the platform ledger keeps PRIMARY KEY (id)');
is( $c->safe_psql('postgres', q{
		SELECT string_agg(p.proname || ' ' || d.distribution_argument_index || ' ' || d.force_delegation, ', '
		                  ORDER BY p.proname)
		FROM pg_dist_object d JOIN pg_proc p ON p.oid = d.objid
		WHERE d.classid = 'pg_proc'::regclass AND p.proname LIKE 'idem%'}),
	'idem_apply 0 true, idem_claim 0 true, idem_complete 0 true, idem_complete_fenced 0 true, '
	  . 'idem_fail 0 true, idem_fail_fenced 0 true, idem_lookup 0 true',
	'install: the tenant API is distributed by tenant_id with force_delegation');

my $w1 = $cl->w1;
my $w2 = $cl->w2;
my $t1 = $cl->tenant_on($w1);
my $t2 = $cl->tenant_on($w2);
my $fp = $c->safe_psql('postgres', "SELECT encode(idem_fingerprint('{}'), 'hex')");

# A runner learns the cluster's keyspace on the coordinator, which sends it
# to every worker node with the secrets: from then on they copy there.
ok(defined IdemValkey::wait_keyspace($c), 'the coordinator names the cluster\'s cache keyspace');

# The Valkey key of a tenant's row: every node copies under the keyspace
# the coordinator names.
sub vkey
{
	my ($t, $scope, $id) = @_;
	return IdemValkey::tenant_key($c, $t, $scope, $id);
}

# kind attempt fingerprint outcome of a value, with its MAC checked under
# the secrets of the node that wrote it.
sub shape
{
	my ($node, $key, $value) = @_;
	my $v = IdemValkey::parse_value($value) or return 'not an idem2 value';
	return 'bad MAC' unless IdemValkey::mac_ok($node, $key, $value);
	return "$v->{kind} $v->{attempt} $v->{fingerprint} $v->{outcome}";
}

sub shard_rows
{
	my ($node, $t, $where) = @_;
	my $shard = $cl->shard_of($t);
	return 'no shard'
	  if $node->safe_psql('postgres', "SELECT to_regclass('$shard') IS NULL") eq 't';
	return $node->safe_psql('postgres',
		"SELECT string_agg(status || ' ' || attempt, ',') FROM $shard WHERE $where");
}

# ---------- the handler, unchanged, against the coordinator ----------
my $out = $c->safe_psql('postgres', qq{
	BEGIN;
	SELECT decision FROM idem_claim($t1, idem_key('c', 'a'), idem_fingerprint('{}'));
	UPDATE tenants SET n = n + 1 WHERE id = $t1;
	SELECT idem_complete($t1, idem_key('c', 'a'), '{"ok": 1}');
	COMMIT;
});
is($out, "claimed\n", 'claim -> effect -> complete through the coordinator');
is(shard_rows($w1, $t1, "idempotency_key = idem_key('c', 'a')"), 'completed 1',
	'the row is in the tenant\'s shard on the worker that holds it');
is(shard_rows($w2, $t1, 'true'), 'no shard', '... and nowhere else');
my $k = vkey($t1, 'c', 'a');
is(shape($w1, $k, $valkey->wait_for_key($k, 10)), qq(c 1 $fp {"ok": 1}),
	'the worker holding the shard copied the result into Valkey');
is( $c->safe_psql('postgres', qq{
		SELECT decision || ' ' || outcome FROM idem_claim($t1, idem_key('c', 'a'), idem_fingerprint('{}'))}),
	'completed {"ok": 1}', 'a redelivery replays the result');
is( $c->safe_psql('postgres', qq{
		SELECT decision FROM idem_claim($t1, idem_key('c', 'a'), idem_fingerprint('{"other": 1}'))}),
	'mismatch', 'another request under the same key: mismatch');
is( $c->safe_psql('postgres', qq{SELECT status || ' ' || attempt FROM idem_lookup($t1, idem_key('c', 'a'))}),
	'completed 1', 'idem_lookup reads the shard');
$c->safe_psql('postgres', qq{
	SELECT idem_claim($t2, idem_key('c', 'f'), idem_fingerprint('{}'));
	SELECT idem_fail($t2, idem_key('c', 'f'), '{"why": "no"}', false);
});
$k = vkey($t2, 'c', 'f');
is(shape($w2, $k, $valkey->wait_for_key($k, 10)), qq(f 1 $fp {"why": "no"}),
	'idem_fail on the other worker: copied by that worker');
like( $c->safe_psql('postgres', q{
		SELECT decision FROM idem_platform_claim(idem_key('p', 'x'), idem_fingerprint('{}'));
		SELECT idem_platform_complete(idem_key('p', 'x'), '{}');
		SELECT status FROM platform_idempotency_keys WHERE idempotency_key = idem_key('p', 'x')}),
	qr/^claimed\n\ncompleted$/, 'the platform API uses the coordinator\'s local ledger');

# Sent to the worker that does not hold the tenant: delegated over there.
is( $w2->safe_psql('postgres', qq{
		SELECT decision FROM idem_claim($t1, idem_key('c', 'a'), idem_fingerprint('{}'))}),
	'completed', 'a call sent to another worker is delegated to the shard\'s node');

# ---------- busy, at once, across sessions ----------
my $bg = $c->background_psql('postgres');
$bg->query_safe(qq{BEGIN; SELECT idem_claim($t1, idem_key('c', 'busy'), idem_fingerprint('{}'))});
my $t0 = time();
my $busy = $c->safe_psql('postgres', qq{
	SELECT decision FROM idem_claim($t1, idem_key('c', 'busy'), idem_fingerprint('{}'))});
my $took = time() - $t0;
is($busy, 'busy', 'a concurrent claim answers busy');
ok($took < 2, sprintf('... without waiting for the holder (%.3f s)', $took));
$bg->query_safe('ROLLBACK');

# ---------- idem_apply: claim, a SQL handler, complete in one statement ----------
# Delegated like the rest of the tenant API: the handler runs in the worker
# backend that holds the tenant's shard, its writes to co-located tables
# there, committed with the key.  The handler is an ordinary function,
# created on the coordinator (Citus propagates it).
$c->safe_psql('postgres', q{
	CREATE FUNCTION apply_effect(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
	BEGIN
		IF args ? 'fail' THEN RAISE EXCEPTION 'refused'; END IF;
		INSERT INTO effects (tenant_id, k) VALUES ((args->>'t')::bigint, args->>'k');
		RETURN jsonb_build_object('k', args->>'k');
	END $$;
});
my $apply = sub {
	my ($node, $t, $k, $args) = @_;
	return $node->psql('postgres', qq{
		SELECT a.decision || ' ' || a.attempt || ' ' || coalesce(a.outcome::text, '-') || ' ' || a.ran
		FROM idem_apply($t, idem_key('ap', '$k'), idem_fingerprint('{}'), 'apply_effect(jsonb)', '$args') AS a});
};
my ($arc, $aout, $aerr) = $apply->($c, $t1, 'a1', qq({"t": $t1, "k": "ap:a1"}));
is($aout, qq(applied 1 {"k": "ap:a1"} true), 'idem_apply through the coordinator: applied')
  or diag($aerr);
is(shard_rows($w1, $t1, "idempotency_key = idem_key('ap', 'a1')"), 'completed 1',
	'... the key in the tenant\'s shard, on the worker that holds it');
is($c->safe_psql('postgres', "SELECT count(*) FROM effects WHERE k = 'ap:a1'"), '1',
	'... the effect committed with it, once');
$k = vkey($t1, 'ap', 'a1');
is(shape($w1, $k, $valkey->wait_for_key($k, 10)), qq(c 1 $fp {"k": "ap:a1"}),
	'... and copied into Valkey by that worker');
($arc, $aout, $aerr) = $apply->($c, $t1, 'a1', qq({"t": $t1, "k": "ap:a1"}));
is($aout, qq(completed 1 {"k": "ap:a1"} false), 'a redelivery replays: the handler does not run')
  or diag($aerr);
($arc, $aout, $aerr) = $apply->($w2, $t1, 'a1', qq({"t": $t1, "k": "ap:a1"}));
is($aout, qq(completed 1 {"k": "ap:a1"} false), '... also sent to the worker without the shard')
  or diag($aerr);
is($c->safe_psql('postgres', "SELECT count(*) FROM effects WHERE k = 'ap:a1'"), '1', '... the effect still once');
($arc, $aout, $aerr) = $apply->($c, $t2, 'a2', qq({"t": $t2, "k": "ap:a2", "fail": true}));
like($aout, qr/^failed_permanent 1 \{.*"sqlstate": "P0001"\} true$/,
	'a handler that raises on the other worker: failed_permanent recorded')
  or diag($aerr);
is( $c->safe_psql('postgres', "SELECT count(*) FROM effects WHERE k = 'ap:a2'")
	  . ' ' . shard_rows($w2, $t2, "idempotency_key = idem_key('ap', 'a2')"),
	'0 failed_permanent 1', '... its writes rolled back, the failure in the shard');

# ---------- lease mode, fenced by the claim's fence ----------
# The claim commits alone on the shard's node; the fenced completion is
# delegated there too; a takeover gives the shard's row a new id (drawn
# from that node's range), so the first holder's fence is refused.
my $f1 = $c->safe_psql('postgres',
	qq{SELECT fence FROM idem_claim($t1, idem_key('lf', '1'), idem_fingerprint('{}'), '1 millisecond')});
usleep(20_000);
my $f2 = $c->safe_psql('postgres',
	qq{SELECT attempt || ' ' || fence FROM idem_claim($t1, idem_key('lf', '1'), idem_fingerprint('{}'), '1 hour')});
my ($frc, $fout, $ferr) = $c->psql('postgres',
	qq{SELECT idem_complete_fenced($t1, idem_key('lf', '1'), $f1, '{"by": 1}')});
like($ferr, qr/another claim holds it now/, 'lease mode: the stale holder\'s fence is refused on the shard\'s node');
$f2 =~ s/^2 // or diag("takeover: $f2");
$c->safe_psql('postgres', qq{SELECT idem_complete_fenced($t1, idem_key('lf', '1'), $f2, '{"by": 2}')});
is(shard_rows($w1, $t1, "idempotency_key = idem_key('lf', '1')"), 'completed 2',
	'... the taker\'s fence completes the key in the tenant\'s shard');

# ---------- never a shell table ----------
foreach my $case (
	[ qq{SELECT (idem_claim($t1, idem_key('c', 'u'), idem_fingerprint('{}'))).decision},
		'a call in an expression' ],
	[ qq{SELECT decision FROM idem_claim((SELECT ${t1}::bigint), idem_key('c', 'u'), idem_fingerprint('{}'))},
		'a tenant that is not a constant' ],
	[ qq{DO \$\$BEGIN PERFORM idem_claim($t1, idem_key('c', 'u'), idem_fingerprint('{}')); END\$\$},
		'a call from PL/pgSQL' ])
{
	my ($ret, $o, $err) = $c->psql('postgres', "\\set VERBOSITY verbose\n" . $case->[0]);
	like($err, qr/55000: the idem ledger shard of tenant $t1 is not on this node/,
		"undelegated ($case->[1]): refused");
	like($err, qr/HINT:  Call the function as a statement of its own/, '... with a hint');
}
my ($ret, $o, $err) = $w2->psql('postgres',
	qq{SELECT (idem_lookup($t1, idem_key('c', 'a'))).status});
like($err, qr/not on this node/, 'undelegated on a worker without the shard: refused');
is( join(' ', map { $_->safe_psql('postgres', "SELECT pg_relation_size('idempotency_keys')") } $cl->nodes),
	'0 0 0', 'the distributed table\'s own storage stays empty on every node');

# ---------- a transaction over two workers and a reference table ----------
$out = $c->safe_psql('postgres', qq{
	BEGIN;
	SELECT decision FROM idem_claim($t1, idem_key('c', 'multi'), idem_fingerprint('{}'));
	UPDATE tenants SET n = n + 1 WHERE id = $t2;
	INSERT INTO audit VALUES ($t1, 'multi');
	SELECT idem_complete($t1, idem_key('c', 'multi'), '{"multi": true}');
	COMMIT;
});
is($out, "claimed\n", 'a handler writing another worker and a reference table commits (two-phase)');
$c->safe_psql('postgres', qq{
	SELECT idem_claim($t1, idem_key('c', 'after-multi'), idem_fingerprint('{}'));
	SELECT idem_complete($t1, idem_key('c', 'after-multi'), '{}');
});
my ($k_after, $k_multi) = (vkey($t1, 'c', 'after-multi'), vkey($t1, 'c', 'multi'));
ok(defined $valkey->wait_for_key($k_after, 10), 'a one-node commit after it is copied');
is($valkey->command('GET', $k_multi), undef, 'a two-phase commit is not copied into Valkey');
is( $c->safe_psql('postgres', qq{SELECT status FROM idem_lookup($t1, idem_key('c', 'multi'))})
	  . ' ' . $c->safe_psql('postgres', "SELECT count(*) FROM audit WHERE note = 'multi'"),
	'completed 1', '... with its key and its effects');
ok(defined $valkey->wait_for_key($k_multi, 10),
	'... and the first read of it in PostgreSQL repopulates Valkey');
is( $c->safe_psql('postgres', qq{
		SELECT decision || ' ' || outcome FROM idem_claim($t1, idem_key('c', 'multi'), idem_fingerprint('{}'))}),
	'completed {"multi": true}', '... and replays from PostgreSQL');

# ---------- a worker backend terminated mid-transaction ----------
$bg = $c->background_psql('postgres', on_error_stop => 0);
$bg->query_safe(qq{BEGIN; SELECT idem_claim($t1, idem_key('c', 'kill'), idem_fingerprint('{}'));
	UPDATE tenants SET n = n + 1 WHERE id = $t1;
	INSERT INTO effects (tenant_id, k) VALUES ($t1, 'kill')});
my $killed = $w1->safe_psql('postgres', q{
	SELECT count(pg_terminate_backend(pid)) FROM pg_locks
	WHERE locktype = 'advisory' AND objsubid = 478 AND granted});
is($killed, '1', 'the worker backend holding the key lock is terminated');
$bg->query(qq{SELECT idem_complete($t1, idem_key('c', 'kill'), '{}')});
$bg->query('COMMIT');
$bg->quit;
is( $c->safe_psql('postgres', qq{
		SELECT decision || ' ' || attempt FROM idem_claim($t1, idem_key('c', 'kill'), idem_fingerprint('{}'))}),
	'claimed 1', 'nothing of the killed transaction survived: the key is claimed afresh');
is($c->safe_psql('postgres', "SELECT count(*) FROM effects WHERE k = 'kill'"), '0',
	'... and its effect is gone with it');

# ---------- a shard move and a rebalance under load ----------
my $connstr = $c->connstr('postgres');
my $tmp = PostgreSQL::Test::Utils::tempdir();
my @loads;
foreach my $i (1 .. 3)
{
	push @loads, IPC::Run::start(
		[ 'bash', "$FindBin::RealBin/load.sh", $connstr, 'mv', 100, 60, 12, "$tmp/load$i" ]);
}
usleep(500_000);
my $moved_tenant = $cl->tenant_on($w1);
my $shardid = $c->safe_psql('postgres',
	"SELECT get_shard_id_for_distribution_column('tenants', ${moved_tenant}::bigint)");
$c->safe_psql('postgres', sprintf(
	"SELECT citus_move_shard_placement(%s, '127.0.0.1', %d, '127.0.0.1', %d, shard_transfer_mode => 'force_logical')",
	$shardid, $w1->port, $w2->port));
is($cl->node_of($moved_tenant)->port, $w2->port, 'a shard moved from worker 1 to worker 2 under load');
$c->safe_psql('postgres', 'SELECT citus_rebalance_start(shard_transfer_mode => \'block_writes\')');
$c->safe_psql('postgres', 'SELECT citus_rebalance_wait()');
my $done_then = 0;
foreach my $i (1 .. 3)
{
	$done_then += () = slurp_file("$tmp/load$i") =~ /\n/g if -e "$tmp/load$i";
}
ok($done_then < 300, "the load was still running when the rebalance ended ($done_then of 300 tasks done)");
is( $c->safe_psql('postgres', q{
		SELECT string_agg(state::text, ',') FROM pg_dist_background_job}),
	'finished', 'a rebalance ran to the end under load');
$_->finish foreach @loads;
my %tasks;
foreach my $i (1 .. 3)
{
	open(my $fh, '<', "$tmp/load$i") or die;
	while (<$fh>)
	{
		my ($t, $k, $d) = split;
		$tasks{"$t $k"}++;
		fail("task $t $k ended as '" . ($d // '') . "'") unless ($d // '') =~ /^(claimed|completed)$/;
	}
}
ok(keys %tasks > 20, scalar(keys %tasks) . ' distinct tasks, 300 deliveries');
is( $c->safe_psql('postgres', q{
		SELECT count(*) FILTER (WHERE c > 1) || ' doubled, ' || count(*) || ' effects'
		FROM (SELECT k, count(*) AS c FROM effects WHERE k LIKE 'mv:%' GROUP BY tenant_id, k) e}),
	'0 doubled, ' . scalar(keys %tasks) . ' effects',
	'across the move and the rebalance: every task had its effect once');
is( $c->safe_psql('postgres', q{
		SELECT count(*) FROM idempotency_keys
		WHERE status = 'completed' AND outcome = '{"done": true}'}),
	scalar(keys %tasks), '... and every key is completed, once');
is( $c->safe_psql('postgres', q{
		SELECT count(*) FROM tenants t
		WHERE n <> (SELECT count(*) FROM effects e WHERE e.tenant_id = t.id AND e.k LIKE 'mv:%')
		  + CASE WHEN t.id = } . "$t1 THEN 1 WHEN t.id = $t2 THEN 1 ELSE 0 END"),
	'0', '... and every tenant\'s counter is exact');
my $mk = $c->safe_psql('postgres', q{SELECT k FROM effects WHERE k LIKE 'mv:%' ORDER BY k LIMIT 1});
my ($mkt) = $c->safe_psql('postgres', "SELECT tenant_id FROM effects WHERE k = '$mk' LIMIT 1");
(my $mkid = $mk) =~ s/^mv://;
is( $c->safe_psql('postgres', qq{
		SELECT decision FROM idem_claim($mkt, idem_key('mv', '$mkid'), idem_fingerprint('{}'))}),
	'completed', 'a key written before the moves replays after them');

# ---------- purge: every shard ----------
$c->safe_psql('postgres', qq{
	SELECT idem_claim($t1, idem_key('c', 'old1'), idem_fingerprint('{}'));
	SELECT idem_complete($t1, idem_key('c', 'old1'), '{}', '1 millisecond');
	SELECT idem_claim($t2, idem_key('c', 'old2'), idem_fingerprint('{}'));
	SELECT idem_complete($t2, idem_key('c', 'old2'), '{}', '1 millisecond');
	SELECT idem_platform_claim(idem_key('c', 'old3'), idem_fingerprint('{}'));
	SELECT idem_platform_complete(idem_key('c', 'old3'), '{}', '1 millisecond');
});
usleep(50_000);
my $before = $c->safe_psql('postgres', 'SELECT count(*) FROM idempotency_keys');
is($c->safe_psql('postgres', 'SELECT idem_purge(1000)'), '3',
	'idem_purge on the coordinator purges expired keys on every shard and the platform ledger');
is($c->safe_psql('postgres', 'SELECT count(*) FROM idempotency_keys'), $before - 2,
	'... and nothing else');
is($c->safe_psql('postgres', 'SELECT idem_purge(1000)'), '0', '... a second call finds nothing');

done_testing();
