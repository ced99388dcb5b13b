/*
 * One delivery of a message, its effect the SQL function charge(jsonb)
 * (README, "One statement"): claim, effect and completion are one statement.
 *   IDEM_PG='host=db dbname=app connect_timeout=2' IDEM_VALKEY=valkey \
 *       ./runner_sql_handler 42 run-1 '{"account": 7, "amount": 5}'
 * Exit status: 0 acknowledge, 75 redeliver later, 65 dead-letter.
 */
#include <stdio.h>
#include <stdlib.h>
#include <idem_client.h>

int
main(int argc, char **argv)
{
    const char *pg = getenv("IDEM_PG");            /* a libpq conninfo */
    const char *valkey = getenv("IDEM_VALKEY");    /* unset: PostgreSQL alone */
    const char *port = getenv("IDEM_VALKEY_PORT"); /* unset: 6379 */
    char *end;
    long long tenant_id;
    idem_runner *r;
    idem_run_options ro;
    idem_result res;
    int rc;

    if (argc != 4) {
        fprintf(stderr, "usage: %s TENANT_ID RUN_ID REQUEST_JSON\n", argv[0]);
        return 2;
    }
    tenant_id = strtoll(argv[1], &end, 10);
    if (*argv[1] == '\0' || *end != '\0') {
        fprintf(stderr, "%s: bad tenant id \"%s\"\n", argv[0], argv[1]);
        return 2;
    }
    r = idem_runner_open(pg ? pg : "connect_timeout=2", valkey,
                         port ? atoi(port) : 6379, NULL); /* either may be down */
    if (r == NULL) {
        fprintf(stderr, "%s: out of memory\n", argv[0]);
        return 75;
    }
    idem_run_options_init(&ro);
    ro.sql_handler = "charge(jsonb)";   /* run by idem_apply; args: the request */
    idem_result_init(&res);
    switch (idem_run_with(r, tenant_id, "billing.charge", argv[2], argv[3],
                          &ro, NULL, NULL, &res)) {
    case IDEM_APPLIED:          /* ran now; res.outcome committed with the effect */
    case IDEM_REPLAYED:         /* ran before; res.outcome is the stored result */
        printf("%s %s\n", idem_status_name(res.status), res.outcome);
        rc = 0;                 /* acknowledge */
        break;
    case IDEM_BUSY:             /* another run holds the key */
        printf("busy: redeliver in %ld ms\n", res.retry_after_ms);
        rc = 75;
        break;
    case IDEM_MISMATCH:         /* the key was used with another request */
    case IDEM_FAILED_PERMANENT: /* charge() raised P0001, class 22 or 23 */
        printf("%s %s\n", idem_status_name(res.status), res.outcome);
        rc = 65;                /* dead-letter */
        break;
    case IDEM_FAILED_RETRYABLE: /* recorded; the next delivery runs attempt + 1 */
        printf("failed_retryable %s\n", res.outcome);
        rc = 75;
        break;
    default:                    /* IDEM_ERROR: nothing decided; redeliver */
        fprintf(stderr, "error: %s\n", res.error_message);
        rc = 75;
        break;
    }
    idem_runner_close(r);
    return rc;
}
