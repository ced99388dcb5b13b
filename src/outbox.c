/*-------------------------------------------------------------------------
 *
 * outbox.c
 *	  idem_emit(): a handler's outgoing message, recorded in the outbox
 *	  table (idem_outbox, in the extension's schema) in the caller's
 *	  transaction, so that it commits or vanishes with the effect.  The
 *	  publisher (idem_outbox_publisher_main) sends it to a Valkey stream once the
 *	  commit is durable, and deletes it.
 *
 *	  A message belongs to a claim this transaction holds: a key it claimed
 *	  (new, retried or taken over) and has not completed or failed yet.
 *	  The decisions report both ends (idem_outbox_claim_taken from the
 *	  claim, idem_outbox_claim_settled from complete / fail), for the
 *	  tenant and the platform ledger, one key at a time or in batches.  The
 *	  message's id is
 *
 *		<the key, 64 lowercase hex digits>-<n>
 *
 *	  n = 1, 2, ... its position among the surviving emits for that key in
 *	  this transaction, so that a run re-run after a lost commit, or taken
 *	  over after its lease, emits the same ids again.
 *
 *	  What this file keeps follows subtransactions by xact.c's rule
 *	  (idem_subxact_follow): a rolled-back savepoint forgets the claims,
 *	  settlements and emits made inside it (PostgreSQL rolls back their
 *	  rows with it); a released one hands them to its parent.  idem_fail of
 *	  a key deletes the key's messages emitted in this transaction (a
 *	  failed effect says nothing): marked discarded at the failing level,
 *	  so that rolling the failure back brings them and their positions
 *	  back, as it brings back their rows.
 *
 *	  idem_emit(tenant_id, key, stream, message) names the tenant ledger's
 *	  claim outright.  On Citus that form is delegated by tenant_id like
 *	  idem_claim, so it runs in the worker backend that holds the claim and
 *	  its shard lock: the message goes into that node's own outbox (a local
 *	  table on every node, never distributed), commits with the claim on
 *	  that node, and that node's publisher publishes it.  A shard moved
 *	  afterwards leaves it where it is.  An emit that
 *	  finds no claim in a database whose tenant ledger is distributed says
 *	  so (outbox_no_claim).
 *
 *	  At commit (XACT_EVENT_COMMIT, after the commit record) a transaction
 *	  whose messages survived flags its database for the publisher
 *	  (idem_outbox_notify: no allocation, no error, no wait).  A prepared
 *	  transaction that emitted flags it too (idem_outbox_notify_prepared):
 *	  COMMIT PREPARED runs no callback of ours, so the publisher polls while
 *	  the database has prepared transactions.
 *
 *	  The table is written through SPI as its owner (the extension's
 *	  owner), so that callers need no grant on it; its plan is kept per
 *	  backend and replanned by PostgreSQL when the table changes.
 *
 *	  Locking: none of its own; the state is backend-local, in
 *	  TopTransactionContext.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xact.h"
#include "catalog/namespace.h"
#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/jsonb.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/rel.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"

#include "outbox.h"
#include "citus.h"
#include "compat.h"
#include "digest.h"
#include "outbox_publish.h"
#include "sql_args.h"
#include "subxact.h"

PG_FUNCTION_INFO_V1(idem_emit);
PG_FUNCTION_INFO_V1(idem_emit_tenant);
PG_FUNCTION_INFO_V1(idem_emit_many);

/* One message emitted in this transaction. */
typedef struct OutboxEmit
{
	int64		seq;			/* its row's seq */
	int			level;			/* subtransaction that emitted it */
	int			discarded_level;	/* subtransaction whose idem_fail deleted
									 * it; 0: live */
} OutboxEmit;

/* One claim this transaction took, and the messages emitted for it. */
typedef struct OutboxClaim
{
	LedgerKey	lk;
	int			claim_level;	/* subtransaction that claimed it */
	int			settled_level;	/* subtransaction that completed or failed
								 * it; 0: held */
	List	   *emits;			/* of OutboxEmit *, in emit order */
} OutboxClaim;

/*
 * This transaction's claims, of OutboxClaim *, in claim order (a list: a
 * transaction holds one claim, or a batch's few dozen).
 */
static List *outbox_claims = NIL;
/* Messages of claims settled and forgotten at the top level survive. */
static bool outbox_emitted = false;
/* The schema of the outbox this transaction wrote (for idem_fail's delete). */
static Oid	outbox_nsp = InvalidOid;

/* The prepared INSERT, per backend, and the schema it was made for. */
static SPIPlanPtr outbox_insert_plan = NULL;
static Oid	outbox_insert_nsp = InvalidOid;

static void
outbox_reset(void)
{
	/* in TopTransactionContext, which goes with the transaction */
	outbox_claims = NIL;
	outbox_emitted = false;
	outbox_nsp = InvalidOid;
}

/* This transaction's claim of lk, or NULL. */
static OutboxClaim *
outbox_claim_find(const LedgerKey *lk)
{
	ListCell   *lc;

	foreach(lc, outbox_claims)
	{
		OutboxClaim *claim = lfirst(lc);

		if (claim->lk.kind == lk->kind && claim->lk.tenant_id == lk->tenant_id &&
			memcmp(claim->lk.key, lk->key, IDEM_DIGEST_LEN) == 0)
			return claim;
	}
	return NULL;
}

/* A claim of lk by this transaction (from the decisions). */
void
idem_outbox_claim_taken(const LedgerKey *lk)
{
	OutboxClaim *claim = outbox_claim_find(lk);

	if (claim == NULL)
	{
		MemoryContext oldcxt = MemoryContextSwitchTo(TopTransactionContext);

		claim = palloc0(sizeof(OutboxClaim));
		claim->lk = *lk;
		claim->emits = NIL;
		claim->claim_level = GetCurrentTransactionNestLevel();
		outbox_claims = lappend(outbox_claims, claim);
		MemoryContextSwitchTo(oldcxt);
	}
	/* claimed again after a retryable failure in this transaction */
	claim->settled_level = 0;
}

/* The messages of the claim that are live (not deleted by idem_fail). */
static int
outbox_live_emits(const OutboxClaim *claim, List **seqs)
{
	ListCell   *lc;
	int			n = 0;

	foreach(lc, claim->emits)
	{
		OutboxEmit *e = lfirst(lc);

		if (e->discarded_level != 0)
			continue;
		n++;
		if (seqs)
			*seqs = lappend(*seqs, e);
	}
	return n;
}

/* The owner of the outbox of schema nsp (the extension's owner). */
static Oid
outbox_owner(Oid nsp)
{
	Oid			relid = get_relname_relid(IDEM_OUTBOX_TABLE, nsp);
	HeapTuple	tup;
	Oid			owner;

	if (!OidIsValid(relid))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_TABLE),
				 errmsg("the outbox table %s.%s does not exist",
						get_namespace_name(nsp), IDEM_OUTBOX_TABLE),
				 errhint("Run ALTER EXTENSION idem UPDATE.")));
	tup = SearchSysCache1(RELOID, ObjectIdGetDatum(relid));
	if (!HeapTupleIsValid(tup))
		elog(ERROR, "cache lookup failed for relation %u", relid);
	owner = ((Form_pg_class) GETSTRUCT(tup))->relowner;
	ReleaseSysCache(tup);
	return owner;
}

/* Run one statement of the outbox as the table's owner, through SPI. */
static void
outbox_spi_as_owner(Oid nsp, SPIPlanPtr plan, Datum *values, const char *nulls,
					int expect, int64 *seq_out)
{
	Oid			owner = outbox_owner(nsp);
	Oid			save_userid;
	int			save_sec;
	int			rc;

	GetUserIdAndSecContext(&save_userid, &save_sec);
	SetUserIdAndSecContext(owner, save_sec | SECURITY_LOCAL_USERID_CHANGE |
						   SECURITY_RESTRICTED_OPERATION);
	rc = SPI_execute_plan(plan, values, nulls, false, 0);
	SetUserIdAndSecContext(save_userid, save_sec);
	if (rc != expect)
		elog(ERROR, "the outbox statement failed: %s", SPI_result_code_string(rc));
	if (seq_out)
	{
		bool		isnull;

		*seq_out = DatumGetInt64(SPI_getbinval(SPI_tuptable->vals[0],
											   SPI_tuptable->tupdesc, 1, &isnull));
	}
}

/*
 * idem_fail of a held claim: delete its messages emitted in this
 * transaction, at the current level.
 */
static void
outbox_discard(OutboxClaim *claim)
{
	List	   *live = NIL;
	Datum	   *seqs;
	ArrayType  *arr;
	ListCell   *lc;
	int			n = outbox_live_emits(claim, &live);
	int			i = 0;
	int			level = GetCurrentTransactionNestLevel();
	SPIPlanPtr	plan;
	Oid			argtypes[1] = {INT8ARRAYOID};
	Datum		values[1];
	char	   *sql;

	if (n == 0)
		return;
	seqs = palloc(sizeof(Datum) * n);
	foreach(lc, live)
		seqs[i++] = Int64GetDatum(((OutboxEmit *) lfirst(lc))->seq);
	arr = construct_array(seqs, n, INT8OID, sizeof(int64), FLOAT8PASSBYVAL,
						  TYPALIGN_DOUBLE);
	values[0] = PointerGetDatum(arr);
	sql = psprintf("DELETE FROM %s.%s WHERE seq = ANY ($1)",
				   quote_identifier(get_namespace_name(outbox_nsp)),
				   IDEM_OUTBOX_TABLE);
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	plan = SPI_prepare(sql, 1, argtypes);
	if (plan == NULL)
		elog(ERROR, "could not prepare the outbox delete: %s",
			 SPI_result_code_string(SPI_result));
	outbox_spi_as_owner(outbox_nsp, plan, values, " ", SPI_OK_DELETE, NULL);
	SPI_finish();
	foreach(lc, live)
		((OutboxEmit *) lfirst(lc))->discarded_level = level;
}

/* Completed or failed (is_fail) by this transaction (from the decisions). */
void
idem_outbox_claim_settled(const LedgerKey *lk, bool is_fail)
{
	OutboxClaim *claim = outbox_claim_find(lk);

	if (claim == NULL || claim->settled_level != 0)
		return;
	if (is_fail)
		outbox_discard(claim);

	/*
	 * Settled by the top level: no rollback short of the transaction's
	 * opens it again (and a claim of the key again starts its positions
	 * afresh), so forget it, as pending_settle does, and remember only
	 * whether its messages survive.
	 */
	if (GetCurrentTransactionNestLevel() <= 1)
	{
		if (outbox_live_emits(claim, NULL) > 0)
			outbox_emitted = true;
		list_free_deep(claim->emits);
		outbox_claims = list_delete_ptr(outbox_claims, claim);
		pfree(claim);
		return;
	}
	claim->settled_level = GetCurrentTransactionNestLevel();
}

/* Whether any message of this transaction is live. */
static bool
outbox_any_live(void)
{
	ListCell   *lc;

	if (outbox_emitted)
		return true;
	foreach(lc, outbox_claims)
		if (outbox_live_emits(lfirst(lc), NULL) > 0)
			return true;
	return false;
}

/* A transaction event, from xact.c. */
void
idem_outbox_xact_event(XactEvent event)
{
	switch (event)
	{
		case XACT_EVENT_COMMIT:
			/* After the commit record: no ERROR, no allocation, no wait. */
			if (outbox_any_live())
				idem_outbox_notify(MyDatabaseId);
			outbox_reset();
			break;
		case XACT_EVENT_PREPARE:
			/* its COMMIT PREPARED wakes nobody: the publisher polls */
			if (outbox_any_live())
				idem_outbox_notify_prepared(MyDatabaseId);
			outbox_reset();
			break;
		case XACT_EVENT_ABORT:
		case XACT_EVENT_PARALLEL_COMMIT:
		case XACT_EVENT_PARALLEL_ABORT:
			outbox_reset();
			break;
		default:
			break;
	}
}

/* The subtransaction at level ended (committed or aborted), from xact.c. */
void
idem_outbox_subxact_end(bool committed, int level)
{
	int			c;

	for (c = list_length(outbox_claims) - 1; c >= 0; c--)
	{
		OutboxClaim *claim = list_nth(outbox_claims, c);
		int			i;

		for (i = list_length(claim->emits) - 1; i >= 0; i--)
		{
			OutboxEmit *e = list_nth(claim->emits, i);

			if (!idem_subxact_follow(&e->level, committed, level))
			{
				pfree(e);
				claim->emits = list_delete_nth_cell(claim->emits, i);
				continue;
			}
			if (e->discarded_level != 0 &&
				!idem_subxact_follow(&e->discarded_level, committed, level))
				e->discarded_level = 0;	/* its deletion was rolled back */
		}
		if (!idem_subxact_follow(&claim->claim_level, committed, level))
		{
			list_free_deep(claim->emits);
			pfree(claim);
			outbox_claims = list_delete_nth_cell(outbox_claims, c);
			continue;
		}
		if (claim->settled_level != 0 &&
			!idem_subxact_follow(&claim->settled_level, committed, level))
			claim->settled_level = 0;	/* its completion was rolled back */
	}
}

/*
 * How many messages wait in the outbox of schema nsp, and how long the
 * oldest has (NULL: none), for idem_stats().  No outbox (an extension not
 * updated yet): none.
 */
void
idem_outbox_backlog(Oid nsp, int64 *waiting, Interval **age)
{
	Oid			relid = get_relname_relid(IDEM_OUTBOX_TABLE, nsp);
	char	   *sql;
	bool		isnull;
	Datum		d;
	Oid			save_userid;
	int			save_sec;
	int			rc;

	*waiting = 0;
	*age = NULL;
	if (!OidIsValid(relid))
		return;
	sql = psprintf("SELECT count(*), pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) min(emitted_at) FROM %s.%s",
				   quote_identifier(get_namespace_name(nsp)), IDEM_OUTBOX_TABLE);
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	/* as the owner: a monitoring role needs no grant on the table */
	GetUserIdAndSecContext(&save_userid, &save_sec);
	SetUserIdAndSecContext(outbox_owner(nsp), save_sec |
						   SECURITY_LOCAL_USERID_CHANGE |
						   SECURITY_RESTRICTED_OPERATION);
	rc = SPI_execute(sql, true, 1);
	SetUserIdAndSecContext(save_userid, save_sec);
	if (rc != SPI_OK_SELECT || SPI_processed != 1)
		elog(ERROR, "could not read the outbox's backlog");
	*waiting = DatumGetInt64(SPI_getbinval(SPI_tuptable->vals[0],
										   SPI_tuptable->tupdesc, 1, &isnull));
	d = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 2, &isnull);
	if (!isnull)
		*age = DatumGetIntervalP(SPI_datumTransfer(d, false, sizeof(Interval)));
	SPI_finish();
}

/* ---------- idem_emit ---------- */

/*
 * The refusal of an emit for which this transaction holds no claim.  On a
 * Citus node whose tenant ledger is distributed, a tenant's claim was
 * taken on the worker node that holds its shard (idem_claim is delegated
 * there), so the message must be recorded there too: the hint says how.
 */
static void
outbox_no_claim(Oid nsp, bool tenant_form, const char *what)
{
	Oid			ledger = get_relname_relid(ledger_table_name(LEDGER_TENANT), nsp);

	if (OidIsValid(ledger) && idem_citus_distributed(ledger))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("cannot emit a message%s: this transaction holds no claim%s on this node", what[0] ? " for this key" : "", what),
				 errdetail("On Citus, a tenant's claim is taken on the worker node that holds the tenant's shard, and its messages are recorded and published there."),
				 tenant_form ?
				 errhint("Call idem_emit(tenant_id, key, stream, message) as a statement of its own, with tenant_id a constant or a parameter, so that Citus delegates it to that node; not from a PL/pgSQL expression or a query's FROM.") :
				 errhint("Call idem_emit(tenant_id, key, stream, message): Citus delegates it to the node of the tenant's claim, as it does idem_claim.")));
	if (what[0] == '\0')
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("cannot emit a message: this transaction holds no claim"),
				 errdetail("A message belongs to the run of a key this transaction claimed and has not completed or failed yet."),
				 errhint("Call idem_emit() in the handler's transaction, after idem_claim() and before idem_complete().")));
	ereport(ERROR,
			(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
			 errmsg("cannot emit a message for this key: this transaction holds no claim%s", what),
			 tenant_form ?
			 errhint("Pass the tenant and the key of a claim this transaction took and has not completed or failed yet.") :
			 errhint("Pass the key of a claim this transaction took and has not completed or failed yet.")));
}

/*
 * The held claim the message belongs to: the one, or the one of key, or
 * (tenant_form) the tenant ledger's claim of key for tenant_id.
 */
static OutboxClaim *
outbox_find_claim(Oid nsp, const uint8 *key, bool tenant_form, int64 tenant_id)
{
	ListCell   *lc;
	OutboxClaim *found = NULL;
	int			held = 0;
	int			matching = 0;

	foreach(lc, outbox_claims)
	{
		OutboxClaim *claim = lfirst(lc);

		if (claim->settled_level != 0)
			continue;
		if (tenant_form && (claim->lk.kind != LEDGER_TENANT ||
							claim->lk.tenant_id != tenant_id))
			continue;
		held++;
		if (key == NULL || memcmp(claim->lk.key, key, IDEM_DIGEST_LEN) == 0)
		{
			matching++;
			found = claim;
		}
	}
	if (tenant_form && matching == 0)
		outbox_no_claim(nsp, true, " of it for this tenant");
	if (held == 0)
		outbox_no_claim(nsp, false, "");
	if (key != NULL && matching == 0)
		outbox_no_claim(nsp, false, " of it");
	if (matching > 1)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("cannot emit a message: this transaction holds %d claims%s",
						matching, key ? " of this key" : ""),
				 errhint(key ? "The key is claimed in both ledgers or for two tenants; name the tenant: idem_emit(tenant_id, key, stream, message)." :
						 "Name the run's key: idem_emit(stream, message, key).")));
	return found;
}

/* The prepared INSERT into the outbox of schema nsp (SPI connected). */
static SPIPlanPtr
outbox_insert_prepare(Oid nsp)
{
	Oid			argtypes[3] = {TEXTOID, TEXTOID, JSONBOID};
	char	   *sql;
	SPIPlanPtr	plan;

	if (outbox_insert_plan != NULL && outbox_insert_nsp == nsp)
		return outbox_insert_plan;
	if (outbox_insert_plan != NULL)
	{
		SPI_freeplan(outbox_insert_plan);
		outbox_insert_plan = NULL;
	}
	sql = psprintf("INSERT INTO %s.%s (stream, message_id, body) VALUES ($1, $2, $3) RETURNING seq",
				   quote_identifier(get_namespace_name(nsp)), IDEM_OUTBOX_TABLE);
	plan = SPI_prepare(sql, 3, argtypes);
	if (plan == NULL)
		elog(ERROR, "could not prepare the outbox insert: %s",
			 SPI_result_code_string(SPI_result));
	SPI_keepplan(plan);
	outbox_insert_plan = plan;
	outbox_insert_nsp = nsp;
	return plan;
}

/*
 * Record one message of the claim (found by outbox_find_claim) in the
 * outbox of schema nsp.  Returns the message's id.
 */
static text *
outbox_record(Oid nsp, OutboxClaim *claim, text *stream, Jsonb *message)
{
	OutboxEmit *emit;
	char		id[IDEM_DIGEST_LEN * 2 + 1 + 12];
	Datum		values[3];
	int64		seq;
	int			len;
	int			n;
	int			i;
	MemoryContext oldcxt;
	ListCell   *lc;

	len = VARSIZE_ANY_EXHDR(stream);
	if (len == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("stream must not be empty"),
				 errhint("Name the Valkey stream the message goes to.")));
	if (len > IDEM_OUTBOX_STREAM_MAX)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("stream must be at most %d bytes, not %d",
						IDEM_OUTBOX_STREAM_MAX, len)));
	if (!JB_ROOT_IS_OBJECT(message) || JB_ROOT_IS_SCALAR(message))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("message must be a JSON object"),
				 errhint("Wrap the value: jsonb_build_object('value', ...).")));
	if (VARSIZE(message) > IDEM_OUTBOX_MESSAGE_MAX)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("message must be at most %d bytes", IDEM_OUTBOX_MESSAGE_MAX)));

	/* its position: one after the live emits of every claim of the key */
	n = 1;
	foreach(lc, outbox_claims)
	{
		OutboxClaim *c = lfirst(lc);

		if (memcmp(c->lk.key, claim->lk.key, IDEM_DIGEST_LEN) == 0)
			n += outbox_live_emits(c, NULL);
	}
	for (i = 0; i < IDEM_DIGEST_LEN; i++)
		snprintf(id + i * 2, 3, "%02x", claim->lk.key[i]);
	snprintf(id + IDEM_DIGEST_LEN * 2, sizeof(id) - IDEM_DIGEST_LEN * 2, "-%d", n);

	values[0] = PointerGetDatum(stream);
	values[1] = CStringGetTextDatum(id);
	values[2] = JsonbPGetDatum(message);
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	outbox_spi_as_owner(nsp, outbox_insert_prepare(nsp), values, NULL,
						SPI_OK_INSERT_RETURNING, &seq);
	SPI_finish();

	outbox_nsp = nsp;
	oldcxt = MemoryContextSwitchTo(TopTransactionContext);
	emit = palloc0(sizeof(OutboxEmit));
	emit->seq = seq;
	emit->level = GetCurrentTransactionNestLevel();
	claim->emits = lappend(claim->emits, emit);
	MemoryContextSwitchTo(oldcxt);

	return cstring_to_text(id);
}

/*
 * idem_emit(stream text, message jsonb, key bytea DEFAULT NULL) RETURNS
 * text: the message's id.
 */
Datum
idem_emit(PG_FUNCTION_ARGS)
{
	Oid			nsp = get_func_namespace(fcinfo->flinfo->fn_oid);
	uint8		keybuf[IDEM_DIGEST_LEN];
	const uint8 *key = NULL;

	idem_require_arg(fcinfo, 0, "stream");
	idem_require_arg(fcinfo, 1, "message");
	if (PG_NARGS() > 2 && !PG_ARGISNULL(2))
	{
		idem_digest_check(PG_GETARG_BYTEA_PP(2), "key", keybuf);
		key = keybuf;
	}
	PG_RETURN_TEXT_P(outbox_record(nsp, outbox_find_claim(nsp, key, false, 0),
								   PG_GETARG_TEXT_PP(0), PG_GETARG_JSONB_P(1)));
}

/*
 * idem_emit(tenant_id bigint, key bytea, stream text, message jsonb)
 * RETURNS text: the same, for the tenant ledger's claim of key for
 * tenant_id.  On Citus it is delegated by tenant_id, as idem_claim is
 * (idem_citus_distribute), so it runs in the worker backend that holds
 * the claim, and the message is recorded in that node's outbox and
 * published by that node's publisher.
 */
Datum
idem_emit_tenant(PG_FUNCTION_ARGS)
{
	Oid			nsp = get_func_namespace(fcinfo->flinfo->fn_oid);
	uint8		key[IDEM_DIGEST_LEN];

	idem_require_arg(fcinfo, 0, "tenant_id");
	idem_require_arg(fcinfo, 1, "key");
	idem_require_arg(fcinfo, 2, "stream");
	idem_require_arg(fcinfo, 3, "message");
	idem_digest_check(PG_GETARG_BYTEA_PP(1), "key", key);
	PG_RETURN_TEXT_P(outbox_record(nsp, outbox_find_claim(nsp, key, true, PG_GETARG_INT64(0)),
								   PG_GETARG_TEXT_PP(2), PG_GETARG_JSONB_P(3)));
}

/* A refused element of idem_emit_many's messages. */
static void
outbox_bad_element(int i)
{
	ereport(ERROR,
			(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
			 errmsg("element %d of messages is not a [stream, message] pair", i + 1),
			 errhint("Pass a JSON array of [stream name, message object] arrays: '[[\"payments.charged\", {\"amount\": 5}]]'.")));
}

/*
 * idem_emit_many(tenant_id bigint, key bytea, messages jsonb) RETURNS
 * text[]: the messages of the tenant ledger's claim of key for tenant_id,
 * [[stream, message], ...], recorded in order as idem_emit records each;
 * their ids.  One call for a run's messages, delegated on Citus as the
 * tenant form of idem_emit is (the runners send it with the completion).
 */
Datum
idem_emit_many(PG_FUNCTION_ARGS)
{
	Oid			nsp = get_func_namespace(fcinfo->flinfo->fn_oid);
	uint8		key[IDEM_DIGEST_LEN];
	Jsonb	   *messages;
	OutboxClaim *claim;
	Datum	   *ids;
	int			n;
	int			i;

	idem_require_arg(fcinfo, 0, "tenant_id");
	idem_require_arg(fcinfo, 1, "key");
	idem_require_arg(fcinfo, 2, "messages");
	idem_digest_check(PG_GETARG_BYTEA_PP(1), "key", key);
	messages = PG_GETARG_JSONB_P(2);
	if (!JB_ROOT_IS_ARRAY(messages) || JB_ROOT_IS_SCALAR(messages))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("messages must be a JSON array"),
				 errhint("Pass a JSON array of [stream name, message object] arrays: '[[\"payments.charged\", {\"amount\": 5}]]'.")));
	claim = outbox_find_claim(nsp, key, true, PG_GETARG_INT64(0));
	n = JB_ROOT_COUNT(messages);
	ids = palloc(sizeof(Datum) * Max(n, 1));
	for (i = 0; i < n; i++)
	{
		JsonbValue *pair = getIthJsonbValueFromContainer(&messages->root, i);
		JsonbValue *stream;
		JsonbValue *message;

		if (pair == NULL || pair->type != jbvBinary ||
			!JsonContainerIsArray(pair->val.binary.data) ||
			JsonContainerIsScalar(pair->val.binary.data) ||
			JsonContainerSize(pair->val.binary.data) != 2)
			outbox_bad_element(i);
		stream = getIthJsonbValueFromContainer(pair->val.binary.data, 0);
		message = getIthJsonbValueFromContainer(pair->val.binary.data, 1);
		if (stream == NULL || stream->type != jbvString || message == NULL)
			outbox_bad_element(i);
		ids[i] = PointerGetDatum(outbox_record(nsp, claim,
											   cstring_to_text_with_len(stream->val.string.val,
																		stream->val.string.len),
											   JsonbValueToJsonb(message)));
	}
	PG_RETURN_ARRAYTYPE_P(construct_array(ids, n, TEXTOID, -1, false, TYPALIGN_INT));
}
