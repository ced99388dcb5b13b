/*-------------------------------------------------------------------------
 *
 * outbox.h
 *	  Outgoing messages (outbox.c): idem_emit(), the completions and
 *	  failures of claims that emitted (which the decisions in ledger.c
 *	  report), how the emits follow the transaction's ends (xact.c, by the
 *	  rule of subxact.h), and the invalidation of the outbox table kept per
 *	  backend (from ledger_store_relcache_cb).
 *	  The publisher's side is in outbox_publish.h.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_OUTBOX_H
#define IDEM_OUTBOX_H

#include "access/xact.h"
#include "datatype/timestamp.h"

#include "ledger_row.h"

/* The outbox table, in the extension's schema. */
#define IDEM_OUTBOX_TABLE		"idem_outbox"
/* The longest stream name idem_emit() takes, in bytes. */
#define IDEM_OUTBOX_STREAM_MAX	256
/* The largest message idem_emit() takes, in bytes of compact JSON text. */
#define IDEM_OUTBOX_MESSAGE_MAX	(1024 * 1024)

extern void idem_outbox_backlog(Oid nsp, int64 *waiting, Interval **age);
extern void idem_outbox_claim_settled(const LedgerKey *lk, bool is_fail);
extern void idem_outbox_xact_event(XactEvent event);
extern void idem_outbox_subxact_end(bool committed, int level);
extern void idem_outbox_relcache_cb(Datum arg, Oid relid);

#endif							/* IDEM_OUTBOX_H */
