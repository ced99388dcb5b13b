/*-------------------------------------------------------------------------
 *
 * valkey_slots.c
 *	  The slot of a key (CRC16, hash tags) and the class of an error reply:
 *	  a redirect (MOVED, ASK, with the slot and node it names), a transient
 *	  state to retry (valkey_reply.c: its TRANSIENT class), or an answer
 *	  for the caller.  Pure functions, unit tested (client/tests).
 *
 *-------------------------------------------------------------------------
 */
#include "valkey_slots.h"

#include "valkey_endpoint.h"
#include "valkey_reply.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/*
 * CRC16-CCITT (XMODEM: polynomial 0x1021, initial 0, not reflected), a
 * byte at a time without a table: the byte's eight shifts of the
 * polynomial folded into three (x, x << 5, x << 12), about ten operations
 * a byte instead of eight conditional shifts.
 */
uint16_t
idem_vc_crc16(const char *buf, size_t len)
{
	uint16_t	crc = 0;
	size_t		i;

	for (i = 0; i < len; i++)
	{
		unsigned int x = ((crc >> 8) ^ (unsigned char) buf[i]) & 0xff;

		x ^= x >> 4;
		crc = (uint16_t) ((crc << 8) ^ (x << 12) ^ (x << 5) ^ x);
	}
	return crc;
}

int
idem_vc_key_slot(const char *key, size_t len)
{
	size_t		s,
				e;

	for (s = 0; s < len && key[s] != '{'; s++)
		;
	if (s < len)
	{
		for (e = s + 1; e < len && key[e] != '}'; e++)
			;
		if (e < len && e > s + 1)
			return idem_vc_crc16(key + s + 1, e - s - 1) & (IDEM_VC_SLOTS - 1);
	}
	return idem_vc_crc16(key, len) & (IDEM_VC_SLOTS - 1);
}

/* "<slot> <host>:<port>" after the word; 0 on success. */
static int
parse_redirect(const char *p, size_t len, int *slot, char *host,
			   size_t hostlen, int *port)
{
	char		buf[IDEM_VC_HOST_MAX + 32];
	char	   *sp,
			   *colon,
			   *end;
	long		v;

	if (len >= sizeof(buf))
		return -1;
	memcpy(buf, p, len);
	buf[len] = '\0';
	errno = 0;
	v = strtol(buf, &end, 10);
	if (end == buf || *end != ' ' || errno != 0 || v < 0 || v >= IDEM_VC_SLOTS)
		return -1;
	*slot = (int) v;
	sp = end + 1;
	colon = strrchr(sp, ':');
	if (colon == NULL || (size_t) (colon - sp) >= hostlen)
		return -1;
	errno = 0;
	v = strtol(colon + 1, &end, 10);
	if (end == colon + 1 || *end != '\0' || errno != 0 || v <= 0 || v > 65535)
		return -1;
	*port = (int) v;
	memcpy(host, sp, colon - sp);
	host[colon - sp] = '\0';
	return 0;
}

idem_vc_errkind
idem_vc_classify(const char *err, size_t len, int *slot, char *host,
				 size_t hostlen, int *port)
{
	idem_vk_error class = idem_vk_error_class(err, len);

	if (class == IDEM_VK_ERR_MOVED || class == IDEM_VK_ERR_ASK)
	{
		int			moved = class == IDEM_VK_ERR_MOVED;
		size_t		skip = moved ? 6 : 4;

		if (len <= skip ||
			parse_redirect(err + skip, len - skip, slot, host, hostlen, port) != 0)
			return IDEM_VC_REPLY;
		return moved ? IDEM_VC_MOVED : IDEM_VC_ASK;
	}
	/* UNAVAILABLE is the caller's: retrying within its deadline is a spin */
	if (class == IDEM_VK_ERR_TRANSIENT)
		return IDEM_VC_RETRY;
	return IDEM_VC_REPLY;
}
