"""Run the package's tests (unittest) and print one TAP line per test:
"ok N - module: test's first docstring line" or "not ok N - ...", the
failure's traceback after it as TAP diagnostics ("# " lines on stdout, which
the suites print whole, however long the servers' logs after them).  Exit status 1 on any failure.

What the tests (and the package, and the programs they start) write on
stderr is caught (file descriptor 2) and must be nothing: a last line
says so, or shows it (TAP diagnostics) with the test that was running.
The package's log (the "idem" logger: Valkey down, a malformed
entry...), which fault tests provoke on purpose, goes to the file
idem-python.log in the current directory instead of Python's last-resort
handler on stderr; any other logger's records still reach stderr.

    python3 tap.py [--first N] [module...]

Without modules: test_unit, then test_server, test_health, test_forms, test_defaults,
test_aio, test_consume, test_pooler, test_cluster, test_rabbitmq and test_epoch (last:
it gives the server a new cache epoch) when IDEM_PG_DSN is set."""
import logging
import os
import sys
import tempfile
import traceback
import unittest


class TapResult(unittest.TestResult):
    def __init__(self, first, caught):
        super().__init__()
        self.n = first - 1
        self.bad = 0
        self.caught = caught        # file descriptor 2 meanwhile
        self.read = 0               # how much of it was read
        self.noise = []             # (test, what it wrote on stderr)

    def stopTest(self, test):
        super().stopTest(test)
        sys.stderr.flush()
        fd = self.caught.fileno()
        size = os.fstat(fd).st_size
        if size > self.read:
            text = os.pread(fd, size - self.read, self.read)
            self.read = size
            self.noise.append((self._name(test), text.decode("utf-8", "replace")))

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
    # the package's logger only: any other record (asyncio's "Task exception
    # was never retrieved", redis-py's tracebacks) still reaches stderr
    log = logging.FileHandler("idem-python.log")
    log.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.getLogger("idem").addHandler(log)
    logging.getLogger("idem").setLevel(logging.INFO)
    suite = unittest.TestSuite()
    for m in mods:
        suite.addTests(unittest.defaultTestLoader.loadTestsFromName(m))
    caught = tempfile.TemporaryFile()
    saved = os.dup(2)
    sys.stderr.flush()
    os.dup2(caught.fileno(), 2)
    result = TapResult(first, caught)
    try:
        suite.run(result)
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
    if result.n < first:
        print("not ok %d - python: no test ran" % first)
        return 1
    result.n += 1
    if result.noise:
        result.bad += 1
        print("not ok %d - python: the tests wrote nothing on stderr" % result.n)
        for name, text in result.noise:
            print("# written on stderr during %s:" % name)
            print("".join("# " + line + "\n" for line in text.splitlines()), end="",
                  flush=True)
    else:
        print("ok %d - python: the tests wrote nothing on stderr" % result.n)
    return 1 if result.bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
