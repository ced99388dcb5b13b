# Rows that leave a ledger outside idem (DELETE, UPDATE, TRUNCATE, a
# restore with pg_restore --clean) are no longer answered from Valkey: the
# transaction that removed them starts a new history epoch when it commits,
# so a message whose row is gone is applied again, not replayed from the
# copy of the result the database no longer holds.  idem's own writes and
# idem_purge keep the epoch (and the warm cache).
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use IdemValkey;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $valkey = IdemValkey->new(name => 'valkey')->start;
my $node = IdemValkey::streaming_node('node', $valkey);

sub run { IdemValkey::run_message($node, 'postgres', $valkey, 1, 'lr', $_[0], '{"x": 1}') }
sub sql { $node->safe_psql('postgres', $_[0]) }

# Apply $id, wait for its copy, and check that a redelivery replays it
# from Valkey.
sub applied_and_cached
{
	my ($id) = @_;
	my ($status, $source) = run($id);
	is("$status $source", 'applied handler', "$id is applied");
	ok(defined $valkey->wait_for_key(IdemValkey::tenant_key($node, 1, 'lr', $id), 10),
		"... its result copied to Valkey");
	($status, $source) = run($id);
	is("$status $source", 'replayed valkey', '... and a redelivery replays it from Valkey');
}

# After $what removed $id's row: a new epoch, and $id applied again.
sub applied_again
{
	my ($id, $what, $ks_before) = @_;
	my $ks = IdemValkey::keyspace($node);
	isnt($ks, $ks_before, "$what: a new history epoch (keyspace $ks)");
	my ($status, $source) = run($id);
	is("$status $source", 'applied handler', "$what: $id is applied again, not replayed");
	like(slurp_file($node->logfile), qr/removed ledger rows outside idem_purge/,
		"$what: the log says why the epoch changed");
}

# --- idem's own writes and idem_purge keep the epoch ---
applied_and_cached('m1');
my $ks = IdemValkey::keyspace($node);
sql(q{SET idem.min_retention = 0; SET idem.purge_grace = 0;
	BEGIN; SELECT idem_claim(1, idem_key('lr', 'gone'), idem_fingerprint('{}'));
	SELECT idem_complete(1, idem_key('lr', 'gone'), '{"a": 1}', '1 millisecond'); COMMIT;
	SELECT pg_sleep(0.01); SELECT idem_purge();});
is(sql(q{SELECT count(*) FROM idempotency_keys WHERE idempotency_key = idem_key('lr', 'gone')}),
	'0', 'idem_purge removed an expired row');
is(IdemValkey::keyspace($node), $ks, '... and the epoch is kept (no renewal for idem\'s own writes)');
my ($status, $source) = run('m1');
is("$status $source", 'replayed valkey', '... with its warm cache');

# --- DELETE by hand ---
sql(q{DELETE FROM idempotency_keys WHERE idempotency_key = idem_key('lr', 'm1')});
applied_again('m1', 'DELETE', $ks);
is(sql(q{SELECT count(*) FROM effects WHERE id = 'm1'}), '2',
	'DELETE: the effect ran again, as the removed row asks');

# --- a DELETE that rolls back keeps the epoch ---
applied_and_cached('m2');
$ks = IdemValkey::keyspace($node);
sql(q{BEGIN; DELETE FROM idempotency_keys WHERE idempotency_key = idem_key('lr', 'm2'); ROLLBACK;});
is(IdemValkey::keyspace($node), $ks, 'a DELETE rolled back keeps the epoch');

# --- UPDATE by hand (a completed row set back to failed_retryable) ---
sql(q{UPDATE idempotency_keys SET status = 'failed_retryable'
	WHERE idempotency_key = idem_key('lr', 'm2')});
applied_again('m2', 'UPDATE', $ks);

# --- DELETE from a PL/pgSQL function through a CTE ---
applied_and_cached('m3');
$ks = IdemValkey::keyspace($node);
sql(q{DO $$ DECLARE n int; BEGIN
	WITH d AS (DELETE FROM idempotency_keys WHERE idempotency_key = idem_key('lr', 'm3') RETURNING 1)
	SELECT count(*) INTO n FROM d; END $$});
applied_again('m3', 'DELETE in a CTE in PL/pgSQL', $ks);

# --- TRUNCATE, also through a cascade from tenants ---
applied_and_cached('m4');
$ks = IdemValkey::keyspace($node);
sql('TRUNCATE idempotency_keys');
applied_again('m4', 'TRUNCATE', $ks);

applied_and_cached('m5');
$ks = IdemValkey::keyspace($node);
sql('TRUNCATE tenants CASCADE; INSERT INTO tenants VALUES (1)');
applied_again('m5', 'TRUNCATE tenants CASCADE', $ks);

# --- pg_restore --clean of last night's dump ---
my $dump = $node->basedir . '/night.dump';
$node->command_ok(
	[ 'pg_dump', '-Fc', '-f', $dump, '-d', $node->connstr('postgres') ],
	'pg_dump of the database');
applied_and_cached('m6');
$ks = IdemValkey::keyspace($node);
$node->command_ok(
	[ 'pg_restore', '--clean', '-d', $node->connstr('postgres'), $dump ],
	'pg_restore --clean into the same database');
is(sql(q{SELECT count(*) FROM effects WHERE id = 'm6'}), '0',
	'the restore took the effect of m6 back');
applied_again('m6', 'pg_restore --clean', $ks);
is(sql(q{SELECT count(*) FROM effects WHERE id = 'm6'}), '1', '... and m6 is applied once');

$node->stop;
done_testing();
