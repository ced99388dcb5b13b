# Bounded memory per transaction: a transaction that completes 100,000 keys
# with 1 KB outcomes holds at most what the commit ring could take from it
# (idem.queue_size x 256 bytes + 8 KB); the copies beyond that are dropped
# at once and counted in idem_stats().dropped, not held until commit.
# Measured from pg_backend_memory_contexts inside the transaction.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $n = 100_000;
my $queue = 4096;
my $ring = $queue * 256 + 2 * 4200;

my $node = PostgreSQL::Test::Cluster->new('memory');
$node->init;
# Every claimed key holds a lock to the end of the transaction.
$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'idem'
idem.valkey_port = 1
idem.queue_size = $queue
max_connections = 10
max_locks_per_transaction = 4000
});
$node->start;
$node->safe_psql('postgres', q{
  CREATE EXTENSION idem;
  CREATE TABLE tenants (id bigint PRIMARY KEY);
  INSERT INTO tenants VALUES (1);
  SELECT idem_install('tenants');
});

# The bytes of TopTransactionContext and everything under it (the
# function lists contexts depth first).
my $txn_bytes = q{
  WITH c AS (SELECT *, ordinality AS o FROM pg_get_backend_memory_contexts() WITH ORDINALITY),
       top AS (SELECT o, level FROM c WHERE name = 'TopTransactionContext'),
       stop AS (SELECT min(c.o) AS o FROM c, top WHERE c.o > top.o AND c.level <= top.level)
  SELECT sum(c.total_bytes) FROM c, top, stop
   WHERE c.o >= top.o AND (stop.o IS NULL OR c.o < stop.o)};

my $dropped_before = $node->safe_psql('postgres', 'SELECT dropped FROM idem_stats()');
my $out = $node->safe_psql('postgres', qq{
  BEGIN;
  DO \$\$
  DECLARE
    fp bytea := idem_fingerprint('{}');
    outcome jsonb := jsonb_build_object('pad', repeat('x', 1000));
    k bytea;
  BEGIN
    FOR i IN 1..$n LOOP
      k := idem_key('memory', i::text);
      PERFORM idem_claim(1, k, fp);
      PERFORM idem_complete(1, k, outcome);
    END LOOP;
  END \$\$;
  $txn_bytes;
  COMMIT;
});
my $bytes = (split /\n/, $out)[-1];
note("TopTransactionContext after $n completions: $bytes bytes (ring: $ring bytes)");
cmp_ok($bytes, '<', $ring + 4 * 1024 * 1024,
	"$n completions in one transaction stay within the ring's size + 4 MB");
is($node->safe_psql('postgres', 'SELECT count(*) FROM idempotency_keys'), $n,
	'every completion is in the ledger');
my $dropped = $node->safe_psql('postgres', 'SELECT dropped FROM idem_stats()') - $dropped_before;
cmp_ok($dropped, '>=', $n - $queue, "copies beyond the ring were dropped and counted ($dropped)");

$node->stop;
done_testing();
