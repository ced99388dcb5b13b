/*-------------------------------------------------------------------------
 *
 * digest.c
 *	  The SHA-256 helpers: idem_key(scope, id) and idem_fingerprint(request).
 *
 *	  idem_key      = SHA-256( be32(len(scope)) || scope || be32(len(id)) || id )
 *	  idem_fingerprint = SHA-256( jsonb text of the request )
 *
 *	  Lengths are byte lengths of the strings in UTF-8, the only database
 *	  encoding idem accepts (idem_require_utf8): the clients hash UTF-8, and
 *	  one message must have one key whoever computes it.  The length
 *	  prefixes make the encoding of the pair unambiguous: ('ab', 'c') and
 *	  ('a', 'bc') hash differently.  The client helper computes the same
 *	  bytes; the README lists shared test vectors.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "common/cryptohash.h"
#include "common/sha2.h"
#include "mb/pg_wchar.h"
#include "utils/builtins.h"
#include "utils/jsonb.h"

#include "digest.h"
#include "cache_format.h"
#include "compat.h"
#include "sql_args.h"

PG_FUNCTION_INFO_V1(idem_key);
PG_FUNCTION_INFO_V1(idem_fingerprint);

/*
 * A SHA-256 in progress, on PostgreSQL's own implementation: the
 * cryptohash API (which may use OpenSSL).
 */
typedef struct IdemSha256
{
	pg_cryptohash_ctx *ctx;
} IdemSha256;

static void
sha256_begin(IdemSha256 *h)
{
	h->ctx = pg_cryptohash_create(PG_SHA256);
	if (h->ctx == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_OUT_OF_MEMORY),
				 errmsg("out of memory")));
	if (pg_cryptohash_init(h->ctx) < 0)
		elog(ERROR, "could not initialize SHA-256 context");
}

static void
sha256_update(IdemSha256 *h, const void *data, size_t len)
{
	if (pg_cryptohash_update(h->ctx, (const uint8 *) data, len) < 0)
		elog(ERROR, "could not update SHA-256 context");
}

/*
 * A digest as a bytea: in buf, or palloc'd when buf is NULL.  With a NULL
 * digest the bytes are left for the caller to fill.  The one place that
 * builds the 32-byte bytea of keys and fingerprints.
 */
bytea *
idem_digest_bytea(const uint8 *digest, IdemDigestBytea *buf)
{
	bytea	   *b = buf ? (bytea *) buf->bytes : (bytea *) palloc(VARHDRSZ + IDEM_DIGEST_LEN);

	SET_VARSIZE(b, VARHDRSZ + IDEM_DIGEST_LEN);
	if (digest)
		memcpy(VARDATA(b), digest, IDEM_DIGEST_LEN);
	return b;
}

StaticAssertDecl(PG_SHA256_DIGEST_LENGTH == IDEM_DIGEST_LEN,
				 "keys and fingerprints are SHA-256 digests");

static bytea *
sha256_finish(IdemSha256 *h)
{
	bytea	   *result = idem_digest_bytea(NULL, NULL);

	if (pg_cryptohash_final(h->ctx, (uint8 *) VARDATA(result),
							PG_SHA256_DIGEST_LENGTH) < 0)
		elog(ERROR, "could not finalize SHA-256 context");
	pg_cryptohash_free(h->ctx);
	return result;
}

static void
sha256_update_prefixed(IdemSha256 *h, const text *t)
{
	uint32		len = VARSIZE_ANY_EXHDR(t);
	uint8		be[4];

	be[0] = (uint8) (len >> 24);
	be[1] = (uint8) (len >> 16);
	be[2] = (uint8) (len >> 8);
	be[3] = (uint8) len;
	sha256_update(h, be, sizeof(be));
	sha256_update(h, VARDATA_ANY(t), len);
}

/* A key or fingerprint given as an argument: exactly IDEM_DIGEST_LEN bytes. */
void
idem_digest_check(const bytea *d, const char *name, uint8 *out)
{
	if (VARSIZE_ANY_EXHDR(d) != IDEM_DIGEST_LEN)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must be %d bytes, not %d",
						name, IDEM_DIGEST_LEN, (int) VARSIZE_ANY_EXHDR(d)),
				 errhint("Derive keys with idem_key(scope, id) and fingerprints with idem_fingerprint(request).")));
	memcpy(out, VARDATA_ANY(d), IDEM_DIGEST_LEN);
}

/*
 * Refuse a database whose encoding is not UTF-8: there idem_key() and
 * idem_fingerprint() would hash other bytes than the clients, and one
 * message would have two keys.  Called by idem_install() and the digests
 * (CREATE EXTENSION refuses such a database in its script).
 */
void
idem_require_utf8(void)
{
	if (GetDatabaseEncoding() != PG_UTF8)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("idem requires a database with encoding UTF8, not %s",
						GetDatabaseEncodingName()),
				 errdetail("Keys and fingerprints are hashes of UTF-8 text, as every client computes them."),
				 errhint("Create the database with ENCODING 'UTF8' (CREATE DATABASE ... TEMPLATE template0 ENCODING 'UTF8').")));
}

/* idem_key(scope text, id text) RETURNS bytea */
Datum
idem_key(PG_FUNCTION_ARGS)
{
	IdemSha256	h;

	idem_require_utf8();
	idem_require_arg(fcinfo, 0, "scope");
	idem_require_arg(fcinfo, 1, "id");
	sha256_begin(&h);
	sha256_update_prefixed(&h, PG_GETARG_TEXT_PP(0));
	sha256_update_prefixed(&h, PG_GETARG_TEXT_PP(1));
	PG_RETURN_BYTEA_P(sha256_finish(&h));
}

/* idem_fingerprint(request jsonb) RETURNS bytea */
Datum
idem_fingerprint(PG_FUNCTION_ARGS)
{
	Jsonb	   *jb;
	char	   *canonical;
	IdemSha256	h;

	idem_require_utf8();
	idem_require_arg(fcinfo, 0, "request");
	jb = PG_GETARG_JSONB_P(0);
	canonical = JsonbToCString(NULL, &jb->root, VARSIZE(jb));
	sha256_begin(&h);
	sha256_update(&h, canonical, strlen(canonical));
	PG_RETURN_BYTEA_P(sha256_finish(&h));
}
