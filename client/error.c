/*
 * error.c
 *	  The error text every part of the library hands back to its caller:
 *	  formatted into the caller's buffer, always NUL-terminated, cut to
 *	  fit (internal.h).  No state.
 */
#include "internal.h"

#include <stdarg.h>
#include <stdio.h>

void
idemc_set_err(char *buf, size_t buflen, const char *fmt,...)
{
	va_list		ap;

	if (buf == NULL || buflen == 0)
		return;
	va_start(ap, fmt);
	vsnprintf(buf, buflen, fmt, ap);
	va_end(ap);
}
