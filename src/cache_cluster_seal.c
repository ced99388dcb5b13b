/*-------------------------------------------------------------------------
 *
 * cache_cluster_seal.c
 *	  The seal of a Citus cluster's cache secrets for one node: how the
 *	  coordinator hands its secrets to a worker node through a statement
 *	  text that the node may log.
 *
 * The node hands the coordinator a fresh one-time 32-byte key in a query
 * result (idem_cache_node).  The coordinator encrypts the secrets under it
 * with OpenSSL's AES-256-GCM and a fresh random 12-byte nonce; the
 * associated data binds the seal to what it is for, so that a seal made
 * for another node, another cluster keyspace or another database does not
 * open:
 *
 *	  "idem cache secrets seal" NUL, the version byte, the node's identity
 *	  NUL, the cluster keyspace NUL, the database's name NUL
 *
 * (C strings hold no NUL, so these fields cannot be confused).  The seal
 * is the version byte (IDEM_SEAL_VERSION), the nonce, the ciphertext of
 * the 72 bytes of secrets, and the 16-byte tag.  A seal of another join
 * (the one-time key was consumed or replaced since) does not open either:
 * a replayed seal is refused.  A seal of idem 0.3 (an HMAC-SHA-256 key
 * stream and tag, 120 bytes) is recognised by its length and refused with
 * IDEM_SEAL_OLD_FORMAT, so that its caller can say why (docs/citus.md,
 * Upgrades).
 *
 * No allocation of ours, no ERROR, no random source: the caller passes the
 * nonce, so that the known-answer tests can too (test/unit/seal.c).
 * OpenSSL's cipher context is freed on every path, and every plaintext
 * copy here is wiped.
 *
 * Locking: none; no state.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <openssl/evp.h>

#include "cache_cluster_seal.h"

#define SEAL_DOMAIN		"idem cache secrets seal"

static void
put32(uint8 *p, int32 v)
{
	p[0] = (uint8) ((uint32) v >> 24);
	p[1] = (uint8) ((uint32) v >> 16);
	p[2] = (uint8) ((uint32) v >> 8);
	p[3] = (uint8) v;
}

static int32
get32(const uint8 *p)
{
	return (int32) (((uint32) p[0] << 24) | ((uint32) p[1] << 16) |
					((uint32) p[2] << 8) | p[3]);
}

/* The associated data (see the header), fed to ctx. */
static bool
seal_aad(EVP_CIPHER_CTX *ctx, bool enc, uint8 version, const IdemSealFor *w)
{
	const void *p[5] = {SEAL_DOMAIN, &version, w->identity, w->keyspace,
	w->database};
	int			len[5] = {sizeof(SEAL_DOMAIN), 1, (int) strlen(w->identity) + 1,
	(int) strlen(w->keyspace) + 1, (int) strlen(w->database) + 1};
	int			n;

	for (int i = 0; i < 5; i++)
		if (!(enc ? EVP_EncryptUpdate(ctx, NULL, &n, p[i], len[i]) :
			  EVP_DecryptUpdate(ctx, NULL, &n, p[i], len[i])))
			return false;
	return true;
}

/*
 * Seal secrets s for what, under key (IDEM_SEAL_KEY_LEN bytes) and nonce
 * (IDEM_SEAL_NONCE_LEN random bytes, never used twice with one key): the
 * IDEM_SEAL_LEN bytes of out.  IDEM_SEAL_OK, or IDEM_SEAL_FAILED.
 */
IdemSealResult
idem_seal_secrets(const uint8 *key, const uint8 *nonce,
				  const IdemCacheSecrets *s, const IdemSealFor *what,
				  uint8 *out)
{
	uint8		plain[IDEM_SEAL_PLAIN_LEN];
	uint8	   *ct = out + 1 + IDEM_SEAL_NONCE_LEN;
	EVP_CIPHER_CTX *ctx;
	int			n = 0;
	int			fin = 0;
	bool		ok;

	ctx = EVP_CIPHER_CTX_new();
	if (ctx == NULL)
		return IDEM_SEAL_FAILED;
	put32(plain, s->current_id);
	memcpy(plain + 4, s->current, IDEM_MAC_LEN);
	put32(plain + 4 + IDEM_MAC_LEN, s->previous_id);
	memcpy(plain + 8 + IDEM_MAC_LEN, s->previous, IDEM_MAC_LEN);
	out[0] = IDEM_SEAL_VERSION;
	memcpy(out + 1, nonce, IDEM_SEAL_NONCE_LEN);
	ok = EVP_EncryptInit_ex(ctx, EVP_aes_256_gcm(), NULL, NULL, NULL) &&
		EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_SET_IVLEN,
							IDEM_SEAL_NONCE_LEN, NULL) &&
		EVP_EncryptInit_ex(ctx, NULL, NULL, key, nonce) &&
		seal_aad(ctx, true, IDEM_SEAL_VERSION, what) &&
		EVP_EncryptUpdate(ctx, ct, &n, plain, IDEM_SEAL_PLAIN_LEN) &&
		EVP_EncryptFinal_ex(ctx, ct + n, &fin) &&
		n + fin == IDEM_SEAL_PLAIN_LEN &&
		EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, IDEM_SEAL_TAG_LEN,
							ct + IDEM_SEAL_PLAIN_LEN);
	EVP_CIPHER_CTX_free(ctx);
	explicit_bzero(plain, sizeof(plain));
	if (!ok)
	{
		explicit_bzero(out, IDEM_SEAL_LEN);
		return IDEM_SEAL_FAILED;
	}
	return IDEM_SEAL_OK;
}

/*
 * Open the len bytes of sealed with key, for what: the secrets into *s
 * (its ids and secrets; the rest zeroed) if IDEM_SEAL_OK.  Otherwise *s is
 * zeroed, and the result says why: not a seal (IDEM_SEAL_MALFORMED), one
 * of idem 0.3 (IDEM_SEAL_OLD_FORMAT), one that does not open with this key
 * for this purpose (IDEM_SEAL_REFUSED: another key, as a replayed seal's,
 * another node, keyspace or database, a changed byte), or OpenSSL failed.
 */
IdemSealResult
idem_seal_open(const uint8 *key, const uint8 *sealed, size_t len,
			   const IdemSealFor *what, IdemCacheSecrets *s)
{
	uint8		plain[IDEM_SEAL_PLAIN_LEN];
	uint8		tag[IDEM_SEAL_TAG_LEN];
	const uint8 *ct = sealed + 1 + IDEM_SEAL_NONCE_LEN;
	EVP_CIPHER_CTX *ctx;
	int			n = 0;
	int			fin = 0;
	int			init;
	int			opened;

	memset(s, 0, sizeof(*s));
	if (len == IDEM_SEAL_V1_LEN)
		return IDEM_SEAL_OLD_FORMAT;
	if (len != IDEM_SEAL_LEN || sealed[0] != IDEM_SEAL_VERSION)
		return IDEM_SEAL_MALFORMED;
	ctx = EVP_CIPHER_CTX_new();
	if (ctx == NULL)
		return IDEM_SEAL_FAILED;
	memcpy(tag, ct + IDEM_SEAL_PLAIN_LEN, IDEM_SEAL_TAG_LEN);
	init = EVP_DecryptInit_ex(ctx, EVP_aes_256_gcm(), NULL, NULL, NULL) &&
		EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_SET_IVLEN,
							IDEM_SEAL_NONCE_LEN, NULL) &&
		EVP_DecryptInit_ex(ctx, NULL, NULL, key, sealed + 1) &&
		seal_aad(ctx, false, sealed[0], what) &&
		EVP_DecryptUpdate(ctx, plain, &n, ct, IDEM_SEAL_PLAIN_LEN) &&
		n == IDEM_SEAL_PLAIN_LEN &&
		EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_SET_TAG, IDEM_SEAL_TAG_LEN,
							tag);
	/* the tag is checked here: nothing of plain is used before */
	opened = init && EVP_DecryptFinal_ex(ctx, plain + n, &fin) > 0;
	EVP_CIPHER_CTX_free(ctx);
	if (opened)
	{
		s->current_id = get32(plain);
		memcpy(s->current, plain + 4, IDEM_MAC_LEN);
		s->previous_id = get32(plain + 4 + IDEM_MAC_LEN);
		memcpy(s->previous, plain + 8 + IDEM_MAC_LEN, IDEM_MAC_LEN);
	}
	explicit_bzero(plain, sizeof(plain));
	if (!init)
		return IDEM_SEAL_FAILED;
	return opened ? IDEM_SEAL_OK : IDEM_SEAL_REFUSED;
}
