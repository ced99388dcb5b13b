# The C client's stream consumer against a real Valkey Cluster (3 masters):
# streams whose names fall on different masters, each read with its own
# consumer group (XGROUP CREATE, XREADGROUP, XAUTOCLAIM, XACK all routed
# by the stream's slot); each entry run once through the runner, a
# repeated id replayed, every entry acknowledged.  Then a master's slot
# moved away under a stream (MOVED followed): the next entries are read
# from its new master.
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

my $bin = IdemValkeyCluster::client_binary('cluster_consumer');

my $vc = IdemValkeyCluster->new(masters => 3, replicas => 0);
my @nodes = $vc->nodes;
my $first = $nodes[0];
my $others = $vc->others;
my $node = $vc->idem_node('consume');
$node->safe_psql('postgres', 'CREATE TABLE effects (scope text, id text)');
my $conninfo = $node->connstr('postgres') . ' connect_timeout=5';

# Stream names until each master holds one.
my (%by_master, @streams);
for (my $i = 0; keys(%by_master) < 3 && $i < 1000; $i++)
{
	my $s = "notices.$i";
	my $m = $vc->master_of_key($s);
	next if $by_master{ $m->port };
	$by_master{ $m->port } = $s;
	push @streams, $s;
}
is(scalar(@streams), 3, 'three streams, one on each master');

# Entries "id m<i> body {...}", 5 a stream, m2 published twice.
sub publish
{
	my ($from, $to) = @_;
	foreach my $s (@streams)
	{
		foreach my $i ($from .. $to)
		{
			$vc->master_of_key($s)->command('XADD', $s, '*', 'id', "m$i", 'body', qq({"n": $i}));
		}
		$vc->master_of_key($s)->command('XADD', $s, '*', 'id', "m$from", 'body', qq({"n": $from}))
		  if $from == 1;
	}
}

# One consumer process over the streams, kept open for two rounds (6
# entries a stream, then 3 more after the slot move); the rounds' lines.
my ($in, $out, $err) = ('', '', '');
my $h = IPC::Run::start([ $bin, $conninfo, '127.0.0.1', $first->port, $others, '6,3', @streams ],
	'<', \$in, '>', \$out, '2>', \$err, IPC::Run::timeout(120));

sub round_of
{
	my ($r) = @_;
	my %got;
	while ($out =~ /^round $r stream (\S+) read=(\d+) acked=(\d+) errors=(\d+)$/mg)
	{
		$got{$1} = { read => $2, acked => $3, errors => $4 };
	}
	return \%got;
}

sub effects
{
	my ($s) = @_;
	return $node->safe_psql('postgres',
		"SELECT count(*) || ' ' || count(DISTINCT id) FROM effects WHERE scope = '$s'");
}

sub pending
{
	my ($s) = @_;
	return $vc->master_of_key($s)->command('XPENDING', $s, 'g')->[0];
}

publish(1, 5);
$h->pump until $out =~ /^next$/m;
my $got = round_of(1);
foreach my $s (@streams)
{
	is($got->{$s}{acked}, 6, "$s: 6 entries (one a repeat) acknowledged");
	is(effects($s), '5 5', "$s: each of its 5 messages applied once");
	is(pending($s), 0, "$s: nothing pending in its group");
}

# The first stream's slot moves to another master under the live consumer:
# its next commands meet MOVED and follow it.
my $s = $streams[0];
my $to = $vc->master_of_key($streams[1]);
$vc->move_slot($vc->slot_of($s), $to);
is($vc->master_of_key($s)->port, $to->port, "${s}'s slot moved to another master");
publish(6, 8);
$in = "go\n";
$h->finish;
diag($err) if $err;
$got = round_of(2);
is($got->{$s}{acked}, 9, "$s: its next 3 entries read from the new master and acknowledged");
is(effects($s), '8 8', "$s: each applied once");
is(pending($s), 0, "$s: nothing pending");

done_testing();
