# The commit ring under stress (src/commit_ring.c, src/commit_copies.c):
#  - idem_stats().dropped counts the copies of committed work only: copies
#    dropped at once inside a subtransaction that rolls back are not
#    counted (any version);
#  - a committer held after counting its record in, before it reserves
#    (as when it is preempted there), while others commit and the worker
#    consumes past the head it read: the worker sleeps instead of spinning,
#    and the held copy is queued once it goes on, not dropped as if the
#    queue were full (the head it read is older than tail); and the worker
#    stays wakeable meanwhile: commits made one at a time behind the held
#    one are copied as fast as with nothing held (a worker that naps marked
#    awake, 1, 2, 4 ... 128 ms, copied them about 60 ms later);
#  - a committer held between reserving and publishing its record over a
#    second is counted in idem_stats().queue_stalls, once.
# The holds use injection points (src/commit_ring.c), so those parts need
# PostgreSQL 17 or later configured with --enable-injection-points and its
# injection_points module: make test's PostgreSQL 18 run.  A stop at an
# exact instruction between two atomic reads cannot be had otherwise
# without a debugger; the ring code under test is the server's own.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use IdemValkey;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use IO::Socket::INET;
use Time::HiRes ();

my $valkey = IdemValkey->new(name => 'valkey')->start;
# A small queue (64 copies), and no batch delay: a worker that does not
# sleep when it has nothing to read spins at full speed.
my $node = IdemValkey::idem_node('stress', $valkey,
	'idem.queue_size' => 64,
	'idem.valkey_batch_delay' => 0);
ok(IdemValkey::wait_connected($node, 1), 'worker connects to Valkey');

sub commit_sql
{
	return "BEGIN; " . IdemValkey::complete_sql('ring', $_[0], qq({"id": "$_[0]"})) . " COMMIT;\n";
}
sub key_of { return IdemValkey::tenant_key($node, 1, 'ring', $_[0]); }
sub dropped { return IdemValkey::stats_col($node, 'dropped'); }

# The median time from just before a commit to its copy's SET in Valkey,
# over 25 commits made one at a time, the worker idle before each: both
# times on this machine's clock, the SET's from Valkey's MONITOR, so that
# neither psql nor polling adds to it.
sub copy_lag
{
	my ($scope) = @_;
	my $session = $node->background_psql('postgres');
	my $mon = IO::Socket::INET->new(
		PeerAddr => '127.0.0.1',
		PeerPort => $valkey->port,
		Proto => 'tcp') or die "connect: $!";
	print $mon "MONITOR\r\n";
	my $okline = <$mon>;
	my @lags;
	foreach my $i (1 .. 25)
	{
		my $id = "$scope$i";
		my $key = key_of($id);
		my $out = $session->query_safe(
			    "BEGIN; DO \$\$ BEGIN "
			  . "PERFORM idem_claim(1, idem_key('ring', '$id'), idem_fingerprint('{}')); "
			  . "PERFORM idem_complete(1, idem_key('ring', '$id'), '{}'::jsonb); END \$\$; "
			  . "SELECT extract(epoch FROM clock_timestamp()); COMMIT;");
		my ($t0) = $out =~ /(\d+\.\d+)/ or die "no time in: $out";
		my $t1;
		eval {
			local $SIG{ALRM} = sub { die "no SET of $key within 10 s\n" };
			alarm(10);
			while (defined(my $line = <$mon>))
			{
				if ($line =~ /^\+(\d+\.\d+) .*"SET" "\Q$key\E"/)
				{
					$t1 = $1;
					last;
				}
			}
			alarm(0);
		};
		die $@ if $@;
		push @lags, $t1 - $t0;
		Time::HiRes::usleep(20_000 + int(rand(20_000)));	# the worker goes idle
	}
	close($mon);
	$session->quit;
	@lags = sort { $::a <=> $::b } @lags;
	diag(sprintf('copy lag (%s): median %.1f ms, max %.1f ms',
			$scope, 1000 * $lags[ int(@lags / 2) ], 1000 * $lags[-1]));
	return $lags[ int(@lags / 2) ];
}

# $n claims and completions of scope $scope, in the current (sub)transaction.
sub complete_many
{
	my ($scope, $n) = @_;
	return "DO \$\$ BEGIN FOR i IN 1..$n LOOP "
	  . "PERFORM idem_claim(1, idem_key('$scope', i::text), idem_fingerprint('{}')); "
	  . "PERFORM idem_complete(1, idem_key('$scope', i::text), '{}'::jsonb); "
	  . "END LOOP; END \$\$;\n";
}

# --- dropped: committed work only ---------------------------------------
$node->safe_psql('postgres', commit_sql('first'));
ok(defined $valkey->wait_for_key(key_of('first'), 10), 'a first copy goes through');

my $d0 = dropped();
$node->safe_psql('postgres',
	"BEGIN;\nSAVEPOINT s;\n" . complete_many('kept', 70) . "RELEASE s;\nCOMMIT;\n");
is(dropped() - $d0, 6,
	'70 copies from one transaction, 64 fit the queue: 6 dropped and counted');

$d0 = dropped();
$node->safe_psql('postgres',
	"BEGIN;\nSAVEPOINT s;\n" . complete_many('undone', 70) . "ROLLBACK TO s;\n"
	  . complete_many('after', 1) . "COMMIT;\n");
is(dropped() - $d0, 0,
	'the copies dropped inside a subtransaction that rolled back are not counted');
ok(defined $valkey->wait_for_key(IdemValkey::tenant_key($node, 1, 'after', '1'), 10),
	'the copy made after the rollback is queued and copied');

$d0 = dropped();
$node->safe_psql('postgres',
	"BEGIN;\nSAVEPOINT a;\nSAVEPOINT b;\n" . complete_many('nested', 70)
	  . "RELEASE b;\nROLLBACK TO a;\nCOMMIT;\n");
is(dropped() - $d0, 0,
	'nor those of a released subtransaction inside one that rolled back');

$d0 = dropped();
$node->safe_psql('postgres',
	"BEGIN;\nSAVEPOINT a;\nSAVEPOINT b;\n" . complete_many('nested2', 70)
	  . "RELEASE b;\nRELEASE a;\nCOMMIT;\n");
is(dropped() - $d0, 6, 'those of released subtransactions are counted');
ok( $node->poll_query_until('postgres', 'SELECT queue_depth = 0 FROM idem_stats()'),
	'the queue empties');

if (!IdemValkey::injection_points($node))
{
	$node->stop;
	$valkey->stop;
	done_testing();
	exit 0;
}
my $free_lag = copy_lag('free');

# --- a committer held after counting its record, before reserving -------
$d0 = dropped();
my ($a, $held) = IdemValkey::held_session($node, 'idem-ring-counted', commit_sql('a'));
ok($held, 'session A committed and is held after counting its copy in, before reserving it');

# Others commit, one at a time; the worker copies each and moves tail past
# the head A read.
my $others = join('', map { commit_sql("o$_") } 1 .. 30);
$node->safe_psql('postgres', $others);
ok(defined $valkey->wait_for_key(key_of("o$_"), 10), "copy o$_ goes through behind held A")
  foreach (1, 30);
ok( $node->poll_query_until('postgres', 'SELECT queue_depth = 1 FROM idem_stats()'),
	'only A is counted in the queue');

# Meanwhile the worker, woken by those commits, has nothing it can read:
# A's copy is counted in, not reserved.
my $ticks = IdemValkey::worker_cpu_ticks($node);
my ($sleeps) = IdemValkey::worker_counts($node);
sleep(2);
my $spent = IdemValkey::worker_cpu_ticks($node) - $ticks;
my ($sleeps2) = IdemValkey::worker_counts($node);
diag("worker: $spent ticks, " . ($sleeps2 - $sleeps) . " sleeps in 2 s");
cmp_ok($ticks, '>=', 0, 'the worker is found');
cmp_ok($spent, '<', 10,
	'the worker sleeps meanwhile (under 0.1 s of CPU in 2 s, with no batch delay; spinning it took 0.46 s on a loaded 2-core machine)');
cmp_ok($sleeps2 - $sleeps, '<', 100, '... waking up fewer than 50 times a second');

# Still held: commits one at a time, as before A was held.  A worker
# napping marked awake copies them when its nap ends (measured: a median of
# 89 ms against 35 ms with nothing held, on a loaded 2-core machine with
# assertions); a wakeable one as fast as with nothing held.
my $held_lag = copy_lag('held');
cmp_ok($held_lag, '<', $free_lag + 0.030,
	'behind a held committer, a commit still wakes the worker: the median copy lag is within 30 ms of that with nothing held');

$node->safe_psql('postgres', "SELECT injection_points_wakeup('idem-ring-counted')");
$a->quit;
my $v = $valkey->wait_for_key(key_of('a'), 10);
my $parsed = IdemValkey::parse_value($v);
ok($parsed && $parsed->{outcome} eq '{"id": "a"}',
	"A goes on: its copy is queued and copied, whole, not dropped as if the queue were full")
  or diag($v // 'absent');
is(dropped() - $d0, 0, 'nothing was dropped');
ok( $node->poll_query_until('postgres', 'SELECT queue_depth = 0 FROM idem_stats()'),
	'the queue empties');

# --- a committer held between reserving and publishing ------------------
is(IdemValkey::stats_col($node, 'queue_stalls'), '0', 'no stall counted so far');
my $c;
($c, $held) = IdemValkey::held_session($node, 'idem-ring-reserved', commit_sql('c'));
ok($held, 'session C committed and is held after reserving its copy');
$node->safe_psql('postgres', commit_sql('d'));
ok($node->poll_query_until('postgres', 'SELECT queue_stalls = 1 FROM idem_stats()'),
	'the stall is counted in idem_stats().queue_stalls once it lasts over a second');
is($valkey->command('GET', key_of('d')), undef, 'the copy behind it waits');
sleep(2);
is(IdemValkey::stats_col($node, 'queue_stalls'), '1', 'once per stalled copy');
$node->safe_psql('postgres', "SELECT injection_points_wakeup('idem-ring-reserved')");
$c->quit;
ok(defined $valkey->wait_for_key(key_of($_), 10), "then $_\'s copy arrives") foreach ('c', 'd');

IdemValkey::check_counters($node);
$node->stop;
$valkey->stop;
done_testing();
