# Nothing crosses a history epoch: a copy of a result read before ledger
# rows were removed is never written into the epoch that follows the
# removal, and a removal's commit returns only once runners connected
# before it no longer trust the old epoch.
#   1. a copy queued while Valkey is down, the row deleted meanwhile (and
#      the commit's wait for the old epoch's retirement timing out);
#   2. copies held for a stopped standby (idem.standby_slots = '*'), the
#      ledger truncated meanwhile, or an older dump restored with
#      pg_restore --clean;
#   3. a REPEATABLE READ transaction whose snapshot predates a DELETE
#      reads the deleted row with idem_lookup(), and so does a READ
#      COMMITTED one between a DELETE's PREPARE TRANSACTION and its
#      COMMIT PREPARED;
#   4. a runner connected before a DELETE, which re-learns its keyspace
#      only once an hour, while the worker is slow: the DELETE returns
#      once the worker has retired the old epoch, and the runner applies
#      the message again at once.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use IdemValkey;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use POSIX ();
use Time::HiRes qw(time);

$ENV{IDEM_SECRETS_MAX_AGE_MS} = 3_600_000;

my $valkey = IdemValkey->new(name => 'valkey')->start;
my $node = IdemValkey::streaming_node('node', $valkey, max_prepared_transactions => 4);

sub sql { $node->safe_psql('postgres', $_[0]) }
sub run { IdemValkey::run_message($node, 'postgres', $valkey, 1, 'es', $_[0], '{"x": 1}') }
sub effects { sql("SELECT count(*) FROM effects WHERE id = '$_[0]'") }
sub key_of { IdemValkey::tenant_key($node, 1, 'es', $_[0]) }

# The keyspace once the worker took an epoch other than $old over.
sub new_keyspace
{
	my ($old) = @_;
	my $ks;
	IdemValkey::poll_until(30, sub {
		$ks = IdemValkey::wait_keyspace($node, undef, 30);
		return defined $ks && $ks ne $old;
	});
	return $ks;
}

# The queue is empty (the worker copied or dropped everything).
sub drained
{
	return IdemValkey::poll_until(20, sub { IdemValkey::stats_col($node, 'queue_depth') eq '0' });
}

# $id applied, and its copy held in the commit ring (the worker cannot
# copy it now).
sub applied_and_held
{
	my ($id, $what) = @_;
	my ($status, $source) = run($id);
	is("$status $source", 'applied handler', "$what: $id is applied");
	ok(IdemValkey::poll_until(10, sub { IdemValkey::stats_col($node, 'queue_depth') ne '0' }),
		"$what: ... its copy waits in the commit ring");
}

# After the worker went on: nothing of $id in the new epoch, and a
# redelivery applied again.
sub not_replayed
{
	my ($id, $what, $old, $effects) = @_;
	my $ks = new_keyspace($old);
	isnt($ks, $old, "$what: a new epoch");
	ok(drained(), "$what: the worker went through the commit ring");
	is($valkey->command('GET', key_of($id)), undef,
		"$what: the copy read before the removal is not written into the new epoch");
	my ($status, $source) = run($id);
	is("$status $source", 'applied handler', "$what: $id is applied again, not replayed");
	is(effects($id), $effects // '2', "$what: ... its effect ran again, as the removed row asks");
}

# --- 1. a copy queued while Valkey is down, the row deleted ---
my $ks = IdemValkey::keyspace($node);
$valkey->stop;
ok(IdemValkey::wait_connected($node, 0), 'Valkey down: the worker notices');
applied_and_held('v1', 'Valkey down');
my ($ret, $out, $err) = $node->psql('postgres',
	q{SET idem.epoch_retire_timeout = '300ms';
	  DELETE FROM idempotency_keys WHERE idempotency_key = idem_key('es', 'v1')},
	on_error_stop => 0);
is($ret, 0, 'Valkey down: the DELETE commits');
like($err, qr/WARNING:  the idem worker did not retire the replaced history epoch in Valkey within 300 ms/,
	'... and warns that its wait for the old epoch\'s retirement timed out');

# A cancel ends a long wait at once; the DELETE stays committed.
my $bg = $node->background_psql('postgres', on_error_stop => 0);
$bg->query_safe(q{SET idem.epoch_retire_timeout = '1h'});
my $bpid = $bg->query_safe('SELECT pg_backend_pid()');
$bg->query_until(qr/deleting/, q{\echo deleting
	DELETE FROM idempotency_keys WHERE idempotency_key = idem_key('es', 'none');
	\echo deleted
});
ok($node->poll_query_until('postgres',
		"SELECT wait_event_type = 'Extension' FROM pg_stat_activity WHERE pid = $bpid"),
	'Valkey down: a DELETE waits for the old epoch\'s retirement');
$node->safe_psql('postgres', "SELECT pg_cancel_backend($bpid)");
my $t_cancel = time();
$bg->{run}->pump until $bg->{stdout} =~ /deleted/ || time() - $t_cancel > 20;
like($bg->{stdout}, qr/deleted/, '... a cancel ends the wait');
like($bg->{stderr}, qr/WARNING:  canceling the wait for the history epoch's retirement/,
	'... with a WARNING, not an error: the DELETE is committed');
$bg->{stdout} = '';
$bg->{stderr} = '';
is($bg->query_safe('SELECT 1'), '1', '... and the session goes on');
$bg->quit;

# So does a termination, which then ends the session.
$bg = $node->background_psql('postgres', on_error_stop => 0);
$bg->query_safe(q{SET idem.epoch_retire_timeout = '1h'});
$bpid = $bg->query_safe('SELECT pg_backend_pid()');
$bg->query_until(qr/deleting/, q{\echo deleting
	DELETE FROM idempotency_keys WHERE idempotency_key = idem_key('es', 'none');
});
ok($node->poll_query_until('postgres',
		"SELECT wait_event_type = 'Extension' FROM pg_stat_activity WHERE pid = $bpid"),
	'Valkey down: another DELETE waits');
$node->safe_psql('postgres', "SELECT pg_terminate_backend($bpid)");
ok($node->poll_query_until('postgres',
		"SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = $bpid"),
	'... a termination ends the wait and the session');
$bg->{run}->kill_kill;
like(slurp_file($node->logfile), qr/\[$bpid\] .*WARNING:  canceling the wait for the history epoch's retirement/,
	'... with a WARNING');
$valkey->start;
not_replayed('v1', 'Valkey down', $ks);
like(slurp_file($node->logfile),
	qr/LOG:  1 results were not copied to Valkey: they were read or committed under an older history epoch/,
	'Valkey down: the log says a queued copy was dropped');
is(IdemValkey::stats_col($node, 'skipped_epoch'), '1', '... and idem_stats().skipped_epoch counts it');

# --- 2. copies held for a stopped standby, the ledger truncated ---
$node->safe_psql('postgres', "SELECT pg_create_physical_replication_slot('standby1')");
my $standby = IdemValkey::standby_of($node, 'standby', 'b1',
	"primary_slot_name = 'standby1'\nidem.valkey_port = 1\n");
$node->wait_for_catchup($standby);
$standby->stop;
$ks = IdemValkey::keyspace($node);
applied_and_held('s1', 'standby stopped');
sql('TRUNCATE idempotency_keys');
$standby->start;
not_replayed('s1', 'standby stopped', $ks);

# ... and pg_restore --clean of a dump taken before the copy was made
my $dump = $node->basedir . '/before_p1.dump';
$node->command_ok([ 'pg_dump', '-Fc', '-f', $dump, '-d', $node->connstr('postgres') ],
	'pg_dump of the database');
$node->wait_for_catchup($standby);
$standby->stop;
$ks = IdemValkey::keyspace($node);
applied_and_held('p1', 'standby stopped, pg_restore --clean');
$node->command_ok([ 'pg_restore', '--clean', '-d', $node->connstr('postgres'), $dump ],
	'pg_restore --clean of the older dump');
is(effects('p1'), '0', 'pg_restore --clean: the restore took the effect of p1 back');
$standby->start;
not_replayed('p1', 'pg_restore --clean', $ks, '1');
$standby->stop;
$node->safe_psql('postgres', "SELECT pg_drop_replication_slot('standby1')");

# --- 3. a REPEATABLE READ snapshot older than the DELETE ---
my ($status, $source) = run('r1');
is("$status $source", 'applied handler', 'repeatable read: r1 is applied');
ok(defined $valkey->wait_for_key(key_of('r1'), 10), '... and copied');
$ks = IdemValkey::keyspace($node);
my $rr = $node->background_psql('postgres');
$rr->query_safe('BEGIN ISOLATION LEVEL REPEATABLE READ');
$rr->query_safe('SELECT count(*) FROM idempotency_keys');
sql(q{DELETE FROM idempotency_keys WHERE idempotency_key = idem_key('es', 'r1')});
my $ks2 = new_keyspace($ks);
isnt($ks2, $ks, 'repeatable read: the DELETE made a new epoch');
is($rr->query_safe(q{SELECT status FROM idem_lookup(1, idem_key('es', 'r1'))}), 'completed',
	'repeatable read: the older snapshot still reads the deleted row');
$rr->query_safe('COMMIT');
$rr->quit;
ok(drained(), 'repeatable read: the worker went through the commit ring');
is($valkey->command('GET', key_of('r1')), undef,
	'repeatable read: the read does not repopulate the new epoch with the deleted row');
($status, $source) = run('r1');
is("$status $source", 'applied handler', 'repeatable read: r1 is applied again, not replayed');

# A REPEATABLE READ transaction that began after the DELETE repopulates.
($status, $source) = run('r2');
is("$status $source", 'applied handler', 'r2 is applied');
$valkey->command('DEL', key_of('r2')) if defined $valkey->wait_for_key(key_of('r2'), 10);
sql(q{BEGIN ISOLATION LEVEL REPEATABLE READ;
	SELECT status FROM idem_lookup(1, idem_key('es', 'r2')); COMMIT});
ok(defined $valkey->wait_for_key(key_of('r2'), 10),
	'a repeatable read transaction newer than every removal repopulates Valkey');

# --- a DELETE prepared (two-phase), read before COMMIT PREPARED ---
($status, $source) = run('t1');
is("$status $source", 'applied handler', 'prepared DELETE: t1 is applied');
ok(defined $valkey->wait_for_key(key_of('t1'), 10), '... and copied');
$ks = IdemValkey::keyspace($node);
sql(q{BEGIN; DELETE FROM idempotency_keys WHERE idempotency_key = idem_key('es', 't1');
	PREPARE TRANSACTION 'del_t1'});
$ks2 = new_keyspace($ks);
isnt($ks2, $ks, 'prepared DELETE: PREPARE TRANSACTION made a new epoch');
is(sql(q{SELECT status FROM idem_lookup(1, idem_key('es', 't1'))}), 'completed',
	'prepared DELETE: a read before COMMIT PREPARED still finds the row');
ok(drained(), 'prepared DELETE: the worker went through the commit ring');
is($valkey->command('GET', key_of('t1')), undef,
	'prepared DELETE: that read does not repopulate the new epoch');
sql(q{COMMIT PREPARED 'del_t1'});
($status, $source) = run('t1');
is("$status $source", 'applied handler', 'prepared DELETE: once committed, t1 is applied again, not replayed');
($status, $source) = run('t2');
$valkey->command('DEL', key_of('t2')) if defined $valkey->wait_for_key(key_of('t2'), 10);
sql(q{SELECT status FROM idem_lookup(1, idem_key('es', 't2'))});
ok(defined $valkey->wait_for_key(key_of('t2'), 10),
	'prepared DELETE: once it is committed, reads repopulate Valkey again');

# --- 4. a runner connected before the DELETE, the worker slow ---
my $s = IdemValkey::runner_session($node, 'postgres', $valkey, 1, 'es', '{"x": 1}');
is($s->run('w1'), 'applied handler', 'slow worker: w1 is applied');
ok(defined $valkey->wait_for_key(key_of('w1'), 10), '... and copied');
is($s->run('w1'), 'replayed valkey', '... and replayed from Valkey by the same runner');
my $wpid = IdemValkey::worker_pid($node);
ok($wpid, 'slow worker: the worker is found');
kill 'STOP', $wpid;
my $child = fork();
die "fork: $!" unless defined $child;
if ($child == 0)
{
	sleep(2);
	kill 'CONT', $wpid;
	POSIX::_exit(0);
}
my $t0 = time();
sql(q{DELETE FROM idempotency_keys WHERE idempotency_key = idem_key('es', 'w1')});
my $took = time() - $t0;
# at once, before the worker is sure to have gone on
my $again = $s->run('w1');
waitpid($child, 0);
kill 'CONT', $wpid;
cmp_ok($took, '>=', 1.5, 'slow worker: the DELETE returns only once the worker went on and retired the old epoch');
is($again, 'applied handler',
	'slow worker: the runner connected before the DELETE applies w1 again at once, not replays it');
is(effects('w1'), '2', '... its effect ran again');
$s->finish;

unlike(slurp_file($node->logfile), qr/PANIC|TRAP/, 'no crash in the server log');
$node->stop;
done_testing();
