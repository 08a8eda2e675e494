#!/usr/bin/env python3
"""Runs pytest-style test files on a machine without pytest (a GPU machine without internet).

Only what flash_steps' test files use: pytest.skip (module level too), pytest.importorskip,
pytest.raises(match=...) and stacked pytest.mark.parametrize. Tests that need a pytest fixture
are left out and counted as not run. Prints one line per failure with its traceback, then
'N passed, N failed, N skipped'; exit status 1 if anything failed.

Usage: python3 common/scripts/gpu/minitest.py common/python/tests/test_attention_gpu.py ...
"""

import contextlib
import importlib.util
import os
import re
import sys
import traceback
import types


class Skip(Exception):
    pass


def skip(msg="", allow_module_level=False):
    raise Skip(msg)


def importorskip(name):
    try:
        return __import__(name)
    except ImportError as e:
        raise Skip("could not import %r: %s" % (name, e))


@contextlib.contextmanager
def raises(exc, match=None):
    try:
        yield
    except exc as e:
        assert match is None or re.search(match, str(e)), "%r does not match %r" % (str(e), match)
    else:
        raise AssertionError("DID NOT RAISE %s" % exc.__name__)


def parametrize(name, values, ids=None):
    def deco(f):
        f.cases = [dict(c, **{name: v}) for v in values for c in getattr(f, "cases", [{}])]
        return f
    return deco


def main(paths):
    pytest = types.ModuleType("pytest")
    pytest.skip, pytest.importorskip, pytest.raises = skip, importorskip, raises
    pytest.mark = types.SimpleNamespace(parametrize=parametrize)
    pytest.fixture = lambda f: f  # the tests that take fixtures are not run (below)
    sys.modules["pytest"] = pytest
    n = {"passed": 0, "failed": 0, "skipped": 0, "not run": 0}
    for path in paths:
        name = os.path.splitext(os.path.basename(path))[0]
        try:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except Skip as e:
            print("SKIPPED %s: %s" % (path, e))
            n["skipped"] += 1
            continue
        except Exception:
            print("FAILED %s (import)" % path)
            traceback.print_exc()
            n["failed"] += 1
            continue
        for test, f in list(vars(module).items()):
            if not test.startswith("test_") or not callable(f):
                continue
            for case in getattr(f, "cases", [{}]):
                if set(f.__code__.co_varnames[:f.__code__.co_argcount]) - set(case):
                    n["not run"] += 1  # needs a fixture
                    continue
                try:
                    f(**case)
                    n["passed"] += 1
                except Skip as e:
                    print("SKIPPED %s %s: %s" % (test, case, e))
                    n["skipped"] += 1
                except Exception:
                    n["failed"] += 1
                    print("FAILED %s::%s %s" % (path, test, case))
                    traceback.print_exc()
    print("%(not run)d tests need pytest fixtures and did not run" % n)
    print("%(passed)d passed, %(failed)d failed, %(skipped)d skipped" % n)
    return 1 if n["failed"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
