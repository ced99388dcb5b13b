/*-------------------------------------------------------------------------
 *
 * valkey_pipeline.c
 *	  The pipeline: a batch of single-key commands split per node by slot,
 *	  sent in rounds whose replies are matched back to the commands; MOVED
 *	  updates the map and resends, ASK sends ASKING and the command to the
 *	  node named, "not now" retries with a backoff until the deadline, and
 *	  (reconnect_dead) a connection found dead is connected again and its
 *	  unanswered commands resent in the next round.  In
 *	  one call (idem_vc_pipeline) or split after the first round's send
 *	  (idem_vc_send, then idem_vc_collect: the worker sleeps out its batch
 *	  delay in between).
 *
 *-------------------------------------------------------------------------
 */
#include "valkey_router_int.h"

#include <stdlib.h>

/*
 * Out of memory while a round is split: nothing of it has been sent, so
 * every node's share of it is dropped.  Left in a node's buffer, it would
 * go out with the next round, whose replies would then be matched to the
 * wrong commands.  (The round still counts against each command's
 * VC_MAX_ROUNDS.)
 */
static void
vc_abandon_round(idem_vc *vc)
{
	int			k;

	for (k = 0; k < vc->nnodes; k++)
	{
		vc->nodes[k].olen = 0;
		vc->nodes[k].nexpect = 0;
	}
}

/*
 * Route what is pending of cmds per node and send it, every node's share
 * written before any reply is read.  Returns the commands sent (0 if none
 * could be: their nodes rest after a failure), -1 out of memory (nothing
 * sent), -2 abandon.  *resting is set if a command's node rests.
 */
static int
vc_send_round(idem_vc *vc, idem_vc_cmd *cmds, int n, int64_t deadline_ms,
			  int *resting)
{
	int			sent = 0;
	int			i,
				k;

	if (vc->cluster && vc->need_refresh)
	{
		if (idem_vc_refresh(vc, deadline_ms) == -2)
			return -2;
	}

	/* Split what is pending per node. */
	for (i = 0; i < n; i++)
	{
		idem_vc_cmd *c = &cmds[i];
		int			target;
		vc_node    *nd;
		int			rc;

		if (c->reply != NULL || c->rounds >= VC_MAX_ROUNDS)
			continue;
		/* a single Valkey's one node serves every slot: no CRC16 needed */
		if (c->ask_node >= 0)
			target = c->ask_node;
		else if (!vc->cluster)
			target = vc->slot_node[0];
		else
			target = vc->slot_node[idem_vc_key_slot(c->key, c->keylen)];
		if (target < 0)
		{
			idem_vc_set_err(vc, "no node serves the slot of a key");
			vc->need_refresh = 1;
			continue;
		}
		nd = &vc->nodes[target];
		c->node = target;
		rc = idem_vc_node_ensure(vc, nd, deadline_ms);
		if (rc == -2)
			return -2;
		if (rc != 0)
		{
			*resting = 1;
			continue;
		}
		if (c->ask_node >= 0)
		{
			const char *asking[1] = {"ASKING"};

			if (idem_vc_node_append(vc, nd, 1, asking, NULL) != 0 ||
				idem_vc_node_expect(vc, nd, -1) != 0)
			{
				vc_abandon_round(vc);
				return -1;
			}
		}
		if (idem_vc_node_append(vc, nd, c->argc, c->argv, c->argvlen) != 0 ||
			idem_vc_node_expect(vc, nd, i) != 0)
		{
			vc_abandon_round(vc);
			return -1;
		}
		c->rounds++;
		sent++;
	}
	if (sent == 0)
		return 0;

	/* Send to every node. */
	for (k = 0; k < vc->nnodes; k++)
	{
		vc_node    *nd = &vc->nodes[k];
		int			rc;

		if (nd->olen == 0)
			continue;
		vc->stats.round_trips++;
		rc = idem_vc_node_flush(vc, nd, deadline_ms);
		if (rc == -2)
			return -2;
		if (rc != 0)
			idem_vc_node_lost(vc, nd, "sending to");
	}
	return sent;
}

/*
 * Read every node's replies to the round sent, matching them to cmds:
 * *done counts the commands answered; MOVED and ASK leave a command
 * pending for its new node, and a "not now" reply sets *retry.  0, or -2
 * abandon.
 */
static int
vc_read_round(idem_vc *vc, idem_vc_cmd *cmds, int64_t deadline_ms,
			  int *done, int *retry)
{
	int			k;

	for (k = 0; k < vc->nnodes; k++)
	{
		vc_node    *nd = &vc->nodes[k];
		int			e;

		for (e = 0; e < nd->nexpect; e++)
		{
			redisReply *r;
			int			what = nd->expect[e];
			int			rc = idem_vc_node_read(vc, nd, deadline_ms, &r);
			idem_vc_cmd *c;
			int			slot,
						port,
						to;
			char		host[IDEM_VC_HOST_MAX];

			if (rc == -2)
				return -2;
			if (rc != 0)
			{
				idem_vc_node_lost(vc, nd, "reading from");
				break;
			}
			if (what < 0)
			{
				freeReplyObject(r);	/* ASKING's OK */
				continue;
			}
			c = &cmds[what];
			if (r->type != REDIS_REPLY_ERROR)
			{
				c->reply = r;
				c->ask_node = -1;
				(*done)++;
				continue;
			}
			switch (idem_vc_classify(r->str, r->len, &slot, host,
									 sizeof(host), &port))
			{
				case IDEM_VC_MOVED:
					vc->stats.moved++;
					to = idem_vc_node_get(vc, host, port);
					if (to >= 0)
						vc->slot_node[slot] = (int16_t) to;
					vc->need_refresh = 1;
					c->ask_node = -1;
					freeReplyObject(r);
					break;
				case IDEM_VC_ASK:
					vc->stats.ask++;
					c->ask_node = idem_vc_node_get(vc, host, port);
					freeReplyObject(r);
					break;
				case IDEM_VC_RETRY:
					if (!vc->cluster)
					{
						/* a single Valkey's state: the caller backs off */
						c->reply = r;
						c->ask_node = -1;
						(*done)++;
						break;
					}
					vc->stats.retries++;
					idem_vc_set_err(vc, "%s replied: %.*s", nd->name,
							(int) (r->len > 100 ? 100 : r->len), r->str);
					vc->need_refresh = vc->cluster;
					c->ask_node = -1;
					*retry = 1;
					freeReplyObject(r);
					break;
				case IDEM_VC_REPLY:
					c->reply = r;
					c->ask_node = -1;
					(*done)++;
					break;
			}
		}
		nd->nexpect = 0;
	}
	return 0;
}

/*
 * The rounds of a pipeline until every command has a reply or the
 * deadline passes.  sent, resting: what a first round sent by the caller
 * gave (vc_send_round), or VC_UNSENT for none.
 */
static int
vc_rounds(idem_vc *vc, idem_vc_cmd *cmds, int n, int64_t deadline_ms,
		  int sent, int resting)
{
	int			done = 0;
	int			backoff = VC_BACKOFF_MIN_MS;
	int			reread = 0;		/* the map was re-read for a resting node */

	while (done < n)
	{
		int			retry = 0;

		if (sent == VC_UNSENT)
		{
			resting = 0;
			sent = vc_send_round(vc, cmds, n, deadline_ms, &resting);
		}
		if (sent == -2)
			return -2;
		if (sent < 0)
			return done;
		if (sent == 0)
		{
			/*
			 * Only keys of a node that is down are left: if the map is not
			 * fresh, read it once more (a failover may have promoted a
			 * replica meanwhile) and route them again.
			 */
			if (resting && vc->cluster && !reread &&
				idem_vc_now_ms() - vc->refreshed_at >= VC_RESTING_REFRESH_MS)
			{
				vc->need_refresh = 1;
				reread = 1;
				sent = VC_UNSENT;
				continue;
			}
			break;
		}
		sent = VC_UNSENT;
		if (vc_read_round(vc, cmds, deadline_ms, &done, &retry) == -2)
			return -2;
		if (done < n && retry)
		{
			int64_t		until = idem_vc_now_ms() + backoff;

			if (until > deadline_ms)
				until = deadline_ms;
			if (vc->io.wait(vc->io.arg, -1, 0, until) == -2)
				return -2;
			backoff = backoff * 2 > VC_BACKOFF_MAX_MS ? VC_BACKOFF_MAX_MS : backoff * 2;
		}
		if (idem_vc_now_ms() >= deadline_ms)
			break;
	}
	return done;
}

static void
vc_start(idem_vc_cmd *cmds, int n)
{
	int			i;

	for (i = 0; i < n; i++)
	{
		cmds[i].reply = NULL;
		cmds[i].node = -1;
		cmds[i].ask_node = -1;
		cmds[i].rounds = 0;
	}
}

/* Route, redirect; see the header. */
int
idem_vc_pipeline(idem_vc *vc, idem_vc_cmd *cmds, int n, int64_t deadline_ms)
{
	vc_start(cmds, n);
	return vc_rounds(vc, cmds, n, deadline_ms, VC_UNSENT, 0);
}

/* The first round of idem_vc_pipeline; see the header. */
int
idem_vc_send(idem_vc *vc, idem_vc_cmd *cmds, int n, int64_t deadline_ms)
{
	vc_start(cmds, n);
	vc->round_resting = 0;
	vc->round_sent = vc_send_round(vc, cmds, n, deadline_ms,
								   &vc->round_resting);
	return vc->round_sent == -2 ? -2 : 0;
}

/* The rest of idem_vc_pipeline after idem_vc_send; see the header. */
int
idem_vc_collect(idem_vc *vc, idem_vc_cmd *cmds, int n, int64_t deadline_ms,
				int waited)
{
	int			k;

	if (waited)
	{
		/* the replies came meanwhile: read before waiting (node_read) */
		for (k = 0; k < vc->nnodes; k++)
			idem_vc_node_unsent(vc, &vc->nodes[k]);
	}
	return vc_rounds(vc, cmds, n, deadline_ms, vc->round_sent,
					 vc->round_resting);
}
