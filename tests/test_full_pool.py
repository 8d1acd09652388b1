"""A KV pool at full memory (#66): greedy decode still runs multi-step chunks (CudaGraphDecoder, eagerly on a CPU),
not one step per host round trip, and writes the same tokens as one step at a time."""
import pytest
import torch

import llama3_generate as L
from helpers import NOTOK, serve, tiny_model


def workload(seed, n=32, lo=6, hi=64):
    """nano-vllm's bench workload scaled down: n requests, prompt and output lengths uniform in [lo, hi]."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n, 2), generator=g).tolist()
    return [torch.randint(0, 256, (p,), generator=g).tolist() for p, _ in lens], [m for _, m in lens]


@pytest.mark.triton
@pytest.mark.parametrize("kw", [dict(backend="token"), dict(backend="paged", block_size=4)], ids=["token", "paged-4"])
def test_full_pool_decodes_in_chunks(kw, monkeypatch):
    """32 requests, a pool of 32 slots a request (half of what they end holding, as bench_engine.py's equal KV
    memory: 512 of 2048): admission fills the pool, and decode must still run in chunks. One-step decode steps
    (the graph decoder's forward: one step per host sync) are under 10% of decode calls; on the code of #66's
    report they were 76 of 83. Greedy fp32 tokens equal one step at a time without graphs."""
    calls = {"one": 0, "chunk": 0}
    forward, steps = L.CudaGraphDecoder.forward, L.CudaGraphDecoder.steps
    monkeypatch.setattr(L.CudaGraphDecoder, "forward",
                        lambda self, *a: (calls.__setitem__("one", calls["one"] + 1), forward(self, *a))[1])
    monkeypatch.setattr(L.CudaGraphDecoder, "steps",
                        lambda self, *a, **k: (calls.__setitem__("chunk", calls["chunk"] + 1), steps(self, *a, **k))[1])
    model = tiny_model()
    prompts, max_new = workload(int(torch.randint(0, 10**6, ())))
    opts = dict(kv_tokens=32 * len(prompts), **kw)
    one, _ = serve(model, NOTOK, prompts, max_new, cuda_graphs=False, **opts)
    multi, e = serve(model, NOTOK, prompts, max_new, cuda_graphs=True, fused=False, multi_step=8, **opts)
    assert multi == one
    assert e.stats["peak_running"] > 16, e.stats  # the pool was shared by many: it ran full
    assert calls["one"] < 0.1 * (calls["one"] + calls["chunk"]), calls


def scheduler(page, pool, n, **opts):
    """05's Scheduler over a KV-less pool of `pool` slots (page > 1: 02's blocks), rows for n requests of <= 128."""
    if page == 1:
        kv = L.L03.TokenKVCache(1, pool, 1, 1, n, 128)
    else:
        kv = L.L02.PagedKVCache(1, pool // page, page, 1, 1, watermark=0, max_seqs=n, max_seq_len=128)
    return L.L05.Scheduler(kv, "lpm", n, seed=0, **{"mixed": False, "reserve": "expected", **opts})


@pytest.mark.parametrize("page", [1, 4])
def test_admission_keeps_room_to_run_ahead(page):
    """05's look-ahead admission (reserve="expected", outputs to their max_new: the expected ends are exact) with
    lookahead=k keeps room for a k-step chunk of every running request (min(k, tokens left) each, in whole pages)
    before every decode step, counting what the radix tree may evict; without it (lookahead=0, #66) the pool runs
    full and a chunk finds no room. Simulated one token a step (05's targets)."""
    prompts, max_new = workload(int(torch.randint(0, 10**6, ())), n=48)
    k, short = 8, {}
    for lookahead in (0, k):
        s, short[lookahead] = scheduler(page, 24 * len(prompts), len(prompts), lookahead=lookahead), []
        prepare = s.prepare

        def checked(batch):
            if batch is s.running:  # a decode step
                need = s.slots_needed(batch, [min(k, r.room) for r in batch])
                short[lookahead].append(need - s.free_slots() - s.tree.evictable_size())
            return prepare(batch)
        s.prepare = checked
        for p, n in zip(prompts, max_new):
            s.add(p, n, target=torch.randint(0, 256, (n,)).tolist())
        s.run()
        assert s.stats["preemptions"] == 0 and s.stats["peak_running"] > 12, s.stats
    assert max(short[k]) <= 0 < max(short[0]), (max(short[k]), max(short[0]))


@pytest.mark.parametrize("page", [1, 4])
def test_run_ahead_takes_the_most_steps_that_fit(page):
    """05's run_ahead == a brute force: the largest s <= k for which kv.prepare(batch, min(s, left)) succeeds on a
    copy of the pool (left: tokens to each one's max_new, past `ahead` in flight), cached prefixes evicted first
    only where k steps do not fit now. Random batches at random fill."""
    import copy
    g = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    rand = lambda lo, hi: int(torch.randint(lo, hi + 1, (), generator=g))
    for _ in range(200):
        s = scheduler(page, rand(12, 40) * 4 * page, 8, lookahead=4)
        reqs = []
        for _ in range(rand(1, 6)):
            r = s.add(torch.randint(0, 256, (rand(1, 9),), generator=g).tolist(), rand(1, 40))
            r.output = [0] * rand(0, r.max_new_tokens - 1)
            try:
                s.kv.prepare([r.rid], [len(r.prompt) + len(r.output) - 1 + rand(0, 3)])
            except L.OutOfBlocks:
                continue
            reqs.append(r)
        if rand(0, 1) and s.free_slots() >= page:  # a cached prefix the tree may evict
            s.kv.prepare([99], [page]), s.tree.insert(list(range(page)), s.kv.slots(99)), s.kv.free(99)
        k, ahead = rand(1, 16), rand(0, 2)
        reqs = [r for r in reqs if r.room > ahead]
        if not reqs:
            continue

        def fits(steps):
            kv = copy.deepcopy(s.kv)
            try:
                kv.prepare([r.rid for r in reqs], [min(steps, r.room - ahead) for r in reqs])
                return True
            except L.OutOfBlocks:
                return False
        evictable = s.tree.evictable_size()
        want_now = max(t for t in range(k + 1) if t == 0 or fits(t))
        got = s.run_ahead(reqs, k, ahead)
        if want_now == k:
            assert got == k and s.tree.evictable_size() == evictable  # nothing evicted
        else:
            assert got == max(t for t in range(k + 1) if t == 0 or fits(t))  # after the eviction
            assert s.tree.evictable_size() < evictable or not evictable


def test_mixed_steps_make_way_for_decode_while_requests_wait_for_kv():
    """05's mixed schedule: while the last admission left requests waiting for KV (held), a mixed step is
    followed by a pure decode step (the engine's graphs and chunks), never by another mixed step; with room
    for everyone nothing is held and mixed steps follow each other. Simulated one token a step."""
    prompts, max_new = workload(int(torch.randint(0, 10**6, ())), n=32)
    for pool, tight in ((16 * len(prompts), True), (128 * len(prompts), False)):
        s, trace = scheduler(1, pool, len(prompts), mixed=True, chunk_tokens=96), []
        prepare = s.prepare

        def traced(batch):
            kind = "decode" if batch is s.running else "mixed" if any(r in s.running for r in batch) else "prefill"
            trace.append((kind, s.held))
            return prepare(batch)
        s.prepare = traced
        for p, n in zip(prompts, max_new):
            s.add(p, n, target=torch.randint(0, 256, (n,)).tolist())
        s.run()
        pairs = list(zip(trace, trace[1:]))
        assert not any(a == ("mixed", True) and b[0] == "mixed" for a, b in pairs)
        if tight:
            assert any(a == ("mixed", True) and b[0] == "decode" for a, b in pairs), trace
        else:
            assert not any(held for _, held in trace) and ("mixed", False) in trace, trace
