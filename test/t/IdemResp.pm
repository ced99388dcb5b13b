# IdemResp: the RESP wire format, for the Perl tests and benchmarks that
# talk to Valkey without a client library.  No dependencies.
#
#   IdemResp::request(@args)   the bytes of one command
#   IdemResp::read_reply($sock) one reply: a string, an integer, an array
#                               ref, or undef for a nil; dies on an error
#                               reply or a closed connection
package IdemResp;

use strict;
use warnings;

sub request
{
	my (@args) = @_;
	my $req = '*' . scalar(@args) . "\r\n";
	$req .= '$' . length($_) . "\r\n$_\r\n" foreach @args;
	return $req;
}

sub read_reply
{
	my ($sock) = @_;
	my $line = <$sock>;
	die "connection closed\n" unless defined $line;
	$line =~ s/\r\n$//;
	my ($type, $rest) = (substr($line, 0, 1), substr($line, 1));
	return $rest if $type eq '+' || $type eq ':';
	die "error reply: $rest\n" if $type eq '-';
	if ($type eq '$')
	{
		return undef if $rest < 0;
		my $buf = '';
		while (length($buf) < $rest + 2)
		{
			my $n = read($sock, $buf, $rest + 2 - length($buf), length($buf));
			die "connection closed\n" unless $n;
		}
		return substr($buf, 0, $rest);
	}
	if ($type eq '*')
	{
		return undef if $rest < 0;
		return [ map { read_reply($sock) } 1 .. $rest ];
	}
	die "bad reply line: $line\n";
}

1;
