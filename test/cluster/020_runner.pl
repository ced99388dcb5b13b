# The client's runner against a real Valkey Cluster (3 masters, 3 replicas):
# mode detected; the gate (SET NX PX GET) and GET go to each key's master,
# so replays come from every node; ASK during a slot migration is followed;
# a master
# that hangs costs only its own keys the cache (PostgreSQL answers them).
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

# No automatic failover while a master hangs for a moment.
my $vc = IdemValkeyCluster->new(masters => 3, replicas => 1, node_timeout => 15000);
my @nodes = $vc->nodes;
my $first = $nodes[0];
my $others = $vc->others;
my $node = $vc->idem_node('runner');
ok(IdemValkey::wait_connected($node, 1), 'worker connects');
my $conninfo = $node->connstr('postgres') . ' connect_timeout=5';

# Run ids first..first+n-1 of scope; returns ({id => [status, source]}, {stats}).
# With $warm (a sub), the runs are made once first, every master connected,
# then $warm is called before the runs that count.
sub runs
{
	my ($scope, $n, $first_id, $port, $nodes, $warm) = @_;
	my ($in, $out, $err) = ('', '', '');
	my @cmd = ($bin, $conninfo, '127.0.0.1', $port // $first->port,
		$nodes // $others, 0, $scope, $n, $first_id // 1);
	if ($warm)
	{
		local $ENV{IDEM_TEST_WARM} = 1;
		my $h = IPC::Run::start(\@cmd, '<', \$in, '>', \$out, '2>', \$err,
			IPC::Run::timeout(120));
		$h->pump until $out =~ /^warm\n/m;
		$out = '';
		$warm->();
		$in = "go\n";
		$h->finish;
	}
	else
	{
		IPC::Run::run(\@cmd, '>', \$out, '2>', \$err);
	}
	diag($err) if $err;
	my (%runs, %stats);
	foreach (split /\n/, $out)
	{
		$runs{$1} = [ $2, $3 ] if /^run (\S+) (\S+) (\S+) \d/;
		%stats = /(\w+)=(\d+)/g if /^stats /;
	}
	return (\%runs, \%stats);
}

# The keys of ids 1..n of a scope (one query).  key_of: the worker's; the
# runner's (rkey) are the same, or, with a client that still writes its
# own legacy-format copies, "idem:t:1:<hex>".
my %hex;
sub hexes
{
	my ($scope, $n) = @_;
	$hex{$scope}{$n} //= [ split / /, $node->safe_psql('postgres',
		"SELECT string_agg(encode(idem_key('$scope', g::text), 'hex'), ' ' ORDER BY g) FROM generate_series(1, $n) g") ];
	return @{ $hex{$scope}{$n} };
}
my $keyspace = IdemValkey::tenant_key($node, 1, 'x', 'x');
$keyspace =~ s/t:1:[0-9a-f]{64}$//;
my $legacy;
sub key_of { my ($scope, $id) = @_; return $keyspace . "t:1:" . (hexes($scope, 60))[ $id - 1 ]; }
sub rkey
{
	my ($scope, $id) = @_;
	return key_of($scope, $id) unless $legacy;
	return "idem:t:1:" . (hexes($scope, 60))[ $id - 1 ];
}

# A value that is a result, not a run's marker (a run that commits leaves
# its marker for the worker's copy to overwrite).
sub is_result { my ($v) = @_; return defined($v) && $v !~ /^idem2 \S+ \d+ p /; }

sub count_where
{
	my ($runs, $status, $source) = @_;
	return scalar grep { $_->[0] eq $status && (!$source || $_->[1] eq $source) } values %$runs;
}

# --- apply, wait for the worker's copies, replay from Valkey ---
my ($runs) = runs('r', 60);
is(count_where($runs, 'applied'), 60, '60 runs applied');
ok( IdemValkey::poll_until(30,
		sub { !grep { !is_result(eval { $vc->master_of_key(key_of('r', $_))->command('GET', key_of('r', $_)) }) } 1 .. 60 }),
	'their results are on their masters');
$legacy = defined(eval { $vc->get('idem:t:1:' . (hexes('r', 60))[0]) });
my $stats;
($runs, $stats) = runs('r', 60);
is(count_where($runs, 'replayed', 'valkey'), 60, 'all 60 replayed from Valkey');
my %masters = map { $vc->master_of_key(rkey('r', $_))->port => 1 } 1 .. 60;
is(scalar(keys %masters), 3, 'the replays came from all three masters');
cmp_ok($stats->{refreshes}, '>=', 1, 'the runner read the slot map');

# Seeds: the first node down, the runner opens through another one.
($runs, $stats) = runs('r', 60, 1, 1, $others);
is(count_where($runs, 'replayed', 'valkey'), 60,
	'a seed that is down: the next one gives the map');

# --- ASK: slots migrating, new keys go to the importing node ---
my %slots = map { $vc->slot_of(rkey('m', $_)) => 1 } 1 .. 20;
my $target = ($vc->masters)[0];
my $moves = $vc->begin_migration($target, keys %slots);
($runs, $stats) = runs('m', 20);
is(count_where($runs, 'applied'), 20, 'runs on migrating slots applied');
cmp_ok($stats->{redirects}, '>', 0, "ASK followed ($stats->{redirects} redirects)");
$vc->finish_migration($target, $moves);
ok( IdemValkey::poll_until(30,
		sub { !grep { !is_result(eval { $target->command('GET', rkey('m', $_)) }) } 1 .. 20 }),
	'their results are on the new owner');
($runs, $stats) = runs('m', 20);
is(count_where($runs, 'replayed', 'valkey'), 20, 'and replay from it');

# --- a master hangs: only its keys go to PostgreSQL ---
# Twice: a master that is not the runner's first seed, then the first seed
# itself (the runner must open through the next seed within its own budget,
# and needs no command on the hung node to start).  Every lookup also reads
# the epoch owner key: if the hung master holds it, no value can be
# trusted and every key goes to PostgreSQL (the cost of one owner key).
(my $owner_key = $keyspace) =~ s/\.[0-9]+:\z/:owner/;
sub hang_master
{
	my ($hung, $what, $port, $seeds, $warm) = @_;
	my @on_hung = grep { $vc->master_of_key(rkey('r', $_))->port == $hung->port } 1 .. 60;
	@on_hung = (1 .. 60)
	  if !$legacy && $vc->master_of_key($owner_key)->port == $hung->port;
	my ($runs, $stats);
	if ($warm)
	{
		($runs, $stats) = runs('r', 60, undef, $port, $seeds, sub { $hung->pause });
	}
	else
	{
		$hung->pause;
		($runs, $stats) = runs('r', 60, undef, $port, $seeds);
	}
	$hung->resume;
	is(count_where($runs, 'replayed'), 60, "$what hangs: every run still replays");
	is(scalar(grep { $runs->{$_}[1] eq 'postgres' } @on_hung), scalar(@on_hung),
		"$what hangs: keys of the hung master (every key, if it holds the epoch owner key) come from PostgreSQL");
	is(count_where($runs, 'replayed', 'valkey'), 60 - @on_hung,
		"$what hangs: all other keys still come from Valkey");
	cmp_ok($stats->{node_errors} // 0, '>', 0, "$what hangs: the hung node is counted");
}
my ($other_master) = grep { $_->port != $first->port } $vc->masters;
hang_master($other_master, 'a master');
die "the first node is not a master" unless grep { $_->port == $first->port } $vc->masters;
hang_master($first, 'the first seed (a master)');

# The router reads a round's replies node by node, in its node table's
# order (the seeds' order, then the map's).  With the hung master before
# the owner key's master, a round that sent to both gives up the hung one
# at the deadline, then reads the owner key's reply, which came in long
# before: that node must not be failed for the deadline the other spent
# (it was, and every later lookup went to PostgreSQL while it rested).
# Every master is connected before the hang: a connect to a hung node
# fails in its setup round trip, before anything is sent to the others.
if (!$legacy)
{
	my $owner_master = $vc->master_of_key($owner_key);
	my ($hung, $third) = grep { $_->port != $owner_master->port } $vc->masters;
	hang_master($hung, 'a master read before the owner key\'s master', $third->port,
		join(',', map { '127.0.0.1:' . $_->port } $hung, $owner_master), 1);
}

$node->stop;
done_testing();
