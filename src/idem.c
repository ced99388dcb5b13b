/*-------------------------------------------------------------------------
 *
 * idem.c
 *	  Module load: defines the settings, registers the transaction callbacks
 *	  once per process, and, when loaded through shared_preload_libraries,
 *	  reserves the shared queue and registers the background worker.
 *
 *-------------------------------------------------------------------------
 */
#include "idem.h"
#include "ledger.h"

#include "miscadmin.h"
#include "utils/inval.h"
#include "utils/syscache.h"

PG_MODULE_MAGIC;

void		_PG_init(void);

const char *const idem_decision_names[IDEM_DECISION_COUNT] = {
	"claimed", "completed", "failed_permanent", "busy", "mismatch"
};

void
_PG_init(void)
{
	idem_define_gucs();
	idem_pending_init();
	CacheRegisterRelcacheCallback(ledger_store_relcache_cb, (Datum) 0);
	CacheRegisterRelcacheCallback(ledger_insert_relcache_cb, (Datum) 0);
	CacheRegisterSyscacheCallback(PROCOID, ledger_insert_syscache_cb, (Datum) 0);
	CacheRegisterSyscacheCallback(TYPEOID, ledger_insert_syscache_cb, (Datum) 0);
	CacheRegisterSyscacheCallback(AUTHMEMROLEMEM, ledger_insert_syscache_cb, (Datum) 0);
	idem_outbox_init(process_shared_preload_libraries_in_progress);
	if (process_shared_preload_libraries_in_progress)
		idem_worker_register();
}
