# Failover (issue 12), with a real streaming standby made by pg_basebackup:
# a message committed on the primary while the standby lagged, then run
# through the C runner against the promoted standby, is applied there (not
# replayed from the old primary's cache entry), exactly once.  The old
# primary rotated its cache secret out after the backup (as after a leak);
# the promoted standby writes and reads its new timeline's values with a
# secret of its own, so a value forged with the one it was made with is
# not trusted.
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

# --- failover to a standby that lacks the newest commit ---
my $old = IdemValkey::streaming_node('old_primary', $valkey);
$old->backup('b2');
my $new = PostgreSQL::Test::Cluster->new('new_primary');
$new->init_from_backup($old, 'b2', has_streaming => 1);
$new->start;
$old->wait_for_catchup($new);
$new->stop;    # the standby lags from here on

sub secrets { IdemValkey::secrets(@_) }
sub secret_hex { IdemValkey::secret_hex(@_) }
my $leaked = secret_hex($old, 1);
$old->safe_psql('postgres', 'SELECT idem_rotate_cache_secret()') for 1 .. 2;
is(secrets($old), '2 3*', 'the old primary rotated key id 1 out (not replicated)');

my ($status, $source, $outcome) =
  IdemValkey::run_message($old, 'postgres', $valkey, 1, 'fo', 'm1', '{"x": 1}');
is("$status $source", 'applied handler', 'the old primary applies the message');
my $old_key = IdemValkey::tenant_key($old, 1, 'fo', 'm1');
ok(defined $valkey->wait_for_key($old_key, 10), '... and its worker copies the result');
$old->stop('immediate');

$new->start;
ok(IdemValkey::promote_and_wait($new),
	'the standby is promoted');
is($new->safe_psql('postgres', "SELECT count(*) FROM effects WHERE id = 'm1'"), '0',
	'it lacks the newest commit');
isnt(IdemValkey::keyspace($new), IdemValkey::keyspace_of_key($old_key),
	'its keyspace names the new timeline: ' . IdemValkey::keyspace($new));
is(secrets($new), '2*',
	'it made itself a new secret for it: key id 2 alone, not the key id 1 it was made with');
isnt(secret_hex($new, 2), $leaked, '... a secret of its own');
like(slurp_file($new->data_dir . '/idem_cache_secret'), qr/^timeline 2\nepoch [0-9a-f]{16}\ntoken [0-9a-f]{16}\nretire 1 [0-9a-f]{16}\n2 [0-9a-f]{64}\n\z/,
	'its secret file names timeline 2, and the old primary\'s epoch it retired');

($status, $source, $outcome) =
  IdemValkey::run_message($new, 'postgres', $valkey, 1, 'fo', 'm1', '{"x": 1}');
is("$status $source", 'applied handler',
	'the same message is applied on the new primary, not replayed from the old cache entry');
($status, $source, $outcome) =
  IdemValkey::run_message($new, 'postgres', $valkey, 1, 'fo', 'm1', '{"x": 1}');
is($status, 'replayed', "a further delivery is a replay ($source)");
like($outcome, qr/"node": "new_primary"/, '... of the new primary\'s outcome');
is($new->safe_psql('postgres', "SELECT count(*) FROM effects WHERE id = 'm1'"), '1',
	'the effect happened exactly once on the new primary');
my $new_key = IdemValkey::tenant_key($new, 1, 'fo', 'm1');
my $v = IdemValkey::parse_value($valkey->command('GET', $new_key));
is($v->{key_id}, 2, "the new primary's copy carries key id 2");
ok(IdemValkey::mac_ok($new, $new_key, $valkey->command('GET', $new_key)),
	'... MACed with its new secret');

# A value forged with the secret the standby was made with, in the new
# keyspace: not trusted (the old code kept that secret current).
IdemValkey::check_forged_ignored($new, $valkey, 'fo', 'm2', $leaked,
	$v->{fingerprint}, 'the rotated-out secret');

# A restart on the same timeline keeps the secret.
my $secret2 = secret_hex($new, 2);
$new->restart;
is(secrets($new) . ' ' . secret_hex($new, 2), "2* $secret2",
	'a restart on the same timeline keeps the secret');

IdemValkey::check_counters($new);
$new->stop;
done_testing();
