"""Every workshop notebook runs top to bottom (in 3 minutes on the 2-core CPU) and ships with its outputs, none of
which answers a question before the attendee does. The questions' key, tests/questions.py, lies outside the
notebooks: here the right answer of each is told "right" on the lessons, and the tempting wrong one "not yet" on a
workshop copy of every lesson (WORKSHOP=1), each with the reason."""
import datetime
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from questions import QUESTIONS  # the key: per question its truth, right and tempting answers, tells

nbformat = pytest.importorskip("nbformat")  # a GPU machine may have only the GPU stack
NotebookClient = pytest.importorskip("nbclient").NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
IDS = [os.path.basename(p) for p in NOTEBOOKS]


def cannot_run(path):
    if "04_triton" in path and importlib.util.find_spec("triton") is None:
        return "needs Triton (Linux only)"
    if importlib.util.find_spec("ipykernel") is None:  # the python3 kernel the notebooks name
        return "needs a Jupyter kernel (pip install ipykernel)"


def questions(nb) -> dict:
    """{cell index: question id}: **Predict:** or **Try:**, then `answer = None`, then one line: check("NN.k", ...)."""
    at = {}
    for i, c in enumerate(nb.cells):
        if c.cell_type == "markdown" and re.match(r"\*\*(Predict|Try):\*\*", c.source):
            answer, check = nb.cells[i + 1:i + 3]
            assert re.fullmatch(r"answer = None(  # .*)?", answer.source), f"cell {i + 1}: {answer.source[:80]}"
            at[i] = re.fullmatch(r'check\("(\d\d\.\d)", answer(, \w+)*\)', check.source)[1]  # None: not one line
    return at


def said(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream").strip()


def execute(path, which, workspace=None):
    """The notebook run with the key's answers (right or tempting), on the lessons or (workspace) a copy."""
    nb = nbformat.read(path, as_version=4)
    at = questions(nb)
    for i, qid in at.items():
        nb.cells[i + 1].source = f"answer = {getattr(QUESTIONS[qid], which)}"
    env = dict(os.environ)
    if workspace:
        nb.cells = nb.cells[:max(at) + 3]
        env.update(WORKSHOP="1", WORKSHOP_DIR=str(workspace))
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": ROOT}}).execute(env=env)
    return [(nb.cells[i].source.split("\n")[0], said(nb.cells[i + 2])) for i in at], said(nb.cells[1])


@pytest.fixture(scope="module")
def running(request, tmp_path_factory):
    """The selected notebooks, two at a time (one thread each), the longest (07) first. {(path, mode): Future}."""
    ws = tmp_path_factory.mktemp("workspace")
    for f in glob.glob(os.path.join(ROOT, "0*.py")) + [os.path.join(ROOT, "llama3_generate.py")]:
        shutil.copy(f, ws)
    runs = {"test_notebook_runs": ("lessons", "right", None), "test_notebook_runs_your_copy": ("copy", "tempting", ws)}
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
        assert re.fullmatch(rf"{said} .+ Why: \S+( \S+){{4,}}", out) and never not in out, (
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


def test_under_workshop_a_question_is_judged_by_the_lesson_and_your_copy_is_pointed_at(tmp_path):
    """A wrong `free` in your copy of 03, and 01 started but not written: the right answers are still right, and one
    line more says your copy gives another value, and how to grade it."""
    sys.path.insert(0, os.path.dirname(__file__))
    import workshop as W
    W.start("01", folder=str(tmp_path), say_next=False)
    body = "        self.mem_state[idx.long()] -= 1  # no check: a double free goes through\n"
    (tmp_path / "03_token_allocator.py").write_text(W.splice(W.reference("03"), {"TokenAllocator.free": body}))
    first = ('import sys; sys.path.insert(0, "tests"); from workshop import use; from questions import check;'
             ' use(["01", "03"], say=False); import importlib; m = importlib.import_module("03_token_allocator"); ')
    run = subprocess.run([sys.executable, "-c", first + 'check("03.2", "c"); check("01.1", lambda r, p: r * 16 + p)'],
                         cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, WORKSHOP="1",
                                                                            WORKSHOP_DIR=str(tmp_path)))
    lines = run.stdout.splitlines()
    assert [line.split(" ")[0] for line in lines] == ["right:", "(your"] * 2, run
    assert "gives 'a' here, not the lesson's 'c'" in lines[1], lines
    assert "raises NotImplementedError: your turn" in lines[3], lines
    assert all("python -m pytest tests/test_0" in line and "--workspace" in line for line in lines[1::2]), lines


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_no_notebook_shows_an_answer_before_it_is_given(path):
    """Nothing in a notebook's source or committed output tells one of its questions' answers (each question's
    `tells`); every question of the key is asked, once, by its one-line check, and what comes after it shows the
    answer only when run (outputs tagged `answers`: `python tests/workshop.py notebooks` withholds them)."""
    nb = nbformat.read(path, as_version=4)
    stage = os.path.basename(path)[:2]
    texts = [c.source for c in nb.cells] + [o.get("text", "") + o.get("data", {}).get("text/plain", "")
                                            for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    shown = [(qid, t) for qid, q in QUESTIONS.items() if qid[:2] == stage for t in texts
             if re.search(q.tells, t) or q.why[:40] in t]  # the answer, or the reason
    assert not shown, shown
    assert sorted(questions(nb).values()) == sorted(q for q in QUESTIONS if q[:2] == stage)


def seconds(cell) -> float:
    t = {k: datetime.datetime.fromisoformat(v.replace("Z", "")) for k, v in cell.metadata["execution"].items()}
    return (t["shell.execute_reply"] - t["iopub.execute_input"]).total_seconds()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_is_committed_executed_and_small(path):
    """Refresh with `jupyter nbconvert --to notebook --execute --inplace notebooks/*.ipynb`, then `python
    tests/workshop.py notebooks`. Small, quick (the run committed took at most 3 minutes), and each of its questions,
    unanswered, says so in one line and nothing else."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
    assert all(c.execution_count for c in code), "a code cell was never run: commit the notebook executed"
    assert sum(bool(c.outputs) for c in code) >= len(code) // 2, "too few outputs"
    assert not any(o.get("output_type") == "error" for c in code for o in c.outputs)
    assert os.path.getsize(path) < 400_000, "keep notebooks small (lower the figure dpi)"
    assert sum(map(seconds, code)) <= 180, f"{sum(map(seconds, code)):.0f} s: a notebook runs in 3 minutes at most"
    for i in questions(nb):
        check = nb.cells[i + 2]
        assert [o.output_type for o in check.outputs] == ["stream"] and said(check).startswith(
            "your answer first") and "\n" not in said(check), (nb.cells[i].source[:80], check.outputs)


def test_01_times_a_step_as_the_lesson_says():
    """01's committed timings: uncached, the step making token 128 computes 129 tokens and takes longer than the one
    making token 16 (17 tokens), and the cache's advantage grows with the prefix."""
    nb = nbformat.read(NOTEBOOKS[0], as_version=4)
    (a16, b16), (a128, b128) = [tuple(map(float, re.findall(r"(\d+) ms", line))) for c in nb.cells[1:]
                                for line in said(c).splitlines() if line.startswith("position")]
    assert a128 > a16 and a128 / b128 > a16 / b16, ((a16, b16), (a128, b128))
