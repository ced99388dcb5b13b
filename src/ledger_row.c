/*-------------------------------------------------------------------------
 *
 * ledger_row.c
 *	  The names of the ledgers (their tables in the extension's schema, and
 *	  their kinds as the registry idem_ledgers records them) and the
 *	  spelling of a ledger row's status (ledger_row.h).  No state.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "ledger_row.h"

static const char *const ledger_tables[LEDGER_KINDS] = {
	"idempotency_keys", "platform_idempotency_keys"
};

static const char *const ledger_kind_names[LEDGER_KINDS] = {
	"tenant", "platform"
};

/* The ledger's table, unqualified (it lives in the extension's schema). */
const char *
ledger_table_name(LedgerKind kind)
{
	return ledger_tables[kind];
}

/* The ledger's kind as the registry records it ("tenant", "platform"). */
const char *
ledger_kind_name(LedgerKind kind)
{
	return ledger_kind_names[kind];
}

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
