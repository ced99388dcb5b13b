/*-------------------------------------------------------------------------
 *
 * compat.h
 *	  The one place for differences between PostgreSQL versions (15 and
 *	  later).  Every other file includes it through idem.h and uses the
 *	  names defined here instead of testing PG_VERSION_NUM itself.
 *
 * Symbol visibility.  idem.so is built with -fvisibility=hidden (Makefile),
 * so that its internal functions cannot clash with another library's:
 * PostgreSQL loads extensions with RTLD_GLOBAL.  Only what PostgreSQL looks
 * up by name is exported: _PG_init, Pg_magic_func, the SQL functions and
 * their pg_finfo_ records, and the background worker's entry point.
 * PostgreSQL 16 and later define PGDLLEXPORT as the visibility attribute and
 * declare all of those with it.  On 15, PGDLLEXPORT is empty outside
 * Windows and PG_FUNCTION_INFO_V1 does not mark the function itself, so
 * IDEM_EXPORT supplies the attribute and PG_FUNCTION_INFO_V1 is replaced by
 * PostgreSQL 16's definition.  test/t/002_exports.pl checks the result.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_COMPAT_H
#define IDEM_COMPAT_H

#include "postgres.h"

#include "fmgr.h"

#if PG_VERSION_NUM >= 160000 || defined(WIN32) || !defined(__GNUC__)
#define IDEM_EXPORT PGDLLEXPORT
#else
#define IDEM_EXPORT __attribute__((visibility("default")))

#undef PG_FUNCTION_INFO_V1
#define PG_FUNCTION_INFO_V1(funcname) \
extern IDEM_EXPORT Datum funcname(PG_FUNCTION_ARGS); \
extern IDEM_EXPORT const Pg_finfo_record * CppConcat(pg_finfo_,funcname)(void); \
const Pg_finfo_record * \
CppConcat(pg_finfo_,funcname) (void) \
{ \
	static const Pg_finfo_record my_finfo = { 1 }; \
	return &my_finfo; \
} \
extern int no_such_variable

/* PG_MODULE_MAGIC declares it PGDLLEXPORT: this earlier declaration wins. */
extern IDEM_EXPORT const Pg_magic_struct *PG_MAGIC_FUNCTION_NAME(void);
#endif

/* The process number of the running backend (MyProcNumber from 17 on). */
#if PG_VERSION_NUM >= 170000
#define IDEM_MY_PROCNO	((uint32) MyProcNumber)
#else
#define IDEM_MY_PROCNO	((uint32) MyProc->pgprocno)
#endif

#endif							/* IDEM_COMPAT_H */
