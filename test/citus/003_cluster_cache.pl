# One Valkey cache for a Citus cluster: every node copies into the keyspace
# the coordinator names, MACed with the coordinator's secrets, so a runner
# that learns both on the coordinator verifies what the worker nodes copy.
# A node's epoch change (rows deleted by hand on a shard, through the
# distributed table, or TRUNCATE) changes the cluster keyspace; the purge
# and a shard move do not.  A node that has not joined copies nothing.
# The cluster keyspace has an owner key like a server's own: a C runner
# connected to the coordinator replays from Valkey, and stops trusting the
# keyspace at once when a node's history changes (that node retires it),
# or when the coordinator names another (it retires the one before).
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;
use lib "$FindBin::RealBin/../t";

use IdemCitus;
use IdemValkey;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(usleep);

# the runners here learn again only once an hour: only the owner check
# stands between them and a keyspace whose history changed
$ENV{IDEM_SECRETS_MAX_AGE_MS} = 3_600_000;

my $valkey = IdemValkey->new(name => 'valkey')->start;
my $cl = IdemCitus->new(valkey => $valkey, conf => { log_statement => q('all') });
my $c = $cl->coord;
my ($w1, $w2) = ($cl->w1, $cl->w2);

$cl->install_tenants;
my $t1 = $cl->tenant_on($w1);
my $t2 = $cl->tenant_on($w2);
my $fp = $c->safe_psql('postgres', "SELECT encode(idem_fingerprint('{}'), 'hex')");

sub ks { return IdemValkey::wait_keyspace($c) // 'none' }

# Complete message $id of tenant $t through the coordinator.
sub complete
{
	my ($t, $id) = @_;
	$c->safe_psql('postgres', qq{
		BEGIN;
		SELECT idem_claim($t, idem_key('s', '$id'), idem_fingerprint('{}'));
		SELECT idem_complete($t, idem_key('s', '$id'), '{"id": "$id"}');
		COMMIT;});
}

sub hexkey
{
	my ($id) = @_;
	return $c->safe_psql('postgres', "SELECT encode(idem_key('s', '$id'), 'hex')");
}

# Does $value under $key verify with the coordinator's secrets?
sub coord_mac_ok { return IdemValkey::mac_ok($c, @_) }

# ---------- one keyspace, the coordinator's secrets ----------
my $ks = ks();
like($ks, qr/^idem:[0-9]+\.1\.[0-9a-f]{16}\.[0-9]+:$/, 'the coordinator names a keyspace');
$c->safe_psql('postgres', q{
	CREATE ROLE runner LOGIN;
	GRANT EXECUTE ON FUNCTION idem_cache_keyspace(), idem_cache_secrets() TO runner;
});
is($c->safe_psql('postgres', 'SET ROLE runner; SELECT idem_cache_keyspace()'), $ks,
	'a runner role that is granted idem_cache_keyspace() learns the same keyspace');
is($c->psql('postgres', 'SET ROLE runner; SELECT idem_cache_node()'), 3,
	'... but may not call the nodes\' own functions');
is(IdemValkey::wait_keyspace($w1), $ks, 'worker 1 joined it');
is(IdemValkey::wait_keyspace($w2), $ks, 'worker 2 joined it');
is(IdemValkey::secrets($w1) . ' ' . IdemValkey::secret_hex($w1, 1),
	IdemValkey::secrets($c) . ' ' . IdemValkey::secret_hex($c, 1),
	'worker 1 MACs with the coordinator\'s secrets');
my $secret = IdemValkey::secret_hex($c, 1);
like(slurp_file($w1->logfile), qr/idem_cache_node_join/, 'worker 1 logged the join statement');
unlike(slurp_file($w1->logfile) . slurp_file($c->logfile), qr/$secret/,
	'the secret travels in no statement text (log_statement = all)');

# ---------- the seal: a node opens a seal once, made for it ----------
# The coordinator's last join statement, as worker 1 logged it.
my @joins = slurp_file($w1->logfile) =~
  /idem_cache_node_join\('([^']*)', '([^']*)', '([0-9a-f]*)'\)/g;
my ($jks, $jid, $jseal) = @joins[-3 .. -1];
is(length($jseal // ''), 202, 'the secrets travel sealed: 101 bytes (AES-256-GCM)');
# A new one-time key replaces the one the seal was made with.
my ($w1id) = split / /, $w1->safe_psql('postgres', 'SELECT idem_cache_node()');
is($w1id, $jid, 'worker 1\'s identity is the one the coordinator sealed for');
is($w1->safe_psql('postgres', "SELECT idem_cache_node_join('$jks', '$jid', '$jseal')"), 'f',
	'a replayed seal does not join (its one-time key was consumed)');
my ($w2id) = split / /, $w2->safe_psql('postgres', 'SELECT idem_cache_node()');
is($w2->safe_psql('postgres', "SELECT idem_cache_node_join('$jks', '$w2id', '$jseal')"), 'f',
	'worker 1\'s seal, given to worker 2 for its own identity, does not join');
$w1->safe_psql('postgres', 'SELECT idem_cache_node()');
is($w1->safe_psql('postgres', "SELECT idem_cache_node_join('$jks', '$jid', '" . ('ab' x 120) . "')"), 'f',
	'a seal of idem 0.3 (120 bytes) does not join ...');
like(slurp_file($w1->logfile), qr/cache secrets sealed by an older version of idem were refused/,
	'... and the node\'s log says why');
is(IdemValkey::wait_keyspace($w1) . ' ' . IdemValkey::wait_keyspace($w2), "$ks $ks",
	'the refused seals left both nodes\' joins as they were');

complete($t1, 'a');
complete($t2, 'b');
my $k1 = "${ks}t:$t1:" . hexkey('a');
my $k2 = "${ks}t:$t2:" . hexkey('b');
my $v1 = $valkey->wait_for_key($k1, 10);
my $v2 = $valkey->wait_for_key($k2, 10);
ok(defined $v1 && coord_mac_ok($k1, $v1),
	'worker 1 copied its result into the cluster keyspace, verifiable with the coordinator\'s secrets');
ok(defined $v2 && coord_mac_ok($k2, $v2), '... and worker 2');

# A replay answered by PostgreSQL (the key deleted from Valkey) is copied
# again, into the same keyspace; nothing lands anywhere else.
$valkey->command('DEL', $k1);
$c->safe_psql('postgres', "SELECT idem_lookup($t1, idem_key('s', 'a'))");
$c->safe_psql('postgres', "SELECT idem_claim($t1, idem_key('s', 'a'), idem_fingerprint('{}'))");
$v1 = $valkey->wait_for_key($k1, 10);
ok(defined $v1 && coord_mac_ok($k1, $v1), 'a PostgreSQL replay on the worker repopulates the cluster keyspace');
my $all = $valkey->command('KEYS', '*');
my @keys = grep { !/:(owner|epochs)$/ } (ref $all ? @$all : split /\n/, $all);
is(join(' ', grep { index($_, $ks) != 0 } @keys), '',
	'no node copies anything outside the cluster keyspace');

# ---------- rotation on the coordinator ----------
my $kid = $c->safe_psql('postgres', 'SELECT idem_rotate_cache_secret()');
is(ks(), $ks, 'a rotation keeps the keyspace');
complete($t1, 'after-rotation');
my $k3 = "${ks}t:$t1:" . hexkey('after-rotation');
my $v3 = $valkey->wait_for_key($k3, 10);
is((IdemValkey::parse_value($v3) // {})->{key_id}, $kid,
	'after the next learn, the worker MACs with the rotated secret');
ok(coord_mac_ok($k3, $v3), '... which the coordinator hands out');

# ---------- the owner key: a runner on the coordinator ----------
sub owner_key_of { (my $k = $_[0]) =~ s/\.[0-9]+:\z/:owner/; return $k; }

# Poll Valkey until the owner key of keyspace $k matches $re.
sub owner_is
{
	my ($k, $re) = @_;
	my $v;
	IdemValkey::poll_until(20, sub { $v = $valkey->command('GET', owner_key_of($k)) // ''; $v =~ $re });
	return $v // '';
}

like(owner_is($ks, qr/^[0-9a-f]{16}\z/), qr/^[0-9a-f]{16}\z/,
	'the coordinator\'s worker set the cluster keyspace\'s owner key to a token');
is($c->safe_psql('postgres', 'SELECT owner_key FROM idem_cache_secrets() WHERE is_current'),
	owner_key_of($ks), 'idem_cache_secrets() on the coordinator names it');
$c->safe_psql('postgres', 'CREATE TABLE effects (scope text, id text)');
my $s = IdemValkey::runner_session($c, 'postgres', $valkey, $t1, 'cr', '{"x": 1}');
is($s->run('r1'), 'applied handler', 'a C runner on the coordinator applies r1 (tenant on worker 1)');
my $kr = "${ks}t:$t1:" . $c->safe_psql('postgres', "SELECT encode(idem_key('cr', 'r1'), 'hex')");
ok(defined $valkey->wait_for_key($kr, 10), '... worker 1 copies its result into the cluster keyspace');
is($s->run('r1'), 'replayed valkey', '... and the same runner replays it from Valkey');
my $shard1 = $cl->shard_of($t1);
$w1->safe_psql('postgres', "DELETE FROM $shard1 WHERE idempotency_key = idem_key('cr', 'r1')");
like(owner_is($ks, qr/^retired /), qr/^retired /,
	'a DELETE by hand on worker 1\'s shard: worker 1 retires the cluster keyspace it joined');
is($s->run('r1'), 'applied handler',
	'... the runner connected before applies r1 again, not replays it from the old keyspace');
is($c->safe_psql('postgres', q{SELECT count(*) FROM effects WHERE id = 'r1'}), '2',
	'... the effect ran again, as the removed row asks');
my $ksr = ks();
isnt($ksr, $ks, '... the coordinator names a new keyspace');
like(owner_is($ksr, qr/^[0-9a-f]{16}\z/), qr/^[0-9a-f]{16}\z/, '... with its own owner token');
# r1 applied again committed before worker 1 joined the new keyspace: its
# next PostgreSQL replay copies it there
my $r;
IdemValkey::poll_until(20, sub { $r = $s->run('r1'); $r eq 'replayed valkey' });
is($r, 'replayed valkey', '... which the runner, having learnt again, replays from Valkey');
cmp_ok(IdemValkey::stats_col($w1, 'skipped_unjoined'), '>=', 1,
	'... its copy made before worker 1 joined was counted in skipped_unjoined');
like(slurp_file($w1->logfile),
	qr/results were not copied to Valkey: their database is in a Citus cluster whose cache keyspace this node has not joined/,
	'... and logged with that reason');
$s->finish;
$ks = $ksr;

# ---------- a node's epoch changes: the cluster keyspace changes ----------
$w1->safe_psql('postgres', "DELETE FROM $shard1 WHERE idempotency_key = idem_key('s', 'a')");
my $ks2;
IdemValkey::poll_until(20, sub { $ks2 = ks(); $ks2 ne $ks && $ks2 ne 'none' });
isnt($ks2, $ks, 'rows deleted by hand from a shard on worker 1 give the cluster a new keyspace');
is(IdemValkey::wait_keyspace($w1), $ks2, '... which worker 1 joins for its new epoch');
complete($t1, 'after-delete');
my $k4 = "${ks2}t:$t1:" . hexkey('after-delete');
ok(defined $valkey->wait_for_key($k4, 10), '... and copies into');
is($valkey->command('EXISTS', "${ks}t:$t1:" . hexkey('after-delete')), '0',
	'... never into the old keyspace');

$c->safe_psql('postgres', "DELETE FROM idempotency_keys WHERE tenant_id = $t2 AND idempotency_key = idem_key('s', 'b')");
my $ks3;
IdemValkey::poll_until(20, sub { $ks3 = ks(); $ks3 ne $ks2 && $ks3 ne 'none' });
isnt($ks3, $ks2, 'a DELETE through the distributed table renews worker 2\'s epoch, and the cluster keyspace');

$w2->safe_psql('postgres', "SET citus.enable_manual_changes_to_shards = on; TRUNCATE " . $cl->shard_of($t2));
my $ks4;
IdemValkey::poll_until(20, sub { $ks4 = ks(); $ks4 ne $ks3 && $ks4 ne 'none' });
isnt($ks4, $ks3, 'TRUNCATE of a shard too');

# ---------- what is not a removal ----------
$c->safe_psql('postgres', qq{
	BEGIN;
	SELECT idem_claim($t1, idem_key('s', 'old1'), idem_fingerprint('{}'));
	SELECT idem_complete($t1, idem_key('s', 'old1'), '{}', '1 millisecond');
	COMMIT;
	BEGIN;
	SELECT idem_claim($t2, idem_key('s', 'old2'), idem_fingerprint('{}'));
	SELECT idem_complete($t2, idem_key('s', 'old2'), '{}', '1 millisecond');
	COMMIT;
});
usleep(50_000);
is($c->safe_psql('postgres', 'SELECT idem_purge(1000)'), '2',
	'idem_purge deletes expired rows on both workers\' shards');
is(ks(), $ks4, '... and keeps the keyspace');

my $sid = $c->safe_psql('postgres',
	"SELECT get_shard_id_for_distribution_column('idempotency_keys', ${t1}::bigint)");
$c->safe_psql('postgres', qq{
	SELECT citus_move_shard_placement($sid, '127.0.0.1', ${\ $w1->port}, '127.0.0.1', ${\ $w2->port},
		shard_transfer_mode => 'block_writes')});
# Citus drops the old placement after citus.defer_shard_delete_interval
IdemValkey::poll_until(20, sub {
	$w1->safe_psql('postgres', "SELECT to_regclass('$shard1') IS NULL") eq 't' });
is($w1->safe_psql('postgres', "SELECT to_regclass('$shard1') IS NULL"), 't',
	'the moved shard\'s old placement is dropped');
is(ks(), $ks4, 'a shard move (its placement created, altered and dropped) keeps the keyspace');

# ---------- a node restarted loses its join until the coordinator sends it again ----------
$w2->restart;
is(IdemValkey::wait_keyspace($w2, undef, 2), undef,
	'a restarted worker has no cluster keyspace of its own');
is(ks(), $ks4, 'a clean restart keeps the node\'s epoch and the cluster keyspace');
is(IdemValkey::wait_keyspace($w2), $ks4, '... and the coordinator joins it again');

# ---------- a node that does not answer is left out ----------
$w2->stop;
my $t0 = time;
my $ks5 = ks();
ok(time - $t0 < 15, 'with worker 2 down, the coordinator still names a keyspace, soon');
isnt($ks5, $ks4, '... another one: worker 2 is left out of it');
like(owner_is($ks4, qr/^retired /), qr/^retired /,
	'... the coordinator retires the keyspace it replaced');
is(IdemValkey::wait_keyspace($w1), $ks5, '... which worker 1 joins');
$w2->start;
is(ks(), $ks4, 'worker 2 back with its history unchanged: the keyspace is the one before');

IdemValkey::check_counters($_) foreach ($c, $w1, $w2);
$w1->stop;
$w2->stop;
$c->stop;
done_testing();
