/*-------------------------------------------------------------------------
 *
 * idem.c
 *	  Module load.  _PG_init is the one place that wires idem into the
 *	  server: it defines the settings, registers every callback (once per
 *	  process: _PG_init runs once per process), and, when idem is loaded
 *	  through shared_preload_libraries, hands shared memory to shmem.c and
 *	  registers the background worker and the outbox launcher.
 *
 *	  Callbacks registered here:
 *		xact.c			the transaction and subtransaction callbacks
 *		ledger_registry.c
 *						a relcache callback that forgets a ledger's cached
 *						identity when the ledger changes (and calls the
 *						direct write's and the outbox's)
 *		ledger_insert.c	relcache and syscache (functions, types, role
 *						membership) callbacks that invalidate the prepared
 *						direct insert
 *		standby_slots.c	a log hook that drops the warning of a replay's
 *						cancelled wait for synchronous replication
 *		citus.c			a utility hook that, after ALTER EXTENSION idem
 *						UPDATE on a Citus coordinator, delegates the tenant
 *						functions the update created
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "miscadmin.h"
#include "utils/inval.h"
#include "utils/syscache.h"

#include "cache_secret.h"
#include "citus.h"
#include "compat.h"
#include "guc.h"
#include "ledger_guard.h"
#include "ledger_insert.h"
#include "ledger_store.h"
#include "outbox_publish.h"
#include "shmem.h"
#include "standby_slots.h"
#include "worker.h"
#include "xact.h"

PG_MODULE_MAGIC;

extern IDEM_EXPORT void _PG_init(void);

void
_PG_init(void)
{
	idem_define_gucs();

	RegisterXactCallback(idem_xact_callback, NULL);
	RegisterSubXactCallback(idem_subxact_callback, NULL);
	/* one slot of PostgreSQL 15's ten: ledger_store_relcache_cb calls the rest */
	CacheRegisterRelcacheCallback(ledger_store_relcache_cb, (Datum) 0);
	CacheRegisterSyscacheCallback(PROCOID, ledger_insert_syscache_cb, (Datum) 0);
	CacheRegisterSyscacheCallback(TYPEOID, ledger_insert_syscache_cb, (Datum) 0);
	CacheRegisterSyscacheCallback(AUTHMEMROLEMEM, ledger_insert_syscache_cb, (Datum) 0);
	idem_ledger_guard_register();
	idem_standby_slots_register();
	idem_citus_register();

	if (process_shared_preload_libraries_in_progress)
	{
		idem_shmem_register();
		idem_worker_register();
		idem_outbox_launcher_register();
		idem_cache_secret_register_stop();
	}
}
