# idem.so exports only what PostgreSQL looks up by name (src/compat.h):
# _PG_init, Pg_magic_func, the SQL functions (idem_*) with their pg_finfo_
# records, and the background worker's entry point.  PostgreSQL loads
# libraries with RTLD_GLOBAL, so any other exported name could clash with
# another extension's.
use strict;
use warnings;
use PostgreSQL::Test::Utils;
use Test::More;

my ($pkglibdir) = run_command([ 'pg_config', '--pkglibdir' ]);
chomp $pkglibdir;
my $so = "$pkglibdir/idem.so";
ok(-f $so, "idem.so is installed at $so");

my ($out, $err) = run_command([ 'nm', '-D', '--defined-only', $so ]);
is($err, '', 'nm -D reads idem.so');
my @names = map { (split ' ')[-1] } grep { /^\S*\s+[A-Za-z]\s+\S+$/ } split /\n/, $out;
ok(@names > 0, 'idem.so has dynamic symbols');

# What the linker itself defines in some binutils versions is not ours.
my %linker = map { $_ => 1 } qw(_init _fini _edata _end __bss_start);
my @stray = grep { !/^(idem_|_PG_|Pg_magic|pg_finfo_idem_)/ && !$linker{$_} } @names;
is(join(' ', sort @stray), '', 'no symbol outside the idem_, _PG_, Pg_magic, pg_finfo_idem_ prefixes');

my %have = map { $_ => 1 } @names;
for my $needed (qw(_PG_init Pg_magic_func idem_worker_main idem_claim
	pg_finfo_idem_claim idem_install pg_finfo_idem_install idem_stats
	pg_finfo_idem_stats))
{
	ok($have{$needed}, "$needed is exported");
}

done_testing();
