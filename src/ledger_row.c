/*-------------------------------------------------------------------------
 *
 * ledger_row.c
 *	  The spelling of a ledger row's status (ledger_row.h).  No state.
 *
 *-------------------------------------------------------------------------
 */
#include "ledger_row.h"

const char *const idem_status_names[IDEM_STATUS_COUNT] = {
	"processing", "completed", "failed_retryable", "failed_permanent"
};

/* The status spelled name; false when it is none of them. */
bool
idem_status_parse(const char *name, IdemStatus *status)
{
	int			i;

	for (i = 0; i < IDEM_STATUS_COUNT; i++)
		if (strcmp(name, idem_status_names[i]) == 0)
		{
			*status = (IdemStatus) i;
			return true;
		}
	return false;
}
