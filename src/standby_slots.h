/*-------------------------------------------------------------------------
 *
 * standby_slots.h
 *	  Which servers hold a commit (standby_slots.c): what the worker waits
 *	  for before it copies a result to Valkey (idem.standby_slots and the
 *	  synchronous standbys), and what a replay waits for before it is
 *	  answered from another transaction's row.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_STANDBY_SLOTS_H
#define IDEM_STANDBY_SLOTS_H

#include "access/xlogdefs.h"

/* The worker: how far WAL is held by every standby a copy waits for. */
extern bool idem_standby_slots_flushed(XLogRecPtr *lsn, char *why,
									   size_t whylen);
extern void idem_standby_slots_holder(XLogRecPtr durable, char *what,
									  size_t whatlen);

/* A replay from another transaction's row. */
extern XLogRecPtr idem_commit_lsn(TransactionId writer);
extern void idem_replay_durable(XLogRecPtr commit_lsn);
extern void idem_standby_slots_register(void);

#endif							/* IDEM_STANDBY_SLOTS_H */
