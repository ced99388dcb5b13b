/*-------------------------------------------------------------------------
 *
 * install.c
 *	  idem_install(tenants regclass): creates the two ledgers in the
 *	  extension's schema, once, after CREATE EXTENSION.
 *
 *	  The ledgers are ordinary tables, not extension members, so that
 *	  pg_dump dumps them (rows, identity sequences and the FK to the
 *	  application's tenants table) after the application's own tables and a
 *	  restore recreates them in order (a ledger made by the extension script
 *	  with an FK to an application table would be restored before that table,
 *	  and fail).  Both tables are built from
 *	  one template, so their columns and checks cannot drift apart.
 *
 *	  fillfactor 70 leaves room on each page for the processing -> completed
 *	  update, which touches no indexed column and so stays HOT.
 *
 *	  Each ledger is recorded by OID in the registry idem_ledgers (an
 *	  extension configuration table, so pg_dump restores it by name), and
 *	  the API uses only the recorded table (ledger_relation_find()).  A table
 *	  already under a ledger's name that is not recorded (a schema-only
 *	  restore, DROP/CREATE EXTENSION, or one planted by a role that can
 *	  create tables in the schema) is adopted only when it is owned by the
 *	  caller or the extension's owner and has exactly the ledger's shape:
 *	  the same columns, constraints and foreign key, and no triggers, rules,
 *	  policies or other indexes that would run someone else's code.
 *
 *	  The CHECK constraints are built from the constants the C code uses:
 *	  the statuses (idem_status_names), the digest length (IDEM_DIGEST_LEN)
 *	  and the outcome limit (IDEM_OUTCOME_MAX).
 *
 *	  On a Citus coordinator the tenant ledger is distributed
 *	  (idem_citus_distribute), and the worker nodes join the cluster's
 *	  Valkey cache before the install returns (idem_cache_cluster_join_now).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/htup_details.h"
#include "catalog/namespace.h"
#include "catalog/pg_class.h"
#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/syscache.h"

#include "cache_cluster.h"
#include "cache_format.h"
#include "citus.h"
#include "compat.h"
#include "digest.h"
#include "ledger_row.h"
#include "ledger_store.h"
#include "sql_args.h"

PG_FUNCTION_INFO_V1(idem_install);

/*
 * Append the CREATE TABLE of one ledger.  fk_target is the qualified name
 * of the tenants table, or NULL for no foreign key (the platform ledger,
 * and the temporary reference copy the shape of an existing table is
 * compared with).
 */
static void
append_ledger_ddl(StringInfo buf, const char *nspname, LedgerKind kind,
				  const char *unique_name, const char *fk_target, bool citus)
{
	const char *table = ledger_table_name(kind);
	const char *qt = quote_identifier(table);
	bool		tenant = kind == LEDGER_TENANT;
	const char *processing = idem_status_names[IDEM_STATUS_PROCESSING];
	StringInfoData statuses;
	int			i;

	initStringInfo(&statuses);
	for (i = 0; i < IDEM_STATUS_COUNT; i++)
		appendStringInfo(&statuses, "%s'%s'", i > 0 ? ", " : "",
						 idem_status_names[i]);

	appendStringInfo(buf,
					 "CREATE TABLE %s.%s (\n"
					 "  id bigint GENERATED ALWAYS AS IDENTITY,\n",
					 quote_identifier(nspname), qt);
	if (tenant)
		appendStringInfoString(buf, "  tenant_id bigint NOT NULL,\n");
	appendStringInfo(buf,
					 "  idempotency_key bytea NOT NULL,\n"
					 "  request_fingerprint bytea NOT NULL,\n"
					 "  status text NOT NULL DEFAULT '%s',\n"
					 "  attempt integer NOT NULL DEFAULT 1,\n"
					 "  outcome jsonb NOT NULL DEFAULT '{}'::jsonb,\n"
					 "  expires_at timestamptz NOT NULL,\n"
					 "  created_at timestamptz NOT NULL DEFAULT clock_timestamp(),\n"
					 "  updated_at timestamptz NOT NULL DEFAULT clock_timestamp(),\n"
					 "  CONSTRAINT %s_pkey PRIMARY KEY (%sid),\n"
					 "  CONSTRAINT %s UNIQUE (%sidempotency_key),\n",
					 processing, table, citus && tenant ? "tenant_id, " : "",
					 unique_name, tenant ? "tenant_id, " : "");
	if (fk_target)
		appendStringInfo(buf,
						 "  CONSTRAINT %s_tenant_id_fkey FOREIGN KEY (tenant_id) REFERENCES %s (id),\n",
						 table, fk_target);
	appendStringInfo(buf,
					 "  CONSTRAINT %s_attempt_check CHECK (attempt > 0),\n"
					 "  CONSTRAINT %s_check CHECK (status <> '%s' OR outcome = '{}'::jsonb),\n"
					 "  CONSTRAINT %s_idempotency_key_check CHECK (octet_length(idempotency_key) = %d),\n"
					 "  CONSTRAINT %s_outcome_check CHECK (jsonb_typeof(outcome) = 'object' AND octet_length(outcome::text) <= %d),\n"
					 "  CONSTRAINT %s_request_fingerprint_check CHECK (octet_length(request_fingerprint) = %d),\n"
					 "  CONSTRAINT %s_status_check CHECK (status IN (%s))\n"
					 ") WITH (fillfactor = 70);\n"
					 "COMMENT ON TABLE %s.%s IS 'idem %s ledger: one row per idempotency key (created by idem_install)';\n",
					 table,
					 table, processing,
					 table, IDEM_DIGEST_LEN,
					 table, IDEM_OUTCOME_MAX,
					 table, IDEM_DIGEST_LEN,
					 table, statuses.data,
					 quote_identifier(nspname), qt,
					 ledger_kind_name(kind));
	pfree(statuses.data);
}

static const char *const unique_names[LEDGER_KINDS] = {
	"idempotency_keys_owner_key", "platform_idempotency_keys_key"
};

/*
 * How a table differs from the ledger idem_install would create: one line
 * per column, constraint, index, trigger, rule, policy or storage trait
 * found on only one of the two ($1 the table, $2 the reference copy; $3 the
 * tenants table the foreign key must reference, or 0).
 */
static const char *const shape_diff_sql =
"WITH traits(rel, trait) AS ("
"  SELECT a.attrelid, pg_catalog.format('column %s %s%s%s%s%s', pg_catalog.quote_ident(a.attname),"
"         pg_catalog.format_type(a.atttypid, a.atttypmod),"
"         CASE WHEN a.attnotnull THEN ' NOT NULL' ELSE '' END,"
"         CASE a.attidentity WHEN 'a' THEN ' GENERATED ALWAYS AS IDENTITY'"
"              WHEN 'd' THEN ' GENERATED BY DEFAULT AS IDENTITY' ELSE '' END,"
"         CASE WHEN a.attgenerated <> '' THEN ' GENERATED' ELSE '' END,"
"         ' DEFAULT ' OPERATOR(pg_catalog.||) pg_catalog.pg_get_expr(d.adbin, d.adrelid))"
"    FROM pg_catalog.pg_attribute a"
"    LEFT JOIN pg_catalog.pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum"
"   WHERE a.attrelid IN ($1, $2) AND a.attnum > 0 AND NOT a.attisdropped"
"  UNION ALL"
"  SELECT conrelid, CASE contype WHEN 'f' THEN '' ELSE 'constraint '"
"         OPERATOR(pg_catalog.||) pg_catalog.quote_ident(conname) OPERATOR(pg_catalog.||) ' ' END"
"         OPERATOR(pg_catalog.||) pg_catalog.pg_get_constraintdef(oid)"
"    FROM pg_catalog.pg_constraint WHERE conrelid IN ($1, $2)"
"  UNION ALL"
"  SELECT $2, pg_catalog.format('FOREIGN KEY (tenant_id) REFERENCES %s(id)', $3::pg_catalog.regclass)"
"   WHERE $3 <> 0"
"  UNION ALL"
"  SELECT i.indrelid, 'index ' OPERATOR(pg_catalog.||) pg_catalog.pg_get_indexdef(i.indexrelid)"
"    FROM pg_catalog.pg_index i WHERE i.indrelid IN ($1, $2)"
"     AND NOT EXISTS (SELECT FROM pg_catalog.pg_constraint c"
"                      WHERE c.conindid = i.indexrelid AND c.conrelid = i.indrelid)"
"  UNION ALL"
"  SELECT tgrelid, 'trigger ' OPERATOR(pg_catalog.||) pg_catalog.quote_ident(tgname)"
"    FROM pg_catalog.pg_trigger WHERE tgrelid IN ($1, $2) AND NOT tgisinternal"
"  UNION ALL"
"  SELECT ev_class, 'rule ' OPERATOR(pg_catalog.||) pg_catalog.quote_ident(rulename)"
"    FROM pg_catalog.pg_rewrite WHERE ev_class IN ($1, $2)"
"  UNION ALL"
"  SELECT polrelid, 'policy ' OPERATOR(pg_catalog.||) pg_catalog.quote_ident(polname)"
"    FROM pg_catalog.pg_policy WHERE polrelid IN ($1, $2)"
"  UNION ALL"
"  SELECT c.oid, pg_catalog.format('a %s table (relkind %s, access method %s%s%s)',"
"         CASE WHEN c.relpersistence = 'p' OR c.oid = $2 THEN 'permanent' ELSE 'temporary or unlogged' END,"
"         c.relkind, am.amname,"
"         CASE WHEN c.relrowsecurity THEN ', row-level security' ELSE '' END,"
"         CASE WHEN c.relispartition OR EXISTS (SELECT FROM pg_catalog.pg_inherits"
"                    WHERE inhrelid = c.oid OR inhparent = c.oid) THEN ', inheritance' ELSE '' END)"
"    FROM pg_catalog.pg_class c LEFT JOIN pg_catalog.pg_am am ON am.oid = c.relam"
"   WHERE c.oid IN ($1, $2)"
"), diff AS ("
"  SELECT trait, pg_catalog.bool_or(rel = $1) AS in_table FROM traits"
"   GROUP BY trait HAVING NOT (pg_catalog.bool_or(rel = $1) AND pg_catalog.bool_or(rel = $2))"
")"
"SELECT pg_catalog.string_agg(CASE WHEN in_table THEN 'has: ' ELSE 'lacks: ' END"
"                             OPERATOR(pg_catalog.||) trait, E'\\n' ORDER BY trait)"
"  FROM diff";

static Oid
rel_owner(Oid relid)
{
	HeapTuple	tp = SearchSysCache1(RELOID, ObjectIdGetDatum(relid));
	Oid			owner;

	if (!HeapTupleIsValid(tp))
		elog(ERROR, "cache lookup failed for relation %u", relid);
	owner = ((Form_pg_class) GETSTRUCT(tp))->relowner;
	ReleaseSysCache(tp);
	return owner;
}

/* The role that owns the extension. */
static Oid
extension_owner(void)
{
	bool		isnull;
	Datum		d;

	if (SPI_execute("SELECT extowner FROM pg_catalog.pg_extension WHERE extname = 'idem'",
					true, 1) != SPI_OK_SELECT || SPI_processed != 1)
		elog(ERROR, "could not read the owner of extension idem");
	d = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull);
	return DatumGetObjectId(d);
}

/*
 * Refuse to adopt an existing table as a ledger unless the caller or the
 * extension's owner owns it and it has exactly the shape of the ledger
 * idem_install creates.
 */
static void
check_adoptable(LedgerKind kind, Oid relid, Oid tenants, bool citus)
{
	const char *table = ledger_table_name(kind);
	Oid			owner = rel_owner(relid);
	StringInfoData ddl;
	Oid			ref;
	Datum		args[3];
	Oid			argtypes[3] = {OIDOID, OIDOID, OIDOID};
	bool		isnull;
	Datum		diff;

	if (owner != GetUserId() && owner != extension_owner())
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("table %s exists and is owned by role \"%s\", not by you or the owner of extension idem",
						table, GetUserNameFromId(owner, false)),
				 errdetail("idem does not adopt a table someone else created under a ledger's name: its owner could run code as every role that uses idem."),
				 errhint("Drop or rename the table and run idem_install again, or make the extension's owner own it.")));

	/* A reference copy in pg_temp, compared column by column, then gone. */
	initStringInfo(&ddl);
	append_ledger_ddl(&ddl, "pg_temp", kind, unique_names[kind], NULL, citus);
	if (SPI_execute(ddl.data, false, 0) != SPI_OK_UTILITY)
		elog(ERROR, "could not create the reference ledger");
	ref = get_relname_relid(table, LookupExplicitNamespace("pg_temp", false));
	args[0] = ObjectIdGetDatum(relid);
	args[1] = ObjectIdGetDatum(ref);
	args[2] = ObjectIdGetDatum(kind == LEDGER_TENANT ? tenants : InvalidOid);
	if (SPI_execute_with_args(shape_diff_sql, 3, argtypes, args, NULL, false, 1) != SPI_OK_SELECT ||
		SPI_processed != 1)
		elog(ERROR, "could not compare %s with the ledger's shape", table);
	diff = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull);
	if (!isnull)
		ereport(ERROR,
				(errcode(ERRCODE_DUPLICATE_TABLE),
				 errmsg("table %s exists and is not an idem ledger", table),
				 errdetail("It differs from the ledger idem_install creates:\n%s",
						   TextDatumGetCString(diff)),
				 errhint("Drop or rename the table and run idem_install again to create the ledger.")));
	resetStringInfo(&ddl);
	appendStringInfo(&ddl, "DROP TABLE pg_temp.%s", quote_identifier(table));
	if (SPI_execute(ddl.data, false, 0) != SPI_OK_UTILITY)
		elog(ERROR, "could not drop the reference ledger");
}

/* The OID the registry holds for a kind, if that relation still exists. */
static Oid
registry_get(const char *qregistry, LedgerKind kind)
{
	char	   *sql = psprintf("SELECT ledger::pg_catalog.oid FROM %s WHERE kind = $1", qregistry);
	Datum		arg = CStringGetTextDatum(ledger_kind_name(kind));
	Oid			argtype = TEXTOID;
	bool		isnull;
	Oid			result = InvalidOid;

	if (SPI_execute_with_args(sql, 1, &argtype, &arg, NULL, true, 1) != SPI_OK_SELECT)
		elog(ERROR, "could not read %s", qregistry);
	if (SPI_processed > 0)
		result = DatumGetObjectId(SPI_getbinval(SPI_tuptable->vals[0],
												SPI_tuptable->tupdesc, 1, &isnull));
	if (OidIsValid(result) && !OidIsValid(get_rel_namespace(result)))
		result = InvalidOid;	/* dropped */
	return result;
}

static void
registry_put(const char *qregistry, LedgerKind kind, Oid relid)
{
	char	   *sql = psprintf("INSERT INTO %s (kind, ledger) VALUES ($1, $2::pg_catalog.regclass)"
							   " ON CONFLICT (kind) DO UPDATE SET ledger = EXCLUDED.ledger",
							   qregistry);
	Datum		args[2];
	Oid			argtypes[2] = {TEXTOID, OIDOID};

	args[0] = CStringGetTextDatum(ledger_kind_name(kind));
	args[1] = ObjectIdGetDatum(relid);
	if (SPI_execute_with_args(sql, 2, argtypes, args, NULL, false, 0) != SPI_OK_INSERT)
		elog(ERROR, "could not record the idem ledger in %s", qregistry);
}

/* The table the tenant ledger's FK points at, or InvalidOid. */
static Oid
ledger_fk_target(Oid ledger)
{
	Datum		arg = ObjectIdGetDatum(ledger);
	Oid			argtype = OIDOID;
	bool		isnull;
	Oid			result = InvalidOid;

	if (SPI_execute_with_args("SELECT confrelid FROM pg_catalog.pg_constraint"
							  " WHERE conrelid = $1 AND contype = 'f'",
							  1, &argtype, &arg, NULL, true, 1) != SPI_OK_SELECT)
		elog(ERROR, "could not read the ledger's foreign key");
	if (SPI_processed > 0)
	{
		Datum		d = SPI_getbinval(SPI_tuptable->vals[0],
									  SPI_tuptable->tupdesc, 1, &isnull);

		if (!isnull)
			result = DatumGetObjectId(d);
	}
	return result;
}

/* The qualified name of a relation, for SQL text. */
static char *
qualified_rel_name(Oid relid)
{
	return quote_qualified_identifier(get_namespace_name(get_rel_namespace(relid)),
									  get_rel_name(relid));
}

/*
 * Re-create the foreign key of an existing tenant ledger that has none, as
 * idem_install creates it.  Rows whose tenant is gone make it fail with
 * the foreign key's own error (23503).
 */
static void
add_ledger_fk(const char *nspname, Oid ledger, Oid tenants)
{
	const char *table = ledger_table_name(LEDGER_TENANT);
	char	   *sql;

	sql = psprintf("ALTER TABLE %s ADD CONSTRAINT %s FOREIGN KEY (tenant_id) REFERENCES %s (id)",
				   quote_qualified_identifier(nspname, table),
				   quote_identifier(psprintf("%s_tenant_id_fkey", table)),
				   qualified_rel_name(tenants));
	if (SPI_execute(sql, false, 0) != SPI_OK_UTILITY)
		elog(ERROR, "could not re-create the foreign key of %s", table);
	ereport(NOTICE,
			(errmsg("re-created the foreign key of the idem tenant ledger %s.%s to %s",
					nspname, table, get_rel_name(tenants))));
}

/* Refuse anything the tenant ledger's FK cannot point at. */
static void
check_tenants_table(Oid tenants)
{
	char		relkind = get_rel_relkind(tenants);
	AttrNumber	attnum;
	Datum		args[2];
	Oid			argtypes[2] = {OIDOID, INT2OID};
	const char *relname = get_rel_name(tenants);

	if (relkind != RELKIND_RELATION && relkind != RELKIND_PARTITIONED_TABLE)
		ereport(ERROR,
				(errcode(ERRCODE_WRONG_OBJECT_TYPE),
				 errmsg("\"%s\" is not a table", relname),
				 errhint("Pass the application's tenants table, for example idem_install('tenants').")));

	attnum = get_attnum(tenants, "id");
	if (attnum == InvalidAttrNumber || get_atttype(tenants, attnum) != INT8OID)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_FOREIGN_KEY),
				 errmsg("table \"%s\" has no bigint column \"id\"", relname),
				 errdetail("The tenant ledger's foreign key references %s(id), which must be bigint.",
						   quote_identifier(relname))));

	args[0] = ObjectIdGetDatum(tenants);
	args[1] = Int16GetDatum(attnum);
	if (SPI_execute_with_args("SELECT 1 FROM pg_catalog.pg_constraint"
							  " WHERE conrelid = $1 AND contype IN ('p', 'u')"
							  " AND conkey = ARRAY[$2]::pg_catalog.int2[]",
							  2, argtypes, args, NULL, true, 1) != SPI_OK_SELECT)
		elog(ERROR, "could not read the constraints of \"%s\"", relname);
	if (SPI_processed == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_FOREIGN_KEY),
				 errmsg("table \"%s\" has no primary key or unique constraint on \"id\" alone", relname),
				 errdetail("The tenant ledger's foreign key needs a unique \"id\" to reference.")));
}

/* idem_install(tenants regclass) RETURNS void */
Datum
idem_install(PG_FUNCTION_ARGS)
{
	Oid			tenants;
	Oid			nsp = get_func_namespace(fcinfo->flinfo->fn_oid);
	char	   *nspname = get_namespace_name(nsp);
	Oid			registry;
	char	   *qregistry;
	int			save_nestlevel;
	int			kind;
	bool		citus;

	idem_require_arg(fcinfo, 0, "tenants");
	tenants = PG_GETARG_OID(0);
	idem_require_utf8();

	/*
	 * The extension's SQL objects may predate the registry (0.1 and 0.2,
	 * before ALTER EXTENSION idem UPDATE): then the ledgers are created as
	 * those versions did, found by name, and recorded by the update.
	 */
	registry = get_relname_relid(IDEM_REGISTRY_TABLE, nsp);
	qregistry = OidIsValid(registry) ?
		quote_qualified_identifier(nspname, IDEM_REGISTRY_TABLE) : NULL;

	/* Resolve nothing through the caller's search_path while we work. */
	save_nestlevel = NewGUCNestLevel();
	(void) set_config_option("search_path", "pg_catalog, pg_temp",
							 PGC_USERSET, PGC_S_SESSION,
							 GUC_ACTION_SAVE, true, 0, false);

	SPI_connect();
	check_tenants_table(tenants);
	/* tenants distributed with Citus: see idem_citus_distribute() */
	citus = idem_citus_check_tenants(tenants);

	for (kind = 0; kind < LEDGER_KINDS; kind++)
	{
		const char *table = ledger_table_name((LedgerKind) kind);
		Oid			named = get_relname_relid(table, nsp);
		Oid			recorded = qregistry ? registry_get(qregistry, (LedgerKind) kind) : named;

		if (OidIsValid(recorded) && recorded == named)
		{
			/*
			 * Installed already: harmless, unless made unlogged since or
			 * installed for other tenants.
			 */
			ledger_check_permanent((LedgerKind) kind, named);
			if (kind == LEDGER_TENANT)
			{
				Oid			target = ledger_fk_target(named);

				/*
				 * No foreign key at all: dropped with the tenants table's key
				 * (DROP CONSTRAINT ... CASCADE).  Every call refuses such a
				 * ledger and sends the caller here: re-create it.
				 */
				if (!OidIsValid(target))
					add_ledger_fk(nspname, named, tenants);
				else if (target != tenants)
					ereport(ERROR,
							(errcode(ERRCODE_DUPLICATE_TABLE),
							 errmsg("idem is already installed for tenants table \"%s\"",
									get_rel_name(target)),
							 errdetail("The tenant ledger %s.idempotency_keys exists and references another table.",
									   nspname)));
			}
			continue;
		}
		if (OidIsValid(recorded) && !OidIsValid(named))
			ereport(ERROR,
					(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
					 errmsg("the idem %s ledger was renamed to %s",
							ledger_kind_name((LedgerKind) kind),
							get_rel_name(recorded)),
					 errhint("Rename it back to %s.%s.", nspname, table)));

		if (OidIsValid(named))
			check_adoptable((LedgerKind) kind, named, tenants, citus);
		else
		{
			StringInfoData ddl;
			char	   *qtenants = qualified_rel_name(tenants);

			initStringInfo(&ddl);
			append_ledger_ddl(&ddl, nspname, (LedgerKind) kind, unique_names[kind],
							  kind == LEDGER_TENANT ? qtenants : NULL,
							  citus);
			if (SPI_execute(ddl.data, false, 0) != SPI_OK_UTILITY)
				elog(ERROR, "could not create the idem ledger %s", table);
			named = get_relname_relid(table, nsp);

			/*
			 * On Citus the tenant ledger is distributed by tenant_id,
			 * co-located with tenants, and the tenant API delegated to
			 * the tenant's worker.  Citus requires the distribution column
			 * in every unique constraint, hence its primary key (tenant_id,
			 * id) there: the one difference from the single-node ledger.  The platform
			 * ledger stays a local table of the coordinator.
			 */
			if (citus && kind == LEDGER_TENANT)
				idem_citus_distribute(quote_qualified_identifier(nspname, table),
									  qtenants, nsp);
		}
		if (qregistry)
			registry_put(qregistry, (LedgerKind) kind, named);
	}

	SPI_finish();
	AtEOXact_GUC(true, save_nestlevel);

	/* Every backend looks its ledgers up again (ledger_registry.c). */
	if (OidIsValid(registry))
		CacheInvalidateRelcacheByRelid(registry);

	/*
	 * On Citus, the worker nodes join the cluster cache now, not at the
	 * first runner's learn: they copy from their first commit.
	 */
	if (citus)
		idem_cache_cluster_join_now(get_relname_relid(ledger_table_name(LEDGER_TENANT),
													  nsp));
	PG_RETURN_VOID();
}
