# The cluster cache across node changes: adding an empty worker, moving
# shards onto it by logical replication, rebalancing and draining it, then
# removing it, keep the cluster keyspace (no node lost anything it held),
# so a runner keeps replaying from Valkey what the workers copied before.
# A node that comes back with its history changed still gives the cluster
# a new keyspace, and so does a user's subscription that writes a shard.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;
use lib "$FindBin::RealBin/../t";

use IdemCitus;
use IdemValkey;
use PostgreSQL::Test::Utils;
use IPC::Run;
use Test::More;
use Time::HiRes qw(usleep);

# runners learn again every 200 ms: a keyspace change shows at once
$ENV{IDEM_SECRETS_MAX_AGE_MS} = 200;

my $valkey = IdemValkey->new(name => 'valkey')->start;
my $cl = IdemCitus->new(valkey => $valkey);
my $c = $cl->coord;
my ($w1, $w2) = ($cl->w1, $cl->w2);

$cl->install_tenants;
$c->safe_psql('postgres', 'CREATE TABLE effects (scope text, id text)');
my $t1 = $cl->tenant_on($w1);
my $t2 = $cl->tenant_on($w2);

sub ks { return IdemValkey::wait_keyspace($c) // 'none' }

# The identity a node reports to the coordinator (system id, timeline, epoch).
sub identity_of
{
	my ($node) = @_;
	return (split / /, $node->safe_psql('postgres', 'SELECT idem_cache_node()'))[0];
}

# Message $id of tenant $t completed through the coordinator, and its copy
# in keyspace $k.
sub complete_cached
{
	my ($t, $id, $k) = @_;
	$c->safe_psql('postgres', qq{
		BEGIN;
		SELECT idem_claim($t, idem_key('s', '$id'), idem_fingerprint('{}'));
		SELECT idem_complete($t, idem_key('s', '$id'), '{"id": "$id"}');
		COMMIT;});
	my $hex = $c->safe_psql('postgres', "SELECT encode(idem_key('s', '$id'), 'hex')");
	return defined $valkey->wait_for_key("${k}t:$t:$hex", 10);
}

# Every one of @keys ([tenant, id]) replayed by a runner on the coordinator
# from Valkey: the number that were.
sub replayed_from_valkey
{
	my (@keys) = @_;
	my $n = 0;
	foreach my $k (@keys)
	{
		my $s = IdemValkey::runner_session($c, 'postgres', $valkey, $k->[0], 's', '{}');
		$n++ if $s->run($k->[1]) eq 'replayed valkey';
		$s->finish;
	}
	return $n;
}

my $ks = ks();
is(IdemValkey::wait_keyspace($w1) . ' ' . IdemValkey::wait_keyspace($w2), "$ks $ks",
	'both workers joined the cluster keyspace');
my @keys;
foreach my $t (1 .. 16)
{
	ok(complete_cached($t, "k$t", $ks), "tenant ${t}'s result copied") or last;
	push @keys, [ $t, "k$t" ];
}
is(replayed_from_valkey(@keys), 16, 'every result replays from Valkey');

# ---------- a worker added, empty ----------
my $w3 = $cl->start_node('w3');
$c->safe_psql('postgres', "SELECT citus_add_node('127.0.0.1', " . $w3->port . ")");
is(ks(), $ks, 'adding an empty worker keeps the cluster keyspace');
is(IdemValkey::wait_keyspace($w3), $ks, '... which the new worker joins');
usleep(300_000);
is(replayed_from_valkey(@keys), 16, '... and every result still replays from Valkey');

# ---------- a shard moved onto it by logical replication ----------
my $id3 = identity_of($w3);
my $sid = $c->safe_psql('postgres',
	"SELECT get_shard_id_for_distribution_column('idempotency_keys', ${t1}::bigint)");
# results completed while it moves: Citus's subscription applies them
my ($mout, $merr) = ('', '');
my $move = IPC::Run::start(
	[ 'psql', '-X', '-At', '-v', 'ON_ERROR_STOP=1', '-d', $c->connstr('postgres'), '-c',
	  "SELECT citus_move_shard_placement($sid, '127.0.0.1', ${\ $w1->port}, '127.0.0.1', ${\ $w3->port},
		shard_transfer_mode => 'force_logical')" ],
	'>', \$mout, '2>', \$merr);
my $during = 0;
while ($move->pumpable && $during < 3000)
{
	# a call that waited for the move fails (the shard moved): not counted
	$c->psql('postgres', qq{
		BEGIN;
		SELECT idem_claim($t1, idem_key('s', 'during$during'), idem_fingerprint('{}'));
		SELECT idem_complete($t1, idem_key('s', 'during$during'), '{}');
		COMMIT;});
	$during++;
	$move->pump_nb;
}
ok($move->finish, 'the shard moved by logical replication while results were completed')
  or diag($merr);
is($cl->coord->safe_psql('postgres', qq{
	SELECT nodeport FROM pg_dist_placement p JOIN pg_dist_node n USING (groupid)
	WHERE p.shardid = $sid}), $w3->port, "tenant ${t1}'s shard is on the new worker");
is(identity_of($w3), $id3, '... whose history epoch the move kept');
is(ks(), $ks, '... and the cluster keyspace too');
usleep(300_000);
is(replayed_from_valkey(@keys), 16, '... every result still replays from Valkey');
ok(complete_cached($t1, 'on-w3', $ks), 'the new worker copies a result of the moved shard');

# ---------- a rebalance, then the worker drained and removed ----------
$c->safe_psql('postgres',
	q{SELECT rebalance_table_shards(shard_transfer_mode => 'force_logical')});
is(ks(), $ks, 'a rebalance keeps the cluster keyspace');
$c->safe_psql('postgres', qq{
	SELECT citus_drain_node('127.0.0.1', ${\ $w3->port}, shard_transfer_mode => 'force_logical');
	SELECT citus_remove_node('127.0.0.1', ${\ $w3->port});});
is(ks(), $ks, 'draining and removing the worker keep it');
usleep(300_000);
push @keys, [ $t1, 'on-w3' ];
is(replayed_from_valkey(@keys), 17, '... every result still replays from Valkey');
is(IdemValkey::wait_keyspace($w1) . ' ' . IdemValkey::wait_keyspace($w2), "$ks $ks",
	'... and both workers kept their joins');

# ---------- a node back with its history changed ----------
$w3->safe_psql('postgres', 'SELECT idem_renew_epoch()');
my $new3;
IdemValkey::poll_until(20, sub { $new3 = identity_of($w3); defined $new3 && $new3 ne $id3 });
isnt($new3 // $id3, $id3, 'the removed worker renews its epoch');
$c->safe_psql('postgres', "SELECT citus_add_node('127.0.0.1', " . $w3->port . ")");
my $ks2 = ks();
isnt($ks2, $ks, 'added again, it gives the cluster a new keyspace');
is(IdemValkey::wait_keyspace($w3), $ks2, '... which it joins');

# ---------- a user's subscription into a shard ----------
# Citus's own move and split subscriptions renew nothing (the logical move
# above); a user's that writes a ledger shard does, as for the ledger.
my $pub = PostgreSQL::Test::Cluster->new('pub');
$pub->init(allows_streaming => 'logical');
$pub->start;
my $node = $cl->node_of($t2);
my $shard = $cl->shard_of($t2);
my $cols = $node->safe_psql('postgres', qq{
	SELECT string_agg(format('%I %s', attname, format_type(atttypid, atttypmod)), ', ' ORDER BY attnum)
	FROM pg_attribute WHERE attrelid = 'public.$shard'::regclass AND attnum > 0 AND NOT attisdropped});
$pub->safe_psql('postgres', qq{
	CREATE TABLE public.$shard ($cols);
	ALTER TABLE public.$shard REPLICA IDENTITY FULL;
	INSERT INTO public.$shard (tenant_id, idempotency_key) VALUES ($t2, '\\x00');
	CREATE PUBLICATION userpub FOR TABLE public.$shard;});
$node->safe_psql('postgres', "CREATE SUBSCRIPTION usersub CONNECTION '" . $pub->connstr
	  . " dbname=postgres' PUBLICATION userpub WITH (copy_data = false)");
$pub->wait_for_catchup('usersub');
my $ks3 = ks();
my $idn = identity_of($node);
$pub->safe_psql('postgres', "DELETE FROM public.$shard");
$pub->wait_for_catchup('usersub');
my $idn2;
IdemValkey::poll_until(20, sub { $idn2 = identity_of($node); defined $idn2 && $idn2 ne $idn });
isnt($idn2 // $idn, $idn, 'a DELETE a user\'s subscription applies to a ledger shard renews that node\'s epoch');
isnt(ks(), $ks3, '... and gives the cluster a new keyspace');
$node->safe_psql('postgres', 'DROP SUBSCRIPTION usersub');
$pub->stop;

IdemValkey::check_counters($_) foreach ($c, $w1, $w2, $w3);
$_->stop foreach ($w3, $w1, $w2, $c);
done_testing();
