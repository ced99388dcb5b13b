# idem on Citus: shard moves and splits against transactions that touched
# the tenant ledger only through idem.  A move or split must wait for such a
# transaction (it takes Citus's shard metadata lock, which idem holds in
# ShareLock), in both transfer modes: block_writes, and logical replication
# (where it blocks writes before its final catch-up).  After it, the key is
# completed on the new node with exactly one effect, and a second claim of
# a key still held never answers claimed.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;
use lib "$FindBin::RealBin/../t";

use IdemCitus;
use IdemValkey;
use IPC::Run;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time usleep);

my $valkey = IdemValkey->new(name => 'valkey')->start;
# A logical split decodes with Citus's own output plugin, which this
# PostgreSQL accepts only when listed.
my $cl = IdemCitus->new(valkey => $valkey,
	conf => { output_plugin_libraries => q{'pgoutput, test_decoding, citus'} });
my $c = $cl->coord;
my ($w1, $w2) = ($cl->w1, $cl->w2);

$cl->install_tenants(effects => 1);

my $connstr = $c->connstr('postgres');
my $opstr = "$connstr application_name=idem_op";
my $fp = q{idem_fingerprint('{}')};
my %used;

# A tenant on $node whose shard no earlier case has moved or split.
sub fresh_tenant
{
	my ($node) = @_;
	foreach my $t (1 .. 40)
	{
		next if $cl->node_of($t)->port != $node->port;
		my ($shard, $one) = split /\|/, $c->safe_psql('postgres', qq{
			SELECT shardid, shardminvalue = shardmaxvalue FROM pg_dist_shard
			WHERE shardid = get_shard_id_for_distribution_column('tenants', ${t}::bigint)});
		next if $one eq 't' || $used{$shard}++;
		return ($t, $shard);
	}
	die 'no fresh tenant on ' . $node->name;
}

# Run @sql on the coordinator in the background (its own psql, one
# command after the other in one session).
sub start_op
{
	my (@sql) = @_;
	my $op = { out => '', err => '', sql => join('; ', @sql) };
	$op->{run} = IPC::Run::start(
		[ 'psql', '-X', '-At', '-v', 'ON_ERROR_STOP=1', '-d', $opstr, map { ('-c', $_) } @sql ],
		'>', \$op->{out}, '2>', \$op->{err});
	return $op;
}

# The operation's statement is still running.
sub op_running
{
	return $c->safe_psql('postgres', q{
		SELECT EXISTS (SELECT 1 FROM pg_stat_activity
		WHERE application_name = 'idem_op' AND state = 'active')}) eq 't';
}

# A statement of a handler session, after the move or split started: an
# error is reported, not fatal, so that what follows shows what it did.
sub hq
{
	my ($h, $sql) = @_;
	my $out = $h->query($sql);
	diag("handler: $h->{stderr}") if $h->{stderr} =~ /ERROR/;
	return $out;
}

# Wait for the operation; true when it succeeded.
sub finish_op
{
	my ($op) = @_;
	my $ok = $op->{run}->finish;
	diag("$op->{sql}: $op->{err}") unless $ok;
	return $ok;
}

# Poll $node until $sql answers 't' (at most $secs seconds).
sub wait_true
{
	my ($node, $sql, $secs) = @_;
	my $until = time() + $secs;
	while (time() < $until)
	{
		return 1 if $node->safe_psql('postgres', $sql) eq 't';
		usleep(100_000);
	}
	return 0;
}

# A move or split waiting on $node for a shard metadata lock held in
# ShareLock by an idem transaction: an ExclusiveLock not granted.
sub op_waits_on
{
	my ($node, $op, $what) = @_;
	ok( wait_true($node, q{
			SELECT EXISTS (SELECT 1 FROM pg_locks
			WHERE locktype = 'advisory' AND mode = 'ExclusiveLock' AND NOT granted)}, 15),
		"$what waits on " . $node->name . ' for the idem transaction\'s shard lock');
	usleep(1_000_000);
	ok(op_running($op), '... and is still waiting a second later');
}

# Citus's testing hook: with citus.running_under_citus_test_suite on, a
# logical move or split takes this advisory lock (ShareLock) after its
# initial copy, before it blocks writes and catches up: holding it pauses
# the operation there, after its replication slot and initial copy exist.
my $pause_sql = 'SELECT pg_advisory_lock(44000, 55152)';
my $paused_sql = q{
	SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory'
	AND classid = 44000 AND objid = 55152 AND objsubid = 2 AND NOT granted)};
my $hook = "SET citus.running_under_citus_test_suite = on; SET statement_timeout = '60s'";

sub move_sql
{
	my ($shard, $from, $to, $mode) = @_;
	return sprintf(
		"SELECT citus_move_shard_placement(%s, '127.0.0.1', %d, '127.0.0.1', %d, shard_transfer_mode => '%s')",
		$shard, $from->port, $to->port, $mode);
}

sub lookup
{
	my ($t, $k) = @_;
	return $c->safe_psql('postgres',
		"SELECT status || ' ' || attempt FROM idem_lookup($t, idem_key('mv', '$k'))");
}

# ---------- block_writes move: claim, a reference-table effect, complete ----------
my ($t_bw, $shard_bw);
{
	my ($t, $shard) = fresh_tenant($w1);
	($t_bw, $shard_bw) = ($t, $shard);
	my $h = $c->background_psql('postgres', on_error_stop => 0);
	$h->query_safe(qq{BEGIN;
		SELECT decision FROM idem_claim($t, idem_key('mv', 'bw'), $fp);
		INSERT INTO audit VALUES ($t, 'mv:bw')});
	my $op = start_op(move_sql($shard, $w1, $w2, 'block_writes'));
	op_waits_on($w1, $op, 'a block_writes move');
	hq($h, qq{SELECT idem_complete($t, idem_key('mv', 'bw'), '{"paid": 1}')});
	hq($h, 'COMMIT');
	$h->quit;
	ok(finish_op($op), '... and finishes once the handler committed');
	is($cl->node_of($t)->port, $w2->port, '... the shard is on worker 2');
	is( $c->safe_psql('postgres', qq{
			SELECT decision || ' ' || outcome FROM idem_claim($t, idem_key('mv', 'bw'), $fp)}),
		'completed {"paid": 1}', 'the redelivery on the new node replays the result');
	is($c->safe_psql('postgres', "SELECT count(*) FROM audit WHERE note = 'mv:bw'"), '1',
		'... and the effect was made once');
}

# ---------- logical move: a lease-mode completion during the move ----------
{
	my ($t, $shard) = fresh_tenant($w1);
	is( $c->safe_psql('postgres', qq{
			SELECT decision || ' ' || attempt FROM idem_claim($t, idem_key('mv', 'lease'), $fp, lease => '1 hour')}),
		'claimed 1', 'a lease-mode claim committed alone');
	my $pause = $c->background_psql('postgres');
	$pause->query_safe($pause_sql);
	my $op = start_op($hook, move_sql($shard, $w1, $w2, 'force_logical'));
	ok(wait_true($c, $paused_sql, 30), 'a logical move paused after its initial copy');
	my $h = $c->background_psql('postgres', on_error_stop => 0);
	$h->query_safe(qq{BEGIN;
		SELECT idem_complete($t, idem_key('mv', 'lease'), '{"sent": 1}', attempt => 1)});
	$pause->query_safe('SELECT pg_advisory_unlock(44000, 55152)');
	op_waits_on($w1, $op, 'the logical move, before its catch-up,');
	hq($h, 'COMMIT');
	$h->quit;
	$pause->quit;
	ok(finish_op($op), '... and finishes once the completion committed');
	is($cl->node_of($t)->port, $w2->port, '... the shard is on worker 2');
	is(lookup($t, 'lease'), 'completed 1', 'the completion is on the new node');
}

# ---------- two holders: a claim held open across a move ----------
{
	my ($t, $shard) = fresh_tenant($w1);
	my $h = $c->background_psql('postgres', on_error_stop => 0);
	$h->query_safe(qq{BEGIN; SELECT decision FROM idem_claim($t, idem_key('mv', 'open'), $fp)});
	my ($ret, $out, $err) = $c->psql('postgres',
		"SET statement_timeout = '3s'; " . move_sql($shard, $w1, $w2, 'block_writes'));
	like($err, qr/statement timeout/, 'a block_writes move cannot finish while a claim is open');
	is($cl->node_of($t)->port, $w1->port, '... the shard stays on worker 1');
	is( $c->safe_psql('postgres', qq{
			SELECT decision FROM idem_claim($t, idem_key('mv', 'open'), $fp)}),
		'busy', '... and a second claim of the key answers busy');
	my $op = start_op(move_sql($shard, $w1, $w2, 'block_writes'));
	op_waits_on($w1, $op, 'the move again');
	hq($h, qq{
		INSERT INTO audit VALUES ($t, 'mv:open');
		SELECT idem_complete($t, idem_key('mv', 'open'), '{}')});
	hq($h, 'COMMIT');
	$h->quit;
	ok(finish_op($op), '... and finishes once the holder committed');
	is( $c->safe_psql('postgres', qq{
			SELECT decision FROM idem_claim($t, idem_key('mv', 'open'), $fp)})
		  . ' ' . $c->safe_psql('postgres', "SELECT count(*) FROM audit WHERE note = 'mv:open'"),
		'completed 1', 'the key is completed on worker 2, its effect once');
}

# ---------- a blocking split: isolate_tenant_to_new_shard ----------
{
	my ($t, $shard) = fresh_tenant($w1);
	my $h = $c->background_psql('postgres', on_error_stop => 0);
	$h->query_safe(qq{BEGIN;
		SELECT decision FROM idem_claim($t, idem_key('mv', 'iso'), $fp);
		INSERT INTO audit VALUES ($t, 'mv:iso')});
	my $op = start_op(
		"SELECT isolate_tenant_to_new_shard('tenants', $t, 'CASCADE', shard_transfer_mode => 'block_writes')");
	op_waits_on($w1, $op, 'isolate_tenant_to_new_shard (block_writes)');
	hq($h, qq{SELECT idem_complete($t, idem_key('mv', 'iso'), '{}')});
	hq($h, 'COMMIT');
	$h->quit;
	ok(finish_op($op), '... and finishes once the handler committed');
	isnt($c->safe_psql('postgres',
			"SELECT get_shard_id_for_distribution_column('tenants', ${t}::bigint)"),
		$shard, '... the tenant has a shard of its own');
	is( $c->safe_psql('postgres', qq{
			SELECT decision FROM idem_claim($t, idem_key('mv', 'iso'), $fp)})
		  . ' ' . $c->safe_psql('postgres', "SELECT count(*) FROM audit WHERE note = 'mv:iso'"),
		'completed 1', 'the key is completed in the new shard, its effect once');
}

# ---------- a logical split: citus_split_shard_by_split_points ----------
{
	my ($t, $shard) = fresh_tenant($w2);
	my ($lo, $hi) = split /\|/, $c->safe_psql('postgres',
		"SELECT shardminvalue, shardmaxvalue FROM pg_dist_shard WHERE shardid = $shard");
	my $mid = int(($lo + $hi) / 2);
	my $nodes = $c->safe_psql('postgres', sprintf(
		"SELECT string_agg(nodeid::text, ',' ORDER BY nodeport = %d DESC) FROM pg_dist_node WHERE nodeport IN (%d, %d)",
		$w1->port, $w1->port, $w2->port));
	my $pause = $c->background_psql('postgres');
	$pause->query_safe($pause_sql);
	my $op = start_op($hook, "SELECT citus_split_shard_by_split_points($shard, ARRAY['$mid'],"
		  . " ARRAY[$nodes], shard_transfer_mode => 'force_logical')");
	ok(wait_true($c, $paused_sql, 30), 'a logical split paused after its initial copy');
	my $h = $c->background_psql('postgres', on_error_stop => 0);
	$h->query_safe(qq{BEGIN;
		SELECT decision FROM idem_claim($t, idem_key('mv', 'split'), $fp);
		INSERT INTO audit VALUES ($t, 'mv:split');
		SELECT idem_complete($t, idem_key('mv', 'split'), '{}')});
	$pause->query_safe('SELECT pg_advisory_unlock(44000, 55152)');
	op_waits_on($w2, $op, 'the logical split, before its catch-up,');
	hq($h, 'COMMIT');
	$h->quit;
	$pause->quit;
	ok(finish_op($op), '... and finishes once the handler committed');
	is( $c->safe_psql('postgres', qq{
			SELECT decision FROM idem_claim($t, idem_key('mv', 'split'), $fp)})
		  . ' ' . $c->safe_psql('postgres', "SELECT count(*) FROM audit WHERE note = 'mv:split'"),
		'completed 1', 'the key is completed in its new shard, its effect once');
}

# ---------- a handler that writes a co-located table through the coordinator ----------
# once the move is waiting for it: the move holds the lock on the
# coordinator and waits on the worker for the handler, which now waits on
# the coordinator for the move.  Citus's distributed deadlock detection
# cancels one of the two; either way the key and its effect agree.
{
	my ($t, $shard) = fresh_tenant($w2);
	my $h = $c->background_psql('postgres', on_error_stop => 0);
	$h->query_safe(qq{BEGIN; SELECT decision FROM idem_claim($t, idem_key('mv', 'dl'), $fp)});
	my $op = start_op("SET statement_timeout = '30s'", move_sql($shard, $w2, $w1, 'block_writes'));
	op_waits_on($w2, $op, 'a move');
	my $t0 = time();
	$h->query(qq{INSERT INTO effects (tenant_id, k) VALUES ($t, 'mv:dl');
		SELECT idem_complete($t, idem_key('mv', 'dl'), '{}')});
	my $handler_err = $h->{stderr};
	$h->query('COMMIT');
	$h->quit;
	my $moved = $op->{run}->finish;
	my $took = time() - $t0;
	like($moved ? $handler_err : $op->{err}, qr/deadlock/,
		($moved ? 'the handler' : 'the move') . ' was cancelled as a distributed deadlock');
	ok($took < 20, sprintf('... after %.1f s', $took));
	my $state = $c->safe_psql('postgres', qq{
			BEGIN;
			SELECT decision FROM idem_claim($t, idem_key('mv', 'dl'), $fp);
			ROLLBACK})
	  . ' ' . $c->safe_psql('postgres', "SELECT count(*) FROM effects WHERE k = 'mv:dl'");
	is($state, $moved ? 'claimed 0' : 'completed 1',
		'... and the key agrees with its effect');
}

# ---------- a handler role that does not own the ledger ----------
# Citus lets only a table's owner take its shard metadata lock; idem takes
# it as the ledger's owner, so a handler with the README's grants is held
# across a move as well.
{
	$c->safe_psql('postgres', q{
		CREATE ROLE handler LOGIN;
		GRANT USAGE ON SCHEMA public TO handler;
		GRANT EXECUTE ON FUNCTION idem_key(text, text), idem_fingerprint(jsonb),
			idem_claim(bigint, bytea, bytea, interval),
			idem_complete(bigint, bytea, jsonb, interval, integer),
			idem_lookup(bigint, bytea) TO handler;
		GRANT SELECT, INSERT, UPDATE ON idempotency_keys TO handler;
		GRANT INSERT, SELECT ON audit TO handler;
	});
	my ($t, $shard) = fresh_tenant($w2);
	my $h = $c->background_psql('postgres', on_error_stop => 0,
		extra_params => [ '-U', 'handler' ]);
	is(hq($h, qq{BEGIN; SELECT decision FROM idem_claim($t, idem_key('mv', 'role'), $fp)}),
		'claimed', 'a handler role that does not own the ledger claims');
	my $op = start_op(move_sql($shard, $w2, $w1, 'block_writes'));
	op_waits_on($w2, $op, 'a block_writes move');
	hq($h, qq{INSERT INTO audit VALUES ($t, 'mv:role');
		SELECT idem_complete($t, idem_key('mv', 'role'), '{}')});
	hq($h, 'COMMIT');
	$h->quit;
	ok(finish_op($op), '... and finishes once the handler committed');
	is( $c->safe_psql('postgres', qq{
			SELECT decision FROM idem_claim($t, idem_key('mv', 'role'), $fp)},
			extra_params => [ '-U', 'handler' ])
		  . ' ' . $c->safe_psql('postgres', "SELECT count(*) FROM audit WHERE note = 'mv:role'"),
		'completed 1', 'the key is completed on worker 1, its effect once');
}

# ---------- back and forth: what a worker's backends remember of a shard ----------
# One coordinator session keeps its connections to the workers, so the
# same worker backend serves its calls before and after the shard left
# and came back (dropped and created again): it must not use the shard it
# remembers.
{
	my $t = $t_bw;
	my $s = $c->background_psql('postgres', on_error_stop => 0);
	my $claim = sub {
		my ($k) = @_;
		return hq($s, qq{BEGIN;
			SELECT decision FROM idem_claim($t, idem_key('mv', '$k'), $fp);
			SELECT idem_complete($t, idem_key('mv', '$k'), '{}'); COMMIT});
	};
	my $move = sub {
		my ($from, $to) = @_;
		$c->safe_psql('postgres', move_sql($shard_bw, $from, $to, 'block_writes'));
		$c->safe_psql('postgres', 'CALL citus_cleanup_orphaned_resources()');
	};
	like($claim->('back1'), qr/^claimed/, 'a key written on worker 2');
	$move->($w2, $w1);
	like($claim->('back2'), qr/^claimed/, '... one on worker 1, after a move');
	$move->($w1, $w2);
	like($claim->('back3'), qr/^claimed/, '... one on worker 2 again, by the same session');
	is( join(' ', map { hq($s, "SELECT decision FROM idem_claim($t, idem_key('mv', '$_'), $fp)") }
			qw(bw back1 back2 back3)),
		'completed completed completed completed', '... and every key of the tenant replays');
	$s->quit;
	my $ledger_shard = $cl->shard_of($t);
	is($w2->safe_psql('postgres', "SELECT count(*) FROM $ledger_shard WHERE tenant_id = $t"),
		'4', '... all four in the shard, now on worker 2');
}

# idem's own transactions do not wait for one another: two handlers of one
# tenant hold the shard lock together.
{
	my ($t) = fresh_tenant($w2);
	my $h = $c->background_psql('postgres');
	$h->query_safe(qq{BEGIN; SELECT decision FROM idem_claim($t, idem_key('mv', 's1'), $fp)});
	my $t0 = time();
	is( $c->safe_psql('postgres', qq{
			BEGIN;
			SELECT decision FROM idem_claim($t, idem_key('mv', 's2'), $fp);
			SELECT idem_complete($t, idem_key('mv', 's2'), '{}');
			COMMIT}),
		"claimed\n", 'a second handler of the same shard runs while the first is open');
	ok(time() - $t0 < 2, '... without waiting for it');
	$h->query_safe('ROLLBACK');
	$h->quit;
}

done_testing();
