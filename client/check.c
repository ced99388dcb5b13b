/*
 * check.c
 *	  idem_runner_check(): the start-up check, as libpq's PQping.  In the
 *	  order a run needs them: PostgreSQL answers (one round trip, timed),
 *	  the idem extension is installed there (its version), the role may
 *	  read the cache keyspace and secrets (trust.c learns them now),
 *	  Valkey answers a new connection with AUTH and its setup accepted
 *	  (valkey_conn.c, without waiting out a rest), and the epoch owner key
 *	  there holds the token the server names (one GET, timed): the same
 *	  Valkey the server's worker writes to.  The first problem is the
 *	  report's status, in words in its message.
 *
 *	  Locking: none; the runner's, used by one thread at a time.
 */
#include "internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void
idem_check_report_init_size(idem_check_report *rep, size_t size)
{
	idem_check_report d;

	memset(&d, 0, sizeof(d));
	d.pg_rtt_us = -1;
	d.valkey_rtt_us = -1;
	idemc_struct_init(rep, size, IDEM_CHECK_REPORT_SIZE_MIN, &d, sizeof(d));
}

const char *
idem_check_status_name(idem_check_status st)
{
	switch (st)
	{
		case IDEM_CHECK_OK:
			return "ok";
		case IDEM_CHECK_OPTIONS:
			return "options";
		case IDEM_CHECK_PG_UNREACHABLE:
			return "pg_unreachable";
		case IDEM_CHECK_NO_EXTENSION:
			return "no_extension";
		case IDEM_CHECK_CACHE_UNAVAILABLE:
			return "cache_unavailable";
		case IDEM_CHECK_VALKEY_UNREACHABLE:
			return "valkey_unreachable";
		case IDEM_CHECK_VALKEY_AUTH:
			return "valkey_auth";
		case IDEM_CHECK_VALKEY_REFUSED:
			return "valkey_refused";
		case IDEM_CHECK_VALKEY_NOT_SERVERS:
			return "valkey_not_servers";
	}
	return "unknown";
}

static idem_check_status
problem(idem_check_report *rep, idem_check_status st, const char *fmt,...)
			__attribute__((format(printf, 3, 4)));

static idem_check_status
problem(idem_check_report *rep, idem_check_status st, const char *fmt,...)
{
	va_list		ap;
	char	   *p;

	rep->status = st;
	va_start(ap, fmt);
	vsnprintf(rep->message, sizeof(rep->message), fmt, ap);
	va_end(ap);
	for (p = rep->message; *p; p++)
		if ((unsigned char) *p < ' ')
			*p = ' ';
	return st;
}

/* The checks, into a report of our size. */
static idem_check_status
check(idem_runner *r, idem_check_report *rep)
{
	char		msg[512];
	char		val[IDEM_CACHE_EPOCH_TOKEN_LEN + 64];
	int			fresh;
	PGresult   *res;
	valkey_problem vp;
	int			rc;

	if (r == NULL)
		return problem(rep, IDEM_CHECK_OPTIONS, "runner is NULL");
	if (r->broken)
		return problem(rep, IDEM_CHECK_OPTIONS, "invalid runner options: %s",
					   r->errmsg);

	/* PostgreSQL, and the extension (pg.c looks its schema up) */
	msg[0] = '\0';
	if (idemc_pg_ensure(&r->pg, &fresh, msg, sizeof(msg)) != 0)
	{
		if (strstr(msg, "is not installed") != NULL)
		{
			rep->pg_ok = 1;
			return problem(rep, IDEM_CHECK_NO_EXTENSION, "%s", msg);
		}
		return problem(rep, IDEM_CHECK_PG_UNREACHABLE, "%s", msg);
	}
	if (PQtransactionStatus(r->pg.conn) != PQTRANS_IDLE)
		(void) idemc_pg_exec(&r->pg, "ROLLBACK");	/* cannot normally happen */
	{
		struct timespec a,
					b;

		clock_gettime(CLOCK_MONOTONIC, &a);
		r->pg.round_trips++;
		res = PQexec(r->pg.conn,
					 "SELECT extversion FROM pg_catalog.pg_extension WHERE extname = 'idem'");
		clock_gettime(CLOCK_MONOTONIC, &b);
		rep->pg_rtt_us = (long) ((b.tv_sec - a.tv_sec) * 1000000L +
								 (b.tv_nsec - a.tv_nsec) / 1000);
	}
	if (PQresultStatus(res) != PGRES_TUPLES_OK)
	{
		snprintf(msg, sizeof(msg), "%s", PQresultErrorMessage(res));
		PQclear(res);
		if (PQstatus(r->pg.conn) != CONNECTION_OK)
		{
			idemc_pg_drop(&r->pg);
			return problem(rep, IDEM_CHECK_PG_UNREACHABLE,
						   "PostgreSQL connection lost: %s", msg);
		}
		rep->pg_ok = 1;
		return problem(rep, IDEM_CHECK_NO_EXTENSION,
					   "reading the idem extension's version failed: %s", msg);
	}
	rep->pg_ok = 1;
	if (PQntuples(res) != 1)
	{
		PQclear(res);
		return problem(rep, IDEM_CHECK_NO_EXTENSION,
					   "the extension idem is not installed in this database (CREATE EXTENSION idem)");
	}
	snprintf(rep->extension_version, sizeof(rep->extension_version), "%s",
			 PQgetvalue(res, 0, 0));
	PQclear(res);
	if (r->gate == NULL)
		return IDEM_CHECK_OK;

	/* what the server says the cache is, learnt now */
	rep->valkey_configured = 1;
	msg[0] = '\0';
	switch (idemc_trust_learn(&r->trust, &r->pg, msg, sizeof(msg)))
	{
		case TRUST_READY:
			break;
		case TRUST_UNKNOWN:
			return problem(rep, IDEM_CHECK_PG_UNREACHABLE,
						   "PostgreSQL connection lost learning the cache keyspace");
		case TRUST_DENIED:
			return problem(rep, IDEM_CHECK_CACHE_UNAVAILABLE, "%s", msg);
	}

	/* Valkey: a new connection, its setup checked */
	if (idemc_gate_open_now(r->gate, &vp, msg, sizeof(msg)) != 0)
		return problem(rep, vp == VALKEY_AUTH ? IDEM_CHECK_VALKEY_AUTH :
					   vp == VALKEY_DOWN ? IDEM_CHECK_VALKEY_UNREACHABLE :
					   IDEM_CHECK_VALKEY_REFUSED,
					   "Valkey at %s: %s", idemc_gate_endpoint(r->gate), msg);
	rep->valkey_ok = 1;

	/* the same Valkey as the server's worker: the owner key holds its token */
	{
		struct timespec a,
					b;

		clock_gettime(CLOCK_MONOTONIC, &a);
		rc = idemc_gate_get_now(r->gate, r->trust.owner_key, val, sizeof(val),
							   msg, sizeof(msg));
		clock_gettime(CLOCK_MONOTONIC, &b);
		if (rc >= 0)
			rep->valkey_rtt_us = (long) ((b.tv_sec - a.tv_sec) * 1000000L +
										 (b.tv_nsec - a.tv_nsec) / 1000);
	}
	if (rc < 0)
	{
		rep->valkey_ok = 0;
		return problem(rep, IDEM_CHECK_VALKEY_UNREACHABLE, "Valkey at %s: %s",
					   idemc_gate_endpoint(r->gate), msg);
	}
	if (rc == 0 || strcmp(val, r->trust.owner_token) != 0)
		return problem(rep, IDEM_CHECK_VALKEY_NOT_SERVERS,
					   "Valkey at %s is not the server's: its epoch owner key %s has %s, not the token idem_cache_secrets() names (point the runner at the Valkey the server's worker writes to, idem.valkey_host and idem.valkey_port; or that worker has not reached it yet)",
					   idemc_gate_endpoint(r->gate), r->trust.owner_key,
					   rc == 0 ? "no value" : "another value");
	rep->valkey_owner_ok = 1;
	/* all well: a rest for another Valkey is over */
	r->health.owner_bad_since = 0;
	idemc_gate_rest(r->gate, 0);
	return IDEM_CHECK_OK;
}

idem_check_status
idem_runner_check(idem_runner *r, idem_check_report *rep)
{
	idem_check_report full;
	idem_check_status st;

	if (rep == NULL ||
		!IDEM_STRUCT_SIZE_OK(rep->struct_size, IDEM_CHECK_REPORT_SIZE_MIN))
	{
		if (r)
			idemc_set_err(r->errmsg, sizeof(r->errmsg),
						 "report was not initialised by idem_check_report_init()");
		return IDEM_CHECK_OPTIONS;
	}
	idem_check_report_init(&full);
	st = check(r, &full);
	full.status = st;
	idemc_struct_copy_out(rep, &full, sizeof(full));
	return st;
}
