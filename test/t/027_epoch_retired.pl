# A runner that learnt the cache keyspace before the server's history epoch
# changed, and stays connected, does not replay from the old epoch: every
# lookup reads the epoch's owner key in the same round trip, and a server
# that makes a new epoch retires the old one's owner key first.  The
# runners here re-learn only once an hour (secrets_max_age_ms), so only the
# owner check stands between them and the old epoch.
#   1. ledger rows deleted, on the runner's own connection;
#   2. a restore from a base backup behind pgbouncer (transaction pooling),
#      so the runner's connection survives the server's change;
#   3. a second server started from a backup of a running one retires the
#      first one's epoch; the first one then makes a new epoch of its own.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use IdemValkey;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

$ENV{IDEM_SECRETS_MAX_AGE_MS} = 3_600_000;

my $valkey = IdemValkey->new(name => 'valkey')->start;
my $node = IdemValkey::streaming_node('node', $valkey);

sub sql { $node->safe_psql('postgres', $_[0]) }
sub owner_key_of { IdemValkey::owner_key_of(@_) }
sub new_keyspace { IdemValkey::new_keyspace(@_) }
sub applied_and_cached
{
	my ($s, $n, $id, $what) = @_;
	IdemValkey::applied_and_cached($s, $n, $valkey, 'er', $id, $what);
}

# --- 1. ledger rows deleted, the runner on its own connection ---
my $s = IdemValkey::runner_session($node, 'postgres', $valkey, 1, 'er', '{"x": 1}');
applied_and_cached($s, $node, 'd1', 'direct');
my $ks = IdemValkey::keyspace($node);
is($valkey->command('GET', owner_key_of($ks)) =~ /^[0-9a-f]{16}\z/ ? 1 : 0, 1,
	'the epoch owner key holds a token');
sql(q{DELETE FROM idempotency_keys WHERE idempotency_key = idem_key('er', 'd1')});
my $ks2 = new_keyspace($node, $ks);
isnt($ks2, $ks, 'DELETE: a new epoch');
like($valkey->command('GET', owner_key_of($ks)), qr/^retired 1\.[0-9a-f]{16}\z/,
	'DELETE: the old epoch\'s owner key is retired, naming the new epoch');
is($s->run('d1'), 'applied handler',
	'DELETE: the runner connected before applies d1 again, not replays it from the old epoch');
is(sql(q{SELECT count(*) FROM effects WHERE id = 'd1'}), '2', '... the effect ran again, as the removed row asks');
ok(defined $valkey->wait_for_key(IdemValkey::tenant_key($node, 1, 'er', 'd1'), 10),
	'... its new result is copied under the new epoch');
is($s->run('d1'), 'replayed valkey', '... and the runner, having learnt the new epoch, replays it from Valkey');
$s->finish;

# --- 2. a restore from a base backup, behind pgbouncer ---
SKIP:
{
	my $bin = '/usr/sbin/pgbouncer';
	skip 'pgbouncer is not installed', 8 unless -x $bin;
	my $dir = PostgreSQL::Test::Utils::tempdir;
	my $bport = PostgreSQL::Test::Cluster::get_free_port();
	my $user = getpwuid($<);
	open(my $f, '>', "$dir/userlist.txt") or die;
	print $f qq{"$user" ""\n};
	close $f;
	open($f, '>', "$dir/pgbouncer.ini") or die;
	print $f "[databases]\n* = host=" . $node->host . " port=" . $node->port . "\n"
	  . "[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = $bport\nunix_socket_dir =\n"
	  . "auth_type = trust\nauth_file = $dir/userlist.txt\npool_mode = transaction\n"
	  . "default_pool_size = 4\nmax_client_conn = 20\n"
	  . "ignore_startup_parameters = extra_float_digits\n"
	  . "logfile = $dir/pgbouncer.log\npidfile = $dir/pgbouncer.pid\n";
	close $f;
	system($bin, '-d', "$dir/pgbouncer.ini") == 0 or die "pgbouncer did not start";
	my $stop_bouncer = sub {
		if (open(my $p, '<', "$dir/pgbouncer.pid")) { my $pid = <$p>; kill 'TERM', $pid if $pid; }
	};
	my $ok = eval {
		$node->backup('before_r1');
		my $b = IdemValkey::runner_session("host=127.0.0.1 port=$bport dbname=postgres",
			'postgres', $valkey, 1, 'er', '{"x": 1}');
		applied_and_cached($b, $node, 'r1', 'through pgbouncer');
		my $old = IdemValkey::keyspace($node);

		# The server is replaced by its backup, taken before r1: same port,
		# the pooler and the runner's connection to it stay.
		IdemValkey::restore_backup($node, 'before_r1');
		my $new = new_keyspace($node, $old);
		isnt($new, $old, 'restored: a new epoch');
		like($valkey->command('GET', owner_key_of($old)), qr/^retired /,
			'restored: the epoch the backup was taken in is retired');
		is($b->run('r1'), 'applied handler',
			'restored: the runner connected through the pooler before applies r1 (not in the restored database), not replays it');
		is($node->safe_psql('postgres', q{SELECT count(*) FROM effects WHERE id = 'r1'}), '1',
			'... and the restored database has its effect once');
		$b->{h}->kill_kill;
		1;
	};
	$stop_bouncer->();
	die $@ unless $ok;
}

# --- 3. a server started from a backup of a running one ---
my $ks_a = IdemValkey::keyspace($node);
$node->backup('running');
my $clone = PostgreSQL::Test::Cluster->new('clone');
$clone->init_from_backup($node, 'running');
$clone->start;
my $ks_c = new_keyspace($clone, $ks_a);
isnt($ks_c, $ks_a, 'the clone makes an epoch of its own');
like($valkey->command('GET', owner_key_of($ks_a)), qr/^retired /,
	"the clone retires the epoch its backup was taken in (the running server's)");
my $ks_b = new_keyspace($node, $ks_a);
isnt($ks_b, $ks_a, 'the running server then makes a new epoch of its own');
isnt($ks_b, $ks_c, '... not the clone\'s');
like(slurp_file($node->logfile), qr/history epoch [0-9a-f]{16} is no longer this server's in Valkey/,
	'... and says why');
is($valkey->command('GET', owner_key_of($ks_c)) =~ /^[0-9a-f]{16}\z/ ? 1 : 0, 1,
	"... and leaves the clone's owner key alone");
my ($status, $source) = IdemValkey::run_message($node, 'postgres', $valkey, 1, 'er', 'c1', '{"x": 1}');
is("$status $source", 'applied handler', 'the running server applies c1');
ok(defined $valkey->wait_for_key(IdemValkey::tenant_key($node, 1, 'er', 'c1'), 10), '... and copies it');
($status, $source) = IdemValkey::run_message($clone, 'postgres', $valkey, 1, 'er', 'c1', '{"x": 1}');
is("$status $source", 'applied handler', 'the clone applies c1 too, not replays the other server\'s result');
($status, $source) = IdemValkey::run_message($node, 'postgres', $valkey, 1, 'er', 'c1', '{"x": 1}');
is("$status $source", 'replayed valkey', 'the running server keeps a working cache');
IdemValkey::check_counters($node);
IdemValkey::check_counters($clone);
$clone->stop;

unlike(slurp_file($node->logfile), qr/PANIC|TRAP/, 'no crash in the server log');
done_testing();
