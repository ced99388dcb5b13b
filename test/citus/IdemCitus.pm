# IdemCitus: a Citus cluster on loopback for the citus suite: a coordinator
# and two workers, each preloading citus and idem, each idem worker copying
# into the same Valkey.  Tenants are distributed by id (8 shards); idem is
# installed on the coordinator.
package IdemCitus;

use strict;
use warnings;

use IdemValkey;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

# new(valkey => $valkey, %conf): started and joined, idem installed.
sub new
{
	my ($class, %args) = @_;
	my $self = bless { valkey => $args{valkey} }, $class;
	$self->{conf} = $args{conf} // {};
	$self->{$_} = $self->start_node($_) foreach qw(coord w1 w2);
	my $c = $self->{coord};
	$c->safe_psql('postgres',
		"SELECT citus_set_coordinator_host('127.0.0.1', " . $c->port . ")");
	foreach my $w (qw(w1 w2))
	{
		$c->safe_psql('postgres',
			"SELECT citus_add_node('127.0.0.1', " . $self->{$w}->port . ")");
	}
	return $self;
}

# A node named $name, started with citus and idem preloaded and the
# cluster's settings, citus created; not yet added to the cluster.
sub start_node
{
	my ($self, $name) = @_;
	my $node = PostgreSQL::Test::Cluster->new($name);
	$node->init(allows_streaming => 'logical');
	# Citus's nodes talk to each other over TCP on loopback.
	$node->append_conf('pg_hba.conf', "host all all 127.0.0.1/32 trust\n");
	$node->append_conf('postgresql.conf', join('',
			"shared_preload_libraries = 'citus,idem'\n",
			"listen_addresses = '127.0.0.1'\n",
			"max_prepared_transactions = 50\n",
			"max_connections = 100\n",
			"max_worker_processes = 32\n",
			"max_wal_senders = 20\n",
			"max_replication_slots = 20\n",
			"citus.shard_count = 8\n",
			"citus.node_conninfo = 'sslmode=disable'\n",
			"idem.min_retention = 0\n",
			"citus.distributed_deadlock_detection_factor = 1.5\n",
			"citus.background_task_queue_interval = '200ms'\n",
			"citus.defer_shard_delete_interval = 1000\n",
			"idem.valkey_port = " . $self->{valkey}->port . "\n",
			map { "$_ = $self->{conf}{$_}\n" } sort keys %{ $self->{conf} }));
	$node->start;
	$node->safe_psql('postgres', 'CREATE EXTENSION citus');
	return $node;
}

# Tenants 1 to 40 in a distributed tenants table, idem installed on it.
# columns => "name text, ": more columns of tenants, after id;
# effects => 1: before idem, a table effects (id, tenant_id, k) distributed
# by tenant and co-located with tenants, and a reference table audit
# (tenant_id, note).
sub install_tenants
{
	my ($self, %opt) = @_;
	my $columns = $opt{columns} // '';
	my $effects = $opt{effects} ? q{
		CREATE TABLE effects (id bigserial, tenant_id bigint NOT NULL, k text NOT NULL,
			PRIMARY KEY (tenant_id, id));
		SELECT create_distributed_table('effects', 'tenant_id', colocate_with => 'tenants');
		CREATE TABLE audit (tenant_id bigint, note text);
		SELECT create_reference_table('audit');
	} : '';
	$self->{coord}->safe_psql('postgres', qq{
		CREATE TABLE tenants (id bigint PRIMARY KEY, ${columns}n bigint NOT NULL DEFAULT 0);
		SELECT create_distributed_table('tenants', 'id');
		INSERT INTO tenants (id) SELECT g FROM generate_series(1, 40) g;
		$effects
		CREATE EXTENSION idem;
		SELECT idem_install('tenants');
	});
}

sub coord { $_[0]->{coord} }
sub w1    { $_[0]->{w1} }
sub w2    { $_[0]->{w2} }
sub nodes { ($_[0]->{coord}, $_[0]->{w1}, $_[0]->{w2}) }

# The worker node (w1 or w2) that holds tenant $t's shard.
sub node_of
{
	my ($self, $t) = @_;
	my $port = $self->coord->safe_psql('postgres', qq{
		SELECT nodeport FROM pg_dist_placement p JOIN pg_dist_node n USING (groupid)
		WHERE p.shardid = get_shard_id_for_distribution_column('tenants', ${t}::bigint)});
	foreach my $w (qw(w1 w2))
	{
		return $self->{$w} if $self->{$w}->port == $port;
	}
	die "tenant $t is on no worker (port $port)";
}

# A tenant held by the given worker, other than those in @not.
sub tenant_on
{
	my ($self, $node, @not) = @_;
	my %skip = map { $_ => 1 } @not;
	foreach my $t (1 .. 40)
	{
		next if $skip{$t};
		return $t if $self->node_of($t)->port == $node->port;
	}
	die 'no tenant on ' . $node->name;
}

# The ledger shard of tenant $t: its table name, as text.
sub shard_of
{
	my ($self, $t) = @_;
	return $self->coord->safe_psql('postgres', qq{
		SELECT 'idempotency_keys_' || get_shard_id_for_distribution_column('idempotency_keys', ${t}::bigint)});
}

1;
