/*
 * workload.c
 *	  What the demo does: the plan (money transfers between accounts of many
 *	  tenants, invoices paid by business key, periodic maintenance.purge,
 *	  deliberate duplicates), the demo's tables and the effect functions.
 *
 *	  The effect table idem_demo.transfers deliberately has NO unique
 *	  constraint on the run_id or task key: if a transfer were applied twice,
 *	  the check would see it.
 */
#include "demo.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *
kind_name(demo_kind k)
{
	switch (k)
	{
		case KIND_TRANSFER:
			return "transfer";
		case KIND_INVOICE:
			return "invoice";
		case KIND_PURGE:
			return "purge";
	}
	return "?";
}

const char *
kind_scope(demo_kind k)
{
	switch (k)
	{
		case KIND_TRANSFER:
			return "transfer.create";
		case KIND_INVOICE:
			return "invoice.pay";
		case KIND_PURGE:
			return "maintenance.purge";
	}
	return "?";
}

/* The request a message carries; its fingerprint is what idem compares. */
int
request_json(const demo_config *cfg, const demo_task *t, char *buf, size_t len)
{
	(void) cfg;
	switch (t->kind)
	{
		case KIND_TRANSFER:
			return snprintf(buf, len,
							"{\"tenant\": %lld, \"from\": %d, \"to\": %d, \"amount\": %lld, \"currency\": \"EUR\"%s}",
							(long long) t->tenant, t->from, t->to,
							(long long) t->amount,
							t->flaky ? ", \"flaky\": true" : "");
		case KIND_INVOICE:
			return snprintf(buf, len,
							"{\"tenant\": %lld, \"invoice\": \"%s\", \"payer\": %d, \"amount\": %lld}",
							(long long) t->tenant, t->id, t->from,
							(long long) t->amount);
		case KIND_PURGE:
			return snprintf(buf, len, "{\"batch\": 500}");
	}
	return -1;
}

static double
frand(void)
{
	return (double) rand() / ((double) RAND_MAX + 1.0);
}

static int
irand(int n)
{
	return n <= 0 ? 0 : (int) (frand() * n);
}

/* Account a of tenant t is frozen: transfers touching it fail for good. */
static int
is_frozen(const demo_config *cfg, int64_t tenant, int a)
{
	return tenant % 5 == 0 && a == cfg->accounts - 1;
}

static int
msg_cmp(const void *a, const void *b)
{
	double		d = ((const demo_msg *) a)->pos - ((const demo_msg *) b)->pos;

	return d < 0 ? -1 : d > 0 ? 1 : 0;
}

int
plan_build(const demo_config *cfg, demo_plan *p)
{
	int			n = cfg->ntasks,
				i,
				maxmsgs;
	int			span = n / 4 > 300 ? 300 : (n / 4 > 2 ? n / 4 : 2);

	memset(p, 0, sizeof(*p));
	srand(cfg->seed);
	p->tasks = calloc(n + cfg->purges + 1, sizeof(demo_task));
	maxmsgs = (n + cfg->purges) * 5 + 8;
	p->msgs = calloc(maxmsgs, sizeof(demo_msg));
	if (p->tasks == NULL || p->msgs == NULL)
		return -1;
	p->n_accounts = cfg->tenants * cfg->accounts;

#define ADD_MSG(task_, copy_, pos_, runid_) do { \
		demo_msg *m_ = &p->msgs[p->nmsgs++]; \
		m_->task = (task_); m_->copy = (copy_); m_->pos = (pos_); \
		snprintf(m_->run_id, sizeof(m_->run_id), "%s", (runid_)); \
	} while (0)

	for (i = 0; i < n; i++)
	{
		demo_task  *t = &p->tasks[p->ntasks];
		int			ti = p->ntasks++;
		char		run[64];
		int			copies = 0,
					c;

		t->tenant = 1 + irand(cfg->tenants);
		t->amount = 1 + irand(500);
		if (frand() < 0.12)
		{
			/* an invoice: paid from a payer to the tenant's account 0, keyed
			 * by its number; the customer clicks "pay" twice (two run_ids) */
			t->kind = KIND_INVOICE;
			t->from = 1 + irand(cfg->accounts - 2);
			t->to = 0;
			snprintf(t->id, sizeof(t->id), "INV-%s-%d", cfg->tag, i);
			snprintf(t->task_key, sizeof(t->task_key), "invoice:%s", t->id);
			t->should_apply = 1;
			p->n_invoices++;
			snprintf(run, sizeof(run), "r%s-%da", cfg->tag, i);
			ADD_MSG(ti, 0, i, run);
			snprintf(run, sizeof(run), "r%s-%db", cfg->tag, i);
			ADD_MSG(ti, 0, frand() < 0.3 ? i + 0.2 : i + 1 + irand(span) + 0.6, run);
			p->n_invoice_resubmits++;
			if (frand() < cfg->dup_ratio)
			{
				ADD_MSG(ti, 1, i + 1 + irand(span) + 0.7, run);
				p->n_dup_msgs++;
			}
			continue;
		}
		t->kind = KIND_TRANSFER;
		t->from = irand(cfg->accounts);
		do
			t->to = irand(cfg->accounts);
		while (t->to == t->from);
		t->flaky = frand() < 0.04;
		t->should_apply = !is_frozen(cfg, t->tenant, t->from) &&
			!is_frozen(cfg, t->tenant, t->to);
		snprintf(t->id, sizeof(t->id), "r%s-%d", cfg->tag, i);
		snprintf(t->task_key, sizeof(t->task_key), "transfer:%s", t->id);
		p->n_transfers++;
		p->n_flaky += t->flaky;
		p->n_frozen_tasks += !t->should_apply;
		ADD_MSG(ti, 0, i, t->id);
		if (frand() < cfg->dup_ratio)
			copies = frand() < 0.2 ? 2 : 1;
		for (c = 1; c <= copies; c++)
		{
			/* right behind (two workers at once: busy) or later (replay) */
			double		pos = frand() < 0.4 ? i + 0.1 * c :
				i + 1 + irand(span) + 0.5;

			ADD_MSG(ti, c, pos, t->id);
			p->n_dup_msgs++;
		}
	}
	for (i = 0; i < cfg->purges; i++)
	{
		demo_task  *t = &p->tasks[p->ntasks];
		int			ti = p->ntasks++;
		double		pos = (double) (i + 1) * n / (cfg->purges + 1) + 0.05;

		t->kind = KIND_PURGE;
		t->should_apply = 1;
		snprintf(t->id, sizeof(t->id), "p%s-%d", cfg->tag, i);
		p->n_purges++;
		ADD_MSG(ti, 0, pos, t->id);
		if (frand() < cfg->dup_ratio)
		{
			ADD_MSG(ti, 1, pos + 0.01, t->id);
			p->n_dup_msgs++;
		}
	}
#undef ADD_MSG
	qsort(p->msgs, p->nmsgs, sizeof(demo_msg), msg_cmp);
	return 0;
}

void
plan_free(demo_plan *p)
{
	free(p->tasks);
	free(p->msgs);
	memset(p, 0, sizeof(*p));
}

int
db_exec(PGconn *conn, const char *sql, char *err, size_t errlen)
{
	PGresult   *r = PQexec(conn, sql);
	int			ok = PQresultStatus(r) == PGRES_COMMAND_OK ||
		PQresultStatus(r) == PGRES_TUPLES_OK;

	if (!ok && err)
		snprintf(err, errlen, "%s", PQerrorMessage(conn));
	PQclear(r);
	return ok ? 0 : -1;
}

/* One value of a query, copied to buf; -1 on error, 1 if NULL or no row. */
static int
db_value(PGconn *conn, const char *sql, char *buf, size_t len, char *err,
		 size_t errlen)
{
	PGresult   *r = PQexec(conn, sql);
	int			rc = 0;

	if (PQresultStatus(r) != PGRES_TUPLES_OK)
	{
		snprintf(err, errlen, "%s", PQerrorMessage(conn));
		rc = -1;
	}
	else if (PQntuples(r) < 1 || PQgetisnull(r, 0, 0))
		rc = 1;
	else
		snprintf(buf, len, "%s", PQgetvalue(r, 0, 0));
	PQclear(r);
	return rc;
}

/*
 * Stage two's effect: a ledger of notices, one row per notification a
 * consumer applied.  No UNIQUE on message_id or task_key either: a notice
 * applied twice must be visible to the check.
 */
static const char DEMO_NOTICES[] =
"CREATE TABLE idem_demo.notices (\n"
"  id bigserial PRIMARY KEY,\n"
"  message_id text NOT NULL,\n"
"  task_key text NOT NULL,\n"
"  tenant_id bigint NOT NULL,\n"
"  transfer_id bigint NOT NULL,\n"
"  attempt int NOT NULL,\n"
"  consumer int NOT NULL,\n"
"  applied_at timestamptz NOT NULL DEFAULT clock_timestamp());\n"
"CREATE INDEX ON idem_demo.notices (task_key);\n";

static const char DEMO_SCHEMA[] =
"DROP SCHEMA IF EXISTS idem_demo CASCADE;\n"
"CREATE SCHEMA idem_demo;\n"
"CREATE TABLE idem_demo.accounts (\n"
"  tenant_id bigint NOT NULL,\n"
"  account_no int NOT NULL,\n"
"  opening bigint NOT NULL,\n"
"  balance bigint NOT NULL,\n"
"  frozen boolean NOT NULL DEFAULT false,\n"
"  PRIMARY KEY (tenant_id, account_no));\n"
"-- The effect.  No UNIQUE on task_key or run_id, on purpose: a transfer\n"
"-- applied twice must be visible to the check.\n"
"CREATE TABLE idem_demo.transfers (\n"
"  id bigserial PRIMARY KEY,\n"
"  tenant_id bigint NOT NULL,\n"
"  task_key text NOT NULL,\n"
"  run_id text NOT NULL,\n"
"  from_account int NOT NULL,\n"
"  to_account int NOT NULL,\n"
"  amount bigint NOT NULL,\n"
"  attempt int NOT NULL,\n"
"  worker int NOT NULL,\n"
"  applied_at timestamptz NOT NULL DEFAULT clock_timestamp());\n"
"CREATE INDEX ON idem_demo.transfers (task_key);\n"
"CREATE TABLE idem_demo.invoices (\n"
"  tenant_id bigint NOT NULL,\n"
"  invoice_no text NOT NULL,\n"
"  payer int NOT NULL,\n"
"  merchant int NOT NULL,\n"
"  amount bigint NOT NULL,\n"
"  paid_count int NOT NULL DEFAULT 0,\n"
"  paid_by_run text,\n"
"  PRIMARY KEY (tenant_id, invoice_no));\n"
"-- What the producer enqueued: each logical task once.\n"
"CREATE TABLE idem_demo.expected (\n"
"  task_key text PRIMARY KEY,\n"
"  kind text NOT NULL,\n"
"  scope text NOT NULL,\n"
"  id text NOT NULL,\n"
"  tenant_id bigint NOT NULL,\n"
"  from_account int NOT NULL,\n"
"  to_account int NOT NULL,\n"
"  amount bigint NOT NULL,\n"
"  should_apply boolean NOT NULL);\n"
"-- The effect of one transfer: both accounts locked in a fixed order (no\n"
"-- deadlock between transfers), two balance updates, one transfers row.\n"
"-- NULL, and nothing changed, when an account is frozen.\n"
"CREATE FUNCTION idem_demo.transfer(p_tenant bigint, p_task_key text,\n"
"    p_run_id text, p_from int, p_to int, p_amount bigint, p_attempt int,\n"
"    p_worker int) RETURNS bigint LANGUAGE plpgsql AS $f$\n"
"DECLARE n int; n_frozen int; tid bigint;\n"
"BEGIN\n"
"  SELECT count(*), count(*) FILTER (WHERE a.frozen) INTO n, n_frozen\n"
"    FROM (SELECT frozen FROM idem_demo.accounts\n"
"           WHERE tenant_id = p_tenant AND account_no IN (p_from, p_to)\n"
"           ORDER BY account_no FOR UPDATE) a;\n"
"  IF n <> 2 THEN RAISE EXCEPTION 'unknown account'; END IF;\n"
"  IF n_frozen > 0 THEN RETURN NULL; END IF;\n"
"  UPDATE idem_demo.accounts SET balance = balance - p_amount\n"
"   WHERE tenant_id = p_tenant AND account_no = p_from;\n"
"  UPDATE idem_demo.accounts SET balance = balance + p_amount\n"
"   WHERE tenant_id = p_tenant AND account_no = p_to;\n"
"  INSERT INTO idem_demo.transfers (tenant_id, task_key, run_id, from_account,\n"
"      to_account, amount, attempt, worker)\n"
"    VALUES (p_tenant, p_task_key, p_run_id, p_from, p_to, p_amount,\n"
"      p_attempt, p_worker) RETURNING id INTO tid;\n"
"  RETURN tid;\n"
"END $f$;\n"
"-- A batch (batch.c) locks every account its effects touch first, in one\n"
"-- global order (tenant, account): batches never deadlock with each other\n"
"-- or with single transfers, which lock their two accounts in that order.\n"
"-- p_invoice[i] is NULL for a transfer; an invoice's accounts are its own.\n"
"CREATE FUNCTION idem_demo.lock_accounts(p_tenant bigint[], p_from int[],\n"
"    p_to int[], p_invoice text[]) RETURNS bigint LANGUAGE sql AS $f$\n"
"  SELECT count(*) FROM (SELECT 1 FROM idem_demo.accounts a\n"
"   WHERE (a.tenant_id, a.account_no) IN (\n"
"       SELECT u.t, v.x FROM unnest(p_tenant, p_from, p_to, p_invoice) u(t, f, o, i),\n"
"         LATERAL (VALUES (u.f), (u.o)) v(x) WHERE u.i IS NULL\n"
"       UNION ALL\n"
"       SELECT i.tenant_id, v.x FROM unnest(p_tenant, p_invoice) u(t, n)\n"
"         JOIN idem_demo.invoices i ON i.tenant_id = u.t AND i.invoice_no = u.n,\n"
"         LATERAL (VALUES (i.payer), (i.merchant)) v(x))\n"
"   ORDER BY a.tenant_id, a.account_no FOR UPDATE) s\n"
"$f$;\n"
"-- Paying an invoice: the transfer payer -> merchant, and the invoice\n"
"-- marked paid (paid_count counts payments: it must end at exactly 1).\n"
"CREATE FUNCTION idem_demo.pay_invoice(p_tenant bigint, p_invoice text,\n"
"    p_run_id text, p_attempt int, p_worker int) RETURNS bigint\n"
"LANGUAGE plpgsql AS $f$\n"
"DECLARE inv idem_demo.invoices; tid bigint;\n"
"BEGIN\n"
"  SELECT * INTO inv FROM idem_demo.invoices\n"
"   WHERE tenant_id = p_tenant AND invoice_no = p_invoice FOR UPDATE;\n"
"  IF NOT FOUND THEN RAISE EXCEPTION 'unknown invoice %', p_invoice; END IF;\n"
"  tid := idem_demo.transfer(p_tenant, 'invoice:' || p_invoice, p_run_id,\n"
"      inv.payer, inv.merchant, inv.amount, p_attempt, p_worker);\n"
"  IF tid IS NOT NULL THEN\n"
"    UPDATE idem_demo.invoices SET paid_count = paid_count + 1,\n"
"        paid_by_run = p_run_id\n"
"     WHERE tenant_id = p_tenant AND invoice_no = p_invoice;\n"
"  END IF;\n"
"  RETURN tid;\n"
"END $f$;\n";

/*
 * On Citus (the extension citus in the database): tenants distributed by
 * id before idem_install, and the demo's tables distributed by tenant_id,
 * co-located with tenants, so that a task's effect is on the worker that
 * holds its tenant's keys.  Citus wants the distribution column in every
 * unique constraint.  The expectations are distributed the same way; the
 * report joins them to the effects by tenant and task.
 */
static const char DEMO_CITUS[] =
"ALTER TABLE idem_demo.transfers DROP CONSTRAINT transfers_pkey,\n"
"  ADD PRIMARY KEY (tenant_id, id);\n"
"ALTER TABLE idem_demo.expected DROP CONSTRAINT expected_pkey,\n"
"  ADD PRIMARY KEY (tenant_id, task_key);\n"
"SELECT create_distributed_table('idem_demo.' || t, 'tenant_id',\n"
"    colocate_with => 'public.tenants')\n"
"  FROM unnest('{accounts,transfers,invoices,expected}'::text[]) t;\n";

/*
 * Extension, ledgers, tenants, the demo's tables and data.  Fills
 * cfg->schema with the extension's (quoted) schema.
 */
int
db_setup(PGconn *conn, demo_config *cfg, const demo_plan *plan, char *err,
		 size_t errlen)
{
	char		sql[2048],
				tenants[256],
				buf[256];
	int			rc,
				i;
	int			citus;
	PGresult   *r;

	if (db_exec(conn, "SET client_min_messages = warning", err, errlen) != 0)
		return -1;
	rc = db_value(conn, "SELECT extname FROM pg_extension WHERE extname = 'citus'",
				  buf, sizeof(buf), err, errlen);
	if (rc < 0)
		return -1;
	citus = rc == 0;
	rc = db_value(conn,
				  "SELECT quote_ident(n.nspname) FROM pg_extension e "
				  "JOIN pg_namespace n ON n.oid = e.extnamespace WHERE e.extname = 'idem'",
				  cfg->schema, sizeof(cfg->schema), err, errlen);
	if (rc < 0)
		return -1;
	if (rc == 1)
	{
		if (db_exec(conn, "CREATE EXTENSION idem", err, errlen) != 0)
			return -1;
		if (db_value(conn,
					 "SELECT quote_ident(n.nspname) FROM pg_extension e "
					 "JOIN pg_namespace n ON n.oid = e.extnamespace WHERE e.extname = 'idem'",
					 cfg->schema, sizeof(cfg->schema), err, errlen) != 0)
			return -1;
	}
	/* the ledgers, created once by idem_install against a tenants table */
	snprintf(sql, sizeof(sql),
			 "SELECT c.confrelid::regclass::text FROM pg_constraint c "
			 "WHERE c.conrelid = to_regclass('%s.idempotency_keys') AND c.contype = 'f' LIMIT 1",
			 cfg->schema);
	rc = db_value(conn, sql, tenants, sizeof(tenants), err, errlen);
	if (rc < 0)
		return -1;
	if (rc == 1)
	{
		snprintf(sql, sizeof(sql),
				 "CREATE TABLE IF NOT EXISTS public.tenants (id bigint PRIMARY KEY, name text NOT NULL DEFAULT '');"
				 "%s"
				 "SELECT %s.idem_install('public.tenants')",
				 citus ? "SELECT create_distributed_table('public.tenants', 'id');" : "",
				 cfg->schema);
		if (db_exec(conn, sql, err, errlen) != 0)
			return -1;
		snprintf(tenants, sizeof(tenants), "public.tenants");
	}
	snprintf(sql, sizeof(sql),
			 "INSERT INTO %s (id) SELECT g FROM generate_series(1, %d) g ON CONFLICT DO NOTHING",
			 tenants, cfg->tenants);
	if (db_exec(conn, sql, err, errlen) != 0)
		return -1;
	if (db_exec(conn, DEMO_SCHEMA, err, errlen) != 0)
		return -1;
	if (citus && db_exec(conn, DEMO_CITUS, err, errlen) != 0)
		return -1;
	if (cfg->notices > 0 && db_exec(conn, DEMO_NOTICES, err, errlen) != 0)
		return -1;
	/*
	 * Citus: the notices (stage two's runs are the coordinator's, on the
	 * platform ledger) in a reference table, which the report joins to
	 * the distributed transfers
	 */
	if (cfg->notices > 0 && citus &&
		db_exec(conn, "SELECT create_reference_table('idem_demo.notices')", err, errlen) != 0)
		return -1;
	cfg->citus = citus;
	snprintf(sql, sizeof(sql),
			 "INSERT INTO idem_demo.accounts (tenant_id, account_no, opening, balance, frozen) "
			 "SELECT t, a, 10000, 10000, t %% 5 = 0 AND a = %d "
			 "FROM generate_series(1, %d) t, generate_series(0, %d) a",
			 cfg->accounts - 1, cfg->tenants, cfg->accounts - 1);
	if (db_exec(conn, sql, err, errlen) != 0)
		return -1;

	/* the expected tasks and the invoices, by COPY */
	r = PQexec(conn, "COPY idem_demo.expected FROM STDIN");
	if (PQresultStatus(r) != PGRES_COPY_IN)
	{
		snprintf(err, errlen, "%s", PQerrorMessage(conn));
		PQclear(r);
		return -1;
	}
	PQclear(r);
	for (i = 0; i < plan->ntasks; i++)
	{
		const demo_task *t = &plan->tasks[i];
		int			len;

		if (t->kind == KIND_PURGE)
			continue;
		len = snprintf(buf, sizeof(buf), "%s\t%s\t%s\t%s\t%lld\t%d\t%d\t%lld\t%s\n",
					   t->task_key, kind_name(t->kind), kind_scope(t->kind),
					   t->id, (long long) t->tenant, t->from, t->to,
					   (long long) t->amount, t->should_apply ? "t" : "f");
		if (PQputCopyData(conn, buf, len) != 1)
			break;
	}
	PQputCopyEnd(conn, NULL);
	r = PQgetResult(conn);
	if (PQresultStatus(r) != PGRES_COMMAND_OK)
	{
		snprintf(err, errlen, "COPY expected: %s", PQerrorMessage(conn));
		PQclear(r);
		return -1;
	}
	PQclear(r);
	while ((r = PQgetResult(conn)) != NULL)
		PQclear(r);
	if (db_exec(conn,
				"INSERT INTO idem_demo.invoices (tenant_id, invoice_no, payer, merchant, amount) "
				"SELECT tenant_id, id, from_account, to_account, amount "
				"FROM idem_demo.expected WHERE kind = 'invoice'", err, errlen) != 0)
		return -1;

	/*
	 * Results from "yesterday" that are past their retention: the work of
	 * maintenance.purge.  Written through the SQL API, 1 ms retention.
	 */
	if (cfg->seed_expired > 0 && citus)
	{
		/*
		 * On Citus only a call of its own is delegated to the tenant's
		 * worker: one claim and one completion per statement.
		 */
		for (i = 1; i <= cfg->seed_expired; i++)
		{
			snprintf(sql, sizeof(sql),
					 "SELECT * FROM %s.idem_claim(%d, %s.idem_key('report.render', 'old-%s-%d'),"
					 " %s.idem_fingerprint('{}'))",
					 cfg->schema, 1 + i % cfg->tenants, cfg->schema, cfg->tag, i, cfg->schema);
			if (db_exec(conn, sql, err, errlen) != 0)
				return -1;
			snprintf(sql, sizeof(sql),
					 "SELECT %s.idem_complete(%d, %s.idem_key('report.render', 'old-%s-%d'),"
					 " '{\"rendered\": true}', '1 millisecond')",
					 cfg->schema, 1 + i % cfg->tenants, cfg->schema, cfg->tag, i);
			if (db_exec(conn, sql, err, errlen) != 0)
				return -1;
		}
	}
	else if (cfg->seed_expired > 0)
	{
		snprintf(sql, sizeof(sql),
				 "DO $d$ DECLARE k bytea; BEGIN\n"
				 "  FOR i IN 1..%d LOOP\n"
				 "    k := %s.idem_key('report.render', 'old-%s-' || i);\n"
				 "    PERFORM %s.idem_claim(1 + i %% %d, k, %s.idem_fingerprint('{}'));\n"
				 "    PERFORM %s.idem_complete(1 + i %% %d, k, '{\"rendered\": true}', '1 millisecond');\n"
				 "  END LOOP; END $d$",
				 cfg->seed_expired, cfg->schema, cfg->tag, cfg->schema,
				 cfg->tenants, cfg->schema, cfg->schema, cfg->tenants);
		if (db_exec(conn, sql, err, errlen) != 0)
			return -1;
	}
	return 0;
}
