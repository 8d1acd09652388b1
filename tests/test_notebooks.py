"""Every workshop notebook runs top to bottom (cwd = repo root, so `importlib.import_module("0X_...")` works), and
ships with its outputs so a reader browsing the repository sees the figures before running anything."""
import glob
import importlib.util
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

nbformat = pytest.importorskip("nbformat")  # a GPU machine may have only the GPU stack
NotebookClient = pytest.importorskip("nbclient").NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))


def cannot_run(path):
    if "04_triton" in path and importlib.util.find_spec("triton") is None:
        return "needs Triton (Linux only)"
    if importlib.util.find_spec("ipykernel") is None:  # the python3 kernel the notebooks name
        return "needs a Jupyter kernel (pip install ipykernel)"


def execute(path):
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": ROOT}}).execute()


@pytest.fixture(scope="module")
def running(request):
    """The selected notebooks, started two at a time, the longest (07) first: each kernel computes on one thread
    (OMP_NUM_THREADS, set by conftest), so one after another left a core of two idle. {path: Future}."""
    chosen = [it.callspec.params["path"] for it in request.session.items
              if getattr(it, "originalname", "") == "test_notebook_runs" and not cannot_run(it.callspec.params["path"])]
    with ThreadPoolExecutor(2) as pool:
        yield {p: pool.submit(execute, p) for p in sorted(chosen, key=lambda p: "07_" not in p)}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[os.path.basename(p) for p in NOTEBOOKS])
def test_notebook_runs(path, running):
    if cannot_run(path):
        pytest.skip(cannot_run(path))
    running[path].result()  # its cell's error, if one failed


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[os.path.basename(p) for p in NOTEBOOKS])
def test_notebook_is_committed_executed_and_small(path):
    """Refresh with `jupyter nbconvert --to notebook --execute --inplace notebooks/*.ipynb`."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
    assert all(c.execution_count for c in code), "a code cell was never run: commit the notebook executed"
    assert sum(bool(c.outputs) for c in code) >= len(code) // 2, "too few outputs"
    assert not any(o.get("output_type") == "error" for c in code for o in c.outputs)
    assert os.path.getsize(path) < 400_000, "keep notebooks small (lower the figure dpi)"
