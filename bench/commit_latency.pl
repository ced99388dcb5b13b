#!/usr/bin/perl
# The measuring half of bench/commit_latency.sh (which sets up the servers).
#
# Latency: pgbench offers each of --rate (a list) transactions/s for
# --seconds, each transaction one call of
# idem_bench_one(:client_id), which claims a fresh key and completes it with
# the outcome {"c": <client>, "n": <sequence>, "t": <clock_timestamp() in
# microseconds>}, and commits.  A subscriber to Valkey's keyspace events
# (__keyevent@0__:set) timestamps each SET as it arrives (it blocks in
# select(), it does not poll); afterwards each value is read back.  Two
# latencies, both on this machine's clock (gettimeofday on both sides):
#   - from idem_complete(): arrival - t.  It includes the COMMIT itself
#     (the WAL flush), so it is an upper bound on commit-to-visible;
#   - from the commit's acknowledgement: arrival - the time pgbench logged
#     the transaction as done (its per-transaction log; a client's n-th
#     transaction is its n-th smallest "n").  pgbench takes the reply after
#     the server sent it, so this is a lower bound, and it is negative when
#     the copy was visible before the client saw its commit.
# Both include the subscriber's own wakeup, on the same cores.
# The worker copies a result only once its commit record is flushed (and
# with synchronous_commit=off that waits for the WAL writer), so the default
# is synchronous_commit=on.  The CPU time and context switches of the worker
# and of the Valkey server during that run, per copied result, come from
# /proc.
#
# Commit latency, side by side: the same pgbench run (rate, clients,
# duration) once with the worker copying into Valkey and once right after
# with the worker pointed at a closed port (it copies nothing; the copies
# wait in the queue, and are copied before the next rate): pgbench's
# average latency and the p99 of its per-transaction log.
# The worker's wait for durability is its own, never the backend's.
#
# Drain: the worker is pointed at a closed port (reload), --drain results
# are committed and stay queued, the worker is pointed back (reload), and a
# loop inside the server times copied results from the first to the last.
# Next to it, the same server's raw SET rate from valkey-benchmark
# with 16 commands per pipeline, values of the same size.
use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin", "$FindBin::Bin/../test/t";
use IdemResp;
use Getopt::Long;
use IO::Select;
use IO::Socket::INET;
use POSIX ();
use Time::HiRes qw(time usleep);

my %o = (rate => '5000', seconds => 10, clients => 8, drain => 50000, sync => 'on');
GetOptions(\%o, 'dir=s', 'pgport=i', 'vkport=i', 'benchmark=s', 'server=s', 'rate=s',
	'seconds=i', 'clients=i', 'drain=i', 'sync=s')
  or die "usage: see bench/commit_latency.sh\n";
my @rates = grep { /^\d+$/ } split /[\s,]+/, $o{rate};
die "--rate: commits/s, one or more\n" unless @rates;

my @psql = ('psql', '-X', '-q', '-A', '-t', '-v', 'ON_ERROR_STOP=1',
	'-h', $o{dir}, '-p', $o{pgport}, '-U', 'postgres', '-d', 'postgres');

# Run SQL through psql (statements one by one, not in one transaction);
# returns the tuples-only output.
sub psql
{
	my ($sql) = @_;
	my $file = "$o{dir}/idem_bench_stmt.sql";
	open(my $w, '>', $file) or die "$file: $!";
	print $w $sql;
	close $w;
	open(my $fh, '-|', @psql, '-f', $file) or die "psql: $!";
	my $out = do { local $/; <$fh> } // '';
	close($fh) or die "psql failed on: $sql\n";
	$out =~ s/\s+\z//;
	return $out;
}

sub stats { return split /\|/, psql('SELECT queued, copied, dropped, queue_depth, valkey_connected FROM idem_stats()'); }

sub wait_for
{
	my ($what, $timeout, $code) = @_;
	my $deadline = time() + $timeout;
	until ($code->())
	{
		die "timed out waiting for $what\n" if time() > $deadline;
		usleep(10_000);
	}
}

# --- a minimal RESP client ---
sub vk_connect
{
	return IO::Socket::INET->new(PeerAddr => '127.0.0.1', PeerPort => $o{vkport},
		Proto => 'tcp') // die "connect to Valkey: $!\n";
}

sub vk_send { my ($sock, @args) = @_; print $sock IdemResp::request(@args); }
sub vk_read { return IdemResp::read_reply($_[0]); }

sub vk_cmd { my ($s, @a) = @_; vk_send($s, @a); return vk_read($s); }

sub percentile
{
	my ($sorted, $p) = @_;
	return $sorted->[ int($p / 100 * (@$sorted - 1) + 0.5) ];
}

my $vk = vk_connect();
my $sub_pid;
my $parent = $$;
my $redirected = 0;	# the worker is pointed away from Valkey
END
{
	return unless $$ == $parent;
	kill 'TERM', $sub_pid if $sub_pid;
	eval { psql("ALTER SYSTEM RESET idem.valkey_port;\nSELECT pg_reload_conf();") }
	  if $redirected;
}

# Keys are fresh in every run: the scope carries the run's start time.
my $scope = 'idem-bench-' . int(time() * 1000);
psql(q{
	CREATE SEQUENCE IF NOT EXISTS idem_bench_seq;
	CREATE OR REPLACE FUNCTION idem_bench_one(c int) RETURNS void LANGUAGE plpgsql AS $$
	DECLARE
		n bigint := nextval('idem_bench_seq');
		k bytea := idem_key('SCOPE', n::text);
	BEGIN
		PERFORM idem_claim(1, k, '\x0000000000000000000000000000000000000000000000000000000000000000'::bytea);
		PERFORM idem_complete(1, k,
			jsonb_build_object('c', c, 'n', n,
				't', (extract(epoch FROM clock_timestamp()) * 1000000)::bigint));
	END $$;
} =~ s/SCOPE/$scope/r);
open(my $sf, '>', "$o{dir}/idem_bench.sql") or die $!;
print $sf "SELECT idem_bench_one(:client_id);\n";
close $sf;
wait_for('the worker to connect', 15, sub { (stats())[4] eq 't' });

# The raw pipelined SET rate of this server, measured right before and
# right after the drain (its neighbours on a shared machine matter).
# Our values are ~190 bytes ("idem2 <64 hex> 1 c 1 <ms> <64 hex> {"t": ...}").
sub raw_set_rate
{
	my $out = `$o{benchmark} -h 127.0.0.1 -p $o{vkport} -t set -P 16 -n 300000 -r 1000000 -d 190 -q 2>&1`;
	my ($rate) = $out =~ /SET: ([0-9.]+) requests per second/
	  or die "could not parse $o{benchmark}: $out\n";
	return $rate;
}

my @pgbench = ('pgbench', '-n', '-M', 'prepared', '-h', $o{dir}, '-p', $o{pgport},
	'-U', 'postgres', '-f', "$o{dir}/idem_bench.sql");
my $jobs = $o{clients} < 2 ? $o{clients} : 2;

# CPU time (ns on a CPU, /proc/PID/schedstat) and context switches of a
# process.
sub proc_usage
{
	my ($pid) = @_;
	my ($cpu, $csw) = (0, 0);
	return (0, 0) unless $pid;
	if (open(my $f, '<', "/proc/$pid/schedstat"))
	{
		($cpu) = split ' ', <$f>;
		close $f;
	}
	if (open(my $f, '<', "/proc/$pid/status"))
	{
		while (<$f>) { $csw += $1 if /^(?:non)?voluntary_ctxt_switches:\s+(\d+)/; }
		close $f;
	}
	return ($cpu, $csw);
}

# The worker has no database connection, so no pg_stat_activity row: it is
# the postmaster's child named for it.
sub worker_pid
{
	open(my $pm, '<', "$o{dir}/pg/postmaster.pid") or return '';
	my $ppid = <$pm> + 0;
	close $pm;
	foreach my $stat (glob('/proc/[0-9]*/stat'))
	{
		open(my $f, '<', $stat) or next;
		my $line = <$f> // '';
		close $f;
		my ($pid, $parent) = $line =~ /^(\d+) .*\) \S+ (\d+) /s or next;
		next unless $parent == $ppid;
		open(my $c, '<', "/proc/$pid/cmdline") or next;
		my $cmd = <$c> // '';
		close $c;
		return $pid if $cmd =~ /idem valkey worker/;
	}
	return '';
}
my ($valkey_pid) = (vk_cmd($vk, 'INFO', 'server') =~ /process_id:(\d+)/);

# One paced pgbench run; returns (tps, average latency ms, p99 latency ms)
# from its per-transaction log, and fills %$ack (if given) with each
# client's completion times (epoch microseconds) in transaction order.
sub paced_run
{
	my ($tag, $rate, $ack) = @_;
	my $prefix = "$o{dir}/idem_bench_log_$tag";
	unlink glob("$prefix*");
	my $out = `PGOPTIONS='-c synchronous_commit=$o{sync}' @pgbench -c $o{clients} -j $jobs -R $rate -T $o{seconds} -l --log-prefix=$prefix postgres 2>&1`;
	my ($tps) = $out =~ /tps = ([0-9.]+) \(without initial connection time\)/
	  or die "pgbench failed:\n$out";
	my ($avg) = $out =~ /latency average = ([0-9.]+) ms/;
	my @us;
	foreach my $f (glob("$prefix*"))
	{
		open(my $lf, '<', $f) or next;
		while (<$lf>)
		{
			my @c = split;
			next unless @c >= 6;
			push @us, $c[2];
			push @{ $ack->{ $c[0] } }, [ $c[1], $c[4] * 1_000_000 + $c[5] ] if $ack;
		}
		close $lf;
		unlink $f;
	}
	@us = sort { $a <=> $b } @us;
	return ($tps, $avg // 0, @us ? percentile(\@us, 99) / 1000.0 : 0);
}

# Point the worker at a closed port (nothing is copied, results queue up),
# or back at Valkey.
sub redirect_worker
{
	my ($away) = @_;
	psql($away ? "ALTER SYSTEM SET idem.valkey_port = 1;\nSELECT pg_reload_conf();"
		: "ALTER SYSTEM RESET idem.valkey_port;\nSELECT pg_reload_conf();");
	$redirected = $away;
	wait_for($away ? 'the worker to disconnect' : 'the worker to connect', 15,
		sub { (stats())[4] eq ($away ? 'f' : 't') });
}

# Subscribe to SET events in a child process, which writes "<key>
# <arrival, epoch microseconds>" lines to $file when sent SIGTERM.
sub start_subscriber
{
	my ($file) = @_;
	unlink $file, "$file.ready";
	my $pid = fork() // die "fork: $!";
	if ($pid == 0)
	{
		my $stop = 0;
		local $SIG{TERM} = sub { $stop = 1 };
		my $s = vk_connect();
		vk_send($s, 'SUBSCRIBE', '__keyevent@0__:set');
		vk_read($s);
		open(my $ready, '>', "$file.ready") or POSIX::_exit(1);
		close($ready);
		my (%seen, $buf);
		my $sel = IO::Select->new($s);
		$buf = '';
		until ($stop)
		{
			next unless $sel->can_read(0.05);
			my $now = int(time() * 1e6);
			my $n = sysread($s, $buf, 1 << 20, length($buf));
			last unless $n;
			# Push messages: *3 $7 message $<n> <channel> $<n> <key>
			while ($buf =~ /\G\*3\r\n\$7\r\nmessage\r\n\$\d+\r\n[^\r]*\r\n\$(\d+)\r\n/gc)
			{
				my $len = $1;
				my $start = pos($buf);
				if (length($buf) < $start + $len + 2)
				{
					pos($buf) = $start;
					last;
				}
				$seen{ substr($buf, $start, $len) } //= $now;
				pos($buf) = $start + $len + 2;
			}
			$buf = substr($buf, pos($buf) // 0);
		}
		open(my $out, '>', $file) or POSIX::_exit(1);
		print $out "$_ $seen{$_}\n" foreach keys %seen;
		close $out;
		POSIX::_exit(0);
	}
	wait_for('the subscriber', 10, sub { -e "$file.ready" });
	return $pid;
}

# --- 1. commit -> visible latency at each offered rate ---
my $keyspace = psql('SELECT idem_cache_keyspace()');
my @results;
vk_cmd($vk, 'CONFIG', 'SET', 'notify-keyspace-events', 'E$');
foreach my $rate (@rates)
{
	my %r = (rate => $rate);
	my $arrivals = "$o{dir}/idem_bench_arrivals_$rate";
	my (undef, undef, $d0) = stats();
	my $wpid = worker_pid();
	my %ack;

	$sub_pid = start_subscriber($arrivals);
	my @use0 = (proc_usage($wpid), proc_usage($valkey_pid));
	@r{qw(tps commit_ms commit_p99)} = paced_run('copying', $rate, \%ack);
	wait_for('the queue to drain', 30, sub { (stats())[3] == 0 });
	my @use1 = (proc_usage($wpid), proc_usage($valkey_pid));
	my (undef, undef, $d1) = stats();
	$r{dropped} = $d1 - $d0;
	usleep(300_000);
	kill 'TERM', $sub_pid;
	waitpid($sub_pid, 0);
	$sub_pid = undef;

	open(my $af, '<', $arrivals) or die "no arrivals: $!";
	my %arrival = map { split / / } <$af>;
	close $af;
	my @keys = grep { /^\Q$keyspace\Et:1:/ } keys %arrival;
	my (@lat, %byclient);
	while (my @chunk = splice(@keys, 0, 1000))
	{
		my $vals = vk_cmd($vk, 'MGET', @chunk);
		for my $i (0 .. $#chunk)
		{
			next unless defined $vals->[$i] &&
			  $vals->[$i] =~ /"c": (\d+), "n": (\d+), "t": (\d+)\}$/;
			push @lat, ($arrival{ $chunk[$i] } - $3) / 1000.0;
			push @{ $byclient{$1} }, [ $2, $arrival{ $chunk[$i] } ];
		}
	}
	@lat = sort { $a <=> $b } @lat;
	die "no latency samples\n" unless @lat;
	# From the acknowledgement: a client's transactions in order, against
	# its copies in the order of their sequence numbers.
	my @acklat;
	foreach my $c (keys %byclient)
	{
		my @copies = sort { $a->[0] <=> $b->[0] } @{ $byclient{$c} };
		my @acks = sort { $a->[0] <=> $b->[0] } @{ $ack{$c} // [] };
		next unless @copies == @acks;	# a copy or a log line missing
		push @acklat, ($copies[$_][1] - $acks[$_][1]) / 1000.0 for 0 .. $#copies;
	}
	@acklat = sort { $a <=> $b } @acklat;
	$r{lat} = \@lat;
	$r{acklat} = \@acklat;
	$r{per_copy} = [ map { ($use1[$_] - $use0[$_]) / scalar(@lat) } 0 .. 3 ];
	$r{worker_seen} = $wpid ne '';

	# The same run with nothing copied: the commit latency side by side.
	redirect_worker(1);
	@r{qw(tps_away commit_ms_away commit_p99_away)} = paced_run('away', $rate);
	redirect_worker(0);
	wait_for('the queue to drain', 60, sub { (stats())[3] == 0 });
	push @results, \%r;
}
vk_cmd($vk, 'CONFIG', 'SET', 'notify-keyspace-events', '');

# --- 2. drain rate, between two raw rates ---
open(my $df, '<', "$FindBin::Bin/drain.sql") or die "drain.sql: $!";
psql(do { local $/; <$df> });
close $df;
redirect_worker(1);
my $per_client = int($o{drain} / $o{clients});
$per_client = 1 if $per_client < 1;
my $fill = `@pgbench -c $o{clients} -j $jobs -t $per_client postgres 2>&1`;
die "pgbench (fill) failed:\n$fill" if $?;
my (undef, undef, $dropped_fill, $depth) = stats();
my $raw_before = raw_set_rate();
my ($drained, $secs) = split / /, psql(qq{
	ALTER SYSTEM SET idem.valkey_port = $o{vkport};
	SELECT pg_reload_conf() \\g /dev/null
	SELECT idem_bench_drain();
	ALTER SYSTEM RESET idem.valkey_port;
	SELECT pg_reload_conf() \\g /dev/null
});
$redirected = 0;
my $raw_after = raw_set_rate();
vk_cmd($vk, 'FLUSHALL');
my $raw = ($raw_before + $raw_after) / 2;
my $drain_rate = ($drained + 1) / $secs;	# the first copy starts the clock
psql(q{
	DROP FUNCTION idem_bench_one(int), idem_bench_drain();
	DROP SEQUENCE idem_bench_seq;
});

# --- the tables ---
printf "idem: commit -> visible in Valkey (%s)\n", $o{server} // 'Valkey';
printf "  %d s per rate, %d clients, synchronous_commit=%s; commits/s and commit latency\n",
  $o{seconds}, $o{clients}, $o{sync};
printf "  (pgbench) with the worker copying, and not copying (pointed away)\n";
printf "  %8s %10s %10s %6s %10s %10s %10s %10s\n", 'offered', 'achieved', 'not copy.',
  'ratio', 'avg ms', 'not copy.', 'p99 ms', 'not copy.';
foreach my $r (@results)
{
	printf "  %8d %10.0f %10.0f %6.2f %10.3f %10.3f %10.3f %10.3f\n", $r->{rate},
	  $r->{tps}, $r->{tps_away}, $r->{tps_away} ? $r->{tps} / $r->{tps_away} : 0,
	  $r->{commit_ms}, $r->{commit_ms_away}, $r->{commit_p99}, $r->{commit_p99_away};
}
printf "  copy latency (ms): from idem_complete() (includes the COMMIT) | from the commit's ack\n";
printf "  %8s %7s %7s %7s %7s %7s | %7s %7s %7s | %7s %7s %7s %7s %7s\n", 'offered', 'copies',
  'p50', 'p99', 'p99.9', 'max', 'p50', 'p99', 'p99.9', 'drops', 'wrk us', 'wrk cs', 'vk us', 'vk cs';
foreach my $r (@results)
{
	my ($l, $a, $u) = ($r->{lat}, $r->{acklat}, $r->{per_copy});
	printf "  %8d %7d %7.3f %7.3f %7.3f %7.3f | %7s %7s %7s | %7d %7s %7s %7.1f %7.2f\n",
	  $r->{rate}, scalar(@$l), percentile($l, 50), percentile($l, 99), percentile($l, 99.9),
	  $l->[-1],
	  (map { @$a ? sprintf('%.3f', percentile($a, $_)) : '-' } 50, 99, 99.9),
	  $r->{dropped},
	  $r->{worker_seen} ? sprintf('%.1f', $u->[0] / 1000) : '-',
	  $r->{worker_seen} ? sprintf('%.2f', $u->[1]) : '-',
	  $u->[2] / 1000, $u->[3];
}
printf "  (wrk/vk us, cs: the worker's and Valkey's CPU time and context switches per copy)\n";
printf "  %-36s %12d\n", 'drain: results queued', $depth;
printf "  %-36s %12.0f\n", 'drain: worker SETs/s', $drain_rate;
printf "  %-36s %12.0f\n", 'raw pipelined SETs/s before (-P 16)', $raw_before;
printf "  %-36s %12.0f\n", 'raw pipelined SETs/s after (-P 16)', $raw_after;
printf "  %-36s %12.2f\n", 'drain / mean raw', $drain_rate / $raw;
foreach my $r (@results)
{
	my $p99 = percentile($r->{lat}, 99);
	printf "  target p99 < 5 ms at %d commits/s offered: %s (%.0f achieved, p99 %.3f ms)\n",
	  $r->{rate}, ($p99 < 5 && $r->{tps} >= 0.95 * $r->{rate}) ? 'met' : 'NOT met',
	  $r->{tps}, $p99;
}
printf "  target drain >= 0.5 x raw: %s\n", ($drain_rate >= 0.5 * $raw) ? 'met' : 'NOT met';
