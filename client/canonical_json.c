/*
 * canonical_json.c
 *	  Reproduce, byte for byte, the text PostgreSQL 15 prints for json::jsonb,
 *	  so that the client's fingerprints equal SQL idem_fingerprint().
 *
 *	  What jsonb does, and so what this file does:
 *	  - input: RFC 8259 JSON as PostgreSQL's lexer reads it (whitespace is
 *		space, tab, CR, LF; no trailing commas; literals in lower case;
 *		numbers -?(0|[1-9]d*)(.d+)?([eE][+-]?d+)?); the text must be valid
 *		UTF-8 without NUL; \u escapes are decoded (surrogate pairs combined,
 *		lone surrogates and \u0000 refused);
 *	  - objects: duplicate keys keep the last value; keys are sorted by byte
 *		length, then bytewise (jsonb's lengthCompareJsonbString);
 *	  - output: "{" key ": " value ", " ... "}", "[" a ", " b "]";
 *	  - strings are escaped as escape_json() does: \" \\ \b \f \n \r \t, other
 *		bytes below 0x20 as \u00xx (lower-case hex), everything else as is;
 *	  - numbers are printed as numeric_out() prints numeric_in()'s value: no
 *		exponent, display scale = fraction digits - exponent (at least 0),
 *		"-0" is "0", and PostgreSQL's range limits are refused alike.
 *	  The tests compare this with the server over many generated documents.
 *	  idem_free frees the text it returns.
 */
#include "internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DEPTH			512
#define NUMERIC_DSCALE_MAX	16383	/* 0x3FFF */
#define NUMERIC_INT_DIGITS_MAX 131072	/* (PG_INT16_MAX + 1) * 4 */
#define EXPONENT_LIMIT		1073741823L /* INT_MAX / 2 */

typedef struct sbuf
{
	char	   *p;
	size_t		len;
	size_t		cap;
} sbuf;

typedef struct parser
{
	const unsigned char *s;
	size_t		len;
	size_t		pos;
	int			depth;
	int			oom;
	char	   *err;
	size_t		errlen;
} parser;

typedef struct member
{
	char	   *key;
	size_t		klen;
	char	   *val;
	size_t		vlen;
	size_t		order;
} member;

static int
sb_reserve(parser *P, sbuf *b, size_t more)
{
	size_t		need;
	char	   *np;
	size_t		ncap;

	if (more > SIZE_MAX / 2 - b->len)
	{
		P->oom = 1;
		return -1;
	}
	need = b->len + more + 1;
	if (need <= b->cap)
		return 0;
	ncap = b->cap ? b->cap : 64;
	while (ncap < need)
		ncap *= 2;
	np = realloc(b->p, ncap);
	if (np == NULL)
	{
		P->oom = 1;
		return -1;
	}
	b->p = np;
	b->cap = ncap;
	return 0;
}

static int
sb_put(parser *P, sbuf *b, const void *s, size_t n)
{
	if (sb_reserve(P, b, n) != 0)
		return -1;
	memcpy(b->p + b->len, s, n);
	b->len += n;
	b->p[b->len] = '\0';
	return 0;
}

static int
sb_putc(parser *P, sbuf *b, char c)
{
	return sb_put(P, b, &c, 1);
}

static int
sb_fill(parser *P, sbuf *b, char c, size_t n)
{
	if (sb_reserve(P, b, n) != 0)
		return -1;
	memset(b->p + b->len, c, n);
	b->len += n;
	b->p[b->len] = '\0';
	return 0;
}

static int
fail(parser *P, const char *what)
{
	if (P->err && P->err[0] == '\0')
		idemc_set_err(P->err, P->errlen, "invalid JSON at byte %zu: %s",
					 P->pos, what);
	return -1;
}

int
idemc_utf8_valid(const char *buf, size_t len)
{
	const unsigned char *s = (const unsigned char *) buf;
	size_t		i = 0;

	while (i < len)
	{
		unsigned char c = s[i];
		size_t		n;
		unsigned char lo = 0x80,
					hi = 0xBF;
		size_t		k;

		if (c == 0)
			return 0;
		if (c < 0x80)
		{
			i++;
			continue;
		}
		if (c >= 0xC2 && c <= 0xDF)
			n = 2;
		else if (c >= 0xE0 && c <= 0xEF)
		{
			n = 3;
			if (c == 0xE0)
				lo = 0xA0;
			else if (c == 0xED)
				hi = 0x9F;
		}
		else if (c >= 0xF0 && c <= 0xF4)
		{
			n = 4;
			if (c == 0xF0)
				lo = 0x90;
			else if (c == 0xF4)
				hi = 0x8F;
		}
		else
			return 0;
		if (len - i < n)
			return 0;
		if (s[i + 1] < lo || s[i + 1] > hi)
			return 0;
		for (k = 2; k < n; k++)
			if (s[i + k] < 0x80 || s[i + k] > 0xBF)
				return 0;
		i += n;
	}
	return 1;
}

static void
skip_ws(parser *P)
{
	while (P->pos < P->len)
	{
		unsigned char c = P->s[P->pos];

		if (c == ' ' || c == '\t' || c == '\n' || c == '\r')
			P->pos++;
		else
			break;
	}
}

static int
hex4(parser *P, unsigned *out)
{
	unsigned	v = 0;
	int			i;

	if (P->len - P->pos < 4)
		return fail(P, "truncated \\u escape");
	for (i = 0; i < 4; i++)
	{
		unsigned char c = P->s[P->pos + i];

		v <<= 4;
		if (c >= '0' && c <= '9')
			v |= c - '0';
		else if (c >= 'a' && c <= 'f')
			v |= c - 'a' + 10;
		else if (c >= 'A' && c <= 'F')
			v |= c - 'A' + 10;
		else
			return fail(P, "bad \\u escape");
	}
	P->pos += 4;
	*out = v;
	return 0;
}

static int
put_utf8(parser *P, sbuf *b, unsigned cp)
{
	char		u[4];
	size_t		n;

	if (cp < 0x80)
	{
		u[0] = (char) cp;
		n = 1;
	}
	else if (cp < 0x800)
	{
		u[0] = (char) (0xC0 | (cp >> 6));
		u[1] = (char) (0x80 | (cp & 0x3F));
		n = 2;
	}
	else if (cp < 0x10000)
	{
		u[0] = (char) (0xE0 | (cp >> 12));
		u[1] = (char) (0x80 | ((cp >> 6) & 0x3F));
		u[2] = (char) (0x80 | (cp & 0x3F));
		n = 3;
	}
	else
	{
		u[0] = (char) (0xF0 | (cp >> 18));
		u[1] = (char) (0x80 | ((cp >> 12) & 0x3F));
		u[2] = (char) (0x80 | ((cp >> 6) & 0x3F));
		u[3] = (char) (0x80 | (cp & 0x3F));
		n = 4;
	}
	return sb_put(P, b, u, n);
}

/* Parse a string at P->pos (on the opening quote); decoded bytes to out. */
static int
parse_string(parser *P, sbuf *out)
{
	P->pos++;					/* opening quote */
	for (;;)
	{
		unsigned char c;

		if (P->pos >= P->len)
			return fail(P, "unterminated string");
		c = P->s[P->pos];
		if (c == '"')
		{
			P->pos++;
			return sb_put(P, out, "", 0);	/* ensures out->p exists */
		}
		if (c < 0x20)
			return fail(P, "control character in string must be escaped");
		if (c != '\\')
		{
			size_t		start = P->pos;

			while (P->pos < P->len && P->s[P->pos] != '"' &&
				   P->s[P->pos] != '\\' && P->s[P->pos] >= 0x20)
				P->pos++;
			if (sb_put(P, out, P->s + start, P->pos - start) != 0)
				return -1;
			continue;
		}
		P->pos++;
		if (P->pos >= P->len)
			return fail(P, "unterminated escape");
		c = P->s[P->pos++];
		switch (c)
		{
			case '"':
			case '\\':
			case '/':
				if (sb_putc(P, out, (char) c) != 0)
					return -1;
				break;
			case 'b':
				if (sb_putc(P, out, '\b') != 0)
					return -1;
				break;
			case 'f':
				if (sb_putc(P, out, '\f') != 0)
					return -1;
				break;
			case 'n':
				if (sb_putc(P, out, '\n') != 0)
					return -1;
				break;
			case 'r':
				if (sb_putc(P, out, '\r') != 0)
					return -1;
				break;
			case 't':
				if (sb_putc(P, out, '\t') != 0)
					return -1;
				break;
			case 'u':
				{
					unsigned	cp;

					if (hex4(P, &cp) != 0)
						return -1;
					if (cp >= 0xD800 && cp <= 0xDBFF)
					{
						unsigned	lo;

						if (P->len - P->pos < 2 || P->s[P->pos] != '\\' ||
							P->s[P->pos + 1] != 'u')
							return fail(P, "high surrogate not followed by a low surrogate");
						P->pos += 2;
						if (hex4(P, &lo) != 0)
							return -1;
						if (lo < 0xDC00 || lo > 0xDFFF)
							return fail(P, "high surrogate not followed by a low surrogate");
						cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
					}
					else if (cp >= 0xDC00 && cp <= 0xDFFF)
						return fail(P, "low surrogate without a high surrogate");
					else if (cp == 0)
						return fail(P, "\\u0000 is not supported by jsonb");
					if (put_utf8(P, out, cp) != 0)
						return -1;
					break;
				}
			default:
				return fail(P, "invalid escape");
		}
	}
}

/* escape_json() of PostgreSQL: the string with quotes, to out. */
static int
emit_string(parser *P, sbuf *out, const char *s, size_t n)
{
	size_t		i;
	size_t		run = 0;

	if (sb_putc(P, out, '"') != 0)
		return -1;
	for (i = 0; i < n; i++)
	{
		unsigned char c = (unsigned char) s[i];
		const char *esc = NULL;
		char		ubuf[8];

		switch (c)
		{
			case '\b':
				esc = "\\b";
				break;
			case '\f':
				esc = "\\f";
				break;
			case '\n':
				esc = "\\n";
				break;
			case '\r':
				esc = "\\r";
				break;
			case '\t':
				esc = "\\t";
				break;
			case '"':
				esc = "\\\"";
				break;
			case '\\':
				esc = "\\\\";
				break;
			default:
				if (c < 0x20)
				{
					snprintf(ubuf, sizeof(ubuf), "\\u%04x", (unsigned) c);
					esc = ubuf;
				}
				break;
		}
		if (esc == NULL)
		{
			run++;
			continue;
		}
		if (sb_put(P, out, s + i - run, run) != 0 ||
			sb_put(P, out, esc, strlen(esc)) != 0)
			return -1;
		run = 0;
	}
	if (sb_put(P, out, s + n - run, run) != 0)
		return -1;
	return sb_putc(P, out, '"');
}

static int
is_digit(unsigned char c)
{
	return c >= '0' && c <= '9';
}

/* A number, printed as numeric_out(numeric_in(text)). */
static int
parse_number(parser *P, sbuf *out)
{
	int			neg = 0;
	size_t		int_start,
				int_len,
				frac_start = 0,
				frac_len = 0;
	long		exp = 0;
	long		dscale;
	long		p;				/* decimal point position within all digits */
	size_t		ndig,
				z,
				i;
	int			allzero = 1;
	sbuf		dig = {0};
	int			rc = -1;

	if (P->s[P->pos] == '-')
	{
		neg = 1;
		P->pos++;
	}
	if (P->pos >= P->len || !is_digit(P->s[P->pos]))
		return fail(P, "invalid number");
	int_start = P->pos;
	if (P->s[P->pos] == '0')
		P->pos++;
	else
		while (P->pos < P->len && is_digit(P->s[P->pos]))
			P->pos++;
	int_len = P->pos - int_start;
	if (P->pos < P->len && P->s[P->pos] == '.')
	{
		P->pos++;
		frac_start = P->pos;
		while (P->pos < P->len && is_digit(P->s[P->pos]))
			P->pos++;
		frac_len = P->pos - frac_start;
		if (frac_len == 0)
			return fail(P, "invalid number");
	}
	if (P->pos < P->len && (P->s[P->pos] == 'e' || P->s[P->pos] == 'E'))
	{
		int			eneg = 0;
		size_t		estart;

		P->pos++;
		if (P->pos < P->len && (P->s[P->pos] == '+' || P->s[P->pos] == '-'))
			eneg = P->s[P->pos++] == '-';
		estart = P->pos;
		while (P->pos < P->len && is_digit(P->s[P->pos]))
		{
			if (exp < 10 * EXPONENT_LIMIT)
				exp = exp * 10 + (P->s[P->pos] - '0');
			P->pos++;
		}
		if (P->pos == estart)
			return fail(P, "invalid number");
		if (eneg)
			exp = -exp;
	}
	if (exp >= EXPONENT_LIMIT || exp <= -EXPONENT_LIMIT)
		return fail(P, "number overflows numeric format");

	/* all digits, the decimal point after int_len + exp of them */
	if (sb_put(P, &dig, P->s + int_start, int_len) != 0 ||
		(frac_len && sb_put(P, &dig, P->s + frac_start, frac_len) != 0))
		goto done;
	ndig = dig.len;
	for (i = 0; i < ndig; i++)
		if (dig.p[i] != '0')
			allzero = 0;
	dscale = (long) frac_len - exp;
	if (dscale < 0)
		dscale = 0;
	if (dscale > NUMERIC_DSCALE_MAX)
	{
		fail(P, "number overflows numeric format");
		goto done;
	}
	p = (long) int_len + exp;
	for (z = 0; z < ndig && dig.p[z] == '0'; z++)
		;
	if (!allzero && p > (long) z && p - (long) z > NUMERIC_INT_DIGITS_MAX)
	{
		fail(P, "number overflows numeric format");
		goto done;
	}
	if (!allzero && neg && sb_putc(P, out, '-') != 0)
		goto done;
	if (allzero || p <= (long) z)
	{
		if (sb_putc(P, out, '0') != 0)
			goto done;
	}
	else
	{
		size_t		end = (size_t) p < ndig ? (size_t) p : ndig;

		if (sb_put(P, out, dig.p + z, end - z) != 0)
			goto done;
		if ((size_t) p > ndig && sb_fill(P, out, '0', (size_t) p - ndig) != 0)
			goto done;
	}
	if (dscale > 0)
	{
		long		q;

		if (sb_putc(P, out, '.') != 0)
			goto done;
		if (allzero)
		{
			if (sb_fill(P, out, '0', (size_t) dscale) != 0)
				goto done;
		}
		else
		{
			/* dscale == ndig - p here: digits p .. ndig-1, zeros before 0 */
			if (p < 0 && sb_fill(P, out, '0', (size_t) (-p)) != 0)
				goto done;
			q = p < 0 ? 0 : p;
			if (sb_put(P, out, dig.p + q, ndig - (size_t) q) != 0)
				goto done;
		}
	}
	rc = 0;
done:
	free(dig.p);
	return rc;
}

static int	parse_value(parser *P, sbuf *out);

static int
member_cmp(const void *a, const void *b)
{
	const member *x = a;
	const member *y = b;
	int			c;

	if (x->klen != y->klen)
		return x->klen < y->klen ? -1 : 1;
	c = memcmp(x->key, y->key, x->klen);
	if (c != 0)
		return c;
	return x->order < y->order ? -1 : (x->order > y->order);
}

static int
parse_object(parser *P, sbuf *out)
{
	member	   *m = NULL;
	size_t		n = 0,
				cap = 0,
				i;
	int			rc = -1;
	int			first = 1;

	P->pos++;					/* { */
	skip_ws(P);
	if (P->pos < P->len && P->s[P->pos] == '}')
		P->pos++;
	else
	{
		for (;;)
		{
			sbuf		k = {0},
						v = {0};

			skip_ws(P);
			if (P->pos >= P->len || P->s[P->pos] != '"')
			{
				fail(P, "expected an object key");
				goto done;
			}
			if (n == cap)
			{
				size_t		ncap = cap ? cap * 2 : 8;
				member	   *nm = realloc(m, ncap * sizeof(member));

				if (nm == NULL)
				{
					P->oom = 1;
					goto done;
				}
				m = nm;
				cap = ncap;
			}
			if (parse_string(P, &k) != 0)
			{
				free(k.p);
				goto done;
			}
			skip_ws(P);
			if (P->pos >= P->len || P->s[P->pos] != ':')
			{
				free(k.p);
				fail(P, "expected ':'");
				goto done;
			}
			P->pos++;
			if (parse_value(P, &v) != 0)
			{
				free(k.p);
				free(v.p);
				goto done;
			}
			m[n].key = k.p;
			m[n].klen = k.len;
			m[n].val = v.p;
			m[n].vlen = v.len;
			m[n].order = n;
			n++;
			skip_ws(P);
			if (P->pos < P->len && P->s[P->pos] == ',')
			{
				P->pos++;
				continue;
			}
			if (P->pos < P->len && P->s[P->pos] == '}')
			{
				P->pos++;
				break;
			}
			fail(P, "expected ',' or '}'");
			goto done;
		}
	}
	if (n > 1)
		qsort(m, n, sizeof(member), member_cmp);
	if (sb_putc(P, out, '{') != 0)
		goto done;
	for (i = 0; i < n; i++)
	{
		/* duplicates: keep the last one (highest order sorts last) */
		if (i + 1 < n && m[i].klen == m[i + 1].klen &&
			memcmp(m[i].key, m[i + 1].key, m[i].klen) == 0)
			continue;
		if (!first && sb_put(P, out, ", ", 2) != 0)
			goto done;
		first = 0;
		if (emit_string(P, out, m[i].key, m[i].klen) != 0 ||
			sb_put(P, out, ": ", 2) != 0 ||
			sb_put(P, out, m[i].val, m[i].vlen) != 0)
			goto done;
	}
	rc = sb_putc(P, out, '}');
done:
	for (i = 0; i < n; i++)
	{
		free(m[i].key);
		free(m[i].val);
	}
	free(m);
	return rc;
}

static int
parse_array(parser *P, sbuf *out)
{
	int			first = 1;

	P->pos++;					/* [ */
	if (sb_putc(P, out, '[') != 0)
		return -1;
	skip_ws(P);
	if (P->pos < P->len && P->s[P->pos] == ']')
	{
		P->pos++;
		return sb_putc(P, out, ']');
	}
	for (;;)
	{
		if (!first && sb_put(P, out, ", ", 2) != 0)
			return -1;
		first = 0;
		if (parse_value(P, out) != 0)
			return -1;
		skip_ws(P);
		if (P->pos < P->len && P->s[P->pos] == ',')
		{
			P->pos++;
			continue;
		}
		if (P->pos < P->len && P->s[P->pos] == ']')
		{
			P->pos++;
			return sb_putc(P, out, ']');
		}
		return fail(P, "expected ',' or ']'");
	}
}

static int
parse_literal(parser *P, sbuf *out, const char *word)
{
	size_t		n = strlen(word);

	if (P->len - P->pos < n || memcmp(P->s + P->pos, word, n) != 0)
		return fail(P, "invalid token");
	P->pos += n;
	return sb_put(P, out, word, n);
}

static int
parse_value(parser *P, sbuf *out)
{
	int			rc;

	skip_ws(P);
	if (P->pos >= P->len)
		return fail(P, "unexpected end of input");
	switch (P->s[P->pos])
	{
		case '{':
		case '[':
			if (++P->depth > MAX_DEPTH)
				return fail(P, "nested too deeply");
			rc = P->s[P->pos] == '{' ? parse_object(P, out) : parse_array(P, out);
			P->depth--;
			return rc;
		case '"':
			{
				sbuf		s = {0};

				rc = parse_string(P, &s);
				if (rc == 0)
					rc = emit_string(P, out, s.p, s.len);
				free(s.p);
				return rc;
			}
		case 't':
			return parse_literal(P, out, "true");
		case 'f':
			return parse_literal(P, out, "false");
		case 'n':
			return parse_literal(P, out, "null");
		default:
			if (P->s[P->pos] == '-' || is_digit(P->s[P->pos]))
				return parse_number(P, out);
			return fail(P, "invalid token");
	}
}

char *
idem_json_canonical(const char *json, size_t len, size_t *out_len,
					char *errbuf, size_t errbuflen)
{
	parser		P;
	sbuf		out = {0};

	if (errbuf && errbuflen)
		errbuf[0] = '\0';
	if (out_len)
		*out_len = 0;
	if (json == NULL)
	{
		idemc_set_err(errbuf, errbuflen, "JSON text is NULL");
		errno = EINVAL;
		return NULL;
	}
	if (!idemc_utf8_valid(json, len))
	{
		idemc_set_err(errbuf, errbuflen, "JSON text is not valid UTF-8 (or contains a NUL byte)");
		errno = EINVAL;
		return NULL;
	}
	memset(&P, 0, sizeof(P));
	P.s = (const unsigned char *) json;
	P.len = len;
	P.err = errbuf;
	P.errlen = errbuflen;
	if (parse_value(&P, &out) == 0)
	{
		skip_ws(&P);
		if (P.pos == P.len)
		{
			if (out_len)
				*out_len = out.len;
			return out.p;
		}
		fail(&P, "trailing characters after the JSON value");
	}
	if (P.oom)
		idemc_set_err(errbuf, errbuflen, "out of memory");
	free(out.p);
	errno = P.oom ? ENOMEM : EINVAL;	/* what callers classify by */
	return NULL;
}

void
idem_free(void *ptr)
{
	free(ptr);
}
