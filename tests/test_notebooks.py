"""The notebooks of examples/ run top to bottom in a fresh kernel without a cell error, and
the repository's copies hold no outputs.

Each runs with nbclient in an IPython kernel started from this interpreter (a kernel spec
written for the test, so that a user's own "python3" spec cannot pick another
environment), from examples/ as its working directory. Measured on a shared 2-core AMD
EPYC (Zen 4) VM, kernel start included: with numkern's kernel cache warm, 01 (write a
kernel) 4-7 s, 02 (check a kernel, vLLM installed) 5-8 s, 03 (run the engine) 12-27 s;
with an empty cache 4 s, 30 s and 50 s (the kernels of fused MoE, attention and the
model compile).
"""

import json
import os
import sys

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
NOTEBOOKS = sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".ipynb"))
# per cell: the engine notebook's first cell compiles its kernels on a cold cache (about a
# minute on 2 busy cores), with room to spare
CELL_TIMEOUT_S = 600
KERNEL = "numkern-tests"


@pytest.fixture(scope="module")
def kernel_specs(tmp_path_factory):
    """JUPYTER_PATH set to a directory whose one kernel spec runs ipykernel on this
    interpreter, for the tests of this module."""
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    kernel = {"argv": argv, "display_name": "numkern tests", "language": "python"}
    (spec / "kernel.json").write_text(json.dumps(kernel))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", str(root))
        yield


def execute(nb):
    """Run every cell of ``nb`` in a fresh kernel, shut down afterwards; nbclient raises
    ``CellExecutionError`` on a cell's error."""
    client = NotebookClient(
        nb,
        kernel_name=KERNEL,
        timeout=CELL_TIMEOUT_S,
        startup_timeout=120,
        resources={"metadata": {"path": EXAMPLES}},
    )
    client.execute()
    return nb


def test_examples_exist():
    wanted = {"01_write_a_kernel.ipynb", "02_check_a_kernel.ipynb", "03_run_the_engine.ipynb"}
    assert wanted <= set(NOTEBOOKS), NOTEBOOKS


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_stripped(name):
    nb = nbformat.read(os.path.join(EXAMPLES, name), as_version=4)
    nbformat.validate(nb)
    dirty = [
        i
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]
    assert not dirty, f"{name}: cells {dirty} hold outputs (clear them before committing)"


@pytest.mark.parametrize("name", NOTEBOOKS)
@pytest.mark.usefixtures("kernel_specs")
def test_notebook_runs(name):
    nb = execute(nbformat.read(os.path.join(EXAMPLES, name), as_version=4))
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors


@pytest.mark.usefixtures("kernel_specs")
def test_cell_kernel_recompiles_with_new_globals():
    """A kernel defined again in a later cell, with the same source, after a global it
    reads changed: Numba's own cache for IPython cells is keyed by the function's source
    text and would load the first machine code; numkern.jit compiles cell kernels in
    memory, so the second one sees the new value (also on a second run of the notebook)."""
    cells = [
        "import numkern\nTILE = 4",
        "@numkern.jit\ndef times_tile(x):\n    return x * TILE",
        "assert times_tile(1.0) == 4.0",
        "TILE = 8",
        "@numkern.jit\ndef times_tile(x):\n    return x * TILE",
        "assert times_tile(1.0) == 8.0, times_tile(1.0)",
    ]
    for _ in range(2):
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
        execute(nb)
