import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def run_child(code, env_extra=None, timeout=900):
    """Run Python code in a fresh interpreter; returns stdout (fails the test on error)."""
    env = dict(os.environ)
    env.update(env_extra or {})
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
        timeout=timeout,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.fail(f"child process failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout
