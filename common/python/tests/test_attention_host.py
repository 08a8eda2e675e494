"""Host tests of flash_steps.attention that need neither torch nor a GPU.

``import flash_steps`` must not import torch (the C API wrapper and the tests work without
it); the choice of the backward step goes through libfa's registry (skipped when libfa is not
built and FA_LIB is unset, like test_wrapper.py).
"""

import os
import subprocess
import sys

import pytest

PYTHON_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, PYTHON_DIR)

import flash_steps as fs  # noqa: E402


def test_import_does_not_import_torch():
    code = ("import sys; sys.path.insert(0, %r); import flash_steps; "
            "assert callable(flash_steps.attention); "
            "assert 'torch' not in sys.modules, 'import flash_steps imported torch'; print('ok')"
            % PYTHON_DIR)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_attention_is_exported():
    for name in ("attention", "backward_step_for", "DEFAULT_STEP", "DEFAULT_BACKWARD_STEP"):
        assert name in fs.__all__ and hasattr(fs, name)
    assert fs.DEFAULT_STEP == "06_causal_skip" and fs.DEFAULT_BACKWARD_STEP == "07_backward"


@pytest.fixture
def lib():
    try:
        fs.load_library()
    except fs.LibraryNotFound as e:
        if os.environ.get("FA_LIB"):
            raise  # ctest sets FA_LIB: a library that does not load is a failure
        pytest.skip("libfa not built (%s)" % e)


def test_backward_step_is_the_steps_own_else_07(lib):
    names = fs.steps()
    with_backward = [s for s in names if fs.has_backward(s)]
    if not with_backward:
        pytest.skip("no registered step has a backward pass")
    fallback = "07_backward" if "07_backward" in with_backward else with_backward[-1]
    for s in names:
        assert fs.backward_step_for(s) == (s if fs.has_backward(s) else fallback), s
        for b in with_backward:
            assert fs.backward_step_for(s, b) == b


def test_backward_step_errors(lib):
    with pytest.raises(fs.UnknownStep, match="unknown step '99_nope'"):
        fs.backward_step_for("99_nope")
    with pytest.raises(fs.UnknownStep, match="unknown step '99_nope'"):
        fs.backward_step_for(fs.steps()[0], "99_nope")
    forward_only = [s for s in fs.steps() if not fs.has_backward(s)]
    if not forward_only:
        pytest.skip("every registered step has a backward pass")
    with pytest.raises(fs.Unsupported, match="backward_step %s has no backward pass"
                       % forward_only[0]):
        fs.backward_step_for(fs.steps()[0], forward_only[0])
