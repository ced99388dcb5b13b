# IdemValkey: a throwaway RESP server (valkey-server, or the server named
# by IDEM_VALKEY_SERVER) for idem's TAP tests, a tiny RESP client to
# look at it, and the helpers the tests share (a node that preloads idem,
# its standbys and restores, WAL positions, polling with a deadline,
# finding the worker's pid).
#
# The server binary is $ENV{IDEM_VALKEY_SERVER} if set, else valkey-server on
# PATH.  Each server listens on a free loopback
# port with persistence off, in a directory under the test's tmp_check, and
# is stopped at the end of the test whatever happens (END block).
package IdemValkey;

use strict;
use warnings;

use Digest::SHA qw(hmac_sha256_hex);
use File::Path qw(make_path);
use IO::Socket::INET;
use IPC::Run ();
use POSIX ();
use Time::HiRes qw(time usleep);

use IdemResp;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::RecursiveCopy;
use PostgreSQL::Test::Utils;

my @started;

sub server_binary
{
	return $ENV{IDEM_VALKEY_SERVER} if $ENV{IDEM_VALKEY_SERVER};
	foreach my $dir (split /:/, ($ENV{PATH} // ''))
	{
		return "$dir/valkey-server" if -x "$dir/valkey-server";
	}
	die "no valkey-server on PATH (or set IDEM_VALKEY_SERVER)\n";
}

# IdemValkey->new(name => 'v1', password => 'pw', extra => [...]): a stopped
# server on a free port (requiring that password, if given; with more
# command-line options, if given).
sub new
{
	my ($class, %args) = @_;
	my $name = $args{name} // 'valkey';
	my $port = PostgreSQL::Test::Cluster::get_free_port();
	my $dir = "$PostgreSQL::Test::Utils::tmp_check/${name}_$port";
	make_path($dir);
	my $self = bless {
		name => $name,
		port => $port,
		dir => $dir,
		password => $args{password},
		extra => $args{extra} // []		# more server options
	}, $class;
	push @started, $self;
	return $self;
}

sub port { return $_[0]->{port}; }
sub dir { return $_[0]->{dir}; }

# Start the server; returns once it answers PING, or (loading => 1) once it
# answers at all, be it with an error such as LOADING.  args => [...] adds
# command-line options for this start only.
sub start
{
	my ($self, %opt) = @_;
	my @cmd = (
		server_binary(), '--save', '', '--appendonly', 'no',
		'--port', $self->{port}, '--bind', '127.0.0.1',
		'--dir', $self->{dir}, '--logfile', "$self->{dir}/server.log",
		$self->{password} ? ('--requirepass', $self->{password}) : (),
		@{ $self->{extra} }, @{ $opt{args} // [] });
	my $pid = fork();
	die "fork: $!" unless defined $pid;
	if ($pid == 0)
	{
		exec(@cmd) or POSIX::_exit(127);
	}
	$self->{pid} = $pid;
	my $deadline = time() + 10;
	while (time() < $deadline)
	{
		my $pong = eval { $self->command('PING') };
		return $self if defined $pong && $pong eq 'PONG';
		return $self if $opt{loading} && $@ =~ /LOADING/;
		usleep(20_000);
	}
	die "$self->{name}: RESP server on port $self->{port} did not start";
}

sub stop
{
	my ($self) = @_;
	my $pid = delete $self->{pid};
	delete $self->{sock};
	return unless $pid;
	kill 'CONT', $pid;
	kill 'TERM', $pid;
	my $deadline = time() + 10;
	while (time() < $deadline)
	{
		return if waitpid($pid, POSIX::WNOHANG()) == $pid;
		usleep(20_000);
	}
	kill 'KILL', $pid;
	waitpid($pid, 0);
}

# Make the server hang (and come back): its socket accepts nothing and
# answers nothing while it is stopped.
sub pause { kill 'STOP', $_[0]->{pid}; }
sub resume { kill 'CONT', $_[0]->{pid}; }

# Send one command; returns the reply (string, integer, array ref, or undef
# for a nil), or dies on an error reply or a dead connection.
sub command
{
	my ($self, @args) = @_;
	my $sock = $self->{sock};
	if (!$sock)
	{
		$sock = IO::Socket::INET->new(
			PeerAddr => '127.0.0.1',
			PeerPort => $self->{port},
			Proto => 'tcp',
			Timeout => 5) or die "connect: $!";
		$self->{sock} = $sock;
		$self->command('AUTH', $self->{password}) if $self->{password};
	}
	my $req = IdemResp::request(@args);
	my $ok = eval { print $sock $req or die "write: $!"; 1 };
	my $reply = $ok ? eval { IdemResp::read_reply($sock) } : undef;
	if (!$ok || $@)
	{
		my $err = $@ || 'write failed';
		delete $self->{sock};
		die $err;
	}
	return $reply;
}

# Poll $code until it returns a true value or $timeout seconds pass; returns
# that value (or undef).  Never sleeps longer than 10 ms at a time.
sub poll_until
{
	my ($timeout, $code) = @_;
	my $deadline = time() + $timeout;
	while (1)
	{
		my $v = $code->();
		return $v if $v;
		return undef if time() >= $deadline;
		usleep(10_000);
	}
}

# Wait for a key; returns its value, or undef after $timeout seconds.
# Wait for a result at $key (the worker's copy), not a run's marker: a run
# that commits leaves its marker for that copy to overwrite.
sub wait_for_key
{
	my ($self, $key, $timeout) = @_;
	return poll_until(
		$timeout // 10,
		sub {
			my $v = $self->command('GET', $key);
			return (defined($v) && $v !~ /^idem2 \S+ \d+ p /) ? $v : undef;
		});
}

# A started node that preloads idem, talks to $valkey, and has a tenants
# table (tenant 1) and the ledgers installed.  %conf adds settings.
sub idem_node
{
	my ($name, $valkey, %conf) = @_;
	return _idem_node($name, $valkey, [], %conf);
}

# The same, able to stream to standbys (pg_basebackup), with the table
# effects (scope, id) that run_message's handler writes.
sub streaming_node
{
	my ($name, $valkey, %conf) = @_;
	my $node = _idem_node($name, $valkey, [ allows_streaming => 1 ], %conf);
	$node->safe_psql('postgres', 'CREATE TABLE effects (scope text, id text)');
	return $node;
}

sub _idem_node
{
	my ($name, $valkey, $init, %conf) = @_;
	my $node = PostgreSQL::Test::Cluster->new($name);
	$node->init(@$init);
	my $extra = "shared_preload_libraries = 'idem'\n"
	  . "idem.valkey_port = " . $valkey->port . "\n";
	$extra .= "$_ = $conf{$_}\n" foreach sort keys %conf;
	$node->append_conf('postgresql.conf', $extra);
	$node->start;
	install($node);
	# The worker takes the epoch over once Valkey answers (if it runs).
	wait_keyspace($node, undef, 10) if $valkey->{pid};
	return $node;
}

# CREATE EXTENSION idem, a tenants table with tenant 1, and the ledgers
# (in database $db, default postgres).
sub install
{
	my ($node, $db) = @_;
	$node->safe_psql($db // 'postgres', q{
		CREATE TABLE tenants (id bigint PRIMARY KEY);
		INSERT INTO tenants VALUES (1);
		CREATE EXTENSION idem;
		SELECT idem_install('tenants');
	});
}

# Promote the standby $node and wait until it is out of recovery (up to
# 30 s); true on success.
sub promote_and_wait
{
	my ($node) = @_;
	$node->promote;
	return poll_until(30,
		sub { $node->safe_psql('postgres', 'SELECT NOT pg_is_in_recovery()') eq 't' });
}

# A started streaming standby $name of $primary, made from a new backup
# $backup of it; $conf (if given) is appended to its postgresql.conf first.
sub standby_of
{
	my ($primary, $name, $backup, $conf) = @_;
	$primary->backup($backup);
	my $standby = PostgreSQL::Test::Cluster->new($name);
	$standby->init_from_backup($primary, $backup, has_streaming => 1);
	$standby->append_conf('postgresql.conf', $conf) if defined $conf;
	$standby->start;
	return $standby;
}

# standby_of($primary, 'standby', 'b1'), made $primary's synchronous
# standby (synchronous_standby_names): one check, that it is.
sub sync_standby
{
	my ($primary) = @_;
	my $standby = standby_of($primary, 'standby', 'b1');
	$primary->safe_psql('postgres', "ALTER SYSTEM SET synchronous_standby_names = 'standby'");
	$primary->reload;
	Test::More::ok(poll_until(30, sub {
				$primary->safe_psql('postgres',
					"SELECT sync_state FROM pg_stat_replication WHERE application_name = 'standby'") eq 'sync'
			}),
		'the standby is synchronous');
	return $standby;
}

# Replace $node's data directory by its backup $backup (an immediate stop
# first) and start it again, on the same port; $conf (if given) appended
# to its postgresql.conf, and with $recovery a recovery.signal written.
sub restore_backup
{
	my ($node, $backup, $conf, $recovery) = @_;
	$node->stop('immediate');
	File::Path::rmtree($node->data_dir);
	PostgreSQL::Test::RecursiveCopy::copypath($node->backup_dir . "/$backup", $node->data_dir);
	chmod 0700, $node->data_dir;
	$node->append_conf('postgresql.conf', $conf) if $conf;
	if ($recovery)
	{
		open(my $f, '>', $node->data_dir . '/recovery.signal') or die "recovery.signal: $!";
		close $f;
	}
	$node->start;
}

# WAL positions: an LSN ("0/16B3748") as a number; whether LSN $x is past
# $y; $node's flush position.
sub lsn_num
{
	my ($hi, $lo) = $_[0] =~ m{^([0-9A-F]+)/([0-9A-F]+)$}i or die "not an LSN: $_[0]";
	return hex($hi) * 2**32 + hex($lo);
}
sub lsn_gt { return lsn_num($_[0]) > lsn_num($_[1]); }
sub flush_lsn { $_[0]->safe_psql('postgres', 'SELECT pg_current_wal_flush_lsn()') }

# Wait until $node's WAL writer has flushed (true), so that what follows
# has most of a cycle before the next flush (the tests that use it set
# wal_writer_delay = 10s: on a slow machine, each psql call can take a
# second).  It commits an asynchronous commit record and
# nothing else (dropping a relation, as a temporary table does at exit,
# would force a synchronous commit), then polls for the flush past it.
sub wait_for_wal_writer
{
	my ($node) = @_;
	my $out = $node->safe_psql('postgres',
		'SET synchronous_commit = off; BEGIN; '
		  . 'SELECT pg_current_wal_insert_lsn(), txid_current(); COMMIT;');
	my ($insert) = split /\|/, $out;
	return poll_until(30, sub { lsn_gt(flush_lsn($node), $insert) });
}

# Complete tenant 1's key ($scope, $id) on $node with synchronous_commit =
# off (complete_sql's $outcome and $retention); returns the insert LSN just
# before COMMIT: the commit record ends after it, so the commit is not
# flushed while the flush position is not past it.
sub commit_async
{
	my ($node, $scope, $id, $outcome, $retention) = @_;
	my $out = $node->safe_psql('postgres',
		'SET synchronous_commit = off; BEGIN; '
		  . complete_sql($scope, $id, $outcome, $retention)
		  . ' SELECT pg_current_wal_insert_lsn(); COMMIT;');
	return (split /\n/, $out)[-1];
}

# Whether $node has the injection_points module (PostgreSQL 17 or later,
# built with --enable-injection-points); if so, it is created.
sub injection_points
{
	my ($node) = @_;
	return 0
	  if $node->safe_psql('postgres',
		"SELECT count(*) FROM pg_available_extensions WHERE name = 'injection_points'") ne '1';
	$node->safe_psql('postgres', 'CREATE EXTENSION injection_points');
	return 1;
}

# A background session of $node that runs $sql (a transaction to commit)
# and stops at the injection point $point, attached for that session
# alone; returns the session and whether it was seen waiting there.
# injection_points_wakeup($point) lets it go on.
sub held_session
{
	my ($node, $point, $sql) = @_;
	my $s = $node->background_psql('postgres');
	$s->query_safe('SELECT injection_points_set_local()');
	$s->query_safe("SELECT injection_points_attach('$point', 'wait')");
	$s->query_until(qr/committing/, "\\echo committing\n" . $sql);
	return ($s, $node->poll_query_until('postgres',
			"SELECT count(*) = 1 FROM pg_stat_activity WHERE wait_event = '$point'"));
}

# One idem_stats() column.
sub stats_col
{
	my ($node, $column) = @_;
	return $node->safe_psql('postgres', "SELECT $column FROM idem_stats()");
}

# Wait until the worker is connected (or not); true on success.
sub wait_connected
{
	my ($node, $want, $timeout) = @_;
	my $expect = $want ? 't' : 'f';
	return poll_until($timeout // 15,
		sub { (eval { stats_col($node, 'valkey_connected') } // '') eq $expect });
}

# The pid of the node's idem worker (a child of the postmaster titled
# "idem valkey worker"), or undef.
sub worker_pid
{
	my ($node) = @_;
	open(my $pf, '<', $node->data_dir . '/postmaster.pid') or return undef;
	my $pm = <$pf>;
	close $pf;
	return undef unless defined $pm && $pm =~ /^(\d+)/;
	$pm = $1;
	foreach my $stat (glob '/proc/[0-9]*/stat')
	{
		open(my $fh, '<', $stat) or next;
		my $line = <$fh> // next;
		close $fh;
		my ($pid, $ppid) = $line =~ /^(\d+) \(.*\) \S (\d+)/ or next;
		next unless $ppid == $pm;
		open(my $cf, '<', "/proc/$pid/cmdline") or next;
		my $cmd = <$cf> // '';
		close $cf;
		return $pid if $cmd =~ /idem valkey worker/;
	}
	return undef;
}

# CPU time the node's idem worker has used (utime + stime, in clock
# ticks: 100 a second), or -1 if there is no worker.
sub worker_cpu_ticks
{
	my ($node) = @_;
	my $pid = worker_pid($node) // return -1;
	open(my $fh, '<', "/proc/$pid/stat") or return -1;
	my @f = split ' ', (<$fh> =~ s/^.*\) //r);
	close $fh;
	return $f[11] + $f[12];
}

# The node's idem worker's sleeps (voluntary context switches) and write
# system calls so far, from /proc (readable by the server's user): with the
# writes as its batches, what tests of the batch delay count.
sub worker_counts
{
	my ($node) = @_;
	my $pid = worker_pid($node) // die "no idem worker";
	open(my $st, '<', "/proc/$pid/status") or die "/proc/$pid/status: $!";
	my ($sleeps) = map { /^voluntary_ctxt_switches:\s+(\d+)/ ? $1 : () } <$st>;
	close($st);
	open(my $io, '<', "/proc/$pid/io") or die "/proc/$pid/io: $!";
	my ($writes) = map { /^syscw:\s+(\d+)/ ? $1 : () } <$io>;
	close($io);
	return ($sleeps, $writes);
}

# Commit $n results of scope $scope on $node ({"i": i} for ids 1..$n),
# each in its own transaction, 10 ms apart, and wait until the queue is
# empty.  Returns the worker's sleeps and batches during that, and how long
# the commits took in seconds.  Its batches are its write system calls, or
# what $batches->() counts (a total it is called for before and after).
sub stream_commits
{
	my ($node, $scope, $n, $batches) = @_;
	$batches //= sub { return (worker_counts($node))[1]; };
	$node->safe_psql('postgres', q{
	CREATE OR REPLACE PROCEDURE idem_test_stream(scope text, n int)
	LANGUAGE plpgsql AS $$
	BEGIN
		FOR i IN 1..n LOOP
			PERFORM idem_claim(1, idem_key(scope, i::text), idem_fingerprint('{}'));
			PERFORM idem_complete(1, idem_key(scope, i::text), jsonb_build_object('i', i), '1 hour');
			COMMIT;
			PERFORM pg_sleep(0.01);
		END LOOP;
	END $$;});
	my ($sleeps0) = worker_counts($node);
	my $batches0 = $batches->();
	my $t0 = time();
	$node->safe_psql('postgres', "CALL idem_test_stream('$scope', $n)");
	my $took = time() - $t0;
	poll_until(10, sub { stats_col($node, 'queue_depth') eq '0' });
	my ($sleeps1) = worker_counts($node);
	my $batches1 = $batches->();
	$node->safe_psql('postgres', 'DROP PROCEDURE idem_test_stream(text, int)');
	return ($sleeps1 - $sleeps0, $batches1 - $batches0, $took);
}

# idem_cache_keyspace() of database $db (default postgres) of $node, once
# the worker has taken the server's history epoch over in Valkey (until then
# it is refused with 55000); undef if that does not happen within $timeout
# seconds (default 20).
sub wait_keyspace
{
	my ($node, $db, $timeout) = @_;
	my $ks;
	poll_until($timeout // 20, sub {
		my ($ret, $out, $err) = $node->psql($db // 'postgres',
			'SELECT idem_cache_keyspace()');
		$ks = $out if $ret == 0 && $out ne '';
		return defined $ks;
	});
	return $ks;
}

# idem_cache_keyspace() of $node once its worker took an epoch other than
# the one of keyspace $old over (up to 30 s); the last keyspace seen if not.
sub new_keyspace
{
	my ($node, $old) = @_;
	my $ks;
	for (1 .. 300)
	{
		$ks = wait_keyspace($node, undef, 30);
		return $ks if defined $ks && $ks ne $old;
		usleep(100_000);
	}
	return $ks;
}

# The epoch owner key of a keyspace.
sub owner_key_of
{
	(my $k = $_[0]) =~ s/\.[0-9]+:\z/:owner/;
	return $k;
}

# Message $id of tenant 1's $scope applied by runner session $s on $node,
# its result copied to $valkey, then replayed from Valkey by $s: three
# checks, named after $what.
sub applied_and_cached
{
	my ($s, $node, $valkey, $scope, $id, $what) = @_;
	Test::More::is($s->run($id), 'applied handler', "$what: $id is applied");
	Test::More::ok(defined $valkey->wait_for_key(tenant_key($node, 1, $scope, $id), 10),
		"$what: ... its result copied to Valkey");
	Test::More::is($s->run($id), 'replayed valkey',
		"$what: ... and replayed from Valkey by the same runner");
}

# The keyspace the worker uses for database $db (default postgres) of
# $node, from idem_cache_keyspace(); with $prefix, as if idem.valkey_prefix
# were $prefix.
sub keyspace
{
	my ($node, $prefix, $db) = @_;
	my $ks = wait_keyspace($node, $db);
	die "no cache keyspace on " . $node->name . " (the worker did not take its epoch over)"
	  unless defined $ks;
	if (defined $prefix)
	{
		my $cur = $node->safe_psql($db // 'postgres',
			"SELECT current_setting('idem.valkey_prefix')");
		$ks = $prefix . substr($ks, length($cur));
	}
	return $ks;
}

# The keyspace part of a tenant or platform key.
sub keyspace_of_key
{
	my ($key) = @_;
	(my $ks = $key) =~ s/(t:-?[0-9]+|p):[0-9a-f]{64}$//;
	return $ks;
}

# The Valkey key of a tenant or platform row (the node's keyspace, or the
# keyspace with another prefix).
sub tenant_key
{
	my ($node, $tenant, $scope, $id, $prefix, $db) = @_;
	my $hex = $node->safe_psql($db // 'postgres',
		"SELECT encode(idem_key('$scope', '$id'), 'hex')");
	return keyspace($node, $prefix, $db) . "t:$tenant:$hex";
}

sub platform_key
{
	my ($node, $scope, $id, $prefix, $db) = @_;
	my $hex = $node->safe_psql($db // 'postgres',
		"SELECT encode(idem_key('$scope', '$id'), 'hex')");
	return keyspace($node, $prefix, $db) . "p:$hex";
}

# Split an idem2 value into its fields (a hash), or undef if it is not one.
sub parse_value
{
	my ($value) = @_;
	return undef unless defined $value;
	my ($mac, $rest) = $value =~ /^idem2 ([0-9a-f]{64}) (.*)$/s or return undef;
	my %v = (mac => $mac, rest => $rest);
	if ($rest =~ /^([1-9][0-9]*) ([cf]) ([1-9][0-9]*) (0|[1-9][0-9]*) ([0-9a-f]{64}) (\{.*\})$/s)
	{
		@v{qw(key_id kind attempt expires_ms fingerprint outcome)} =
		  ($1, $2, $3, $4, $5, $6);
		return \%v;
	}
	if ($rest =~ /^([1-9][0-9]*) p (0|[1-9][0-9]*) ([0-9a-f]{32})$/)
	{
		@v{qw(key_id kind expires_ms token)} = ($1, 'p', $2, $3);
		return \%v;
	}
	return undef;
}

# The node's cache secrets as "1 2*" (key ids, the current one starred).
sub secrets
{
	my ($node) = @_;
	return $node->safe_psql('postgres',
		"SELECT string_agg(key_id || CASE WHEN is_current THEN '*' ELSE '' END, ' ' ORDER BY key_id) FROM idem_cache_secrets()"
	);
}

# The hex of the node's secret with key id $key_id.
sub secret_hex
{
	my ($node, $key_id) = @_;
	return $node->safe_psql('postgres',
		"SELECT encode(secret, 'hex') FROM idem_cache_secrets() WHERE key_id = $key_id");
}

# Whether $value (stored under $key) carries a valid MAC under one of the
# node's cache secrets.
sub mac_ok
{
	my ($node, $key, $value) = @_;
	my $v = parse_value($value) or return 0;
	my $hex = $node->safe_psql('postgres',
		"SELECT encode(secret, 'hex') FROM idem_cache_secrets() WHERE key_id = $v->{key_id}");
	return 0 unless $hex;
	return hmac_sha256_hex($key . "\0" . $v->{rest}, pack('H*', $hex)) eq $v->{mac};
}

# Write under $key a completed value (outcome {"forged": true}) MACed with
# secret $hex under key id $key_id, as a party holding that secret could.
sub forge_value
{
	my ($valkey, $key, $key_id, $hex, $fingerprint) = @_;
	my $rest = sprintf('%d c 1 %d %s {"forged": true}',
		$key_id, int(time() * 1000) + 3_600_000, $fingerprint);
	my $mac = hmac_sha256_hex($key . "\0" . $rest, pack('H*', $hex));
	$valkey->command('SET', $key, "idem2 $mac $rest", 'PX', '3600000');
}

# Forge a value for message $id of tenant 1's $scope on $node with secret
# $hex (key id 1) and the request's $fingerprint, then deliver the message
# (request {"x": 1}, handler writing effects): two checks, that it is
# applied, not replayed, and once.  $what names the forger's secret.
sub check_forged_ignored
{
	my ($node, $valkey, $scope, $id, $hex, $fingerprint, $what) = @_;
	forge_value($valkey, tenant_key($node, 1, $scope, $id), 1, $hex, $fingerprint);
	my ($status, $source) =
	  run_message($node, 'postgres', $valkey, 1, $scope, $id, '{"x": 1}');
	Test::More::is("$status $source", 'applied handler',
		"a value forged with $what is not replayed: $id is applied");
	Test::More::is($node->safe_psql('postgres',
			"SELECT count(*) FROM effects WHERE id = '$id'"),
		'1', '... once');
}

# The C runner (client/): test/t/idem_run_once.c, built once per test
# against client/build/libidemclient.a (make test builds it).
my $run_once_bin;
sub run_once_binary
{
	return $run_once_bin if $run_once_bin;
	my $tree = $ENV{TESTDIR} // '.';
	my $inc = `pg_config --includedir`;
	my $lib = `pg_config --libdir`;
	chomp($inc, $lib);
	my $bin = "$PostgreSQL::Test::Utils::tmp_check/idem_run_once";
	my @cmd = ('cc', '-std=c11', '-D_GNU_SOURCE', "-I$tree/client", "-I$tree/src/common", "-I$inc",
		'-o', $bin, "$tree/test/t/idem_run_once.c", "$tree/client/build/libidemclient.a",
		"-L$lib", '-lpq', '-lhiredis', '-pthread');
	system(@cmd) == 0 or die "could not build idem_run_once: @cmd";
	return $run_once_bin = $bin;
}

# Run one message through the C runner against database $db of $node and
# $valkey: returns (status, source, outcome), e.g. ('applied', 'handler',
# '{"db": "postgres", "node": "alpha"}').  The handler's effect is a row in
# the database's table effects (scope, id).
sub run_message
{
	my ($node, $db, $valkey, $tenant, $scope, $id, $request) = @_;
	my $bin = run_once_binary();
	my $out = `$bin '@{[ $node->connstr($db) ]}' @{[ $valkey->port ]} $tenant '$scope' '$id' '$request' 2>&1`;
	chomp $out;
	my ($status, $source, $outcome) = split / /, $out, 3;
	return ($status, $source // '', $outcome // '');
}

# A runner that stays connected (idem_run_once with id "-"): ->run($id)
# runs message $id of ($tenant, $scope, $request) and returns "status
# source"; ->rejected is its cache_rejected counter; ->finish ends it.
# $node may also be a connection string (a pooler's).
sub runner_session
{
	my ($node, $db, $valkey, $tenant, $scope, $request) = @_;
	my $self = { in => '', out => '' };
	$self->{h} = IPC::Run::start(
		[ run_once_binary(), ref $node ? $node->connstr($db) : $node,
		  $valkey->port, $tenant,
		  $scope, '-', $request ],
		'<', \$self->{in}, '>', \$self->{out}, '2>', \$self->{err},
		IPC::Run::timeout(250));
	return bless $self, 'IdemValkey::RunnerSession';
}

package IdemValkey::RunnerSession;

sub ask
{
	my ($self, $line) = @_;
	$self->{out} = '';
	$self->{in} .= "$line\n";
	$self->{h}->pump until $self->{out} =~ /\n/;
	my ($answer) = $self->{out} =~ /^(.*)\n/;
	return $answer;
}

sub run
{
	my ($self, $id) = @_;
	my ($status, $source) = split / /, $self->ask($id);
	return "$status $source";
}

sub rejected { return (split / /, $_[0]->ask('rejected'))[1]; }

sub finish
{
	my ($self) = @_;
	$self->{h}->finish;
}

package IdemValkey;

# SQL that claims and completes tenant 1's key (scope, id) with $outcome.
sub complete_sql
{
	my ($scope, $id, $outcome, $retention) = @_;
	$outcome //= '{"ok": true}';
	my $ret = $retention ? ", '$retention'" : '';
	return "SELECT idem_claim(1, idem_key('$scope', '$id'), idem_fingerprint('{}'));"
	  . " SELECT idem_complete(1, idem_key('$scope', '$id'), '$outcome'$ret);";
}

# Every copy handed to $node's commit ring is accounted for: queued =
# copied + dropped + rejected + skipped + queue_depth, and skipped is the
# sum of its reasons.  Counters move one after another, so this polls
# until a reading balances (up to $timeout s, 20 by default): a copy
# counted nowhere never does.  For the end of each test that injects
# faults.
sub check_counters
{
	my ($node, $timeout) = @_;
	my $last = '';
	my $ok = poll_until(
		$timeout // 20,
		sub {
			$last = $node->safe_psql('postgres',
				'SELECT queued, copied, dropped, rejected, skipped, queue_depth, '
				  . 'skipped_expired + skipped_unjoined + skipped_epoch FROM idem_stats()');
			my ($q, $c, $d, $r, $s, $depth, $reasons) = split /\|/, $last;
			return $q == $c + $d + $r + $s + $depth && $s == $reasons;
		});
	return Test::More::ok($ok,
		'every copy is counted: queued = copied + dropped + rejected + skipped + queue_depth')
	  || Test::More::diag("queued|copied|dropped|rejected|skipped|queue_depth|reasons: $last");
}

END
{
	my $rc = $?;
	$_->stop foreach @started;
	$? = $rc;
}

1;
