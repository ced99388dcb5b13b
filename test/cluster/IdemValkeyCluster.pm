# IdemValkeyCluster: a throwaway Valkey Cluster on loopback for idem's tests
# and benchmarks: N masters with one replica each (valkey-server
# --cluster-enabled yes, a small cluster-node-timeout, valkey-cli --cluster
# create), persistence off, every node on a free port in a directory under
# the test's tmp_check, all stopped at the end whatever happens (IdemValkey's
# END block stops every server it started).
#
#   my $c = IdemValkeyCluster->new(masters => 3, replicas => 1);
#   (ipv6 => 1: the nodes also listen on ::1 and meet there, so the
#   cluster announces every node as ::1; the helpers below still talk to
#   them over 127.0.0.1; extra => [...]: more valkey-server arguments)
#   $c->seeds                  "127.0.0.1:p1,127.0.0.1:p2,..." (every node)
#   $c->others                 the same without the first node
#   $c->idem_node($name, %conf)  a PostgreSQL node preloading idem, its
#                              cache the cluster (idem.valkey_nodes)
#   IdemValkeyCluster::client_binary($name)
#                              client/build/$name, or the test skipped
#   $c->get($key)              GET on the key's master, following MOVED
#   $c->master_of_key($key)    the IdemValkey node serving the key now
#   $c->masters                the nodes that are masters now
#   $c->kill_master($node)     SIGKILL; wait until its replica took over
#   $c->move_slot($slot, $to)  SETSLOT IMPORTING/MIGRATING, MIGRATE, NODE
#   $c->on_owner(@keys)        how many hold a result on their slot's master
#   IdemValkeyCluster::commit_results($pg, $tag, $n[, $from]),
#   IdemValkeyCluster::result_keys($pg, $tag, $n)
#                              results committed on $pg, and their keys
#   IdemValkeyCluster::runner_counts($bin, @args)
#                              run client/build/cluster_runner: (applied,
#                              replayed from Valkey)
package IdemValkeyCluster;

use strict;
use warnings;

use FindBin;
use IdemValkey;
use IPC::Run;
use PostgreSQL::Test::Utils;
use Time::HiRes qw(time usleep);

sub cli_binary
{
	my $server = IdemValkey::server_binary();
	(my $cli = $server) =~ s/-server$/-cli/;
	return -x $cli ? $cli : 'valkey-cli';
}

sub new
{
	my ($class, %args) = @_;
	my $masters = $args{masters} // 3;
	my $replicas = $args{replicas} // 1;
	my $timeout = $args{node_timeout} // 1000;
	my @nodes;
	foreach my $i (1 .. $masters * (1 + $replicas))
	{
		my $n = IdemValkey->new(name => "cluster$i",
			extra => [
				'--cluster-enabled', 'yes',
				'--cluster-config-file', 'nodes.conf',
				# The bus port defaults to port + 10000, which nothing
				# reserved: it may be in use (an ephemeral port of some
				# outgoing connection, another server's port) and the node
				# would not start.  Take a free one like every other port.
				'--cluster-port', PostgreSQL::Test::Cluster::get_free_port(),
				'--cluster-node-timeout', $timeout,
				# a replica takes over as soon as the master is judged dead
				'--cluster-replica-validity-factor', '0',
				'--appendonly', 'no',
				$args{ipv6} ? ('--bind', '127.0.0.1 ::1') : (),
				@{ $args{extra} // [] }
			]);
		$n->start;
		push @nodes, $n;
	}
	my $self = bless { nodes => \@nodes }, $class;
	my @addr = map { ($args{ipv6} ? '::1:' : '127.0.0.1:') . $_->port } @nodes;
	my ($out, $err);
	IPC::Run::run([ cli_binary(), '--cluster', 'create', @addr,
			'--cluster-replicas', $replicas, '--cluster-yes' ],
		'>', \$out, '2>', \$err)
	  or die "valkey-cli --cluster create failed: $out $err";
	$self->wait_ok(30) or die "the cluster did not become ok";
	return $self;
}

sub nodes { return @{ $_[0]->{nodes} }; }

# The nodes but the first, "127.0.0.1:p2,127.0.0.1:p3,..." (with $host
# '[::1]': "[::1]:p2,..."), as idem.valkey_nodes lists them beside the
# first node's port.
sub others
{
	my ($self, $host) = @_;
	my @n = $self->nodes;
	return join(',', map { ($host // '127.0.0.1') . ':' . $_->port } @n[ 1 .. $#n ]);
}

# A started PostgreSQL node that preloads idem (IdemValkey::idem_node)
# with the cluster as its cache: the first node, the others in
# idem.valkey_nodes.  %conf adds settings (or replaces that one).
sub idem_node
{
	my ($self, $name, %conf) = @_;
	return IdemValkey::idem_node($name, ($self->nodes)[0],
		'idem.valkey_nodes' => "'" . $self->others . "'", %conf);
}

# The path of the client's test program $name in client/build (or in
# $IDEM_CLIENT_BUILD); the whole test is skipped when it is not built.
sub client_binary
{
	my ($name) = @_;
	my $bin = ($ENV{IDEM_CLIENT_BUILD} // "$FindBin::RealBin/../../client/build") . "/$name";
	Test::More::plan(skip_all => "$bin is not built") unless -x $bin;
	return $bin;
}

sub seeds
{
	my ($self) = @_;
	return join(',', map { '127.0.0.1:' . $_->port } grep { $_->{pid} } $self->nodes);
}

# A live node's view, or undef.
sub try_command
{
	my ($node, @args) = @_;
	return undef unless $node->{pid};
	my $r = eval { $node->command(@args) };
	return $r;
}

sub node_by_port
{
	my ($self, $port) = @_;
	my ($n) = grep { $_->port == $port } $self->nodes;
	return $n;
}

# Every live node says cluster_state:ok and agrees on the masters.
sub wait_ok
{
	my ($self, $timeout) = @_;
	return IdemValkey::poll_until($timeout // 30, sub {
		foreach my $n (grep { $_->{pid} } $self->nodes)
		{
			my $info = try_command($n, 'CLUSTER', 'INFO') // return 0;
			return 0 unless $info =~ /cluster_state:ok/;
		}
		my @slots = $self->slot_ranges;
		my $covered = 0;
		$covered += $_->[1] - $_->[0] + 1 foreach @slots;
		return $covered == 16384;
	});
}

# [start, end, master port] from a live node's CLUSTER SLOTS.
sub slot_ranges
{
	my ($self) = @_;
	foreach my $n (grep { $_->{pid} } $self->nodes)
	{
		my $r = try_command($n, 'CLUSTER', 'SLOTS') or next;
		return map { [ $_->[0], $_->[1], $_->[2][1] ] } @$r;
	}
	return ();
}

sub masters
{
	my ($self) = @_;
	my %ports = map { $_->[2] => 1 } $self->slot_ranges;
	return map { $self->node_by_port($_) } sort keys %ports;
}

sub slot_of
{
	my ($self, $key) = @_;
	foreach my $n (grep { $_->{pid} } $self->nodes)
	{
		my $s = try_command($n, 'CLUSTER', 'KEYSLOT', $key);
		return $s if defined $s;
	}
	die "no live node";
}

sub master_of_slot
{
	my ($self, $slot) = @_;
	foreach my $r ($self->slot_ranges)
	{
		return $self->node_by_port($r->[2]) if $slot >= $r->[0] && $slot <= $r->[1];
	}
	return undef;
}

sub master_of_key { my ($self, $key) = @_; return $self->master_of_slot($self->slot_of($key)); }

# GET on the key's master, following MOVED/ASK (ASK: ASKING first).
sub get
{
	my ($self, $key) = @_;
	my $node = $self->master_of_key($key);
	for (1 .. 5)
	{
		my $v = eval { $node->command('GET', $key) };
		return $v unless $@;
		if ($@ =~ /error reply: (MOVED|ASK) \d+ [\d.]+:(\d+)/)
		{
			my ($kind, $port) = ($1, $2);
			$node = $self->node_by_port($port);
			if ($kind eq 'ASK')
			{
				$node->command('ASKING');
				return $node->command('GET', $key);
			}
			next;
		}
		die $@;
	}
	die "too many redirects for $key";
}

# The node's id (CLUSTER MYID).
sub id_of { return $_[1]->command('CLUSTER', 'MYID'); }

# Kill a master with SIGKILL and wait until the cluster is ok again (its
# replica promoted).  Returns the promoted replica.
sub kill_master
{
	my ($self, $node) = @_;
	my $pid = delete $node->{pid};
	delete $node->{sock};
	kill 'KILL', $pid;
	waitpid($pid, 0);
	$self->wait_ok(30) or die "no failover after killing " . $node->port;
	return $self;
}

# Move one slot from its master to $to, the way valkey-cli --cluster
# reshard does: IMPORTING on the target, MIGRATING on the source, MIGRATE
# the keys in chunks, then SETSLOT NODE everywhere.  $between->() runs
# after the slot is half-migrated (keys may be on either side).
sub move_slot
{
	my ($self, $slot, $to, $between) = @_;
	my $from = $self->master_of_slot($slot);
	return if $from->port == $to->port;
	my $from_id = $self->id_of($from);
	my $to_id = $self->id_of($to);
	$to->command('CLUSTER', 'SETSLOT', $slot, 'IMPORTING', $from_id);
	$from->command('CLUSTER', 'SETSLOT', $slot, 'MIGRATING', $to_id);
	my $first = 1;
	while (1)
	{
		my $keys = $from->command('CLUSTER', 'GETKEYSINSLOT', $slot, 10);
		last unless @$keys;
		$from->command('MIGRATE', '127.0.0.1', $to->port, '', 0, 5000, 'KEYS', @$keys);
		if ($first && $between)
		{
			$between->();
			$first = 0;
		}
	}
	$between->() if $first && $between;
	$to->command('CLUSTER', 'SETSLOT', $slot, 'NODE', $to_id);
	$from->command('CLUSTER', 'SETSLOT', $slot, 'NODE', $to_id);
	foreach my $m ($self->masters)
	{
		eval { $m->command('CLUSTER', 'SETSLOT', $slot, 'NODE', $to_id) };
	}
}

# Start moving @slots to $to without moving any key yet: IMPORTING on the
# target, MIGRATING on each source.  A key absent from its source is then
# answered with ASK.
sub begin_migration
{
	my ($self, $to, @slots) = @_;
	my $to_id = $self->id_of($to);
	my @moves;
	foreach my $slot (@slots)
	{
		my $from = $self->master_of_slot($slot);
		next if $from->port == $to->port;
		$to->command('CLUSTER', 'SETSLOT', $slot, 'IMPORTING', $self->id_of($from));
		$from->command('CLUSTER', 'SETSLOT', $slot, 'MIGRATING', $to_id);
		push @moves, [ $slot, $from ];
	}
	return \@moves;
}

# Move the keys of begun migrations and give the slots to $to everywhere.
sub finish_migration
{
	my ($self, $to, $moves) = @_;
	my $to_id = $self->id_of($to);
	foreach my $m (@$moves)
	{
		my ($slot, $from) = @$m;
		while (1)
		{
			my $keys = $from->command('CLUSTER', 'GETKEYSINSLOT', $slot, 100);
			last unless @$keys;
			$from->command('MIGRATE', '127.0.0.1', $to->port, '', 0, 5000, 'KEYS', @$keys);
		}
		$to->command('CLUSTER', 'SETSLOT', $slot, 'NODE', $to_id);
		$from->command('CLUSTER', 'SETSLOT', $slot, 'NODE', $to_id);
	}
	foreach my $m (@$moves)
	{
		foreach my $n ($self->masters)
		{
			eval { $n->command('CLUSTER', 'SETSLOT', $m->[0], 'NODE', $to_id) };
		}
	}
}

# Commit results ({"i": i}) for ids $from (1)..$n of scope $tag on the
# PostgreSQL node $pg, tenant 1, in one transaction.
sub commit_results
{
	my ($pg, $tag, $n, $from) = @_;
	$from //= 1;
	$pg->safe_psql('postgres', qq{
		DO \$\$ BEGIN
		FOR i IN $from..$n LOOP
			PERFORM idem_claim(1, idem_key('$tag', i::text), idem_fingerprint('{}'));
			PERFORM idem_complete(1, idem_key('$tag', i::text), jsonb_build_object('i', i));
		END LOOP; END \$\$;});
}

# The Valkey keys of those results, in id order.
sub result_keys
{
	my ($pg, $tag, $n) = @_;
	my $hexes = $pg->safe_psql('postgres',
		"SELECT string_agg(encode(idem_key('$tag', g::text), 'hex'), ' ' ORDER BY g) FROM generate_series(1, $n) g");
	my $prefix = IdemValkey::tenant_key($pg, 1, 'x', 'x');
	$prefix =~ s/[0-9a-f]{64}$//;
	return map { $prefix . $_ } split / /, $hexes;
}

# How many of @keys hold a result on the master that owns their slot now
# (a plain GET there, no redirect).
sub on_owner
{
	my ($self, @keys) = @_;
	my $found = 0;
	foreach my $k (@keys)
	{
		my $v = eval { $self->master_of_key($k)->command('GET', $k) };
		$found++ if defined $v && $v =~ /"i"/;
	}
	return $found;
}

# Run the client's cluster_runner (its arguments: conninfo, host, port,
# nodes, db, scope, n, first id); returns (runs applied, runs replayed
# from Valkey).
sub runner_counts
{
	my ($bin, @args) = @_;
	my ($out, $err);
	IPC::Run::run([ $bin, @args ], '>', \$out, '2>', \$err);
	my ($applied, $valkey) = (0, 0);
	foreach (split /\n/, $out // '')
	{
		$applied++ if /^run \S+ applied /;
		$valkey++ if /^run \S+ replayed valkey /;
	}
	return ($applied, $valkey);
}

1;
