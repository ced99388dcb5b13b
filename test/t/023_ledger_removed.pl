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

# --- INSERT ... ON CONFLICT DO UPDATE (an operator resetting a key so
# that its message runs again), also in a CTE; one that only inserts
# keeps the epoch ---
applied_and_cached('m7');
$ks = IdemValkey::keyspace($node);
sql(q{INSERT INTO idempotency_keys (tenant_id, idempotency_key, request_fingerprint, expires_at)
	VALUES (1, idem_key('lr', 'fresh'), idem_fingerprint('{}'), now() + interval '1 hour')
	ON CONFLICT (tenant_id, idempotency_key) DO NOTHING});
is(IdemValkey::keyspace($node), $ks, 'INSERT ... ON CONFLICT DO NOTHING keeps the epoch');
sql(q{INSERT INTO idempotency_keys (tenant_id, idempotency_key, request_fingerprint, expires_at)
	VALUES (1, idem_key('lr', 'm7'), idem_fingerprint('{}'), now() + interval '1 hour')
	ON CONFLICT (tenant_id, idempotency_key) DO UPDATE SET status = 'failed_retryable'});
applied_again('m7', 'INSERT ... ON CONFLICT DO UPDATE', $ks);

applied_and_cached('m8');
$ks = IdemValkey::keyspace($node);
sql(q{WITH u AS (INSERT INTO idempotency_keys (tenant_id, idempotency_key, request_fingerprint, expires_at)
	VALUES (1, idem_key('lr', 'm8'), idem_fingerprint('{}'), now() + interval '1 hour')
	ON CONFLICT (tenant_id, idempotency_key) DO UPDATE SET status = 'failed_retryable' RETURNING 1)
	SELECT count(*) FROM u});
applied_again('m8', 'INSERT ... ON CONFLICT DO UPDATE in a CTE', $ks);

# --- MERGE ---
applied_and_cached('m9');
$ks = IdemValkey::keyspace($node);
sql(q{MERGE INTO idempotency_keys k USING (SELECT idem_key('lr', 'm9') AS key) s
	ON k.tenant_id = 1 AND k.idempotency_key = s.key
	WHEN MATCHED THEN DELETE});
applied_again('m9', 'MERGE', $ks);

# --- DELETE through a table the ledger inherits from ---
applied_and_cached('m11');
$ks = IdemValkey::keyspace($node);
sql(q{CREATE TABLE ledger_parent (LIKE idempotency_keys);
	ALTER TABLE idempotency_keys INHERIT ledger_parent});
sql(q{DELETE FROM ledger_parent WHERE idempotency_key = idem_key('lr', 'm11')});
sql(q{ALTER TABLE idempotency_keys NO INHERIT ledger_parent; DROP TABLE ledger_parent});
applied_again('m11', 'DELETE through an inheritance parent', $ks);

# --- ALTER TABLE ... ALTER COLUMN ... TYPE ... USING: a rewrite that
# changes every row's value ---
applied_and_cached('m12');
$ks = IdemValkey::keyspace($node);
sql(q{ALTER TABLE idempotency_keys ALTER COLUMN status TYPE text
	USING CASE WHEN status = 'completed' THEN 'failed_retryable' ELSE status END});
applied_again('m12', 'ALTER COLUMN TYPE USING', $ks);

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

# --- what nothing reports (pg_surgery's heap_force_kill, a data file put
# back by hand): the operator calls idem_renew_epoch(), which a connected
# runner obeys without waiting to learn the keyspace again ---
{
	local $ENV{IDEM_SECRETS_MAX_AGE_MS} = 3_600_000;
	my $runner = IdemValkey::runner_session($node, 'postgres', $valkey, 1, 'lr', '{"x": 1}');
	applied_and_cached('m10');
	$ks = IdemValkey::keyspace($node);
	is($runner->run('m10'), 'replayed valkey', 'a connected runner replays m10 from Valkey');
	sql(q{BEGIN; SELECT idem_renew_epoch(); ROLLBACK;});
	is(IdemValkey::keyspace($node), $ks, 'idem_renew_epoch() rolled back keeps the epoch');
	sql(q{SELECT idem_renew_epoch()});
	isnt(IdemValkey::keyspace($node), $ks, 'idem_renew_epoch(): a new history epoch');
	is($runner->run('m10'), 'replayed postgres',
		'... the connected runner no longer replays from Valkey: PostgreSQL answers');
	like(slurp_file($node->logfile), qr/idem_renew_epoch\(\) was called/,
		'... and the log says why the epoch changed');
	$runner->finish;

	# A standby refuses it: it copies nothing, and starts an epoch of its
	# own when promoted.
	$node->backup('b1');
	my $standby = PostgreSQL::Test::Cluster->new('standby');
	$standby->init_from_backup($node, 'b1', has_streaming => 1);
	$standby->start;
	my ($ret, $out, $err) = $standby->psql('postgres', 'SELECT idem_renew_epoch()',
		extra_params => [ '-v', 'VERBOSITY=verbose' ]);
	like($err, qr/55000: recovery is in progress/, 'idem_renew_epoch() on a standby: 55000');
	$standby->stop;

	# Without preloading there is no epoch to renew (nothing is copied).
	my $plain = PostgreSQL::Test::Cluster->new('plain');
	$plain->init;
	$plain->start;
	($ret, $out, $err) = $plain->psql('postgres',
		'CREATE EXTENSION idem; SELECT idem_renew_epoch()',
		extra_params => [ '-v', 'VERBOSITY=verbose' ]);
	like($err, qr/55000: idem is not in shared_preload_libraries/,
		'idem_renew_epoch() without preloading: 55000');
	$plain->stop;
}

IdemValkey::check_counters($node);
$node->stop;
done_testing();
