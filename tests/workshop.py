"""The workshop: each stage's exercises are the functions that are its idea, cut out of the lesson itself (one source
of truth: the lessons are the reference solutions), and the stage's own tests say when the attendee's are right.

    python tests/workshop.py start 03     # workspace/03_token_allocator.py: the lesson with 3 bodies to write
    python -m pytest tests/test_03_token_allocator.py --workspace     # its tests, on your copy
    python tests/workshop.py progress     # what passes, what is still to do

Which code a graded run uses: the lessons whose test files you run come from workspace/ where you started them;
every other lesson is the reference, so 05 can be done before 04 (and an unfinished 03 never breaks 05's grade).
Stage 07 is the engine: llama3_generate.py's Engine.step, graded by tests/test_engine.py.
A notebook started with WORKSHOP=1 in its environment (`WORKSHOP=1 jupyter lab`) runs your copy of its lesson.
Exercises run on a CPU; 04's kernels through Triton's interpreter (TRITON_INTERPRET=1, set for you), Linux only:
Triton has no macOS or Windows wheels. tiny-llm (skyzh) and minitorch do the same: a stub, a hint, a test."""
from __future__ import annotations

import argparse
import ast
import functools
import glob
import importlib.abc
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKSPACE = os.path.join(ROOT, "workspace")  # git-ignored
STUB = "your turn: "


@dataclass(frozen=True)
class Exercise:
    stage: str      # "03"
    name: str       # qualname in the lesson: "TokenAllocator.alloc"
    hint: str       # one line: how
    checks: str     # what its tests check, in words
    tests: tuple    # the tests of tests/test_<lesson>.py that grade it (names; "name[param]" for one case)

    @property
    def lesson(self) -> str:
        return LESSONS[self.stage]

    @property
    def id(self) -> str:
        return f"{self.stage} {self.name}"


LESSONS = {os.path.basename(p)[:2]: os.path.basename(p)[:-3] for p in sorted(glob.glob(os.path.join(ROOT, "0*.py")))}
LESSONS["07"] = "llama3_generate"  # the engine: its stage's tests are tests/test_engine.py, its notebook 07's
TESTS = {s: f"tests/test_{name}.py" for s, name in LESSONS.items()} | {"07": "tests/test_engine.py"}
NOTEBOOKS = {s: os.path.basename(p) for s in LESSONS
             for p in glob.glob(os.path.join(ROOT, "notebooks", s + "_*.ipynb"))}

EXERCISES = [
    Exercise("01", "ContiguousKVCache.prepare",
             "give each new request a free row, check every length first, then return positions lens[row]..+n "
             "and set tok_slots = row * max_seq_len + position",
             "greedy decoding through your cache gives the no-cache tokens and logits; a request that does not fit is "
             "refused and leaves the cache untouched",
             ("test_cached_generation_equals_no_cache[c]", "test_overlong_prompt_is_refused_and_cache_stays_usable",
              "test_contiguous_cache_batches_against_a_brute_force_model",
              "test_contiguous_cache_fills_a_row_exactly")),
    Exercise("01", "KVCache.attend",
             "write k, v into the pools at tok_slots; decode: attend_table over the table; prefill: gather each "
             "request's slots with table_slots and attend_dense over them",
             "greedy decoding through the contiguous cache (its prefill and decode both attend here) gives the "
             "no-cache tokens and logits",
             ("test_cached_generation_equals_no_cache[c]",
              "test_contiguous_cache_batches_against_a_brute_force_model")),
    Exercise("02", "BlockManager.append",
             "need = blocks_needed(seq, n); refuse before changing anything; copy-on-write: a shared partly filled "
             "last block is released and replaced by a fresh one (return (src, dst)); then take the new blocks",
             "random appends, forks and frees keep the refcounts, the free list and every sequence's tokens exactly "
             "as a brute-force model says; a shared block is copied once",
             ("test_random_alloc_append_fork_free_keeps_invariants_and_contents[1]",
              "test_batch_estimate_counts_copy_on_write_once_per_shared_block", "test_clear_errors",
              "test_copy_on_write_only_for_a_shared_partial_block")),
    Exercise("02", "BlockManager.fork",
             "the child gets a copy of the parent's block table and token count; every shared block's refcount + 1",
             "a forked sequence reads its parent's tokens, and its own after it writes (copy-on-write)",
             ("test_random_alloc_append_fork_free_keeps_invariants_and_contents[1]", "test_clear_errors")),
    Exercise("02", "BlockManager.free",
             "KeyError for an unknown sequence; _release every block of its table (last first); forget its tokens",
             "freed blocks come back to the free list exactly when no other sequence holds them",
             ("test_random_alloc_append_fork_free_keeps_invariants_and_contents[1]", "test_clear_errors")),
    Exercise("02", "Scheduler.preempt",
             "count and log it; swap: append (req, kv.swap_out(rid)) to swapped, req.in_kv = False; recompute: "
             "release(req) and put it back at the head of waiting",
             "a pool too small for the trace preempts, and every request still finishes with its own KV intact",
             ("test_scheduler_preempts_and_keeps_every_request_kv", "test_preemption_order_against_the_policy")),
    Exercise("03", "TokenAllocator.alloc",
             "cum = (mem_state == 0).cumsum(0); the k-th free slot is searchsorted(cum, k) for k = 1..n; "
             "None if fewer than n are free; take them with _take",
             "alloc returns the lowest free slots, exactly as a brute-force Python list does, and refuses cleanly",
             ("test_random_ops_agree_with_brute_force", "test_exhaustion_is_a_clean_refusal")),
    Exercise("03", "TokenAllocator.alloc_contiguous",
             "c = free slots before i (cumsum, padded with 0); a run of n starts at i where c[i + n] - c[i] == n; "
             "take the first, else fall back to alloc(n)",
             "a run of n free slots is returned whenever one exists, the first one",
             ("test_alloc_contiguous_returns_a_run_whenever_one_exists[0.5]",
              "test_random_ops_agree_with_brute_force")),
    Exercise("03", "TokenAllocator.free",
             "unique slots with counts; refcount - count must stay >= 0 and indices in range (ValueError, nothing "
             "changed), then write the new refcounts and add the slots reaching 0 to n_free",
             "freeing drops one reference per slot; double frees and foreign slots are refused without a change",
             ("test_random_ops_agree_with_brute_force", "test_double_free_and_foreign_slots_are_detected")),
    Exercise("04", "_attend",
             "s = q k^T * qk_scale (log2 units), masked to -inf where not visible; m_new = max(m_i, rowmax s); "
             "rescale l_i and acc by exp2(m_i - m_new), add exp2(s - m_new) and its product with v",
             "the decode kernel equals float64 softmax attention (the online softmax over tiles)",
             ("test_matches_reference[float32-gqa4-d64-scat-s1]",)),
    Exercise("04", "_stage2",
             "load each split's lse (-inf for splits that hold no tokens) and partial output; weights "
             "exp2(lse - max lse); out = sum(w * o) / sum(w)",
             "splitting a sequence over several programs and merging their partial softmaxes gives the reference",
             ("test_empty_splits_and_custom_scale",)),
    Exercise("05", "RadixCache.match_prefix",
             "drop the last token if compute_last, keep whole pages, _walk the tree; the slots are the matched "
             "values concatenated (the tokens themselves without an allocator)",
             "matches, inserts and evictions give what a brute-force list of cached prompts gives",
             ("test_match_insert_evict_lock_vs_brute_force[0-1]", "test_split_lru_order_and_pretty_print")),
    Exercise("05", "RadixCache.insert",
             "_walk the full pages of tokens; the part not matched becomes a new leaf under the last node "
             "(its slots cloned, inc_ref'd, counted evictable); return how many were cached already",
             "the tree holds exactly the prompts inserted, shares their common prefixes, and counts refs right",
             ("test_match_insert_evict_lock_vs_brute_force[0-1]", "test_split_lru_order_and_pretty_print")),
    Exercise("05", "RadixCache.evict",
             "a heap of unlocked leaves by (last_access, serial); pop, free their slots, unlink them, push a parent "
             "left childless and unlocked; stop once n tokens are freed",
             "eviction frees the least recently used unlocked leaves first, never a locked one",
             ("test_match_insert_evict_lock_vs_brute_force[0-1]", "test_split_lru_order_and_pretty_print")),
    Exercise("05", 'POLICIES["lpm"]',
             "the waiting requests sorted by the length of their cached prefix (r.prefix), longest first; a stable "
             "sort, so ties stay first come first served",
             "longest-prefix-first admission caches at least as many prompt tokens as first come first served, and "
             "reaches the best possible order on a workload built for it",
             ("test_lpm_never_worse_than_fcfs_and_reaches_the_bound",
              "test_lpm_orders_longest_cached_prefix_first_ties_first_come")),
    Exercise("06", "TokenIndex.jump",
             "from state, while forced[s]: append the one byte with table[s] >= 0 and follow it; cache in self.jumps",
             "the compressed edges are exactly the DFA's chains of forced bytes",
             ("test_compressed_edges_are_the_forced_chains",
              "test_jump_is_the_forced_string_against_partial_matching")),
    Exercise("06", "TokenIndex.jump_forward",
             "append jump(state), cut to whole UTF-8 characters; re-tokenize text + it; keep the common token prefix "
             "with output; no jump (return what you got) if nothing is forced or it would pass limit or lose the room "
             "a shortest completion (self.dist) had",
             "jump-forward gives what a byte-by-byte walk of the forced text gives, and never takes the room a "
             "shortest completion needs",
             ("test_jump_forward_keeps_the_room_a_shortest_completion_had",)),
    Exercise("06", "constrained_decode",
             "loop: jump_forward (when on) and keep the K/V of the tokens it kept; stop where "
             "index.finish(state, room left) says so; else mask the logits to index.allowed(state, room left), "
             "sample, step the DFA",
             "every output matches the regex, with and without jump-forward, on random logits",
             ("test_fuzz_random_logits_always_match[(ab|cd){1,3}e?]",
              "test_constrained_decode_stops_at_max_new_tokens_and_eos")),
    Exercise("07", "Engine.step",
             "if requests wait, t0 += self.land(on_token) (decode's seconds); new = self.sched.admit(); on a GPU "
             "self.graphs.decode_ahead may land greedy steps (None: do one): batch, positions = self.schedule(new), "
             "ids = self.next_tokens(batch, self.forward(batch, positions)); self.postprocess each landed (batch, ids, "
             "steps); add the seconds to self.counts[kind + '_s']",
             "the engine serves the same greedy tokens with and without the radix cache, on every sharing backend, "
             "and its events account for every token of a run that preempts",
             ("test_radix_cache_same_tokens_on_every_sharing_backend[token]",
              "test_events_account_for_a_run_under_memory_pressure[token-recompute-False]")),
]


def exercises(stage=None) -> list:
    return [e for e in EXERCISES if stage in (None, e.stage)]


# -------- cutting a body out of a lesson -----------------------------------------------------------------

def _find(tree, qualname):
    node = tree
    for part in qualname.split("."):
        node = next(n for n in node.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
    return node


@functools.lru_cache(maxsize=16)
def _parse(source: str):
    return ast.parse(source)


def span(source: str, name: str):
    """(start, end, indent): the characters source[start:end] an exercise's attendee writes, a function's body
    after its docstring (whole lines, indent its column), or a lambda's expression in a dict, `POLICIES["lpm"]`
    (indent None)."""
    tree, lines = _parse(source), source.splitlines(keepends=True)
    at = lambda line, col: sum(map(len, lines[:line - 1])) + (len(lines[line - 1].encode()[:col].decode()) if col
                                                               else 0)  # ast's columns count UTF-8 bytes
    if m := re.fullmatch(r"(\w+)\[(.+)\]", name):  # a lambda in a dict
        d = next(n.value for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == m[1])
        e = next(v for k, v in zip(d.keys, d.values) if k.value == ast.literal_eval(m[2])).body
        return at(e.lineno, e.col_offset), at(e.end_lineno, e.end_col_offset), None
    fn = _find(tree, name)
    doc = isinstance(fn.body[0], ast.Expr) and isinstance(getattr(fn.body[0], "value", None), ast.Constant) and \
        isinstance(fn.body[0].value.value, str)
    first = fn.body[1] if doc and len(fn.body) > 1 else fn.body[0]
    return at(first.lineno, 0), at(fn.end_lineno + 1, 0), first.col_offset


def stub_text(ex: Exercise, indent) -> str:
    error = f"NotImplementedError({STUB + ex.hint!r})"
    return f"(_ for _ in ()).throw({error})" if indent is None else " " * indent + f"raise {error}\n"


def splice(source: str, bodies: dict) -> str:
    """source with what the attendee writes of each exercise in bodies, {name: text}, replaced by that text."""
    for a, b, _, name in sorted(((*span(source, n), n) for n in bodies), reverse=True):  # bottom up
        source = source[:a] + bodies[name] + source[b:]
    return source


def stub(source: str, exs) -> str:
    """source with each exercise's body replaced by raise NotImplementedError("your turn: <hint>")."""
    return splice(source, {e.name: stub_text(e, span(source, e.name)[2]) for e in exs})


def is_stub(source: str, ex: Exercise) -> bool:
    a, b, indent = span(source, ex.name)
    return source[a:b] == stub_text(ex, indent)


def body(source: str, name: str) -> str:
    """What the attendee writes of an exercise, as the lesson writes it (dedented)."""
    a, b, indent = span(source, name)
    return source[a:b] if indent is None else "".join(line[indent:] for line in source[a:b].splitlines(True))


def reference(stage: str) -> str:
    with open(os.path.join(ROOT, LESSONS[stage] + ".py"), encoding="utf-8") as f:
        return f.read()


# -------- which lessons a run takes from the workspace ----------------------------------------------------

class _Finder(importlib.abc.MetaPathFinder):
    """Imports lesson `name` from `folder` where it is there (lessons are imported by name)."""

    def __init__(self, folder, names):
        self.folder, self.names = folder, set(names)

    def find_spec(self, name, path=None, target=None):
        file = os.path.join(self.folder, name + ".py")
        if name not in self.names or not os.path.exists(file):
            return None
        spec = importlib.util.spec_from_file_location(name, file)  # tracebacks show this file...
        spec.origin = os.path.join(ROOT, name + ".py")  # ...and __file__ the lesson's, so tests/bench_0X.py is found
        return spec


def use(stages, folder=WORKSPACE, say=True):
    """Import these stages' lessons from `folder` (where there), every other lesson from the repository. Call it
    before anything imports a lesson. Returns the finder (sys.meta_path.remove it to undo)."""
    finder = _Finder(folder, [LESSONS[s] for s in stages])
    sys.meta_path.insert(0, finder)
    for s in stages if say else ():
        mine = os.path.exists(os.path.join(folder, LESSONS[s] + ".py"))
        print(f"{LESSONS[s]}: {'your copy in' if mine else 'the reference (not started in'} "
              f"{os.path.relpath(folder)}{'' if mine else ')'}")
    return finder


def started(folder=WORKSPACE) -> list:
    return [s for s, name in LESSONS.items() if os.path.exists(os.path.join(folder, name + ".py"))]


def stages_of(args) -> list:
    """The stages whose test files a pytest command line names (none named: every stage)."""
    named = sorted({s for a in args for s, t in TESTS.items() if os.path.basename(str(a).split("::")[0]) == t[6:]})
    return named or list(LESSONS)


class Grader:
    """pytest plugin (conftest registers it under --workspace): imports the graded stages from the workspace and
    says, for each failing test, which exercise it grades, what it checks and the hint."""

    def __init__(self, config):
        self.folder = os.path.abspath(config.getoption("workspace_dir") or WORKSPACE)
        self.stages = [s for s in stages_of(config.args) if s in started(self.folder)]
        self.finder = use(self.stages, self.folder, say=False)
        self.report_path = config.getoption("workspace_report")
        self.results = {}  # test id -> [outcome, ids of the exercises it blames, why]

    def pytest_unconfigure(self, config):
        if self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)

    def pytest_report_header(self, config):
        where = os.path.relpath(self.folder, ROOT)
        return (f"workshop: stages {', '.join(self.stages)} from {where}/, the rest from the reference lessons"
                if self.stages else f"workshop: nothing started in {where}/ (python tests/workshop.py start 03): "
                                    "this run grades the reference lessons")

    def source(self, stage) -> str:
        with open(os.path.join(self.folder, LESSONS[stage] + ".py"), encoding="utf-8") as f:
            return f.read()

    def explain(self, item, call):
        """(the exercises a failing test blames, what to tell the attendee)."""
        stage = next((s for s in self.stages if item.nodeid.split("::")[0].endswith(TESTS[s])), None)
        if stage is None:
            return [], ""
        lesson = LESSONS[stage]
        err = str(call.excinfo.value) if call.excinfo else ""
        todo = [e for e in exercises(stage) if STUB + e.hint in err]
        if todo:
            where = os.path.relpath(os.path.join(self.folder, lesson + ".py"))
            return todo[:1], f"{todo[0].id} is not written yet ({where}).\n  hint: {todo[0].hint}"
        src = self.source(stage)
        graders = [e for e in exercises(stage) if graded(e, item.nodeid) and not is_stub(src, e)]
        if not graders:
            return [], ("this test checks more of the lesson than its exercises; compare your copy with the "
                        f"reference: diff {lesson}.py {os.path.relpath(os.path.join(self.folder, lesson))}.py")
        if len(graders) == 1:
            e = graders[0]
            return graders, f"{e.id} gives a wrong answer: this test checks that {e.checks}.\n  hint: {e.hint}"
        return graders, f"one of {', '.join(e.id for e in graders)} gives a wrong answer; this test checks that\n" + \
            "\n".join(f"  {e.name}: {e.checks}.\n    hint: {e.hint}" for e in graders)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        rep = (yield).get_result()
        if rep.failed:
            blame, text = self.explain(item, call)
            if text:
                rep.sections.append(("workshop", text))
            why = [line[2:].strip() for line in rep.longreprtext.splitlines() if line.startswith("E ")
                   and line[2:].strip()][:2]
            self.results[item.nodeid] = ["failed", [e.id for e in blame], " / ".join(why)[:300]]
        elif rep.when == "call" or rep.skipped:
            self.results[item.nodeid] = [rep.outcome, [], ""]

    def pytest_terminal_summary(self, terminalreporter):
        if self.report_path:
            with open(self.report_path, "w") as f:
                json.dump(self.results, f)
        if self.stages:
            terminalreporter.section("workshop")
        for s in self.stages:
            src = self.source(s)
            for e in exercises(s):
                terminalreporter.line(f"  {status_of(e, self.results, is_stub(src, e)):8} {e.id}")


def graded(ex: Exercise, nodeid: str) -> bool:
    """Does test nodeid grade ex? ("name" names every case of a parametrized test, "name[p]" one)."""
    file, _, name = nodeid.partition("::")
    return file.endswith(TESTS[ex.stage]) and (name in ex.tests or name.split("[")[0] in ex.tests)


def status_of(ex: Exercise, results: dict, stubbed: bool) -> str:
    """to do: its stub is still there; fails: a test failed on it; passes: its tests ran and passed; blocked:
    its tests stopped at another exercise first; not run. results: {test id: [outcome, exercises blamed, why]}."""
    if stubbed:
        return "to do"
    mine = [r for n, r in results.items() if graded(ex, n)]
    if any(ex.id in blame for _, blame, _ in mine):
        return "fails"
    if mine and all(o != "failed" for o, _, _ in mine):
        return "passes" if any(o == "passed" for o, _, _ in mine) else "skipped"
    return "blocked" if mine else "not run"  # blocked: progress grades it alone


# -------- the commands ------------------------------------------------------------------------------------

def start(stage, force=False, folder=WORKSPACE, say_next=True):
    path = os.path.join(folder, LESSONS[stage] + ".py")
    rel = os.path.relpath(path, ROOT)
    if os.path.exists(path) and not force:
        print(f"{rel} exists (your work): not overwritten; `start {stage} --force` starts it again "
              f"(the old copy is kept as {rel}.bak)")
        return 1
    os.makedirs(folder, exist_ok=True)
    if os.path.exists(path):
        shutil.copyfile(path, path + ".bak")
    src = stub(reference(stage), exercises(stage))
    with open(path, "w", encoding="utf-8") as f:
        f.write(src)
    print(f"wrote {rel}: {len(exercises(stage))} exercises, each raising NotImplementedError until you write it")
    for line, e in sorted((src[:span(src, e.name)[0]].count("\n") + 1, e) for e in exercises(stage)):
        print(f"  line {line:4}  {e.name}: {e.hint}")
    if stage == "04":
        print("04's kernels run on a CPU through Triton's interpreter (TRITON_INTERPRET=1, set for you); Triton has "
              "Linux wheels only: on macOS or Windows do 04 on a Linux machine")
    test = TESTS[stage]
    say_next and print(f"next: read {LESSONS[stage]}.py (the reference: do not peek at these functions), run it, open "
          f"notebooks/{NOTEBOOKS[stage]},\nthen write the functions in {rel} and check them with\n"
          f"  python -m pytest {test} --workspace -x\n  python tests/workshop.py progress")
    return 0


class Runner:
    """pytest.main in this process, once per case, the lessons and test files imported afresh each time and the
    model loaded once: ~1 s a case where a fresh pytest process takes ~5 (torch, the model)."""

    def __init__(self):
        os.chdir(ROOT)
        sys.path.insert(0, ROOT)
        os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # only pytest and the conftest: no plugins to rewrite
        import llama3_generate as L
        L.load_model = functools.lru_cache(None)(L.load_model)
        self.L, self.tmp = L, tempfile.mkdtemp()
        self.log = ""

    def __call__(self, stage, source, tests, plain=False) -> tuple:
        """Run tests of the stage's test file on source as its lesson: (rc, {test id: [outcome, blamed, why]})."""
        import contextlib
        import io
        with open(os.path.join(self.tmp, LESSONS[stage] + ".py"), "w", encoding="utf-8") as f:
            f.write(source)
        for name in [n for n in sys.modules if re.match(r"(test_)?0\d_|test_engine$|llama3_generate$", n)]:
            del sys.modules[name]  # imported afresh: the workspace's where this stage is graded
        if stage != "07":
            sys.modules["llama3_generate"] = self.L  # the reference engine, its model loaded once
        report, log = os.path.join(self.tmp, "report.json"), io.StringIO()
        if os.path.exists(report):
            os.remove(report)
        quiet = [a for p in ("cacheprovider", "unraisableexception", "threadexception", "faulthandler")
                 for a in ("-p", "no:" + p)]
        args = [f"{TESTS[stage]}::{t}" for t in sorted(tests)] + ["--assert=plain"] * plain + [
            "-q", "-x", "--workspace", "--workspace-dir", self.tmp, "--workspace-report", report, *quiet]
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            rc = pytest.main(args)
        self.log = log.getvalue()
        return rc, json.load(open(report)) if os.path.exists(report) else {}


def grade(stages, folder=WORKSPACE, run=None) -> dict:
    """{exercise: "passes" | "fails" | "to do" | "not started"}: each exercise written is graded alone, the
    lesson's code standing in for every other exercise, so alloc passes before free is written."""
    status = {}
    for s in stages:
        path = os.path.join(folder, LESSONS[s] + ".py")
        if not os.path.exists(path):
            status.update({e: "not started" for e in exercises(s)})
            continue
        with open(path, encoding="utf-8") as f:
            src = f.read()
        ref = reference(s)
        for e in exercises(s):
            if is_stub(src, e):
                status[e] = "to do"
                continue
            a, b, _ = span(src, e.name)
            run = run or Runner()
            rc, got = run(s, splice(ref, {e.name: src[a:b]}), e.tests)
            mine = [o for n, (o, _, _) in got.items() if graded(e, n)]
            status[e] = "fails" if "failed" in mine or rc not in (0, 1) else "passes" if "passed" in mine else "not run"
            if status[e] == "fails":
                why = [f"{n.split('::')[-1]}: {w}" for n, (o, _, w) in got.items() if o == "failed"]
                status[e] += "   " + (why[0] if why else run.log.strip().splitlines()[-1])
    return status


def progress(folder=WORKSPACE):
    status = grade(list(LESSONS), folder)
    print(f"{'stage':5}  {'exercise':32} status")
    for e in EXERCISES:
        print(f"{e.stage:5}  {e.name:32} {status[e]}")
    print(f"{sum(v == 'passes' for v in status.values())} of {len(status)} exercises pass "
          "(each graded alone: the lesson's code stands in for the others)")


def verify(stages=None, say=print) -> list:
    """CI's proof that every exercise is graded: the lesson with only that body cut out fails the tests that grade
    it, blaming it, and the untouched lesson passes them all. Returns the problems (none: all is well)."""
    import time
    run = Runner()
    stages = stages or [s for s in LESSONS if exercises(s) and (s != "04" or importlib.util.find_spec("triton"))]
    problems = []
    for s in stages:
        for cut in [None] + exercises(s):
            t0 = time.perf_counter()
            tests = {t for e in ([cut] if cut else exercises(s)) for t in e.tests}
            rc, got = run(s, reference(s) if cut is None else stub(reference(s), [cut]), tests, plain=True)
            if cut is None:
                bad = [e.id for e in exercises(s) if status_of(e, got, False) != "passes"]
                ok = rc == 0 and not bad
                what = f"{s} untouched: {'passes' if ok else 'FAILS ' + ', '.join(bad)}"
            else:
                ok = rc == 1 and status_of(cut, got, False) == "fails"
                what = f"{cut.id} cut out: {'fails, as it must' if ok else 'NOT caught (rc %s)' % rc}"
            say(f"  {what} ({time.perf_counter() - t0:.1f} s)")
            if not ok:
                problems.append(what + "\n" + run.log[-3000:])
    return problems


def your_turn(stage) -> str:
    """The "Your turn" cell that ends the stage's notebook (`python tests/workshop.py notebooks` writes them)."""
    name, test = LESSONS[stage], TESTS[stage]
    rows = "\n".join(f"| `{e.name}` | {e.checks} | {', '.join(f'`{t}`' for t in e.tests)} |" for e in exercises(stage))
    triton = ("\n\nOn a CPU the kernels run in Triton's interpreter (`TRITON_INTERPRET=1`, set for you); Triton has "
              "Linux wheels only, so on macOS or Windows do this stage on a Linux machine.") if stage == "04" else ""
    return f"""## Your turn

Write this lesson's idea yourself: `python tests/workshop.py start {stage}` copies `{name}.py` into `workspace/`
(git ignores it) with these bodies cut out, each raising `NotImplementedError` with a hint:

| exercise | its tests check that | graded by (in `{test}`) |
|---|---|---|
{rows}

Write them in `workspace/{name}.py`, then

    python -m pytest {test} --workspace -x    # a failure names the exercise, what it checks, the hint
    python tests/workshop.py progress    # each exercise graded alone: passes, fails (and why), to do

Run this notebook on your code: `WORKSHOP=1 jupyter lab` (its first cell then imports `workspace/{name}.py`).{triton}"""


def write_notebooks():
    import nbformat
    for stage, name in LESSONS.items():
        path = os.path.join(ROOT, "notebooks", NOTEBOOKS[stage])
        nb = nbformat.read(path, as_version=4)
        ours = nb.cells[-1].source.startswith("## Your turn")
        cell = nbformat.v4.new_markdown_cell(your_turn(stage), **({"id": nb.cells[-1].id} if ours else {}))
        nb.cells[-1:] = [cell] if ours else [nb.cells[-1], cell]
        nbformat.write(nb, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("start", help="write workspace/<lesson>.py with the stage's exercises to do")
    st.add_argument("stage", help="01 .. 06, or all")
    st.add_argument("--force", action="store_true", help="start again (your copy is kept as .bak)")
    pr = sub.add_parser("progress", help="which exercises pass")
    for p in (st, pr):
        p.add_argument("--dir", default=WORKSPACE, help="the workspace folder (default: workspace/)")
    sub.add_parser("list", help="every exercise, its hint and the tests that grade it")
    so = sub.add_parser("solution", help="print the reference body of an exercise (stuck? read it, then write yours)")
    so.add_argument("stage")
    so.add_argument("name", help="TokenAllocator.alloc, or alloc")
    sub.add_parser("notebooks", help="(maintainers) rewrite each lesson notebook's last cell, \"Your turn\"")
    ve = sub.add_parser("verify", help="(CI) each exercise cut out alone fails its tests; the lesson passes them")
    ve.add_argument("stages", nargs="*")
    a = ap.parse_args(argv)
    if a.cmd == "start":
        stages = list(LESSONS) if a.stage == "all" else [a.stage.zfill(2)]
        if any(s not in LESSONS for s in stages):
            ap.error(f"no stage {a.stage!r}: choose from {', '.join(LESSONS)} or all")
        rc = max(start(s, a.force, a.dir, say_next=len(stages) == 1) for s in stages)
        if len(stages) > 1:
            print("next, stage by stage: read the lesson, run it, open its notebook, write its functions in "
                  f"{os.path.relpath(a.dir)}/, and check them with\n  python -m pytest tests/test_0N_....py "
                  "--workspace -x\n  python tests/workshop.py progress")
        return rc
    if a.cmd == "progress":
        return progress(a.dir)
    if a.cmd == "solution":
        e = next((e for e in exercises(a.stage.zfill(2)) if e.name == a.name or e.name.endswith("." + a.name)), None)
        if e is None:
            ap.error(f"no exercise {a.name!r} in stage {a.stage}: `python tests/workshop.py list` lists them")
        return print(body(reference(e.stage), e.name).rstrip("\n"))
    if a.cmd == "notebooks":
        return write_notebooks()
    if a.cmd == "verify":
        problems = verify(a.stages)
        print("\n".join(problems) or "every exercise is graded")
        return int(bool(problems))
    for e in EXERCISES:
        print(f"{e.id}: {e.hint}\n    checks: {e.checks}\n    graded by: {', '.join(e.tests)}")


if __name__ == "__main__":
    sys.exit(main())
