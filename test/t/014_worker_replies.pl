# The worker's reply classes (issue 12): a Valkey that cannot take writes
# now (a replica: READONLY; loading its dataset: LOADING; too few replicas:
# NOREPLICAS; memory full: OOM; a password it does not accept: WRONGPASS /
# NOAUTH) keeps the batch, and every copy
# arrives once the server takes writes again; only a reply that condemns one
# record (NOPERM for a key the server's ACL does not allow) drops that
# record, counted apart in idem_stats().
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use IdemValkey;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use IPC::Run;
use Time::HiRes qw(time usleep);

my $primary = IdemValkey->new(name => 'primary')->start;
my $valkey = IdemValkey->new(name => 'valkey', extra => [ '--enable-debug-command', 'yes' ])->start;
my $node = IdemValkey::idem_node('replies', $valkey,
	'idem.valkey_connect_timeout' => "'500ms'");
ok(IdemValkey::wait_connected($node, 1), 'worker connects to Valkey');

sub stat_of { IdemValkey::stats_col($node, $_[0]) }
sub key_of { IdemValkey::tenant_key($node, 1, 'r', $_[0]) }

sub commit_keys
{
	my ($tag, $n) = @_;
	$node->safe_psql('postgres', join "\n",
		map { 'BEGIN; ' . IdemValkey::complete_sql('r', "$tag-$_") . ' COMMIT;' } 1 .. $n);
}

sub all_copied
{
	my ($server, $tag, $n, $timeout) = @_;
	return IdemValkey::poll_until($timeout // 15, sub {
		foreach my $i (1 .. $n)
		{
			return 0 unless defined eval { $server->command('GET', key_of("$tag-$i")) };
		}
		return 1;
	});
}

sub none_copied
{
	my ($server, $tag, $n) = @_;
	foreach my $i (1 .. $n)
	{
		return 0 if defined eval { $server->command('GET', key_of("$tag-$i")) };
	}
	return 1;
}

commit_keys('up', 3);
ok(all_copied($valkey, 'up', 3), 'baseline: commits are copied');

# --- a replica answers READONLY: the batch waits for it to be promoted ---
my $errors0 = stat_of('copy_errors');
$valkey->command('REPLICAOF', '127.0.0.1', $primary->port);
IdemValkey::poll_until(10, sub {
	($valkey->command('INFO', 'replication') // '') =~ /master_link_status:up/ });
commit_keys('ro', 5);
ok(IdemValkey::poll_until(10, sub { stat_of('copy_errors') > $errors0 }),
	'READONLY replies are counted as copy errors');
like(stat_of('last_error'), qr/READONLY/, 'last_error names READONLY');
ok(none_copied($valkey, 'ro', 5) && none_copied($primary, 'ro', 5),
	'nothing is written while the server is a replica');
is(stat_of('rejected'), '0', 'no record is rejected for it');
$valkey->command('REPLICAOF', 'NO', 'ONE');
ok(all_copied($valkey, 'ro', 5), 'once promoted, every copy held back arrives');
is(stat_of('queue_depth'), '0', '... and the queue is empty');

# --- a server that takes no writes until it is mended: NOREPLICAS, OOM ---
# (valkey_reply.c: both keep the batch.)  NOREPLICAS refuses the owner
# key's check too, so it is set while the worker is inside a drain: with a
# batch delay of 300 ms and a commit every 30 ms, each batch finds the next
# one's records waiting and the drain does not return to the main loop
# (where the check is).  Its SETs then get NOREPLICAS, which dropped every
# record as rejected before the worker and the router shared one list.
$node->safe_psql('postgres', q{
CREATE PROCEDURE stream_keys(tag text, secs float8) LANGUAGE plpgsql AS $$
DECLARE
	i int := 0;
	stop timestamptz := clock_timestamp() + secs * interval '1 second';
BEGIN
	WHILE clock_timestamp() < stop LOOP
		i := i + 1;
		PERFORM idem_claim(1, idem_key('r', tag || '-' || i), idem_fingerprint('{}'));
		PERFORM idem_complete(1, idem_key('r', tag || '-' || i), '{"ok": true}');
		COMMIT;
		PERFORM pg_sleep(0.03);
	END LOOP;
	RAISE NOTICE 'streamed %', i;
END $$;});
$node->append_conf('postgresql.conf', "idem.valkey_batch_delay = '300ms'\n");
$node->reload;
{
	my ($rejected, $copied, $errors) = map { stat_of($_) } qw(rejected copied copy_errors);
	my ($out, $err) = ('', '');
	my $h = IPC::Run::start(
		[ 'psql', '-X', '-d', $node->connstr('postgres'), '-c',
		  "CALL stream_keys('norep', 3)" ],
		'>', \$out, '2>', \$err);
	usleep(1_000_000);
	$valkey->command('CONFIG', 'SET', 'min-replicas-to-write', '1');
	ok(IdemValkey::poll_until(10, sub { stat_of('last_error') =~ /NOREPLICAS/ }),
		'NOREPLICAS replies are reported');
	usleep(1_000_000);
	$valkey->command('CONFIG', 'SET', 'min-replicas-to-write', '0');
	$h->finish;
	my ($n) = $err =~ /streamed (\d+)/;
	ok(defined $n && $n > 0, "NOREPLICAS: commits streamed in meanwhile (${\($n // 0)})");
	ok(IdemValkey::poll_until(15, sub { stat_of('queue_depth') == 0 }),
		'NOREPLICAS: the queue drains once the server takes writes');
	is(stat_of('rejected'), $rejected, 'NOREPLICAS: no record is rejected for it');
	ok(stat_of('copy_errors') > $errors, 'NOREPLICAS: counted as copy errors');
	ok(all_copied($valkey, 'norep', $n // 1),
		'NOREPLICAS: every copy held back arrives');
}
$node->append_conf('postgresql.conf', "idem.valkey_batch_delay = '1ms'\n");
$node->reload;

# OOM: memory full (maxmemory, noeviction)
{
	my ($errors, $rejected) = map { stat_of($_) } qw(copy_errors rejected);
	$valkey->command('CONFIG', 'SET', 'maxmemory-policy', 'noeviction');
	$valkey->command('CONFIG', 'SET', 'maxmemory', '1');
	commit_keys('oom', 4);
	ok(IdemValkey::poll_until(10, sub { stat_of('last_error') =~ /OOM/ }),
		'OOM replies are reported');
	ok(stat_of('copy_errors') > $errors && none_copied($valkey, 'oom', 4),
		'OOM: counted as copy errors, nothing written');
	is(stat_of('rejected'), $rejected, 'OOM: no record is rejected for it');
	$valkey->command('CONFIG', 'SET', 'maxmemory', '0');
	ok(all_copied($valkey, 'oom', 4), 'OOM: once mended, every copy held back arrives');
}

# --- a password the server does not accept: NOAUTH, then WRONGPASS ---
$valkey->command('CONFIG', 'SET', 'requirepass', 'sesame');
$valkey->command('AUTH', 'sesame');
$valkey->command('CLIENT', 'KILL', 'TYPE', 'normal', 'SKIPME', 'yes');    # the worker reconnects
commit_keys('auth', 4);
usleep(1_500_000);
ok(none_copied($valkey, 'auth', 4), 'without the password nothing is written');
like(stat_of('last_error'), qr/NOAUTH/, 'last_error names NOAUTH');
$node->append_conf('postgresql.conf', "idem.valkey_password = 'wrong'\n");
$node->reload;
usleep(1_500_000);
like(stat_of('last_error'), qr/WRONGPASS|invalid password/i,
	'a wrong password is reported');
ok(none_copied($valkey, 'auth', 4), 'nothing is written with a wrong password');
$valkey->command('CONFIG', 'SET', 'requirepass', 'wrong');
ok(all_copied($valkey, 'auth', 4), 'once the server takes the password, every copy arrives');
$valkey->command('CONFIG', 'SET', 'requirepass', '');
$node->append_conf('postgresql.conf', "idem.valkey_password = ''\n");
$node->reload;
ok(IdemValkey::wait_connected($node, 1), 'the worker reconnects without a password');

# --- a loading server answers LOADING until its dataset is in memory ---
$valkey->command('DEBUG', 'POPULATE', '8000', 'filler');
$valkey->command('SAVE');
$valkey->stop;
$valkey->start(loading => 1,
	args => [ '--key-load-delay', '300', '--loading-process-events-interval-bytes', '1024' ]);
my $t_loading = time();
commit_keys('load', 5);
ok(IdemValkey::poll_until(10, sub { stat_of('last_error') =~ /LOADING/ }),
	'LOADING replies are reported');
my $still_loading = (eval { $valkey->command('PING') } // '') ne 'PONG';
ok($still_loading && none_copied($valkey, 'load', 5),
	sprintf('nothing is written while the server loads (%.1f s after its start)', time() - $t_loading));
ok(all_copied($valkey, 'load', 5, 60), sprintf('once loaded, every copy arrives (%.1f s)', time() - $t_loading));
$valkey->stop;
unlink($valkey->dir . '/dump.rdb');
$valkey->start;

# --- a reply that condemns one record drops that record only ---
ok(IdemValkey::wait_connected($node, 1), 'the worker is connected again');
my $rejected0 = stat_of('rejected');
# The default user may write tenant keys (and the epoch owner key, without
# which nothing is copied) only: a platform key gets NOPERM.
$valkey->command('ACL', 'SETUSER', 'default', 'resetkeys', '~*:t:*', '~*:owner');
$node->safe_psql('postgres', join "\n",
	'BEGIN; ' . IdemValkey::complete_sql('r', 'perm-1') . ' COMMIT;',
	q{BEGIN; SELECT idem_platform_claim(idem_key('r', 'perm-2'), idem_fingerprint('{}'));
	  SELECT idem_platform_complete(idem_key('r', 'perm-2'), '{}'); COMMIT;},
	'BEGIN; ' . IdemValkey::complete_sql('r', 'perm-3') . ' COMMIT;');
ok(defined $valkey->wait_for_key(key_of('perm-3'), 10)
	  && defined $valkey->command('GET', key_of('perm-1')),
	'the records around a refused one are copied');
ok(IdemValkey::poll_until(5, sub { stat_of('rejected') == $rejected0 + 1 }),
	'the refused record is dropped and counted as rejected');
like(stat_of('last_error'), qr/NOPERM/, 'last_error names NOPERM');
is(stat_of('queue_depth'), '0', '... and it is not retried');
$valkey->command('ACL', 'SETUSER', 'default', 'allkeys');
is($valkey->command('GET', IdemValkey::platform_key($node, 'r', 'perm-2')), undef,
	'the refused record was not written');

IdemValkey::check_counters($node);
$node->stop;
done_testing();
