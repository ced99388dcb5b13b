/*
 * ######################################################################
 * ##  DELIBERATELY BROKEN VARIANT -- NOT THE PROTOCOL.  check.sh       ##
 * ##  requires spin to REJECT it with a counterexample.               ##
 * ######################################################################
 *
 * broken_copy_before_flush.pml -- the cache design before issue 12:
 *   1. the background worker copies a terminal value as soon as the
 *      commit callback queues it, before its WAL is flushed
 *      (COPY_AT_COMMIT);
 *   2. the runner SETs its own terminal result after COMMIT, and every
 *      replay it reads from PostgreSQL (CLIENT_SETS_TERMINAL);
 *   3. one keyspace for the server, whatever its timeline
 *      (NS_WITHOUT_TIMELINE).
 * Compiled with -DDURABILITY (commits may return before their flush; a
 * crash loses unflushed commits), spin finds: a commit returns, its value
 * reaches Valkey, the server crashes before the flush, the row and the
 * effect are gone while Valkey keeps the result (invariant: a cached
 * terminal value is the committed one), so every later delivery would
 * replay it and the effect would never be applied.
 *
 * To show which part of the old design is at fault, one part at a time:
 *   -DONLY_COPY_AT_COMMIT   only 1 (the client writes markers only):
 *                           rejected -- the worker must wait for the flush;
 *   -DONLY_CLIENT_SETS      only 2 (the worker waits for the flush):
 *                           rejected -- a client cannot know its commit is
 *                           durable (synchronous_commit is per session);
 *   -DONLY_NS_WITHOUT_TIMELINE with -DFAILOVER -DRELEARN_AT_GATE: only 3:
 *                           rejected -- a promoted asynchronous standby
 *                           lacks a copied commit, the shared keyspace
 *                           still has it.
 */
#if !defined(ONLY_CLIENT_SETS) && !defined(ONLY_NS_WITHOUT_TIMELINE)
#define COPY_AT_COMMIT
#endif
#if !defined(ONLY_COPY_AT_COMMIT) && !defined(ONLY_NS_WITHOUT_TIMELINE)
#define CLIENT_SETS_TERMINAL
#endif
#if !defined(ONLY_COPY_AT_COMMIT) && !defined(ONLY_CLIENT_SETS)
#define NS_WITHOUT_TIMELINE
#endif
#include "common.pml"
#include "procs.pml"
