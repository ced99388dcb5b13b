# Copies wait for the synchronous standbys (issue 25), whatever
# idem.standby_slots says: a commit that did not wait for synchronous
# replication (synchronous_commit = local here; a COMMIT whose wait was
# cancelled is the same) is committed on the primary only, and a failover
# to the synchronous standby would lose it.  It is copied to Valkey only
# once that standby has flushed it.  A replay of it to a session with
# synchronous_commit = on waits for the standby too, and a cancelled wait
# answers nothing (57014), without the warning of a COMMIT's cancelled wait.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use IdemValkey;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use IPC::Run;
use Time::HiRes qw(usleep);

my $valkey = IdemValkey->new(name => 'valkey')->start;

# No standby slot at all: only synchronous replication is in play.
my $primary = IdemValkey::streaming_node('primary', $valkey, 'idem.standby_slots' => "''");
my $standby = IdemValkey::sync_standby($primary);
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
unlike($err, qr/already committed locally|canceling wait for synchronous replication/,
	'... without PostgreSQL\'s warning that the transaction committed locally (a replay committed nothing)');
is($primary->safe_psql('postgres', "SET synchronous_commit = local; $claim"), 'completed',
	'a session with synchronous_commit = local is answered at once');

$standby->start;
ok(defined $valkey->wait_for_key($k2, 30), 'once the synchronous standby has it, it is copied');
is($primary->safe_psql('postgres', $claim), 'completed', '... and replayed with synchronous_commit = on');

# --- a COMMIT's wait cancelled, then the synchronous standby promoted ---
$standby->stop;
my $k3 = IdemValkey::tenant_key($primary, 1, 's', 'k3');
# (statement_timeout does not reach a COMMIT's wait: cancel it from outside)
my ($cout, $cerr) = ('', '');
my $h = IPC::Run::start(
	[ 'psql', '-X', '-d', $primary->connstr('postgres'), '-c',
	  "BEGIN; INSERT INTO effects VALUES ('s', 'k3'); "
		. IdemValkey::complete_sql('s', 'k3') . ' COMMIT;' ],
	'>', \$cout, '2>', \$cerr);
ok(IdemValkey::poll_until(30, sub {
			$primary->safe_psql('postgres',
				"SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'") eq '1' }),
	'a COMMIT waits for the stopped synchronous standby');
$primary->safe_psql('postgres',
	"SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE wait_event = 'SyncRep'");
$h->finish;
like($cerr, qr/canceling wait for synchronous replication/,
	'... its wait is cancelled');
is($primary->safe_psql('postgres',
		"SET synchronous_commit = local; SELECT count(*) FROM effects WHERE id = 'k3'"),
	'1', '... is committed on the primary');
usleep(2_000_000);
is($valkey->command('GET', $k3), undef, '... and not copied to Valkey');
$primary->stop('immediate');
$standby->start;
ok(IdemValkey::promote_and_wait($standby),
	'the synchronous standby is promoted');
is($standby->safe_psql('postgres', "SELECT count(*) FROM effects WHERE id = 'k3'"), '0',
	'it lacks the commit whose wait was cancelled');
my ($status, $source) = IdemValkey::run_message($standby, 'postgres', $valkey, 1, 's', 'k3', '{}');
is("$status $source", 'applied handler', 'the redelivery is applied on the new primary, not replayed');
is($standby->safe_psql('postgres', "SELECT count(*) FROM effects WHERE id = 'k3'"), '1',
	'... once');

IdemValkey::check_counters($standby);
$standby->stop;

done_testing();
