"""01_kv_cache: (a) no cache, (b) StaticKVCache, (c) ContiguousKVCache agree on the real model; the pool accounting is
exact (checked slot by slot against a brute-force painting); over-long requests are refused without damage."""
import importlib
import json
import os

import numpy as np
import pytest
import torch
from helpers import ROOT, backend_against_brute_force, refuses

import llama3_generate as L

m = importlib.import_module("01_kv_cache")
N_NEW = 16


@pytest.fixture(scope="module")
def three_ways(smollm):
    """Greedy tokens and logits of the three ways; caches poisoned with NaN (a stale read shows)."""
    model, tok = smollm
    prompt, static = tok.chat("Name three colours."), m.StaticKVCache(model, 128)
    static.k.fill_(float("nan")), static.v.fill_(float("nan"))
    contig = m.ContiguousKVCache.for_model(model, max_batch=2, max_seq_len=128)
    contig.k_cache.fill_(float("nan")), contig.v_cache.fill_(float("nan"))
    return model, prompt, {"a": m.greedy(model, prompt, N_NEW), "b": m.greedy(model, prompt, N_NEW, static),
                           "c": m.generate_contiguous(model, prompt, N_NEW, kv=contig)}


def test_no_cache_matches_one_teacher_forced_pass(three_ways):
    """(a) against an independent reference: one forward over prompt + generated tokens gives every step's logits."""
    model, prompt, runs = three_ways
    tokens, logits = runs["a"]
    assert len(tokens) == N_NEW and logits.shape == (N_NEW, model.args.vocab_size)
    assert tokens == logits.argmax(-1).tolist()  # greedy
    seq = torch.tensor(prompt + tokens[:-1])
    full = model(seq, torch.arange(len(seq)), L.NoCache())[len(prompt) - 1:]  # (N_NEW, vocab)
    torch.testing.assert_close(logits, full, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("way", ["b", "c"])
def test_cached_generation_equals_no_cache(three_ways, way):
    _, _, runs = three_ways
    tokens, logits = runs[way]
    assert tokens == runs["a"][0]
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits, runs["a"][1], atol=1e-3, rtol=1e-4)  # fp32: only summation order differs


def test_overlong_prompt_is_refused_and_cache_stays_usable(three_ways):
    model, prompt, runs = three_ways
    kv = m.ContiguousKVCache.for_model(model, max_batch=2, max_seq_len=len(prompt) + 4)
    kv.k_cache.normal_(), kv.v_cache.normal_()
    k0, v0 = kv.k_cache.clone(), kv.v_cache.clone()
    for prompts in ([prompt + prompt], [prompt, prompt + [1] * 5]):  # alone, and behind a request that fits
        refuses(ValueError, L.generate, model, kv, prompts, 2, match="exceed max_seq_len")
        assert kv.rows == {} and kv.free_rows == [0, 1] and kv.lens == [0, 0]  # no row leaked
        assert torch.equal(kv.k_cache, k0) and torch.equal(kv.v_cache, v0)  # not one slot written
    assert L.generate(model, kv, [prompt], 3) == [runs["a"][0][:3]]  # the same cache still works
    kv.prepare(["x"], [len(prompt)])  # a request that grows past max_seq_len is refused without moving
    refuses(ValueError, kv.prepare, ["x", "y"], [5, 1], match="exceed max_seq_len")
    assert kv.lens[kv.rows["x"]] == len(prompt) and "y" not in kv.rows
    refuses(ValueError, kv.prepare, ["x", "x"], [1, 1], match="duplicate")
    static = m.StaticKVCache(model, 8)
    refuses(ValueError, static.prepare, [0], [9], match="exceed max_seq_len")
    assert static.len == 0


def test_reservation_schemes():
    rng = np.random.default_rng(1)
    prompt, output = rng.integers(1, 300, 500), rng.integers(1, 300, 500)
    need, pow2 = prompt + output, m.reservation("pow2", prompt, output, 4096)
    assert all(p == min(q for q in (2 ** i for i in range(13)) if q >= n) for p, n in zip(pow2, need))
    assert (pow2 >= need).all() and (pow2 < 2 * need).all()
    assert (m.reservation("oracle", prompt, output, 4096) == need).all()
    assert (m.reservation("max_len", prompt, output, 600) == 600).all()
    assert (m.reservation("pow2", prompt, output, 600) <= 600).all()
    refuses(ValueError, m.reservation, "buddy", prompt, output, 600, match="unknown scheme")


def brute_force_paint(running, prompt, output, reserve, pool):
    """Label every slot by walking each extent one slot at a time; detects overlaps and out-of-pool extents."""
    label = ["external"] * pool
    for start, size, r, g in running:
        assert size == reserve[r] and 0 <= start and start + size <= pool
        assert prompt[r] <= prompt[r] + g < prompt[r] + output[r] <= size
        for i in range(size):
            assert label[start + i] == "external", "two extents overlap"
            label[start + i] = "live" if i < prompt[r] + g else "future" if i < prompt[r] + output[r] else "internal"
    return label


@pytest.mark.parametrize("seed", range(6))
def test_accounting_adds_up_to_the_pool_on_random_traces(seed):
    rng = np.random.default_rng(seed)
    max_seq_len = int(rng.integers(8, 80))
    prompt, output = m.synthetic_trace(["sharegpt", "alpaca"][seed % 2], int(rng.integers(20, 60)), seed, max_seq_len,
                                       sigma=float(rng.uniform(0.3, 1.5)))
    pool = int(rng.integers(max_seq_len, 6 * max_seq_len))
    for scheme in m.SCHEMES:
        reserve, n_snap = m.reservation(scheme, prompt, output, max_seq_len), 0
        for running, n_waiting in m.simulate(prompt, output, reserve, pool):
            counts = m.breakdown(running, prompt, output, pool)
            assert sum(counts.values()) == pool and min(counts.values()) >= 0
            label = brute_force_paint(running, prompt, output, reserve, pool)
            assert counts == {c: label.count(c) for c in m.CATEGORIES}
            owner, cat = m.paint(running, prompt, output, pool)  # the figure's map agrees too
            assert [m.CATEGORIES[c] for c in cat] == label
            head = len(prompt) - n_waiting  # FCFS: the head of the queue really fits in no free run of slots
            runs = "".join("x" if s == "external" else "." for s in label).split(".")
            assert max(map(len, runs)) < reserve[head] and all(r < head for _, _, r, _ in running)  # nobody overtook
            n_snap += 1
        res = m.account(prompt, output, scheme, pool, max_seq_len) if n_snap else None
        if res:
            assert res["steps"] == n_snap and abs(sum(res[c] for c in m.CATEGORIES) - 1) < 1e-12


def test_accounting_by_hand():
    """Pool 10, oracle: A (2+2) at 0..3, B (3+2) at 4..8, C (4+1 = 5 slots) waits: 1 free slot for two steps."""
    prompt, output = np.array([2, 3, 4]), np.array([2, 2, 1])
    res = m.account(prompt, output, "oracle", 10, 16)
    assert res["steps"] == 2 and res["batch"] == 2
    assert [res[c] for c in m.CATEGORIES] == pytest.approx([(5 + 7) / 20, (4 + 2) / 20, 0, 2 / 20])
    assert res["snapshot"] == [[0, 4, 0, 0], [4, 5, 1, 0]]
    refuses(ValueError, m.account, prompt, output, "max_len", 10, 16, match="pool has only")


def test_memory_report_and_cli_errors(tmp_path):
    rep = m.memory_report(n_requests=300, pool_tokens=8192, max_seq_len=1024, plot=str(tmp_path / "pool.png"))
    json.dumps(rep)
    live = rep["live_fraction"]
    assert set(live) == {"max_len", "pow2", "oracle"} and live["max_len"] < live["pow2"] < live["oracle"]
    for res in rep["traces"].values():
        assert res["max_len"]["batch"] == 8192 // 1024 and res["max_len"]["batch"] < res["oracle"]["batch"]
        for r in res.values():
            assert abs(sum(r[c] for c in m.CATEGORIES) - 1) < 1e-3
    assert (tmp_path / "pool.png").stat().st_size > 10_000
    for argv in (["--pool-tokens", "100"], ["--requests", "0"], ["--max-seq-len", "x"]):
        assert refuses(SystemExit, m.main, argv).code != 0


def test_lessons_never_import_the_model_in_their_core():
    """Imports run one way: a numbered file imports the model only inside a module-level function (its demos)."""
    import ast
    import glob
    for path in sorted(glob.glob(os.path.join(ROOT, "0*.py"))):
        tree, bad = ast.parse(open(path).read()), []

        def visit(node, where):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    names = [a.name for a in child.names] + [getattr(child, "module", None) or ""]
                    if "llama3_generate" in names and where != "function":
                        bad.append(child.lineno)
                inner = ("function" if where == "module" else where) if isinstance(
                    child, (ast.FunctionDef, ast.AsyncFunctionDef)) else "class" if isinstance(child, ast.ClassDef) \
                    else where
                visit(child, inner)
        visit(tree, "module")
        assert not bad, f"{os.path.basename(path)} imports llama3_generate outside a demo function at lines {bad}"


def test_backends_run_without_the_model_module():
    """Every backend, 05's simulation and 06's decode run with llama3_generate never imported."""
    import subprocess
    import sys
    code = """
import importlib, importlib.util, sys, torch
m = {n: importlib.import_module(n) for n in ("01_kv_cache", "02_paged_cache_manager", "03_token_allocator",
                                             "05_radix_scheduler")}
kvs = [m["01_kv_cache"].ContiguousKVCache(1, 2, 32, 2, 16), m["02_paged_cache_manager"].PagedKVCache(1, 8, 4, 2, 16),
       m["03_token_allocator"].TokenKVCache(1, 64, 2, 16, 4, 32)]
if importlib.util.find_spec("triton"):  # 04's kernels (Linux); the other backends run everywhere
    m04, token = importlib.import_module("04_triton_token_attn"), m["03_token_allocator"].TokenKVCache(1, 64, 2, 16, 4, 32)
    token.decode_attn, token.extend_attn = m04.token_decode_attention, m04.token_extend_attention
    kvs.append(token)
for kv in kvs:
    for n_new in ([5, 3], [1, 1]):
        kv.prepare([0, 1], n_new)
        t = sum(n_new)
        out = kv.attend(0, torch.randn(t, 4, 16), torch.randn(t, 2, 16), torch.randn(t, 2, 16))
        assert out.shape == (t, 4, 16) and torch.isfinite(out).all()
m["05_radix_scheduler"].simulate([([1, 2, 3], [4, 5], None), ([1, 2], [6], None)], 16, "lpm", check=True)
m6 = importlib.import_module("06_jump_forward_fsm")
class Tok:  # bytes as tokens
    special, eos_id = {"<eos>": 0}, 0
    vocab = [b"<eos>"] + [bytes([b]) for b in range(256)]
    vocab_size, token_bytes = len(vocab), vocab.__getitem__
r = m6.constrained_decode(m6.TokenIndex("(ab|cd){1,3}", Tok()), Tok(), [1, 2], lambda ids, keep: torch.randn(257),
                          20, jump_forward=False, temperature=1.0)
assert r["finished"] and __import__("re").fullmatch("(ab|cd){1,3}", r["text"]), r
assert "llama3_generate" not in sys.modules, "a backend imported the model module"
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr[-2000:]


@pytest.mark.parametrize("seed", range(3))
def test_contiguous_cache_batches_against_a_brute_force_model(seed):
    """Many requests through one ContiguousKVCache (no model): each token's slot is row * max_seq_len + position."""
    kv = m.ContiguousKVCache(1, 3, 12, 2, 8)
    backend_against_brute_force(kv, seed)
    assert sorted(kv.free_rows) == [0, 1, 2], f"after every request was freed, the free rows are {kv.free_rows}"
    assert kv.lens == [0] * 3, f"after every request was freed, the rows' lengths are {kv.lens}"


def test_contiguous_cache_fills_a_row_exactly():
    """A request of exactly max_seq_len tokens fits (one more is refused); every row can be taken, and a freed row
    is taken again from position 0."""
    kv = m.ContiguousKVCache(1, 2, 6, 1, 4)
    got = kv.prepare(["a"], [6]).tolist()
    assert got == list(range(6)), f"prepare(['a'], [6]) on rows of 6 returned positions {got}; want 0..5"
    refuses(ValueError, kv.prepare, ["a"], [1], what="prepare(['a'], [1]) with 'a' holding max_seq_len = 6 tokens")
    refuses(ValueError, kv.prepare, ["new", "a"], [1, 1], what="prepare(['new', 'a'], [1, 1]) with 'a' full")
    assert "new" not in kv.rows and kv.free_rows == [1], (
        f"a refused prepare(['new', 'a'], [1, 1]) gave 'new' a row (rows {kv.rows}, free {kv.free_rows}): check "
        "everything before changing anything")
    got = kv.prepare(["b"], [5]).tolist() + kv.prepare(["b"], [1]).tolist()
    assert got == list(range(6)), f"prepare(['b'], [5]) then prepare(['b'], [1]) gave positions {got}; want 0..5"
    refuses(ValueError, kv.prepare, ["c"], [1], what="prepare(['c'], [1]) with both rows taken")
    for _ in range(3):  # free and take again, more times than there are rows
        kv.free("a")
        got = kv.prepare(["c"], [2]).tolist()
        assert got == [0, 1] and kv.batch_lens.tolist() == [2], (
            f"a request in a freed row got positions {got}, batch_lens {kv.batch_lens.tolist()}; want [0, 1], [2]")
        kv.free("c")
        assert kv.prepare(["a"], [1]).tolist() == [0], "a request in a freed row must start at position 0"
    assert kv.used() == 2 * 6 and sorted(kv.rows) == ["a", "b"], f"rows {kv.rows}, {kv.used()} slots used"
