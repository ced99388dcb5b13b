-- make bench: idem_bench_drain() times the worker emptying its queue, from
-- its first copied result to an empty queue (at most 60 s), and returns
-- '<results copied> <seconds>'.  Called right after the worker is pointed
-- back at a server, with results queued while it was away
-- (bench/commit_latency.pl, bench/cluster.sh).
CREATE OR REPLACE FUNCTION idem_bench_drain() RETURNS text LANGUAGE plpgsql AS $$
DECLARE
	c0 bigint := (SELECT copied FROM idem_stats());
	c_first bigint;
	t_first timestamptz;
	deadline timestamptz := clock_timestamp() + interval '60 s';
BEGIN
	-- from the first copied result ...
	LOOP
		SELECT copied, clock_timestamp() INTO c_first, t_first FROM idem_stats();
		EXIT WHEN c_first > c0 OR clock_timestamp() > deadline;
		PERFORM pg_sleep(0.002);
	END LOOP;
	-- ... to an empty queue
	WHILE (SELECT queue_depth FROM idem_stats()) > 0 AND clock_timestamp() < deadline LOOP
		PERFORM pg_sleep(0.002);
	END LOOP;
	RETURN ((SELECT copied FROM idem_stats()) - c_first) || ' '
		|| extract(epoch FROM clock_timestamp() - t_first);
END $$;
