# The slot map: CLUSTER SHARDS where the server has it (Valkey 8), CLUSTER
# SLOTS where it refuses SHARDS (here an ACL denies it; a server before
# Redis 7 does not know it): either way the worker's copies land on their
# masters and the runner replays every key from Valkey.
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

my $bin = IdemValkeyCluster::client_binary('cluster_runner');

my $vc = IdemValkeyCluster->new(masters => 3, replicas => 0);
my @nodes = $vc->nodes;
my $first = $nodes[0];
my $others = $vc->others;

# Calls and refused calls of a CLUSTER subcommand, over every node.
sub map_calls
{
	my ($sub) = @_;
	my ($calls, $rejected) = (0, 0);
	foreach my $n (@nodes)
	{
		my $info = $n->command('INFO', 'commandstats');
		next unless $info =~ /^cmdstat_cluster\|$sub:(\S+)/m;
		my $f = $1;
		$calls += $1 if $f =~ /\bcalls=(\d+)/;
		$rejected += $1 if $f =~ /\brejected_calls=(\d+)/;
	}
	return ($calls, $rejected);
}

my $node = $vc->idem_node('map');
my $conninfo = $node->connstr('postgres') . ' connect_timeout=5';

# Run ids 1..n of scope through the client's runner: (applied, from Valkey).
sub runs
{
	my ($scope, $n) = @_;
	return IdemValkeyCluster::runner_counts($bin, $conninfo, '127.0.0.1', $first->port,
		$others, 0, $scope, $n, 1);
}

# Apply n runs, then replay them until every one comes from Valkey (the
# worker's copies routed by its map, the runner's GETs by its own).
sub round
{
	my ($scope, $n, $what) = @_;
	my ($applied) = runs($scope, $n);
	is($applied, $n, "$what: $n runs applied");
	ok( IdemValkey::poll_until(30, sub { (runs($scope, $n))[1] == $n ? 1 : 0 }),
		"$what: the worker copied them to their masters, the runner replays all from Valkey");
}

ok(IdemValkey::wait_connected($node, 1), 'worker connects');
my ($shards0) = map_calls('shards');
cmp_ok($shards0, '>=', 1, 'the worker read the map with CLUSTER SHARDS');
my ($slots0) = map_calls('slots');
round('s', 60, 'CLUSTER SHARDS');
my ($shards1) = map_calls('shards');
my ($slots1) = map_calls('slots');
cmp_ok($shards1, '>', $shards0, 'the runner read the map with CLUSTER SHARDS too');
is($slots1, $slots0, '... and nobody needed CLUSTER SLOTS');

# An ACL that refuses CLUSTER SHARDS: both fall back to CLUSTER SLOTS.
$_->command('ACL', 'SETUSER', 'default', '-cluster|shards') foreach @nodes;
like(eval { $first->command('CLUSTER', 'SHARDS') } // $@, qr/NOPERM/,
	'CLUSTER SHARDS is refused now');
$node->restart;					# the worker reads the map again
ok(IdemValkey::wait_connected($node, 1), 'worker connects again');
my (undef, $refused) = map_calls('shards');
cmp_ok($refused, '>=', 1, 'the worker asked for CLUSTER SHARDS and was refused');
($slots1) = map_calls('slots');
cmp_ok($slots1, '>', $slots0, '... then read CLUSTER SLOTS');
round('f', 60, 'CLUSTER SLOTS');
my (undef, $refused2) = map_calls('shards');
cmp_ok($refused2, '>', $refused, 'the runners were refused CLUSTER SHARDS too');
my ($slots2) = map_calls('slots');
cmp_ok($slots2, '>', $slots1, '... and read CLUSTER SLOTS');

$node->stop;
$_->stop foreach @nodes;
done_testing();
