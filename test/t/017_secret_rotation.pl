# Rotating the cache secret (issue 12), with a real Valkey and the C runner.
# idem_rotate_cache_secret() makes a new current secret and keeps the one
# before it accepted: entries written under it still replay, new copies
# carry the new key id, and a runner connected before the rotation learns
# the new secret when it meets its key id.  Once a secret is rotated out
# (a second rotation), what was written under it is ignored: PostgreSQL
# answers and repopulates, and a value forged with it (a leaked secret) is
# never trusted, also by a runner that stays connected.  Through all of it
# every message's effect happens exactly once.
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
my $node = IdemValkey::idem_node('rotation', $valkey);
$node->safe_psql('postgres', 'CREATE TABLE effects (scope text, id text)');
ok(IdemValkey::wait_connected($node, 1), 'worker connects to Valkey');

my $request = '{"r": 1}';
sub run
{
	my ($status, $source) =
	  IdemValkey::run_message($node, 'postgres', $valkey, 1, 'rot', $_[0], $request);
	return "$status $source";
}
sub effects
{
	return $node->safe_psql('postgres', "SELECT count(*) FROM effects WHERE id = '$_[0]'");
}
sub key_of { return IdemValkey::tenant_key($node, 1, 'rot', $_[0]); }
sub value_of { return $valkey->command('GET', key_of($_[0])); }
sub key_id_of
{
	my $v = IdemValkey::parse_value(value_of($_[0]));
	return $v ? $v->{key_id} : 'none';
}
sub secrets { return IdemValkey::secrets($node); }
sub secret_hex { return IdemValkey::secret_hex($node, $_[0]); }
# A completed value for message $id, MACed under $key_id with $hex.
sub forge
{
	my ($id, $key_id, $hex, $fingerprint) = @_;
	IdemValkey::forge_value($valkey, key_of($id), $key_id, $hex, $fingerprint);
}

# --- before: one secret, key id 1 ---
is(secrets(), '1*', 'one secret, key id 1');
my $secret1 = secret_hex(1);
is(run('m1'), 'applied handler', 'm1 is applied');
ok(defined $valkey->wait_for_key(key_of('m1'), 10), '... and copied into Valkey');
is(key_id_of('m1'), 1, '... under key id 1');
my $m1_under_1 = value_of('m1');
my $fingerprint = IdemValkey::parse_value($m1_under_1)->{fingerprint};
is(run('m1'), 'replayed valkey', 'a redelivery replays from Valkey');

# Two runners stay connected from here to the end: one re-reads the secrets
# when it meets an unknown key id and every 60 s (secrets_max_age_ms 0, the
# longest), the other also every 3 s (secrets_max_age_ms; 5 s by default).
my $long;
my $aging;
{
	local $ENV{IDEM_SECRETS_MAX_AGE_MS} = '0';
	$long = IdemValkey::runner_session($node, 'postgres', $valkey, 1, 'rot', $request);
	$ENV{IDEM_SECRETS_MAX_AGE_MS} = '3000';
	$aging = IdemValkey::runner_session($node, 'postgres', $valkey, 1, 'rot', $request);
}
is($long->run('m1'), 'replayed valkey', 'a runner that stays connected replays m1 from Valkey');
is($aging->run('m1'), 'replayed valkey', '... as does the other one');

# --- first rotation: key id 2, and 1 still accepted ---
is($node->safe_psql('postgres', 'SELECT idem_rotate_cache_secret()'), '2',
	'the rotation returns key id 2');
is(secrets(), '1 2*', 'key id 2 is current, 1 is still accepted');
like(slurp_file($node->data_dir . '/idem_cache_secret'),
	qr/^timeline 1\nepoch [0-9a-f]{16}\ntoken [0-9a-f]{16}\n1 [0-9a-f]{64}\n2 [0-9a-f]{64}\n\z/,
	'the secret file holds both, and the timeline they were made on');
is(key_id_of('m1'), 1, "m1's entry under key id 1 is still in Valkey");
is(run('m1'), 'replayed valkey', '... and a new runner replays it from Valkey');
is($long->run('m1'), 'replayed valkey', '... as does the runner connected before the rotation');

is(run('m2'), 'applied handler', 'm2 is applied');
ok(defined $valkey->wait_for_key(key_of('m2'), 10), '... and copied into Valkey');
is(key_id_of('m2'), 2, '... under the new key id 2');
ok(IdemValkey::mac_ok($node, key_of('m2'), value_of('m2')), '... MACed with the new secret');
my $rejected = $long->rejected;
is($long->run('m2'), 'replayed postgres',
	'the runner connected before the rotation does not know key id 2 yet: PostgreSQL answers');
cmp_ok($long->rejected, '>', $rejected, '... and the value was counted as ignored');
usleep(1_100_000);    # it re-learns at most once a second
is($long->run('m2'), 'replayed valkey', '... then it learns the new secret: Valkey answers');

# --- second rotation: key id 1 is rotated out ---
is($node->safe_psql('postgres', 'SELECT idem_rotate_cache_secret()'), '3',
	'a second rotation returns key id 3');
is(secrets(), '2 3*', 'key id 1 is no longer accepted');
is(key_id_of('m1'), 1, "m1's entry under key id 1 is still in Valkey");
is(run('m1'), 'replayed postgres', '... a new runner ignores it: PostgreSQL answers');
ok(IdemValkey::poll_until(10, sub { key_id_of('m1') eq '3' }),
	'... and that read repopulates it under key id 3');
is($long->run('m2'), 'replayed valkey', "m2's entry under key id 2 still replays from Valkey");

# A value forged with the rotated-out secret (as after a leak: the reason
# to rotate twice) is never trusted, by a new runner or, once its
# secrets_max_age_ms has passed, by one that learnt the secrets while key
# id 1 was still accepted.
forge('m3', 1, $secret1, $fingerprint);
is(run('m3'), 'applied handler', 'a value forged with the rotated-out secret: m3 is applied');
is(effects('m3'), '1', '... once');
forge('m4', 1, $secret1, $fingerprint);
usleep(3_500_000);
is($aging->run('m4'), 'applied handler',
	'a runner connected before both rotations does not trust it either: m4 is applied');
is(effects('m4'), '1', '... once');
# The old entry of m1, put back: that runner ignores it too.
$valkey->command('SET', key_of('m1'), $m1_under_1, 'PX', '3600000');
is($aging->run('m1'), 'replayed postgres', "m1's old entry is ignored by that runner too");

# --- no effect lost or doubled ---
is(effects('m1'), '1', 'm1 was applied exactly once');
is(effects('m2'), '1', 'm2 was applied exactly once');
is($node->safe_psql('postgres', 'SELECT count(*) FROM effects'), '4',
	'four messages, four effects');
$long->finish;
$aging->finish;

# A temporary secret file a crashed rotation left behind is removed at the
# next start; the secrets stay.
my $before = secrets() . ' ' . secret_hex(3);
my $stale = $node->data_dir . '/idem_cache_secret.4242.tmp';
my $other = $node->data_dir . '/idem_cache_secret.4242.tmp.keep';
append_to_file($stale, "4 " . ('ab' x 32) . "\n");
append_to_file($other, "not ours\n");
$node->restart;
ok(IdemValkey::poll_until(10, sub { !-e $stale }),
	'a stale temporary secret file is removed at the next start');
ok(-e $other, '... and nothing else');
is(secrets() . ' ' . secret_hex(3), $before, '... and the secrets are unchanged');

$node->stop;
done_testing();
