# pg_dump / pg_restore (custom format, --exit-on-error) into an empty
# database keeps both ledgers: rows, identity sequences, every constraint
# including the FK to the application's tenants table; replays still work.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = PostgreSQL::Test::Cluster->new('dump');
$node->init;
$node->append_conf('postgresql.conf', "shared_preload_libraries = 'idem'\nidem.valkey_port = 1\n");
$node->start;

$node->safe_psql('postgres', 'CREATE DATABASE app');
$node->safe_psql('app', q{
  CREATE EXTENSION idem;
  CREATE TABLE tenants (id bigint PRIMARY KEY, name text NOT NULL);
  INSERT INTO tenants VALUES (1, 'one'), (2, 'two');
  SELECT idem_install('tenants');
  BEGIN;
  SELECT idem_claim(1, idem_key('t', 'a'), idem_fingerprint('{"n": 1}'));
  SELECT idem_complete(1, idem_key('t', 'a'), '{"done": "a"}');
  SELECT idem_claim(2, idem_key('t', 'b'), idem_fingerprint('{}'));
  SELECT idem_fail(2, idem_key('t', 'b'), '{"error": "declined"}', false);
  SELECT idem_platform_claim(idem_key('maintenance.purge', '1'), idem_fingerprint('{}'));
  SELECT idem_platform_complete(idem_key('maintenance.purge', '1'), '{"deleted": 0}');
  COMMIT;
  SELECT idem_claim(1, idem_key('t', 'lease'), idem_fingerprint('{}'), interval '1 hour');
});

my $ledger_q = q{
  SELECT string_agg(format('%s|%s|%s|%s|%s|%s', id, tenant_id, encode(idempotency_key, 'hex'),
                           status, attempt, outcome), E'\n' ORDER BY id)
    FROM idempotency_keys};
my $platform_q = q{
  SELECT string_agg(format('%s|%s|%s|%s', id, encode(idempotency_key, 'hex'), status, outcome),
                    E'\n' ORDER BY id)
    FROM platform_idempotency_keys};
my $constraints_q = q{
  SELECT string_agg(format('%s %s %s', conrelid::regclass, conname, pg_get_constraintdef(oid)),
                    E'\n' ORDER BY conrelid::regclass::text, conname)
    FROM pg_constraint
   WHERE conrelid IN ('idempotency_keys'::regclass, 'platform_idempotency_keys'::regclass)};

my %before = map { $_->[0] => $node->safe_psql('app', $_->[1]) }
  (['ledger', $ledger_q], ['platform', $platform_q], ['constraints', $constraints_q]);

my $dump = $node->basedir . '/app.dump';
$node->command_ok([ 'pg_dump', '-Fc', '-f', $dump, '-d', $node->connstr('app') ],
	'pg_dump -Fc of the application database');
$node->safe_psql('postgres', 'CREATE DATABASE restored');
$node->command_ok(
	[ 'pg_restore', '--exit-on-error', '-d', $node->connstr('restored'), $dump ],
	'pg_restore --exit-on-error into an empty database');

for my $what (sort keys %before)
{
	my $q = $what eq 'ledger' ? $ledger_q : $what eq 'platform' ? $platform_q : $constraints_q;
	is($node->safe_psql('restored', $q), $before{$what}, "$what identical after restore");
}
like($before{constraints}, qr/idempotency_keys_tenant_id_fkey FOREIGN KEY \(tenant_id\) REFERENCES tenants\(id\)/,
	'the FK to tenants is among them');
is($node->safe_psql('restored', q{SELECT reloptions::text FROM pg_class WHERE relname = 'idempotency_keys'}),
	'{fillfactor=70}', 'storage settings restored');

# Replays, and the FK still refusing unknown tenants.
is($node->safe_psql('restored',
	q{SELECT decision || ' ' || outcome FROM idem_claim(1, idem_key('t', 'a'), idem_fingerprint('{"n": 1}'))}),
	'completed {"done": "a"}', 'completed result replays after restore');
is($node->safe_psql('restored',
	q{SELECT decision || ' ' || outcome FROM idem_claim(2, idem_key('t', 'b'), idem_fingerprint('{}'))}),
	'failed_permanent {"error": "declined"}', 'permanent failure replays after restore');
is($node->safe_psql('restored',
	q{SELECT decision FROM idem_claim(1, idem_key('t', 'lease'), idem_fingerprint('{}'))}),
	'busy', 'a running lease is still busy after restore');
is($node->safe_psql('restored',
	q{SELECT decision || ' ' || outcome FROM idem_platform_claim(idem_key('maintenance.purge', '1'), idem_fingerprint('{}'))}),
	'completed {"deleted": 0}', 'platform result replays after restore');
my ($ret, $out, $err) = $node->psql('restored',
	q{SELECT idem_claim(99, idem_key('t', 'x'), idem_fingerprint('{}'))});
like($err, qr/tenant 99 does not exist/, 'a claim for an unknown tenant is refused');
($ret, $out, $err) = $node->psql('restored', q{
  INSERT INTO idempotency_keys (tenant_id, idempotency_key, request_fingerprint, expires_at)
  VALUES (99, idem_key('t', 'x'), idem_fingerprint('{}'), now())});
like($err, qr/violates foreign key constraint "idempotency_keys_tenant_id_fkey"/,
	'the restored FK itself refuses an unknown tenant');

# The identity sequences carry on past the restored rows.
my $max_before = $node->safe_psql('restored', 'SELECT max(id) FROM idempotency_keys');
$node->safe_psql('restored',
	q{SELECT idem_claim(1, idem_key('t', 'new'), idem_fingerprint('{}'))});
cmp_ok($node->safe_psql('restored',
	q{SELECT id FROM idempotency_keys WHERE idempotency_key = idem_key('t', 'new')}),
	'>', $max_before, 'identity sequence continues after the restored rows');

$node->stop;
done_testing();
