/*
 * One delivery of a message, its effect a C handler in the runner's
 * transaction: charge the account the request names.
 *   IDEM_PG='host=db dbname=app connect_timeout=2' IDEM_VALKEY=valkey \
 *       ./runner_c_handler 42 run-1 '{"account": 7, "amount": 5}'
 * Exit status: 0 acknowledge, 75 redeliver later, 65 dead-letter.
 */
#include <stdio.h>
#include <stdlib.h>
#include <idem_client.h>

static idem_handler_status
charge(PGconn *conn, idem_call *call, void *user_data)
{
    /* inside the run's transaction, after a SAVEPOINT: do the effect */
    const char *params[1] = {idem_call_request(call)};
    PGresult *r = PQexecParams(conn,
        "UPDATE accounts SET balance = balance - ($1::jsonb->>'amount')::int"
        " WHERE id = ($1::jsonb->>'account')::int"
        " RETURNING jsonb_build_object('charged', $1::jsonb->'amount')",
        1, NULL, params, NULL, NULL, 0);
    idem_handler_status st;

    (void) user_data;
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        idem_call_set_json(call, "{\"reason\": \"update failed\"}");
        st = IDEM_HANDLER_RETRYABLE;    /* recorded; a redelivery tries again */
    } else if (PQntuples(r) != 1) {
        idem_call_set_json(call, "{\"reason\": \"no such account\"}");
        st = IDEM_HANDLER_PERMANENT;    /* recorded; every redelivery gets it */
    } else {
        idem_call_set_json(call, PQgetvalue(r, 0, 0)); /* the outcome: a JSON object */
        st = IDEM_HANDLER_OK;
    }
    PQclear(r);
    return st;
}

int
main(int argc, char **argv)
{
    const char *pg = getenv("IDEM_PG");            /* a libpq conninfo */
    const char *valkey = getenv("IDEM_VALKEY");    /* unset: PostgreSQL alone */
    const char *port = getenv("IDEM_VALKEY_PORT"); /* unset: 6379 */
    char *end;
    long long tenant_id;
    idem_options o;
    idem_runner *r;
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
    idem_options_init(&o);
    o.lease_ms = 30000;                 /* longer than the handler ever takes */
    r = idem_runner_open(pg ? pg : "connect_timeout=2", valkey,
                         port ? atoi(port) : 6379, &o); /* either may be down */
    if (r == NULL) {
        fprintf(stderr, "%s: out of memory\n", argv[0]);
        return 75;
    }
    idem_result_init(&res);             /* once; reusable */
    switch (idem_run(r, tenant_id, "billing.charge", argv[2], argv[3],
                     charge, NULL, &res)) {
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
    case IDEM_FAILED_PERMANENT: /* now (res.source == IDEM_SOURCE_HANDLER) or a replay */
        printf("%s %s\n", idem_status_name(res.status), res.outcome);
        rc = 65;                /* dead-letter */
        break;
    case IDEM_FAILED_RETRYABLE: /* recorded; the next delivery runs attempt + 1 */
        printf("failed_retryable %s\n", res.outcome);
        rc = 75;
        break;
    default:                    /* IDEM_ERROR: res.error_code, res.error_message */
        fprintf(stderr, "error: %s\n", res.error_message);
        rc = 75;
        break;
    }
    idem_runner_close(r);
    return rc;
}
