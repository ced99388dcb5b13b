/*-------------------------------------------------------------------------
 *
 * valkey_endpoint.c
 *	  Endpoints as settings and slot maps spell them: host, host:port,
 *	  [IPv6]:port.  Pure functions.
 *
 *-------------------------------------------------------------------------
 */
#include "valkey_endpoint.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int
idem_vc_parse_endpoint(const char *s, size_t len, int default_port,
					   char *host, size_t hostlen, int *port)
{
	const char *h = s;
	const char *colon = NULL;	/* before the port, if one is given */
	size_t		hl = len;
	size_t		i;
	long		v = default_port;

	if (len > 0 && s[0] == '[')
	{
		const char *close = memchr(s, ']', len);

		if (close == NULL)
			return -1;
		h = s + 1;
		hl = close - h;
		if (close + 1 < s + len)
		{
			if (close[1] != ':')
				return -1;
			colon = close + 1;
		}
	}
	else
	{
		int			ncolons = 0;

		for (i = 0; i < len; i++)
			if (s[i] == ':')
			{
				ncolons++;
				colon = s + i;
			}
		if (ncolons == 1)
			hl = colon - s;
		else
			colon = NULL;		/* none, or a bare IPv6 address */
	}
	if (colon != NULL)
	{
		const char *d = colon + 1;

		if (d == s + len)
			return -1;
		for (v = 0; d < s + len; d++)
		{
			if (*d < '0' || *d > '9' || v > 65535)
				return -1;
			v = v * 10 + (*d - '0');
		}
	}
	if (hl == 0 || hl >= hostlen || v <= 0 || v > 65535)
		return -1;
	memcpy(host, h, hl);
	host[hl] = '\0';
	*port = (int) v;
	return 0;
}

void
idem_vc_format_endpoint(char *buf, size_t len, const char *host, int port)
{
	snprintf(buf, len, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, port);
}
