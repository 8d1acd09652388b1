"""The workshop (tests/workshop.py): the lesson passes every exercise's grade, every attendee's bug in
tests/mutants.py fails its own exercise's in words, other right answers pass (verify); `start` keeps each signature,
docstring and an attendee's work; pytest --workspace and progress give one grade; a loop that never ends fails."""
import ast
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import workshop as W


def test_every_exercise_is_graded():
    """CI's proof (tests/workshop.py verify), the stages in two processes at once."""
    halves = [[s for s in W.verifiable() if s in "01 02 04 07"], [s for s in W.verifiable() if s in "03 05 06"]]
    procs = [subprocess.Popen([sys.executable, "tests/workshop.py", "verify", *h], cwd=W.ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for h in halves]  # 2 cores, 1 each
    outs = [p.communicate(timeout=1200) for p in procs]
    r = SimpleNamespace(returncode=max(p.returncode for p in procs), stdout="".join(o for o, _ in outs),
                        stderr="".join(e for _, e in outs))
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    import mutants
    stages = [s for s in W.LESSONS if "04" not in s or "04 _attend" in r.stdout]  # without Triton, 04's are skipped
    want = sum(len(mutants.of_exercises(s)) for s in stages)
    assert r.stdout.count(": fails\n") == want and want >= 60, r.stdout[-3000:]
    assert r.stdout.count("alternative: passes") >= len(W.exercises("02") + W.exercises("03") + W.exercises("05"))
    assert not [line for line in r.stdout.splitlines() if " fails: " in line and "GPU" in line]  # a CPU's words
    assert "07 Engine.step fails: on_token(seq) heard the outputs {}" in r.stdout
    assert r.stdout.count("passes, progress --json passes\n") == sum(e.stage in stages for e in W.EXERCISES)  # pasted


@pytest.mark.triton
def test_a_grade_is_the_same_whatever_the_grading_process_imported():
    """pytest's process has imported the tests' helpers (and the engine through them): a graded test monkeypatching
    the engine still runs on the graded copy (pytest --workspace once failed the lesson's own FastEngine.step so)."""
    import helpers  # noqa: F401
    ex, ref = dataclasses.replace(W.find("07", "step"), name="FastEngine.step", tests=(
        "test_prefills_beside_a_chunk_in_flight_match_one_step[token]",)), W.reference("07")
    assert W.grade_body(ex, ref[slice(*W.span(ref, ex.name)[:2])]).status == "passes"


def test_a_failure_shows_the_input_its_test_line_describes():
    """verify flags a failure whose message shows a pool or a tree its `test:` line does not describe."""
    why = "05 RadixCache.evict fails: evict(4) on a tree [1 2] -> {[3], [4]} freed 2 tokens; 8 of 10 blocks free"
    assert W.undescribed(why, "  test: evict (evict on a tree [1 2 3] -> {[4 5], [7 8]}, a pool of 6 blocks)") == [
        "10 blocks", "[1 2] -> {[3], [4]}"]
    assert W.undescribed(why, "  test: evict (a pool of 10 blocks; then a tree [1 2] -> {[3], [4]})") == []
    assert W.bare("06 TokenIndex.jump fails: ('(ab|cd){1,3}e?', 'cdcdc')") and not W.bare(why)  # values alone


def test_a_mutant_is_found_in_its_function_whatever_the_reflow():
    """Each mutant applies once to its lesson, reflowed or not; changed in substance or in another function: stale."""
    import mutants
    from code_mutants import CODE_MUTANTS
    read = lambda mu: open(os.path.join(W.ROOT, mutants.FILES[mu.stage]), encoding="utf-8").read()
    assert [mu.what for mu in mutants.MUTANTS + CODE_MUTANTS if mutants.apply(read(mu), mu) is None] == []
    mu = next(mu for mu in mutants.MUTANTS if mu.what == "insert's new leaf starts one token late")
    src = read(mu)
    flowed = src.replace("Node(key[n:], key[n:] if slots is None else slots[",
                         "Node(\n                key[n:],\n                key[n:] if slots is None\n"
                         "                   else slots[")
    (got, at, _), (want, at0, _) = mutants.apply(flowed, mu), mutants.apply(src, mu)
    flat = lambda text: "".join(text.split())
    assert flowed != src and at == at0 and flat(got) == flat(want) != flat(src)
    assert mutants.apply(flowed.replace("key[n:],\n", "key[n - 1:],\n"), mu) is None  # changed in substance
    assert mutants.apply(src, mu._replace(where="RadixCache.evict")) is None  # not in that function


def test_start_keeps_signatures_docstrings_and_work(tmp_path, capsys):
    for s, name in W.LESSONS.items():
        assert W.start(s, folder=str(tmp_path)) == 0
        path, ref = tmp_path / f"{name}.py", W.reference(s)
        src = path.read_text()
        tree, ref_tree = ast.parse(src), ast.parse(ref)
        for e in W.exercises(s):
            assert W.is_stub(src, e) and not W.is_stub(ref, e) and e.idea in src
            if "[" in e.name:  # a lambda in a dict
                continue
            a, b = W._find(tree, e.name), W._find(ref_tree, e.name)
            assert ast.get_docstring(a) == ast.get_docstring(b)
            assert ast.dump(a.args) == ast.dump(b.args)
            assert ast.dump(a.returns or ast.Pass()) == ast.dump(b.returns or ast.Pass())
            assert [ast.dump(d) for d in a.decorator_list] == [ast.dump(d) for d in b.decorator_list]
        bodies = {e.name: ref[slice(*W.span(ref, e.name)[:2])] for e in W.exercises(s)}
        assert W.splice(src, bodies) == ref  # the reference's bodies put back: the lesson, byte for byte
        assert {e: g.status for e, g in W.grade([s], str(tmp_path)).items()} == {e: "to do" for e in W.exercises(s)}
        out = capsys.readouterr().out
        assert f"{name}.py (the" not in out and f"read {name}" not in out, out  # start never points at the lesson
    path.write_text("my work")
    assert W.start(s, folder=str(tmp_path)) == 1 and path.read_text() == "my work"  # never overwritten...
    assert W.start(s, force=True, folder=str(tmp_path)) == 0  # ...unless asked, and then kept
    assert (tmp_path / f"{name}.py.bak").read_text() == "my work" and W.is_stub(path.read_text(), W.exercises(s)[0])
    assert f"python -m pytest {W.TESTS[s]} --workspace" in capsys.readouterr().out


def write(path, name, body):
    """An attendee's edit: body (lines, dedented) becomes the body of name in path."""
    src = path.read_text()
    indent = W.span(src, name)[2]
    path.write_text(W.splice(src, {name: "".join(" " * indent + line + "\n" for line in body)}))


def graders(tmp_path, *pytest_args):
    """(pytest --workspace's output and exit status, progress --json's object) on the workspace tmp_path."""
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")  # no third-party plugins: a second saved
    r = subprocess.run([sys.executable, "-m", "pytest", "tests/test_03_token_allocator.py", "--workspace",
                        "--workspace-dir", str(tmp_path), "-p", "no:cacheprovider", *pytest_args], cwd=W.ROOT,
                       capture_output=True, text=True, timeout=600, env=env)
    p = subprocess.run([sys.executable, "tests/workshop.py", "progress", "--json", "--dir", str(tmp_path)],
                       cwd=W.ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == r.returncode, p.stdout[-2000:] + p.stderr[-2000:]  # the same exit status too
    return r.stdout, r.returncode, json.loads(p.stdout)


def test_pytest_and_progress_give_one_grade_that_names_the_exercise(tmp_path):
    """pytest --workspace and progress grade 03's alloc alone, wrong and then right, in the same sentence."""
    W.start("03", folder=str(tmp_path))
    path = tmp_path / "03_token_allocator.py"
    write(path, "TokenAllocator.alloc", ["free = torch.nonzero(self.mem_state == 0)[:, 0]",
                                         "return None if n > len(free) else self._take(free.flip(0)[:n])"])
    out, rc, prog = graders(tmp_path, "-x")
    why = prog["exercises"]["03 TokenAllocator.alloc"]["why"]
    assert rc == 1 and why.startswith("03 TokenAllocator.alloc fails: alloc(1) on the pool .") and why in out, out
    assert "1 failed" in out and "  fails    03 TokenAllocator.alloc\n" in out, out
    assert prog["passed"] == 0 and prog["total"] == len(W.EXERCISES)
    assert prog["exercises"]["03 TokenAllocator.free"]["status"] == "to do"
    assert prog["exercises"]["05 RadixCache.insert"]["status"] == "not started"
    write(path, "TokenAllocator.alloc", W.body(W.alternatives("03"), "TokenAllocator.alloc").splitlines())
    out, rc, prog = graders(tmp_path, "--exercise", "alloc")
    assert rc == 0 and "1 passed" in out and "  passes   03 TokenAllocator.alloc\n" in out, out
    assert prog["passed"] == 1 and prog["exercises"]["03 TokenAllocator.alloc"]["status"] == "passes"


def test_a_wrong_answer_fails_fast_and_safely():
    """A loop that never ends fails on the time limit, a list that grows without bound on the memory limit."""
    ex = dataclasses.replace(W.find("03", "alloc"), seconds=8)
    g = W.grade_body(ex, "        while True:\n            pass\n")
    assert g.status == "fails" and "ran for more than 8 s" in g.why and g.seconds < 30, g
    fill = ("        import contextlib\n        x = []\n"
            "        for size in (1 << 24, 1 << 16, 1 << 8):  # to the limit's last bytes\n"
            "            with contextlib.suppress(MemoryError):\n                while True:\n"
            "                    x.append(bytearray(size))\n        x.append(bytearray(1 << 24))\n")
    g = W.grade_body(ex, fill, memory=1 << 28)
    assert g.status == "fails" and g.why.startswith("03 TokenAllocator.alloc fails: your alloc raised MemoryError"), g


def test_each_lesson_notebook_ends_with_its_exercises_and_runs_your_copy_under_workshop():
    nbformat = pytest.importorskip("nbformat")  # a GPU machine may have only the GPU stack
    for s, name in W.LESSONS.items():
        nb = nbformat.read(os.path.join(W.ROOT, "notebooks", W.NOTEBOOKS[s]), as_version=4)
        first, last = next(c for c in nb.cells if c.cell_type == "code"), nb.cells[-1]
        assert f'use(["{s}"]) if os.environ.get("WORKSHOP") else None' in first.source
        assert last.cell_type == "markdown" and last.source == W.your_turn(s)  # python tests/workshop.py notebooks
        for text in [f"python tests/workshop.py start {s}", f"python -m pytest {W.TESTS[s]} --workspace",
                     "python tests/workshop.py progress", f"python tests/workshop.py hint {s}"] + [
                f"`{e.name}`" for e in W.exercises(s)]:
            assert text in last.source, (name, text)


def test_a_failure_points_at_your_copy_and_at_the_lesson_each_by_its_own_lines(tmp_path):
    """A failure's `at:` names the copy's line and the lesson's line of the check that failed, each in its own file."""
    W.start("03", folder=str(tmp_path))
    path = tmp_path / "03_token_allocator.py"
    write(path, "TokenAllocator.free", ["self.mem_state[idx.long()] -= 1", "self.check()"])
    src, ref = path.read_text(), W.reference("03")
    g = W.grade_copy(W.find("03", "free"), src, str(path))
    mine = src.splitlines().index(" " * 8 + "self.check()") + 1
    theirs = next(i for i, line in enumerate(ref.splitlines(), 1) if "host thinks" in line)
    assert g.why.startswith("03 TokenAllocator.free fails: the lesson's check found the state your free left wrong")
    assert f"{os.path.relpath(path)}:{mine} in free  (your free)" in g.detail, g.detail
    assert f"    03_token_allocator.py:{theirs} in check  (the lesson's code)" in g.detail, g.detail
    assert mine != theirs and f"\n    03_token_allocator.py:{mine} " not in g.detail


def test_each_mistake_is_one_clear_line_and_a_non_zero_exit(tmp_path):
    """Ctrl-C during progress, a copy that does not parse, --exercise misspelled or without --workspace, a misspelled
    name: one line and a non-zero exit each; `list` names each exercise as the command line takes it; the README's
    --exercise collects one; output cut short by a pipe (`start 06 | head -3`) ends quietly, without a traceback."""
    W.start("03", folder=str(tmp_path))
    path, ws, test = tmp_path / "03_token_allocator.py", ["--workspace", "--workspace-dir", str(tmp_path)], [
        "-m", "pytest", "tests/test_03_token_allocator.py", "-p", "no:cacheprovider"]
    run = lambda *a: subprocess.run([sys.executable, *a], cwd=W.ROOT, capture_output=True, text=True, timeout=300)
    one = re.search(r"^python -m pytest tests/test_03_\S+ --workspace .*\((?:one of them: )?(--exercise \w+)\)$",
                    open(os.path.join(W.ROOT, "README.md"), encoding="utf-8").read(), re.M)[1].split()
    r = run(*test, *ws, *one, "--collect-only", "-q")
    assert r.returncode == 0 and re.findall(r"::(\S+)$", r.stdout, re.M) == ["TokenAllocator.alloc"], r.stdout
    names = re.findall(r"^(\d\d) ([^\s:]+)", run("tests/workshop.py", "list").stdout, re.M)
    assert len(names) == len(W.EXERCISES) and all(W.find(*n) and re.fullmatch(r"[\w.]+", n[1]) for n in names)
    write(path, "TokenAllocator.alloc", ["while True:", "    pass"])  # graded for a minute, unless stopped
    pipe, progress = [subprocess.Popen([sys.executable, "tests/workshop.py", *a, "--dir", str(tmp_path)], cwd=W.ROOT,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                      for a in (["start", "06"], ["progress"])]
    pipe.stdout.close()  # before it writes a line
    assert pipe.stderr.read() == "" and pipe.wait(60) != 0
    time.sleep(8)
    progress.send_signal(signal.SIGINT)
    assert progress.communicate(timeout=60)[1] == "workshop: stopped (Ctrl-C)\n" and progress.returncode == 130
    line = path.read_text().count("\n") + 1
    path.write_text(path.read_text() + "def broken(:\n")
    for r, says in [(run(*test, *ws), f"line {line}: SyntaxError"), (run(*test, "--exercise", "alloc"), "--workspace"),
                    (run("tests/workshop.py", "progress", "--dir", str(tmp_path)), f"line {line}: SyntaxError"),
                    (run(*test, *ws, "--exercise", "alloc-contiguous"), "03's are alloc, alloc_contiguous, free"),
                    (run("tests/workshop.py", "hint", "03", "aloc"), "did you mean alloc?")]:
        said = [x for x in (r.stdout + r.stderr).splitlines() if x.strip()]
        assert r.returncode > 1 and len(said) == 1 and says in said[0], r.stdout + r.stderr


def test_hints_come_in_levels_that_teach():
    """Hint 1 has none of the solution's code, hint 2 a worked example without its lines; `hint` prints them in turn."""
    for e in W.EXERCISES:
        sol = W.body(W.reference(e.stage), e.name)
        code = {t for t in re.findall(r"\w+(?=\()|\w*_\w*", sol) if len(t) > 2} | {"lambda", "self"}
        leak = [t for t in code if re.search(rf"(?<!\w){t}(?!\w)", e.hint)]
        assert not leak and not re.search(r"=|\w\(|\w\[", e.hint) and len(e.hint) > 40, (e.id, leak, e.hint)
        lines = {line.strip() for line in sol.splitlines() if len(line.strip()) > 12}
        assert len(re.findall(r"\d", e.example)) >= 4 and not [x for x in lines if x in e.example], (e.id, e.example)
        tree = re.sub(r"\{[^{}]*\}", "", re.sub(r"\{[^{}]*\}", "", e.example.split("\n")[0]))  # a drawn tree's top
        assert " -> {" not in e.example or len(re.findall(r"\[[\d ]+\]", tree)) <= 1, (e.id, e.example)  # one root
    say = lambda *a: subprocess.run([sys.executable, "tests/workshop.py", "hint", "03", "alloc_contiguous", *a],
                                    cwd=W.ROOT, capture_output=True, text=True, timeout=60).stdout
    e = W.find("03", "alloc_contiguous")
    one, two = say(), say("--level", "2")
    assert e.hint.split("\n")[0] in one and e.example.split("\n")[0] not in one and "--level 2" in one, one
    assert e.example.split("\n")[0] in two and "solution 03 alloc_contiguous" in two, two
