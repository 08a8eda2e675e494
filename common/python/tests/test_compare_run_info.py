"""compare.run_info(): the recorded command reproduces the run, environment included."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import compare  # noqa: E402


def test_command_names_the_shared_memory_limit(monkeypatch):
    script = os.path.join(compare.REPO, "common", "python", "compare.py")
    monkeypatch.setattr(sys, "argv", [script, "--quick"])
    monkeypatch.delenv("FA_SMEM_LIMIT", raising=False)
    assert compare.run_info()["command"] == "python3 common/python/compare.py --quick"
    monkeypatch.setenv("FA_SMEM_LIMIT", "101376")
    assert (compare.run_info()["command"]
            == "FA_SMEM_LIMIT=101376 python3 common/python/compare.py --quick")
