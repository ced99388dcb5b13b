# idem 0.3 installed on a Citus cluster, then ALTER EXTENSION idem UPDATE
# to 0.4: the tenant functions the update creates (idem_complete_fenced,
# idem_fail_fenced, the tenant form of idem_emit) are delegated to the
# tenant's node like those idem_install delegated, so a lease-mode
# completion by the claim's fence works through the coordinator at once (it
# was refused there, 55000), and so does an emit, published by the worker.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;
use lib "$FindBin::RealBin/../t";

use IdemCitus;
use IdemValkey;
use PostgreSQL::Test::Utils;
use Test::More;

my $valkey = IdemValkey->new(name => 'valkey')->start;
my $cl = IdemCitus->new(valkey => $valkey);
my $c = $cl->coord;

$c->safe_psql('postgres', q{
	CREATE TABLE tenants (id bigint PRIMARY KEY);
	SELECT create_distributed_table('tenants', 'id');
	INSERT INTO tenants (id) SELECT g FROM generate_series(1, 40) g;
	CREATE EXTENSION idem VERSION '0.3';
	SELECT idem_install('tenants');
});

my $delegated = q{
	SELECT string_agg(p.proname || ' ' || d.distribution_argument_index || ' ' || d.force_delegation, ', '
	                  ORDER BY p.proname)
	FROM pg_dist_object d JOIN pg_proc p ON p.oid = d.objid
	WHERE d.classid = 'pg_proc'::regclass AND p.proname LIKE 'idem%'};
is($c->safe_psql('postgres', $delegated),
	'idem_apply 0 true, idem_claim 0 true, idem_complete 0 true, idem_fail 0 true, '
	  . 'idem_lookup 0 true',
	'0.3 on Citus: idem_install delegated the tenant API of 0.3');

$c->safe_psql('postgres', 'ALTER EXTENSION idem UPDATE');
is( $c->safe_psql('postgres', q{SELECT extversion FROM pg_extension WHERE extname = 'idem'})
	  . ' ' . $cl->w1->safe_psql('postgres', q{SELECT extversion FROM pg_extension WHERE extname = 'idem'}),
	'0.4 0.4', 'ALTER EXTENSION idem UPDATE: 0.4 on the coordinator and the workers');
is($c->safe_psql('postgres', $delegated),
	'idem_apply 0 true, idem_claim 0 true, idem_complete 0 true, idem_complete_fenced 0 true, '
	  . 'idem_emit 0 true, idem_emit_many 0 true, idem_fail 0 true, idem_fail_fenced 0 true, idem_lookup 0 true',
	'... and the functions it created are delegated by tenant_id with force_delegation');
is($cl->w1->safe_psql('postgres', $delegated),
	'idem_apply 0 true, idem_claim 0 true, idem_complete 0 true, idem_complete_fenced 0 true, '
	  . 'idem_emit 0 true, idem_emit_many 0 true, idem_fail 0 true, idem_fail_fenced 0 true, idem_lookup 0 true',
	'... in the workers\' metadata too');

# Lease mode through the coordinator: the claim commits alone, the fenced
# completion (and a fenced failure) follow, each delegated to the shard's node.
my $t1 = $cl->tenant_on($cl->w1);
my $t2 = $cl->tenant_on($cl->w2);
foreach my $t ($t1, $t2)
{
	my $fence = $c->safe_psql('postgres', qq{
		SELECT fence FROM idem_claim($t, idem_key('up', 'l'), idem_fingerprint('{}'), '30 s')});
	like($fence, qr/^\d+$/, "tenant $t: a lease-mode claim answers its fence");
	my ($rc, $out, $err) = $c->psql('postgres',
		qq{SELECT idem_complete_fenced($t, idem_key('up', 'l'), $fence, '{"sent": true}')});
	is($rc, 0, "tenant $t: idem_complete_fenced through the coordinator works") or diag($err);
	is( $c->safe_psql('postgres', qq{
			SELECT status || ' ' || outcome FROM idem_lookup($t, idem_key('up', 'l'))}),
		'completed {"sent": true}', "tenant $t: ... and completed the key");
	$fence = $c->safe_psql('postgres', qq{
		SELECT fence FROM idem_claim($t, idem_key('up', 'f'), idem_fingerprint('{}'), '30 s')});
	($rc, $out, $err) = $c->psql('postgres',
		qq{SELECT idem_fail_fenced($t, idem_key('up', 'f'), $fence, '{"why": "no"}', true)});
	is( $rc . ' ' . $c->safe_psql('postgres', qq{
			SELECT status FROM idem_lookup($t, idem_key('up', 'f'))}),
		'0 failed_retryable', "tenant $t: idem_fail_fenced through the coordinator works")
	  or diag($err);
}

# The tenant form of idem_emit, delegated by the update: a message emitted
# through the coordinator is recorded in the tenant's worker's outbox and
# published by that worker (the key form, run on the coordinator, finds no
# claim there).
my %ids;
foreach my $t ($t1, $t2)
{
	my ($rc, $out, $err) = $c->psql('postgres', qq{
		BEGIN;
		SELECT decision FROM idem_claim($t, idem_key('up', 'e'), idem_fingerprint('{}'));
		SELECT idem_emit($t, idem_key('up', 'e'), 'up.s', '{"t": $t}');
		SELECT idem_complete($t, idem_key('up', 'e'), '{}');
		COMMIT;});
	is($rc, 0, "tenant $t: idem_emit(tenant_id, key, stream, message) through the coordinator works")
	  or diag($err);
}
my $hex = $c->safe_psql('postgres', "SELECT encode(idem_key('up', 'e'), 'hex')");
ok( IdemValkey::poll_until(20, sub { ($valkey->command('XLEN', 'up.s') // 0) >= 2 }),
	'... and both messages are published');
is( join(' ', sort map { my %f = @{ $_->[1] }; "$f{id}:$f{body}" }
		  @{ $valkey->command('XRANGE', 'up.s', '-', '+') }),
	join(' ', sort("$hex-1:{\"t\":$t1}", "$hex-1:{\"t\":$t2}")),
	'... once each, with their ids');
is( join(' ', map { IdemValkey::stats_col($_, 'published') } $cl->nodes),
	'0 1 1', '... each by the publisher of its tenant\'s worker');

# Updating again (nothing to update) delegates nothing twice.
$c->safe_psql('postgres', 'ALTER EXTENSION idem UPDATE');
is($c->safe_psql('postgres', q{
		SELECT count(*) FROM pg_dist_object d JOIN pg_proc p ON p.oid = d.objid
		WHERE d.classid = 'pg_proc'::regclass AND p.proname LIKE 'idem%'}),
	'9', 'a second ALTER EXTENSION idem UPDATE changes nothing');

IdemValkey::check_counters($_) foreach $cl->nodes;
$_->stop foreach reverse $cl->nodes;
done_testing();
