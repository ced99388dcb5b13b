# A cache secret made during recovery, by a standby that had no secret file
# (built before its primary made one), travels with pg_basebackup to a
# standby cloned from it.  The first standby, promoted, rotates it out (as
# after a leak); the clone, promoted later, must not keep it: secrets made
# during recovery are replaced at promotion like those of an older
# timeline (the old code kept them, "made on this very server").  A server
# that does not preload idem replaces them too: its runners still read
# Valkey with them.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use IdemValkey;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $valkey = IdemValkey->new(name => 'valkey')->start;

sub secrets { IdemValkey::secrets(@_) }

# Every secret the node trusts, as hex.
sub secret_hexes
{
	my ($node) = @_;
	return join(' ', map { IdemValkey::secret_hex($node, $_) } secrets($node) =~ /(\d+)/g);
}

my $primary = IdemValkey::streaming_node('primary', $valkey);
$primary->backup('b0');

# s1: as if built before the primary made its secret file
my $s1 = PostgreSQL::Test::Cluster->new('s1');
$s1->init_from_backup($primary, 'b0', has_streaming => 1);
unlink($s1->data_dir . '/idem_cache_secret') or die "unlink: $!";
$s1->start;
$primary->wait_for_catchup($s1);
my $made = IdemValkey::secret_hex($s1, 1);
like(slurp_file($s1->data_dir . '/idem_cache_secret'), qr/^epoch [0-9a-f]{16}\n1 [0-9a-f]{64}\n\z/,
	's1 made its own secret during recovery (no timeline line)');

# s2: cloned from s1 by pg_basebackup, streaming from it
$s1->backup('b1');
my $s2 = PostgreSQL::Test::Cluster->new('s2');
$s2->init_from_backup($s1, 'b1', has_streaming => 1);
$s2->start;
$s1->wait_for_catchup($s2, 'replay', $s1->lsn('replay'));
is(slurp_file($s2->data_dir . '/idem_cache_secret'),
	slurp_file($s1->data_dir . '/idem_cache_secret'),
	's2 has the same secret file, copied by pg_basebackup');

# s1 takes over, and rotates that secret out (as after a leak)
$primary->stop;
ok(IdemValkey::promote_and_wait($s1),
	's1 is promoted');
$s1->safe_psql('postgres', 'SELECT idem_rotate_cache_secret()') for 1 .. 2;
unlike(secret_hexes($s1), qr/$made/, 's1 no longer holds the secret it made');
$s1->safe_psql('postgres', 'CHECKPOINT');
$s1->wait_for_catchup($s2);

# s2 takes over later: the secret made during recovery is not trusted there
$s1->stop;
ok(IdemValkey::promote_and_wait($s2),
	's2 is promoted');
is(secrets($s2), '2*', 's2 made itself a new secret: key id 2 alone');
unlike(secret_hexes($s2), qr/$made/,
	'... and does not trust the secret s1 made and rotated out (the old code kept it current)');

# A value forged with it in s2's keyspace is ignored.
my ($status, $source) =
  IdemValkey::run_message($s2, 'postgres', $valkey, 1, 'sm', 'm0', '{"x": 1}');
is("$status $source", 'applied handler', 's2 applies a message');
my $m0 = $valkey->wait_for_key(IdemValkey::tenant_key($s2, 1, 'sm', 'm0'), 10);
my $fp = IdemValkey::parse_value($m0)->{fingerprint};
is(IdemValkey::parse_value($m0)->{key_id}, 2, '... and its worker copies it under key id 2');
IdemValkey::check_forged_ignored($s2, $valkey, 'sm', 'm1', $made, $fp,
	'the secret s1 made during recovery');

$s2->stop;

# --- without preloading ---
# The primary's secret leaks; the remedy without preloading is to remove
# the file (no rotation), which a standby does not see.  Promoted, the
# standby must not keep that secret either (an old version reported the
# file as it was).  Without preloading there is no worker to take a
# history epoch over, so runners get no keyspace and use PostgreSQL alone.
my $np = PostgreSQL::Test::Cluster->new('np');
$np->init(allows_streaming => 1);
$np->start;
IdemValkey::install($np);
$np->safe_psql('postgres', 'CREATE TABLE effects (scope text, id text)');
is(secrets($np), '1*', 'not preloaded: the first reader made key id 1');
my $np_leaked = IdemValkey::secret_hex($np, 1);
$np->backup('b2');
my $nps = PostgreSQL::Test::Cluster->new('nps');
$nps->init_from_backup($np, 'b2', has_streaming => 1);
$nps->start;
$np->wait_for_catchup($nps);
$np->stop;
ok(IdemValkey::promote_and_wait($nps),
	'its standby is promoted');
is(secrets($nps), '2*', 'not preloaded, promoted: a new secret, key id 2 alone');
unlike(secret_hexes($nps), qr/$np_leaked/, '... not the secret it was made with');
is(secrets($nps) . ' ' . IdemValkey::secret_hex($nps, 2),
	'2* ' . IdemValkey::secret_hex($nps, 2), '... which the next readers keep');
my ($ret, $out, $err) = $nps->psql('postgres', 'SELECT idem_cache_keyspace()');
like($err, qr/55000|idem is not in shared_preload_libraries/,
	'not preloaded: no cache keyspace for runners (55000)');
($status, $source) = IdemValkey::run_message($nps, 'postgres', $valkey, 1, 'sm', 'n1', '{"x": 1}');
is("$status $source", 'applied handler', '... which then use PostgreSQL alone');
$nps->stop;
done_testing();
