/*-------------------------------------------------------------------------
 *
 * idem.c
 *	  Module load.  _PG_init is the one place that wires idem into the
 *	  server: it defines the settings, registers every callback (once per
 *	  process: _PG_init runs once per process), and, when idem is loaded
 *	  through shared_preload_libraries, hands shared memory to shmem.c and
 *	  registers the background worker.
 *
 *	  Callbacks registered here:
 *		xact.c			the transaction and subtransaction callbacks
 *		ledger_store.c	a relcache callback that forgets a ledger's cached
 *						identity when the ledger changes
 *		ledger_insert.c	relcache and syscache (functions, types, role
 *						membership) callbacks that invalidate the prepared
 *						direct insert
 *
 *-------------------------------------------------------------------------
 */
#include "idem.h"
#include "ledger.h"
#include "citus.h"

#include "miscadmin.h"
#include "utils/inval.h"
#include "utils/syscache.h"

PG_MODULE_MAGIC;

extern IDEM_EXPORT void _PG_init(void);

const char *const idem_decision_names[IDEM_DECISION_COUNT] = {
	"claimed", "completed", "failed_permanent", "busy", "mismatch"
};

const char *const idem_status_names[IDEM_STATUS_COUNT] = {
	"processing", "completed", "failed_retryable", "failed_permanent"
};

/* The status spelled name; false when it is none of them. */
bool
idem_status_parse(const char *name, IdemStatus *status)
{
	int			i;

	for (i = 0; i < IDEM_STATUS_COUNT; i++)
		if (strcmp(name, idem_status_names[i]) == 0)
		{
			*status = (IdemStatus) i;
			return true;
		}
	return false;
}

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

	if (process_shared_preload_libraries_in_progress)
	{
		idem_shmem_register();
		idem_worker_register();
	}
}
