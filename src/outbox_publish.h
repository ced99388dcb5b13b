/*-------------------------------------------------------------------------
 *
 * outbox_publish.h
 *	  Publishing the outbox: the databases flagged in shared memory and the
 *	  launcher that starts their publishers (outbox_launch.c), and the
 *	  publisher of one database (outbox_publish.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_OUTBOX_PUBLISH_H
#define IDEM_OUTBOX_PUBLISH_H

#include "compat.h"

/* Shared memory (shmem.c). */
extern Size idem_outbox_shmem_size(void);
extern void idem_outbox_shmem_init(void);

/* A committing backend's messages of database dboid wait (commit path). */
extern void idem_outbox_notify(Oid dboid);
extern void idem_outbox_notify_prepared(Oid dboid);

/* The launcher: registered by _PG_init, started by the postmaster. */
extern void idem_outbox_launcher_register(void);
extern IDEM_EXPORT void idem_outbox_launcher_main(Datum main_arg);

/* A publisher's life in the shared slots (outbox_launch.c). */
extern bool idem_outbox_publisher_attach(Oid dboid);
extern bool idem_outbox_publisher_sleepy(Oid dboid);
extern void idem_outbox_publisher_awake(Oid dboid);
extern bool idem_outbox_publisher_idle(Oid dboid);
extern uint32 idem_outbox_publisher_prepared(Oid dboid, bool some);
extern void idem_outbox_publisher_prepared_gone(Oid dboid, uint32 gen);
extern void idem_outbox_publisher_detach(Oid dboid, bool wanted);

/* The publisher of one database (outbox_publish.c). */
extern IDEM_EXPORT void idem_outbox_publisher_main(Datum main_arg);

#endif							/* IDEM_OUTBOX_PUBLISH_H */
