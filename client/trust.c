/*
 * trust.c
 *	  What the client trusts in Valkey (issue 12: Valkey may only make
 *	  things faster, never change an outcome).
 *
 *	  - The keyspace (<prefix><system id>.<timeline>.<epoch>.<database
 *		oid>:, src/common/cache_format.h) and
 *		the secrets are learnt from the PostgreSQL server the runner is
 *		connected to, with idem_cache_keyspace() and idem_cache_secrets()
 *		in one pipeline on each new connection (never guessed), again
 *		when a value names an unknown key id (at most once a second), and
 *		at least every secrets_max_age_ms (idem_options, at most
 *		IDEM_SECRETS_MAX_AGE_MAX_MS: idemc_trust_max_age): a secret rotated
 *		out on the server (two rotations, as after a leak) stops verifying
 *		here within that time, even on a connection that never meets a new
 *		key id, and so does an epoch the server left while it could not
 *		reach Valkey to retire it.
 *	  - The history epoch's owner key and the token it holds while the
 *		server owns the epoch are learnt with the secrets.  Every lookup
 *		reads the owner key in the same round trip (gate.c), and a value is
 *		trusted only if it held that token: a server that replaced its
 *		epoch (a restart after a crash, a restore, a promotion, ledger rows
 *		removed) retires the old one's owner key, so a runner that learnt
 *		the old epoch (behind a pooler that kept its connection) stops
 *		replaying from it at its next lookup.  On a mismatch nothing read
 *		in that round trip is trusted, PostgreSQL decides, and the runner
 *		learns again; if the key held another value (the epoch was retired
 *		or taken over), the cache is not used until it has (at once, then
 *		at most once a second); if it held nothing (Valkey lost it, and the
 *		server's worker sets it again), later lookups check it as usual.
 *	  - Every value read is parsed (src/common/cache_format.h) and its MAC
 *		checked (HMAC-SHA-256 over <key> 0x00 <rest>, sha256.c) with the
 *		secret of its key id; anything that fails, an idem1 value, an
 *		expired terminal value, or a marker whose deadline is past or
 *		further away than our own lease (+ 1 s of clock skew) is ignored
 *		and counted: PostgreSQL decides.
 *	  - The only value the client writes is its processing marker, MACed
 *		with the current secret.
 *	  - A role without EXECUTE on those functions (42501), or a server
 *		whose extension predates them (42883), runs without the cache.
 *		A server whose cache is not ready (55000: in recovery, or its
 *		worker has not yet taken its history epoch over in Valkey) is
 *		asked again a second later; meanwhile PostgreSQL decides alone.
 *
 *	  One idem_trust per runner; used by one thread at a time, as the runner.
 */
#include "internal.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Wall-clock milliseconds (the epoch of expires_ms). */
int64_t
idemc_wall_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_REALTIME, &ts);
	return (int64_t) ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void
idemc_trust_init(idem_trust *t)
{
	memset(t, 0, sizeof(*t));
	t->state = TRUST_UNKNOWN;
}

/* Forget the secrets' key material (on close). */
void
idemc_trust_clear(idem_trust *t)
{
	memset(t->keys, 0, sizeof(t->keys));
	t->nkeys = 0;
	t->state = TRUST_UNKNOWN;
}

/* "\x0a1b..." (bytea text output, hex format) of 32 bytes. */
static int
bytea_hex32(const char *txt, uint8_t out[IDEM_MAC_LEN])
{
	if (txt == NULL || strlen(txt) != 2 + 2 * IDEM_MAC_LEN ||
		txt[0] != '\\' || txt[1] != 'x')
		return -1;
	return idem_cache_unhex(out, txt + 2, IDEM_MAC_LEN);
}

/*
 * The re-learn bound a runner uses for the option secrets_max_age_ms: the
 * default for a negative value, the maximum for 0 or anything above it.
 * It is the last line of defence: while the server cannot reach Valkey to
 * retire an epoch it left, a runner that learnt that epoch trusts it until
 * it learns again.
 */
int
idemc_trust_max_age(int option_ms)
{
	if (option_ms < 0)
		return 5000;
	if (option_ms == 0 || option_ms > IDEM_SECRETS_MAX_AGE_MAX_MS)
		return IDEM_SECRETS_MAX_AGE_MAX_MS;
	return option_ms;
}

/*
 * Does the runner need to (re)learn before using Valkey: a new connection
 * since the last time, an unknown key id met more than a second ago, or
 * secrets learnt max_age_ms ago or more.
 */
int
idemc_trust_stale(const idem_trust *t, const idem_pg *pg)
{
	int64_t		age;

	if (t->state == TRUST_UNKNOWN || t->learnt_at_connect != pg->connects)
		return 1;
	age = idemc_now_ms() - t->learnt_ms;
	return (t->refresh_wanted &&
			(age >= 1000 || (t->owner_suspect && !t->owner_relearnt))) ||
		(t->state == TRUST_READY && age >= t->max_age_ms);
}

/*
 * The owner key and token of row row of idem_cache_secrets() into t: both
 * present, the token 16 lower-case hex digits, and the key that of the
 * keyspace's epoch (the keyspace minus ".<database oid>:" is the key minus
 * ":owner").  0, or -1 when not.
 */
static int
owner_of(idem_trust *t, const PGresult *r, int row)
{
	const char *key;
	const char *tok;
	size_t		klen;

	if (PQnfields(r) < 5 || PQgetisnull(r, row, 3) || PQgetisnull(r, row, 4))
		return -1;
	key = PQgetvalue(r, row, 3);
	tok = PQgetvalue(r, row, 4);
	klen = strlen(key);
	if (klen >= sizeof(t->owner_key) || klen <= 6 ||
		strcmp(key + klen - 6, ":owner") != 0 ||
		strncmp(t->keyspace, key, klen - 6) != 0 ||
		t->keyspace[klen - 6] != '.' ||
		strlen(tok) != IDEM_CACHE_EPOCH_TOKEN_LEN ||
		strspn(tok, "0123456789abcdef") != IDEM_CACHE_EPOCH_TOKEN_LEN)
		return -1;
	memcpy(t->owner_key, key, klen + 1);
	memcpy(t->owner_token, tok, IDEM_CACHE_EPOCH_TOKEN_LEN + 1);
	return 0;
}

void
idemc_trust_owner_mismatch(idem_trust *t, int checked)
{
	t->owner_mismatches++;
	t->refresh_wanted = 1;
	/* absent: Valkey lost it (its worker sets it again), or no reply */
	if (checked == GATE_CHECK_OTHER)
		t->owner_suspect = 1;
}

void
idemc_trust_owner_ok(idem_trust *t)
{
	t->owner_relearnt = 0;
}

/*
 * Learn the keyspace and the secrets on pg's connection (connected, idle):
 * one round trip.  Returns the new state.  TRUST_DENIED when the role may
 * not execute the functions or they do not exist (*msg says which);
 * TRUST_UNKNOWN when the connection failed (try again on the next run).
 */
trust_state
idemc_trust_learn(idem_trust *t, idem_pg *pg, char *msg, size_t msglen)
{
	pg_cmd		cmds[2];
	pg_outcome	o;
	int			i;
	int			owner_row = -1;

	memset(cmds, 0, sizeof(cmds));
	cmds[0].sql = pg->sql[STMT_KEYSPACE];
	cmds[1].sql = pg->sql[STMT_SECRETS];
	idemc_pg_pipeline(pg, cmds, 2, &o);
	t->learnt_ms = idemc_now_ms();
	t->refresh_wanted = 0;
	t->owner_relearnt = t->owner_suspect;
	t->owner_suspect = 0;
	if (o.rc == PG_CONN_LOST)
	{
		idemc_pg_outcome_clear(&o);
		t->state = TRUST_UNKNOWN;
		return t->state;
	}
	t->learnt_at_connect = pg->connects;
	if (o.rc == PG_SERVER_ERROR)
	{
		if (strcmp(o.sqlstate, "42501") == 0)
			idemc_set_err(msg, msglen,
						 "the role may not execute idem_cache_keyspace() and idem_cache_secrets() (GRANT EXECUTE on them to it): running without the Valkey cache, on PostgreSQL only");
		else if (strcmp(o.sqlstate, "42883") == 0)
			idemc_set_err(msg, msglen,
						 "the idem extension has no idem_cache_secrets() (ALTER EXTENSION idem UPDATE): running without the Valkey cache, on PostgreSQL only");
		else if (strcmp(o.sqlstate, "55000") == 0)
			idemc_set_err(msg, msglen,
						 "the server's Valkey cache is not ready (%s): running on PostgreSQL only, asking again in a second",
						 o.message);
		else
			idemc_set_err(msg, msglen,
						 "learning the cache keyspace failed (%s): running without the Valkey cache on this connection",
						 o.message);
		{
			/*
			 * 55000: not now (recovery, or the server's worker has not yet
			 * taken its history epoch over in Valkey since it started or the
			 * epoch changed): ask again, at most once a second.
			 */
			int			again = strcmp(o.sqlstate, "55000") == 0;

			idemc_pg_outcome_clear(&o);
			idemc_trust_clear(t);
			t->state = TRUST_DENIED;
			t->refresh_wanted = again;
		}
		return t->state;
	}
	/* the keyspace */
	{
		PGresult   *r = o.res[0];
		const char *ks;

		if (PQntuples(r) != 1 || PQgetisnull(r, 0, 0) ||
			strlen(ks = PQgetvalue(r, 0, 0)) > IDEM_CACHE_KEYSPACE_MAX)
		{
			idemc_set_err(msg, msglen, "idem_cache_keyspace() returned no usable keyspace: running without the Valkey cache on this connection");
			idemc_pg_outcome_clear(&o);
			idemc_trust_clear(t);
			t->state = TRUST_DENIED;
			return t->state;
		}
		snprintf(t->keyspace, sizeof(t->keyspace), "%s", ks);
	}
	/* the secrets */
	t->nkeys = 0;
	t->current = -1;
	for (i = 0; i < PQntuples(o.res[1]) && t->nkeys < IDEM_TRUST_MAX_KEYS; i++)
	{
		PGresult   *r = o.res[1];
		uint8_t		secret[IDEM_MAC_LEN];
		long		id;

		if (PQgetisnull(r, i, 0) || PQgetisnull(r, i, 1) ||
			bytea_hex32(PQgetvalue(r, i, 1), secret) != 0)
			continue;
		id = strtol(PQgetvalue(r, i, 0), NULL, 10);
		if (id <= 0 || id > IDEM_CACHE_KEY_ID_MAX)
			continue;
		t->keys[t->nkeys].key_id = (int32_t) id;
		idem_hmac_key(&t->keys[t->nkeys].hmac, secret, sizeof(secret));
		memset(secret, 0, sizeof(secret));
		if (!PQgetisnull(r, i, 2) && PQgetvalue(r, i, 2)[0] == 't')
		{
			t->current = t->nkeys;
			owner_row = i;
		}
		t->nkeys++;
	}
	if (owner_row >= 0 && owner_of(t, o.res[1], owner_row) != 0)
	{
		/* not taken over yet, or the keyspace is of another epoch: soon */
		idemc_set_err(msg, msglen, "the server's Valkey cache is not ready (its worker has not taken the history epoch over): running on PostgreSQL only, asking again in a second");
		idemc_pg_outcome_clear(&o);
		idemc_trust_clear(t);
		t->state = TRUST_DENIED;
		t->refresh_wanted = 1;
		return t->state;
	}
	idemc_pg_outcome_clear(&o);
	if (t->current < 0)
	{
		idemc_set_err(msg, msglen, "idem_cache_secrets() returned no current secret: running without the Valkey cache on this connection");
		idemc_trust_clear(t);
		t->state = TRUST_DENIED;
		return t->state;
	}
	t->state = TRUST_READY;
	return t->state;
}

static const idem_hmac *
secret_of(idem_trust *t, int32_t key_id)
{
	int			i;

	for (i = 0; i < t->nkeys; i++)
		if (t->keys[i].key_id == key_id)
			return &t->keys[i].hmac;
	return NULL;
}

/* MAC of value (its rest) under key, with h. */
static int
mac_of(const idem_hmac *h, const char *key, size_t keylen,
	   const char *value, size_t len, uint8_t mac[IDEM_MAC_LEN])
{
	char		input[IDEM_CACHE_MAC_INPUT_MAX];
	int			n = idem_cache_mac_input(input, sizeof(input), key, keylen,
										 value, len);

	if (n < 0)
		return -1;
	idem_hmac_sha256(h, input, (size_t) n, mac);
	return 0;
}

/*
 * Check a value read from Valkey under key.  TRUST_VALUE_OK fills *e (its
 * pointers point into value); anything else means: ignore the value
 * (counted in t->rejected, except an expired one), PostgreSQL decides.
 * lease_ms is this runner's lease: a marker may not claim longer.
 */
trust_verdict
idemc_trust_check(idem_trust *t, const char *key, const char *value,
				 size_t len, int lease_ms, IdemCacheEntry *e)
{
	const idem_hmac *h;
	uint8_t		mac[IDEM_MAC_LEN];
	int64_t		now;

	if (t->state != TRUST_READY)
		return TRUST_VALUE_BAD;
	if (idem_cache_parse(value, len, e) != 0)
	{
		t->rejected++;
		return TRUST_VALUE_BAD;
	}
	h = secret_of(t, e->key_id);
	if (h == NULL)
	{
		/* perhaps rotated since we learnt: re-learn, at most once a second */
		t->refresh_wanted = 1;
		t->rejected++;
		return TRUST_VALUE_BAD;
	}
	if (mac_of(h, key, strlen(key), value, len, mac) != 0 ||
		!idem_cache_mac_equal(mac, e->mac))
	{
		t->rejected++;
		return TRUST_VALUE_BAD;
	}
	now = idemc_wall_ms();
	if (e->kind == IDEM_CACHE_MARKER)
	{
		/* never busy past a lease: ours bounds what we honour */
		if (e->expires_ms <= now ||
			e->expires_ms > now + (int64_t) lease_ms + 1000)
		{
			if (e->expires_ms > now)
				t->rejected++;
			return TRUST_VALUE_EXPIRED;
		}
		return TRUST_VALUE_OK;
	}
	if (e->expires_ms <= now)
		return TRUST_VALUE_EXPIRED;
	return TRUST_VALUE_OK;
}

/*
 * Our processing marker for key: deadline now + lease_ms, token, MACed with
 * the current secret.  Returns its length, or -1 (no trust, short buffer).
 */
int
idemc_trust_marker(idem_trust *t, const char *key, int lease_ms,
				  const uint8_t token[IDEM_TOKEN_LEN], char *buf,
				  size_t buflen)
{
	uint8_t		mac[IDEM_MAC_LEN];
	int			n;

	if (t->state != TRUST_READY)
		return -1;
	n = idem_cache_encode_lease_marker(buf, buflen,
									   t->keys[t->current].key_id,
									   idemc_wall_ms() + lease_ms, token);
	if (n < 0 ||
		mac_of(&t->keys[t->current].hmac, key, strlen(key), buf, (size_t) n,
			   mac) != 0)
		return -1;
	idem_cache_set_mac(buf, mac);
	return n;
}
