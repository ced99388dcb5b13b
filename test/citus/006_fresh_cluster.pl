# A fresh cluster copies from its first commit: idem_install on the
# coordinator joins every worker node to the cluster keyspace (and renews
# no node's epoch: the ledger and the shell tables Citus makes for it are
# new and empty), so results committed on the workers right after the
# install, before any runner has learnt the keyspace, are copied into
# Valkey, and a runner that connects afterwards replays them from there.
# No worker skips anything.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;
use lib "$FindBin::RealBin/../t";

use IdemCitus;
use IdemValkey;
use PostgreSQL::Test::Utils;
use Test::More;

my $valkey = IdemValkey->new(name => 'valkey')->start;
my $cl = IdemCitus->new(valkey => $valkey);
my $c = $cl->coord;
my ($w1, $w2) = ($cl->w1, $cl->w2);

# Each node's worker has reached Valkey (its epoch taken over), as on a
# cluster whose nodes have been up a moment; nobody has asked the
# coordinator for the keyspace yet.
foreach my $node ($c, $w1, $w2)
{
	ok(IdemValkey::poll_until(20, sub {
		slurp_file($node->logfile) =~ /took history epoch [0-9a-f]+ over in Valkey/ }),
		$node->name . '\'s worker took its epoch over in Valkey');
}

$cl->install_tenants;
my $t1 = $cl->tenant_on($w1);
my $t2 = $cl->tenant_on($w2);
my $request = '{"x": 1}';

# Results committed through the coordinator right after the install: no
# runner, no idem_cache_keyspace() in between.
foreach my $i (1 .. 5)
{
	foreach my $t ($t1, $t2)
	{
		$c->safe_psql('postgres', qq{
			BEGIN;
			SELECT idem_claim($t, idem_key('fresh', 'm$i'), idem_fingerprint('$request'));
			SELECT idem_complete($t, idem_key('fresh', 'm$i'), '{"done": $i}');
			COMMIT;});
	}
}

# Every copy has left the workers' rings (copied or skipped).
foreach my $node ($w1, $w2)
{
	IdemValkey::poll_until(20, sub {
		$node->safe_psql('postgres', 'SELECT queue_depth FROM idem_stats()') eq '0' });
	is($node->safe_psql('postgres', 'SELECT skipped_unjoined FROM idem_stats()'), '0',
		$node->name . ' skipped none of the results committed right after the install');
	is($node->safe_psql('postgres', 'SELECT copied >= 5 FROM idem_stats()'), 't',
		'... it copied them');
}

# A runner connecting now replays every one of them from Valkey.
$c->safe_psql('postgres', 'CREATE TABLE effects (scope text, id text)');
foreach my $t ($t1, $t2)
{
	my $s = IdemValkey::runner_session($c, 'postgres', $valkey, $t, 'fresh', $request);
	my @sources = map { $s->run("m$_") } 1 .. 5;
	is(join(', ', @sources), join(', ', ('replayed valkey') x 5),
		"a runner replays tenant $t\'s first results from Valkey");
	$s->finish;
}
is($c->safe_psql('postgres', 'SELECT count(*) FROM effects'), '0', '... and runs no effect');

# The install renewed no node's epoch: each worker took one over, at its start.
foreach my $node ($c, $w1, $w2)
{
	my @taken = slurp_file($node->logfile) =~ /took history epoch ([0-9a-f]+) over in Valkey/g;
	is(scalar(@taken), 1, $node->name . ' kept the epoch it started with');
}

IdemValkey::check_counters($_) foreach ($c, $w1, $w2);

done_testing();
