/*
 * itest_router.c: the Valkey router (src/common/valkey_*.c, shared by the
 * client's gate and the server's worker) against the real RESP server
 * (itest router).
 *
 *	  - a round that runs out of memory while it splits its commands sends
 *		none of them: the next pipeline on the same connection gets its own
 *		replies, not the abandoned round's.
 *	  - a new connection's setup (src/common/valkey_wire.c) with a password
 *		and a database is one round trip, for a router's node (with INFO
 *		cluster in auto mode, on one connect) and for the runner's gate, and
 *		what it selects is used; a wrong password is a failed connect.
 *
 * The itest binary is linked with --wrap=realloc (tests/Makefile), so that
 * a test can make the library's next realloc fail.
 */
#include <stdlib.h>
#include <string.h>

#include "itest.h"
#include "internal.h"
#include "valkey_router.h"

/* ---- realloc that fails on request ---- */

void	   *__real_realloc(void *p, size_t n);
void	   *__wrap_realloc(void *p, size_t n);

static int	fail_realloc_in = 0;	/* > 0: the call that many from now fails */

void *
__wrap_realloc(void *p, size_t n)
{
	if (fail_realloc_in > 0 && --fail_realloc_in == 0)
		return NULL;
	return __real_realloc(p, n);
}

static void
set_cmd(idem_vc_cmd *c, const char **argv, size_t *lens, int argc)
{
	int			i;

	memset(c, 0, sizeof(*c));
	for (i = 0; i < argc; i++)
		lens[i] = strlen(argv[i]);
	c->key = argv[1];
	c->keylen = lens[1];
	c->argc = argc;
	c->argv = argv;
	c->argvlen = lens;
}

static const char *
reply_kind(const redisReply *r)
{
	if (r == NULL)
		return "no reply";
	switch (r->type)
	{
		case REDIS_REPLY_NIL:
			return "nil";
		case REDIS_REPLY_STATUS:
			return "a status, as the abandoned SET's";
		case REDIS_REPLY_STRING:
			return "a string";
		case REDIS_REPLY_ERROR:
			return "an error";
		default:
			return "another type";
	}
}

static void
free_replies(idem_vc_cmd *cmds, int n)
{
	int			i;

	for (i = 0; i < n; i++)
		if (cmds[i].reply)
			freeReplyObject(cmds[i].reply);
}

static void
test_oom_round(void)
{
	idem_vc_options opt;
	idem_vc_io	io = {idemc_vc_poll_wait, NULL, NULL};
	idem_vc    *vc;
	char		seeds[64],
				err[256],
				ka[64],
				kb[64],
				kw[64];
	char	   *big;
	const char *warm[3],
			   *seta[3],
			   *setb[3],
			   *geta[2];
	size_t		lw[3],
				la[3],
				lb[3],
				lg[2];
	idem_vc_cmd cmds[2];
	int			got;
	redisReply *r;

	snprintf(seeds, sizeof(seeds), "127.0.0.1:%d", E.valkey_port);
	snprintf(ka, sizeof(ka), "router-oom-a%s", E.suffix);
	snprintf(kb, sizeof(kb), "router-oom-b%s", E.suffix);
	snprintf(kw, sizeof(kw), "router-oom-w%s", E.suffix);
	memset(&opt, 0, sizeof(opt));
	opt.seeds = seeds;
	opt.default_port = E.valkey_port;
	opt.mode = IDEM_VC_MODE_SINGLE;
	opt.connect_timeout_ms = 2000;
	opt.retry_ms = 100;
	vc = idem_vc_new(&opt, &io, err, sizeof(err));
	if (vc == NULL || idem_vc_open(vc, 2000, err, sizeof(err)) != 0)
	{
		tap_ok_ext(0, "connects to the RESP server (%s)", err);
		if (vc)
			idem_vc_free(vc);
		return;
	}

	/* a first round: the node's buffers exist from here on */
	warm[0] = "SET";
	warm[1] = kw;
	warm[2] = "w";
	set_cmd(&cmds[0], warm, lw, 3);
	got = idem_vc_pipeline(vc, cmds, 1, idem_vc_now_ms() + 2000);
	tap_ok_ext(got == 1 && cmds[0].reply && cmds[0].reply->type == REDIS_REPLY_STATUS,
			   "a first SET is answered");
	free_replies(cmds, 1);

	/*
	 * A round of two SETs whose second is too large for the buffer: its
	 * realloc fails after the first is in the buffer.
	 */
	big = malloc(16384);
	memset(big, 'x', 16383);
	big[16383] = '\0';
	seta[0] = "SET";
	seta[1] = ka;
	seta[2] = "1";
	setb[0] = "SET";
	setb[1] = kb;
	setb[2] = big;
	set_cmd(&cmds[0], seta, la, 3);
	set_cmd(&cmds[1], setb, lb, 3);
	fail_realloc_in = 1;
	got = idem_vc_pipeline(vc, cmds, 2, idem_vc_now_ms() + 2000);
	fail_realloc_in = 0;
	tap_ok_ext(got == 0 && cmds[0].reply == NULL && cmds[1].reply == NULL,
			   "a round out of memory answers none of its commands (%d answered)",
			   got);
	free_replies(cmds, 2);
	free(big);

	/* The next round on the same connection gets its own reply. */
	geta[0] = "GET";
	geta[1] = ka;
	set_cmd(&cmds[0], geta, lg, 2);
	got = idem_vc_pipeline(vc, cmds, 1, idem_vc_now_ms() + 2000);
	tap_ok_ext(got == 1 && cmds[0].reply && cmds[0].reply->type == REDIS_REPLY_NIL,
			   "the next round's GET gets its own reply, nil (%d answered, %s)",
			   got, reply_kind(cmds[0].reply));
	free_replies(cmds, 1);

	r = rv(NULL, "EXISTS %s", ka);
	tap_ok_ext(r != NULL && r->type == REDIS_REPLY_INTEGER && r->integer == 0,
			   "the abandoned round's first SET was never sent");
	if (r)
		freeReplyObject(r);
	r = rv(NULL, "DEL %s", kw);
	if (r)
		freeReplyObject(r);
	idem_vc_free(vc);
}

/* The router's single node, open with a password and a database.  NULL
 * with err set if the open failed. */
static idem_vc *
open_single(const char *password, int db, idem_vc_mode mode, char *err,
			size_t errlen)
{
	idem_vc_options opt;
	idem_vc_io	io = {idemc_vc_poll_wait, NULL, NULL};
	idem_vc    *vc;
	char		seeds[64];

	snprintf(seeds, sizeof(seeds), "127.0.0.1:%d", E.valkey_port);
	memset(&opt, 0, sizeof(opt));
	opt.seeds = seeds;
	opt.default_port = E.valkey_port;
	opt.password = password;
	opt.db = db;
	opt.mode = mode;
	opt.connect_timeout_ms = 2000;
	opt.retry_ms = 100;
	vc = idem_vc_new(&opt, &io, err, errlen);
	if (vc != NULL && idem_vc_open(vc, 2000, err, errlen) != 0)
	{
		idem_vc_free(vc);
		vc = NULL;
	}
	return vc;
}

static void
test_setup_round_trip(void)
{
	const char *pw = "itest-router-pw";
	char		err[256],
				key[64];
	idem_vc    *vc;
	idem_gate  *g;
	redisReply *r;
	idem_vc_cmd cmd;
	const char *set[3];
	size_t		ls[3];
	int			got;

	snprintf(key, sizeof(key), "router-setup%s", E.suffix);
	r = rv(NULL, "CONFIG SET requirepass %s", pw);
	tap_ok_ext(r != NULL && r->type == REDIS_REPLY_STATUS,
			   "the RESP server takes a password");
	if (r)
		freeReplyObject(r);

	vc = open_single(pw, 2, IDEM_VC_MODE_SINGLE, err, sizeof(err));
	tap_ok_ext(vc != NULL, "the router opens with AUTH and SELECT (%s)",
			   vc ? "" : err);
	if (vc != NULL)
	{
		tap_ok_ext(idem_vc_get_stats(vc)->round_trips == 1,
				   "AUTH and SELECT are one round trip (%lld)",
				   idem_vc_get_stats(vc)->round_trips);
		set[0] = "SET";
		set[1] = key;
		set[2] = "in-db-2";
		set_cmd(&cmd, set, ls, 3);
		got = idem_vc_pipeline(vc, &cmd, 1, idem_vc_now_ms() + 2000);
		tap_ok_ext(got == 1 && cmd.reply && cmd.reply->type == REDIS_REPLY_STATUS,
				   "a SET through it is answered");
		free_replies(&cmd, 1);
		idem_vc_free(vc);
		r = rv(NULL, "EXISTS %s", key);
		tap_ok_ext(r != NULL && r->type == REDIS_REPLY_INTEGER && r->integer == 0,
				   "it went to the database selected, not database 0");
		if (r)
			freeReplyObject(r);
	}
	vc = open_single("wrong", 2, IDEM_VC_MODE_SINGLE, err, sizeof(err));
	tap_ok_ext(vc == NULL && strstr(err, "AUTH refused") != NULL,
			   "a wrong password fails the open (%s)", vc ? "opened" : err);
	if (vc)
		idem_vc_free(vc);

	/* auto mode (the worker's): INFO cluster in the same round trip */
	vc = open_single(pw, 2, IDEM_VC_MODE_AUTO, err, sizeof(err));
	tap_ok_ext(vc != NULL && !idem_vc_is_cluster(vc) &&
			   idem_vc_get_stats(vc)->round_trips == 1 &&
			   idem_vc_get_stats(vc)->connects == 1,
			   "in auto mode one connect and one round trip ask INFO cluster, AUTH and SELECT (%lld connects, %lld round trips; %s)",
			   vc ? idem_vc_get_stats(vc)->connects : 0,
			   vc ? idem_vc_get_stats(vc)->round_trips : 0, vc ? "" : err);
	if (vc)
		idem_vc_free(vc);

	/* the runner's gate: the same setup with INFO cluster and SCRIPT LOAD */
	g = idemc_gate_new("127.0.0.1", E.valkey_port, pw, 2, 2000, 2000, 100);
	idemc_gate_connect(g);
	tap_ok_ext(g != NULL && !idemc_gate_resting(g) &&
			   idemc_gate_round_trips(g) == 1,
			   "the gate connects with AUTH, INFO, SCRIPT LOAD and SELECT in one round trip (%ld)",
			   idemc_gate_round_trips(g));
	idemc_gate_free(g);
	g = idemc_gate_new("127.0.0.1", E.valkey_port, "wrong", 2, 2000, 2000, 100);
	idemc_gate_connect(g);
	tap_ok_ext(g != NULL && idemc_gate_resting(g),
			   "a wrong password leaves the gate resting");
	idemc_gate_free(g);

	r = rv(NULL, "CONFIG SET requirepass %s", "");
	tap_ok_ext(r != NULL && r->type == REDIS_REPLY_STATUS,
			   "the password is taken away again");
	if (r)
		freeReplyObject(r);
	/* the key, in database 2 */
	r = rv(NULL, "SELECT 2");
	if (r)
		freeReplyObject(r);
	r = rv(NULL, "DEL %s", key);
	if (r)
		freeReplyObject(r);
	r = rv(NULL, "SELECT 0");
	if (r)
		freeReplyObject(r);
}

int
router_main(int argc, char **argv)
{
	(void) argc;
	(void) argv;
	test_oom_round();
	test_setup_round_trip();
	return tap_finish();
}
