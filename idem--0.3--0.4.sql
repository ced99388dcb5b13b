-- idem 0.3 -> 0.4.  A fresh install runs 0.1, 0.1 -> 0.2, 0.2 -> 0.3, then
-- this script.

\echo Use "ALTER EXTENSION idem UPDATE TO '0.4'" to load this file. \quit
