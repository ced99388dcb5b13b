/*-------------------------------------------------------------------------
 *
 * ledger_row.h
 *	  What a ledger row is: which ledger it lives in, its key, its content,
 *	  and how its status is spelled (ledger_row.c).  The bottom of the
 *	  ledger files: the decisions (ledger.h) and the storage
 *	  (ledger_store.h, ledger_insert.h) both stand on it.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_LEDGER_ROW_H
#define IDEM_LEDGER_ROW_H

#include "datatype/timestamp.h"

#include "cache_format.h"

typedef enum LedgerKind
{
	LEDGER_TENANT = 0,
	LEDGER_PLATFORM,
	LEDGER_KINDS
} LedgerKind;

extern const char *ledger_table_name(LedgerKind kind);
extern const char *ledger_kind_name(LedgerKind kind);

/*
 * The status of a ledger row.  idem_status_names[] is its spelling in the
 * ledgers' status column: install.c builds the CHECK constraint from it, and
 * every read and write of the column goes through it.
 */
typedef enum IdemStatus
{
	IDEM_STATUS_PROCESSING = 0,
	IDEM_STATUS_COMPLETED,
	IDEM_STATUS_FAILED_RETRYABLE,
	IDEM_STATUS_FAILED_PERMANENT,
	IDEM_STATUS_COUNT
} IdemStatus;

extern const char *const idem_status_names[IDEM_STATUS_COUNT];
extern bool idem_status_parse(const char *name, IdemStatus *status);

/* The identity of a ledger row: which ledger, whose, which key. */
typedef struct LedgerKey
{
	LedgerKind	kind;
	int64		tenant_id;		/* 0 on the platform ledger */
	uint8		key[IDEM_DIGEST_LEN];
} LedgerKey;

/* A ledger row as the API sees it. */
typedef struct LedgerRow
{
	IdemStatus	status;
	uint8		fingerprint[IDEM_DIGEST_LEN];
	int32		attempt;
	Datum		outcome;		/* jsonb, detoasted, in the caller's context */
	TimestampTz expires_at;
	bool		ours;			/* written by this transaction */
	TransactionId writer;		/* its xmin (Invalid: not read from the table) */
} LedgerRow;

#endif							/* IDEM_LEDGER_ROW_H */
