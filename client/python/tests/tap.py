"""Run the package's tests (unittest) and print one TAP line per test:
"ok N - module: test's first docstring line" or "not ok N - ...", the
failure's traceback after it as TAP diagnostics ("# " lines on stdout, which
the suites print whole, however long the servers' logs after them).  Exit status 1 on any failure.

    python3 tap.py [--first N] [module...]

Without modules: test_unit, then test_server, test_health, test_forms, test_defaults,
test_aio, test_consume, test_pooler, test_cluster, test_rabbitmq and test_epoch (last:
it gives the server a new cache epoch) when IDEM_PG_DSN is set."""
import os
import sys
import traceback
import unittest


class TapResult(unittest.TestResult):
    def __init__(self, first):
        super().__init__()
        self.n = first - 1
        self.bad = 0

    def _name(self, test):
        # a module's or class's setUp/tearDown that fails is reported as an
        # _ErrorHolder, which has a description but no test method
        if not hasattr(test, "_testMethodName"):
            return "python: %s" % test.id()
        doc = test.shortDescription() or test._testMethodName
        return "%s: %s" % (test.__class__.__module__.replace("test_", "python "), doc)

    def _line(self, ok, test, extra=""):
        self.n += 1
        print("%s %d - %s%s" % ("ok" if ok else "not ok", self.n, self._name(test), extra),
              flush=True)

    def addSuccess(self, test):
        self._line(True, test)

    def addFailure(self, test, err):
        self.bad += 1
        self._line(False, test)
        text = "".join(traceback.format_exception(*err))
        print("".join("# " + line + "\n" for line in text.splitlines()), end="", flush=True)

    addError = addFailure

    def addSkip(self, test, reason):
        self._line(True, test, " # SKIP %s" % reason)


def main(argv):
    first = 1
    if argv[:1] == ["--first"]:
        first = int(argv[1])
        argv = argv[2:]
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    mods = argv or (["test_unit"] + (["test_server", "test_health", "test_forms", "test_defaults", "test_aio",
                                      "test_consume", "test_pooler", "test_cluster", "test_rabbitmq", "test_epoch"]
                                     if os.environ.get("IDEM_PG_DSN") else []))
    suite = unittest.TestSuite()
    for m in mods:
        suite.addTests(unittest.defaultTestLoader.loadTestsFromName(m))
    result = TapResult(first)
    suite.run(result)
    if result.n < first:
        print("not ok %d - python: no test ran" % first)
        return 1
    return 1 if result.bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
