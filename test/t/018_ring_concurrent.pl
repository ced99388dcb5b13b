# The commit ring under concurrent committers: many backends append to the
# shared ring at once (no lock: they reserve with compare-and-swap and
# publish each record when it is written), with outcomes of many sizes so
# that the ring wraps and pads again and again, and a queue small enough to
# fill.  Every copy that was queued reaches Valkey whole and under its own
# key; every other one is counted as dropped; nothing is garbled, lost or
# copied twice.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use IdemValkey;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $valkey = IdemValkey->new(name => 'valkey')->start;
my $node = IdemValkey::idem_node('concurrent', $valkey,
	'idem.queue_size' => 64, 'max_connections' => 30);
ok(IdemValkey::wait_connected($node, 1), 'worker connects to Valkey');

$node->safe_psql('postgres',
	'CREATE FUNCTION cc_handler(a jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT a $$');
my $clients = 12;
my $per_client = 250;
my $script = $node->basedir . '/cc.sql';
# One key per transaction, one statement each (as the runner sends it);
# outcome sizes from 20 bytes to about 1.5 kB.
PostgreSQL::Test::Utils::append_to_file($script, q{
\set r random(1, 1000000000000)
SELECT idem_apply(1, idem_key('cc', :r::text), idem_fingerprint('{}'), 'cc_handler(jsonb)', jsonb_build_object('n', :r, 'pad', repeat('x', (:r % 1531)::int)), NULL);
});
my ($queued0, $dropped0, $copied0) = split /\|/,
  $node->safe_psql('postgres', 'SELECT queued, dropped, copied FROM idem_stats()');

$node->command_ok(
	[
		'pgbench', '-n', '-c', $clients, '-j', $clients, '-t', $per_client,
		'-f', $script, '-h', $node->host, '-p', $node->port, 'postgres'
	],
	"$clients clients commit $per_client keys each at once");

my $n = $clients * $per_client;
ok( IdemValkey::poll_until(
		30, sub { IdemValkey::stats_col($node, 'queue_depth') == 0 }),
	'the queue drains');
my ($queued, $dropped, $copied, $errors, $rejected) = split /\|/,
  $node->safe_psql('postgres',
	"SELECT queued - $queued0, dropped - $dropped0, copied - $copied0, copy_errors, rejected FROM idem_stats()");
is($queued, $n, "each of the $n copies is counted in queued ($dropped of them dropped: the ring was full)");
is($copied, $queued - $dropped, 'every copy the ring took is copied');
is("$errors|$rejected", '0|0', 'no copy error, nothing rejected');
cmp_ok($copied, '>', $n / 4, "most copies went through ($copied)");

# Every key: absent (its copy dropped) or its own ledger row's outcome, whole.
my $ks = IdemValkey::keyspace($node);
my @rows = map { [ split /\|/, $_, 2 ] } split /\n/, $node->safe_psql('postgres',
	"SELECT encode(idempotency_key, 'hex'), outcome::text FROM idempotency_keys WHERE tenant_id = 1");
is(scalar(@rows), $n, 'one ledger row per commit');
my ($present, @bad) = (0);
for (my $i = 0; $i < @rows; $i += 100)
{
	my $last = $i + 99 < $#rows ? $i + 99 : $#rows;
	my $vals = $valkey->command('MGET', map { "${ks}t:1:$_->[0]" } @rows[ $i .. $last ]);
	for my $j ($i .. $last)
	{
		my $v = $vals->[ $j - $i ];
		next unless defined $v;
		$present++;
		my $p = IdemValkey::parse_value($v);
		push @bad, $rows[$j][0]
		  unless $p && $p->{kind} eq 'c' && $p->{outcome} eq $rows[$j][1]
		  && ($j % 50 || IdemValkey::mac_ok($node, "${ks}t:1:$rows[$j][0]", $v));
	}
}
is($present, $copied, 'as many keys in Valkey as copies made');
is(scalar(@bad), 0, 'each copy is its own key\'s outcome, whole (and, one in 50 checked, authenticated)')
  or diag("bad: @bad[0 .. ($#bad < 9 ? $#bad : 9)]");

IdemValkey::check_counters($node);
$node->stop;
$valkey->stop;
done_testing();
