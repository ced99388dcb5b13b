/*-------------------------------------------------------------------------
 *
 * valkey_reply.c
 *	  The one list of Valkey error codes that mean "not now", and the class
 *	  of every error reply (valkey_reply.h): the worker keeps a batch for
 *	  either "not now" class, the router sends a TRANSIENT command again
 *	  within its deadline and hands an UNAVAILABLE one back at once.
 *	  Pure functions, unit tested (client/tests/unit_cluster.c pins each
 *	  code's class).  No locking: no state.
 *
 *-------------------------------------------------------------------------
 */
#include "valkey_reply.h"

#include <string.h>

typedef struct vk_code
{
	const char *code;
	idem_vk_error class;
} vk_code;

static const vk_code not_now[] = {
	/* a cluster between two states: retry shortly */
	{"CLUSTERDOWN", IDEM_VK_ERR_TRANSIENT},	/* slots not served (failover) */
	{"TRYAGAIN", IDEM_VK_ERR_TRANSIENT},	/* a slot being migrated */
	{"MASTERDOWN", IDEM_VK_ERR_TRANSIENT},	/* a replica lost its master */
	{"READONLY", IDEM_VK_ERR_TRANSIENT},	/* a replica, not (yet) promoted */
	{"LOADING", IDEM_VK_ERR_TRANSIENT},	/* a restart reading its data */
	/* the server takes no writes until it is mended */
	{"BUSY", IDEM_VK_ERR_UNAVAILABLE},	/* a script or function runs */
	{"OOM", IDEM_VK_ERR_UNAVAILABLE},	/* maxmemory, noeviction */
	{"MISCONF", IDEM_VK_ERR_UNAVAILABLE},	/* RDB saves fail */
	{"NOREPLICAS", IDEM_VK_ERR_UNAVAILABLE},	/* min-replicas-to-write */
	{"NOAUTH", IDEM_VK_ERR_UNAVAILABLE},	/* a new connection authenticates */
};

int
idem_vk_error_code_is(const char *err, size_t len, const char *code)
{
	size_t		cl = strlen(code);

	return len >= cl && memcmp(err, code, cl) == 0 &&
		(len == cl || err[cl] == ' ');
}

idem_vk_error
idem_vk_error_class(const char *err, size_t len)
{
	size_t		i;

	if (idem_vk_error_code_is(err, len, "MOVED"))
		return IDEM_VK_ERR_MOVED;
	if (idem_vk_error_code_is(err, len, "ASK"))
		return IDEM_VK_ERR_ASK;
	for (i = 0; i < sizeof(not_now) / sizeof(not_now[0]); i++)
		if (idem_vk_error_code_is(err, len, not_now[i].code))
			return not_now[i].class;
	return IDEM_VK_ERR_ANSWER;
}

int
idem_vk_error_not_now(const char *err, size_t len)
{
	idem_vk_error c = idem_vk_error_class(err, len);

	return c == IDEM_VK_ERR_TRANSIENT || c == IDEM_VK_ERR_UNAVAILABLE;
}
