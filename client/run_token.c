/*
 * run_token.c
 *	  The marker's token: unique among the runs of all runners, as the
 *	  compare-and-delete needs; a random base per runner (drawn again in a
 *	  forked child) and the run's counter, no system call per run.
 */
#include "run.h"

#include <fcntl.h>
#include <pthread.h>
#include <string.h>
#include <unistd.h>
#include <sys/random.h>

/* Forks since the library was loaded, + 1: a child draws a new token base. */
static volatile uint64_t fork_gen = 1;
static pthread_once_t fork_hook_once = PTHREAD_ONCE_INIT;

static void
fork_child(void)
{
	fork_gen++;
}

static void
fork_hook(void)
{
	(void) pthread_atfork(NULL, NULL, fork_child);
}

/* 16 random bytes; never fails. */
static void
random_bytes(idem_runner *r, uint8_t tok[IDEM_TOKEN_LEN])
{
	ssize_t		got = getrandom(tok, IDEM_TOKEN_LEN, GRND_NONBLOCK);

	if (got != IDEM_TOKEN_LEN)
	{
		int			fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);

		got = fd >= 0 ? read(fd, tok, IDEM_TOKEN_LEN) : -1;
		if (fd >= 0)
			close(fd);
	}
	if (got != IDEM_TOKEN_LEN)
	{
		/* last resort: unique per runner and process, still unguessable
		 * enough for a compare-and-delete token */
		idem_sha256 c;
		uint8_t		d[32];
		struct
		{
			int64_t		t;
			int64_t		wall;
			pid_t		pid;
			const void *self;
		}			seed;

		seed.t = idemc_now_ms();
		seed.wall = idemc_wall_ms();
		seed.pid = getpid();
		seed.self = r;
		idem_sha256_init(&c);
		idem_sha256_update(&c, &seed, sizeof(seed));
		idem_sha256_final(&c, d);
		memcpy(tok, d, IDEM_TOKEN_LEN);
	}
}

/*
 * The marker's token: unique among the runs of all runners (what the
 * compare-and-delete needs).  A random base, drawn once per runner (and
 * again in a forked child), with the run's counter in its last 8 bytes: no
 * system call per run.
 */
void
idemc_run_token(idem_runner *r, uint8_t tok[IDEM_TOKEN_LEN])
{
	uint64_t	n;
	int			i;

	if (r->token_fork_gen != fork_gen)
	{
		(void) pthread_once(&fork_hook_once, fork_hook);
		random_bytes(r, r->token_base);
		r->token_counter = 0;
		r->token_fork_gen = fork_gen;
	}
	n = ++r->token_counter;
	memcpy(tok, r->token_base, IDEM_TOKEN_LEN);
	for (i = 0; i < 8; i++)
		tok[IDEM_TOKEN_LEN - 1 - i] ^= (uint8_t) (n >> (8 * i));
}
