"""Every workshop notebook runs top to bottom and ships with its outputs. Its questions are answered here from KEY,
an answer key kept apart from the notebooks: right answers on the lessons are told "right", wrong ones on a workshop
copy of every lesson (WORKSHOP=1) "not yet", each with the reason."""
import glob
import importlib.util
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

nbformat = pytest.importorskip("nbformat")  # a GPU machine may have only the GPU stack
NotebookClient = pytest.importorskip("nbclient").NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
IDS = [os.path.basename(p) for p in NOTEBOOKS]

# Each notebook's questions, in order: (a right answer, a tempting wrong one), as an attendee would write them.
KEY = {
    "01_kv_cache.ipynb": [('lambda r, p: r * 16 + p', 'lambda r, p: p * 16 + r'), ('[154, 40]', '[148, 40]'),
                          ('16', '32')],
    "02_paged_cache_manager.ipynb": [('[2, 3]', '[0, 3]'), ('[4, 5]', '[0, 1, 4, 5]'),
                                     ('lambda n: (n + 15) // 16', 'lambda n: n // 16 + 1')],
    "03_token_allocator.ipynb": [('[2, 5, 6]', '[5, 6, 8]'), ("'c'", "'a'"), ('[9, 10, 11, 12]', '[1, 4, 5, 6]')],
    "04_triton_token_attn.ipynb": [("'b'", "'a'"), ('0.75', '1 / 3'), ('[64, 1, 8]', '[66, 1, 8]')],
    "05_radix_scheduler.ipynb": [('6', '8'), ('2', '3'), ('[1, 3, 0, 4, 2]', '[3, 1, 0, 4, 2]'),
                                 ('lambda n, P: n // P * P', 'lambda n, P: -(-n // P) * P')],
    "06_jump_forward_fsm.ipynb": [("r'Answer: (yes|no)'", "r'Answer: yes|no'"),
                                  ("""['{"ok": ', 'rue, "n": ']""", """['{"ok": ', 'true, "n": ']"""), ("'b'", "'a'")],
    "07_end_to_end.ipynb": [("'token'", "'paged'"), ("'b'", "'a'"),
                            ('lambda table, P, r, i: table[r][i // P] * P + i % P',
                             'lambda table, P, r, i: table[r][i // P]')],
}


def cannot_run(path):
    if "04_triton" in path and importlib.util.find_spec("triton") is None:
        return "needs Triton (Linux only)"
    if importlib.util.find_spec("ipykernel") is None:  # the python3 kernel the notebooks name
        return "needs a Jupyter kernel (pip install ipykernel)"


def questions(nb) -> list:
    """Each question's cell index: **Predict:** or **Try:**, then `answer = None`, then a check calling ask."""
    at = [i for i, c in enumerate(nb.cells) if c.cell_type == "markdown"
          and re.match(r"\*\*(Predict|Try):\*\*", c.source)]
    for i in at:
        answer, check = nb.cells[i + 1:i + 3]
        assert re.fullmatch(r"answer = None(  # .*)?", answer.source), f"cell {i + 1}: {answer.source[:80]}"
        assert check.cell_type == "code" and "ask(" in check.source, f"cell {i + 2}: {check.source[:80]}"
    return at


def said(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream").strip()


def execute(path, which, workspace=None):
    """The notebook run with the key's `which` answers (0 right, 1 wrong), on the lessons or (workspace) a copy."""
    nb = nbformat.read(path, as_version=4)
    at = questions(nb)
    for i, answers in zip(at, KEY[os.path.basename(path)]):
        nb.cells[i + 1].source = f"answer = {answers[which]}"
    env = dict(os.environ)
    if workspace:
        nb.cells = nb.cells[:at[-1] + 3]
        env.update(WORKSHOP="1", WORKSHOP_DIR=str(workspace))
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": ROOT}}).execute(env=env)
    return [(nb.cells[i].source.split("\n")[0], said(nb.cells[i + 2])) for i in at], said(nb.cells[1])


@pytest.fixture(scope="module")
def running(request, tmp_path_factory):
    """The selected notebooks, two at a time (one thread each), the longest (07) first. {(path, mode): Future}."""
    ws = tmp_path_factory.mktemp("workspace")
    for f in glob.glob(os.path.join(ROOT, "0*.py")) + [os.path.join(ROOT, "llama3_generate.py")]:
        shutil.copy(f, ws)
    runs = {"test_notebook_runs": ("lessons", 0, None), "test_notebook_runs_your_copy": ("copy", 1, ws)}
    chosen = [(it.callspec.params["path"], runs[it.originalname]) for it in request.session.items
              if getattr(it, "originalname", "") in runs and not cannot_run(it.callspec.params["path"])]
    with ThreadPoolExecutor(2) as pool:
        yield {(p, mode): pool.submit(execute, p, which, folder)
               for p, (mode, which, folder) in sorted(chosen, key=lambda c: "07_" not in c[0])}


def checks_say(path, running, mode, said, never):
    """Every check of the notebook's run in `mode` says `said` with why, never `never`; the first cell's output."""
    if cannot_run(path):
        pytest.skip(cannot_run(path))
    checks, first = running[path, mode].result()  # a cell's error, if one failed
    for question, out in checks:
        assert re.search(rf"^{said} .+ Why: \S+( \S+){{4,}}", out, re.M) and never not in out, (
            f"{question}\nthe check said: {out}")
    return first


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_runs(path, running):
    """On the lessons, every right answer in the key is told "right", with why."""
    checks_say(path, running, "lessons", "right:", "not yet")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_runs_your_copy(path, running):
    """WORKSHOP=1 on copies of the lessons: the notebook imports the copy, and every wrong answer is told "not yet"."""
    first = checks_say(path, running, "copy", "not yet:", "right:")
    assert "your copy in" in first, first


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_is_committed_executed_and_small(path):
    """Refresh with `jupyter nbconvert --to notebook --execute --inplace notebooks/*.ipynb`. Small, with at least
    three questions left unanswered that reveal nothing."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
    assert all(c.execution_count for c in code), "a code cell was never run: commit the notebook executed"
    assert sum(bool(c.outputs) for c in code) >= len(code) // 2, "too few outputs"
    assert not any(o.get("output_type") == "error" for c in code for o in c.outputs)
    assert os.path.getsize(path) < 400_000, "keep notebooks small (lower the figure dpi)"
    at = questions(nb)
    assert len(at) >= 3 and len(KEY[os.path.basename(path)]) == len(at), (len(at), "questions")
    for i in at:
        assert said(nb.cells[i + 2]).startswith("your answer first"), nb.cells[i].source[:80]
