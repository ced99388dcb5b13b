/*-------------------------------------------------------------------------
 *
 * valkey_single.c
 *	  A single Valkey (not a cluster) driven directly: the router's one node
 *	  (every slot maps to it), for a caller that writes batches ahead of
 *	  their replies (the worker's pipelined copies).  Connection setup
 *	  (connect, AUTH, SELECT) and the socket I/O are the node's
 *	  (valkey_node.c), as on a cluster; only the order of sends and reads
 *	  is the caller's.  A failure drops the node (its error in
 *	  idem_vc_last_error): the caller closes the router or opens it again.
 *
 *	  No locking: an idem_vc belongs to one thread.
 *
 *-------------------------------------------------------------------------
 */
#include "valkey_router_int.h"

/* The one node, connected; NULL with err set if there is none. */
static vc_node *
single_node(idem_vc *vc)
{
	vc_node    *n;

	if (!vc->is_open || vc->cluster || vc->slot_node[0] < 0)
	{
		idem_vc_set_err(vc, "not connected to a single Valkey");
		return NULL;
	}
	n = &vc->nodes[vc->slot_node[0]];
	if (n->fd < 0)
	{
		idem_vc_set_err(vc, "%s: not connected", n->name);
		return NULL;
	}
	return n;
}

int
idem_vc_single_append(idem_vc *vc, int argc, const char **argv,
					  const size_t *argvlen)
{
	vc_node    *n = single_node(vc);

	if (n == NULL)
		return -1;
	return idem_vc_node_append(vc, n, argc, argv, argvlen);
}

int
idem_vc_single_flush(idem_vc *vc, int64_t deadline_ms)
{
	vc_node    *n = single_node(vc);
	int			rc;

	if (n == NULL)
		return -1;
	rc = idem_vc_node_flush(vc, n, deadline_ms);
	if (rc == -1)
		idem_vc_node_failed(vc, n, "sending to");
	return rc;
}

int
idem_vc_single_read(idem_vc *vc, int64_t deadline_ms, int read_first,
					redisReply **out)
{
	vc_node    *n = single_node(vc);
	int			rc;

	*out = NULL;
	if (n == NULL)
		return -1;
	/* the replies are likely in: receive before waiting for the socket */
	if (read_first)
		idem_vc_node_unsent(vc, n);
	rc = idem_vc_node_read(vc, n, deadline_ms, out);
	if (rc == -1)
		idem_vc_node_failed(vc, n, "reading from");
	return rc;
}
