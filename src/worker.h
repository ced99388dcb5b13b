/*-------------------------------------------------------------------------
 *
 * worker.h
 *	  The background worker that copies results into Valkey (worker.c):
 *	  its registration, from _PG_init, and its entry point, which the
 *	  postmaster looks up by name.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_WORKER_H
#define IDEM_WORKER_H

#include "compat.h"

extern void idem_worker_register(void);
extern IDEM_EXPORT void idem_worker_main(Datum main_arg);

#endif							/* IDEM_WORKER_H */
