#!/usr/bin/env bash
# Comments name functions, not files; where one names both, the function
# must be defined in that file.  This finds such claims in the sources
# (src/, src/common/, client/, test/spin/) and the documents (docs/,
# READMEs), in four forms:
#     name() (file.c)      name() (file.c, ...)     file.c's name()
#     a_name (file.c)
#     name() in file.c     `file.c` `name`     `name` in `file.c`
#     `name()` (`file.c`)
# and fails on each whose function file.c does not define: a definition
# starting its line ("(name) (" too, a function-like macro's twin), a
# #define, a variable defined at file level, or for a SQL function its
# comment "name() RETURNS"; in a header, a declaration.  A file named without a folder is
# looked for beside the comment's file, then in src/, src/common/ and
# client/.  TAP.
#
#   comment_claims.sh [FILE...]   (default: the tree's sources and documents)
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 1
if [ $# -eq 0 ]; then
	set -- src/*.[ch] src/common/*.[ch] client/*.[ch] test/spin/*.pml \
		docs/*.md README.md CONTRIBUTING.md client/README.md test/README.md \
		test/spin/README.md bench/README.md
fi
perl - "$@" <<'PERL'
use strict;
use warnings;
use File::Basename qw(dirname basename);

my %defs;    # file -> { name => 1 }
sub defined_in
{
	my ($file, $name) = @_;
	if (!$defs{$file})
	{
		my %d;
		open(my $fh, '<', $file) or return 0;
		my $header = $file =~ /\.h$/;
		while (my $l = <$fh>)
		{
			$d{$1} = 1 if $l =~ /^\(?([A-Za-z_]\w*)\)?\s*\(/;
			$d{$1} = 1 if $l =~ /^#\s*define\s+([A-Za-z_]\w*)/;
			$d{$1} = 1 if $l =~ /^(?:static\s+|const\s+)*[A-Za-z_]\w*(?:\s+const)?[\s\*]+([A-Za-z_]\w*)\s*(?:\[[^\]]*\])*\s*=/;
			$d{$1} = 1 if $l =~ /\b([A-Za-z_]\w*)\(\) RETURNS\b/;
			$d{$1} = 1 if $l =~ /^(?:static\s+|extern\s+|inline\s+)*[A-Za-z_][\w\s\*]*?\b([A-Za-z_]\w*)\s*\(/
			  && ($header || $l =~ /\)\s*$/ || $l =~ /^static inline/);
			if ($header)
			{
				$d{$1} = 1 while $l =~ /\b([A-Za-z_]\w*)\s*\(/g;
			}
		}
		close $fh;
		$defs{$file} = \%d;
	}
	return $defs{$file}{$name};
}

sub candidates
{
	my ($from, $file) = @_;
	return (-f $file ? ($file) : ()) if $file =~ m{/} && -f $file;
	if ($file =~ m{/})
	{
		my @c = grep { -f $_ } map { "$_/$file" } qw(src client);
		return @c;
	}
	my $beside = dirname($from) . "/$file";
	return ($beside) if -f $beside;
	return grep { -f $_ } map { "$_/$file" } qw(src src/common client);
}

my ($n, $bad) = (0, 0);
my @wrong;
for my $from (@ARGV)
{
	open(my $fh, '<', $from) or next;
	my $text = do { local $/; <$fh> };
	close $fh;
	# comments only, in C; the whole text elsewhere
	my @claims;
	my $id = qr/[A-Za-z_]\w*/;
	my $f = qr{(?:[\w.-]+/)*[\w-]+\.[ch]};
	while ($text =~ /\b($id)\(\)\s*\(($f)[,;:)]/g) { push @claims, [$1, $2, $-[0]] }
	while ($text =~ /\b([a-z][a-z0-9]*_[a-z0-9_]+) \(($f)\)/g) { push @claims, [$1, $2, $-[0]] }
	while ($text =~ /\b($f)'s ($id)\(\)/g) { push @claims, [$2, $1, $-[0]] }
	while ($text =~ /\b($id)\(\)\s+in\s+($f)\b/g) { push @claims, [$1, $2, $-[0]] }
	while ($text =~ /`($f)` `($id)`/g) { push @claims, [$2, $1, $-[0]] }
	while ($text =~ /`($id)(?:\(\))?`\s+in\s+`($f)`/g) { push @claims, [$1, $2, $-[0]] }
	while ($text =~ /`($id)\(\)` \(`($f)`\)/g) { push @claims, [$1, $2, $-[0]] }
	for my $c (@claims)
	{
		my ($name, $file, $at) = @$c;
		my $line = 1 + (substr($text, 0, $at) =~ tr/\n//);
		my @cand = candidates($from, $file);
		$n++;
		next if grep { defined_in($_, $name) } @cand;
		$bad++;
		push @wrong, "$from:$line: $name() is not defined in $file"
		  . (@cand ? " (looked in @cand)" : " (no such file)");
	}
}
print "# $_\n" for @wrong;
print(($bad ? "not ok" : "ok") . " 1 - every function-and-file claim in comments and documents is true ($n claims"
	. ($bad ? ", $bad wrong" : "") . ")\n");
print "1..1\n";
exit($bad ? 1 : 0);
PERL
