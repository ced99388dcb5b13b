\set t random(1, 100)
\set run random(1, 9000000000000000000)
\set amt random(1, 1000)
SELECT v1_effect(:t, :run, :amt);
