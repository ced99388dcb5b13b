/*
 * digest.c
 *	  idem_key() and idem_fingerprint(): the same bytes as the SQL functions
 *	  of the same names (see the test vectors in tests/unit.c and the
 *	  differential test in tests/itest.c).
 */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

static void
put_u32be(idem_sha256 *c, size_t n)
{
	uint8_t		b[4];

	b[0] = (uint8_t) (n >> 24);
	b[1] = (uint8_t) (n >> 16);
	b[2] = (uint8_t) (n >> 8);
	b[3] = (uint8_t) n;
	idem_sha256_update(c, b, 4);
}

int
idem_key(const char *task_scope, const char *id, uint8_t out[IDEM_DIGEST_BYTES])
{
	idem_sha256 c;
	size_t		sl,
				il;

	if (task_scope == NULL || id == NULL || out == NULL)
		return -1;
	sl = strlen(task_scope);
	il = strlen(id);
	if (sl > UINT32_MAX || il > UINT32_MAX ||
		!idemc_utf8_valid(task_scope, sl) || !idemc_utf8_valid(id, il))
		return -1;
	idem_sha256_init(&c);
	put_u32be(&c, sl);
	idem_sha256_update(&c, task_scope, sl);
	put_u32be(&c, il);
	idem_sha256_update(&c, id, il);
	idem_sha256_final(&c, out);
	return 0;
}

int
idem_fingerprint(const char *json, size_t len, uint8_t out[IDEM_DIGEST_BYTES],
				 char *errbuf, size_t errbuflen)
{
	size_t		clen;
	char	   *canon;
	idem_sha256 c;

	if (out == NULL)
	{
		idemc_set_err(errbuf, errbuflen, "output buffer is NULL");
		return -1;
	}
	canon = idem_json_canonical(json, len, &clen, errbuf, errbuflen);
	if (canon == NULL)
		return -1;
	idem_sha256_init(&c);
	idem_sha256_update(&c, canon, clen);
	idem_sha256_final(&c, out);
	free(canon);
	return 0;
}
