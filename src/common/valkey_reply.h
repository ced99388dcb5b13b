/*-------------------------------------------------------------------------
 *
 * valkey_reply.h
 *	  What a Valkey error reply means for the command that got it: one
 *	  classification (valkey_reply.c), used by the worker's copies, the
 *	  Valkey Cluster router (valkey_pipeline.c) and, through the router,
 *	  the client library.
 *
 * An error reply's first word is its code ("LOADING Valkey is loading the
 * dataset in memory"): a code matches only as a whole word ("BUSYKEY" is
 * not "BUSY").  Codes not listed are answers about the command itself
 * (ERR, WRONGTYPE, NOPERM, NOSCRIPT, ...): the caller judges them.
 *
 * Plain C, no PostgreSQL headers: compiled into idem.so and libidemclient.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_VALKEY_REPLY_H
#define IDEM_VALKEY_REPLY_H

#include <stddef.h>

typedef enum idem_vk_error
{
	IDEM_VK_ERR_ANSWER = 0,		/* about this command: it is refused, and
								 * sending it again will not change that */
	IDEM_VK_ERR_MOVED,			/* MOVED <slot> <host>:<port> */
	IDEM_VK_ERR_ASK,			/* ASK <slot> <host>:<port> */
	IDEM_VK_ERR_TRANSIENT,		/* the server or cluster is between two
								 * states (a failover, a resharding, a
								 * restart loading its data): the same
								 * command, sent again shortly, is taken */
	IDEM_VK_ERR_UNAVAILABLE		/* the server takes no writes until time or
								 * an operator mends it (memory full, disk
								 * failing, too few replicas, a script
								 * running, this connection not
								 * authenticated): keep the command, back
								 * off, do not spin on it */
} idem_vk_error;

/* The class of an error reply's text (len bytes, not NUL-terminated). */
extern idem_vk_error idem_vk_error_class(const char *err, size_t len);

/*
 * Does the error reply say "not now" (TRANSIENT or UNAVAILABLE): whatever
 * the command was meant to write must be kept and written later?
 */
extern int	idem_vk_error_not_now(const char *err, size_t len);

/* Is code (a NUL-terminated word) the reply's code: its whole first word? */
extern int	idem_vk_error_code_is(const char *err, size_t len, const char *code);

#endif							/* IDEM_VALKEY_REPLY_H */
