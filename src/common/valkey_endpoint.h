/*-------------------------------------------------------------------------
 *
 * valkey_endpoint.h
 *	  Endpoints as settings and slot maps spell them (valkey_endpoint.c):
 *	  host, host:port, [IPv6]:port.  Pure functions.  Plain C: compiled into
 *	  idem.so and libidemclient.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_VALKEY_ENDPOINT_H
#define IDEM_VALKEY_ENDPOINT_H

#include <stddef.h>

/* A host name or address, with its NUL, at most. */
#define IDEM_VC_HOST_MAX	256

/*
 * One endpoint of a seed list (s, len bytes): "host:port", "host",
 * "[IPv6 address]:port", "[IPv6 address]", or a bare IPv6 address (more
 * than one colon, no brackets: no port).  host gets the name or address
 * without brackets (NUL-terminated, at most hostlen - 1 bytes), *port the
 * port or default_port.  0, or -1 if malformed.
 */
int			idem_vc_parse_endpoint(const char *s, size_t len, int default_port,
								   char *host, size_t hostlen, int *port);
/* "host:port", or "[host]:port" for an IPv6 address. */
void		idem_vc_format_endpoint(char *buf, size_t len, const char *host,
									int port);

#endif							/* IDEM_VALKEY_ENDPOINT_H */
