/*-------------------------------------------------------------------------
 *
 * valkey_slots.h
 *	  The slot of a key and the class of an error reply (valkey_slots.c):
 *	  pure functions, unit tested (client/tests).  Plain C: compiled into
 *	  idem.so and libidemclient.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_VALKEY_SLOTS_H
#define IDEM_VALKEY_SLOTS_H

#include <stddef.h>
#include <stdint.h>

#define IDEM_VC_SLOTS		16384

/* CRC16-CCITT (XMODEM), the one Valkey Cluster uses. */
uint16_t	idem_vc_crc16(const char *buf, size_t len);

/* The slot of a key: CRC16 of the hash tag ({...}, if non-empty) or the key. */
int			idem_vc_key_slot(const char *key, size_t len);

typedef enum idem_vc_errkind
{
	IDEM_VC_REPLY = 0,			/* not a redirect or a transient error */
	IDEM_VC_MOVED,				/* MOVED <slot> <host>:<port> */
	IDEM_VC_ASK,				/* ASK <slot> <host>:<port> */
	IDEM_VC_RETRY				/* a transient state (valkey_reply.h:
								 * IDEM_VK_ERR_TRANSIENT): keep the command,
								 * retry later */
} idem_vc_errkind;

/*
 * Classify an error reply's text.  For MOVED and ASK, *slot, host (NUL-
 * terminated, at most hostlen - 1 bytes) and *port are set; a malformed
 * redirect is IDEM_VC_REPLY.
 */
idem_vc_errkind idem_vc_classify(const char *err, size_t len, int *slot,
								 char *host, size_t hostlen, int *port);

#endif							/* IDEM_VALKEY_SLOTS_H */
