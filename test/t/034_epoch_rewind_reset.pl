# Three more ways a server's history goes back without the secret file
# saying so; in each a runner that learnt the epoch before the event (and
# re-learns only once an hour, secrets_max_age_ms) must be stopped by the
# server's own doing, not by its timer:
#   1. pg_resetwal after a crash: pg_control says "shut down", but not at
#      the clean stop idem recorded, so the start makes a new epoch;
#   2. a Valkey restored from a snapshot (RDB) taken before the server
#      retired an epoch: the worker retires it again;
#   3. pg_rewind of an old primary that went on after its standby (no slot)
#      was promoted and committed a message there: pg_rewind replaces its
#      secret file with the new primary's, yet the epoch it used on its
#      abandoned timeline is retired, while it serves as a standby and
#      after it is promoted.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use File::Copy qw(copy);
use IdemValkey;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

$ENV{IDEM_SECRETS_MAX_AGE_MS} = 3_600_000;

my $valkey = IdemValkey->new(name => 'valkey')->start;
my $node = IdemValkey::streaming_node('node', $valkey, wal_log_hints => 'on');

sub owner_key_of { IdemValkey::owner_key_of(@_) }
sub new_keyspace { IdemValkey::new_keyspace(@_) }
sub effects
{
	my ($n, $id) = @_;
	return $n->safe_psql('postgres', "SELECT count(*) FROM effects WHERE id = '$id'");
}
sub applied_and_cached
{
	my ($s, $n, $id, $what) = @_;
	IdemValkey::applied_and_cached($s, $n, $valkey, 'rw', $id, $what);
}

# Wait until $key holds a retired marker; true if it does.
sub retired
{
	my ($key) = @_;
	return IdemValkey::poll_until(15, sub { ($valkey->command('GET', $key) // '') =~ /^retired / });
}

# --- 1. pg_resetwal after a crash ---
{
	my $s = IdemValkey::runner_session($node, 'postgres', $valkey, 1, 'rw', '{"x": 1}');
	$node->restart;
	my $ks = IdemValkey::keyspace($node);
	like(slurp_file($node->data_dir . '/idem_cache_secret'), qr/^stop [0-9]+ [0-9a-f]{16}$/m,
		'resetwal: the secret file records the last clean stop');
	$node->safe_psql('postgres', 'CHECKPOINT');
	applied_and_cached($s, $node, 'w1', 'resetwal, before the crash');
	my ($status, $source) = IdemValkey::run_message($node, 'postgres', $valkey, 1, 'rw', 'w2', '{"x": 1}');
	is("$status $source", 'applied handler', 'resetwal, before the crash: w2 is applied');
	ok(defined $valkey->wait_for_key(IdemValkey::tenant_key($node, 1, 'rw', 'w2'), 10),
		'resetwal, before the crash: ... its result copied to Valkey');
	$node->stop('immediate');
	command_ok([ 'pg_resetwal', '-f', $node->data_dir ], 'resetwal: pg_resetwal -f after the crash');
	# A first start fails (its socket's lock file is held): that postmaster
	# must not record the reset pg_control as a clean stop of its own.
	my $lock = $node->host . '/.s.PGSQL.' . $node->port . '.lock';
	open(my $lf, '>', $lock) or die "$lock: $!";
	print $lf "$valkey->{pid}\n";	# a live process, not the server's ancestor
	close $lf;
	ok(!$node->start(fail_ok => 1), 'resetwal: a start that fails (the socket is taken)');
	unlink($lock) or die "$lock: $!";
	$node->start;
	is(effects($node, 'w1') . effects($node, 'w2'), '00', 'resetwal: w1 and w2 are lost with the WAL');
	# pg_resetwal hands out again the transaction ids of the lost commits,
	# whose rows may have reached the disk: burn them as aborted, so that
	# no later commit brings a lost row back (PostgreSQL's own hazard).
	$node->safe_psql('postgres',
		'DO $$ BEGIN FOR i IN 1..200 LOOP PERFORM txid_current(); ROLLBACK; END LOOP; END $$');
	my $ks2 = new_keyspace($node, $ks);
	isnt($ks2, $ks, 'resetwal: the start makes a new epoch');
	like(slurp_file($node->logfile), qr/not at the last clean stop idem recorded/,
		'resetwal: ... and says why');
	like($valkey->command('GET', owner_key_of($ks)), qr/^retired /, 'resetwal: the old epoch is retired');
	($status, $source) = IdemValkey::run_message($node, 'postgres', $valkey, 1, 'rw', 'w2', '{"x": 1}');
	is("$status $source", 'applied handler',
		'resetwal: a new runner applies w2 again, not replays the lost result');
	is($s->run('w1'), 'applied handler',
		'resetwal: the runner connected before applies w1 again, not replays the lost result');
	$s->{h}->kill_kill;
	$node->restart;
	is(IdemValkey::keyspace($node), $ks2, 'a clean restart still keeps the epoch');
}

# --- 2. Valkey restored from a snapshot taken before the retirement ---
{
	$node->backup('before_v1');
	my $s = IdemValkey::runner_session($node, 'postgres', $valkey, 1, 'rw', '{"x": 1}');
	applied_and_cached($s, $node, 'v1', 'RDB, on the original');
	my $ks = IdemValkey::keyspace($node);
	$valkey->command('SAVE');
	copy($valkey->dir . '/dump.rdb', $valkey->dir . '/after_v1.rdb') or die "copy: $!";
	unlink($valkey->dir . '/dump.rdb');

	# The server is replaced by its backup, taken before v1; it retires the
	# epoch v1 was copied under.  Then Valkey comes back from the snapshot.
	IdemValkey::restore_backup($node, 'before_v1');
	my $ks2 = new_keyspace($node, $ks);
	ok(retired(owner_key_of($ks)), 'RDB: the restored server retires the old epoch');
	$valkey->stop;
	copy($valkey->dir . '/after_v1.rdb', $valkey->dir . '/dump.rdb') or die "copy: $!";
	$valkey->start;
	ok(retired(owner_key_of($ks)),
		'RDB: the old epoch, back with its live token from the snapshot, is retired again');
	is($s->run('v1'), 'applied handler',
		'RDB: the runner connected before applies v1 (not in the restored database), not replays it');
	is(effects($node, 'v1'), '1', 'RDB: ... once');
	$s->{h}->kill_kill;
}

unlike(slurp_file($node->logfile), qr/PANIC|TRAP/, 'no crash in the server log');
$node->stop;

# --- 3. pg_rewind of an old primary that went on after a failover ---
$node = IdemValkey::streaming_node('old', $valkey, wal_log_hints => 'on',
	wal_keep_size => "'256MB'");
{
	my $standby = IdemValkey::standby_of($node, 'standby', 'for_standby');
	$node->wait_for_catchup($standby);
	my $ks = IdemValkey::keyspace($node);

	# The standby is promoted while the old primary runs on.
	ok(IdemValkey::promote_and_wait($standby), 'rewind: the standby is promoted');
	$standby->safe_psql('postgres', 'CHECKPOINT');
	my $ks_new = IdemValkey::keyspace($standby);
	my $ks_old = new_keyspace($node, $ks);
	isnt($ks_old, $ks, 'rewind: the old primary, its epoch retired, makes a new one');
	my $s = IdemValkey::runner_session($node, 'postgres', $valkey, 1, 'rw', '{"x": 1}');
	applied_and_cached($s, $node, 'm1', 'rewind, the old primary on its diverged timeline');

	# The old primary is rewound and follows the new one.
	$node->stop;
	# pg_rewind copies the source's configuration, its port included: keep ours
	copy($node->data_dir . '/postgresql.conf', $node->basedir . '/postgresql.conf.keep') or die;
	command_ok([ 'pg_rewind', '--target-pgdata=' . $node->data_dir,
			'--source-server=' . $standby->connstr('postgres') ],
		'rewind: pg_rewind of the old primary');
	my ($file_epoch) = slurp_file($node->data_dir . '/idem_cache_secret') =~ /^epoch ([0-9a-f]{16})$/m;
	my ($new_epoch) = $ks_new =~ /\.([0-9a-f]{16})\.[0-9]+:\z/;
	is($file_epoch, $new_epoch, "rewind: pg_rewind replaced its secret file with the new primary's");
	copy($node->basedir . '/postgresql.conf.keep', $node->data_dir . '/postgresql.conf') or die;
	$node->enable_streaming($standby);
	$node->start;
	ok(retired(owner_key_of($ks_old)),
		'rewind: the rewound standby retires the epoch it used on its abandoned timeline');
	isnt($s->run('m1'), 'replayed valkey',
		'rewind: the runner connected before does not replay m1 from the rewound standby\'s old epoch');

	# Later it is promoted in turn.
	$standby->stop;
	ok(IdemValkey::promote_and_wait($node), 'rewind: the rewound server is promoted');
	new_keyspace($node, $ks_old);
	is(effects($node, 'm1'), '0', 'rewind: it lacks m1');
	is($s->run('m1'), 'applied handler',
		'rewind: promoted, the runner connected before applies m1, not replays it');
	$s->{h}->kill_kill;
}

unlike(slurp_file($node->logfile), qr/PANIC|TRAP/, 'no crash in the server log');
$node->stop;
done_testing();
