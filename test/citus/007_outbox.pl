# The outbox on Citus: a tenant's messages are recorded by the tenant form
# idem_emit(tenant_id, key, stream, message), which Citus delegates like
# idem_claim (and a run's messages in one call of idem_emit_many, as the
# runners send them), into the outbox of the worker node that holds the
# claim; they commit with the claim there and that node's publisher
# publishes them.
# Emits through the coordinator for tenants on both workers (one node, and
# two nodes in one two-phase transaction) are published exactly once by
# id, each by its node; rollbacks publish nothing; an emit the coordinator
# cannot record is refused with 55000 and a hint; a shard moved while its
# messages wait (the streams' Valkey down) loses none and sends none twice:
# those committed before the move go out from the old node, those after it
# from the new one; and so does a split.
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

my $valkey = IdemValkey->new(name => 'valkey')->start;
# The streams have a Valkey of their own, which the test stops to make
# messages wait while the cache goes on.
my $streams = IdemValkey->new(name => 'streams')->start;
my $cl = IdemCitus->new(valkey => $valkey,
	conf => {
		'idem.outbox_valkey_host' => "'127.0.0.1'",
		'idem.outbox_valkey_port' => $streams->port });
my $c = $cl->coord;
my ($w1, $w2) = ($cl->w1, $cl->w2);
$cl->install_tenants;

# Every entry of a stream, as "<id field> <body field>", in stream order.
sub entries
{
	my ($stream) = @_;
	my $r = $streams->command('XRANGE', $stream, '-', '+') // [];
	return [ map { my %f = @{ $_->[1] }; "$f{id} $f{body}" } @$r ];
}

sub stream_len { return $streams->command('XLEN', $_[0]) // 0; }

sub wait_len
{
	my ($stream, $n) = @_;
	return IdemValkey::poll_until(30, sub { stream_len($stream) >= $n });
}

sub key_hex
{
	my ($k) = @_;
	return $c->safe_psql('postgres', "SELECT encode(idem_key('ob', '$k'), 'hex')");
}

sub published { return IdemValkey::stats_col($_[0], 'published'); }
sub waiting   { return IdemValkey::stats_col($_[0], 'outbox_waiting'); }

# One run through the coordinator: claim, effect, the tenant form of
# idem_emit for each body, complete; $end is COMMIT or ROLLBACK.
sub run_sql
{
	my ($t, $k, $stream, $end, @bodies) = @_;
	my $sql = "BEGIN; SELECT decision FROM idem_claim($t, idem_key('ob', '$k'), idem_fingerprint('{}'));"
	  . " UPDATE tenants SET n = n + 1 WHERE id = $t;";
	$sql .= " SELECT idem_emit($t, idem_key('ob', '$k'), '$stream', '$_');" foreach @bodies;
	$sql .= " SELECT idem_complete($t, idem_key('ob', '$k'), '{}'); $end;";
	return $sql;
}

my $t1 = $cl->tenant_on($w1);
my $t2 = $cl->tenant_on($w2);

# One transaction, claims on both workers (Citus commits it in two phases):
# key $k1 for $t1 and $k2 for $t2, emitting {"n": $n} and {"n": $n + 1}.
sub both_sql
{
	my ($k1, $k2, $stream, $n, $end) = @_;
	my ($n2, $sql) = ($n + 1, 'BEGIN;');
	$sql .= " SELECT idem_claim($_->[0], idem_key('ob', '$_->[1]'), idem_fingerprint('{}'));"
	  foreach ([ $t1, $k1 ], [ $t2, $k2 ]);
	$sql .= " SELECT idem_emit($t1, idem_key('ob', '$k1'), '$stream', '{\"n\": $n}');"
	  . " SELECT idem_emit($t2, idem_key('ob', '$k2'), '$stream', '{\"n\": $n2}');";
	$sql .= " SELECT idem_complete($_->[0], idem_key('ob', '$_->[1]'), '{}');"
	  foreach ([ $t1, $k1 ], [ $t2, $k2 ]);
	return "$sql $end;";
}

# ---------- set up by idem_install ----------
is( $c->safe_psql('postgres', q{
		SELECT string_agg(pg_get_function_identity_arguments(p.oid) || ': '
		                  || coalesce(d.distribution_argument_index::text || ' ' || d.force_delegation, 'local'),
		                  ' | ' ORDER BY p.pronargs)
		FROM pg_proc p LEFT JOIN pg_dist_object d
		  ON d.classid = 'pg_proc'::regclass AND d.objid = p.oid
		WHERE p.proname IN ('idem_emit', 'idem_emit_many')}),
	'stream text, message jsonb, key bytea: local | tenant_id bigint, key bytea, messages jsonb: 0 true'
	  . ' | tenant_id bigint, key bytea, stream text, message jsonb: 0 true',
	'install: the tenant form of idem_emit and idem_emit_many are delegated by tenant_id, the other runs where it is called');
is( $c->safe_psql('postgres', q{
		SELECT count(*) FROM pg_dist_partition WHERE logicalrelid = 'idem_outbox'::regclass}),
	'0', 'the outbox is a local table of each node, not a Citus table');

# ---------- emits for tenants on both workers ----------
my $before1 = published($w1);
my $before2 = published($w2);
my $before_c = published($c);
is($c->safe_psql('postgres', run_sql($t1, 'a', 'cit.s', 'COMMIT', '{"n": 1}', '{"n": 2}')),
	"claimed\n" . key_hex('a') . "-1\n" . key_hex('a') . "-2\n",
	'through the coordinator, for a tenant on w1: the ids are <key hex>-<n>');
$c->safe_psql('postgres', run_sql($t2, 'b', 'cit.s', 'COMMIT', '{"n": 3}'));
# One transaction, claims on both workers: Citus commits it in two phases.
$c->safe_psql('postgres', both_sql('c1', 'c2', 'cit.s', 4, 'COMMIT'));
my @want = sort(
	key_hex('a') . '-1 {"n":1}', key_hex('a') . '-2 {"n":2}', key_hex('b') . '-1 {"n":3}',
	key_hex('c1') . '-1 {"n":4}', key_hex('c2') . '-1 {"n":5}');
ok(wait_len('cit.s', 5), 'the messages of both workers are published');
is_deeply([ sort @{ entries('cit.s') } ], \@want, '... each once, with its id');
ok(IdemValkey::poll_until(10, sub { published($w1) - $before1 == 3 && published($w2) - $before2 == 2 }),
	'... each by the publisher of the worker that holds its tenant (w1: 3, w2: 2)');
is(published($c) - $before_c, 0, '... none by the coordinator\'s');
is(join(' ', map { waiting($_) } $c, $w1, $w2), '0 0 0', '... and no outbox holds any');

# ---------- rollbacks publish nothing ----------
$c->safe_psql('postgres', run_sql($t1, 'r1', 'cit.r', 'ROLLBACK', '{"n": 1}'));
$c->safe_psql('postgres', both_sql('r2', 'r3', 'cit.r', 2, 'ROLLBACK'));
# a failed effect says nothing either
$c->safe_psql('postgres', qq{
	BEGIN;
	SELECT idem_claim($t2, idem_key('ob', 'r4'), idem_fingerprint('{}'));
	SELECT idem_emit($t2, idem_key('ob', 'r4'), 'cit.r', '{"n": 4}');
	SELECT idem_fail($t2, idem_key('ob', 'r4'), '{}', false);
	COMMIT;
});
# a committed one after them, on each worker, to know they had their turn
$c->safe_psql('postgres', run_sql($_->[0], $_->[1], 'cit.r', 'COMMIT', '{"n": 9}'))
  foreach ([ $t1, 'r5' ], [ $t2, 'r6' ]);
ok(wait_len('cit.r', 2), 'after rollbacks, committed messages go out');
is_deeply([ sort @{ entries('cit.r') } ],
	[ sort(key_hex('r5') . '-1 {"n":9}', key_hex('r6') . '-1 {"n":9}') ],
	'... and nothing of a rolled-back transaction (one node, two nodes) or of idem_fail');

# ---------- what the coordinator cannot record: refused, with a hint ----------
my ($rc, $out, $err) = $c->psql('postgres', qq{
	BEGIN;
	SELECT idem_claim($t1, idem_key('ob', 'k'), idem_fingerprint('{}'));
	SELECT idem_emit('cit.k', '{"n": 1}', idem_key('ob', 'k'));
	COMMIT;}, extra_params => [ '-v', 'VERBOSITY=verbose' ]);
like($err, qr/ERROR:  55000: cannot emit a message: this transaction holds no claim on this node/,
	'the key form on the coordinator after a delegated claim: 55000');
like($err, qr/HINT:  Call idem_emit\(tenant_id, key, stream, message\): Citus delegates it/,
	'... whose hint names the tenant form');
($rc, $out, $err) = $c->psql('postgres', qq{
	BEGIN;
	SELECT idem_claim($t1, idem_key('ob', 'k'), idem_fingerprint('{}'));
	DO \$\$BEGIN PERFORM idem_emit($t1, idem_key('ob', 'k'), 'cit.k', '{"n": 1}'); END\$\$;
	COMMIT;}, extra_params => [ '-v', 'VERBOSITY=verbose' ]);
like($err, qr/ERROR:  55000: cannot emit a message for this key: this transaction holds no claim of it for this tenant on this node/,
	'the tenant form where Citus cannot delegate it (PL/pgSQL): 55000');
like($err, qr/HINT:  Call idem_emit\(tenant_id, key, stream, message\) as a statement of its own/,
	'... whose hint says how Citus delegates it');
is(stream_len('cit.k'), 0, '... and nothing is published');

# The runners' statement for a tenant's run (idem_call_emit, run.emit): its
# messages in one call of idem_emit_many, delegated likewise.
my $hrn = key_hex('rn');
is( $c->safe_psql('postgres', qq{
		BEGIN;
		SELECT decision FROM idem_claim($t2, idem_key('ob', 'rn'), idem_fingerprint('{}'));
		SELECT idem_emit_many($t2, idem_key('ob', 'rn'), '[["cit.rn", {"n": 1}], ["cit.rn", {"n": 2}]]');
		SELECT idem_complete($t2, idem_key('ob', 'rn'), '{}');
		COMMIT;}),
	"claimed\n{$hrn-1,$hrn-2}\n", 'idem_emit_many through the coordinator: the ids, in order');
ok(wait_len('cit.rn', 2), '... published');
is_deeply(entries('cit.rn'), [ "$hrn-1 {\"n\":1}", "$hrn-2 {\"n\":2}" ], '... once each, in order');

# idem_apply's SQL handler runs on the tenant's node: the key form works there.
$c->safe_psql('postgres', q{
	CREATE FUNCTION emit_effect(args jsonb) RETURNS jsonb LANGUAGE sql AS $$
		SELECT jsonb_build_object('id', idem_emit('cit.h', args))
	$$;
});
is( $c->safe_psql('postgres', qq{
		SELECT a.decision || ' ' || a.ran FROM idem_apply($t2, idem_key('ob', 'h'), idem_fingerprint('{}'),
		                                                 'emit_effect(jsonb)', '{"n": 1}') AS a}),
	'applied true', 'idem_apply through the coordinator, its handler emitting');
ok(wait_len('cit.h', 1), '... its message is published');
is_deeply(entries('cit.h'), [ key_hex('h') . '-1 {"n":1}' ], '... once, with its id');

# ---------- a shard moved while its messages wait ----------
$streams->stop;
$c->safe_psql('postgres', run_sql($t1, "m$_", 'cit.m', 'COMMIT', qq({"m": $_})))
  foreach 1 .. 5;
# a transaction holding a claim and its message while the move starts
my $bg = $c->background_psql('postgres');
$bg->query_safe(qq{BEGIN;
	SELECT idem_claim($t1, idem_key('ob', 'm6'), idem_fingerprint('{}'));
	SELECT idem_emit($t1, idem_key('ob', 'm6'), 'cit.m', '{"m": 6}')});
is(waiting($w1), '5', 'the streams\' Valkey down: 5 messages wait in w1\'s outbox');
my $shard = $c->safe_psql('postgres',
	"SELECT get_shard_id_for_distribution_column('tenants', ${t1}::bigint)");
my $move_out = '';
my $move = IPC::Run::start(
	[ 'psql', '-X', '-At', '-v', 'ON_ERROR_STOP=1', '-d', $c->connstr('postgres'), '-c',
	  sprintf("SELECT citus_move_shard_placement(%s, '127.0.0.1', %d, '127.0.0.1', %d, shard_transfer_mode => 'block_writes')",
		$shard, $w1->port, $w2->port) ],
	'>', \$move_out, '2>&1');
ok( IdemValkey::poll_until(20, sub {
		$w1->safe_psql('postgres', q{
			SELECT EXISTS (SELECT 1 FROM pg_locks
			WHERE locktype = 'advisory' AND mode = 'ExclusiveLock' AND NOT granted)}) eq 't' }),
	'the move waits on w1 for the open transaction that emitted');
$bg->query_safe('SELECT idem_complete(' . $t1 . ", idem_key('ob', 'm6'), '{}'); COMMIT");
$bg->quit;
ok($move->finish, '... and finishes once it committed') or diag($move_out);
is($cl->node_of($t1)->name, $w2->name, 'the tenant\'s shard moved to w2');
is(waiting($w1), '6', 'w1 still holds the messages committed before the move');
$c->safe_psql('postgres', run_sql($t1, "m$_", 'cit.m', 'COMMIT', qq({"m": $_})))
  foreach 7 .. 8;
is(waiting($w2), '2', 'those committed after it wait in w2\'s outbox');
$streams->start;
ok(wait_len('cit.m', 8), 'the streams\' Valkey back: every message is published');
is_deeply([ sort @{ entries('cit.m') } ],
	[ sort map { key_hex("m$_") . qq(-1 {"m":$_}) } 1 .. 8 ],
	'... each once, with its id: none lost or sent twice by the move');
ok(IdemValkey::poll_until(10, sub { waiting($w1) eq '0' && waiting($w2) eq '0' }),
	'... and both outboxes are empty');
sleep 2;
is(stream_len('cit.m'), 8, '... and nothing is sent again later');

# ---------- a shard split while its messages wait ----------
$streams->stop;
$c->safe_psql('postgres', run_sql($t2, "s$_", 'cit.sp', 'COMMIT', qq({"s": $_})))
  foreach 1 .. 3;
my $old_shard = $c->safe_psql('postgres',
	"SELECT get_shard_id_for_distribution_column('tenants', ${t2}::bigint)");
$c->safe_psql('postgres',
	"SELECT isolate_tenant_to_new_shard('tenants', $t2, 'CASCADE', shard_transfer_mode => 'block_writes')");
isnt($c->safe_psql('postgres', "SELECT get_shard_id_for_distribution_column('tenants', ${t2}::bigint)"),
	$old_shard, 'the tenant was isolated into a new shard while 3 of its messages waited');
$c->safe_psql('postgres', run_sql($t2, 's4', 'cit.sp', 'COMMIT', '{"s": 4}'));
is(waiting($cl->node_of($t2)), '4', '... they and one emitted after the split wait in its node\'s outbox');
$streams->start;
ok(wait_len('cit.sp', 4), 'the streams\' Valkey back: they are published');
is_deeply([ sort @{ entries('cit.sp') } ],
	[ sort map { key_hex("s$_") . qq(-1 {"s":$_}) } 1 .. 4 ],
	'... each once, with its id');

IdemValkey::check_counters($_) foreach $cl->nodes;
done_testing();
