"""03: the token allocator against a brute-force Python model, and the token-pool backend against 01 and NoCache."""
import importlib
import json
import random

import pytest
import torch
from helpers import backend_against_brute_force, dense_reference, random_model, refuses, tiny_model

m = importlib.import_module("03_token_allocator")


class BruteForce:
    """The spec in plain Python: a refcount list; alloc takes the lowest free slots, contiguous takes the first run."""

    def __init__(self, size):
        self.ref = [0] * size

    def free_slots(self):
        return [i for i, r in enumerate(self.ref) if r == 0]

    def first_run(self, n):
        run = 0
        for i, r in enumerate(self.ref):
            run = run + 1 if r == 0 else 0
            if run == n:
                return list(range(i - n + 1, i + 1))
        return None

    def alloc(self, n, contiguous=False):
        free = self.free_slots()
        if n > len(free):
            return None
        got = (contiguous and n > 0 and self.first_run(n)) or free[:n]
        for i in got:
            self.ref[i] = 1
        return got


def same_state(a, bf, after="the last call"):
    got = a.mem_state.tolist()
    bad = [i for i, (x, y) in enumerate(zip(got, bf.ref)) if x != y][:6]
    assert not bad, (f"after {after}, the refcounts of slots {bad} are {[got[i] for i in bad]}; a brute-force "
                     f"model of the pool says {[bf.ref[i] for i in bad]}")
    assert a.available() == bf.ref.count(0), (f"after {after}, n_free says {a.available()} slots are free; "
                                              f"{bf.ref.count(0)} are (refcount 0)")
    a.check()


def pool(size, held):
    """A TokenAllocator of size slots with `held` taken (refcount 1), and its brute-force model."""
    a, bf = m.TokenAllocator(size), BruteForce(size)
    a.mem_state[list(held)] = 1
    a.n_free = size - len(held)
    for i in held:
        bf.ref[i] = 1
    return a, bf


def show(bf):
    return "".join("x" if r else "." for r in bf.ref) + " (x: held, .: free)"


def test_alloc_takes_the_lowest_free_slots():
    """alloc(n) on small pools: the n lowest free slots, taken; None (nothing taken) when fewer than n are free."""
    for size, held in ((8, [1, 2, 5]), (5, []), (4, [0, 1, 2, 3]), (6, [0, 5])):
        for n in range(size + 2):
            a, bf = pool(size, held)
            picture, got = show(bf), a.alloc(n)
            want = bf.alloc(n)
            if want is None:
                assert got is None, f"alloc({n}) on the pool {picture} returned {got.tolist()}; want None: " \
                    f"only {size - len(held)} slots are free"
            else:
                assert got is not None, f"alloc({n}) on the pool {picture} returned None; want slots {want}"
                assert isinstance(got, torch.Tensor), f"alloc({n}) returned a {type(got).__name__}; want a tensor"
                assert got.tolist() == want, f"alloc({n}) on the pool {picture} returned slots {got.tolist()}; " \
                    f"want the {n} lowest free ones, {want}"
            same_state(a, bf, f"alloc({n}) on the pool {picture}")


def test_alloc_contiguous_takes_the_first_run():
    """alloc_contiguous(n) on small pools: the first run of n free slots, at the start, the end, or in between;
    no run: n scattered free slots (alloc's); fewer than n free: None."""
    for size, held in ((8, [2, 5]), (6, [0, 1]), (6, [4, 5]), (7, [1, 3, 5]), (5, []), (3, [0, 1, 2])):
        for n in range(1, size + 2):
            a, bf = pool(size, held)
            picture, run = show(bf), bf.first_run(n)
            got, want = a.alloc_contiguous(n), bf.alloc(n, contiguous=True)
            if want is None:
                assert got is None, f"alloc_contiguous({n}) on the pool {picture} returned {got.tolist()}; " \
                    f"want None: only {size - len(held)} slots are free"
            else:
                assert got is not None, f"alloc_contiguous({n}) on the pool {picture} returned None; want {want}"
                what = "the first run of free slots" if run else "no run exists: the lowest free slots (alloc)"
                assert got.tolist() == want, f"alloc_contiguous({n}) on the pool {picture} returned " \
                    f"{got.tolist()}; want {want}, {what}"
            same_state(a, bf, f"alloc_contiguous({n}) on the pool {picture}")


def test_free_drops_one_reference_per_slot_listed():
    """free on a pool of 8: one reference less per slot listed (repeats count); a slot that is free or out of range
    is a ValueError, and nothing changes."""
    a, bf = pool(8, [0, 1, 2, 3, 7])  # 7 held: a slot index 8 or -1 must not reach it
    a.mem_state[1] = bf.ref[1] = 3  # slot 1 shared (inc_ref)
    for slots, ok in (([-1], False), ([8], False), ([0], True), ([1], True), ([1, 1], True), ([2, 2], False),
                      ([5], False), ([3, 0], False), ([2, 3], True), ([], True)):
        picture, refs = show(bf), list(bf.ref)
        if ok:
            a.free(torch.tensor(slots, dtype=torch.long))
            for i in slots:
                bf.ref[i] -= 1
            same_state(a, bf, f"free({slots}) with refcounts {refs}")
            continue
        why = "a slot out of range" if min(slots) < 0 or max(slots) >= 8 else "a slot would drop below 0"
        refuses(ValueError, a.free, torch.tensor(slots, dtype=torch.long),
                what=f"free({slots}) with refcounts {refs} ({why})")
        same_state(a, bf, f"free({slots}) was refused (it must change nothing)")


def test_random_ops_agree_with_brute_force():
    rng, size = random.Random(1234), 97
    a, bf = m.TokenAllocator(size), BruteForce(size)
    held = []  # slot lists we own one reference to
    for step in range(1500):
        op = rng.random()
        if op < 0.45:
            n, contiguous = rng.choice([0, 1, 2, 3, 7, 16, 40, 120]), rng.random() < 0.5
            got = (a.alloc_contiguous if contiguous else a.alloc)(n)
            before, want = show(bf), bf.alloc(n, contiguous)
            assert (None if got is None else got.tolist()) == want, (
                f"step {step}: {'alloc_contiguous' if contiguous else 'alloc'}({n}) returned "
                f"{None if got is None else got.tolist()}; want {want}, on the pool {before}")
            if want:
                held.append(want)
        elif op < 0.8 and held:
            slots = held.pop(rng.randrange(len(held)))
            part = rng.sample(slots, rng.randint(1, len(slots)))  # free a random subset, in any order
            a.free(torch.tensor(part))
            for i in part:
                bf.ref[i] -= 1
            same_state(a, bf, f"step {step}: free({part})")
            if len(part) < len(slots):
                held.append([i for i in slots if i not in part])
        elif op < 0.9 and held:
            slots = rng.choice(held)
            a.inc_ref(torch.tensor(slots))
            for i in slots:
                bf.ref[i] += 1
            held.append(list(slots))
        else:  # an invalid free: a currently free slot, never allocated -> error, nothing changes
            free = bf.free_slots()
            if free and held:
                bad = rng.choice(held) + [rng.choice(free)]
                refuses(ValueError, a.free, torch.tensor(bad), what=f"step {step}: free({bad}), slot {bad[-1]} free")
                same_state(a, bf, f"step {step}: free({bad}) (slot {bad[-1]} is free: a ValueError, no change)")
        same_state(a, bf, f"step {step}")
    for slots in held:
        a.free(torch.tensor(slots))
    assert a.available() == size, f"every slot was freed, but {a.available()} of {size} are available"
    assert a.mem_state.abs().sum() == 0, "every slot was freed, but mem_state still counts references"


@pytest.mark.parametrize("density", [0.1, 0.5, 0.8, 0.95])
def test_alloc_contiguous_returns_a_run_whenever_one_exists(density):
    g = torch.Generator().manual_seed(int(density * 100))
    for trial in range(60):
        size = int(torch.randint(5, 300, (1,), generator=g))
        a, bf = m.TokenAllocator(size), BruteForce(size)
        taken = torch.nonzero(torch.rand(size, generator=g) < density)[:, 0]
        if len(taken):
            a.free(a.alloc(size)[torch.ones(size, dtype=torch.bool).index_fill_(0, taken, False)])  # keep `taken`
        bf.ref = [int(i in set(taken.tolist())) for i in range(size)]
        same_state(a, bf)
        n, picture = int(torch.randint(1, size + 1, (1,), generator=g)), show(bf)
        got, run = a.alloc_contiguous(n), bf.first_run(n)
        call = f"alloc_contiguous({n}) on the pool {picture}"
        if n > size - len(taken):
            assert got is None, f"{call} returned {got.tolist()}; want None: only {size - len(taken)} are free"
        elif run is not None:
            assert got is not None and got.tolist() == run, \
                f"{call} returned {None if got is None else got.tolist()}; want the first run of {n} free, {run}"
        else:
            assert got is not None and len(set(got.tolist())) == n and all(bf.ref[i] == 0 for i in got.tolist()), \
                f"{call} returned {None if got is None else got.tolist()}; want {n} free slots (no run exists)"


def test_exhaustion_is_a_clean_refusal():
    a = m.TokenAllocator(10)
    x, before = a.alloc(7), a.mem_state.clone()
    assert a.alloc(4) is None and a.alloc_contiguous(4) is None
    assert torch.equal(a.mem_state, before) and a.available() == 3
    assert a.alloc(3) is not None and a.available() == 0
    a.free(x)
    assert a.alloc_contiguous(7).tolist() == list(range(7))

    kv = m.TokenKVCache(1, 12, 1, 2, max_requests=2, max_seq_len=12)
    kv.prepare([0], [8])
    state, rows = kv.allocator.mem_state.clone(), list(kv.req_pool.free_rows)
    # 5 slots wanted, 4 free: nothing may be taken, no row opened
    refuses(m.PoolExhausted, kv.prepare, [0, 1], [1, 4], match="KV slots")
    refuses(m.PoolExhausted, kv.prepare, [1, 2, 3], [1, 1, 1], match="request rows")
    assert torch.equal(kv.allocator.mem_state, state) and kv.req_pool.free_rows == rows and 1 not in kv.rows
    assert kv.lens == {0: 8}
    kv.free(0)
    kv.prepare([1], [12])
    assert kv.allocator.available() == 0
    refuses(ValueError, kv.prepare, [1], [1], match="max_seq_len")


def test_double_free_and_foreign_slots_are_detected():
    a = m.TokenAllocator(16)
    x = a.alloc(4)
    a.free(x[:2])
    for bad in (x[:1], x[2:] .repeat(2), torch.tensor([9]), torch.tensor([16]), torch.tensor([-1])):
        before = a.mem_state.clone()
        refuses(ValueError, a.free, bad)
        assert torch.equal(a.mem_state, before) and a.available() == 14
    refuses(ValueError, a.inc_ref, torch.tensor([0]))  # slot 0 was freed: sharing it would resurrect garbage
    a.inc_ref(x[2:])
    a.free(x[2:].repeat(2))  # two references, two frees in one call: fine
    assert a.available() == 16
    a.check()
    a.mem_state[3] = -1  # corrupt it: check() must notice
    refuses(AssertionError, a.check)
    pool = m.ReqToTokenPool(2, 4)
    r = pool.alloc()
    pool.free(r)
    refuses(ValueError, pool.free, r)


def test_decode_attn_matches_float64_reference():
    g = torch.Generator().manual_seed(7)
    size, H, Hkv, D, B = 300, 6, 2, 16, 4
    kp, vp = torch.randn(size, Hkv, D, generator=g), torch.randn(size, Hkv, D, generator=g)
    q, lens = torch.randn(B, H, D, generator=g), torch.tensor([1, 17, 5, 60], dtype=torch.int32)
    r2t = torch.randint(0, size, (6, 64), generator=g, dtype=torch.int32)  # stale junk past each length too
    rows, out = torch.tensor([4, 0, 5, 2], dtype=torch.int32), torch.full((B, H, D), float("nan"))
    out[:] = m.L01.attend_table(q, kp, vp, r2t, rows, lens)
    for b in range(B):  # one query seeing all of its request's keys
        i = r2t[rows[b], :lens[b]].long()
        assert torch.allclose(out[b].double(), dense_reference(q[b][None], kp[i], vp[i], len(i) - 1)[0], atol=1e-5)


def test_add_prefix_shares_slots_and_matches_recompute():
    import llama3_generate as L
    model, a_tok = tiny_model(0, vocab_size=97, hidden_dim=96, max_seq_len=64), torch.randint(0, 97, (20,))
    b_tok = torch.cat([a_tok[:12], torch.randint(0, 97, (5,))])  # shares A's first 12 tokens
    kv = m.TokenKVCache.for_model(model, 64, max_requests=4, max_seq_len=32)
    kv.allocator.alloc(3)  # so slots are not simply 0..n-1
    model(a_tok, kv.prepare(["A"], [20]), kv)
    kv.add_prefix("B", kv.slots("A")[:12])
    assert kv.allocator.available() == 64 - 3 - 20
    pos = kv.prepare(["B"], [5])
    assert pos.tolist() == list(range(12, 17))
    got = model(b_tok[12:], pos, kv)
    assert torch.allclose(got, model(b_tok, torch.arange(17), L.NoCache())[12:], atol=1e-4)
    assert kv.slots("B")[:12].tolist() == kv.slots("A")[:12].tolist()
    kv.free("A")
    assert kv.allocator.available() == 64 - 3 - 17  # B still holds the shared 12 + its own 5
    kv.free("B")
    assert kv.allocator.available() == 61
    kv.allocator.check()


@pytest.mark.slow
def test_greedy_decode_matches_contiguous_cache(smollm, one_thread):
    import llama3_generate as L
    model, tok = smollm
    kv01 = importlib.import_module("01_kv_cache")
    prompts = [tok.chat("What is the capital of France?"), tok.chat("Say hello.")]
    want = L.generate(model, kv01.ContiguousKVCache.for_model(model, 2, 128), prompts, 16)
    kv = m.TokenKVCache.for_model(model, 400, max_requests=4, max_seq_len=128)
    hole = kv.allocator.alloc(300)
    kv.allocator.free(hole[torch.randperm(300)[:200]])  # scattered free slots: requests cannot be contiguous
    assert L.generate(model, kv, prompts, 16) == want
    assert kv.allocator.available() == 300 and not kv.rows  # everything generate() took came back
    kv.allocator.check()


def test_cli_json_and_errors(capsys, monkeypatch):
    m.main(["--json", "--requests", "12"])
    r = json.loads(capsys.readouterr().out)
    assert r["live_fraction"] == 1.0
    assert r["live_fraction_by_scheme"]["max_len_01"] < r["live_fraction_by_scheme"]["blocks_256"] < 1.0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU's peers only, on a GPU machine too
    m.main(["--json", "--bench", "--requests", "12"])  # the peers beside it: tests/bench_03.py, after 03's figures
    b = json.loads(capsys.readouterr().out)
    assert b["live_fraction_by_scheme"] == r["live_fraction_by_scheme"]
    assert set(b["alloc_free_speedup_vs_python_set"]) == {"1", "64", "4096"}
    assert refuses(SystemExit, m.main, ["--requests", "0"]).code != 0


@pytest.mark.gpu
def test_cuda_allocator_matches_cpu():
    rng = random.Random(5)
    cpu, gpu = m.TokenAllocator(500), m.TokenAllocator(500, "cuda")
    held = []
    for _ in range(300):
        if rng.random() < 0.55 or not held:
            n, c = rng.randint(1, 60), rng.random() < 0.5
            x, y = (cpu.alloc_contiguous(n), gpu.alloc_contiguous(n)) if c else (cpu.alloc(n), gpu.alloc(n))
            assert (x is None) == (y is None)
            if x is not None:
                assert y.is_cuda and x.tolist() == y.tolist()
                held.append(x)
        else:
            x = held.pop(rng.randrange(len(held)))
            cpu.free(x)
            gpu.free(x.cuda())
        assert torch.equal(cpu.mem_state, gpu.mem_state.cpu()) and cpu.available() == gpu.available()
    refuses(ValueError, gpu.free, torch.tensor([10_000], device="cuda"))  # out of range: an error, not a device assert
    gpu.check()


@pytest.mark.gpu
def test_cuda_decode_matches_contiguous_cache():
    import llama3_generate as L
    model = random_model(L.ModelArgs(dim=128, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=256, hidden_dim=256,
                                     max_seq_len=128), "cuda", torch.float32)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (5, 17, 9)]
    want = L.generate(model, importlib.import_module("01_kv_cache").ContiguousKVCache.for_model(model, 3, 64), prompts, 12)
    kv = m.TokenKVCache.for_model(model, 200, max_requests=3, max_seq_len=64)
    kv.allocator.free(kv.allocator.alloc(120)[::2])  # scattered free slots
    assert L.generate(model, kv, prompts, 12) == want and kv.allocator.available() == 140


@pytest.mark.parametrize("seed", range(3))
def test_token_cache_batches_against_a_brute_force_model(seed):
    """01's brute-force drive through the token pool: exactly 3 x 12 slots and 3 rows, so a leak shows at once."""
    kv = m.TokenKVCache(1, 36, 2, 8, max_requests=3, max_seq_len=12)
    backend_against_brute_force(kv, seed, steps=60)
    assert kv.allocator.available() == 36 and sorted(kv.req_pool.free_rows) == [0, 1, 2] and kv.lens == {}
    kv.allocator.check()


def test_share_prefix_moves_one_reference_per_slot():
    """share_prefix moves one reference per slot from B's own slots to A's (a refcount model)."""
    for start, n in ((0, 6), (2, 5), (4, 6)):
        kv = m.TokenKVCache(1, 40, 1, 2, max_requests=3, max_seq_len=16)
        kv.allocator.alloc(3)  # slots are not simply 0..n-1
        kv.prepare(["A", "B"], [10, 10])
        a, b = kv.slots("A").tolist(), kv.slots("B").tolist()
        ref = [int(x) for x in kv.allocator.mem_state]
        kv.share_prefix("B", kv.slots("A")[start:start + n], start)
        for s in a[start:start + n]:
            ref[s] += 1
        for s in b[start:start + n]:
            ref[s] -= 1
        assert kv.allocator.mem_state.tolist() == ref and kv.allocator.available() == ref.count(0)
        assert kv.slots("B").tolist() == b[:start] + a[start:start + n] + b[start + n:]
        kv.free("A")
        kv.free("B")
        assert kv.allocator.available() == 37
        kv.allocator.check()
