/*-------------------------------------------------------------------------
 *
 * epoch_renewal.h
 *	  The renewal generation (epoch_renewal.c): what orders a commit that
 *	  removed ledger rows against the copies queued for Valkey and the
 *	  reads that repopulate it, and the removing commit's bounded wait for
 *	  the worker to retire the epoch it replaced.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_EPOCH_RENEWAL_H
#define IDEM_EPOCH_RENEWAL_H

/* Shared memory (shmem.c). */
extern Size idem_renewal_shmem_size(void);
extern void idem_renewal_shmem_init(void);

/* Everyone: the generation now (0 without preloading). */
extern uint64 idem_renewal_generation(void);

/* A read's copy: its stamp, or this while a removal is prepared. */
#define IDEM_RENEWAL_NO_COPY	PG_UINT64_MAX
extern uint64 idem_renewal_stamp(void);
extern void idem_renewal_prepared(TransactionId xid);

/* A commit that removed ledger rows (cache_secret.c's renewal). */
extern uint64 idem_renewal_bump(void);
extern void idem_renewal_wait(uint64 generation);

/* The worker took over an epoch made at that generation. */
extern void idem_renewal_taken(uint64 generation);

#endif							/* IDEM_EPOCH_RENEWAL_H */
