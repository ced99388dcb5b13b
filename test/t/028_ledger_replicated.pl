# Rows that logical replication removes from, or changes in, a subscriber's
# ledger (a DELETE, an UPDATE, a TRUNCATE made on the publisher) are no
# longer answered from the subscriber's Valkey cache: the apply worker
# writes rows below the executor, so idem sees the transaction's lock on
# the ledger instead, and the subscriber starts a new history epoch when the
# applied transaction commits (or is prepared, for a two-phase
# subscription).  A runner that stays connected to the subscriber (and
# would not learn the keyspace again for an hour) replays the row from
# Valkey before, and runs the message again after.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use IdemValkey;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

# The connected runner must be stopped by the subscriber's retirement of
# its old epoch, not by re-learning the keyspace on a timer.
$ENV{IDEM_SECRETS_MAX_AGE_MS} = 3_600_000;

my $valkey = IdemValkey->new(name => 'valkey')->start;
my $pub = IdemValkey::streaming_node('pub', $valkey, wal_level => 'logical',
	max_prepared_transactions => 4, logical_decoding_work_mem => "'64kB'");
my $sub = IdemValkey::streaming_node('sub', $valkey, max_prepared_transactions => 4);
# Large transactions are streamed before they commit (past the publisher's
# 64kB of logical_decoding_work_mem): from 16 on, a parallel apply worker
# applies them and commits them itself.
my $streaming = $sub->safe_psql('postgres', 'SHOW server_version_num') >= 160000 ? 'parallel' : 'on';

# The subscriber's own ledger rows take ids far from the publisher's.
$sub->safe_psql('postgres', q{SELECT setval(pg_get_serial_sequence('idempotency_keys', 'id'), 1000000)});
$pub->safe_psql('postgres', 'CREATE PUBLICATION ledger FOR TABLE idempotency_keys');
$sub->safe_psql('postgres',
	"CREATE SUBSCRIPTION ledger CONNECTION 'host=" . $pub->host . ' port=' . $pub->port
	  . " dbname=postgres' PUBLICATION ledger WITH (two_phase = true, streaming = $streaming)");
$sub->poll_query_until('postgres',
	q{SELECT count(*) = 0 FROM pg_subscription_rel WHERE srsubstate NOT IN ('r', 's')})
  or die 'the subscription did not synchronise';
# (two-phase transactions are applied as such once the tables are ready)
$sub->poll_query_until('postgres', q{SELECT subtwophasestate = 'e' FROM pg_subscription})
  or die 'the subscription did not enable two-phase';

sub on_pub { $pub->safe_psql('postgres', $_[0]) }
sub on_sub { $sub->safe_psql('postgres', $_[0]) }
sub run_on { IdemValkey::run_message($_[0], 'postgres', $valkey, 1, 'rp', $_[1], '{"x": 1}') }

my $runner = IdemValkey::runner_session($sub, 'postgres', $valkey, 1, 'rp', '{"x": 1}');

# $id applied on the publisher, replicated, and answered on the subscriber
# from its Valkey cache (a lookup there copies the replicated result).
sub replicated_and_cached
{
	my ($id) = @_;
	my ($status, $source) = run_on($pub, $id);
	is("$status $source", 'applied handler', "$id is applied on the publisher");
	$pub->wait_for_catchup('ledger');
	is(on_sub(qq{SELECT status FROM idempotency_keys WHERE idempotency_key = idem_key('rp', '$id')}),
		'completed', '... and its row replicated to the subscriber');
	my $ks = IdemValkey::keyspace($sub);
	on_sub(qq{SELECT idem_lookup(1, idem_key('rp', '$id'))});
	ok(defined $valkey->wait_for_key(IdemValkey::tenant_key($sub, 1, 'rp', $id), 10),
		'... a lookup on the subscriber copies it to Valkey');
	# (its first lookup may find its keyspace gone: the replicated insert
	# started a new epoch, which the runner then learns)
	my $answer;
	for (1 .. 3)
	{
		$answer = $runner->run($id);
		last if $answer eq 'replayed valkey';
	}
	is($answer, 'replayed valkey', '... and the connected runner replays it from Valkey');
	return $ks;
}

# After $what, applied on the subscriber, left $id's row removed or
# changed: a new epoch there, and $id runs again on the subscriber.
sub applied_again
{
	my ($id, $what, $ks_before) = @_;
	$pub->wait_for_catchup('ledger');
	my $ks = IdemValkey::keyspace($sub);
	isnt($ks, $ks_before, "$what applied by the subscription: a new history epoch on the subscriber");
	is($runner->run($id), 'applied handler',
		"$what: the connected runner runs $id again, not replayed from Valkey");
	like(slurp_file($sub->logfile), qr/Logical replication applied a transaction that wrote a ledger/,
		"$what: the subscriber's log says why the epoch changed");
}

my $ks = replicated_and_cached('d1');
on_pub(q{DELETE FROM idempotency_keys WHERE idempotency_key = idem_key('rp', 'd1')});
applied_again('d1', 'DELETE', $ks);

$ks = replicated_and_cached('u1');
on_pub(q{UPDATE idempotency_keys SET status = 'failed_retryable'
	WHERE idempotency_key = idem_key('rp', 'u1')});
applied_again('u1', 'UPDATE', $ks);

$ks = replicated_and_cached('t1');
on_pub('TRUNCATE idempotency_keys');
applied_again('t1', 'TRUNCATE', $ks);

# The apply worker does not wait for the retirement at its commits: with
# the subscriber's Valkey paused (no retirement can happen), a replicated
# DELETE is applied at once, not after idem.epoch_retire_timeout (5 s), and
# still renews the epoch.
$ks = replicated_and_cached('w1');
$valkey->pause;
my $t0 = time;
# (the publisher's own commit does not wait either: that is not measured)
on_pub(q{SET idem.epoch_retire_timeout = 0;
	DELETE FROM idempotency_keys WHERE idempotency_key = idem_key('rp', 'w1')});
$pub->wait_for_catchup('ledger');
my $took = time - $t0;
$valkey->resume;
cmp_ok($took, '<', 4, "a replicated DELETE is applied without waiting for the retirement (took ${took} s)");
applied_again('w1', 'DELETE applied while Valkey was paused', $ks);

# A prepared transaction is applied as one on the subscriber (two_phase):
# the epoch is renewed at its PREPARE, as the commit comes later, apart.
$ks = replicated_and_cached('p1');
on_pub(q{BEGIN; DELETE FROM idempotency_keys WHERE idempotency_key = idem_key('rp', 'p1');
	PREPARE TRANSACTION 'delete_p1'});
$pub->wait_for_catchup('ledger');
is(on_sub('SELECT count(*) FROM pg_prepared_xacts'), '1', 'the subscriber applied the PREPARE');
on_pub(q{COMMIT PREPARED 'delete_p1'});
applied_again('p1', 'DELETE in a prepared transaction', $ks);

# A large DELETE, streamed while it runs (and, from 16 on, applied by a
# parallel apply worker).
on_pub(q{INSERT INTO idempotency_keys (tenant_id, idempotency_key, request_fingerprint, status, expires_at)
	SELECT 1, idem_key('bulk', i::text), idem_fingerprint('{}'), 'completed', now() + interval '1 hour'
	FROM generate_series(1, 5000) i});
$ks = replicated_and_cached('s1');
on_pub(q{DELETE FROM idempotency_keys WHERE tenant_id = 1 AND idempotency_key IN
	(SELECT idem_key('bulk', i::text) FROM generate_series(1, 5000) i UNION ALL SELECT idem_key('rp', 's1'))});
applied_again('s1', 'a large DELETE, streamed', $ks);
ok($pub->poll_query_until('postgres',
	q{SELECT stream_txns > 0 FROM pg_stat_replication_slots WHERE slot_name = 'ledger'}),
	'... which the publisher streamed');
# The subscriber's own claims are idem's own writes: they keep its epoch.
$ks = IdemValkey::keyspace($sub);
my ($status, $source) = run_on($sub, 'own');
is("$status $source", 'applied handler', 'a message applied on the subscriber itself');
is(IdemValkey::keyspace($sub), $ks, '... keeps its epoch');

$runner->finish;
$sub->stop;
# (a parallel apply worker logs nothing when it starts; its exit is logged,
# at the latest when the server stops)
like(slurp_file($sub->logfile), qr/background worker "logical replication parallel worker"/,
	'the large DELETE went to a parallel apply worker')
  if $streaming eq 'parallel';
$pub->stop;
done_testing();
