/*-------------------------------------------------------------------------
 *
 * compat.h
 *	  The one place for differences between PostgreSQL versions.  idem
 *	  supports 15 and later: 15 and 18 are built and tested on every run
 *	  (make test), 16 and 17 build under the same guards, and the changes
 *	  announced for 19 are handled here so idem builds the day it is
 *	  released.  Every file that meets one of these differences includes
 *	  it and uses the names defined here instead of testing PG_VERSION_NUM
 *	  itself; so does every file that declares a SQL function
 *	  (PG_FUNCTION_INFO_V1) or another symbol PostgreSQL looks up by name
 *	  (IDEM_EXPORT), else on 15 that symbol stays hidden.
 *
 *	  19, for the record: funcapi.h no longer includes access/htup_details.h
 *	  (files that form tuples include it themselves), and signal handlers
 *	  receive a const pg_signal_info * (idem installs only PostgreSQL's own
 *	  handlers; any of its own would be declared with SIGNAL_ARGS).
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

#if PG_VERSION_NUM < 150000
#error "idem needs PostgreSQL 15 or later"
#endif

/*
 * index_beginscan: 18 added the instrumentation argument (NULL: none), 19
 * a flags argument (0: a plain scan).
 */
#if PG_VERSION_NUM >= 190000
#define idem_index_beginscan(heap, index, snapshot, nkeys, norderbys) \
	index_beginscan((heap), (index), (snapshot), NULL, (nkeys), (norderbys), 0)
#elif PG_VERSION_NUM >= 180000
#define idem_index_beginscan(heap, index, snapshot, nkeys, norderbys) \
	index_beginscan((heap), (index), (snapshot), NULL, (nkeys), (norderbys))
#else
#define idem_index_beginscan(heap, index, snapshot, nkeys, norderbys) \
	index_beginscan((heap), (index), (snapshot), (nkeys), (norderbys))
#endif

/*
 * CHECK constraints of a result relation, as ExecRelCheck evaluates them.
 * 18 renamed the field, can leave a check unenforced (NOT ENFORCED: its
 * entry stays NULL, which ExecRelCheck skips), and has virtual generated
 * columns, whose references a check's expression must have replaced by
 * the column's expression before it is evaluated.
 */
#if PG_VERSION_NUM >= 180000
#define IDEM_RRI_CHECK_EXPRS(rri)	((rri)->ri_CheckConstraintExprs)
#define IDEM_CHECK_ENFORCED(check)	((check)->ccenforced)
#define idem_expand_virtual_columns(node, rel) \
	expand_generated_columns_in_expr((node), (rel), 1)
#else
#define IDEM_RRI_CHECK_EXPRS(rri)	((rri)->ri_ConstraintExprs)
#define IDEM_CHECK_ENFORCED(check)	true
#define idem_expand_virtual_columns(node, rel)	(node)
#endif

/* 16: the per-kind ACL checks became object_aclcheck. */
#if PG_VERSION_NUM >= 160000
#include "catalog/pg_proc.h"
#define idem_proc_aclcheck(proc, role, mode) \
	object_aclcheck(ProcedureRelationId, (proc), (role), (mode))
#else
#define idem_proc_aclcheck(proc, role, mode) pg_proc_aclcheck((proc), (role), (mode))
#endif
#if PG_VERSION_NUM >= 160000
#include "catalog/pg_namespace.h"
#define idem_namespace_aclcheck(nsp, role, mode) \
	object_aclcheck(NamespaceRelationId, (nsp), (role), (mode))
#else
#define idem_namespace_aclcheck(nsp, role, mode) \
	pg_namespace_aclcheck((nsp), (role), (mode))
#endif

/*
 * 17: intervals can be infinite ('infinity', '-infinity').  Before 17 every
 * interval is finite.
 */
#if PG_VERSION_NUM >= 170000
#define idem_interval_is_finite(iv)	(!INTERVAL_NOT_FINITE(iv))
#else
#define idem_interval_is_finite(iv)	true
#endif

/* 17: LockHeldByMe can also answer for a stronger mode; asked for mode. */
#if PG_VERSION_NUM >= 170000
#define idem_lock_held_by_me(tag, mode) LockHeldByMe((tag), (mode), false)
#else
#define idem_lock_held_by_me(tag, mode) LockHeldByMe((tag), (mode))
#endif

/* 17: a wait event set no longer takes a memory context. */
#if PG_VERSION_NUM >= 170000
#define idem_create_wait_event_set(nevents) CreateWaitEventSet(NULL, (nevents))
#else
#define idem_create_wait_event_set(nevents) \
	CreateWaitEventSet(TopMemoryContext, (nevents))
#endif

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

/*
 * 17: getIdentitySequence takes the relation, not its OID.  The _if_any
 * form returns InvalidOid for a column that is not an identity.
 */
#if PG_VERSION_NUM >= 170000
#include "access/relation.h"
#include "catalog/dependency.h"
static inline Oid
idem_identity_sequence_ext(Oid relid, AttrNumber attnum, bool missing_ok)
{
	Relation	rel = relation_open(relid, AccessShareLock);
	Oid			seq = getIdentitySequence(rel, attnum, missing_ok);

	relation_close(rel, AccessShareLock);
	return seq;
}
#else
#define idem_identity_sequence_ext(relid, attnum, missing_ok) \
	getIdentitySequence((relid), (attnum), (missing_ok))
#endif
#define idem_identity_sequence(relid, attnum) \
	idem_identity_sequence_ext((relid), (attnum), false)
#define idem_identity_sequence_if_any(relid, attnum) \
	idem_identity_sequence_ext((relid), (attnum), true)

/* The process number of the running backend (MyProcNumber from 17 on). */
#if PG_VERSION_NUM >= 170000
#define IDEM_MY_PROCNO	((uint32) MyProcNumber)
#else
#define IDEM_MY_PROCNO	((uint32) MyProc->pgprocno)
#endif

/*
 * Injection points (17 and later, in builds configured with
 * --enable-injection-points; tests only): IDEM_INJECTION_POINT(name) runs
 * what a test attached to name.  18 added an argument; before 17, and in
 * builds without them, nothing.
 */
#if PG_VERSION_NUM >= 170000
#include "utils/injection_point.h"
#if PG_VERSION_NUM >= 180000
#define IDEM_INJECTION_POINT(name)	INJECTION_POINT(name, NULL)
#else
#define IDEM_INJECTION_POINT(name)	INJECTION_POINT(name)
#endif
#else
#define IDEM_INJECTION_POINT(name)	((void) 0)
#endif

/*
 * Whether synchronous standbys are configured, in WalSndCtl (read under
 * SyncRepLock).  The 2025 minor releases of every branch replaced the flag
 * sync_standbys_defined by the bits of sync_standbys_status, which also
 * say whether the checkpointer has set it from synchronous_standby_names
 * yet (before that, the setting itself decides, as in syncrep.c).
 */
#include "replication/walsender_private.h"
#ifdef SYNC_STANDBY_DEFINED
#define IDEM_SYNC_STANDBYS_KNOWN(ctl) \
	(((ctl)->sync_standbys_status & SYNC_STANDBY_INIT) != 0)
#define IDEM_SYNC_STANDBYS_DEFINED(ctl) \
	(((ctl)->sync_standbys_status & SYNC_STANDBY_DEFINED) != 0)
#else
#define IDEM_SYNC_STANDBYS_KNOWN(ctl)	true
#define IDEM_SYNC_STANDBYS_DEFINED(ctl)	((ctl)->sync_standbys_defined)
#endif

/*
 * An invalidated replication slot: 16 records why (the field invalidated);
 * 15 only clears restart_lsn, which callers test anyway.  From 18 a
 * physical slot invalidated for idle_replication_slot_timeout keeps its
 * restart_lsn.
 */
#if PG_VERSION_NUM >= 160000
#define IDEM_SLOT_INVALIDATED(slot) \
	((slot)->data.invalidated != RS_INVAL_NONE)
#else
#define IDEM_SLOT_INVALIDATED(slot)	false
#endif

#endif							/* IDEM_COMPAT_H */
