# A replay is as durable as the asking session wants (issue 25): a session
# with synchronous_commit = off completes a key and its commit stays in WAL
# buffers (a 10 s WAL-writer cycle); a session with synchronous_commit = on
# that is answered "completed" from that row (idem_claim, idem_claim_many,
# idem_apply, idem_lookup) acknowledges the message, so the row must then
# survive an immediate stop.  A session with synchronous_commit = off is
# answered without a flush, and a replay flushes only as far as the row's
# own commit needs (none for a synchronous one).  No Valkey: nothing here is about the cache.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use IdemValkey;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

# A long WAL-writer cycle, and nothing else that writes or flushes WAL on
# its own (as in 012_durable_copy.pl); the worker finds no Valkey.
my $node = PostgreSQL::Test::Cluster->new('replay');
$node->init;
$node->append_conf('postgresql.conf', q{
shared_preload_libraries = 'idem'
idem.valkey_port = 1
wal_writer_delay = '10s'
autovacuum = off
checkpoint_timeout = '1h'
});
$node->start;
IdemValkey::install($node);
$node->safe_psql('postgres',
	'CREATE FUNCTION echo(jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT $1 $$');

# WAL positions, and an asynchronous commit (synchronous_commit = off) of
# tenant 1's key ('r', $id) that returns the insert LSN before its COMMIT.
sub lsn_gt { IdemValkey::lsn_gt(@_) }
sub flush_lsn { IdemValkey::flush_lsn($node) }
sub wait_for_wal_writer { IdemValkey::wait_for_wal_writer($node) }
sub commit_async { IdemValkey::commit_async($node, 'r', $_[0]) }

# In a new session with synchronous_commit = $sc: $sql's answer, and the
# flush position right after it.
sub replay
{
	my ($sc, $sql) = @_;
	my $out = $node->safe_psql('postgres',
		"SET synchronous_commit = $sc; $sql; SELECT pg_current_wal_flush_lsn();");
	my @lines = split /\n/, $out;
	return ($lines[0], $lines[-1]);
}

my $fp = q{idem_fingerprint('{}')};

# A result committed synchronously, then more than a clog LSN group (32
# transactions) of others, so that no asynchronous commit below shares
# its group.
$node->safe_psql('postgres', 'BEGIN; ' . IdemValkey::complete_sql('r', 'durable') . ' COMMIT;');
$node->safe_psql('postgres', 'CREATE TABLE noise (n int)');
$node->safe_psql('postgres',
	'DO $$ BEGIN FOR i IN 1..40 LOOP PERFORM txid_current(); COMMIT; END LOOP; END $$');

ok(wait_for_wal_writer(), 'the WAL writer has just flushed');

# The wait is for the row's own commit: WAL of others is not flushed.
my $out = $node->safe_psql('postgres',
	'SET synchronous_commit = off; BEGIN; INSERT INTO noise VALUES (1); '
	  . 'SELECT pg_current_wal_insert_lsn(); COMMIT;');
my $noise = (split /\n/, $out)[-1];
my ($answer, $flushed) = replay('on',
	"SELECT decision FROM idem_claim(1, idem_key('r', 'durable'), $fp)");
is($answer, 'completed', 'a row committed synchronously is replayed');
ok(!lsn_gt($flushed, $noise),
	'... without flushing an asynchronous commit of another table made after it');

# synchronous_commit = off asks for no flush: none is made.
my $lsn = commit_async('off');
($answer, $flushed) = replay('off',
	"SELECT decision FROM idem_claim(1, idem_key('r', 'off'), $fp)");
is($answer, 'completed', 'a session with synchronous_commit = off is answered completed');
ok(!lsn_gt($flushed, $lsn), '... without a flush of the row\'s commit');

my @paths = (
	[ 'claim', "SELECT decision FROM idem_claim(1, idem_key('r', 'claim'), $fp)",
		'completed' ],
	[ 'claim_many',
		"SELECT decision FROM idem_claim_many(ARRAY[1], ARRAY[idem_key('r', 'claim_many')], ARRAY[$fp])",
		'completed' ],
	[ 'apply',
		"SELECT decision FROM idem_apply(1, idem_key('r', 'apply'), $fp, 'echo(jsonb)', '{}')",
		'completed' ],
	[ 'lookup', "SELECT status FROM idem_lookup(1, idem_key('r', 'lookup'))",
		'completed' ]);
foreach my $p (@paths)
{
	my ($id, $sql, $expected) = @$p;
	$lsn = commit_async($id);
	($answer, $flushed) = replay('on', $sql);
	is($answer, $expected,
		"$id: a session with synchronous_commit = on is answered $expected from an asynchronous commit");
	ok(lsn_gt($flushed, $lsn), "$id: ... only once that commit is flushed");
}

$node->stop('immediate');
$node->start;
foreach my $p (@paths)
{
	my $id = $p->[0];
	is($node->safe_psql('postgres', "SELECT status FROM idem_lookup(1, idem_key('r', '$id'))"),
		'completed', "$id: the row answered survives an immediate stop");
}
IdemValkey::check_counters($node);
$node->stop;

done_testing();
