/*
 * run_result.c
 *	  The run's result as its caller receives it: an error (one line, also
 *	  the runner's last error), an outcome, a replay from Valkey; and the
 *	  caller's result struct checked and filled by its struct_size.
 */
#include "run.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

idem_status
idemc_run_error(run_state *s, idem_error_code code, const char *sqlstate,
			 const char *fmt,...)
{
	va_list		ap;
	char	   *p;

	s->out->status = IDEM_ERROR;
	s->out->error_code = code;
	snprintf(s->out->sqlstate, sizeof(s->out->sqlstate), "%s",
			 sqlstate ? sqlstate : "");
	va_start(ap, fmt);
	vsnprintf(s->out->error_message, sizeof(s->out->error_message), fmt, ap);
	va_end(ap);
	/* one line: libpq's messages carry newlines and tabs */
	for (p = s->out->error_message; *p; p++)
		if ((unsigned char) *p < ' ')
			*p = ' ';
	snprintf(s->r->errmsg, sizeof(s->r->errmsg), "%s", s->out->error_message);
	s->out->outcome[0] = '\0';
	s->out->outcome_len = 0;
	return IDEM_ERROR;
}

void
idemc_result_set_outcome(idem_result *out, const char *text, size_t len)
{
	if (len > IDEM_OUTCOME_MAX_BYTES)
		len = IDEM_OUTCOME_MAX_BYTES;	/* cannot happen: checked before */
	memcpy(out->outcome, text, len);
	out->outcome[len] = '\0';
	out->outcome_len = len;
}

/* A trusted terminal value in Valkey (completed or failed_permanent) as
 * the run's result. */
void
idemc_result_from_cache(idem_result *out, const IdemCacheEntry *e)
{
	out->valkey_used = 1;
	out->source = IDEM_SOURCE_VALKEY;
	out->status = e->kind == IDEM_CACHE_COMPLETED ?
		IDEM_REPLAYED : IDEM_FAILED_PERMANENT;
	out->attempt = e->attempt;
	idemc_result_set_outcome(out, e->outcome, e->outcome_len);
}

void
idem_result_init_size(idem_result *res, size_t size)
{
	idemc_struct_init(res, size, IDEM_RESULT_SIZE_MIN, NULL, 0);
}

/* The function of the headers that passed no size: the first layout. */
void
(idem_result_init) (idem_result *res)
{
	idem_result_init_size(res, IDEM_RESULT_SIZE_MIN);
}

/*
 * A result the caller passed, checked (0) or refused (-1: nothing written,
 * the runner's message says why).
 */
int
idemc_result_size_ok(idem_runner *r, const idem_result *out)
{
	if (IDEM_STRUCT_SIZE_OK(out->struct_size, IDEM_RESULT_SIZE_MIN))
		return 0;
	/* its size is unknown: write nothing into it */
	if (r)
		idemc_set_err(r->errmsg, sizeof(r->errmsg),
					 "result was not initialised by idem_result_init() (struct_size %zu, expected %zu to %d)",
					 out->struct_size, (size_t) IDEM_RESULT_SIZE_MIN,
					 IDEM_STRUCT_SIZE_MAX);
	return -1;
}

/* Copy a full result into the caller's, within its struct_size. */
void
idemc_result_copy_out(idem_result *out, const idem_result *full)
{
	idemc_struct_copy_out(out, full, sizeof(*full));
}
