# The outbox (issue 40): a handler's messages (idem_emit) commit or vanish
# with its effect, keep their ids when the run runs again, and are
# published to their Valkey stream (XADD <stream> * id <id> body <json>)
# only once the commit is durable (a stopped synchronous standby holds
# them), at least once across Valkey outages, kill -9 of the publisher
# and of the server, and a dump restored elsewhere, in the promised order.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use IdemValkey;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(usleep);

my $valkey = IdemValkey->new(name => 'valkey')->start;
# restart_after_crash: a kill -9 of the publisher restarts the server, as in
# production (the TAP library turns it off).
my $primary = IdemValkey::streaming_node('primary', $valkey, 'idem.standby_slots' => "''",
	restart_after_crash => 'on', max_prepared_transactions => 2);
ok(IdemValkey::wait_connected($primary, 1), 'the worker connects');

# The stream's entries as [id field, body field], in stream order.
sub entries
{
	my ($stream) = @_;
	my $r = $valkey->command('XRANGE', $stream, '-', '+') // [];
	my @out;
	foreach my $e (@$r)
	{
		my ($sid, $fields) = @$e;
		push @out, [ @$fields ];
	}
	return \@out;
}

sub wait_len
{
	my ($stream, $n, $timeout) = @_;
	return IdemValkey::poll_until($timeout // 20,
		sub { ($valkey->command('XLEN', $stream) // 0) >= $n });
}

sub waiting { return IdemValkey::stats_col($primary, 'outbox_waiting'); }

sub key_hex
{
	my ($id) = @_;
	return $primary->safe_psql('postgres', "SELECT encode(idem_key('o', '$id'), 'hex')");
}

# One run: claim, emit each message, complete, in one transaction.
sub run_sql
{
	my ($id, $stream, @bodies) = @_;
	my $sql = "BEGIN; SELECT (idem_claim(1, idem_key('o', '$id'), idem_fingerprint('{}'))).decision;";
	$sql .= " SELECT idem_emit('$stream', '$_');" foreach @bodies;
	$sql .= " SELECT idem_complete(1, idem_key('o', '$id'), '{}'); COMMIT;";
	return $sql;
}

# --- commit, rollback, savepoint ---
$primary->safe_psql('postgres', run_sql('a', 'st.basic', '{"n": 1, "t": "a b: c"}', '{"n": 2}'));
ok(wait_len('st.basic', 2), 'committed messages are published');
my $ha = key_hex('a');
is_deeply(entries('st.basic'),
	[ [ 'id', "$ha-1", 'body', '{"n":1,"t":"a b: c"}' ], [ 'id', "$ha-2", 'body', '{"n":2}' ] ],
	'... as XADD stream * id <key hex>-<n> body <compact JSON>, in emit order');
ok(IdemValkey::poll_until(10, sub { waiting() eq '0' }), '... and deleted from the outbox');

my $rolled = run_sql('b', 'st.basic', '{"n": 3}');
$rolled =~ s/COMMIT;$/ROLLBACK;/;
$primary->safe_psql('postgres', $rolled);
$primary->safe_psql('postgres', q{
	BEGIN;
	SELECT idem_claim(1, idem_key('o', 'c'), idem_fingerprint('{}'));
	SAVEPOINT h;
	SELECT idem_emit('st.basic', '{"n": 4}');
	ROLLBACK TO h;
	SELECT idem_emit('st.basic', '{"n": 5}');
	SELECT idem_complete(1, idem_key('o', 'c'), '{}');
	COMMIT;
});
ok(wait_len('st.basic', 3), 'the next commit is published');
usleep(300_000);
my $hc = key_hex('c');
is_deeply(entries('st.basic')->[2], [ 'id', "$hc-1", 'body', '{"n":5}' ],
	'nothing of a rolled-back transaction or savepoint is published; positions forget the savepoint');
is($valkey->command('XLEN', 'st.basic'), 3, '... and nothing more');

# --- the same ids when the run runs again ---
my $lost = $primary->safe_psql('postgres', q{
	BEGIN;
	SELECT idem_claim(1, idem_key('o', 'd'), idem_fingerprint('{}'));
	SELECT idem_emit('st.rerun', '{"n": 1}') || ' ' || idem_emit('st.rerun', '{"n": 2}');
	ROLLBACK;
});
$lost = (split /\n/, $lost)[-1];
my $again = (split /\n/, $primary->safe_psql('postgres', q{
	BEGIN;
	SELECT idem_claim(1, idem_key('o', 'd'), idem_fingerprint('{}'));
	SELECT idem_emit('st.rerun', '{"n": 1}') || ' ' || idem_emit('st.rerun', '{"n": 2}');
	SELECT idem_complete(1, idem_key('o', 'd'), '{}');
	COMMIT;
}))[1];
is($again, $lost, 'a run re-run after a lost commit emits the same ids');

# Lease mode: the first holder's claim commits alone (with what it
# emitted); its lease ends, another run takes the key over and emits again.
my $first = (split /\n/, $primary->safe_psql('postgres', q{
	BEGIN;
	SELECT idem_claim(1, idem_key('o', 'e'), idem_fingerprint('{}'), '200 milliseconds');
	SELECT idem_emit('st.lease', '{"n": 1}');
	COMMIT;
}))[1];
usleep(400_000);
my $taken = $primary->safe_psql('postgres', q{
	BEGIN;
	SELECT (idem_claim(1, idem_key('o', 'e'), idem_fingerprint('{}'))).attempt;
	SELECT idem_emit('st.lease', '{"n": 1}');
	SELECT idem_complete(1, idem_key('o', 'e'), '{}');
	COMMIT;
});
my @taken = split /\n/, $taken;
is($taken[0], '2', 'the key is taken over after its lease');
is($taken[1], $first, '... and the takeover emits the same id');
ok(wait_len('st.lease', 2), 'both are published (at least once, the same id)');

# --- nothing before the commit is durable: a stopped synchronous standby ---
my $standby = IdemValkey::sync_standby($primary);
$standby->stop;
$primary->safe_psql('postgres',
	'SET synchronous_commit = local; ' . run_sql('f', 'st.sync', '{"n": 1}'));
usleep(2_000_000);
is($valkey->command('XLEN', 'st.sync'), 0,
	'a commit the synchronous standby lacks is not published');
is(waiting(), '1', '... its message waits in the outbox');
$standby->start;
ok(wait_len('st.sync', 1, 30), 'once the standby has it, it is published');
$standby->stop;
$primary->safe_psql('postgres', "ALTER SYSTEM RESET synchronous_standby_names");
$primary->reload;

# --- Valkey down, then up: nothing lost, the backlog shown ---
$valkey->stop;
my $errors0 = IdemValkey::stats_col($primary, 'publish_errors');
$primary->safe_psql('postgres', run_sql("g$_", 'st.down', qq({"n": $_}))) foreach 1 .. 20;
ok(IdemValkey::poll_until(10, sub {
			IdemValkey::stats_col($primary, 'publish_errors') > $errors0 }),
	'Valkey down: the publisher counts its failures');
is(waiting(), '20', '... idem_stats() shows the messages waiting');
is($primary->safe_psql('postgres', "SELECT outbox_age > interval '0' FROM idem_stats()"), 't',
	'... and the oldest one\'s age');
$valkey->start;
ok(wait_len('st.down', 20, 30), 'Valkey back: every message is published');
is_deeply([ map { $_->[3] } @{ entries('st.down') } ], [ map { qq({"n":$_}) } 1 .. 20 ],
	'... in commit order');
ok(IdemValkey::poll_until(10, sub { waiting() eq '0' }), '... and the outbox is empty');

# --- kill -9 of the publisher, and of the server, mid-publish ---
sub publisher_pid
{
	return $primary->safe_psql('postgres',
		"SELECT pid FROM pg_stat_activity WHERE backend_type = 'idem outbox publisher'");
}

foreach my $what ('publisher', 'server')
{
	my $stream = "st.kill.$what";
	my $n = 3000;
	my $expect = $primary->safe_psql('postgres', qq{
		BEGIN;
		SELECT idem_claim(1, idem_key('o', 'k$what'), idem_fingerprint('{}'));
		SELECT string_agg(idem_emit('$stream', jsonb_build_object('i', i)), ' ' ORDER BY i)
		  FROM generate_series(1, $n) i;
		SELECT idem_complete(1, idem_key('o', 'k$what'), '{}');
		COMMIT;
	});
	my @ids = split / /, (split /\n/, $expect)[1];
	ok(IdemValkey::poll_until(20, sub { ($valkey->command('XLEN', $stream) // 0) > 0 }),
		"$what: publishing started");
	if ($what eq 'publisher')
	{
		my $pid = publisher_pid();
		ok($pid, '... the publisher runs') and kill 'KILL', $pid;
	}
	else
	{
		$primary->stop('immediate');
		$primary->start;
	}
	ok(IdemValkey::poll_until(60, sub {
				(eval { waiting() } // '') eq '0' }), "$what killed: the outbox drains after the restart");
	my %seen;
	my $bad = 0;
	foreach my $e (@{ entries($stream) })
	{
		my ($id, $body) = ($e->[1], $e->[3]);
		my ($pos) = $id =~ /-(\d+)$/;
		$bad++ unless $body eq qq({"i":$pos});
		$seen{$id}++;
	}
	my @missing = grep { !$seen{$_} } @ids;
	is(scalar(@missing), 0, "... every message published at least once ($n ids; "
		  . (scalar(keys %seen) ? (grep { $seen{$_} > 1 } keys %seen) : 0) . " twice)");
	is($bad, 0, '... each with its own body under its id');
	ok(IdemValkey::wait_connected($primary, 1), '... the worker is back') if $what eq 'server';
}

# --- order: a transaction committed before another began comes first ---
my $s1 = $primary->background_psql('postgres');
my $s2 = $primary->background_psql('postgres');
$s1->query_safe(q{BEGIN; SELECT idem_claim(1, idem_key('o', 'o1'), idem_fingerprint('{}'))});
$s1->query_safe(q{SELECT idem_emit('st.order', '{"t": 1, "n": 1}')});
$s2->query_safe(q{BEGIN; SELECT idem_claim(1, idem_key('o', 'o2'), idem_fingerprint('{}'))});
$s2->query_safe(q{SELECT idem_emit('st.order', '{"t": 2, "n": 1}')});
$s1->query_safe(q{SELECT idem_emit('st.order', '{"t": 1, "n": 2}')});
$s2->query_safe(q{SELECT idem_complete(1, idem_key('o', 'o2'), '{}'); COMMIT});
$s1->query_safe(q{SELECT idem_complete(1, idem_key('o', 'o1'), '{}'); COMMIT});
# t3 began after both committed
$primary->safe_psql('postgres', run_sql('o3', 'st.order', '{"t": 3, "n": 1}', '{"t": 3, "n": 2}'));
$s1->quit;
$s2->quit;
ok(wait_len('st.order', 5), 'concurrent and later transactions are published');
my @order = map { $_->[3] } @{ entries('st.order') };
my @t1 = grep { /"t":1/ } @order;
is_deeply(\@t1, [ '{"n":1,"t":1}', '{"n":2,"t":1}' ], 'a transaction\'s messages keep their emit order');
is_deeply([ @order[3, 4] ], [ '{"n":1,"t":3}', '{"n":2,"t":3}' ],
	'a transaction that began after others committed comes after them');

# --- two-phase commit: COMMIT PREPARED wakes nobody; the publisher polls ---
my $prep = run_sql('p1', 'st.prep', '{"n": 1}');
$prep =~ s/COMMIT;$/PREPARE TRANSACTION 'p1';/;
$primary->safe_psql('postgres', $prep);
usleep(1_500_000);
is($valkey->command('XLEN', 'st.prep'), 0, 'a prepared transaction\'s message is not published');
$primary->safe_psql('postgres', "COMMIT PREPARED 'p1'");
ok(wait_len('st.prep', 1, 10), '... and is once COMMIT PREPARED commits it');

# --- a dump restored on another server: what waited goes out from there too ---
$valkey->stop;
my @rids = map {
	(split /\n/, $primary->safe_psql('postgres', run_sql("r$_", 'st.restore', qq({"r": $_}))))[1]
} 1 .. 3;
my $dump = $primary->basedir . '/outbox.dump';
$primary->command_ok([ 'pg_dump', '-Fc', '-f', $dump, '-d', $primary->connstr('postgres') ],
	'pg_dump while messages wait');
my $restored = PostgreSQL::Test::Cluster->new('restored');
$restored->init;
$restored->append_conf('postgresql.conf',
	"shared_preload_libraries = 'idem'\nidem.valkey_port = " . $valkey->port . "\n");
$restored->start;
$restored->command_ok([ 'pg_restore', '-d', $restored->connstr('postgres'), $dump ], 'pg_restore');
is($restored->safe_psql('postgres', 'SELECT count(*) FROM idem_outbox'), '3',
	'the restored outbox holds the waiting messages');
$restored->restart;
$valkey->start;
ok(wait_len('st.restore', 6, 30), 'Valkey back: both servers publish them');
my %rseen;
$rseen{ $_->[1] }++ foreach @{ entries('st.restore') };
is_deeply([ sort keys %rseen ], [ sort @rids ], '... under their ids: at least once, nothing lost');
$restored->stop;

done_testing();
