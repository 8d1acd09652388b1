"""The workshop (tests/workshop.py): every exercise is graded (cut out alone, its tests fail; the lesson passes them
all), `start` keeps each signature, docstring and an attendee's work, and a failing grade names the exercise."""
import ast
import os
import subprocess
import sys

import pytest
import workshop as W


def test_every_exercise_is_graded():
    """CI's proof, one process for all stages (tests/workshop.py verify): about 45 s of one core."""
    r = subprocess.run([sys.executable, "tests/workshop.py", "verify"], cwd=W.ROOT, capture_output=True, text=True,
                       timeout=1200)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert r.stdout.count("fails, as it must") == len(W.EXERCISES) - ("04 _attend" not in r.stdout) * len(
        W.exercises("04"))  # without Triton, 04's are skipped


def test_start_keeps_signatures_docstrings_and_work(tmp_path, capsys):
    for s, name in W.LESSONS.items():
        assert W.start(s, folder=str(tmp_path)) == 0
        path, ref = tmp_path / f"{name}.py", W.reference(s)
        src = path.read_text()
        tree, ref_tree = ast.parse(src), ast.parse(ref)
        for e in W.exercises(s):
            assert W.is_stub(src, e) and not W.is_stub(ref, e) and e.hint in src
            if "[" in e.name:  # a lambda in a dict
                continue
            a, b = W._find(tree, e.name), W._find(ref_tree, e.name)
            assert ast.get_docstring(a) == ast.get_docstring(b)
            assert ast.dump(a.args) == ast.dump(b.args)
            assert ast.dump(a.returns or ast.Pass()) == ast.dump(b.returns or ast.Pass())
            assert [ast.dump(d) for d in a.decorator_list] == [ast.dump(d) for d in b.decorator_list]
        bodies = {e.name: ref[slice(*W.span(ref, e.name)[:2])] for e in W.exercises(s)}
        assert W.splice(src, bodies) == ref  # the reference's bodies put back: the lesson, byte for byte
        assert W.grade([s], str(tmp_path)) == {e: "to do" for e in W.exercises(s)}
    path.write_text("my work")
    assert W.start(s, folder=str(tmp_path)) == 1 and path.read_text() == "my work"  # never overwritten...
    assert W.start(s, force=True, folder=str(tmp_path)) == 0  # ...unless asked, and then kept
    assert (tmp_path / f"{name}.py.bak").read_text() == "my work" and W.is_stub(path.read_text(), W.exercises(s)[0])
    assert "python -m pytest tests/test_06_jump_forward_fsm.py --workspace" in capsys.readouterr().out


def write(path, name, body):
    """An attendee's edit: body (lines, dedented) becomes the body of name in path."""
    src = path.read_text()
    indent = W.span(src, name)[2]
    path.write_text(W.splice(src, {name: "".join(" " * indent + line + "\n" for line in body)}))


def test_a_failing_grade_names_the_exercise_and_what_it_checks(tmp_path):
    """03 with alloc written wrong (the highest free slots first), the other two as the lesson writes them."""
    W.start("03", folder=str(tmp_path))
    path = tmp_path / "03_token_allocator.py"
    write(path, "TokenAllocator.alloc", ["free = torch.nonzero(self.mem_state == 0)[:, 0]",
                                         "return None if n > len(free) else self._take(free.flip(0)[:n])"])
    for name in ("TokenAllocator.alloc_contiguous", "TokenAllocator.free"):
        write(path, name, W.body(W.reference("03"), name).splitlines())
    test = "tests/test_03_token_allocator.py::test_random_ops_agree_with_brute_force"
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")  # no third-party plugins: a second saved
    r = subprocess.run([sys.executable, "-m", "pytest", test, "--workspace", "--workspace-dir", str(tmp_path),
                        "-p", "no:cacheprovider"], cwd=W.ROOT, capture_output=True, text=True, timeout=600, env=env)
    out = r.stdout
    assert r.returncode == 1, out[-3000:]
    assert "one of 03 TokenAllocator.alloc, 03 TokenAllocator.alloc_contiguous, 03 TokenAllocator.free gives a " \
        "wrong answer; this test checks that\n  TokenAllocator.alloc: alloc returns the lowest free slots" in out
    assert "  fails    03 TokenAllocator.alloc\n" in out
    write(path, "TokenAllocator.free", [W.stub_text(W.exercises("03")[2], 0).strip()])  # free: to do again
    r = subprocess.run([sys.executable, "tests/workshop.py", "progress", "--dir", str(tmp_path)], cwd=W.ROOT,
                       capture_output=True, text=True, timeout=600)
    for name, status in (("alloc", "fails   test_"),
                         ("alloc_contiguous", "passes\n"), ("free", "to do\n")):
        assert f"03     {'TokenAllocator.' + name:32} {status}" in r.stdout, r.stdout + r.stderr[-2000:]
    assert "05     RadixCache.insert                not started\n" in r.stdout


def test_each_lesson_notebook_ends_with_its_exercises_and_runs_your_copy_under_workshop():
    nbformat = pytest.importorskip("nbformat")  # a GPU machine may have only the GPU stack
    for s, name in W.LESSONS.items():
        nb = nbformat.read(os.path.join(W.ROOT, "notebooks", W.NOTEBOOKS[s]), as_version=4)
        first, last = next(c for c in nb.cells if c.cell_type == "code"), nb.cells[-1]
        assert f'if os.environ.get("WORKSHOP"): ' in first.source and f'.use(["{s}"])' in first.source
        assert last.cell_type == "markdown" and last.source == W.your_turn(s)  # python tests/workshop.py notebooks
        for text in [f"python tests/workshop.py start {s}", f"python -m pytest {W.TESTS[s]} --workspace",
                     "python tests/workshop.py progress"] + [f"`{e.name}`" for e in W.exercises(s)]:
            assert text in last.source, (name, text)
