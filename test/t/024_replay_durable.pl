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

sub lsn_num
{
	my ($hi, $lo) = $_[0] =~ m{^([0-9A-F]+)/([0-9A-F]+)$}i or die "not an LSN: $_[0]";
	return hex($hi) * 2**32 + hex($lo);
}
sub lsn_gt { return lsn_num($_[0]) > lsn_num($_[1]); }

sub flush_lsn { $node->safe_psql('postgres', 'SELECT pg_current_wal_flush_lsn()') }

# Wait for the WAL writer to flush, so that what follows has most of a
# 10 s cycle before the next flush.
sub wait_for_wal_writer
{
	my $out = $node->safe_psql('postgres',
		'SET synchronous_commit = off; BEGIN; '
		  . 'SELECT pg_current_wal_insert_lsn(), txid_current(); COMMIT;');
	my ($insert) = split /\|/, $out;
	return IdemValkey::poll_until(30, sub { lsn_gt(flush_lsn(), $insert) });
}

# Complete key $id with synchronous_commit = off; returns the insert LSN
# just before COMMIT: the commit is not flushed while the flush position is
# not past it.
sub commit_async
{
	my ($id) = @_;
	my $out = $node->safe_psql('postgres',
		'SET synchronous_commit = off; BEGIN; '
		  . IdemValkey::complete_sql('r', $id)
		  . ' SELECT pg_current_wal_insert_lsn(); COMMIT;');
	return (split /\n/, $out)[-1];
}

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
