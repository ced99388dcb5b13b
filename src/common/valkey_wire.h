/*-------------------------------------------------------------------------
 *
 * valkey_wire.h
 *	  The bytes of one Valkey connection (valkey_wire.c), the lowest layer
 *	  of idem's Valkey stack: send, read one reply, a new connection's
 *	  setup, each before a deadline, waiting through the caller (idem_vc_io).
 *	  Every Valkey connection of the worker and of the client goes through
 *	  it: the router's nodes (valkey_router.h) and the runner's gate.
 *
 * Plain C11 and POSIX: no PostgreSQL or libpq headers, malloc only.
 * hiredis is used only for its RESP writer and reader.  No locking: a
 * connection belongs to one thread.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_VALKEY_WIRE_H
#define IDEM_VALKEY_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include <hiredis/hiredis.h>

/* How a connection waits: the caller's (the worker's latch, poll()). */
typedef struct idem_vc_io
{
	/*
	 * Wait until fd is readable (for_write 0) or writable (1), or, with fd
	 * -1, just until deadline.  Returns 0 when ready (or, for fd -1, when
	 * the deadline passed), -1 on timeout, -2 to abandon at once (shutdown).
	 */
	int			(*wait) (void *arg, int fd, int for_write, int64_t deadline_ms);
	/* Called before a socket the module opened is closed; may be NULL. */
	void		(*closing) (void *arg, int fd);
	void	   *arg;
} idem_vc_io;

/*
 * Send len bytes before the deadline (send with MSG_NOSIGNAL|MSG_DONTWAIT;
 * a full buffer waits through io).  0; -1 (err set, errno kept: 0 for the
 * deadline); -2 abandon (io said so).
 */
int			idem_vc_wire_send(int fd, const char *buf, size_t len,
							  int64_t deadline_ms, const idem_vc_io *io,
							  char *err, size_t errlen);

/*
 * Read one reply (caller frees) before the deadline.  rcvtimeo_ms NULL: a
 * non-blocking socket, waited for through io on EAGAIN, or before the
 * first recv if wait_first.  Non-NULL: a blocking socket whose SO_RCVTIMEO
 * is *rcvtimeo_ms (idem_vc_wire_set_blocking), one blocking recv, the
 * timeout brought within the deadline (io unused).  0; -1 (err set, errno
 * kept: ECONNRESET for EOF, 0 for the deadline or a protocol error); -2
 * abandon.
 */
int			idem_vc_wire_read(int fd, redisReader *rd, int64_t deadline_ms,
							  int wait_first, int *rcvtimeo_ms,
							  const idem_vc_io *io, char *err, size_t errlen,
							  redisReply **out);

/* Append one formatted command to *buf (malloc'd, *len bytes).  0 or -1. */
int			idem_vc_wire_append(char **buf, size_t *len, int argc,
								const char **argv);

/* Make fd blocking, SO_RCVTIMEO timeout_ms (into *rcvtimeo_ms).  0 or -1. */
int			idem_vc_wire_set_blocking(int fd, int timeout_ms, int *rcvtimeo_ms);

typedef enum idem_vc_setup_refused
{
	IDEM_VC_SETUP_OK = 0,
	IDEM_VC_SETUP_AUTH,			/* AUTH answered an error */
	IDEM_VC_SETUP_SELECT		/* SELECT answered an error */
} idem_vc_setup_refused;

/*
 * A new connection's setup, in one round trip: AUTH (with a password), the
 * caller's commands, SELECT (db != 0), pipelined, every reply read before
 * the deadline.  The caller's commands' replies go to extra_replies (the
 * caller frees them; all NULL unless 0 or -3 is returned).  0; -1 no
 * answer (err set, errno kept); -2 abandon; -3 AUTH or SELECT refused
 * (refused says which, err has Valkey's text; extra_replies are set).
 */
typedef struct idem_vc_setup
{
	const char *password;		/* NULL or "": no AUTH */
	int			db;				/* 0: no SELECT */
	int			nextra;
	const int  *extra_argc;
	const char *const *const *extra_argv;
	redisReply **extra_replies; /* out, nextra of them */
	idem_vc_setup_refused refused;	/* out */
} idem_vc_setup;

int			idem_vc_wire_setup(int fd, idem_vc_setup *s, int64_t deadline_ms,
							   const idem_vc_io *io, char *err, size_t errlen);

/* Monotonic milliseconds. */
int64_t		idem_vc_now_ms(void);

#endif							/* IDEM_VALKEY_WIRE_H */
