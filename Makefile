# idem: PGXS build of the extension, plus the project's own entry points.
#
#   make demo    build, install, and run the main job on throwaway servers
#   make test    install what is missing, build, and run every suite
#   make bench   the benchmarks (not part of make test)
#   make clean-test  remove what make test, make demo and make bench keep
#                outside the checkout (/var/tmp/idem-UID-HASH, ~110 MB)
#
# make / make install / make installcheck are the usual PGXS targets;
# installcheck runs the regress, isolation and TAP suites against the
# installed PostgreSQL (as a non-root user, after make install).

EXTENSION = idem
MODULE_big = idem
OBJS = src/idem.o src/shmem.o src/xact.o src/guc.o src/digest.o \
	src/install.o src/ledger.o src/ledger_row.o src/ledger_registry.o src/ledger_probe.o \
	src/ledger_store.o src/ledger_citus.o src/ledger_insert.o \
	src/ledger_batch.o src/ledger_apply.o src/ledger_guard.o src/epoch_renewal.o src/pending.o src/outbox.o src/outbox_launch.o src/outbox_publish.o src/commit_copies.o src/commit_ring.o \
	src/worker.o src/worker_valkey.o src/worker_epoch.o src/worker_encode.o \
	src/worker_durable.o src/worker_drain.o src/worker_report.o src/worker_router.o src/stats.o src/stats_sql.o src/cache_secret.o \
	src/cache_keyspace.o src/cache_cluster.o src/cache_cluster_owner.o src/cache_cluster_seal.o \
	src/cache_cluster_node.o src/cache_cluster_refresh.o src/cache_cluster_naming.o src/cache_sql.o src/standby_slots.o src/citus.o \
	$(COMMON_OBJS)
# src/common/: plain C with no server headers, compiled into both idem.so and
# the client library (client/Makefile), as PostgreSQL's own src/common.
COMMON_OBJS = src/common/cache_format.o src/common/sha256.o \
	src/common/valkey_reply.o src/common/valkey_slots.o src/common/valkey_map.o src/common/valkey_endpoint.o \
	src/common/valkey_node.o src/common/valkey_wire.o src/common/valkey_router.o src/common/valkey_pipeline.o src/common/valkey_single.o
# Install and upgrade scripts, beside idem.control as in contrib.
DATA = $(wildcard idem--*.sql)
PG_CPPFLAGS = -I$(srcdir)/src -I$(srcdir)/src/common
# Export only what PostgreSQL looks up by name (src/compat.h, IDEM_EXPORT);
# PostgreSQL 16+ adds this flag itself.
PG_CFLAGS = -fvisibility=hidden
# libcrypto: the seal of a Citus cluster's cache secrets (AES-256-GCM).
SHLIB_LINK = -lhiredis -lcrypto

# pg_regress suites: sql/NAME.sql against expected/NAME.out, on a throwaway
# instance that preloads idem (test/regress.conf).
REGRESS = install ledger errors security write hot upgrade stats cache batch apply outbox retention deferred roles ddl persistence serverlog \
	attempts lease_purge partition
REGRESS_OPTS = --temp-instance=tmp_check --temp-config=$(srcdir)/test/regress.conf

# Isolation specs: test/isolation/specs/NAME.spec, test/isolation/expected/NAME.out.
ISOLATION = claim_race lease_takeover retry_mismatch repeatable_read purge_skip ledger_changed batch_race reindex serverlog \
	cursor_claim attempts_race
ISOLATION_OPTS = --inputdir=$(srcdir)/test/isolation \
	--temp-instance=tmp_check_iso --temp-config=$(srcdir)/test/regress.conf

# TAP tests: test/t/*.pl (PostgreSQL::Test::Cluster and a real Valkey), with
# their helper modules in test/t (added to PG_PROVE_FLAGS below, after PGXS
# sets it; prove runs in the source directory).  015_standby_slots runs a
# message through the client library, which REGRESS_PREP builds first.
TAP_TESTS = 1
PROVE_TESTS = test/t/*.pl
REGRESS_PREP = client-lib

EXTRA_CLEAN = idem.objs tmp_check tmp_check_iso output_iso results regression.diffs regression.out

PG_CONFIG ?= pg_config
PGXS := $(shell $(PG_CONFIG) --pgxs 2>/dev/null)

ifneq ($(wildcard $(PGXS)),)
include $(PGXS)
PG_PROVE_FLAGS += -I test/t
# What only PostgreSQL 17 and later have (infinite intervals).
ifeq ($(shell test $(VERSION_NUM) -ge 170000 2>/dev/null && echo y),y)
REGRESS += infinite_pg17
endif
# What only PostgreSQL 18 and later have (NOT ENFORCED, virtual columns).
ifeq ($(shell test $(VERSION_NUM) -ge 180000 2>/dev/null && echo y),y)
REGRESS += write_pg18
endif
# PGXS tracks no header dependencies: rebuild every object when a header
# (src/compat.h, say) changes.
$(OBJS): $(wildcard $(srcdir)/src/*.h $(srcdir)/src/common/*.h)
# PGXS declares every target .SECONDARY, and make does not build a missing
# secondary object whose source is older than the library: a file added to
# OBJS but older than idem.so (switching branches, a copy keeping its
# mtime) was neither compiled nor linked.  idem.objs records OBJS and is
# rewritten only when that list changes; the library depends on it, so a
# changed list relinks it, building whatever object is missing.
$(shlib): idem.objs
idem.objs: idem-objs-force
	@echo '$(OBJS)' | cmp -s - $@ || echo '$(OBJS)' >$@
.PHONY: idem-objs-force
idem-objs-force:
# ddl drives its sessions through dblink: without that contrib module
# (PostgreSQL 18 as make test builds it), it cannot run.
ifeq ($(wildcard $(shell $(PG_CONFIG) --sharedir)/extension/dblink.control),)
REGRESS := $(filter-out ddl,$(REGRESS))
endif
else
# No PostgreSQL server headers yet: only the entry points that install them work.
all install installcheck:
	@echo "idem: PostgreSQL 15 server headers (pg_config --pgxs) not found." >&2
	@echo "      run 'make test' as root, or: apt-get install postgresql-15 postgresql-server-dev-15 libpq-dev libhiredis-dev libssl-dev; valkey-server valkey-tools from bookworm-backports" >&2
	@exit 1
endif

# make install also installs the client library (libidemclient.so.1,
# idem_client.h, idemclient.pc) under CLIENT_PREFIX, and runs ldconfig when
# that library directory is one the dynamic linker searches (client/Makefile);
# NO_CLIENT=1 skips it.
CLIENT_PREFIX ?= /usr/local
.PHONY: install-client uninstall-client
ifndef NO_CLIENT
install: install-client
uninstall: uninstall-client
endif
install-client:
	$(MAKE) -C $(srcdir)/client install prefix='$(CLIENT_PREFIX)' PG_CONFIG='$(PG_CONFIG)'
uninstall-client:
	$(MAKE) -C $(srcdir)/client uninstall prefix='$(CLIENT_PREFIX)'

.PHONY: test demo bench clean-test
test:
	@bash test/run

# The checkout's private folder outside it (test/lib/common.sh,
# idem_private_dir): the copies of PostgreSQL 15 and 18 that make test,
# make demo and make bench install idem into.  The next run makes it again.
clean-test:
	@bash -c '. test/lib/common.sh && idem_private_remove "$$PWD"'

demo:
	@bash test/demo

bench:
	@bash bench/run

# What the TAP tests link (REGRESS_PREP of installcheck).
.PHONY: client-lib
client-lib:
	$(MAKE) -C $(srcdir)/client build/libidemclient.a PG_CONFIG=$(PG_CONFIG)

# The two pg_regress-driven suites separately, so one failing does not hide
# the other (test/suites runs both).
.PHONY: installcheck-regress installcheck-isolation
installcheck-regress:
	$(pg_regress_installcheck) $(REGRESS_OPTS) $(REGRESS)

installcheck-isolation:
	$(pg_isolation_regress_installcheck) $(ISOLATION_OPTS) $(ISOLATION)

.PHONY: valgrind
valgrind:
	@bash test/valgrind

# The fuzz suite for longer than make test's minute (FUZZ_SECONDS, 600).
.PHONY: fuzz
fuzz:
	@IDEM_SUITES=fuzz FUZZ_SECONDS=$${FUZZ_SECONDS:-600} bash test/run
