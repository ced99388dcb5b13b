# The client's runner given valkey_db other than 0 against a Valkey Cluster
# (which has only database 0): a configuration error the runner reports,
# as the worker does for idem.valkey_db.  Detected (mode auto): the runs go
# to PostgreSQL and the notice hook hears why, once; forced (valkey_cluster
# = 1): an invalid option, every run fails with the message.  The control,
# valkey_db = 0, uses the cache and hears nothing.
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
my $first = ($vc->nodes)[0];
my $node = IdemValkey::idem_node('runnerdb', $first);
ok(IdemValkey::wait_connected($node, 1), 'worker connects');
my $conninfo = $node->connstr('postgres') . ' connect_timeout=5';

# n runs of scope with the given mode and valkey_db: (runs, notices, stderr)
sub runs
{
	my ($scope, $n, $mode, $db, $port, $nodes) = @_;
	my ($out, $err);
	IPC::Run::run([ $bin, $conninfo, '127.0.0.1', $port // $first->port, $nodes // '', $mode,
			$scope, $n, 1, $db ],
		'>', \$out, '2>', \$err);
	my (@runs, @notices);
	foreach (split /\n/, $out)
	{
		push @runs, [ $1, $2, $3 ] if /^run (\S+) (\S+) (\S+) \d/;
		push @notices, $1 if /^notice (.*)/;
	}
	return (\@runs, \@notices, $err // '');
}

my ($runs, $notices, $err) = runs('db0', 5, 0, 0);
is(scalar(grep { $_->[1] eq 'applied' } @$runs), 5, 'valkey_db = 0: five runs applied');
($runs, $notices) = runs('db0', 5, 0, 0);
ok(scalar(grep { $_->[1] eq 'replayed' && $_->[2] eq 'valkey' } @$runs) >= 1,
	'valkey_db = 0: the cluster serves replays');
is(scalar(@$notices), 0, 'valkey_db = 0: no notice');

($runs, $notices) = runs('db1', 5, 0, 1);
is(scalar(grep { $_->[1] eq 'applied' && $_->[2] eq 'handler' } @$runs), 5,
	'valkey_db = 1 on a cluster (detected): the runs still apply, on PostgreSQL');
is(scalar(@$notices), 1, 'valkey_db = 1 on a cluster: the notice hook hears it once');
like($notices->[0] // '',
	qr/valkey_db is 1, but a Valkey Cluster has only database 0: set valkey_db = 0/,
	'... with what to change');
($runs) = runs('db1', 5, 0, 1);
is(scalar(grep { $_->[1] eq 'replayed' && $_->[2] eq 'postgres' } @$runs), 5,
	'valkey_db = 1 on a cluster: replays come from PostgreSQL (the cache stays off)');

# The first node given is down: the runner asks the other nodes, finds
# a cluster there, and says the same.
my $dead = PostgreSQL::Test::Cluster::get_free_port();
($runs, $notices) = runs('db1seed', 3, 0, 1, $dead, $vc->seeds);
is(scalar(grep { $_->[1] eq 'applied' && $_->[2] eq 'handler' } @$runs), 3,
	'valkey_db = 1, first node down, the others a cluster: the runs apply on PostgreSQL');
is(scalar(@$notices), 1, '... and the notice hook hears it once');
like($notices->[0] // '', qr/valkey_db is 1, but a Valkey Cluster has only database 0/,
	'... with what to change');

($runs, $notices, $err) = runs('db1forced', 2, 1, 1);
is(scalar(grep { $_->[1] eq 'error' } @$runs), 2,
	'valkey_db = 1 with valkey_cluster = 1: an invalid option, every run fails');
like($err, qr/valkey_db is 1 with valkey_cluster = 1, but a Valkey Cluster has only database 0/,
	'... with the reason');

done_testing();
