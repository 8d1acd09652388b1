"""A KV pool at full memory (#66): greedy decode still runs multi-step chunks (CudaGraphDecoder, eagerly on a CPU),
not one step per host round trip, and writes the same tokens as one step at a time."""
import pytest
import torch

import llama3_generate as L
from helpers import NOTOK, kv_less, serve, tiny_model


def workload(seed, n=32, lo=6, hi=64):
    """nano-vllm's bench workload scaled down: n requests, prompt and output lengths uniform in [lo, hi]."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n, 2), generator=g).tolist()
    return [torch.randint(0, 256, (p,), generator=g).tolist() for p, _ in lens], [m for _, m in lens]


@pytest.mark.triton
@pytest.mark.parametrize("kw", [dict(backend="token"), dict(backend="paged", block_size=4)], ids=["token", "paged-4"])
def test_full_pool_decodes_in_chunks(kw, monkeypatch):
    """A full pool (#66) still decodes in chunks (one-step decodes under 10%), with one-step-at-a-time tokens."""
    calls = {"one": 0, "chunk": 0}
    forward, steps = L.CudaGraphDecoder.forward, L.CudaGraphDecoder.steps
    monkeypatch.setattr(L.CudaGraphDecoder, "forward",
                        lambda self, *a: (calls.__setitem__("one", calls["one"] + 1), forward(self, *a))[1])
    monkeypatch.setattr(L.CudaGraphDecoder, "steps",
                        lambda self, *a, **k: (calls.__setitem__("chunk", calls["chunk"] + 1), steps(self, *a, **k))[1])
    model = tiny_model()
    prompts, max_new_tokens = workload(int(torch.randint(0, 10**6, ())))
    opts = dict(kv_tokens=32 * len(prompts), **kw)
    one, _ = serve(model, NOTOK, prompts, max_new_tokens, cuda_graphs=False, **opts)
    multi, e = serve(model, NOTOK, prompts, max_new_tokens, cuda_graphs=True, fused=False, multi_step=8, **opts)
    assert multi == one
    assert e.stats["peak_running"] > 16, e.stats  # the pool was shared by many: it ran full
    assert calls["one"] < 0.1 * (calls["one"] + calls["chunk"]), calls


def scheduler(page, pool, n, **opts):
    """05's Scheduler over a KV-less pool of `pool` slots (page > 1: 02's blocks), rows for n requests of <= 128."""
    opts = {"mixed": False, "reserve": "expected", **opts}
    return L.L05.Scheduler(kv_less(page, pool, n, 128), "lpm", n, seed=0, **opts)


def run_watched(s, prompts, max_new_tokens, watch):
    """Run the scheduler s on the workload (random targets), calling watch(batch) before each prepare(batch)."""
    prepare = s.prepare
    s.prepare = lambda batch: (watch(batch), prepare(batch))[1]
    for p, n in zip(prompts, max_new_tokens):
        s.add(p, n, target=torch.randint(0, 256, (n,)).tolist())
    s.run()


@pytest.mark.parametrize("page", [1, 4])
def test_admission_keeps_room_to_run_ahead(page):
    """Look-ahead admission keeps room for a k-step chunk before every decode step; without it (#66) it does not."""
    prompts, max_new_tokens = workload(int(torch.randint(0, 10**6, ())), n=48)
    k, short = 8, {}
    for lookahead in (0, k):
        s, short[lookahead] = scheduler(page, 24 * len(prompts), len(prompts), lookahead=lookahead), []

        def checked(batch):
            if batch is s.running:  # a decode step
                need = s.slots_needed(batch, [min(k, r.tokens_left) for r in batch])
                short[lookahead].append(need - s.free_slots() - s.tree.evictable_size())
        run_watched(s, prompts, max_new_tokens, checked)
        assert s.stats["preemptions"] == 0 and s.stats["peak_running"] > 12, s.stats
    assert max(short[k]) <= 0 < max(short[0]), (max(short[k]), max(short[0]))


@pytest.mark.parametrize("page", [1, 4])
def test_run_ahead_takes_the_most_steps_that_fit(page):
    """05's run_ahead == the largest s <= k whose prepare fits a copy of the pool, evicting only when k does not fit."""
    import copy
    g = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    rand = lambda lo, hi: int(torch.randint(lo, hi + 1, (), generator=g))
    for _ in range(200):
        s, reqs = scheduler(page, rand(12, 40) * 4 * page, 8, lookahead=4), []
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
        reqs = [r for r in reqs if r.tokens_left > ahead]
        if not reqs:
            continue

        def fits(steps):
            kv = copy.deepcopy(s.kv)
            try:
                kv.prepare([r.rid for r in reqs], [min(steps, r.tokens_left - ahead) for r in reqs])
                return True
            except L.OutOfBlocks:
                return False
        evictable, want_now = s.tree.evictable_size(), max(t for t in range(k + 1) if t == 0 or fits(t))
        got = s.run_ahead(reqs, k, ahead)
        if want_now == k:
            assert got == k and s.tree.evictable_size() == evictable  # nothing evicted
        else:
            assert got == max(t for t in range(k + 1) if t == 0 or fits(t))  # after the eviction
            assert s.tree.evictable_size() < evictable or not evictable


def test_mixed_steps_make_way_for_decode_while_requests_wait_for_kv():
    """While requests wait for KV (held), a mixed step is followed by a decode step, never by another mixed one."""
    prompts, max_new_tokens = workload(int(torch.randint(0, 10**6, ())), n=32)
    for pool, tight in ((16 * len(prompts), True), (128 * len(prompts), False)):
        s, trace = scheduler(1, pool, len(prompts), mixed=True, chunk_tokens=96), []

        def traced(batch):
            kind = "decode" if batch is s.running else "mixed" if any(r in s.running for r in batch) else "prefill"
            trace.append((kind, s.held))
        run_watched(s, prompts, max_new_tokens, traced)
        pairs = list(zip(trace, trace[1:]))
        assert not any(a == ("mixed", True) and b[0] == "mixed" for a, b in pairs)
        if tight:
            assert any(a == ("mixed", True) and b[0] == "decode" for a, b in pairs), trace
        else:
            assert not any(held for _, held in trace) and ("mixed", False) in trace, trace
