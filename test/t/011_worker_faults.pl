# The worker under faults: Valkey hanging, stopped and restarted; a full
# queue; the worker killed with SIGTERM and SIGKILL; PostgreSQL restarted;
# settings reloaded (another server, a password, a database, a prefix).
# Commits never wait or fail because of any of it.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use IdemValkey;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time);

my $valkey = IdemValkey->new(name => 'valkey')->start;

# A small queue, and long timeouts: the worker must answer SIGTERM at once
# even though Valkey could keep it waiting for 10 s.
my $node = IdemValkey::idem_node(
	'faults', $valkey,
	'idem.queue_size' => 16,
	'restart_after_crash' => 'on',
	'idem.valkey_connect_timeout' => "'10s'",
	'idem.valkey_command_timeout' => "'10s'");
ok(IdemValkey::wait_connected($node, 1), 'worker connects to Valkey');

sub stat_of { IdemValkey::stats_col($node, $_[0]) }
sub key_of { IdemValkey::tenant_key($node, 1, 'f', $_[0], $_[1]) }

# Commit $n transactions, each completing one key "$tag-$i"; returns the
# seconds they took, and dies if any failed.
sub commit_keys
{
	my ($tag, $n) = @_;
	my $sql = join "\n",
	  map { 'BEGIN; ' . IdemValkey::complete_sql('f', "$tag-$_") . ' COMMIT;' }
	  1 .. $n;
	my $t0 = time();
	$node->safe_psql('postgres', $sql);
	return time() - $t0;
}

sub wait_worker_restart
{
	my ($old) = @_;
	return IdemValkey::poll_until(15,
		sub { my $p = IdemValkey::worker_pid($node); $p && $p != $old ? $p : 0 });
}

my $t_up = commit_keys('up', 10);
ok(defined $valkey->wait_for_key(key_of('up-10'), 5), 'baseline: commits are copied');
my $pid = IdemValkey::worker_pid($node);
ok($pid, "the worker runs (pid $pid)");

# --- Valkey hangs: commits are not slowed; SIGTERM still stops the worker ---
$valkey->pause;
my $t_hang = commit_keys('hang', 10);
ok($t_hang < 3 * $t_up + 0.5,
	sprintf('commits keep their latency while Valkey hangs (%.3f s vs %.3f s)',
		$t_hang, $t_up));
ok(stat_of('queue_depth') > 0, 'the worker is waiting on the hung server');
my $t0 = time();
kill 'TERM', $pid;
ok(IdemValkey::poll_until(5, sub { !kill(0, $pid) }),
	sprintf('SIGTERM stops the worker promptly while Valkey hangs (%.2f s)',
		time() - $t0));
my $pid2 = wait_worker_restart($pid);
ok($pid2, 'the postmaster restarts the worker after SIGTERM');
$valkey->resume;
ok(defined $valkey->wait_for_key(key_of('hang-10'), 15),
	'results committed while Valkey hung are copied once it answers');
ok(defined $valkey->command('GET', key_of('hang-1')), '... all of them');
$pid = $pid2;

# --- Valkey stopped: commits unaffected, errors counted, worker alive ---
ok(IdemValkey::poll_until(5, sub { stat_of('queue_depth') eq '0' }),
	'queue drained');
my $errors0 = stat_of('copy_errors');
$valkey->stop;
my $t_stopped = time();
my $t_down = commit_keys('down', 10);
ok($t_down < 3 * $t_up + 0.5,
	sprintf('commits keep their latency while Valkey is down (%.3f s vs %.3f s)',
		$t_down, $t_up));
ok(IdemValkey::poll_until(15, sub { stat_of('copy_errors') > $errors0 }),
	'copy errors are counted');
ok(IdemValkey::wait_connected($node, 0), 'idem_stats() shows the worker disconnected');
like(stat_of('last_error'), qr/connect|send|read|reply/,
	'last_error says what failed');
is(IdemValkey::worker_pid($node), $pid, 'the worker keeps running');

# --- queue overflow: counted drops, no error to anyone ---
my ($queued0, $dropped0) = split /\|/,
  $node->safe_psql('postgres', 'SELECT queued, dropped FROM idem_stats()');
is(stat_of('queue_depth'), '10', 'the 10 results are kept queued');
my $overflow_sql = join ' ',
  map { IdemValkey::complete_sql('f', "over-$_") } 1 .. 30;
my ($rc, $out, $err) =
  $node->psql('postgres', "BEGIN; $overflow_sql COMMIT;", on_error_stop => 1);
is($rc, 0, 'a commit that overflows the queue succeeds');
unlike($err, qr/ERROR|WARNING/, '... without an error or warning');
is( $node->safe_psql('postgres',
		"SELECT queued - $queued0, dropped - $dropped0, queue_depth FROM idem_stats()"),
	'30|24|16',
	'30 copies handed to the queue (16): 6 fit, 24 are dropped and counted');
is( $node->safe_psql('postgres',
		"SELECT status FROM idem_lookup(1, idem_key('f', 'over-30'))"),
	'completed',
	'a dropped copy leaves the committed row alone');

# --- Valkey back: the kept entries, then later commits, are copied ---
# After a long outage the backoff is at its maximum; the worker must still
# find Valkey back within about a second (it retried every 5 s before 0.3,
# so copies stalled up to 5 s).
my $outage_left = 7.5 - (time() - $t_stopped);
sleep($outage_left) if $outage_left > 0;
$valkey->start;
# From when Valkey answers: starting it took over a second on a loaded machine.
my $t_back = time();
ok(IdemValkey::wait_connected($node, 1), 'the worker reconnects after backoff');
my $reconnect_s = time() - $t_back;
ok($reconnect_s < 2,
	sprintf('after a 7.5 s outage the worker reconnects within 2 s (%.2f s)',
		$reconnect_s));
commit_keys('after', 1);
ok(defined $valkey->wait_for_key(key_of('after-1'), 10),
	'later commits are copied');
ok( defined $valkey->command('GET', key_of('down-1'))
	  && defined $valkey->command('GET', key_of('over-6')),
	'entries queued during the outage are copied');
is($valkey->command('GET', key_of('over-7')), undef,
	'dropped entries are not');
is(IdemValkey::worker_pid($node), $pid, 'same worker throughout');

# Large outcomes: the queue holds 16 x 256 bytes plus two records of the
# largest size, so these wrap around it many times.  (If the worker falls
# behind, some are dropped: then they are counted.)
my $big = '{"pad": "' . ('x' x 3000) . '"}';
my $big_sql = join "\n",
  map { 'BEGIN; ' . IdemValkey::complete_sql('f', "big-$_", $big) . ' COMMIT;' }
  1 .. 12;
my $dropped_before = stat_of('dropped');
$node->safe_psql('postgres', $big_sql);
ok(IdemValkey::poll_until(10, sub { stat_of('queue_depth') eq '0' }),
	'large outcomes are drained');
my @big = grep { defined } map { $valkey->command('GET', key_of("big-$_")) } 1 .. 12;
is(scalar(@big) + stat_of('dropped') - $dropped_before, 12,
	'each large outcome is copied or counted as dropped');
is(scalar(grep { /"x{3000}"\}$/ } @big), scalar(@big),
	'... and copied intact across the wrap-around of the queue');
diag(scalar(@big) . ' of 12 large outcomes copied');

# --- SIGKILL: the postmaster resets everything and the worker comes back ---
kill 'KILL', $pid;
$pid2 = wait_worker_restart($pid);
ok($pid2, 'the worker is back after SIGKILL (crash restart)');
ok(IdemValkey::wait_connected($node, 1), '... and connected');
commit_keys('kill', 1);
ok(defined $valkey->wait_for_key(key_of('kill-1'), 10), '... and copying');
$pid = $pid2;

# --- PostgreSQL restart ---
$node->restart;
ok(IdemValkey::wait_connected($node, 1), 'connected after a restart');
commit_keys('restart', 1);
ok(defined $valkey->wait_for_key(key_of('restart-1'), 10),
	'copying after a restart');

# --- SIGHUP: another server, with a password, a database and a prefix ---
$pid = IdemValkey::worker_pid($node);
my $other = IdemValkey->new(name => 'other', password => 'pw-2')->start;
my $port2 = $other->port;
$node->safe_psql('postgres', qq{
	SET log_statement = none;
	ALTER SYSTEM SET idem.valkey_port = $port2;
	ALTER SYSTEM SET idem.valkey_password = 'pw-2';
	ALTER SYSTEM SET idem.valkey_db = 3;
	ALTER SYSTEM SET idem.valkey_prefix = 'other:';
	SELECT pg_reload_conf();
});
commit_keys('hup', 1);
$other->command('SELECT', '3');
ok(defined $other->wait_for_key(key_of('hup-1', 'other:'), 10),
	'after a reload: the new server, password, database and prefix are used');
$other->command('SELECT', '0');
is($valkey->command('GET', key_of('hup-1')), undef, '... and not the old server');
is(IdemValkey::worker_pid($node), $pid, 'the worker reloads without restarting');

IdemValkey::check_counters($node);
$node->stop;
done_testing();
