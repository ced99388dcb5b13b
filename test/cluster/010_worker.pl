# The worker against a real Valkey Cluster (3 masters, 3 replicas, loopback):
# mode detected, every committed result on the master of its key's slot,
# idem.valkey_batch_delay kept as on one Valkey (a batch costs the worker one
# wakeup), slots migrated with commits flowing (ASK, then MOVED), a master
# killed and its replica promoted: no copy lost; idem.valkey_db other than 0
# refused.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;
use lib "$FindBin::RealBin/../t";

use IdemValkey;
use IdemValkeyCluster;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time usleep);

my $vc = IdemValkeyCluster->new(masters => 3, replicas => 1);

my $node = $vc->idem_node('cluster',
	'idem.valkey_connect_timeout' => 300,
	'idem.valkey_command_timeout' => 2000);
ok(IdemValkey::wait_connected($node, 1), 'worker connects through a cluster node');
is(IdemValkey::stats_col($node, 'valkey_cluster'), 't', 'idem_stats() says cluster mode');
like(IdemValkey::stats_col($node, 'valkey_nodes'),
	qr/^(?:127\.0\.0\.1:\d+ \w+ errors=\d+(?:, |$)){3,}/,
	'idem_stats() lists the nodes');

sub wait_all
{
	my ($what, @keys) = @_;
	my $n = IdemValkey::poll_until(30, sub { $vc->on_owner(@keys) == @keys ? 1 : 0 });
	is($vc->on_owner(@keys), scalar(@keys), "$what: every result on its slot's master");
}

# --- plain routing: results spread over the three masters ---
IdemValkeyCluster::commit_results($node, 'a', 300);
my @a = IdemValkeyCluster::result_keys($node, 'a', 300);
wait_all('300 commits', @a);
my %per_master;
$per_master{ $vc->master_of_key($_)->port }++ foreach @a;
is(scalar(keys %per_master), 3, 'results landed on all three masters');
is(IdemValkey::stats_col($node, 'copy_errors'), '0', 'no copy errors');

# The queue is empty now: the worker sleeps (no busy loop).
my $ticks = IdemValkey::worker_cpu_ticks($node);
sleep(2);
cmp_ok(IdemValkey::worker_cpu_ticks($node) - $ticks, '<', 20,
	'an idle worker uses no CPU (under 0.2 s in 2 s)');

# --- idem.valkey_batch_delay holds here too: a lone commit goes at once,
# the next within the delay waits for it, and under a stream of commits a
# batch costs the worker one wakeup (it sleeps out the delay, then reads
# every master's replies and sends the next batch) ---
$node->safe_psql('postgres', q{
	ALTER SYSTEM SET idem.valkey_batch_delay = '1s';
	SELECT pg_reload_conf();
});
sleep(2);    # the worker has reloaded, and its last batch is long past
my @p = IdemValkeyCluster::result_keys($node, 'pace', 2);
my $before1 = time();
IdemValkeyCluster::commit_results($node, 'pace', 1);
my $t0 = time();
IdemValkey::poll_until(5, sub { $vc->on_owner($p[0]) });
my $seen1 = time();
cmp_ok($seen1 - $t0, '<', 0.9, 'batch delay 1 s: a lone commit is still copied at once');
# From $before1, not $seen1: see test/t/010_commit_ring.pl (a psql slow to
# return after its commit makes this lenient, never fail).
IdemValkeyCluster::commit_results($node, 'pace', 2, 2);
IdemValkey::poll_until(5, sub { $vc->on_owner($p[1]) });
my $seen2 = time();
ok($seen2 - $before1 > 0.95 && $seen2 - $seen1 < 4,
	sprintf('... the next commit waits for the delay: copied %.3f s after the first was committed',
		$seen2 - $before1));

# The worker's sends are not write system calls: count the masters' reads
# (one per batch and master it has copies for, as the batches are far
# apart; and one per INFO asked here).
sub master_reads
{
	my $reads = 0;
	foreach my $m ($vc->masters)
	{
		$reads += $1 if $m->command('INFO', 'stats') =~ /total_reads_processed:(\d+)/;
	}
	return $reads;
}
$node->safe_psql('postgres', q{
	ALTER SYSTEM SET idem.valkey_batch_delay = '100ms';
	SELECT pg_reload_conf();
});
sleep(1);
my ($sleeps, $reads, $took) =
  IdemValkey::stream_commits($node, 'stream', 150, \&master_reads);
my $periods = $took / 0.1;
ok($reads <= 3 * ($periods + 5) && $sleeps <= 1.4 * $periods + 5,
	sprintf('batch delay 100 ms, 150 commits 10 ms apart in %.2f s (%d periods '
		  . 'of the delay): the masters read %d times (at most once each per '
		  . 'period) and the worker slept %d times (about once per period)',
		$took, $periods, $reads, $sleeps));
wait_all('the streamed commits', IdemValkeyCluster::result_keys($node, 'stream', 150));
$node->safe_psql('postgres', q{
	ALTER SYSTEM RESET idem.valkey_batch_delay;
	SELECT pg_reload_conf();
});

# --- migrating slots with commits flowing: ASK, then MOVED ---
my @b = IdemValkeyCluster::result_keys($node, 'b', 60);
my %slots = map { $vc->slot_of($_) => 1 } @b;
my $target = ($vc->masters)[0];
my $red0 = IdemValkey::stats_col($node, 'valkey_redirects');
my $moves = $vc->begin_migration($target, sort { $a <=> $b } keys %slots);
ok(scalar(@$moves) > 0, scalar(@$moves) . ' slots migrating');
IdemValkeyCluster::commit_results($node, 'b', 30);    # new keys of migrating slots: ASK
ok( IdemValkey::poll_until(30,
		sub { !grep { !defined(eval { $vc->get($_) }) } (@b)[ 0 .. 29 ] }),
	'30 commits to migrating slots: all copied (ASK followed)');
cmp_ok(IdemValkey::stats_col($node, 'valkey_redirects'), '>', $red0,
	'ASK redirects are counted in idem_stats()');
$red0 = IdemValkey::stats_col($node, 'valkey_redirects');
$vc->finish_migration($target, $moves);
IdemValkeyCluster::commit_results($node, 'b', 60, 31);		# the same slots, now moved: MOVED
wait_all('60 commits after the slots moved', @b);
cmp_ok(IdemValkey::stats_col($node, 'valkey_redirects'), '>', $red0,
	'MOVED redirects are counted too');
cmp_ok(IdemValkey::stats_col($node, 'valkey_map_refreshes'), '>=', 2,
	'the slot map was read again after MOVED');
is(IdemValkey::stats_col($node, 'copy_errors'), '0', 'still no copy errors');
wait_all('the first 300, after the migration', @a);

# --- a master killed mid-run: its replica takes over, no copy lost ---
my @c = IdemValkeyCluster::result_keys($node, 'c', 200);
IdemValkeyCluster::commit_results($node, 'c', 100);
wait_all('100 commits before the failover', (@c)[ 0 .. 99 ]);
usleep(300_000);				# let the replicas catch up
my $victim = $vc->master_of_key($c[0]);
my $pid = $victim->{pid};
kill 'KILL', $pid;
waitpid($pid, 0);
delete $victim->{pid};
delete $victim->{sock};
IdemValkeyCluster::commit_results($node, 'c', 200, 101);	# while the cluster fails over
ok($vc->wait_ok(30), 'a replica was promoted');
wait_all('200 commits across the failover', @c);
cmp_ok(IdemValkey::stats_col($node, 'valkey_node_errors'), '>', 0,
	'the dead node is counted');
like(IdemValkey::stats_col($node, 'valkey_nodes'),
	qr/127\.0\.0\.1:${\ $victim->port} other errors=[1-9]/,
	'idem_stats() shows which node failed');
is(IdemValkey::stats_col($node, 'queue_depth'), '0', 'nothing left in the queue');
is(IdemValkey::stats_col($node, 'dropped'), '0', 'nothing dropped');

# --- idem.valkey_db other than 0 on a cluster: a clear error ---
$node->append_conf('postgresql.conf', "idem.valkey_db = 3\n");
$node->reload;
ok( IdemValkey::poll_until(15,
		sub { (IdemValkey::stats_col($node, 'last_error') // '') =~ /valkey_db is 3, but a Valkey Cluster has only database 0/ }),
	'idem.valkey_db = 3 on a cluster is reported as a configuration error');

IdemValkey::check_counters($node);
$node->stop;
done_testing();
