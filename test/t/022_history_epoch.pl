# The history epoch: a server never reads from Valkey what another history
# of its data directory wrote.  Each case makes a second server from the
# first one's data directory in a way that keeps the system identifier, the
# timeline and the cache secret file; the first server then applies a
# message and copies its result to Valkey; the message, delivered to the
# second server (which lacks it), must be applied there, not replayed from
# the first one's copy.  A clean restart keeps the epoch and its warm cache.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use File::Copy qw(copy);
use IdemValkey;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::RecursiveCopy;
use PostgreSQL::Test::Utils;
use Test::More;

my $valkey = IdemValkey->new(name => 'valkey')->start;
my $orig = IdemValkey::streaming_node('orig', $valkey);

sub run { IdemValkey::run_message($_[0], 'postgres', $valkey, 1, 'he', $_[1], '{"x": 1}') }
sub effects
{
	my ($node, $id) = @_;
	return $node->safe_psql('postgres', "SELECT count(*) FROM effects WHERE id = '$id'");
}

# A node made from a copy of $orig's data directory ($how: 'backup' for
# pg_basebackup -X stream, started as it is, with its backup_label; 'dir'
# for a copy of the data directory of the stopped server), started.
my $n = 0;
sub copy_of
{
	my ($how, $name) = @_;
	my $backup = 'copy' . ++$n;
	if ($how eq 'backup')
	{
		$orig->backup($backup);
	}
	else
	{
		PostgreSQL::Test::RecursiveCopy::copypath($orig->data_dir,
			$orig->backup_dir . "/$backup");
	}
	my $node = PostgreSQL::Test::Cluster->new($name);
	$node->init_from_backup($orig, $backup);
	return $node;
}

# The applied message $id on $node, and its copy in Valkey.
sub applied_and_copied
{
	my ($node, $id, $what) = @_;
	my ($status, $source) = run($node, $id);
	is("$status $source", 'applied handler', "$what: applies $id");
	ok(defined $valkey->wait_for_key(IdemValkey::tenant_key($node, 1, 'he', $id), 10),
		"$what: ... and copies its result to Valkey");
}

# --- a clean restart keeps the epoch and the warm cache ---
applied_and_copied($orig, 'm0', 'orig');
my $ks0 = IdemValkey::keyspace($orig);
my $sysid = $orig->safe_psql('postgres', 'SELECT system_identifier FROM pg_control_system()');
my $dboid = $orig->safe_psql('postgres', "SELECT oid FROM pg_database WHERE datname = 'postgres'");
like($ks0, qr/^idem:$sysid\.1\.[0-9a-f]{16}\.$dboid:\z/,
	'the keyspace names the cluster, the timeline, the epoch and the database');
$orig->restart;
is(IdemValkey::keyspace($orig), $ks0, 'a clean restart keeps the keyspace (the epoch)');
my ($status, $source) = run($orig, 'm0');
is("$status $source", 'replayed valkey', '... and its warm cache');

# --- 1. a base backup started as it is (backup_label, same timeline) ---
my $b1 = copy_of('backup', 'backup1');
applied_and_copied($orig, 'm1', 'orig after the backup');
$b1->start;
isnt(IdemValkey::keyspace($b1), IdemValkey::keyspace($orig),
	'the backup started as it is writes under another keyspace');
($status, $source) = run($b1, 'm1');
is("$status $source", 'applied handler',
	'the backup applies m1 (committed on orig after the backup), not replays it');
is(effects($b1, 'm1'), '1', '... once');
unlike(slurp_file($b1->logfile), qr/PANIC|TRAP/, '... and logs no crash');
like(slurp_file($b1->logfile), qr/new history epoch [0-9a-f]{16}.*\n.*started with recovery/,
	'... and says why it started a new epoch');

# --- 2. a second server from the same backup, both running ---
my $b2 = PostgreSQL::Test::Cluster->new('backup2');
$b2->init_from_backup($orig, 'copy1');
$b2->start;
isnt(IdemValkey::keyspace($b2), IdemValkey::keyspace($b1),
	'two servers started from one backup use two keyspaces');
isnt(IdemValkey::secret_hex($b2, 2), IdemValkey::secret_hex($b1, 2),
	'... with secrets of their own');
applied_and_copied($b1, 'm2', 'backup1');
($status, $source) = run($b2, 'm2');
is("$status $source", 'applied handler', "backup2 applies m2, not replays backup1's result");
$b1->stop;
$b2->stop;

# --- 3. a copy of the stopped server's data directory ---
$orig->stop;
my $c = copy_of('dir', 'coldcopy');
$orig->start;
applied_and_copied($orig, 'm3', 'orig after the cold copy');
$c->start;
isnt(IdemValkey::keyspace($c), IdemValkey::keyspace($orig),
	'the cold copy, started cleanly after orig took the epoch over, makes a new one');
($status, $source) = run($c, 'm3');
is("$status $source", 'applied handler', 'the cold copy applies m3, not replays it');
like(slurp_file($c->logfile), qr/Another server started with a copy of this data directory took the epoch over/,
	'... and says why');
$c->stop;

# --- 4. the copy starts first; then the original comes back ---
$orig->stop;
my $c2 = copy_of('dir', 'coldcopy2');
$c2->start;
my $ks_c2 = IdemValkey::keyspace($c2);
applied_and_copied($c2, 'm4', 'the second cold copy, started first');
$orig->start;
isnt(IdemValkey::keyspace($orig), $ks_c2,
	'orig, started after its copy took the epoch over, makes a new one');
($status, $source) = run($orig, 'm4');
is("$status $source", 'applied handler', "orig applies m4, not replays its copy's result");
$c2->stop;

# --- 5. a crash-consistent copy (the data directory of a server that
# stopped without a shutdown checkpoint, as a volume snapshot) ---
$orig->stop('immediate');
my $s = copy_of('dir', 'snapshot');
$orig->start;
applied_and_copied($orig, 'm5', 'orig after the snapshot');
$s->start;
($status, $source) = run($s, 'm5');
is("$status $source", 'applied handler', 'the snapshot applies m5, not replays it');
is(effects($s, 'm5'), '1', '... once');
IdemValkey::check_counters($s);
IdemValkey::check_counters($orig);
$s->stop;

$orig->stop;
done_testing();
