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
 *	  (new, retried or taken over) and has not completed or failed yet,
 *	  in the tenant or the platform ledger, one key at a time or in
 *	  batches.  Which claims a transaction holds is the claim table's
 *	  (pending_held), asked at each emit: a claim costs this file nothing,
 *	  and nothing is kept here until the transaction's first emit.  The
 *	  decisions report a completion or failure (idem_outbox_claim_settled),
 *	  which costs one test while nothing was emitted.  The message's id is
 *
 *		<the key, 64 lowercase hex digits>-<n>
 *
 *	  n = 1, 2, ... its position among the surviving emits for that key in
 *	  this transaction, so that a run re-run after a lost commit, or taken
 *	  over after its lease, emits the same ids again.
 *
 *	  idem_emit(tenant_id, key, stream, message) names the tenant ledger's
 *	  claim outright (pending_holds), and idem_emit_many(tenant_id, key,
 *	  messages) records a run's messages in one call.  On Citus both are
 *	  delegated by tenant_id like idem_claim, so they run in the worker
 *	  backend that holds the claim and its shard lock: the message goes
 *	  into that node's own outbox (a local table on every node, never
 *	  distributed), commits with the claim on that node, and that node's
 *	  publisher publishes it.  A shard moved afterwards leaves it where it
 *	  is.  An emit that finds no claim in a database whose tenant ledger is
 *	  distributed says so (outbox_no_claim).
 *
 *	  What this file keeps, the emits per key, follows subtransactions by
 *	  xact.c's rule (idem_subxact_follow): a rolled-back savepoint forgets
 *	  the emits made inside it (PostgreSQL rolls back their rows with it);
 *	  a released one hands them to its parent.  idem_fail of
 *	  a key deletes the key's messages emitted in this transaction (a
 *	  failed effect says nothing): marked discarded at the failing level,
 *	  so that rolling the failure back brings them and their positions
 *	  back, as it brings back their rows.
 *
 *	  At commit (XACT_EVENT_COMMIT, after the commit record) a transaction
 *	  whose messages survived flags its database for the publisher
 *	  (idem_outbox_notify: no allocation, no error, no wait).  A prepared
 *	  transaction that emitted flags it too (idem_outbox_notify_prepared):
 *	  COMMIT PREPARED runs no callback of ours, so the publisher polls while
 *	  the database has prepared transactions.
 *
 *	  The table is written as its owner (the extension's owner), so that
 *	  callers need no grant on it: a message's row is inserted directly
 *	  (idem_direct_begin and ExecSimpleRelationInsert, as
 *	  ledger_insert_direct writes a ledger row), with the table's oid,
 *	  owner and identity sequence kept per backend until a relcache
 *	  invalidation of the table
 *	  (idem_outbox_relcache_cb).  A table that is no longer exactly the
 *	  one idem made (a column, a default, a trigger, a rule, row-level
 *	  security, a CHECK) or a read-only transaction gets the INSERT through
 *	  SPI instead, whose plan is kept per backend and replanned by
 *	  PostgreSQL when the table changes.
 *
 *	  Locking: none of its own; the state is backend-local, in
 *	  TopTransactionContext.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/relation.h"
#include "access/table.h"
#include "access/xact.h"
#include "catalog/namespace.h"
#include "catalog/pg_type.h"
#include "commands/sequence.h"
#include "executor/executor.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "nodes/primnodes.h"
#include "rewrite/rewriteHandler.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/hsearch.h"
#include "utils/jsonb.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"

#include "outbox.h"
#include "citus.h"
#include "compat.h"
#include "digest.h"
#include "ledger_insert.h"
#include "ledger_row.h"
#include "outbox_publish.h"
#include "pending.h"
#include "sql_args.h"
#include "subxact.h"

PG_FUNCTION_INFO_V1(idem_emit);
PG_FUNCTION_INFO_V1(idem_emit_tenant);
PG_FUNCTION_INFO_V1(idem_emit_many);

/* One message emitted in this transaction. */
typedef struct OutboxEmit
{
	int64		seq;			/* its row's seq */
	LedgerKind	kind;			/* the claim it belongs to: ledger, */
	int64		tenant_id;		/* tenant (and the entry's key) */
	int			level;			/* subtransaction that emitted it */
	int			discarded_level;	/* subtransaction whose idem_fail deleted
									 * it; 0: live */
} OutboxEmit;

/*
 * The messages of one key emitted in this transaction, in emit order, of
 * every claim of the key (the id names the key only: claims of one key in
 * both ledgers, or for two tenants, number their messages together).
 */
typedef struct OutboxKey
{
	uint8		key[IDEM_DIGEST_LEN];	/* hash key: must stay first */
	List	   *emits;			/* of OutboxEmit * */
} OutboxKey;

/* This transaction's emits by key; NULL until its first emit. */
static HTAB *outbox_keys = NULL;
/* Messages of claims settled and forgotten at the top level survive. */
static bool outbox_emitted = false;
/* Some message survives at commit or prepare (set at PRE_COMMIT). */
static bool outbox_live_at_commit = false;
/* The schema of the outbox this transaction wrote (for idem_fail's delete). */
static Oid	outbox_nsp = InvalidOid;

/* The prepared INSERT, per backend, and the schema it was made for. */
static SPIPlanPtr outbox_insert_plan = NULL;
static Oid	outbox_insert_nsp = InvalidOid;

/* The outbox table's columns, in the order idem made them. */
enum
{
	OC_SEQ = 0,
	OC_STREAM,
	OC_MESSAGE_ID,
	OC_BODY,
	OC_EMITTED_AT,
	OC_COUNT
};

static const struct
{
	const char *name;
	Oid			type;
}			outbox_columns[OC_COUNT] = {
	{"seq", INT8OID},
	{"stream", TEXTOID},
	{"message_id", TEXTOID},
	{"body", JSONBOID},
	{"emitted_at", TIMESTAMPTZOID},
};

/*
 * The outbox table of one schema, per backend, kept across transactions
 * until a relcache invalidation of the table (or of every relation).
 */
typedef struct OutboxRel
{
	Oid			nsp;			/* InvalidOid: nothing kept */
	Oid			relid;
	Oid			owner;
	bool		direct;			/* the direct insert applies */
	Oid			seqid;			/* seq's identity sequence (direct) */
	bool		stale;			/* an invalidation arrived: look again */
} OutboxRel;

static OutboxRel outbox_rel;

static void
outbox_reset(void)
{
	/* in TopTransactionContext, which goes with the transaction */
	outbox_keys = NULL;
	outbox_emitted = false;
	outbox_live_at_commit = false;
	outbox_nsp = InvalidOid;
}

/* Called by ledger_store_relcache_cb: the outbox (or every relation) changed. */
void
idem_outbox_relcache_cb(Datum arg, Oid relid)
{
	if (!OidIsValid(relid) || relid == outbox_rel.relid)
		outbox_rel.stale = true;
}

/* The live (not deleted by idem_fail) emits of key's entry, of lk if given. */
static int
outbox_live_emits(const OutboxKey *entry, const LedgerKey *lk)
{
	ListCell   *lc;
	int			n = 0;

	foreach(lc, entry->emits)
	{
		OutboxEmit *e = lfirst(lc);

		if (e->discarded_level != 0)
			continue;
		if (lk != NULL && (e->kind != lk->kind || e->tenant_id != lk->tenant_id))
			continue;
		n++;
	}
	return n;
}

/* The owner of the outbox of schema nsp (the extension's owner). */
static Oid
outbox_owner(Oid nsp, Oid *relid_out)
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
	if (relid_out)
		*relid_out = relid;
	return owner;
}

/*
 * Whether rel is exactly the outbox idem made, so that the direct insert
 * writes what the INSERT would: its five columns of their types, seq an
 * identity (*seqid: its sequence), emitted_at's default clock_timestamp(),
 * no CHECK, trigger, rule or row-level security, a plain table.
 */
static bool
outbox_rel_plain(Relation rel, Oid *seqid)
{
	TupleDesc	desc = RelationGetDescr(rel);
	Node	   *def;
	int			i;

	if (rel->rd_rel->relkind != RELKIND_RELATION ||
		rel->rd_rel->relispartition || rel->rd_rel->relrowsecurity ||
		rel->rd_rules != NULL || rel->trigdesc != NULL ||
		(desc->constr && desc->constr->num_check > 0) ||
		desc->natts != OC_COUNT)
		return false;
	for (i = 0; i < OC_COUNT; i++)
	{
		Form_pg_attribute att = TupleDescAttr(desc, i);

		if (att->attisdropped || att->atttypid != outbox_columns[i].type ||
			att->atttypmod != -1 || att->attgenerated ||
			strcmp(NameStr(att->attname), outbox_columns[i].name) != 0 ||
			(i == OC_SEQ) != (att->attidentity == ATTRIBUTE_IDENTITY_ALWAYS))
			return false;
	}
	def = build_column_default(rel, OC_SEQ + 1);
	if (def == NULL || !IsA(def, NextValueExpr))
		return false;
	*seqid = ((NextValueExpr *) def)->seqid;
	def = build_column_default(rel, OC_EMITTED_AT + 1);
	return def != NULL && IsA(def, FuncExpr) &&
		((FuncExpr *) def)->funcid == F_CLOCK_TIMESTAMP &&
		((FuncExpr *) def)->args == NIL;
}

/*
 * The outbox of schema nsp, opened RowExclusiveLock, with outbox_rel
 * describing it (looked up again after an invalidation).
 */
static Relation
outbox_open(Oid nsp)
{
	Relation	rel = NULL;

	if (outbox_rel.nsp == nsp && !outbox_rel.stale)
	{
		/* an invalidation processed while locking makes it stale */
		rel = try_relation_open(outbox_rel.relid, RowExclusiveLock);
		if (rel != NULL && !outbox_rel.stale)
			return rel;
		if (rel != NULL)
			relation_close(rel, RowExclusiveLock);
	}
	for (;;)
	{
		Oid			relid;

		outbox_rel.nsp = InvalidOid;
		outbox_rel.stale = false;
		outbox_rel.owner = outbox_owner(nsp, &relid);
		outbox_rel.relid = relid;
		rel = table_open(relid, RowExclusiveLock);
		if (outbox_rel.stale)
		{
			/* changed while we waited for the lock: look again */
			table_close(rel, RowExclusiveLock);
			continue;
		}
		outbox_rel.direct = outbox_rel_plain(rel, &outbox_rel.seqid);
		outbox_rel.nsp = nsp;
		return rel;
	}
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

/* Run one statement of the outbox as owner, through SPI (connected). */
static void
outbox_spi_as_owner(Oid owner, SPIPlanPtr plan, Datum *values, const char *nulls,
					int expect, int64 *seq_out)
{
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
 * The message's row, in the outbox of schema nsp, as its owner: its seq.
 * Direct when the table is as idem made it, else the INSERT through SPI.
 */
static int64
outbox_insert(Oid nsp, Datum stream, Datum id, Datum body)
{
	Relation	rel = outbox_open(nsp);
	Oid			owner = outbox_rel.owner;
	Oid			save_userid;
	int			save_sec;
	int64		seq;

	if (!outbox_rel.direct || XactReadOnly || ExecutorCheckPerms_hook != NULL)
	{
		Datum		values[3] = {stream, id, body};

		/* the INSERT refuses a read-only transaction, or uses the layout */
		table_close(rel, NoLock);
		if (SPI_connect() != SPI_OK_CONNECT)
			elog(ERROR, "SPI_connect failed");
		outbox_spi_as_owner(owner, outbox_insert_prepare(nsp), values, NULL,
							SPI_OK_INSERT_RETURNING, &seq);
		SPI_finish();
		return seq;
	}

	GetUserIdAndSecContext(&save_userid, &save_sec);
	SetUserIdAndSecContext(owner, save_sec | SECURITY_LOCAL_USERID_CHANGE |
						   SECURITY_RESTRICTED_OPERATION);
	PG_TRY();
	{
		IdemDirectWrite dw;
		TupleTableSlot *slot;

		idem_direct_begin(&dw, rel, NULL);
		slot = dw.slot;
		seq = nextval_internal(outbox_rel.seqid, false);
		memset(slot->tts_isnull, 0, sizeof(bool) * OC_COUNT);
		slot->tts_values[OC_SEQ] = Int64GetDatum(seq);
		slot->tts_values[OC_STREAM] = stream;
		slot->tts_values[OC_MESSAGE_ID] = id;
		slot->tts_values[OC_BODY] = body;
		slot->tts_values[OC_EMITTED_AT] = TimestampTzGetDatum(GetCurrentTimestamp());
		ExecStoreVirtualTuple(slot);
		ExecSimpleRelationInsert(dw.rri, dw.estate, slot);
		idem_direct_end(&dw);
	}
	PG_FINALLY();
	{
		SetUserIdAndSecContext(save_userid, save_sec);
	}
	PG_END_TRY();
	table_close(rel, NoLock);
	/* Later commands of the transaction see the row. */
	CommandCounterIncrement();
	return seq;
}

/*
 * idem_fail of a held claim (lk): delete its messages emitted in this
 * transaction, at the current level.
 */
static void
outbox_discard(OutboxKey *entry, const LedgerKey *lk)
{
	Datum	   *seqs;
	ArrayType  *arr;
	ListCell   *lc;
	int			n = outbox_live_emits(entry, lk);
	int			i = 0;
	int			level = GetCurrentTransactionNestLevel();
	SPIPlanPtr	plan;
	Oid			argtypes[1] = {INT8ARRAYOID};
	Datum		values[1];
	char	   *sql;

	if (n == 0)
		return;
	seqs = palloc(sizeof(Datum) * n);
	foreach(lc, entry->emits)
	{
		OutboxEmit *e = lfirst(lc);

		if (e->discarded_level == 0 && e->kind == lk->kind &&
			e->tenant_id == lk->tenant_id)
			seqs[i++] = Int64GetDatum(e->seq);
	}
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
	outbox_spi_as_owner(outbox_owner(outbox_nsp, NULL), plan, values, " ",
						SPI_OK_DELETE, NULL);
	SPI_finish();
	foreach(lc, entry->emits)
	{
		OutboxEmit *e = lfirst(lc);

		if (e->discarded_level == 0 && e->kind == lk->kind &&
			e->tenant_id == lk->tenant_id)
			e->discarded_level = level;
	}
}

/*
 * Completed or failed (is_fail) by this transaction (from the decisions).
 * Nothing to do unless it emitted.
 */
void
idem_outbox_claim_settled(const LedgerKey *lk, bool is_fail)
{
	OutboxKey  *entry;
	ListCell   *lc;

	if (outbox_keys == NULL)
		return;
	entry = hash_search(outbox_keys, lk->key, HASH_FIND, NULL);
	if (entry == NULL)
		return;
	if (is_fail)
		outbox_discard(entry, lk);

	/*
	 * Settled by the top level: no rollback short of the transaction's
	 * opens it again (and a claim of the key again starts its positions
	 * afresh), so forget its emits, as pending_settle forgets the claim,
	 * and remember only whether its messages survive.
	 */
	if (GetCurrentTransactionNestLevel() > 1)
		return;
	foreach(lc, entry->emits)
	{
		OutboxEmit *e = lfirst(lc);

		if (e->kind != lk->kind || e->tenant_id != lk->tenant_id)
			continue;
		if (e->discarded_level == 0)
			outbox_emitted = true;
		entry->emits = foreach_delete_current(entry->emits, lc);
		pfree(e);
	}
	if (entry->emits == NIL)
		hash_search(outbox_keys, lk->key, HASH_REMOVE, NULL);
}

/* Whether any message of this transaction is live. */
static bool
outbox_any_live(void)
{
	HASH_SEQ_STATUS seq;
	OutboxKey  *entry;

	if (outbox_emitted)
		return true;
	if (outbox_keys == NULL)
		return false;
	hash_seq_init(&seq, outbox_keys);
	while ((entry = hash_seq_search(&seq)) != NULL)
		if (outbox_live_emits(entry, NULL) > 0)
		{
			hash_seq_term(&seq);
			return true;
		}
	return false;
}

/* A transaction event, from xact.c. */
void
idem_outbox_xact_event(XactEvent event)
{
	switch (event)
	{
		case XACT_EVENT_PRE_COMMIT:
		case XACT_EVENT_PRE_PREPARE:
			/* after pending_flush, the last write of the transaction */
			outbox_live_at_commit = outbox_any_live();
			break;
		case XACT_EVENT_COMMIT:
			/* After the commit record: no ERROR, no allocation, no wait. */
			if (outbox_live_at_commit)
				idem_outbox_notify(MyDatabaseId);
			outbox_reset();
			break;
		case XACT_EVENT_PREPARE:
			/* its COMMIT PREPARED wakes nobody: the publisher polls */
			if (outbox_live_at_commit)
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
	HASH_SEQ_STATUS seq;
	OutboxKey  *entry;

	if (outbox_keys == NULL)
		return;
	hash_seq_init(&seq, outbox_keys);
	while ((entry = hash_seq_search(&seq)) != NULL)
	{
		ListCell   *lc;

		foreach(lc, entry->emits)
		{
			OutboxEmit *e = lfirst(lc);

			if (!idem_subxact_follow(&e->level, committed, level))
			{
				entry->emits = foreach_delete_current(entry->emits, lc);
				pfree(e);
				continue;
			}
			if (e->discarded_level != 0 &&
				!idem_subxact_follow(&e->discarded_level, committed, level))
				e->discarded_level = 0; /* its deletion was rolled back */
		}
		/* the current entry may go during the scan */
		if (entry->emits == NIL)
			hash_search(outbox_keys, entry->key, HASH_REMOVE, NULL);
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
	SetUserIdAndSecContext(outbox_owner(nsp, NULL), save_sec |
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
 * The held claim the message belongs to, in *lk: the one, or the one of
 * key (pending_held), or (tenant_form) the tenant ledger's claim of key
 * for tenant_id (pending_holds); the 55000 errors when there is none or
 * more than one.
 */
static void
outbox_find_claim(Oid nsp, const uint8 *key, bool tenant_form, int64 tenant_id,
				  LedgerKey *lk)
{
	int			matching;

	if (tenant_form)
	{
		memset(lk, 0, sizeof(*lk));
		lk->kind = LEDGER_TENANT;
		lk->tenant_id = tenant_id;
		memcpy(lk->key, key, IDEM_DIGEST_LEN);
		if (!pending_holds(lk))
			outbox_no_claim(nsp, true, " of it for this tenant");
		return;
	}
	matching = pending_held(key, lk);
	if (matching == 0 && (key == NULL || pending_held(NULL, lk) == 0))
		outbox_no_claim(nsp, false, "");
	if (matching == 0)
		outbox_no_claim(nsp, false, " of it");
	if (matching > 1)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("cannot emit a message: this transaction holds %d claims%s",
						matching, key ? " of this key" : ""),
				 errhint(key ? "The key is claimed in both ledgers or for two tenants; name the tenant: idem_emit(tenant_id, key, stream, message)." :
						 "Name the run's key: idem_emit(stream, message, key).")));
}

/* The id <key, 64 lowercase hex digits>-<n>, as text. */
static text *
outbox_message_id(const uint8 *key, int n)
{
	static const char hex[] = "0123456789abcdef";
	char		buf[IDEM_DIGEST_LEN * 2 + 1 + 12];
	char		digits[12];
	int			len = IDEM_DIGEST_LEN * 2;
	int			d = 0;
	int			i;

	for (i = 0; i < IDEM_DIGEST_LEN; i++)
	{
		buf[i * 2] = hex[key[i] >> 4];
		buf[i * 2 + 1] = hex[key[i] & 0xf];
	}
	buf[len++] = '-';
	do
	{
		digits[d++] = '0' + n % 10;
		n /= 10;
	} while (n > 0);
	while (d > 0)
		buf[len++] = digits[--d];
	return cstring_to_text_with_len(buf, len);
}

/* The schema of the function called, once per call site (as the decisions' call_cache). */
static Oid
outbox_call_nsp(FunctionCallInfo fcinfo)
{
	if (fcinfo->flinfo->fn_extra == NULL)
		fcinfo->flinfo->fn_extra =
			MemoryContextAllocZero(fcinfo->flinfo->fn_mcxt, sizeof(Oid));
	if (!OidIsValid(*(Oid *) fcinfo->flinfo->fn_extra))
		*(Oid *) fcinfo->flinfo->fn_extra =
			get_func_namespace(fcinfo->flinfo->fn_oid);
	return *(Oid *) fcinfo->flinfo->fn_extra;
}

/*
 * Record one message of the claim lk (found by outbox_find_claim) in the
 * outbox of schema nsp.  Returns the message's id.
 */
static text *
outbox_record(Oid nsp, const LedgerKey *lk, text *stream, Jsonb *message)
{
	OutboxKey  *entry;
	OutboxEmit *emit;
	text	   *id;
	int64		seq;
	int			len;
	bool		found;
	MemoryContext oldcxt;

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

	/* this transaction's first emit: the table of emits by key */
	if (outbox_keys == NULL)
	{
		HASHCTL		ctl;

		ctl.keysize = IDEM_DIGEST_LEN;
		ctl.entrysize = sizeof(OutboxKey);
		ctl.hcxt = TopTransactionContext;
		outbox_keys = hash_create("idem outbox emits", 16, &ctl,
								  HASH_ELEM | HASH_BLOBS | HASH_CONTEXT);
	}
	entry = hash_search(outbox_keys, lk->key, HASH_ENTER, &found);
	if (!found)
		entry->emits = NIL;

	/*
	 * Its position: one after the live emits of every claim of the key.  On
	 * an error below the entry may stay empty, which nothing minds.
	 */
	id = outbox_message_id(lk->key, outbox_live_emits(entry, NULL) + 1);
	seq = outbox_insert(nsp, PointerGetDatum(stream), PointerGetDatum(id),
						JsonbPGetDatum(message));

	outbox_nsp = nsp;
	oldcxt = MemoryContextSwitchTo(TopTransactionContext);
	emit = palloc(sizeof(OutboxEmit));
	emit->seq = seq;
	emit->kind = lk->kind;
	emit->tenant_id = lk->tenant_id;
	emit->level = GetCurrentTransactionNestLevel();
	emit->discarded_level = 0;
	entry->emits = lappend(entry->emits, emit);
	MemoryContextSwitchTo(oldcxt);

	return id;
}

/*
 * idem_emit(stream text, message jsonb, key bytea DEFAULT NULL) RETURNS
 * text: the message's id.
 */
Datum
idem_emit(PG_FUNCTION_ARGS)
{
	Oid			nsp = outbox_call_nsp(fcinfo);
	uint8		keybuf[IDEM_DIGEST_LEN];
	const uint8 *key = NULL;
	LedgerKey	lk;

	idem_require_arg(fcinfo, 0, "stream");
	idem_require_arg(fcinfo, 1, "message");
	if (PG_NARGS() > 2 && !PG_ARGISNULL(2))
	{
		idem_digest_check(PG_GETARG_BYTEA_PP(2), "key", keybuf);
		key = keybuf;
	}
	outbox_find_claim(nsp, key, false, 0, &lk);
	PG_RETURN_TEXT_P(outbox_record(nsp, &lk, PG_GETARG_TEXT_PP(0),
								   PG_GETARG_JSONB_P(1)));
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
	Oid			nsp = outbox_call_nsp(fcinfo);
	uint8		key[IDEM_DIGEST_LEN];
	LedgerKey	lk;

	idem_require_arg(fcinfo, 0, "tenant_id");
	idem_require_arg(fcinfo, 1, "key");
	idem_require_arg(fcinfo, 2, "stream");
	idem_require_arg(fcinfo, 3, "message");
	idem_digest_check(PG_GETARG_BYTEA_PP(1), "key", key);
	outbox_find_claim(nsp, key, true, PG_GETARG_INT64(0), &lk);
	PG_RETURN_TEXT_P(outbox_record(nsp, &lk, PG_GETARG_TEXT_PP(2),
								   PG_GETARG_JSONB_P(3)));
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
	Oid			nsp = outbox_call_nsp(fcinfo);
	uint8		key[IDEM_DIGEST_LEN];
	Jsonb	   *messages;
	LedgerKey	lk;
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
	outbox_find_claim(nsp, key, true, PG_GETARG_INT64(0), &lk);
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
		ids[i] = PointerGetDatum(outbox_record(nsp, &lk,
											   cstring_to_text_with_len(stream->val.string.val,
																		stream->val.string.len),
											   JsonbValueToJsonb(message)));
	}
	PG_RETURN_ARRAYTYPE_P(construct_array(ids, n, TEXTOID, -1, false, TYPALIGN_INT));
}
