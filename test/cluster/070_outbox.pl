# The outbox on a Valkey Cluster (issue 40): each message of idem_emit is
# XADDed to the master of its stream name's slot, with its id and body,
# and messages to streams of every master go out from one transaction;
# also when the cluster is the streams' own Valkey (idem.outbox_valkey_nodes)
# beside a single cache Valkey.
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

my $vc = IdemValkeyCluster->new(masters => 3, replicas => 0);

my $node = $vc->idem_node('cluster',
	'idem.valkey_connect_timeout' => 300,
	'idem.valkey_command_timeout' => 2000);
ok(IdemValkey::wait_connected($node, 1), 'the worker connects through a cluster node');

my $n = 30;
my $ids = $node->safe_psql('postgres', qq{
	BEGIN;
	SELECT idem_claim(1, idem_key('oc', 'run'), idem_fingerprint('{}'));
	SELECT string_agg(idem_emit('orders.' || i, jsonb_build_object('i', i)), ' ' ORDER BY i)
	  FROM generate_series(1, $n) i;
	SELECT idem_complete(1, idem_key('oc', 'run'), '{}');
	COMMIT;
});
my @ids = split / /, (split /\n/, $ids)[1];
is(scalar(@ids), $n, "$n messages emitted to $n streams");

# Each stream, read on the master of its slot (no redirect followed).
sub on_master
{
	my ($i, $prefix) = @_;
	my $stream = ($prefix // 'orders.') . $i;
	my $r = eval { $vc->master_of_key($stream)->command('XRANGE', $stream, '-', '+') };
	return ($r && @$r == 1) ? $r->[0][1] : undef;
}

ok(IdemValkey::poll_until(30, sub { !grep { !defined on_master($_) } 1 .. $n }),
	'every message is on the master of its stream\'s slot');
my $bad = grep {
	my $f = on_master($_);
	!($f && $f->[0] eq 'id' && $f->[1] eq $ids[ $_ - 1 ] && $f->[2] eq 'body' && $f->[3] eq qq({"i":$_}))
} 1 .. $n;
is($bad, 0, '... with its id and body');
my %masters;
$masters{ $vc->master_of_key("orders.$_")->port }++ foreach 1 .. $n;
is(scalar(keys %masters), 3, '... spread over the three masters');
ok(IdemValkey::poll_until(10, sub { IdemValkey::stats_col($node, 'outbox_waiting') eq '0' }),
	'the outbox is empty');
is(IdemValkey::stats_col($node, 'publish_errors'), '0', 'no publish errors');
$node->stop;

# --- the cluster as the streams' own Valkey, the cache a single Valkey ---
my $cache = IdemValkey->new(name => 'cache')->start;
my $node2 = IdemValkey::idem_node('single_cache', $cache,
	'idem.outbox_valkey_nodes' => "'" . $vc->seeds . "'",
	'idem.valkey_command_timeout' => 2000);
ok(IdemValkey::wait_connected($node2, 1), 'a node whose cache is a single Valkey');
$node2->safe_psql('postgres', qq{
	BEGIN;
	SELECT idem_claim(1, idem_key('oc', 'run2'), idem_fingerprint('{}'));
	SELECT count(idem_emit('own.' || i, jsonb_build_object('i', i))) FROM generate_series(1, $n) i;
	SELECT idem_complete(1, idem_key('oc', 'run2'), '{}');
	COMMIT;
});
ok(IdemValkey::poll_until(30, sub { !grep { !defined on_master($_, 'own.') } 1 .. $n }),
	'idem.outbox_valkey_nodes alone: every message on the master of its stream\'s slot');
is($cache->command('EXISTS', 'own.1'), 0, '... none in the cache');
is(IdemValkey::stats_col($node2, 'valkey_cluster'), 'f',
	'... and idem_stats() still describes the cache (not a cluster)');
$node2->stop;

done_testing();
