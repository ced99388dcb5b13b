/*
 * cached.c
 *	  idem_cached() and idem_cached_many(): read-only lookups of results in
 *	  Valkey, for a consumer that wants to answer known duplicates before it
 *	  opens a transaction (the demo's batches).  One pipelined GET per node,
 *	  each value's MAC verified (trust.c), no marker written, no PostgreSQL
 *	  round trip; a key not decided here is the caller's to run.
 */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

static int	cached_many_full(idem_runner *r, int n, const int64_t *tenant_ids,
							 const char *const *scopes,
							 const char *const *ids,
							 const char *const *requests, idem_result *out);

/*
 * out is an array of the caller's results: its stride is the caller's
 * sizeof, its struct_size.  Of another size than ours, the lookups fill
 * results of our size, copied back within the caller's.
 */
int
idem_cached_many(idem_runner *r, int n, const int64_t *tenant_ids,
				 const char *const *scopes, const char *const *ids,
				 const char *const *requests, idem_result *out)
{
	size_t		stride;
	idem_result *full;
	int			i,
				decided;

	if (out == NULL || n <= 0 || idemc_result_size_ok(r, &out[0]) != 0)
		return 0;
	stride = out[0].struct_size;
	for (i = 1; i < n; i++)
		if (((idem_result *) ((char *) out + (size_t) i * stride))->struct_size != stride)
			return 0;
	if (stride == sizeof(idem_result))
		return cached_many_full(r, n, tenant_ids, scopes, ids, requests, out);
	full = malloc((size_t) n * sizeof(idem_result));
	if (full == NULL)
		return 0;
	for (i = 0; i < n; i++)
		idem_result_init(&full[i]);
	decided = cached_many_full(r, n, tenant_ids, scopes, ids, requests, full);
	for (i = 0; i < n; i++)
		idemc_result_copy_out((idem_result *) ((char *) out + (size_t) i * stride),
							 &full[i]);
	free(full);
	return decided;
}

static int
cached_many_full(idem_runner *r, int n, const int64_t *tenant_ids,
				 const char *const *scopes, const char *const *ids,
				 const char *const *requests, idem_result *out)
{
	char		err[200];
	char	   *ckeys = NULL;
	const char **keys = NULL;
	uint8_t    *fps = NULL;
	int		   *at = NULL;
	gate_reply *g = NULL;
	int			i,
				m = 0,
				decided = 0,
				checked = 0;

	for (i = 0; i < n; i++)
		idem_result_init(&out[i]);
	if (r == NULL || r->broken || r->gate == NULL || tenant_ids == NULL ||
		scopes == NULL || ids == NULL || requests == NULL ||
		idemc_gate_resting(r->gate))
		return 0;
	if (!idemc_runner_trust_ready(r))
		return 0;
	ckeys = malloc((size_t) n * IDEM_CACHE_KEY_MAX);
	keys = calloc(n, sizeof(char *));
	fps = malloc((size_t) n * IDEM_DIGEST_LEN);
	at = calloc(n, sizeof(int));
	g = calloc(n, sizeof(gate_reply));
	if (ckeys == NULL || keys == NULL || fps == NULL || at == NULL || g == NULL)
		goto done;
	for (i = 0; i < n; i++)
	{
		uint8_t		key[IDEM_DIGEST_LEN];
		char	   *ck = ckeys + (size_t) m * IDEM_CACHE_KEY_MAX;

		if (scopes[i] == NULL || ids[i] == NULL || requests[i] == NULL ||
			idem_key(scopes[i], ids[i], key) != 0 ||
			idem_cache_key(ck, IDEM_CACHE_KEY_MAX, r->trust.keyspace, 0,
						   tenant_ids[i], key) < 0 ||
			idem_fingerprint(requests[i], strlen(requests[i]),
							 fps + (size_t) m * IDEM_DIGEST_LEN,
							 err, sizeof(err)) != 0)
			continue;			/* PostgreSQL will say what is wrong */
		keys[m] = ck;
		at[m++] = i;
	}
	idemc_gate_get_many(r->gate, keys, m, r->trust.owner_key,
					   r->trust.owner_token, g, &checked);
	if (m > 0)
		idemc_health_owner(r, checked);
	if (m > 0 && checked != GATE_CHECK_HOLDS)
		idemc_trust_owner_mismatch(&r->trust, checked);	/* trust none */
	else if (checked == GATE_CHECK_HOLDS)
		idemc_trust_owner_ok(&r->trust);
	for (i = 0; i < m; i++)
	{
		IdemCacheEntry e;
		idem_result *o = &out[at[i]];

		if (g[i].answer != GATE_SKIPPED)
			o->valkey_used = 1; /* the node answered, even "not there" */
		if (g[i].answer == GATE_VALUE && checked == GATE_CHECK_HOLDS &&
			idemc_trust_check(&r->trust, keys[i], g[i].value, g[i].value_len,
							 r->lease_ms, &e) == TRUST_VALUE_OK &&
			e.kind != IDEM_CACHE_MARKER &&
			memcmp(e.fingerprint, fps + (size_t) i * IDEM_DIGEST_LEN,
				   IDEM_DIGEST_LEN) == 0)
		{
			idemc_result_from_cache(o, &e);
			decided++;
		}
		free(g[i].value);
	}
done:
	free(ckeys);
	free(keys);
	free(fps);
	free(at);
	free(g);
	return decided;
}

int
idem_cached(idem_runner *r, int64_t tenant_id, const char *scope,
			const char *id, const char *request_json, idem_result *out)
{
	return idem_cached_many(r, 1, &tenant_id, &scope, &id, &request_json, out);
}
