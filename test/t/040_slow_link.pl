# A slow link with large outcomes (src/worker_drain.c's send window): the
# worker reaches Valkey through a TCP proxy on loopback that passes about
# 2 MB/s towards Valkey.  Valkey hangs (SIGSTOP) while 3,000 results of
# about 3.5 kB each are committed; once it is back, the backlog must drain.
# A worker that sends its full window (4 batches of 512 copies, about
# 7.6 MB here, of which 4 MB fit its socket's send buffer, the rest 1.7 s
# on this link) within one idem.valkey_command_timeout (1 s) times out,
# reconnects and sends the same window again, forever; one that
# halves its window after a timeout settles on a window the link carries in
# time, and grows it back once windows are answered quickly.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use IO::Select;
use IO::Socket::INET;
use IdemValkey;
use POSIX ();
use Socket qw(SOL_SOCKET SO_RCVBUF);
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time usleep);

my $RATE = 2_000_000;	# bytes a second, towards Valkey

my $valkey = IdemValkey->new(name => 'valkey')->start;

# The proxy: a child process that accepts on $port and relays each
# connection to Valkey, the bytes towards Valkey at most $RATE a second
# (all connections together), the replies as they come.
my $port = PostgreSQL::Test::Cluster::get_free_port();
my $listen = IO::Socket::INET->new(
	LocalAddr => '127.0.0.1',
	LocalPort => $port,
	Listen => 16,
	ReuseAddr => 1) or die "listen: $!";
# A small receive buffer (inherited by each accepted connection), so that
# the kernel does not absorb megabytes the link has not carried yet: what
# the worker writes waits in its own send buffer (up to tcp_wmem's maximum,
# 4 MB by default) and then in its write.
setsockopt($listen, SOL_SOCKET, SO_RCVBUF, 65536) or die "SO_RCVBUF: $!";
my $proxy = fork();
die "fork: $!" unless defined $proxy;
if ($proxy == 0)
{
	# never return into the test (its END blocks stop the servers)
	eval { relay(); };
	if (open(my $fh, '>', "$PostgreSQL::Test::Utils::tmp_check/proxy.err"))
	{
		print $fh "proxy: $@";
		close($fh);
	}
	POSIX::_exit(0);
}

sub relay
{
	my %peer;		# fileno => the fileno it relays to
	my %sock;		# fileno => socket
	my %out;		# fileno => bytes waiting to be written to it
	my %slow;		# fileno => 1 if it is a connection to Valkey
	my $sel = IO::Select->new($listen);
	my ($budget, $at) = (0, time());
	local $SIG{PIPE} = 'IGNORE';
	my $drop = sub {
		my @fds = grep { defined } @_;	# copies: @_ aliases entries deleted here
		foreach my $f (@fds)
		{
			my $s = delete $sock{$f} or next;
			$sel->remove($s);
			delete $peer{$f};
			delete $out{$f};
			delete $slow{$f};
			close($s);
		}
	};
	while (1)
	{
		my $now = time();
		$budget += ($now - $at) * $RATE;
		$budget = $RATE / 10 if $budget > $RATE / 10;
		$at = $now;
		my @ready = $sel->can_read(0.005);
		foreach my $s (@ready)
		{
			if ($s == $listen)
			{
				my $c = $listen->accept or next;
				my $v = IO::Socket::INET->new(
					PeerAddr => '127.0.0.1',
					PeerPort => $valkey->port,
					Proto => 'tcp');
				if (!$v) { close($c); next; }
				$c->blocking(0);
				$v->blocking(0);
				my ($fc, $fv) = (fileno($c), fileno($v));
				@peer{ $fc, $fv } = ($fv, $fc);
				@sock{ $fc, $fv } = ($c, $v);
				@out{ $fc, $fv } = ('', '');
				$slow{$fv} = 1;
				$sel->add($c, $v);
				next;
			}
			my $f = fileno($s);
			next unless defined $f && $sock{$f};
			my $to = $peer{$f};
			# hold back what the link cannot carry yet
			next if $slow{$to} && length($out{$to}) > 65536;
			my $n = sysread($s, my $buf, 65536);
			if (!$n)
			{
				next if !defined $n && $!{EAGAIN};
				$drop->($f, $to);
				next;
			}
			$out{$to} .= $buf;
		}
		foreach my $f (keys %out)
		{
			next unless $sock{$f} && length $out{$f};
			my $max = length $out{$f};
			if ($slow{$f})
			{
				$max = int($budget) if int($budget) < $max;
				next if $max <= 0;
			}
			my $w = syswrite($sock{$f}, $out{$f}, $max);
			if (!defined $w)
			{
				$drop->($f, $peer{$f}) unless $!{EAGAIN};
				next;
			}
			substr($out{$f}, 0, $w) = '';
			$budget -= $w if $slow{$f};
		}
	}
}
close($listen);
END { kill 'KILL', $proxy if $proxy; }

my $node = IdemValkey::idem_node('slow', $valkey, 'idem.valkey_port' => $port);
ok(IdemValkey::wait_connected($node, 1), 'the worker connects through the slow proxy');

my $first = IdemValkey::tenant_key($node, 1, 'slow', 'first');
$node->safe_psql('postgres', 'BEGIN; ' . IdemValkey::complete_sql('slow', 'first') . ' COMMIT;');
ok(defined $valkey->wait_for_key($first, 10), 'a copy goes through the proxy');

# Valkey hangs while 3,000 large results commit.
$valkey->pause;
$node->safe_psql('postgres',
	    "DO \$\$ BEGIN FOR i IN 1..3000 LOOP "
	  . "PERFORM idem_claim(1, idem_key('big', i::text), idem_fingerprint('{}')); "
	  . "PERFORM idem_complete(1, idem_key('big', i::text), jsonb_build_object('pad', repeat('x', 3500))); "
	  . "END LOOP; END \$\$;");
is(IdemValkey::stats_col($node, 'queue_depth'), '3000', '3,000 copies wait while Valkey hangs');
sleep(3);
$valkey->resume;

my $t0 = time();
my $drained = IdemValkey::poll_until(60,
	sub { IdemValkey::stats_col($node, 'queue_depth') eq '0' });
diag(sprintf('drained in %.1f s after Valkey came back', time() - $t0)) if $drained;
ok($drained, 'once Valkey is back, the backlog drains over the slow link (within 60 s)')
  or diag('queue_depth ' . IdemValkey::stats_col($node, 'queue_depth')
	  . ', last_error ' . IdemValkey::stats_col($node, 'last_error') . "\n"
	  . join('', grep { /idem:|DETAIL/ } split /^/, slurp_file($node->logfile))
	  . (-e "$PostgreSQL::Test::Utils::tmp_check/proxy.err"
		  ? slurp_file("$PostgreSQL::Test::Utils::tmp_check/proxy.err") : ''));
my $last = IdemValkey::tenant_key($node, 1, 'big', '3000');
ok(defined $valkey->wait_for_key($last, 10), 'the last copy is in Valkey');

# The window grows back once windows are answered quickly: with small
# outcomes, a burst of 3,000 goes in a few seconds.
$node->safe_psql('postgres',
	    "DO \$\$ BEGIN FOR i IN 1..3000 LOOP "
	  . "PERFORM idem_claim(1, idem_key('small', i::text), idem_fingerprint('{}')); "
	  . "PERFORM idem_complete(1, idem_key('small', i::text), '{}'); "
	  . "END LOOP; END \$\$;");
ok( IdemValkey::poll_until(30,
		sub { IdemValkey::stats_col($node, 'queue_depth') eq '0' }),
	'small copies then drain too');
IdemValkey::check_counters($node);

$node->stop;
$valkey->stop;
done_testing();
