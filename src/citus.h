/*-------------------------------------------------------------------------
 *
 * citus.h
 *	  idem on Citus (citus.c): the narrow interface the ledger and install
 *	  code use.  Every function is a no-op answer on plain PostgreSQL.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_CITUS_H
#define IDEM_CITUS_H

#include "postgres.h"

#include "utils/timestamp.h"

extern void idem_citus_register(void);
extern void idem_citus_relcache_cb(Datum arg, Oid relid);
extern bool idem_citus_distributed(Oid relid);
extern Oid	idem_citus_local_shard(Oid relid, int64 tenant_id, int64 *shardid);
extern bool idem_citus_check_tenants(Oid tenants);
extern void idem_citus_distribute(const char *qledger, const char *qtenants,
								  Oid nsp);
extern int64 idem_citus_purge(Oid relid, const char *cmd);

#endif							/* IDEM_CITUS_H */
