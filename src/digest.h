/*-------------------------------------------------------------------------
 *
 * digest.h
 *	  The 32-byte bytea of keys and fingerprints, and the database
 *	  encoding they need (digest.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_DIGEST_H
#define IDEM_DIGEST_H

#include "cache_format.h"

/* Room for a digest as a bytea (e.g. on the stack), suitably aligned. */
typedef union IdemDigestBytea
{
	char		bytes[VARHDRSZ + IDEM_DIGEST_LEN];
	int32		align;
} IdemDigestBytea;

extern bytea *idem_digest_bytea(const uint8 *digest, IdemDigestBytea *buf);
extern void idem_digest_check(const bytea *d, const char *name, uint8 *out);
extern void idem_require_utf8(void);

#endif							/* IDEM_DIGEST_H */
