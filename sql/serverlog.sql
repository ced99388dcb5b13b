-- Runs last: no backend of this suite crashed, failed an assertion or
-- panicked (a crash restarts the server and can hide behind a passing test).
WITH f AS (SELECT current_setting('data_directory') || p AS path
             FROM unnest(ARRAY['/../../log/postmaster.log', '/../../output_iso/log/postmaster.log']) AS p
            WHERE (pg_stat_file(current_setting('data_directory') || p, true)).size IS NOT NULL)
SELECT (SELECT count(*) FROM f) > 0 AS log_read,
       (SELECT count(*) FROM f, regexp_split_to_table(pg_read_file(f.path), E'\n') AS l
         WHERE l ~ '(TRAP:|PANIC:|terminated by signal|was terminated by exception)') AS crashes;
