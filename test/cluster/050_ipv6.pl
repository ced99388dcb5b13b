# Valkey Cluster over IPv6: a cluster on ::1 announces its nodes as ::1;
# the worker (idem.valkey_host = '::1', idem.valkey_nodes = '[::1]:port,...')
# and the runner (host "::1", nodes "[::1]:port,...") route to them, so
# every result is copied to its master and replayed from Valkey.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;
use lib "$FindBin::RealBin/../t";

use IdemValkey;
use IdemValkeyCluster;
use IO::Socket::IP;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $bin = IdemValkeyCluster::client_binary('cluster_runner');
{
	my $probe = IO::Socket::IP->new(LocalHost => '::1', LocalPort => 0,
		Listen => 1);
	plan skip_all => 'no IPv6 loopback (::1) on this machine' unless $probe;
	close $probe;
}

my $vc = IdemValkeyCluster->new(masters => 3, replicas => 0, ipv6 => 1);
my @nodes = $vc->nodes;
my $first = $nodes[0];
my $others = $vc->others('[::1]');
like($first->command('CLUSTER', 'SLOTS')->[0][2][0], qr/^::1$/,
	'the cluster announces its nodes as ::1');

my $node = $vc->idem_node('v6',
	'idem.valkey_host' => "'::1'",
	'idem.valkey_nodes' => "'$others'");
ok(IdemValkey::wait_connected($node, 1), 'the worker connects over IPv6');
like(IdemValkey::stats_col($node, 'valkey_nodes'),
	qr/^(?:\[::1\]:\d+ master errors=\d+(?:, |$)){3}$/,
	'idem_stats() names the three masters [::1]:port');
my $conninfo = $node->connstr('postgres') . ' connect_timeout=5';

sub runs
{
	my ($scope, $n) = @_;
	return IdemValkeyCluster::runner_counts($bin, $conninfo, '::1', $first->port,
		$others, 0, $scope, $n, 1);
}

my ($applied) = runs('v6', 60);
is($applied, 60, '60 runs applied');
ok( IdemValkey::poll_until(30, sub { (runs('v6', 60))[1] == 60 ? 1 : 0 }),
	'the worker copied them to their masters over IPv6; the runner replays all 60 from Valkey');

# Every node's clients came over ::1 (the worker's and the runners').
my $v6 = 0;
foreach my $n (@nodes)
{
	$v6++ if $n->command('CLIENT', 'LIST') =~ /addr=\[?::1\]?:\d+/;
}
is($v6, 3, 'every master has a client connected from ::1');

$node->stop;
$_->stop foreach @nodes;
done_testing();
