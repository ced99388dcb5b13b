/*
 * valkey_conn.h
 *	  Private to the gate's files (valkey_conn.c, valkey_io.c, gate.c,
 *	  release.c): the gate's state, and the calls between them.  What the
 *	  rest of the client uses is in internal.h.
 */
#ifndef IDEM_CLIENT_VALKEY_CONN_H
#define IDEM_CLIENT_VALKEY_CONN_H

#include <stddef.h>
#include <stdint.h>

#include <hiredis/hiredis.h>

#include "valkey_cluster.h"

struct idem_gate
{
	char	   *host;
	int			port;
	char	   *password;
	int			db;
	int			connect_timeout_ms;
	int			command_timeout_ms;
	int			retry_ms;
	redisContext *c;
	int64_t		down_until;		/* monotonic ms */
	long		round_trips;
	long		connects;
	int			last_errno;		/* of the last failed exchange; 0: EOF,
								 * timeout or protocol error */
	int			rcvtimeo_ms;	/* SO_RCVTIMEO of g->c's socket */
	/* Valkey Cluster */
	char	   *nodes;			/* more seeds, "host:port,..." */
	int			cluster_mode;	/* 0 auto, 1 on, -1 off */
	idem_vc    *vc;				/* non-NULL: cluster mode */
	long		stat_connects;	/* of routers freed */
	char	   *get_cmd;		/* GET <get_key>, formatted once: the owner */
	size_t		get_cmd_len;	/* check of every lookup (trust.c) */
	char	   *get_key;
	char		config_error[160];	/* non-empty: Valkey is not usable as
									 * configured (valkey_db on a cluster) */
};

/* valkey_conn.c */
void		idemc_gate_drop(idem_gate *g);
int			idemc_gate_ensure(idem_gate *g);

/* valkey_io.c */
int			idemc_vk_socket_setup(idem_gate *g);
int			idemc_vk_send_all(idem_gate *g, const char *buf, size_t len,
							  int64_t deadline);
redisReply *idemc_vk_read_reply(idem_gate *g, int64_t deadline);
redisReply *idemc_vk_command(idem_gate *g, int argc, const char **argv,
							 const size_t *argvlen);
void		idemc_vk_commands(idem_gate *g, int n, const int *argc,
							  const char *const *const *argv, redisReply **out);

/* release.c: the compare-and-delete script, and its SHA-1 (its EVALSHA
 * name; the connect checks it against what SCRIPT LOAD answers, so a script
 * changed without it fails every connect) */
extern const char idemc_cad_script[];
extern const char idemc_cad_sha1[];

#endif
