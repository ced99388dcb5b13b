/* tap.h: a few lines of TAP for the client tests ("ok N - ...", plan last). */
#ifndef IDEM_TAP_H
#define IDEM_TAP_H

#include <stdarg.h>
#include <stdio.h>

static int tap_n = 0;
static int tap_failed = 0;

static int tap_ok(int cond, const char *fmt, ...) __attribute__((format(printf, 2, 3), unused));
static int
tap_ok(int cond, const char *fmt, ...)
{
	va_list		ap;

	printf("%sok %d - ", cond ? "" : "not ", ++tap_n);
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	printf("\n");
	fflush(stdout);
	if (!cond)
		tap_failed++;
	return cond;
}

static void tap_diag(const char *fmt, ...) __attribute__((format(printf, 1, 2), unused));
static void
tap_diag(const char *fmt, ...)
{
	va_list		ap;

	printf("# ");
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	printf("\n");
	fflush(stdout);
}

/* The plan goes last ("1..N"); exit status 1 on any failure. */
static int	tap_done(void) __attribute__((unused));
static int
tap_done(void)
{
	printf("1..%d\n", tap_n);
	fflush(stdout);
	return tap_failed ? 1 : 0;
}

#endif
