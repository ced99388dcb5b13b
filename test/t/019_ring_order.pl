# The commit ring's reader and a writer held between reserving its record
# and publishing it (as when that committer is preempted there): a record
# published behind it is not copied before it, nothing is read from the
# unwritten record, the worker waits without spinning, and both are
# copied, whole, once it is published.  The
# writer is held by an injection point (src/commit_ring.c), so this needs
# PostgreSQL 17 or later configured with --enable-injection-points and its
# injection_points module: make test's PostgreSQL 18 run.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use IdemValkey;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $valkey = IdemValkey->new(name => 'valkey')->start;
my $node = IdemValkey::idem_node('ring', $valkey);
if (!IdemValkey::injection_points($node))
{
	$node->stop;
	plan skip_all => 'no injection points (PostgreSQL 17 or later, --enable-injection-points)';
}
ok(IdemValkey::wait_connected($node, 1), 'worker connects to Valkey');

sub commit_sql
{
	my ($id) = @_;
	return "BEGIN;\n"
	  . "SELECT idem_claim(1, idem_key('ring', '$id'), idem_fingerprint('{}'));\n"
	  . "SELECT idem_complete(1, idem_key('ring', '$id'), jsonb_build_object('id', '$id'));\n"
	  . "COMMIT;\n";
}
sub key_of { return IdemValkey::tenant_key($node, 1, 'ring', $_[0]); }

# A copy first, so the worker has read the queue before.
$node->safe_psql('postgres', commit_sql('first'));
ok(defined $valkey->wait_for_key(key_of('first'), 10), 'a first copy goes through');

# Session A commits and stops after reserving its record.
my ($a, $held) = IdemValkey::held_session($node, 'idem-ring-reserved', commit_sql('a'));
ok($held, 'session A committed and is held after reserving its record');
is($node->safe_psql('postgres',
		"SELECT status FROM idem_lookup(1, idem_key('ring', 'a'))"),
	'completed', "A's commit is visible");

# Session B commits behind it; its record is published.
$node->safe_psql('postgres', commit_sql('b'));
my $ticks = IdemValkey::worker_cpu_ticks($node);
sleep(2);
cmp_ok(IdemValkey::worker_cpu_ticks($node) - $ticks, '<', 40,
	'the worker waits for it without spinning (under 0.4 s of CPU in 2 s)');
is($valkey->command('GET', key_of('b')), undef,
	"B's copy, published behind A's unpublished record, waits for it");
is($valkey->command('GET', key_of('a')), undef, "A's record is not read before it is published");
is(IdemValkey::stats_col($node, 'copy_errors') . ' ' . IdemValkey::stats_col($node, 'rejected'),
	'0 0', 'nothing was read from the unwritten record (no error, nothing rejected)');

# A goes on: it writes and publishes its record.
$node->safe_psql('postgres', "SELECT injection_points_wakeup('idem-ring-reserved')");
$a->quit;
foreach my $id ('a', 'b')
{
	my $v = $valkey->wait_for_key(key_of($id), 10);
	my $parsed = IdemValkey::parse_value($v);
	ok($parsed && $parsed->{outcome} eq qq({"id": "$id"}), "then ${id}'s copy arrives, whole")
	  or diag($v // 'absent');
	ok(IdemValkey::mac_ok($node, key_of($id), $v), '... and authenticated');
}
is(IdemValkey::stats_col($node, 'queue_depth'), '0', 'the queue is empty');

IdemValkey::check_counters($node);
$node->stop;
done_testing();
