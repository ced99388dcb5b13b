# idem.standby_slots (issue 12), with a real streaming standby made by
# pg_basebackup: a copy waits until the named standby has flushed its
# commit; a stopped standby holds copies back, a missing slot too.  By
# default ('*', issue 25) every physical slot a standby has used is waited
# for; '' waits for none.  Copies held back are said: last_error and the
# log name the standby's slot, idem_stats().queue_age shows the oldest
# one's wait; one whose retention ends meanwhile is skipped and counted.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use IdemValkey;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time usleep);

my $valkey = IdemValkey->new(name => 'valkey')->start;

sub commit_key
{
	my ($node, $id) = @_;
	$node->safe_psql('postgres', 'BEGIN; ' . IdemValkey::complete_sql('s', $id) . ' COMMIT;');
}

# --- idem.standby_slots ---
my $primary = IdemValkey::streaming_node('primary', $valkey, 'idem.standby_slots' => "'sb1'");
$primary->safe_psql('postgres', "SELECT pg_create_physical_replication_slot('sb1')");
my $standby = IdemValkey::standby_of($primary, 'standby', 'b1', "primary_slot_name = 'sb1'\n");
ok(-f $standby->data_dir . '/idem_cache_secret',
	'pg_basebackup copied the cache secret to the standby');
ok(IdemValkey::wait_connected($primary, 1), 'the primary\'s worker connects');

my $k1 = IdemValkey::tenant_key($primary, 1, 's', 'k1');
commit_key($primary, 'k1');
ok(defined $valkey->wait_for_key($k1, 10), 'with the standby streaming, a commit is copied');

$standby->stop;
my $k2 = IdemValkey::tenant_key($primary, 1, 's', 'k2');
commit_key($primary, 'k2');
usleep(2_000_000);
is($valkey->command('GET', $k2), undef,
	'with the standby named in idem.standby_slots stopped, the copy waits');
ok(IdemValkey::stats_col($primary, 'queue_depth') >= 1, '... in the queue');
$standby->start;
ok(defined $valkey->wait_for_key($k2, 20), 'once the standby has flushed it, it is copied');

$primary->safe_psql('postgres', "ALTER SYSTEM SET idem.standby_slots = 'sb1, nosuch'");
$primary->reload;
usleep(500_000);
my $k3 = IdemValkey::tenant_key($primary, 1, 's', 'k3');
commit_key($primary, 'k3');
ok(IdemValkey::poll_until(10,
		sub { IdemValkey::stats_col($primary, 'last_error') =~ /"nosuch".*does not exist/ }),
	'a missing slot is reported');
is($valkey->command('GET', $k3), undef, '... and holds copies back');
$primary->safe_psql('postgres', 'ALTER SYSTEM RESET idem.standby_slots');
$primary->reload;
ok(defined $valkey->wait_for_key($k3, 10), 'without it, the copy goes out');
my ($rc, $out, $err) = $primary->psql('postgres', "ALTER SYSTEM SET idem.standby_slots = 'Bad-Name'");
like($err, qr/not a valid replication slot name/, 'an invalid slot name is refused');
($rc, $out, $err) = $primary->psql('postgres', "ALTER SYSTEM SET idem.standby_slots = '*, sb1'");
like($err, qr/cannot be combined with slot names/, '"*" with slot names is refused');

# --- the default, '*': the standby of every physical slot (issue 25) ---
$primary->adjust_conf('postgresql.conf', 'idem.standby_slots', undef);
$primary->reload;
usleep(500_000);
is($primary->safe_psql('postgres', 'SHOW idem.standby_slots'), '*',
	'by default idem.standby_slots is *');
$primary->safe_psql('postgres', "SELECT pg_create_physical_replication_slot('unused')");
my $k4 = IdemValkey::tenant_key($primary, 1, 's', 'k4');
commit_key($primary, 'k4');
ok(defined $valkey->wait_for_key($k4, 10),
	'by default, with the standby streaming, a commit is copied (a slot no standby used is not waited for)');
$standby->stop;
my $log_at = -s $primary->logfile;
my $k5 = IdemValkey::tenant_key($primary, 1, 's', 'k5');
commit_key($primary, 'k5');
# a copy whose retention (2 s) ends while it is held back
$primary->safe_psql('postgres', 'SET idem.min_retention = 0; BEGIN; '
	  . IdemValkey::complete_sql('s', 'short', undef, '2 seconds') . ' COMMIT;');
my $short_at = time();
my $expired0 = IdemValkey::stats_col($primary, 'skipped_expired');
usleep(2_000_000);
is($valkey->command('GET', $k5), undef,
	'by default, with the standby of a physical slot stopped, the copy waits');
ok( IdemValkey::poll_until(5,
		sub { IdemValkey::stats_col($primary, 'last_error') =~ /copies held back .*slot "sb1".*no standby is connected/ }),
	'last_error names the slot whose standby holds the copies back')
  or diag(IdemValkey::stats_col($primary, 'last_error'));
like(slurp_file($primary->logfile, $log_at),
	qr/results have waited \d+ s to be copied to Valkey: the standby of replication slot "sb1"/,
	'... and so does the log');
cmp_ok(IdemValkey::stats_col($primary, 'extract(epoch FROM queue_age)'), '>=', 1.5,
	'idem_stats().queue_age is the oldest held copy\'s wait');
usleep(1_000_000) while time() < $short_at + 3;
$primary->safe_psql('postgres', "ALTER SYSTEM SET idem.standby_slots = ''");
$primary->reload;
ok(defined $valkey->wait_for_key($k5, 10),
	"with idem.standby_slots = '' no standby is waited for: the copy goes out");
ok( IdemValkey::poll_until(10,
		sub { IdemValkey::stats_col($primary, 'skipped_expired') == $expired0 + 1 }),
	'the copy whose retention ended while it was held back is skipped and counted');
is($valkey->command('GET', IdemValkey::tenant_key($primary, 1, 's', 'short')), undef,
	'... not copied');
like(slurp_file($primary->logfile, $log_at),
	qr/1 results were not copied to Valkey: their retention ended while they waited in the commit ring/,
	'... and logged with its reason');
IdemValkey::check_counters($primary);
$primary->safe_psql('postgres', 'ALTER SYSTEM RESET idem.standby_slots');
$primary->reload;
usleep(500_000);
my $k6 = IdemValkey::tenant_key($primary, 1, 's', 'k6');
commit_key($primary, 'k6');
usleep(2_000_000);
is($valkey->command('GET', $k6), undef, 'back to the default, the next copy waits again');
$standby->start;
ok(defined $valkey->wait_for_key($k6, 20), 'once the standby has caught up, it is copied');
IdemValkey::check_counters($primary);

# From 18 a slot invalidated for idle_replication_slot_timeout keeps its
# restart_lsn, which never moves again: '*' must not wait for it.
SKIP:
{
	skip 'idle_replication_slot_timeout is new in PostgreSQL 18', 2
	  if $primary->pg_version < 18;
	$primary->safe_psql('postgres', "SELECT pg_create_physical_replication_slot('idle', true)");
	$primary->safe_psql('postgres', "ALTER SYSTEM SET idle_replication_slot_timeout = '1s'");
	$primary->reload;
	usleep(1_500_000);
	ok(IdemValkey::poll_until(20, sub {
				$primary->safe_psql('postgres', 'CHECKPOINT');
				$primary->safe_psql('postgres',
					"SELECT invalidation_reason FROM pg_replication_slots WHERE slot_name = 'idle'") eq
				  'idle_timeout'
			}),
		'a reserved slot left idle is invalidated (idle_timeout)');
	my $k7 = IdemValkey::tenant_key($primary, 1, 's', 'k7');
	commit_key($primary, 'k7');
	ok(defined $valkey->wait_for_key($k7, 10),
		'by default, a slot invalidated with its restart_lsn kept is not waited for');
	$primary->safe_psql('postgres', 'ALTER SYSTEM RESET idle_replication_slot_timeout');
	$primary->reload;
	$primary->safe_psql('postgres', "SELECT pg_drop_replication_slot('idle')");
}

# --- the asynchronous standby promoted, with the default settings ---
$standby->stop;
my ($status, $source) = IdemValkey::run_message($primary, 'postgres', $valkey, 1, 'fo', 'p8', '{}');
is("$status $source", 'applied handler', 'the primary applies p8 while its standby is stopped');
usleep(2_000_000);
my $p8 = IdemValkey::parse_value($valkey->command('GET', IdemValkey::tenant_key($primary, 1, 'fo', 'p8')));
ok(!defined $p8 || $p8->{kind} eq 'p',
	"... and, by default, does not copy its result (at most the runner's marker is there)");
$primary->stop('immediate');
$standby->start;
ok(IdemValkey::promote_and_wait($standby),
	'the standby is promoted');
is($standby->safe_psql('postgres', "SELECT count(*) FROM effects WHERE id = 'p8'"), '0',
	'it lacks p8');
($status, $source) = IdemValkey::run_message($standby, 'postgres', $valkey, 1, 'fo', 'p8', '{}');
is("$status $source", 'applied handler', 'the promoted standby applies the redelivery of p8');
is($standby->safe_psql('postgres', "SELECT count(*) FROM effects WHERE id = 'p8'"), '1',
	'... once');
$standby->stop;

done_testing();
