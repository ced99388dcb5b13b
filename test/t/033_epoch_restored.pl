# A server replaced by a restore of its own backup retires the epoch Valkey
# vouches for now, not only the one its copy of the secret file names (the
# epoch at backup time).  In each case the original's epoch changed after
# the backup, and a runner that learnt the newest epoch before the restore
# (and re-learns only once an hour, secrets_max_age_ms) must be stopped by
# the restored server's own takeover, not by its timer:
#   1. the original deleted a ledger row after the backup (a new epoch);
#   2. the original crashed after the backup (a new epoch at its restart);
#   3. the backup was taken while the original's newest epoch was not yet
#      taken over in Valkey (Valkey down during a DELETE), restored to a
#      point in time (recovery_target = 'immediate', promoted).
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
sub new_keyspace { IdemValkey::new_keyspace($node, $_[0]) }
sub applied_and_cached
{
	my ($s, $id, $what) = @_;
	IdemValkey::applied_and_cached($s, $node, $valkey, 'rs', $id, $what);
}

# Replace the server by its backup $name (same port), with more settings.
sub restore { IdemValkey::restore_backup($node, @_) }

# The original's epoch changes after the backup ($change), a runner learns
# the new epoch and caches $id, then the backup replaces the server.
sub restore_after
{
	my ($what, $id, $change) = @_;
	$node->backup("before_$id");
	my $ks0 = IdemValkey::keyspace($node);
	$change->();
	my $ks1 = new_keyspace($ks0);
	isnt($ks1, $ks0, "$what: the original's epoch changed after the backup");
	my $s = IdemValkey::runner_session($node, 'postgres', $valkey, 1, 'rs', '{"x": 1}');
	applied_and_cached($s, $id, "$what, on the original");
	restore("before_$id");
	my $ks2 = new_keyspace($ks1);
	isnt($ks2, $ks1, "$what: the restored server makes a new epoch");
	like($valkey->command('GET', owner_key_of($ks1)), qr/^retired /,
		"$what: it retires the original's newest epoch, which its secret file does not name");
	is($s->run($id), 'applied handler',
		"$what: the runner connected before applies $id (not in the restored database), not replays it");
	is(sql("SELECT count(*) FROM effects WHERE id = '$id'"), '1', "$what: ... once");
	$s->{h}->kill_kill;
}

# --- 1. a DELETE on the original after the backup ---
restore_after('DELETE after the backup', 'd1', sub {
	sql(IdemValkey::complete_sql('other', 'x'));
	sql(q{DELETE FROM idempotency_keys WHERE idempotency_key = idem_key('other', 'x')});
});

# --- 2. a crash of the original after the backup ---
restore_after('a crash after the backup', 'c1', sub {
	$node->stop('immediate');
	$node->start;
});

# --- 3. point-in-time recovery from a backup taken while the newest epoch
# was not yet taken over in Valkey ---
{
	my $ks0 = IdemValkey::keyspace($node);
	$valkey->stop;
	sql(IdemValkey::complete_sql('other', 'y'));
	sql(q{DELETE FROM idempotency_keys WHERE idempotency_key = idem_key('other', 'y')});
	# A reader makes the new epoch's secrets (the worker cannot reach Valkey).
	my ($ret, $out, $err) = $node->psql('postgres', 'SELECT idem_cache_keyspace()');
	like($err, qr/55000|not .*taken/i, 'PITR: no keyspace while the new epoch is not taken over');
	sql('SELECT count(*) FROM idem_cache_secrets()');
	unlike(slurp_file($node->data_dir . '/idem_cache_secret'), qr/^token /m,
		'PITR: the secret file names the new epoch, not yet taken over');
	$node->backup('pitr');
	$valkey->start;
	my $ks1 = new_keyspace($ks0);
	isnt($ks1, $ks0, 'PITR: the original takes its new epoch over once Valkey is back');
	my $s = IdemValkey::runner_session($node, 'postgres', $valkey, 1, 'rs', '{"x": 1}');
	applied_and_cached($s, 'p1', 'PITR, on the original');
	restore('pitr', "restore_command = 'false'\nrecovery_target = 'immediate'\n"
		  . "recovery_target_action = 'promote'\n", 1);
	ok(IdemValkey::poll_until(30,
			sub { $node->safe_psql('postgres', 'SELECT NOT pg_is_in_recovery()') eq 't' }),
		'PITR: the restored server is promoted');
	my $ks2 = new_keyspace($ks1);
	like($ks2, qr/\.2\.[0-9a-f]{16}\.[0-9]+:\z/, 'PITR: a new timeline, a new epoch');
	like($valkey->command('GET', owner_key_of($ks1)), qr/^retired /,
		'PITR: the epoch its backup named but had not taken over is retired too');
	is($s->run('p1'), 'applied handler',
		'PITR: the runner connected before applies p1, not replays it');
	$s->{h}->kill_kill;
}

unlike(slurp_file($node->logfile), qr/PANIC|TRAP/, 'no crash in the server log');
$node->stop;
done_testing();
