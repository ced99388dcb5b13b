# One Valkey, one prefix, the same tenant and key in two databases of one
# cluster and in a second cluster (issue 12): each effect is applied once in
# each, each replay returns its own outcome, and no value is read for
# another database or cluster.  The worker's values are MACed: a value
# verifies only under its own server's secret and its own key.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use IdemValkey;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $valkey = IdemValkey->new(name => 'valkey')->start;
my $alpha = IdemValkey::idem_node('alpha', $valkey);
my $beta = IdemValkey::idem_node('beta', $valkey);

$alpha->safe_psql('postgres', 'CREATE DATABASE second');
IdemValkey::install($alpha, 'second');
foreach my $target ([ $alpha, 'postgres' ], [ $alpha, 'second' ], [ $beta, 'postgres' ])
{
	$target->[0]->safe_psql($target->[1], q{
		CREATE TABLE effects (scope text, id text);
		-- the runner's handler role is the superuser here
	});
}
ok(IdemValkey::wait_connected($alpha, 1) && IdemValkey::wait_connected($beta, 1),
	'both workers connect to the one Valkey');

my @targets = (
	[ $alpha, 'postgres', 'alpha/postgres' ],
	[ $alpha, 'second', 'alpha/second' ],
	[ $beta, 'postgres', 'beta/postgres' ]);

# The keyspaces differ: by database within a cluster, by system identifier
# across clusters.
my %ks = map { $_->[2] => IdemValkey::keyspace($_->[0], undef, $_->[1]) } @targets;
is(scalar(keys %{ { reverse %ks } }), 3,
	"three keyspaces: $ks{'alpha/postgres'} $ks{'alpha/second'} $ks{'beta/postgres'}");

# --- the same message in each: applied once in each ---
foreach my $t (@targets)
{
	my ($node, $db, $name) = @$t;
	my ($status, $source, $outcome) =
	  IdemValkey::run_message($node, $db, $valkey, 1, 'ns', 'm1', '{"x": 1}');
	is("$status $source", 'applied handler', "$name: the effect is applied ($outcome)");
	# Let the worker copy it before the next target runs.
	ok(defined $valkey->wait_for_key(IdemValkey::tenant_key($node, 1, 'ns', 'm1', undef, $db), 10),
		"$name: the worker copied the result into its own keyspace");
}

# --- each replay returns its own outcome ---
foreach my $t (@targets)
{
	my ($node, $db, $name) = @$t;
	my ($status, $source, $outcome) =
	  IdemValkey::run_message($node, $db, $valkey, 1, 'ns', 'm1', '{"x": 1}');
	my ($want_node) = $name =~ m{^(\w+)/};
	is($status, 'replayed', "$name: the second delivery is a replay ($source)");
	like($outcome, qr/"db": "$db"/, "$name: ... of its own database's outcome");
	like($outcome, qr/"node": "$want_node"/, "$name: ... and its own cluster's");
	is($node->safe_psql($db, q{SELECT count(*) FROM effects WHERE id = 'm1'}), '1',
		"$name: one effect");
}

# --- the values: each in its keyspace, each MACed for its key and server ---
my $ka = IdemValkey::tenant_key($alpha, 1, 'ns', 'm1');
my $kb = IdemValkey::tenant_key($beta, 1, 'ns', 'm1');
my $va = $valkey->command('GET', $ka);
my $vb = $valkey->command('GET', $kb);
like($va, qr/"node": "alpha"/, 'alpha\'s value holds alpha\'s outcome');
like($vb, qr/"node": "beta"/, 'beta\'s value holds beta\'s outcome');
ok(IdemValkey::mac_ok($alpha, $ka, $va) && IdemValkey::mac_ok($beta, $kb, $vb),
	'each value verifies under its own server\'s secret');
ok(!IdemValkey::mac_ok($beta, $kb, $va) && !IdemValkey::mac_ok($alpha, $ka, $vb),
	'... and not under the other server\'s, nor moved to the other key');
ok(!IdemValkey::mac_ok($alpha, IdemValkey::tenant_key($alpha, 1, 'ns', 'm1', undef, 'second'), $va),
	'... nor moved to another database of the same server');

$alpha->stop;
$beta->stop;
done_testing();
