/*-------------------------------------------------------------------------
 *
 * install.c
 *	  idem_install(tenants regclass): creates the two ledgers in the
 *	  extension's schema, once, after CREATE EXTENSION.
 *
 *	  The ledgers are ordinary tables, not extension members, so that
 *	  pg_dump dumps them (rows, identity sequences and the FK to the
 *	  application's tenants table) after the application's own tables and a
 *	  restore recreates them in order (SPEC 4.5).  Both tables are built from
 *	  one template, so their columns and checks cannot drift apart.
 *
 *	  fillfactor 70 leaves room on each page for the processing -> completed
 *	  update, which touches no indexed column and so stays HOT.
 *
 *-------------------------------------------------------------------------
 */
#include "idem.h"

#include "access/htup_details.h"
#include "catalog/pg_class.h"
#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "lib/stringinfo.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/lsyscache.h"

PG_FUNCTION_INFO_V1(idem_install);

/* Append the CREATE TABLE of one ledger; tenants is NULL for the platform one. */
static void
append_ledger_ddl(StringInfo buf, const char *nspname, const char *table,
				  const char *unique_name, const char *tenants)
{
	const char *qt = quote_identifier(table);

	appendStringInfo(buf,
					 "CREATE TABLE %s.%s (\n"
					 "  id bigint GENERATED ALWAYS AS IDENTITY,\n",
					 quote_identifier(nspname), qt);
	if (tenants)
		appendStringInfoString(buf, "  tenant_id bigint NOT NULL,\n");
	appendStringInfo(buf,
					 "  idempotency_key bytea NOT NULL,\n"
					 "  request_fingerprint bytea NOT NULL,\n"
					 "  status text NOT NULL DEFAULT 'processing',\n"
					 "  attempt integer NOT NULL DEFAULT 1,\n"
					 "  outcome jsonb NOT NULL DEFAULT '{}'::jsonb,\n"
					 "  expires_at timestamptz NOT NULL,\n"
					 "  created_at timestamptz NOT NULL DEFAULT clock_timestamp(),\n"
					 "  updated_at timestamptz NOT NULL DEFAULT clock_timestamp(),\n"
					 "  CONSTRAINT %s_pkey PRIMARY KEY (id),\n"
					 "  CONSTRAINT %s UNIQUE (%sidempotency_key),\n",
					 table, unique_name, tenants ? "tenant_id, " : "");
	if (tenants)
		appendStringInfo(buf,
						 "  CONSTRAINT %s_tenant_id_fkey FOREIGN KEY (tenant_id) REFERENCES %s (id),\n",
						 table, tenants);
	appendStringInfo(buf,
					 "  CONSTRAINT %s_attempt_check CHECK (attempt > 0),\n"
					 "  CONSTRAINT %s_check CHECK (status <> 'processing' OR outcome = '{}'::jsonb),\n"
					 "  CONSTRAINT %s_idempotency_key_check CHECK (octet_length(idempotency_key) = 32),\n"
					 "  CONSTRAINT %s_outcome_check CHECK (jsonb_typeof(outcome) = 'object' AND octet_length(outcome::text) <= 4096),\n"
					 "  CONSTRAINT %s_request_fingerprint_check CHECK (octet_length(request_fingerprint) = 32),\n"
					 "  CONSTRAINT %s_status_check CHECK (status IN ('processing', 'completed', 'failed_retryable', 'failed_permanent'))\n"
					 ") WITH (fillfactor = 70);\n"
					 "COMMENT ON TABLE %s.%s IS 'idem %s ledger: one row per idempotency key (created by idem_install)';\n",
					 table, table, table, table, table, table,
					 quote_identifier(nspname), qt,
					 tenants ? "tenant" : "platform");
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
				 errdetail("The tenant ledger's foreign key references tenants(id), which must be bigint.")));

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
	Oid			ledger;
	int			save_nestlevel;
	StringInfoData ddl;

	idem_require_arg(fcinfo, 0, "tenants");
	tenants = PG_GETARG_OID(0);

	/* Resolve nothing through the caller's search_path while we work. */
	save_nestlevel = NewGUCNestLevel();
	(void) set_config_option("search_path", "pg_catalog, pg_temp",
							 PGC_USERSET, PGC_S_SESSION,
							 GUC_ACTION_SAVE, true, 0, false);

	SPI_connect();
	check_tenants_table(tenants);

	initStringInfo(&ddl);
	ledger = get_relname_relid("idempotency_keys", nsp);
	if (OidIsValid(ledger))
	{
		Oid			target = ledger_fk_target(ledger);

		if (target != tenants)
			ereport(ERROR,
					(errcode(ERRCODE_DUPLICATE_TABLE),
					 errmsg("idem is already installed for tenants table \"%s\"",
							OidIsValid(target) ? get_rel_name(target) : "(none)"),
					 errdetail("The tenant ledger %s.idempotency_keys exists and references another table.",
							   nspname)));
	}
	else
		append_ledger_ddl(&ddl, nspname, "idempotency_keys",
						  "idempotency_keys_owner_key",
						  quote_qualified_identifier(get_namespace_name(get_rel_namespace(tenants)),
													 get_rel_name(tenants)));

	if (!OidIsValid(get_relname_relid("platform_idempotency_keys", nsp)))
		append_ledger_ddl(&ddl, nspname, "platform_idempotency_keys",
						  "platform_idempotency_keys_key", NULL);

	if (ddl.len > 0 && SPI_execute(ddl.data, false, 0) != SPI_OK_UTILITY)
		elog(ERROR, "could not create the idem ledgers");

	SPI_finish();
	AtEOXact_GUC(true, save_nestlevel);
	PG_RETURN_VOID();
}
