# Valkey never knows more than PostgreSQL durably knows (issue 12): with
# synchronous_commit = off the worker holds a copy until the WAL writer has
# flushed its commit record; an immediate stop before that flush leaves
# neither the ledger row nor the Valkey value.  The copy that does reach
# Valkey is an idem2 value in the database's keyspace, MACed with the
# server's secret.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use IdemValkey;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time usleep);

my $valkey = IdemValkey->new(name => 'valkey')->start;

# A long WAL-writer cycle, and nothing else that writes or flushes WAL on
# its own.  The WAL writer flushes an asynchronous commit within one to
# three cycles (two when the commit's WAL fills a page first).
my $node = IdemValkey::idem_node(
	'durable', $valkey,
	wal_writer_delay => "'10s'",
	autovacuum => 'off',
	checkpoint_timeout => "'1h'");
ok(IdemValkey::wait_connected($node, 1), 'worker connects to Valkey');

# WAL positions, and an asynchronous commit (synchronous_commit = off) of
# tenant 1's key ('d', $id) that returns the insert LSN before its COMMIT.
sub lsn_gt { IdemValkey::lsn_gt(@_) }
sub flush_lsn { IdemValkey::flush_lsn($node) }
sub wait_for_wal_writer { IdemValkey::wait_for_wal_writer($node) }
sub commit_async { IdemValkey::commit_async($node, 'd', $_[0], $_[1], '1 hour') }

# --- a copy appears only once its commit is flushed ---
ok(wait_for_wal_writer(), 'the WAL writer has just flushed');
my $key = IdemValkey::tenant_key($node, 1, 'd', 'async');
my $lsn = commit_async('async', '{"n": 1}');
my $t_commit = time();
# While it waits, the worker looks at the flush position after a quarter
# of the time waited (1 to 20 ms): some tens of wakeups a second, not the
# thousand of a 1 ms poll.
usleep(100_000);
my ($wakeups0) = IdemValkey::worker_counts($node);
usleep(1_400_000);
my $wakeups = (IdemValkey::worker_counts($node))[0] - $wakeups0;
my $before = $valkey->command('GET', $key);
my $flushed = lsn_gt(flush_lsn(), $lsn);
ok(!$flushed, 'the commit record is not flushed 1.5 s after an asynchronous commit');
is($before, undef, '... and its result is not in Valkey');
cmp_ok($wakeups, '<', 300,
	"... and the worker waiting for the flush woke $wakeups times in 1.4 s");
my $value = $valkey->wait_for_key($key, 45);
ok(defined $value, sprintf('the result reaches Valkey after the flush (%.1f s after commit)',
	time() - $t_commit));
ok(lsn_gt(flush_lsn(), $lsn), '... and by then the WAL is flushed past its start');
my $v = IdemValkey::parse_value($value);
ok($v && $v->{kind} eq 'c' && $v->{attempt} == 1 && $v->{outcome} eq '{"n": 1}',
	'the value is an idem2 completed result');
ok(IdemValkey::mac_ok($node, $key, $value), '... with a valid MAC under the current secret');
my $expires_ms = $node->safe_psql('postgres',
	"SELECT floor(extract(epoch FROM expires_at) * 1000)::bigint FROM idem_lookup(1, idem_key('d', 'async'))");
is($v->{expires_ms}, $expires_ms, '... and the row\'s expires_at in epoch milliseconds');
ok(!IdemValkey::mac_ok($node, IdemValkey::tenant_key($node, 2, 'd', 'async'), $value),
	'... which does not verify under another key');

# With synchronous_commit = on the flush happens before the commit returns:
# the copy is not held back.
my $t0 = time();
$node->safe_psql('postgres',
	'BEGIN; ' . IdemValkey::complete_sql('d', 'sync') . ' COMMIT;');
ok(defined $valkey->wait_for_key(IdemValkey::tenant_key($node, 1, 'd', 'sync'), 5),
	sprintf('a synchronous commit is copied at once (%.3f s)', time() - $t0));

# --- an immediate stop before the flush loses the row and the value ---
ok(wait_for_wal_writer(), 'the WAL writer has just flushed again');
my $lost_key = IdemValkey::tenant_key($node, 1, 'd', 'lost');
$lsn = commit_async('lost', '{"n": 2}');
usleep(1_000_000);
ok(!lsn_gt(flush_lsn(), $lsn), 'the second asynchronous commit is not flushed yet');
ok(!lsn_gt($node->safe_psql('postgres', 'SELECT pg_current_wal_lsn()'), $lsn),
	'... not even written to the operating system');
is($valkey->command('GET', $lost_key), undef, '... nor copied');
$node->stop('immediate');
$node->start;
is($node->safe_psql('postgres',
		"SELECT count(*) FROM idem_lookup(1, idem_key('d', 'lost'))"),
	'0', 'after an immediate stop the unflushed commit is gone from PostgreSQL');
ok(IdemValkey::wait_connected($node, 1), 'the worker is back');
$node->safe_psql('postgres',
	'BEGIN; ' . IdemValkey::complete_sql('d', 'after') . ' COMMIT;');
ok(defined $valkey->wait_for_key(IdemValkey::tenant_key($node, 1, 'd', 'after'), 5),
	'a later commit is copied');
is($valkey->command('GET', $lost_key), undef,
	'and Valkey never held the lost result');

# --- repopulation: a read of a committed terminal row copies it again ---
# The copy is marked with the end of the WAL inserted at the read.  WAL of
# no commit written before the read (here a non-transactional logical
# message; for real, the full-page images that hint bits write under data
# checksums, initdb's default from 18, or on-access pruning) is flushed by
# nothing but the WAL writer, one to three cycles later.  The worker
# flushes it itself: right after a WAL-writer cycle, the copy must be back
# well before the next one (10 s).
my $after_key = IdemValkey::tenant_key($node, 1, 'd', 'after');
# The WAL writer has just flushed and no copy is queued any more: a late
# copy from the step before cannot stand in for the next one.
sub settled
{
	return wait_for_wal_writer()
	  && IdemValkey::poll_until(15,
		sub { IdemValkey::stats_col($node, 'queue_depth') eq '0' });
}
sub repopulated_at_once
{
	my ($what, $sql, $answer) = @_;
	ok(settled(), "$what: the WAL writer has just flushed, nothing is queued");
	$valkey->command('DEL', $after_key);
	my $pending = $node->safe_psql('postgres',
		"SELECT pg_logical_emit_message(false, 'idem test', 'no commit')");
	ok(lsn_gt($pending, flush_lsn()), "$what: WAL of no commit waits for the WAL writer");
	my $t0 = time();
	is($node->safe_psql('postgres', $sql), $answer,
		"$what: after a cache miss the row is read from PostgreSQL");
	my $again = $valkey->wait_for_key($after_key, 5);
	ok(defined $again && IdemValkey::mac_ok($node, $after_key, $again),
		sprintf('%s: ... and the worker copies it into Valkey again, MACed (%.1f s)',
			$what, time() - $t0));
	ok(!lsn_gt($pending, flush_lsn()), "$what: ... once the WAL before the read is flushed");
}
repopulated_at_once('lookup', "SELECT status FROM idem_lookup(1, idem_key('d', 'after'))",
	'completed');
repopulated_at_once('claim',
	"SELECT decision FROM idem_claim(1, idem_key('d', 'after'), idem_fingerprint('{}'))",
	'completed');
# Right after pg_switch_wal() the next record would start past the next
# segment's header, where no flush reaches until more WAL is written: the
# copy's mark is where the flush does reach.
ok(settled(), 'nothing is queued');
$valkey->command('DEL', $after_key);
my ($switched, $status, $read_at) = split /\n/, $node->safe_psql('postgres',
	"SELECT pg_switch_wal(); SELECT status FROM idem_lookup(1, idem_key('d', 'after'));"
	  . ' SELECT pg_current_wal_insert_lsn()');
is($status, 'completed', 'a read right after a WAL segment switch ...');
note("switched at $switched, the read at $read_at");
ok(defined $valkey->wait_for_key($after_key, 5), '... is copied into Valkey again at once');
# A row this transaction wrote is left to the commit hook: nothing is copied
# when the transaction rolls back.
my $own_key = IdemValkey::tenant_key($node, 1, 'd', 'own');
$node->safe_psql('postgres', 'BEGIN; ' . IdemValkey::complete_sql('d', 'own')
	  . " SELECT * FROM idem_lookup(1, idem_key('d', 'own'));"
	  . " SELECT idem_claim(1, idem_key('d', 'own'), idem_fingerprint('{}')); ROLLBACK;");
$node->safe_psql('postgres', 'BEGIN; ' . IdemValkey::complete_sql('d', 'sentinel') . ' COMMIT;');
ok(defined $valkey->wait_for_key(IdemValkey::tenant_key($node, 1, 'd', 'sentinel'), 5),
	'a later commit is copied');
is($valkey->command('GET', $own_key), undef,
	'reads of a row of a rolled-back transaction copied nothing');

IdemValkey::check_counters($node);
$node->stop;
done_testing();
