/*
 * valkey_conn.h
 *	  Private to the gate's files (valkey_conn.c, gate.c, release.c): the
 *	  gate's state, and its one way to send commands.  What the rest of the
 *	  client uses is in internal.h.
 */
#ifndef IDEM_CLIENT_VALKEY_CONN_H
#define IDEM_CLIENT_VALKEY_CONN_H

#include <stddef.h>
#include <stdint.h>

#include <hiredis/hiredis.h>

#include "valkey_router.h"

struct idem_gate
{
	char	   *host;
	int			port;
	char	   *password;
	int			db;
	int			connect_timeout_ms;
	int			command_timeout_ms;
	int			retry_ms;
	char	   *nodes;			/* more seeds, "host:port,..." */
	int			cluster_mode;	/* 0 auto, 1 on, -1 off */
	idem_vc    *vc;				/* the router: one node or a cluster's
								 * masters; NULL until first used */
	int64_t		down_until;		/* monotonic ms: no open before */
	int64_t		rest_until;		/* monotonic ms: not used before, open or
								 * not (idemc_gate_rest: not the server's) */
	gate_report_fn report;		/* told what goes wrong (health.c) */
	void	   *report_arg;
	int			reported;		/* a problem was reported since the last
								 * answer: the next answer says it is over */
	char		endpoint[IDEM_VC_HOST_MAX + 8];	/* "host:port" */
	long		round_trips;	/* calls of idemc_gate_pipeline */
	char		config_error[160];	/* non-empty: Valkey is not usable as
									 * configured (valkey_db on a cluster) */
};

/* valkey_conn.c */
int			idemc_gate_ensure(idem_gate *g);
void		idemc_gate_pipeline(idem_gate *g, idem_vc_cmd *cmds, int n);

/* release.c: the compare-and-delete script, and its SHA-1 (its EVALSHA
 * name; every connection's setup checks it against what SCRIPT LOAD
 * answers, so a script changed without it fails every connect) */
extern const char idemc_cad_script[];
extern const char idemc_cad_sha1[];

#endif
