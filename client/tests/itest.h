/* itest.h: helpers shared by the client's integration tests. */
#ifndef IDEM_ITEST_H
#define IDEM_ITEST_H

#include <stdint.h>
#include <libpq-fe.h>
#include <hiredis/hiredis.h>

#include "idem_client.h"

/* From the environment that tests/run.sh sets. */
typedef struct itest_env
{
	const char *pg;				/* conninfo of the test database */
	const char *pg_admin;		/* conninfo of database postgres */
	const char *pg_host;
	int			pg_port;
	const char *dbname;
	int			valkey_port;
	const char *valkey_start;	/* shell command: start the RESP server */
	const char *valkey_pidfile;
	const char *pg_crash;		/* shell command: kill -9 PostgreSQL's
								 * processes, then start it (recovery) */
	int			slow;			/* under valgrind: fewer iterations */
	const char *suffix;			/* appended to task scopes: one pass's keys
								 * never meet another's */
} itest_env;

extern itest_env E;

void		itest_env_load(void);
int			tap_ok_ext(int cond, const char *fmt,...) __attribute__((format(printf, 2, 3)));
void		tap_diag_ext(const char *fmt,...) __attribute__((format(printf, 1, 2)));
void		tap_skip_ext(const char *fmt,...) __attribute__((format(printf, 1, 2)));
int			tap_finish(void);

PGconn	   *pg_open(const char *conninfo);
/* Run SQL with text params; returns the first column of the first row as a
 * malloc'd string, or NULL (no row, NULL value, or error: *err set). */
char	   *pg_val(PGconn *c, const char *sql, int n, const char *const *params);
long long	pg_int(PGconn *c, const char *sql, int n, const char *const *params);
int			pg_ok(PGconn *c, const char *sql);

redisContext *rv_open(void);
redisReply *rv(redisContext *c, const char *fmt,...);
/* GET key: malloc'd value or NULL */
char	   *rv_get(const char *key);
long long	rv_pttl(const char *key);
int			rv_cmd_ok(const char *fmt,...);

pid_t		valkey_pid(void);
int			valkey_kill(int sig);
int			valkey_start(void);

/* Valkey keys in the server's keyspace (idem_cache_keyspace()), and in the
 * single "idem:" namespace of the versions before 0.3. */
const char *test_keyspace(void);
void		cache_key_of(char *buf, size_t n, int platform, int64_t tenant,
						 const char *scope, const char *id);
void		old_cache_key_of(char *buf, size_t n, int platform, int64_t tenant,
							 const char *scope, const char *id);
/* Authentic idem2 values, MACed with the server's current secret. */
int			authentic_terminal(char *buf, size_t buflen, const char *key,
							   int completed, int attempt, const uint8_t fp[32],
							   const char *outcome, int64_t expires_ms);
int			authentic_marker(char *buf, size_t buflen, const char *key,
							 int64_t expires_ms);
/* Write the copy of a committed terminal row that the worker writes. */
int			worker_copy(int platform, int64_t tenant, const char *scope,
						const char *id);
int			worker_writes_idem2(void);
int			worker_copies_within(int ms);
void		await_worker_settled(int ms);
void		await_worker_copy(const char *key, const char *not_this, int ms);
int64_t		wall_ms(void);
void		sleep_ms(int ms);
/* Until the epoch owner key holds a token again (the worker sets it after
 * Valkey lost it), at most 10 s. */
void		wait_owner_key(void);
int64_t		now_ms(void);

/* Loopback TCP for the tests' proxies: a listener on a free port, a
 * connection; -1 on failure. */
int			itest_listen_loopback(int backlog, int *port);
int			itest_connect_loopback(int port);

int			contention_main(int argc, char **argv);
int			trust_main(int argc, char **argv);
int			router_main(int argc, char **argv);
int			honesty_main(int argc, char **argv);
int			health_main(int argc, char **argv);
int			consume_main(int argc, char **argv);

#endif
