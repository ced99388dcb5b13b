/*-------------------------------------------------------------------------
 *
 * sql_args.h
 *	  What every SQL function of idem checks of its arguments.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_SQL_ARGS_H
#define IDEM_SQL_ARGS_H

#include "postgres.h"

#include "fmgr.h"

/* Every SQL function refuses NULL arguments with the same error. */
static inline void
idem_require_arg(FunctionCallInfo fcinfo, int argno, const char *name)
{
	if (PG_ARGISNULL(argno))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("%s must not be null", name)));
}

#endif							/* IDEM_SQL_ARGS_H */
