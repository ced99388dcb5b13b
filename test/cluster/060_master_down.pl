# A master down with no replica to take its place (3 masters, no replicas,
# cluster-require-full-coverage no, so the other masters keep serving):
# the other masters get the batch's copies once, not again at every retry
# of the copies owed to the dead one; those arrive when it returns, and
# every copy is counted once.
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
use Time::HiRes qw(usleep);

my $vc = IdemValkeyCluster->new(masters => 3, replicas => 0,
	extra => [ '--cluster-require-full-coverage', 'no' ]);

my $node = $vc->idem_node('down',
	'idem.valkey_connect_timeout' => 300,
	'idem.valkey_command_timeout' => 2000);
ok(IdemValkey::wait_connected($node, 1), 'worker connects through a cluster node');

# SET commands a master has executed so far.
sub set_calls
{
	my ($n) = @_;
	my $info = $n->command('INFO', 'commandstats');
	return $info =~ /cmdstat_set:calls=(\d+)/ ? $1 : 0;
}

my @a = IdemValkeyCluster::result_keys($node, 'a', 30);
IdemValkeyCluster::commit_results($node, 'a', 30);
ok(IdemValkey::poll_until(30, sub { $vc->on_owner(@a) == @a }),
	'30 results on their masters before the outage');

# --- one master dies; nothing takes its place ---
# The one that holds the epoch's owner key: runners then trust no value (they
# read that key with every lookup), but the worker still copies to the
# masters that are up, so the cache is warm when it is back.
my @b = IdemValkeyCluster::result_keys($node, 'b', 300);
my $owner_key = $node->safe_psql('postgres',
	'SELECT owner_key FROM idem_cache_secrets() WHERE is_current');
my $victim = $vc->master_of_key($owner_key);
my @healthy = grep { $_ != $victim } $vc->masters;
my @b_healthy = grep { $vc->master_of_key($_) != $victim } @b;
my $b_dead = @b - @b_healthy;
is(scalar(@healthy), 2, 'two masters stay up');
my $pid = delete $victim->{pid};
delete $victim->{sock};
kill 'KILL', $pid;
waitpid($pid, 0);

# one batch; about a third of it is owed to the dead master
IdemValkeyCluster::commit_results($node, 'b', 300);
ok(IdemValkey::poll_until(30, sub { $vc->on_owner(@b_healthy) == @b_healthy }),
	scalar(@b_healthy) . ' results on the masters that are up while one is down');
usleep(500_000);
my @before = map { set_calls($_) } @healthy;
sleep(2);
my @after = map { set_calls($_) } @healthy;
my $resent = 0;
$resent += $after[$_] - $before[$_] foreach 0 .. $#healthy;
is($resent, 0,
	'in 2 s of retries for the dead master, the masters that are up got no SET again (old code: every 100 ms)');
is(IdemValkey::stats_col($node, 'queue_depth'), '300',
	'the batch stays queued while its copies to the dead master are owed')
  or diag('queue_depth ' . IdemValkey::stats_col($node, 'queue_depth'));

# --- it returns with its slots (nodes.conf in its folder) ---
$victim->start;
ok($vc->wait_ok(30), 'the master is back and the cluster is ok');
ok(IdemValkey::poll_until(30, sub { $vc->on_owner(@b) == @b }),
	"all 300 results on their masters, the $b_dead owed to the one that came back included");
ok(IdemValkey::poll_until(10, sub { IdemValkey::stats_col($node, 'queue_depth') eq '0' }),
	'nothing left in the queue');
is(IdemValkey::stats_col($node, 'copied'), 330, 'each of the 330 copies counted once');
is(IdemValkey::stats_col($node, 'dropped'), '0', 'nothing dropped');

IdemValkey::check_counters($node);
$node->stop;
done_testing();
