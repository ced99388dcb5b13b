\set i random(1, 10000)
SELECT decision, outcome FROM idem_claim(1 + :i % 100, idem_key('bench.replay', :i::text), idem_fingerprint('{"amount": 1}'));
