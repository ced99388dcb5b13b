# Failover (issue 12), with a real streaming standby made by pg_basebackup:
# a message committed on the primary while the standby lagged, then run
# through the C runner against the promoted standby, is applied there (not
# replayed from the old primary's cache entry), exactly once.
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

my ($status, $source, $outcome) =
  IdemValkey::run_message($old, 'postgres', $valkey, 1, 'fo', 'm1', '{"x": 1}');
is("$status $source", 'applied handler', 'the old primary applies the message');
my $old_key = IdemValkey::tenant_key($old, 1, 'fo', 'm1');
ok(defined $valkey->wait_for_key($old_key, 10), '... and its worker copies the result');
$old->stop('immediate');

$new->start;
$new->promote;
ok(IdemValkey::poll_until(30,
		sub { $new->safe_psql('postgres', 'SELECT NOT pg_is_in_recovery()') eq 't' }),
	'the standby is promoted');
is($new->safe_psql('postgres', "SELECT count(*) FROM effects WHERE id = 'm1'"), '0',
	'it lacks the newest commit');
isnt(IdemValkey::keyspace($new), IdemValkey::keyspace_of_key($old_key),
	'its keyspace names the new timeline: ' . IdemValkey::keyspace($new));

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

$new->stop;
done_testing();
