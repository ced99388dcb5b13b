# Copies wait for the synchronous standbys (issue 25), whatever
# idem.standby_slots says: a commit that did not wait for synchronous
# replication (synchronous_commit = local here; a COMMIT whose wait was
# cancelled is the same) is committed on the primary only, and a failover
# to the synchronous standby would lose it.  It is copied to Valkey only
# once that standby has flushed it.  A replay of it to a session with
# synchronous_commit = on waits for the standby too, and a cancelled wait
# answers nothing (57014).
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

# No standby slot at all: only synchronous replication is in play.
my $primary = IdemValkey::streaming_node('primary', $valkey, 'idem.standby_slots' => "''");
$primary->backup('b1');
my $standby = PostgreSQL::Test::Cluster->new('standby');
$standby->init_from_backup($primary, 'b1', has_streaming => 1);
$standby->start;
$primary->safe_psql('postgres', "ALTER SYSTEM SET synchronous_standby_names = 'standby'");
$primary->reload;
ok(IdemValkey::poll_until(30, sub {
			$primary->safe_psql('postgres',
				"SELECT sync_state FROM pg_stat_replication WHERE application_name = 'standby'") eq 'sync'
		}),
	'the standby is synchronous');
ok(IdemValkey::wait_connected($primary, 1), 'the primary\'s worker connects');

my $claim = q{SELECT decision FROM idem_claim(1, idem_key('s', 'k2'), idem_fingerprint('{}'))};

my $k1 = IdemValkey::tenant_key($primary, 1, 's', 'k1');
$primary->safe_psql('postgres', 'BEGIN; ' . IdemValkey::complete_sql('s', 'k1') . ' COMMIT;');
ok(defined $valkey->wait_for_key($k1, 10), 'a synchronous commit is copied');

$standby->stop;
my $k2 = IdemValkey::tenant_key($primary, 1, 's', 'k2');
$primary->safe_psql('postgres',
	'SET synchronous_commit = local; BEGIN; ' . IdemValkey::complete_sql('s', 'k2') . ' COMMIT;');
usleep(2_000_000);
is($valkey->command('GET', $k2), undef,
	'a commit the synchronous standby lacks is not copied');

my ($rc, $out, $err) = $primary->psql('postgres', "SET statement_timeout = '1s'; $claim");
isnt($out, 'completed', 'a replay of it to a session with synchronous_commit = on is not answered');
like($err, qr/canceling the idem replay while it waited for synchronous replication/,
	'... its wait for the synchronous standby, cancelled, raises an error');
is($primary->safe_psql('postgres', "SET synchronous_commit = local; $claim"), 'completed',
	'a session with synchronous_commit = local is answered at once');

$standby->start;
ok(defined $valkey->wait_for_key($k2, 30), 'once the synchronous standby has it, it is copied');
is($primary->safe_psql('postgres', $claim), 'completed', '... and replayed with synchronous_commit = on');

$standby->stop;
$primary->stop;

done_testing();
