/*-------------------------------------------------------------------------
 *
 * ledger_store.c
 *	  Writes of a ledger table (ledger_store.h): statements prepared once
 *	  per backend, ledger and role, run through SPI, so constraints, the FK
 *	  and every index are maintained by PostgreSQL itself; a new row is
 *	  written directly where that is the same (ledger_insert.c), with the
 *	  SPI INSERT as the fallback.  Every name in the statements is
 *	  schema-qualified (the ledger in the extension's schema, operators and
 *	  functions in pg_catalog), so the caller's search_path can neither
 *	  redirect them nor force a replan.  Also the purge, of the local
 *	  ledger or, on Citus, of every shard (idem_shard_purge).
 *
 *	  Which table a store writes, and whether it may, is
 *	  ledger_registry.c's: the plans live in the LedgerStore and are freed
 *	  when it is rebuilt after the relcache callback invalidated it.  Every
 *	  write runs as idem's own (ledger_guard_own_begin/_end), so that the
 *	  ledger guard lets it through.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/dependency.h"
#include "catalog/pg_type.h"
#include "commands/sequence.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/lsyscache.h"

#include "ledger_store_int.h"
#include "citus.h"
#include "compat.h"
#include "digest.h"
#include "ledger_guard.h"
#include "ledger_insert.h"
#include "ledger_row.h"

/*
 * Every statement takes the owner of the key as $1 (tenant_id, unused on
 * the platform ledger) and the key as $2, so all bind them the same way.
 */
static const char *const owner_clause[LEDGER_KINDS] = {
	"tenant_id OPERATOR(pg_catalog.=) $1 AND idempotency_key OPERATOR(pg_catalog.=) $2",
	"idempotency_key OPERATOR(pg_catalog.=) $2"
};

/*
 * The purge's DELETE of up to LIMIT expired rows of TABLE, skipping rows
 * locked by others: terminal rows that expired before TERMINAL_BEFORE and
 * finished before FINISHED_BEFORE (younger ones are within
 * idem.min_retention), processing rows whose lease ended before
 * PROCESSING_BEFORE.  The arguments are SQL text: parameters for the local
 * plan, literals for the Citus shards.
 */
static char *
purge_sql(const char *table, const char *terminal_before,
		  const char *processing_before, const char *finished_before,
		  const char *limit)
{
	const char *processing = quote_literal_cstr(idem_status_names[IDEM_STATUS_PROCESSING]);

	return psprintf("DELETE FROM %s WHERE id OPERATOR(pg_catalog.=) ANY (ARRAY("
					"SELECT id FROM %s WHERE"
					" (status OPERATOR(pg_catalog.<>) %s AND expires_at OPERATOR(pg_catalog.<) %s"
					"  AND updated_at OPERATOR(pg_catalog.<) %s)"
					" OR (status OPERATOR(pg_catalog.=) %s AND expires_at OPERATOR(pg_catalog.<) %s)"
					" LIMIT %s FOR UPDATE SKIP LOCKED))",
					table, table, processing, terminal_before, finished_before,
					processing, processing_before, limit);
}

/* A timestamp as an SQL literal. */
static char *
timestamptz_literal(TimestampTz t)
{
	char	   *text = DatumGetCString(DirectFunctionCall1(timestamptz_out,
														   TimestampTzGetDatum(t)));

	return psprintf("%s::pg_catalog.timestamptz", quote_literal_cstr(text));
}

static SPIPlanPtr
prepare_plan(LedgerKind kind, StorePlanId id, const char *qtable, Oid idseq)
{
	const char *owner = owner_clause[kind];
	const char *processing = idem_status_names[IDEM_STATUS_PROCESSING];
	char	   *sql;
	Oid			types[8] = {INT8OID, BYTEAOID};
	int			nargs;
	SPIPlanPtr	plan;

	switch (id)
	{
		case PLAN_INSERT:
			/*
			 * The id ($8) is the claim's fence, drawn from the ledger's
			 * identity sequence when the claim answered (ledger_new_fence).
			 * A Citus shard has no identity of its own: its ids come from
			 * the identity sequence of the node's shell table, which Citus
			 * gives a range of its own on each node.
			 */
			sql = psprintf("INSERT INTO %s (id, %sidempotency_key, request_fingerprint,"
						   " status, attempt, outcome, expires_at)"
						   " OVERRIDING SYSTEM VALUE"
						   " VALUES ($8, %s$2, $3, $4, $5, $6, $7)",
						   qtable,
						   kind == LEDGER_TENANT ? "tenant_id, " : "",
						   kind == LEDGER_TENANT ? "$1, " : "");
			types[2] = BYTEAOID;
			types[3] = TEXTOID;
			types[4] = INT4OID;
			types[5] = JSONBOID;
			types[6] = TIMESTAMPTZOID;
			types[7] = INT8OID;
			nargs = 8;
			break;
		case PLAN_RECLAIM:
			/*
			 * A new id: the takeover's fence, never the one the holder it
			 * takes over from was given.  An identity column can only be
			 * updated to DEFAULT; a Citus shard's id is given ($6).
			 */
			sql = psprintf("UPDATE %s SET status = '%s', id = %s,"
						   " attempt = attempt OPERATOR(pg_catalog.+) 1,"
						   " outcome = '{}'::pg_catalog.jsonb, expires_at = $3,"
						   " updated_at = pg_catalog.clock_timestamp()"
						   " WHERE %s AND attempt OPERATOR(pg_catalog.=) $4"
						   " AND status OPERATOR(pg_catalog.=) $5"
						   " RETURNING attempt, id", qtable, processing,
						   OidIsValid(idseq) ? "$6" : "DEFAULT", owner);
			types[2] = TIMESTAMPTZOID;
			types[3] = INT4OID;
			types[4] = TEXTOID;
			types[5] = INT8OID;
			nargs = OidIsValid(idseq) ? 6 : 5;
			break;
		case PLAN_FINISH:
			/* $6: the attempt fence (0: none); $7: the claim's fence (0: none) */
			sql = psprintf("UPDATE %s SET status = $3, outcome = $4, expires_at = $5,"
						   " updated_at = pg_catalog.clock_timestamp()"
						   " WHERE %s AND status OPERATOR(pg_catalog.=) '%s'"
						   " AND ($6 OPERATOR(pg_catalog.=) 0 OR attempt OPERATOR(pg_catalog.=) $6)"
						   " AND ($7 OPERATOR(pg_catalog.=) 0 OR id OPERATOR(pg_catalog.=) $7)"
						   " RETURNING attempt, request_fingerprint",
						   qtable, owner, processing);
			types[2] = TEXTOID;
			types[3] = JSONBOID;
			types[4] = TIMESTAMPTZOID;
			types[5] = INT4OID;
			types[6] = INT8OID;
			nargs = 7;
			break;
		case PLAN_EXHAUST:
			sql = psprintf("UPDATE %s SET status = '%s',"
						   " expires_at = GREATEST(expires_at, $3),"
						   " updated_at = pg_catalog.clock_timestamp()"
						   " WHERE %s AND attempt OPERATOR(pg_catalog.=) $4"
						   " AND status OPERATOR(pg_catalog.=) '%s'"
						   " RETURNING expires_at", qtable,
						   idem_status_names[IDEM_STATUS_FAILED_PERMANENT], owner,
						   idem_status_names[IDEM_STATUS_FAILED_RETRYABLE]);
			types[2] = TIMESTAMPTZOID;
			types[3] = INT4OID;
			nargs = 4;
			break;
		case PLAN_PURGE:
			sql = purge_sql(qtable, "$1", "$2", "$4", "$3");
			types[0] = TIMESTAMPTZOID;
			types[1] = TIMESTAMPTZOID;
			types[2] = INT4OID;
			types[3] = TIMESTAMPTZOID;
			nargs = 4;
			break;
		default:
			elog(ERROR, "unknown ledger statement %d", (int) id);
	}

	plan = SPI_prepare(sql, nargs, types);
	if (plan == NULL)
		elog(ERROR, "could not prepare idem ledger statement: %s",
			 SPI_result_code_string(SPI_result));
	SPI_keepplan(plan);
	pfree(sql);
	return plan;
}

/*
 * A prepared statement of the store, for the current role (the caller is
 * connected to SPI).  The planner inlines a SQL function in a default or
 * a constraint only for a role that may execute it, and a plan is kept for
 * reuse: so each role gets statements planned for it, and a role that may
 * not run such a function gets the executor's permission error, never the
 * previous role's inlined result.
 */
static SPIPlanPtr
store_plan(LedgerStore *store, StorePlanId id)
{
	Oid			role = GetUserId();

	if (store->plans[id] == NULL || store->plan_roles[id] != role)
	{
		if (store->plans[id])
			SPI_freeplan(store->plans[id]);
		store->plans[id] = NULL;
		store->plans[id] = prepare_plan(store->kind, id,
										quote_qualified_identifier(get_namespace_name(store->nsp),
																   get_rel_name(store->relid)),
										store->idseq);
		store->plan_roles[id] = role;
	}
	return store->plans[id];
}

/*
 * Run one of idem's own prepared statements on the ledger: its rows do not
 * leave the ledger behind idem's back (ledger_guard.c), whatever it does.
 * Returns SPI_execute_plan's code.
 */
static int
store_execute_own(LedgerStore *store, StorePlanId id, Datum *values)
{
	volatile int rc = 0;

	ledger_guard_own_begin();
	PG_TRY();
	{
		rc = SPI_execute_plan(store_plan(store, id), values, NULL, false, 0);
	}
	PG_FINALLY();
	{
		ledger_guard_own_end();
	}
	PG_END_TRY();
	return rc;
}

static void
run_write(LedgerStore *store, StorePlanId id, const LedgerKey *lk,
		  Datum *extra, int nextra, int expect)
{
	Datum		values[8];
	IdemDigestBytea keybuf;
	int			i;
	int			rc;

	values[0] = Int64GetDatum(lk->tenant_id);
	values[1] = PointerGetDatum(idem_digest_bytea(lk->key, &keybuf));
	for (i = 0; i < nextra; i++)
		values[2 + i] = extra[i];
	rc = store_execute_own(store, id, values);
	if (rc != expect)
		elog(ERROR, "idem ledger statement failed: %s", SPI_result_code_string(rc));
}

/*
 * The sequence the ledger's ids are drawn from: its identity column's, or
 * on a Citus shard the shell table's.
 */
static Oid
store_id_sequence(LedgerStore *store)
{
	if (OidIsValid(store->idseq))
		return store->idseq;
	if (!OidIsValid(store->id_seq))
	{
		store->id_seq = idem_identity_sequence_if_any(store->relid,
													  store->att[COL_ID]);
		if (!OidIsValid(store->id_seq))
			ereport_altered(ledger_table_name(store->kind),
							("Column \"id\" is no longer an identity column."),
							("Make it one again: ALTER TABLE %s ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY.",
							 ledger_table_name(store->kind)));
	}
	return store->id_seq;
}

/*
 * A new claim's fence: the id its row will have, drawn as the identity
 * column's default draws it, without the USAGE privilege on the sequence
 * (the INSERT privilege on the ledger stands for it).  Never reused, so a
 * holder whose claim was taken over, or whose row was purged and the key
 * claimed again, never completes another claim.
 */
int64
ledger_new_fence(LedgerStore *store)
{
	store_check_local(store);
	return nextval_internal(store_id_sequence(store), false);
}

/*
 * Write a new row (the claim's only write), with id fence (0: one drawn
 * now).
 */
void
ledger_insert(LedgerStore *store, const LedgerKey *lk, int64 fence,
			  const uint8 *fingerprint, IdemStatus status, int32 attempt,
			  Datum outcome, TimestampTz expires_at)
{
	Datum		extra[6];

	store_check_local(store);
	if (!OidIsValid(store->idseq) &&
		ledger_insert_direct(store->relid, lk, fence, fingerprint, status,
							 attempt, outcome, expires_at))
		return;
	extra[0] = PointerGetDatum(idem_digest_bytea(fingerprint, NULL));
	extra[1] = CStringGetTextDatum(idem_status_names[status]);
	extra[2] = Int32GetDatum(attempt);
	extra[3] = outcome;
	extra[4] = TimestampTzGetDatum(expires_at);
	extra[5] = Int64GetDatum(fence != 0 ? fence : ledger_new_fence(store));
	SPI_connect();
	run_write(store, PLAN_INSERT, lk, extra, 6, SPI_OK_INSERT);
	SPI_finish();
}

/*
 * Take over a row seen as failed_retryable or with an expired lease: its
 * new attempt, and its new id (*fence).
 */
bool
ledger_reclaim(LedgerStore *store, const LedgerKey *lk, const LedgerRow *seen,
			   TimestampTz lease_end, int32 *attempt, int64 *fence)
{
	Datum		extra[4];
	int			nextra = 3;
	bool		isnull;
	bool		done;

	store_check_local(store);
	extra[0] = TimestampTzGetDatum(lease_end);
	extra[1] = Int32GetDatum(seen->attempt);
	extra[2] = CStringGetTextDatum(idem_status_names[seen->status]);
	if (OidIsValid(store->idseq))
		extra[nextra++] = Int64GetDatum(ledger_new_fence(store));
	SPI_connect();
	run_write(store, PLAN_RECLAIM, lk, extra, nextra, SPI_OK_UPDATE_RETURNING);
	done = SPI_processed == 1;
	if (done)
	{
		*attempt = DatumGetInt32(SPI_getbinval(SPI_tuptable->vals[0],
											   SPI_tuptable->tupdesc, 1, &isnull));
		*fence = DatumGetInt64(SPI_getbinval(SPI_tuptable->vals[0],
											 SPI_tuptable->tupdesc, 2, &isnull));
	}
	SPI_finish();
	return done;
}

/*
 * A failed_retryable row seen out of attempts becomes failed_permanent, its
 * detail kept, retained at least until expires_at.  False when the row
 * changed since it was seen.
 */
bool
ledger_exhaust(LedgerStore *store, const LedgerKey *lk, const LedgerRow *seen,
			   TimestampTz expires_at, TimestampTz *kept_until)
{
	Datum		extra[2];
	bool		isnull;
	bool		done;

	store_check_local(store);
	extra[0] = TimestampTzGetDatum(expires_at);
	extra[1] = Int32GetDatum(seen->attempt);
	SPI_connect();
	run_write(store, PLAN_EXHAUST, lk, extra, 2, SPI_OK_UPDATE_RETURNING);
	done = SPI_processed == 1;
	if (done)
		*kept_until = DatumGetTimestampTz(SPI_getbinval(SPI_tuptable->vals[0],
														SPI_tuptable->tupdesc, 1, &isnull));
	SPI_finish();
	return done;
}

/*
 * processing -> a final status; false when no processing row exists (of
 * attempt fence_attempt, when not 0, and of id fence, when not 0).
 */
bool
ledger_finish(LedgerStore *store, const LedgerKey *lk, IdemStatus status,
			  Datum outcome, TimestampTz expires_at, int32 fence_attempt,
			  int64 fence, int32 *attempt, uint8 *fingerprint)
{
	Datum		extra[5];
	bool		isnull;
	bool		done;

	store_check_local(store);
	extra[0] = CStringGetTextDatum(idem_status_names[status]);
	extra[1] = outcome;
	extra[2] = TimestampTzGetDatum(expires_at);
	extra[3] = Int32GetDatum(fence_attempt);
	extra[4] = Int64GetDatum(fence);
	SPI_connect();
	run_write(store, PLAN_FINISH, lk, extra, 5, SPI_OK_UPDATE_RETURNING);
	done = SPI_processed == 1;
	if (done)
	{
		Datum		fp;

		*attempt = DatumGetInt32(SPI_getbinval(SPI_tuptable->vals[0],
											   SPI_tuptable->tupdesc, 1, &isnull));
		fp = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 2, &isnull);
		if (isnull)
			ereport_altered(ledger_table_name(store->kind),
							("A row has a NULL \"request_fingerprint\"."),
							("Restore the column's NOT NULL constraint."));
		ledger_digest_value(store, fp, fingerprint);
	}
	SPI_finish();
	return done;
}

/* Delete one batch of expired rows; rows locked by others are skipped. */
int64
ledger_purge(LedgerStore *store, TimestampTz terminal_before,
			 TimestampTz processing_before, TimestampTz finished_before,
			 int32 batch)
{
	Datum		values[4];
	int64		deleted;
	int			rc;

	values[0] = TimestampTzGetDatum(terminal_before);
	values[1] = TimestampTzGetDatum(processing_before);
	values[2] = Int32GetDatum(batch);
	values[3] = TimestampTzGetDatum(finished_before);
	if (store->distributed)
	{
		/*
		 * Every shard, through Citus: %1$L is the shard's name there, as a
		 * literal.  idem_shard_purge runs the batch on it as idem's own
		 * write, so that the worker's ledger guard lets it through.
		 */
		return idem_citus_purge(store->relid,
								psprintf("SELECT %s.idem_shard_purge(%%1$L, %s, %s, %s, %d)",
										 quote_identifier(get_namespace_name(get_rel_namespace(store->relid))),
										 timestamptz_literal(terminal_before),
										 timestamptz_literal(processing_before),
										 timestamptz_literal(finished_before),
										 batch));
	}
	SPI_connect();
	/* expired rows, whose copies have expired too */
	rc = store_execute_own(store, PLAN_PURGE, values);
	if (rc != SPI_OK_DELETE)
		elog(ERROR, "idem purge failed");
	deleted = (int64) SPI_processed;
	SPI_finish();
	return deleted;
}

PG_FUNCTION_INFO_V1(idem_shard_purge);

/*
 * idem_shard_purge(shard regclass, terminal_before timestamptz,
 * processing_before timestamptz, finished_before timestamptz, batch integer)
 * RETURNS bigint: one purge batch on a Citus shard of the tenant ledger, run
 * on the node that holds it by idem_purge on the coordinator (through
 * run_command_on_shards), with the caller's privileges on the shard.  Only
 * expired rows leave, whose copies have expired too, so the batch is idem's
 * own write for the ledger guard (ledger_guard.c), as the single-node purge
 * is.  Returns the rows deleted.
 */
Datum
idem_shard_purge(PG_FUNCTION_ARGS)
{
	Oid			shard = PG_GETARG_OID(0);
	Datum		values[4];
	Oid			types[4] = {TIMESTAMPTZOID, TIMESTAMPTZOID, INT4OID, TIMESTAMPTZOID};
	bool		is_shard;
	char	   *sql;
	volatile int rc = 0;
	int64		deleted;

	if (PG_NARGS() != 5 || PG_ARGISNULL(0) || PG_ARGISNULL(1) ||
		PG_ARGISNULL(2) || PG_ARGISNULL(3) || PG_ARGISNULL(4))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("idem_shard_purge arguments must not be null")));
	if (!idem_ledger_guard_is_ledger(shard, &is_shard) || !is_shard)
		ereport(ERROR,
				(errcode(ERRCODE_WRONG_OBJECT_TYPE),
				 errmsg("relation \"%s\" is not a Citus shard of the idem tenant ledger",
						get_rel_name(shard) ? get_rel_name(shard) : "?"),
				 errhint("idem_purge() calls this function on every shard; call idem_purge() on the coordinator.")));
	sql = purge_sql(quote_qualified_identifier(get_namespace_name(get_rel_namespace(shard)),
											   get_rel_name(shard)),
					"$1", "$2", "$4", "$3");
	values[0] = PG_GETARG_DATUM(1);
	values[1] = PG_GETARG_DATUM(2);
	values[2] = PG_GETARG_DATUM(4);
	values[3] = PG_GETARG_DATUM(3);
	SPI_connect();
	ledger_guard_own_begin();
	PG_TRY();
	{
		rc = SPI_execute_with_args(sql, 4, types, values, NULL, false, 0);
	}
	PG_FINALLY();
	{
		ledger_guard_own_end();
	}
	PG_END_TRY();
	if (rc != SPI_OK_DELETE)
		elog(ERROR, "idem purge of shard \"%s\" failed", get_rel_name(shard));
	deleted = (int64) SPI_processed;
	SPI_finish();
	PG_RETURN_INT64(deleted);
}
