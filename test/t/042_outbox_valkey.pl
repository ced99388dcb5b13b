# The streams' own Valkey (idem.outbox_valkey_*): the publishers send to
# it, not to the cache's Valkey, so flushing or restarting the cache empty
# loses no published message; a reload moves publishing (to another
# Valkey, with a password file; back to the cache's when unset).  And the
# pipelined publishing: one stream that Valkey refuses holds back its own
# messages only, which then go out whole and in order, once each.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use IdemValkey;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(usleep);

my $cache = IdemValkey->new(name => 'cache')->start;
my $streams = IdemValkey->new(name => 'streams', extra => [ '--appendonly', 'yes' ])->start;
my $node = IdemValkey::idem_node('node', $cache,
	'idem.outbox_valkey_host' => "'127.0.0.1'",
	'idem.outbox_valkey_port' => $streams->port,
	'idem.outbox_valkey_db' => 3);
ok(IdemValkey::wait_connected($node, 1), 'the worker connects to the cache');

my $runs = 0;

# One run that emits each (stream, body) pair, in one transaction.
sub emit
{
	my @pairs = @_;
	my $id = 'r' . ++$runs;
	my $sql = "BEGIN; SELECT (idem_claim(1, idem_key('o', '$id'), idem_fingerprint('{}'))).decision;";
	while (my ($stream, $body) = splice(@pairs, 0, 2))
	{
		$sql .= " SELECT idem_emit('$stream', '$body');";
	}
	$sql .= " SELECT idem_complete(1, idem_key('o', '$id'), '{}'); COMMIT;";
	$node->safe_psql('postgres', $sql);
}

sub waiting { return IdemValkey::stats_col($node, 'outbox_waiting'); }

sub in_db
{
	my ($v, $db, @cmd) = @_;
	$v->command('SELECT', $db);
	my $r = $v->command(@cmd);
	$v->command('SELECT', 0);
	return $r;
}

sub xlen { my ($v, $db, $stream) = @_; return in_db($v, $db, 'XLEN', $stream) // 0; }

sub bodies
{
	my ($v, $db, $stream) = @_;
	return [ map { $_->[1][3] } @{ in_db($v, $db, 'XRANGE', $stream, '-', '+') // [] } ];
}

# --- published to the streams' Valkey, never to the cache's ---
emit('st.a', qq({"n": $_})) foreach 1 .. 5;
ok(IdemValkey::poll_until(20, sub { xlen($streams, 3, 'st.a') >= 5 }),
	'messages go to the streams\' Valkey (idem.outbox_valkey_host, _port, _db)');
is(xlen($cache, 0, 'st.a'), 0, '... and not to the cache\'s Valkey');
ok(IdemValkey::poll_until(10, sub { waiting() eq '0' }), '... and leave the outbox');

# --- the cache flushed and restarted empty: every message is still there ---
$cache->command('FLUSHALL');
$cache->stop;
emit('st.a', qq({"n": $_})) foreach 6 .. 8;
ok(IdemValkey::poll_until(20, sub { xlen($streams, 3, 'st.a') >= 8 }),
	'the cache down: publishing goes on');
$cache->start;
ok(IdemValkey::wait_connected($node, 1), 'the cache restarted empty: the worker is back');
is_deeply(bodies($streams, 3, 'st.a'), [ map { qq({"n":$_}) } 1 .. 8 ],
	'... and the streams\' Valkey kept every message, in order');
$streams->stop;
$streams->start;
is(xlen($streams, 3, 'st.a'), 8, 'the streams\' Valkey (appendonly) keeps them across its own restart');

# --- one stream refused: the others go on; it goes out whole, in order ---
$streams->command('SELECT', 3);
$streams->command('SET', 'st.bad', 'a string, not a stream');
$streams->command('SELECT', 0);
my $errors0 = IdemValkey::stats_col($node, 'publish_errors');
emit(map { ('st.bad', qq({"b": $_}), 'st.good', qq({"g": $_})) } 1 .. 4);
emit('st.good', '{"g": 5}', 'st.bad', '{"b": 5}');
ok(IdemValkey::poll_until(20, sub { xlen($streams, 3, 'st.good') >= 5 }),
	'a stream Valkey refuses (WRONGTYPE) does not hold the others back');
ok(IdemValkey::stats_col($node, 'publish_errors') > $errors0, '... the refusal is counted');
ok(IdemValkey::poll_until(10, sub { waiting() eq '5' }), '... its messages wait in the outbox (the others are deleted)');
in_db($streams, 3, 'DEL', 'st.bad');
ok(IdemValkey::poll_until(20, sub { waiting() eq '0' }), 'the key gone, they go out');
is_deeply(bodies($streams, 3, 'st.bad'), [ map { qq({"b":$_}) } 1 .. 5 ],
	'... all of them, once each, in order');
is_deeply(bodies($streams, 3, 'st.good'), [ map { qq({"g":$_}) } 1 .. 5 ],
	'... and the other stream\'s once each, in order');

# --- a reload moves publishing: another Valkey, a password file ---
my $other = IdemValkey->new(name => 'other', password => 'sEcret')->start;
my $pwfile = $node->basedir . '/outbox_pw';
open(my $fh, '>', $pwfile) or die;
print $fh "sEcret\n";
close $fh;
$node->safe_psql('postgres', qq{
	ALTER SYSTEM SET idem.outbox_valkey_host = '';
	ALTER SYSTEM SET idem.outbox_valkey_nodes = '127.0.0.1:@{[ $other->port ]}';
	ALTER SYSTEM SET idem.outbox_valkey_db = 0;
	ALTER SYSTEM SET idem.outbox_valkey_password_file = '$pwfile';
	SELECT pg_reload_conf();
});
usleep(300_000);
emit('st.moved', '{"m": 1}');
ok(IdemValkey::poll_until(20, sub { xlen($other, 0, 'st.moved') >= 1 }),
	'a reload moves publishing (idem.outbox_valkey_nodes alone, with a password file)');
is(xlen($streams, 3, 'st.moved'), 0, '... away from the Valkey before');

# --- unset: the cache's Valkey, as without the settings ---
$node->safe_psql('postgres', q{
	ALTER SYSTEM RESET idem.outbox_valkey_nodes;
	ALTER SYSTEM RESET idem.outbox_valkey_password_file;
	SELECT pg_reload_conf();
});
usleep(300_000);
emit('st.back', '{"m": 2}');
ok(IdemValkey::poll_until(20, sub { xlen($cache, 0, 'st.back') >= 1 }),
	'neither host nor nodes set: the cache\'s Valkey publishes');
ok(IdemValkey::wait_connected($node, 1), '... and the worker\'s connection is untouched');

# --- the settings' checks ---
my ($rc, $out, $err) = $node->psql('postgres',
	"ALTER SYSTEM SET idem.outbox_valkey_nodes = 'h:notaport'");
like($err, qr/not host:port/, 'idem.outbox_valkey_nodes is checked');
($rc, $out, $err) = $node->psql('postgres',
	"ALTER SYSTEM SET idem.outbox_valkey_host = 'a b'");
like($err, qr/printable ASCII/, 'idem.outbox_valkey_host is checked');
$node->safe_psql('postgres', 'CREATE ROLE plain LOGIN');
($rc, $out, $err) = $node->psql('postgres', 'SHOW idem.outbox_valkey_password',
	extra_params => [ '-U', 'plain' ]);
like($err, qr/permission denied|must be superuser|privileges/, 'idem.outbox_valkey_password is the superuser\'s');

$node->stop;
done_testing();
