/*-------------------------------------------------------------------------
 *
 * shmem.c
 *	  The one owner of idem's shared memory.  When idem is loaded through
 *	  shared_preload_libraries, _PG_init calls idem_shmem_register(), which
 *	  installs one shmem_request hook (reserving the space of every area and
 *	  the LWLock tranche) and one shmem_startup hook (initialising every
 *	  area), as pg_stat_statements does.  Each area's file sizes and
 *	  initialises its own struct:
 *		commit_ring.c	the queue from committing backends to the worker
 *		stats.c			the counters behind idem_stats()
 *		cache_secret.c	the shared copy of the cache secret
 *		epoch_renewal.c	the renewal generation and its waiters
 *		cache_cluster.c	the Citus cluster cache's joins
 *		outbox_launch.c	the databases whose outbox waits, and the launcher
 *
 *	  Without preloading nothing is reserved: the areas' pointers stay NULL
 *	  and their files treat that as "not available".
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "miscadmin.h"
#include "storage/ipc.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"

#include "shmem.h"
#include "cache_cluster.h"
#include "cache_secret.h"
#include "epoch_renewal.h"
#include "commit_ring.h"
#include "outbox_publish.h"
#include "stats.h"

static shmem_request_hook_type prev_shmem_request_hook = NULL;
static shmem_startup_hook_type prev_shmem_startup_hook = NULL;

static void
idem_shmem_request(void)
{
	if (prev_shmem_request_hook)
		prev_shmem_request_hook();

	RequestAddinShmemSpace(add_size(add_size(add_size(add_size(idem_ring_shmem_size(),
															   idem_stats_shmem_size()),
													  idem_cache_secret_shmem_size()),
											 idem_cache_cluster_shmem_size()),
									add_size(idem_renewal_shmem_size(),
											 idem_outbox_shmem_size())));
	RequestNamedLWLockTranche(IDEM_CACHE_SECRET_TRANCHE, 1);
}

static void
idem_shmem_startup(void)
{
	if (prev_shmem_startup_hook)
		prev_shmem_startup_hook();

	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	idem_ring_shmem_init();
	idem_stats_shmem_init();
	idem_cache_secret_shmem_init();
	idem_cache_cluster_shmem_init();
	idem_renewal_shmem_init();
	idem_outbox_shmem_init();
	LWLockRelease(AddinShmemInitLock);
}

/* From _PG_init, only while shared_preload_libraries is being processed. */
void
idem_shmem_register(void)
{
	Assert(process_shared_preload_libraries_in_progress);

	prev_shmem_request_hook = shmem_request_hook;
	shmem_request_hook = idem_shmem_request;
	prev_shmem_startup_hook = shmem_startup_hook;
	shmem_startup_hook = idem_shmem_startup;
}
