#!/usr/bin/perl
# bench/table.pl RESULTS.tsv: the bench table with ratios to (1) and (4).
use strict;
use warnings;

my (%tps, %cfg);
open my $fh, '<', $ARGV[0] or die "$ARGV[0]: $!\n";
<$fh>;
while (<$fh>)
{
	chomp;
	my ($sync, $clients, $variant, $tps) = split /\t/;
	$tps{"$sync $clients"}{$variant} = $tps;
	$cfg{"$sync $clients"} = [ $sync, $clients ];
}
my @variants = qw(v1_effect v2_idem v3_hand v4_floor replay_idem replay_select);
printf "%-5s %7s  %-14s %9s %7s %7s\n", 'sync', 'clients', 'variant', 'tps', 'x(1)', 'x(4)';
for my $k (sort { $cfg{$a}[0] cmp $cfg{$b}[0] or $cfg{$a}[1] <=> $cfg{$b}[1] } keys %cfg)
{
	my $t = $tps{$k};
	for my $v (@variants)
	{
		next unless defined $t->{$v} && $t->{$v} ne '';
		if ($v =~ /^replay/)
		{
			printf "%-5s %7s  %-14s %9.0f\n", @{ $cfg{$k} }, $v, $t->{$v};
		}
		else
		{
			printf "%-5s %7s  %-14s %9.0f %7.2f %7.2f\n", @{ $cfg{$k} }, $v, $t->{$v},
			  $t->{$v} / $t->{v1_effect}, $t->{$v} / $t->{v4_floor};
		}
	}
	printf "%-5s %7s  targets: idem/floor %.2f (>= 0.90), idem/hand %.2f (>= 1.10)%s\n",
	  @{ $cfg{$k} }, $t->{v2_idem} / $t->{v4_floor}, $t->{v2_idem} / $t->{v3_hand},
	  defined $t->{replay_select}
	  ? sprintf(", pg replay/select %.2f (>= 0.80)", $t->{replay_idem} / $t->{replay_select})
	  : '';
}
