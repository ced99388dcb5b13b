#!/usr/bin/perl
# The measuring half of bench/commit_latency.sh (which sets up the servers).
#
# Latency: pgbench offers --rate transactions/s, each one call of
# idem_bench_one(), which claims a fresh key and completes it with the
# outcome {"t": <clock_timestamp() in microseconds>}, and commits.  A
# subscriber to Valkey's keyspace events (__keyevent@0__:set) timestamps
# each SET as it arrives; afterwards each value's "t" is read back.  The
# latency is arrival - t: from idem_complete() inside the transaction to the
# SET in Valkey, so it includes the COMMIT itself (an upper bound on
# commit-to-visible).  Both clocks are this machine's.  The worker copies a
# result only once its commit record is flushed (and with
# synchronous_commit=off that waits for the WAL writer), so the default is
# synchronous_commit=on.
#
# Commit latency, side by side: the same pgbench run (rate, clients,
# duration) once with the worker copying into Valkey and once with the
# worker pointed at a closed port (it copies nothing; the copies wait in the
# queue): pgbench's average latency and the p99 of its per-transaction log.
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

my %o = (rate => 5000, seconds => 10, clients => 8, drain => 50000, sync => 'on');
GetOptions(\%o, 'dir=s', 'pgport=i', 'vkport=i', 'benchmark=s', 'server=s', 'rate=i',
	'seconds=i', 'clients=i', 'drain=i', 'sync=s')
  or die "usage: see bench/commit_latency.sh\n";

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
	CREATE OR REPLACE FUNCTION idem_bench_one() RETURNS void LANGUAGE plpgsql AS $$
	DECLARE
		k bytea := idem_key('SCOPE', nextval('idem_bench_seq')::text);
	BEGIN
		PERFORM idem_claim(1, k, '\x0000000000000000000000000000000000000000000000000000000000000000'::bytea);
		PERFORM idem_complete(1, k,
			jsonb_build_object('t', (extract(epoch FROM clock_timestamp()) * 1000000)::bigint));
	END $$;
} =~ s/SCOPE/$scope/r);
open(my $sf, '>', "$o{dir}/idem_bench.sql") or die $!;
print $sf "SELECT idem_bench_one();\n";
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

# --- 1. commit -> visible latency at a sustained rate ---
vk_cmd($vk, 'CONFIG', 'SET', 'notify-keyspace-events', 'E$');
my $arrivals = "$o{dir}/idem_bench_arrivals";
$sub_pid = fork() // die "fork: $!";
if ($sub_pid == 0)
{
	my $stop = 0;
	local $SIG{TERM} = sub { $stop = 1 };
	my $s = vk_connect();
	vk_send($s, 'SUBSCRIBE', '__keyevent@0__:set');
	vk_read($s);
	open(my $ready, '>', "$arrivals.ready") or POSIX::_exit(1);
	close($ready);
	my (%seen, $buf);
	my $sel = IO::Select->new($s);
	$buf = '';
	until ($stop)
	{
		next unless $sel->can_read(0.05);
		my $n = sysread($s, $buf, 1 << 20, length($buf));
		last unless $n;
		my $now = int(time() * 1e6);
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
	open(my $out, '>', $arrivals) or POSIX::_exit(1);
	print $out "$_ $seen{$_}\n" foreach keys %seen;
	close $out;
	POSIX::_exit(0);
}
wait_for('the subscriber', 10, sub { -e "$arrivals.ready" });

my (undef, undef, $d0) = stats();
my @pgbench = ('pgbench', '-n', '-M', 'prepared', '-h', $o{dir}, '-p', $o{pgport},
	'-U', 'postgres', '-f', "$o{dir}/idem_bench.sql");
my $jobs = $o{clients} < 2 ? $o{clients} : 2;

# One paced pgbench run; returns (tps, average latency ms, p99 latency ms)
# from its per-transaction log.
sub paced_run
{
	my ($tag) = @_;
	my $prefix = "$o{dir}/idem_bench_log_$tag";
	unlink glob("$prefix*");
	my $out = `PGOPTIONS='-c synchronous_commit=$o{sync}' @pgbench -c $o{clients} -j $jobs -R $o{rate} -T $o{seconds} -l --log-prefix=$prefix postgres 2>&1`;
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
			push @us, $c[2] if @c >= 3;
		}
		close $lf;
		unlink $f;
	}
	@us = sort { $a <=> $b } @us;
	return ($tps, $avg // 0, @us ? percentile(\@us, 99) / 1000.0 : 0);
}
my ($tps, $commit_ms, $commit_p99) = paced_run('copying');
wait_for('the queue to drain', 30, sub { (stats())[3] == 0 });
my (undef, undef, $d1) = stats();
usleep(300_000);
kill 'TERM', $sub_pid;
waitpid($sub_pid, 0);
vk_cmd($vk, 'CONFIG', 'SET', 'notify-keyspace-events', '');

open(my $af, '<', $arrivals) or die "no arrivals: $!";
my %arrival = map { split / / } <$af>;
close $af;
my $keyspace = psql('SELECT idem_cache_keyspace()');
my @keys = grep { /^\Q$keyspace\Et:1:/ } keys %arrival;
my @lat;
while (my @chunk = splice(@keys, 0, 1000))
{
	my $vals = vk_cmd($vk, 'MGET', @chunk);
	for my $i (0 .. $#chunk)
	{
		next unless defined $vals->[$i] && $vals->[$i] =~ /"t": (\d+)\}$/;
		push @lat, ($arrival{ $chunk[$i] } - $1) / 1000.0;
	}
}
@lat = sort { $a <=> $b } @lat;
die "no latency samples\n" unless @lat;

# --- 2. drain rate, between two raw rates ---
open(my $df, '<', "$FindBin::Bin/drain.sql") or die "drain.sql: $!";
psql(do { local $/; <$df> });
close $df;
psql(q{
	ALTER SYSTEM SET idem.valkey_port = 1;
	SELECT pg_reload_conf();
});
$redirected = 1;
wait_for('the worker to disconnect', 15, sub { (stats())[4] eq 'f' });
# Commit latency with nothing copied, side by side with the run above; its
# results stay queued and are part of the drain.
my ($tps_away, $commit_ms_away, $commit_p99_away) = paced_run('away');
my $per_client = int(($o{drain} - $o{rate} * $o{seconds}) / $o{clients});
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
	DROP FUNCTION idem_bench_one(), idem_bench_drain();
	DROP SEQUENCE idem_bench_seq;
});

# --- the table ---
my $p50 = percentile(\@lat, 50);
my $p99 = percentile(\@lat, 99);
printf "idem: commit -> visible in Valkey (%s)\n", $o{server} // 'Valkey';
printf "  offered %d commits/s for %d s, %d clients, synchronous_commit=%s\n",
  $o{rate}, $o{seconds}, $o{clients}, $o{sync};
printf "  %-36s %12s %12s %8s\n", 'commit latency (pgbench)', 'copying', 'not copying', 'ratio';
printf "  %-36s %12.0f %12.0f %8.2f\n", 'commits/s achieved', $tps, $tps_away, $tps / $tps_away;
printf "  %-36s %12.3f %12.3f %8.2f\n", 'latency average (ms)', $commit_ms, $commit_ms_away,
  $commit_ms_away ? $commit_ms / $commit_ms_away : 0;
printf "  %-36s %12.3f %12.3f %8.2f\n", 'latency p99 (ms)', $commit_p99, $commit_p99_away,
  $commit_p99_away ? $commit_p99 / $commit_p99_away : 0;
printf "  %-36s %12s\n", 'copy', 'value';
printf "  %-36s %12d\n", 'results copied / samples', scalar(@lat);
printf "  %-36s %12d\n", 'dropped (queue full)', $d1 - $d0;
printf "  %-36s %12.3f\n", 'latency p50 (ms)', $p50;
printf "  %-36s %12.3f\n", 'latency p99 (ms)', $p99;
printf "  %-36s %12.3f\n", 'latency p99.9 (ms)', percentile(\@lat, 99.9);
printf "  %-36s %12.3f\n", 'latency max (ms)', $lat[-1];
printf "  %-36s %12d\n", 'drain: results queued', $depth;
printf "  %-36s %12.0f\n", 'drain: worker SETs/s', $drain_rate;
printf "  %-36s %12.0f\n", 'raw pipelined SETs/s before (-P 16)', $raw_before;
printf "  %-36s %12.0f\n", 'raw pipelined SETs/s after (-P 16)', $raw_after;
printf "  %-36s %12.2f\n", 'drain / mean raw', $drain_rate / $raw;
printf "  targets: p99 < 5 ms at %d commits/s: %s; drain >= 0.5 x raw: %s\n",
  $o{rate},
  ($p99 < 5 && $tps >= 0.95 * $o{rate}) ? 'met' : 'NOT met',
  ($drain_rate >= 0.5 * $raw) ? 'met' : 'NOT met';
