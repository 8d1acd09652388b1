"""The engine: continuous batching through every backend, radix prefix reuse, constraints, n > 1, preemption."""
import gc
import json
import random
import re

import pytest
import torch

import llama3_generate as L
from helpers import (LLAMA_SHAPES, NOTOK, kv_left, meta_state_dict, random_model, refuses, serve, tiny_model,
                     to_transformers)

PROMPTS = ["Hi", "Name three primary colors and say why they are primary.", "What is the capital of France?"]


def run(smollm, prompts, params=None, **kw):
    model, tok = smollm
    engine = L.FastEngine(model, tok, **kw)
    for p in prompts:
        engine.add(tok.chat(p) if isinstance(p, str) else p, params or L.SamplingParams(max_new_tokens=12))
    return engine.run(), engine


def hf_greedy(hf, prompts, n, stop_ids):
    """transformers' batched greedy generation (left padding), each row cut after its first stop token."""
    width = max(map(len, prompts))
    x = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(x, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=stop_ids, pad_token_id=0)
    return [r[:next((i + 1 for i, t in enumerate(r) if t in stop_ids), len(r))] for r in out[:, width:].tolist()]


def test_backends_agree_with_each_other_and_transformers(smollm, hf_smollm):
    model, tok = smollm
    ref = hf_greedy(hf_smollm[0], [tok.chat(p) for p in PROMPTS], 12, tok.stop_ids)
    for backend in ("contiguous", "paged", "token"):
        outs, _ = run(smollm, PROMPTS, backend=backend, kv_tokens=512, max_seq_len=128)
        assert list(outs.values()) == ref, backend


def test_radix_cache_reuses_a_shared_prefix(smollm):
    model, tok = smollm
    doc = tok.encode("The quick brown fox jumps over the lazy dog. " * 12)
    prompts = [doc + tok.encode(q) for q in (" Who jumps?", " Who is lazy?", " What color is the fox?")]
    with_cache, e1 = run(smollm, prompts, radix=True, kv_tokens=1024)
    without, e0 = run(smollm, prompts, radix=False, kv_tokens=1024)
    assert with_cache == without
    assert e0.stats["cached_tokens"] == 0
    assert e1.stats["cached_tokens"] >= 2 * (len(doc) - 1)  # the 2nd and 3rd prompt reuse the document
    e1.sched.tree.check(held=[])


def test_constrained_requests_fullmatch(smollm):
    pattern = r'\{"name": "[A-Z][a-z]{1,12}", "age": [1-9][0-9]?\}'
    params = L.SamplingParams(max_new_tokens=40, regex=pattern, temperature=0.7)
    outs, e = run(smollm, ["Make up a person as JSON.", "Describe a cat as JSON."], params, seed=3)
    _, tok = smollm
    for out in outs.values():
        text = tok.decode([t for t in out if t not in tok.stop_ids])
        assert re.fullmatch(pattern, text), text
    assert e.stats["jump_forward_tokens"] > 0


def test_postprocess_requeues_from_the_token_append_says_changed():
    """02's postprocess keeps the KV before the token an append says changed, requeues, and recomputes only the rest."""
    R, T = L.lesson("05_radix_scheduler"), L.lesson("03_token_allocator")

    class Jumping(R.Req):  # at its 3rd token, output[1:] changes (output[1] is in its KV): as a jump-forward
        def append(self, t):
            super().append(t)
            if len(self.output) == 3:
                self.output[1:] = [7, 8, 9]
                return len(self.prompt) + 1

    s = R.Scheduler(T.TokenKVCache(1, 64, 1, 1, 2, 32), "lpm", 2)
    req = Jumping(0, [1, 2, 3, 4], 8, target=list(range(20, 40)))  # simulated: the model writes target[i]
    s.waiting.append(req)
    s.run(check=True)
    assert [(e.kind, e.tokens) for e in s.events if e.kind in ("admit", "prefill", "requeue")] == \
        [("admit", 0), ("prefill", 4), ("requeue", 6), ("admit", 5), ("prefill", 3)]  # 5 cached: [1, 2, 3, 4, 20]
    assert req.output == [20, 7, 8, 9, 24, 25, 26, 27] and s.finished == [req]


@pytest.mark.parametrize("backend,preempt", [("token", "recompute"), ("paged", "recompute"), ("paged", "swap")])
def test_tiny_pool_preempts_and_still_finishes_correctly(smollm, backend, preempt, monkeypatch):
    """A tiny pool admits through 05's Scheduler.admit, preempts through 02's, and writes a big pool's tokens."""
    model, tok = smollm
    P, R = L.lesson("02_paged_cache_manager"), L.lesson("05_radix_scheduler")
    calls = {}
    for cls, name in ((R.Scheduler, "admit"), (P.Scheduler, "preempt")):
        def counted(*a, _f=getattr(cls, name), _name=name, **kw):
            calls[_name] = calls.get(_name, 0) + 1
            return _f(*a, **kw)
        monkeypatch.setattr(cls, name, counted)
    prepare = P.Scheduler.prepare

    def prepare_checked(self, batch):  # admission counted the room: what it lets in is never held back
        asked = list(batch)
        out, positions = prepare(self, batch)
        assert batch is self.running or out == asked, "admitted, then held back for lack of room"
        return out, positions
    monkeypatch.setattr(P.Scheduler, "prepare", prepare_checked)
    params = L.SamplingParams(max_new_tokens=16, ignore_eos=True)
    big, _ = run(smollm, PROMPTS, params, backend=backend, kv_tokens=1024)
    longest = max(len(tok.chat(p)) for p in PROMPTS) + 16
    small, e = run(smollm, PROMPTS, params, backend=backend, kv_tokens=longest + 24, block_size=8, preempt=preempt,
                   reserve=False)  # admit what fits now (look-ahead admission would rarely preempt here)
    assert isinstance(e.sched, R.Scheduler) and isinstance(e.sched, P.Scheduler)
    assert e.stats["preemptions"] == calls["preempt"] > 0 and calls["admit"] > 0
    assert small == big
    assert not (e.sched.swapped or e.sched.waiting or e.sched.running)
    e.kv.allocator.check()  # 03's slots, or 02's blocks (the radix tree keeps whole blocks of them)
    assert e.kv.allocator.available() * e.kv.page + e.sched.tree.evictable_size() == e.kv.capacity()


def test_request_too_large_is_refused(smollm):
    model, tok = smollm
    engine = L.Engine(model, tok, kv_tokens=64)
    refuses(L.UserError, engine.add, list(range(60)), L.SamplingParams(max_new_tokens=10))


@pytest.mark.triton
@pytest.mark.parametrize("pdl", [False, True])
def test_fused_decode_matches_the_model(pdl, monkeypatch):
    """fused_decode (interpreted; pdl: the GPU's variants) gives model(...)'s logits and K/V on the token backend."""
    m04 = L.lesson("04_triton_token_attn")
    monkeypatch.setattr(m04, "FUSED_CONFIG", {k: (rows, 16, warps) for k, (rows, _, warps) in m04.FUSED_CONFIG.items()})
    model = tiny_model(seed=int(torch.randint(0, 1000, ())))
    kvs = [L.lesson("03_token_allocator").TokenKVCache.for_model(model, 64, 2, 64) for _ in range(2)]
    prompt = torch.randint(0, 256, (int(torch.randint(2, 20, ())),))
    for kv in kvs:
        kv.k_pool.fill_(float("nan")), kv.v_pool.fill_(float("nan"))
        model(prompt, kv.prepare([0], [len(prompt)]), kv)
    token = prompt[-1:]
    for _ in range(2):
        ref = model(token, kvs[0].prepare([0], [1]), kvs[0])
        out = m04.fused_decode(model, kvs[1], token, kvs[1].prepare([0], [1]), pdl=pdl)
        assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
        token = ref.argmax(-1)
    for a, b in ((kvs[0].k_pool, kvs[1].k_pool), (kvs[0].v_pool, kvs[1].v_pool)):
        assert torch.allclose(a, b, atol=1e-5, equal_nan=True)


@pytest.mark.triton
def test_argmax_kernel_matches_torch():
    """_argmax == torch.argmax (ties to the lowest index, fp32 and bf16), also with the logits split over 2 ranks."""
    m04 = L.lesson("04_triton_token_attn")
    for B, V in ((1, 300), (3, 2 * int(torch.randint(2049, 10000, ()))), (2, 7)):  # (even: halves)
        x = torch.randn(B, V) * 5 - 30 * torch.rand(B, 1)
        x[0, V // 3] = x[0, V - 1] = x[0].max() + 1  # a tie
        for dtype in (torch.float32, torch.bfloat16):  # the graphs hand it the weights' dtype
            out = torch.full((B,), -1)
            assert m04.argmax(x.to(dtype), out).tolist() == x.to(dtype).argmax(-1).tolist()
            if V % 2 == 0:  # TP's split head over 2 ranks: each rank's keys, then each finds the token among both's
                halves = [(x.to(dtype)[:, r * V // 2:(r + 1) * V // 2].contiguous(), (r * V // 2, V)) for r in (0, 1)]
                keys = []
                for h, vocab in halves:
                    m04.argmax(h, torch.full((B,), -1), vocab=vocab, gather=lambda k: keys.append(k.clone()) or k[None])
                for h, vocab in halves:  # (the tie spans the halves: the first rank's index wins)
                    got = m04.argmax(h, torch.full((B,), -1), vocab=vocab, gather=lambda k: torch.stack(keys))
                    assert got.tolist() == out.tolist()


BACKENDS = [dict(backend="token"), dict(backend="paged", block_size=4), dict(backend="contiguous")]
SHARING = [dict(backend="token"), dict(backend="paged", block_size=4), dict(backend="paged", block_size=16)]


@pytest.mark.parametrize("kw", SHARING, ids=["token", "paged-4", "paged-16"])
def test_radix_cache_same_tokens_on_every_sharing_backend(kw):
    """With, without 05's radix cache (token pool, blocks): equal greedy tokens, whole-page hits, evictions, no leak."""
    model, rng = tiny_model(), torch.Generator().manual_seed(random.randrange(1 << 30))  # fresh inputs each run
    doc = torch.randint(0, 256, (int(torch.randint(40, 70, (), generator=rng)),), generator=rng).tolist()
    prompts = [doc + torch.randint(0, 256, (n,), generator=rng).tolist() for n in (3, 9, 17, 1, 30)]
    prompts += [list(prompts[1]), torch.randint(0, 256, (50,), generator=rng).tolist()]

    def run(radix):
        e = L.Engine(model, NOTOK, kv_tokens=144, max_batch=3, max_seq_len=112, radix=radix, **kw)
        for p in prompts:
            e.add(p, L.SamplingParams(max_new_tokens=int(torch.randint(4, 12, (), generator=rng))))
        return list(e.run().values()), e
    state = rng.get_state()
    plain, e0 = run(False)
    rng.set_state(state)  # the same max_new_tokens
    cached, e1 = run(None)  # None: on where the backend shares
    assert e0.sched.tree is None and e0.stats["cached_tokens"] == 0, "radix=False still cached tokens"
    assert cached == plain, f"with the radix cache the engine wrote {cached}; without it {plain}"
    page, hits = e1.kv.page, [ev.tokens for ev in e1.sched.events if ev.kind == "admit"]
    assert all(h % page == 0 for h in hits), f"admitted with cached prefixes {hits}: not whole {page}-token pages"
    assert max(hits) >= len(doc) // page * page - page, f"the shared document was never found cached: {hits}"
    assert e1.stats["cached_tokens"] >= 3 * (len(doc) // page * page - page), "few prompts reused the document"
    assert e1.stats["evicted_tokens"] > 0, "nothing was evicted, though the pool cannot hold every prefix"
    e1.sched.tree.check(held=[])
    assert kv_left(e1) == 0, f"the run ended with {kv_left(e1)} KV slots held outside the radix cache"


def test_contiguous_backend_refuses_a_radix_cache():
    """01's rows cannot share a prefix: asked for one, the engine says so in one line; by default it has none."""
    model = tiny_model()
    err = refuses(L.UserError, lambda: L.Engine(model, NOTOK, "contiguous", kv_tokens=256, max_seq_len=64, radix=True),
                  match="cannot share a cached prefix")
    assert "\n" not in str(err)
    assert L.Engine(model, NOTOK, "contiguous", kv_tokens=256, max_seq_len=64).sched.tree is None


@pytest.mark.triton
@pytest.mark.parametrize("kw", BACKENDS, ids=[b["backend"] for b in BACKENDS])
def test_multi_step_decoding_matches_one_step(kw, monkeypatch):
    """Greedy steps k at a time write one-step tokens, stop at the same EOS, leak no slot; batch 1 runs fused_decode."""
    model = tiny_model()
    resumed, steps = [], L.CudaGraphDecoder.steps
    monkeypatch.setattr(L.CudaGraphDecoder, "steps",
                        lambda self, *a, keep=None, **kw: (resumed.append(keep), steps(self, *a, keep=keep, **kw))[1])
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (3, 9, 17)]
    tok = type("Tok", (), {"stop_ids": [], "eos_id": -1})()

    def run(prompts, max_new_tokens, **opts):  # (serve: no KV slot held after)
        outs, e = serve(model, tok, prompts, max_new_tokens, kv_tokens=256, max_batch=4, max_seq_len=64,
                        **kw, **opts)
        assert e.graphs is None or e.graphs.inflight is None, "the run ended with a chunk still in flight"
        return outs, e

    plain, _ = run(prompts, (7, 20, 12), cuda_graphs=False)
    tok.stop_ids = [plain[1][5]]  # an EOS mid-way through the second sequence
    plain, _ = run(prompts, (7, 20, 12), cuda_graphs=False)
    multi, e = run(prompts, (7, 20, 12), cuda_graphs=True, fused=False, multi_step=4)
    assert multi == plain, f"greedy steps 4 at a time wrote {multi}; one step at a time {plain}"
    assert len(plain[1]) <= 6, "the second sequence did not stop at its EOS"
    assert None in resumed and any(k and k != list(range(len(k))) for k in resumed)  # from the host; and continued
    # on the device after the EOS, the rows behind it gathered to the front
    n = sum(map(len, plain)) - len(plain)  # each sequence's first token came from its prefill
    assert e.stats["decode_tokens"] == n, f"decode_tokens counts {e.stats['decode_tokens']}; the outputs decoded {n}"
    tok.stop_ids = []
    one, _ = run(prompts[:1], (8,), cuda_graphs=False)
    fused, e = run(prompts[:1], (8,), cuda_graphs=True, multi_step=3)
    assert fused == one and e.graphs.fused and (1, 3) in e.graphs.graphs  # batch 1's 3 steps as one graph


@pytest.mark.triton
@pytest.mark.parametrize("kw", BACKENDS, ids=[b["backend"] for b in BACKENDS])
def test_multi_step_chunks_run_past_an_end_but_not_past_a_context(kw, monkeypatch):
    """A chunk runs past a sequence's max_new_tokens (tokens dropped) but not past its context: one-step tokens."""
    model, tok, ks = tiny_model(), NOTOK, []
    steps = L.CudaGraphDecoder.steps
    monkeypatch.setattr(L.CudaGraphDecoder, "steps",
                        lambda self, batch, pos, k, **kw: (ks.append(k), steps(self, batch, pos, k, **kw))[1])
    prompts, max_new_tokens = [torch.randint(0, 256, (n,)).tolist() for n in (3, 50)], (3, 14)  # 50 + 14: all 64 slots

    run = lambda **opts: serve(model, tok, prompts, max_new_tokens, max_batch=4, max_seq_len=64, kv_tokens=256,
                               fused=False, **kw, **opts)[0]
    one = run(cuda_graphs=False)
    assert run(cuda_graphs=True, multi_step=4) == one and list(map(len, one)) == [3, 14]
    assert ks[0] == 4 and ks[-1] < 4, ks  # the first ends 2 steps into a 4-step chunk; the context ends the last


@pytest.mark.triton
@pytest.mark.parametrize("kw", BACKENDS, ids=[b["backend"] for b in BACKENDS])
def test_multi_step_random_workloads_match_one_step(kw):
    """Random batches stopping mid-chunk (chunks land after their batch changed) write one-step-at-a-time tokens."""
    model, rand = tiny_model(), randoms()
    for _ in range(25):
        prompts = [rand(0, 256, rand(1, 12)) for _ in range(rand(1, 5))]
        multi_step_matches_one_step(model, rand, prompts, rand(1, 30, len(prompts)), max_batch=4, **kw)


def multi_step_matches_one_step(model, rand, prompts, max_new_tokens, schedule="prefill-first", **kw):
    """With an EOS somewhere in the longest output, chunks of 2 to 5 steps write one-step-at-a-time tokens."""
    tok = type("Tok", (), {"stop_ids": [], "eos_id": -1})()
    run = lambda **opts: serve(model, tok, prompts, max_new_tokens, max_seq_len=64, kv_tokens=512, fused=False,
                               **kw, **opts)[0]
    longest = max(run(cuda_graphs=False), key=len)
    tok.stop_ids = [longest[rand(0, len(longest))]]  # an EOS somewhere in the longest output
    one = run(cuda_graphs=False)
    got = run(cuda_graphs=True, multi_step=rand(2, 6), schedule=schedule)
    assert got == one, (schedule, prompts, max_new_tokens, tok.stop_ids)


@pytest.mark.triton
@pytest.mark.parametrize("kw", BACKENDS, ids=[b["backend"] for b in BACKENDS])
def test_prefills_beside_a_chunk_in_flight_match_one_step(kw, monkeypatch):
    """Prompts admitted while a multi-step chunk is in flight prefill behind it and join the next: one-step tokens.
    A prompt seen before prefills one token (the rest is cached): eagerly, not through the chunk's buffers."""
    model, seen = tiny_model(), {"beside": 0, "joined": 0}
    ahead, steps = L.CudaGraphDecoder.argmax_ahead, L.CudaGraphDecoder.steps

    def joined(self, batch, *a, keep=None, **opts):
        seen["joined"] += keep is not None and len(keep) < len(batch)
        return steps(self, batch, *a, keep=keep, **opts)
    monkeypatch.setattr(L.CudaGraphDecoder, "steps", joined)
    monkeypatch.setattr(L.CudaGraphDecoder, "argmax_ahead", lambda self, x: (
        seen.__setitem__("beside", seen["beside"] + 1), ahead(self, x))[1])
    rand = randoms()
    for schedule in ["prefill-first"] * 3 + ["mixed"]:  # mixed steps decode every running one: they land first
        prompts = [rand(0, 256, rand(1, 12)) for _ in range(rand(4, 7))]
        prompts += prompts[:2]  # admitted later, their prompts cached
        multi_step_matches_one_step(model, rand, prompts, rand(1, 30, len(prompts)), schedule, max_batch=3,
                                    max_prefill_tokens=12, **kw)
    assert all(seen.values()), f"no prompt prefilled beside a chunk in flight, or none joined the next: {seen}"


@pytest.mark.parametrize("graphs", [False, pytest.param(True, marks=pytest.mark.triton)], ids=["eager", "graphs"])
def test_each_step_counts_its_seconds_as_its_kind(graphs, monkeypatch):
    """Each step's seconds count as its kind, a multi-step chunk's as decode also where a prefill step's admission
    lands it: on a fake clock (a prefill 1000 s, a decode or a chunk's read 1 s) prefill_s and decode_s are those
    sums; on_token hears each sequence's every token."""
    model, tok = tiny_model(), NOTOK
    clock, took, trace = [0.0], {"prefill": 0.0, "decode": 0.0}, []
    forward, read, step = L.FastEngine.forward, L.CudaGraphDecoder.read, L.FastEngine.step

    def spend(kind, seconds, what=None):
        clock[0], took[kind] = clock[0] + seconds, took[kind] + seconds
        trace[-1].append(what or kind)
    monkeypatch.setattr(L.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(L.FastEngine, "step", lambda self, *a: (trace.append([]), step(self, *a))[1])
    monkeypatch.setattr(L.FastEngine, "forward", lambda self, batch, *a: (
        spend(*(("decode", 1.0) if batch[0] in self.sched.running else ("prefill", 1000.0))),
        forward(self, batch, *a))[1])
    monkeypatch.setattr(L.CudaGraphDecoder, "read", staticmethod(lambda c: (spend("decode", 1.0, "ahead"), read(c))[1]))
    # whole prompts: a prefill goes in beside the chunk in flight, which it lands (prefill_beside); chunked (5 of
    # a prompt's 8 tokens, then 3): a step that continues a prompt lands the chunk before it admits
    for chunk in (None, 5):
        clock[0], trace[:], took["prefill"], took["decode"], heard = 0.0, [], 0.0, 0.0, {}
        e = L.FastEngine(model, tok, kv_tokens=256, max_batch=4, max_seq_len=64, max_prefill_tokens=8,
                         cuda_graphs=graphs, fused=False, multi_step=4, chunk_tokens=chunk)
        for n in (12, 9, 14):
            e.add(torch.randint(0, 256, (8,)).tolist(), L.SamplingParams(max_new_tokens=n))
        outs = e.run(lambda s: heard.__setitem__(s.rid, list(s.output)))
        assert heard == outs, f"on_token(seq) heard the outputs {heard}; the run wrote {outs}"
        steps = f"what each step ran, in order (ahead: the tokens of several decode steps run at once): {trace}"
        assert not graphs or any("ahead" in t for t in trace), f"no step decoded ahead (decode_ahead): {steps}"
        assert not graphs or any({"ahead", "prefill"} <= set(t) for t in trace), (
            f"no step with prompts waiting delivered the steps decoded ahead (land) as it admitted them: {steps}")
        got, want = (e.stats["prefill_s"], e.stats["decode_s"]), (took["prefill"], took["decode"])
        assert got == want, (f"chunk_tokens={chunk}: the steps counted prefill_s {got[0]:g} s and decode_s "
                             f"{got[1]:g} s; the fake clock spent {want[0]:g} and {want[1]:g} (a prefill 1000 s; a "
                             f"decode or a chunk's read 1 s, decode's also when a prefill step lands it); {steps}")


SCHEDULING = [dict(schedule="mixed"), dict(chunk_tokens=5), dict(schedule="mixed", chunk_tokens=7),
              dict(schedule="mixed", chunk_tokens=1)]


@pytest.mark.parametrize("graphs", [False, pytest.param(True, marks=pytest.mark.triton)], ids=["eager", "graphs"])
@pytest.mark.parametrize("kw", BACKENDS, ids=[b["backend"] for b in BACKENDS])
def test_chunked_and_mixed_steps_write_the_same_tokens(kw, graphs):
    """Mixed steps and chunked prefill write whole prompts' tokens on every backend; events account for it; no leak."""
    model, rand = tiny_model(), randoms()
    cut = 0  # prompts held back or preempted part-way in

    def run(prompts, max_new_tokens, pool, late=0, **opts):  # late: the last prompt arrives after two steps
        e = L.FastEngine(model, NOTOK, kv_tokens=pool, max_batch=4, max_seq_len=64, cuda_graphs=graphs,
                         multi_step=3, fused=False, **kw, **opts)
        sids = []
        for i, (p, n) in enumerate(zip(prompts, max_new_tokens)):
            for _ in range(2 * (late and i == len(prompts) - 1)):
                e.step()
            sids += e.add(p, L.SamplingParams(max_new_tokens=n, ignore_eos=True))
        outs = e.run()
        check_events(e.events, {sid: (len(p), len(outs[sid])) for sid, p in zip(sids, prompts)}, e.stats)
        assert kv_left(e) == 0
        fed = {}
        for ev in e.events:
            fed[ev.rid] = ev.tokens if ev.kind == "admit" else fed.get(ev.rid, 0) + ev.tokens * (ev.kind == "prefill")
            if ev.kind in ("hold_back", "preempt") and 0 < fed[ev.rid] < len(prompts[ev.rid]):
                nonlocal cut
                cut += 1
        return list(outs.values())

    for _ in range(6):
        shared = rand(0, 256, rand(8, 20))
        prompts = [shared + rand(0, 256, rand(1, 12)) for _ in range(rand(2, 5))] + [rand(0, 256, rand(20, 40))]
        max_new_tokens = rand(2, 16, len(prompts))
        pool = max(len(p) + n for p, n in zip(prompts, max_new_tokens)) + rand(0, 24)
        want = run(prompts, max_new_tokens, 256)
        for opts in SCHEDULING:
            assert run(prompts, max_new_tokens, pool, **opts) == want, (opts, prompts, max_new_tokens, pool)
    # a 40-token prompt arrives while two sequences decode, into 60 slots: admitted, it fits, but the two grow by a
    # token per mixed step (its chunks: 4 - 2 tokens) until it no longer does: held back, or preempted, part-way in
    prompts, max_new_tokens = [rand(0, 256, 4), rand(0, 256, 4), rand(0, 256, 40)], [40, 40, 4]
    want, cut = run(prompts, max_new_tokens, 256, late=1), 0
    assert run(prompts, max_new_tokens, 60, late=1, schedule="mixed", chunk_tokens=4, reserve=False) == want
    assert cut > 0 or kw["backend"] == "contiguous"  # (its rows are reserved whole: one sequence at a time here)


@pytest.mark.parametrize("graphs", [False, True])
def test_warm_up_leaves_no_trace(graphs):
    """After warm_up (captures, a frozen heap) the engine serves as a fresh one: same tokens, ids, stats, slots."""
    model, prompts = tiny_model(), [torch.randint(0, 256, (n,)).tolist() for n in (4, 11, 7)]
    outs = []
    for warm in (False, True):
        e = L.FastEngine(model, NOTOK, "token", kv_tokens=256, max_batch=4, cuda_graphs=graphs, multi_step=3)
        if warm:
            gc.unfreeze()
            fresh = {**dict.fromkeys(e.sched.stats, 0), **e.new_counts()}
            assert e.warm_up(3) > 0 and e.stats == fresh and e.kv.used() == graphs
            assert len(gc.get_objects()) < gc.get_freeze_count() // 20
            gc.unfreeze()
            assert not graphs or sorted(k for k in e.graphs.graphs if isinstance(k, int)) == [1, 2, 4]
        for p in prompts:
            e.add(p, L.SamplingParams(max_new_tokens=9))
        outs.append((e.run(), e.stats["prefill_tokens"], e.stats["cached_tokens"]))
    assert outs[0] == outs[1] and list(outs[1][0]) == [0, 1, 2]


@pytest.fixture(scope="module")
def llama_1b():
    """A random Llama-3.2-1B shape in bf16 on the GPU and transformers' model on the same weights, built once."""
    model = random_model(LLAMA_SHAPES["llama-3.2-1b"], "cuda")
    return model, to_transformers(model)


@pytest.mark.gpu
@pytest.mark.parametrize("backend,max_batch", [("token", 4), ("token", 1), ("paged", 4), ("contiguous", 4)])
def test_gpu_bf16_decode_matches_transformers(llama_1b, backend, max_batch):
    """A random Llama-3.2-1B shape in bf16: every greedy token is transformers' argmax up to bf16 noise."""
    model, hf = llama_1b
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128000, (n,), generator=g).tolist() for n in (5, 77, 300)]
    engine = L.FastEngine(model, NOTOK, backend, kv_tokens=4096, max_batch=max_batch, max_seq_len=512, block_size=256)
    for p in prompts:
        engine.add(p, L.SamplingParams(max_new_tokens=8, ignore_eos=True))
    outs = engine.run()
    assert engine.graphs is not None or backend != "token"
    assert max_batch > 1 or engine.graphs.fused
    for p, out in zip(prompts, outs.values()):
        x = torch.tensor([p + out], device="cuda")
        with torch.no_grad():
            ref = hf(x).logits[0, len(p) - 1:-1].float()  # (8, vocab): the logits each new token was chosen from
        scale = ref.std()
        gap = ref.max(-1).values - ref[torch.arange(len(out)), torch.tensor(out, device="cuda")]
        assert (gap <= 0.05 * scale).all(), (backend, gap / scale)
        ours = model(x[0, :len(p)], torch.arange(len(p), device="cuda"), L.NoCache())
        with torch.no_grad():
            theirs = hf(x[:, :len(p)]).logits[0].float()
        assert (ours - theirs).norm() / theirs.norm() < 2e-2


@pytest.mark.gpu
def test_gpu_serving_compiles_nothing_after_warm_up(llama_1b, monkeypatch):
    """Issue 34 (a compile mid-serving stalls every stream): after warm_up no step shape compiles a Triton kernel."""
    import triton.runtime.jit as jit
    compiles, compile_ = [], jit.JITFunction._do_compile
    monkeypatch.setattr(jit.JITFunction, "_do_compile", lambda self, *a, **k: compiles.append(self.fn.__name__)
                        or compile_(self, *a, **k))
    model, _ = llama_1b
    e = L.FastEngine(model, NOTOK, "token", kv_tokens=8192, max_batch=8, max_seq_len=2100)
    e.warm_up(8)
    assert compiles, "the warm-up compiles (or loads from Triton's cache) every kernel a run needs"
    compiles.clear()
    g = torch.Generator().manual_seed(2)
    prompt = lambda n: torch.randint(0, model.args.vocab_size, (n,), generator=g).tolist()
    for n in (1, 8, 32, 64, 2048):  # prefill-first: one prompt per step
        e.add(prompt(n), L.SamplingParams(max_new_tokens=3, ignore_eos=True))
        e.run()
    e.sched.set_schedule(False, 50)  # a prompt alone in chunks: steps that sample no row
    e.add(prompt(300), L.SamplingParams(max_new_tokens=3, ignore_eos=True))
    e.run()
    e.sched.set_schedule(True, 50)
    for n in (5, 300, 120):  # the later prompts in chunks of at most 50 tokens, beside the first one's decoding
        e.add(prompt(n), L.SamplingParams(max_new_tokens=40, ignore_eos=True))
    e.run()
    assert e.stats["mixed_tokens"] > 0 and compiles == []


@pytest.mark.gpu
def test_gpu_fused_decode_matches_the_model():
    """bf16, random Llama-3.2-1B shape: fused_decode's logits and K/V against the plain model's, step by step."""
    model = random_model(LLAMA_SHAPES["llama-3.2-1b"], "cuda", seed=int(torch.randint(0, 1000, ())))
    m03, m04 = L.lesson("03_token_allocator"), L.lesson("04_triton_token_attn")
    kvs = [m03.TokenKVCache.for_model(model, 1024, 2, 1024) for _ in range(2)]
    prompt = torch.randint(0, 128000, (int(torch.randint(50, 500, ())),), device="cuda")
    for kv in kvs:
        kv.decode_attn = m04.token_decode_attention
        model(prompt, kv.prepare([0], [len(prompt)]), kv)
    token = prompt[-1:]
    for _ in range(4):
        ref = model(token, kvs[0].prepare([0], [1]), kvs[0])
        out = m04.fused_decode(model, kvs[1], token, kvs[1].prepare([0], [1]))
        assert (out - ref).norm() / ref.norm() < 2e-2
        assert m04.argmax(out, torch.empty(1, dtype=torch.long, device="cuda")).item() == out.argmax().item()
        slot = kvs[1].tok_slots
        for a, b in ((kvs[0].k_pool, kvs[1].k_pool), (kvs[0].v_pool, kvs[1].v_pool)):
            assert (a[:, slot] - b[:, slot]).float().norm() / a[:, slot].float().norm() < 2e-2
        token = ref.argmax(-1)


def test_cli_constrained_samples(smollm, tmp_path, capsys):
    pattern = r"(yes|no), because [a-z ]{5,40}\."
    L.main(["--quiet", "--regex", pattern, "--n", "2", "--temperature", "0.8", "--max-new-tokens", "24",
            "Is the sky blue?"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]  # --quiet, several: JSON strings
    assert len(lines) == 2 and all(re.fullmatch(pattern, line) for line in lines), lines
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}')
    L.main(["--quiet", "--json-schema", str(schema), "--backend", "paged", "--max-new-tokens", "16", "Is water wet?"])
    assert isinstance(json.loads(capsys.readouterr().out)["answer"], bool)


def test_cli_json_schema_from_pydantic(smollm, tmp_path, capsys):
    """Issue 33: --json-schema of 06's Pydantic demo model answers a document its model_validate_json accepts."""
    character, schema = L.lesson("06_jump_forward_fsm").demo_model(), tmp_path / "character.json"
    schema.write_text(json.dumps(character.model_json_schema()))
    L.main(["--json", "--json-schema", str(schema), "--max-new-tokens", "96", "Describe Hermione Granger."])
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] == "stop", out
    character.model_validate_json(out["text"])


def test_cli_bad_constraints_are_clear_errors(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "object", "properties": {"x": {"type": "strange"}}}')
    for argv, msg in [(["--json-schema", str(bad)], "strange"), (["--json-schema", str(tmp_path / "none.json")], "none.json"),
                      (["--regex", "(unclosed"], "error:"), (["--backend", "magic"], "invalid choice")]:
        code, err = refuses(SystemExit, L.main, argv + ["hi"]).code, capsys.readouterr().err
        assert code != 0 and msg in err + str(code) and "Traceback" not in err, (argv, err)


def test_cli_json_lines_and_cut_constrained_output(smollm, tmp_path, capsys):
    """--json: one object per completion; one cut by --max-new-tokens says "length" and warns, a finished one parses."""
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", '
                      '"items": {"type": "string"}}}, "required": ["name", "tags"]}')
    L.main(["--json", "--json-schema", str(schema), "--max-new-tokens", "6", "--n", "2", "Describe a person."])
    cap = capsys.readouterr()
    outs = [json.loads(line) for line in cap.out.splitlines()]
    assert [(o["prompt_index"], o["sample"], o["finish_reason"]) for o in outs] == [(0, 0, "length"), (0, 1, "length")]
    assert cap.err.count("cut by --max-new-tokens") == 2
    L.main(["--json", "--regex", "(yes|no)", "--max-new-tokens", "8", "Is the sky blue?", "Is fire cold?"])
    cap = capsys.readouterr()
    outs = [json.loads(line) for line in cap.out.splitlines()]
    assert [o["finish_reason"] for o in outs] == ["stop", "stop"] and "cut by" not in cap.err
    assert all(o["text"] in ("yes", "no") and o["text"] == smollm[1].decode(o["token_ids"]) for o in outs)


def test_cli_paged_pool_holds_what_it_admits(smollm, capsys):
    """Issue 22.3: the CLI's paged pool holds a request running to --max-new-tokens (once rounded down to blocks)."""
    model, tok = smollm
    prompt = "Write a long story about a dragon."
    n = next(n for n in range(20, 40) if (len(tok.chat(prompt)) + n) % 16)
    L.main([prompt, "--backend", "paged", "--max-new-tokens", str(n), "--quiet", "--ignore-eos"])
    assert len(tok.encode(capsys.readouterr().out)) >= n // 2


def test_projections_load_stacked():
    """Separate q, k, v (gate, up) projections load stacked; the logits are transformers' on the separate weights."""
    from transformers import LlamaConfig, LlamaForCausalLM
    a = tiny_model().args
    sd = {k: torch.randn(v.shape) * 0.3 for k, v in meta_state_dict(L.Transformer(a)).items()}  # Meta's names
    model = L.Transformer(a).eval()
    model.load_state_dict(sd)
    assert not any(k.endswith(("wq.weight", "w1.weight")) for k in model.state_dict())  # stacked, not kept apart
    hf = LlamaForCausalLM(LlamaConfig(hidden_size=a.dim, intermediate_size=a.hidden_dim, num_hidden_layers=a.n_layers,
                                      num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads,
                                      vocab_size=a.vocab_size, rope_theta=a.rope_theta, rms_norm_eps=a.norm_eps,
                                      max_position_embeddings=a.max_seq_len, tie_word_embeddings=True)).eval()
    hf.load_state_dict({k: sd[v] for k, v in L.hf_names(a.n_layers).items() if v in sd}, strict=False)
    tokens = torch.randint(0, a.vocab_size, (9,))
    with torch.no_grad():
        want = hf(tokens[None]).logits[0]
    torch.testing.assert_close(model(tokens, torch.arange(9), L.NoCache()), want, atol=1e-4, rtol=1e-4)


def test_policy_orders_admission_and_changes_no_output():
    """--policy: 05's policies order the engine's queue (fcfs, lpm, random) and change no token."""
    R, tok = L.lesson("05_radix_scheduler"), NOTOK
    model = tiny_model(seed=int(torch.randint(0, 10**6, ())))
    heads = [torch.randint(0, 256, (40,)).tolist() for _ in range(3)]
    prompts = [heads[i % 3] + torch.randint(0, 256, (5,)).tolist() for i in range(9)]  # groups 0 1 2 0 1 2 ...
    order, outs = {}, {}
    for policy in R.POLICIES:
        e = L.Engine(model, tok, "token", kv_tokens=1024, max_batch=1, policy=policy)
        for p in prompts:
            e.add(p, L.SamplingParams(max_new_tokens=3))
        outs[policy] = e.run()
        order[policy] = list(e.finished)
    assert order["fcfs"] == list(range(9))
    assert order["lpm"] == [0, 3, 6, 1, 4, 7, 2, 5, 8]
    assert sorted(order["random"]) == list(range(9)) and order["random"] != order["fcfs"]
    assert all(o == outs["fcfs"] for o in outs.values())
    refuses(L.UserError, lambda: L.Engine(model, tok, "token", kv_tokens=64, policy="shortest"), match="unknown policy")
    assert [L.cli_args(["--policy", p]).policy for p in R.POLICIES] == list(R.POLICIES)  # the CLI offers each
    assert L.cli_args([]).policy == "lpm"


def randoms():
    """rand(lo, hi, n=None): n (or one) random ints in [lo, hi), from a generator seeded afresh each test."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    return lambda lo, hi, n=None: torch.randint(lo, hi, (n,) if n else (), generator=g).tolist()


def check_events(events, finished, stats, capacity=None):
    """A brute-force account of a run from its events alone (each request waiting -> admit -> prefill+ -> decode* ->
    finish, or back): the KV each holds and drops, totals as counted; capacity: never more KV than the pool."""
    state, kv, cached, steps = {}, {}, 0, [e.step for e in events]
    moves = {"admit": ("waiting",), "hold_back": ("admitted",), "prefill": ("admitted",), "decode": ("running",),
             "preempt": ("running",), "requeue": ("running",), "swap_out": ("running",), "swap_in": ("swapped",),
             "finish": ("running",)}
    after = {"admit": "admitted", "hold_back": "waiting", "prefill": "running", "decode": "running",
             "preempt": "waiting", "requeue": "waiting", "swap_out": "swapped", "swap_in": "running", "finish": "done"}
    totals, held_at, last = {k: 0 for k in moves}, {}, {}
    assert steps == sorted(steps) and set(e.kind for e in events) <= set(L.lesson("02_paged_cache_manager").EVENTS)
    for e in events:
        if e.kind == "evict":
            assert e.rid is None and e.tokens > 0
            totals["evict"] = totals.get("evict", 0) + e.tokens
            continue
        s = state.get(e.rid, "waiting")
        if s == "running" and last.get(e.rid) == "prefill" and e.kind in ("prefill", "hold_back"):
            s = "admitted"  # part-way through its prompt (chunked prefill): the next chunk, or held back
        assert s in moves[e.kind], (e, s)
        last[e.rid] = e.kind
        totals[e.kind] += e.tokens
        if e.kind == "admit":
            cached += e.tokens if e.rid not in kv else 0  # the hit rate counts first admissions
            kv[e.rid] = e.tokens
        elif e.kind in ("prefill", "decode"):
            assert e.tokens >= 1, e
            kv[e.rid] += e.tokens
        elif e.kind == "finish":
            p, n = finished[e.rid]
            assert e.tokens == n and kv[e.rid] == p + n - 1, (e, kv[e.rid], p, n)  # the last token is never fed
            kv[e.rid] = 0
        elif e.kind == "swap_in":
            assert e.tokens == kv[e.rid], e
        else:  # hold_back, preempt, requeue, swap_out: the KV it held goes (swap_out: to CPU memory)
            assert e.tokens == kv[e.rid] or e.kind == "hold_back", (e, kv[e.rid])
            kv[e.rid] = e.tokens if e.kind == "swap_out" else 0
        state[e.rid] = after[e.kind]
        held_at[e.step] = sum(kv[r] for r, st in state.items() if st in ("admitted", "running"))
    assert state == {rid: "done" for rid in finished}  # every request admitted finishes, once
    assert sum(e.kind in ("preempt", "swap_out") for e in events) == stats["preemptions"]
    assert totals.get("evict", 0) == stats.get("evicted_tokens", 0)
    if "prefill_tokens" in stats:  # the engine's (it counts a step of one-token prefills as decode: the sum)
        assert totals["prefill"] + totals["decode"] == sum(stats[f"{k}_tokens"] for k in ("prefill", "decode", "mixed"))
    if "cached_tokens" in stats:
        assert cached == stats["cached_tokens"]
    assert not events or max(steps) < stats["steps"]
    if capacity is not None:
        assert max(held_at.values()) <= capacity
    return totals


@pytest.mark.parametrize("backend,preempt,graphs", [("token", "recompute", False), ("token", "recompute", True),
                                                    ("paged", "recompute", False), ("paged", "swap", False)])
def test_events_account_for_a_run_under_memory_pressure(backend, preempt, graphs):
    """A pool too small for random requests: the events agree with a brute-force account (check_events); it preempts."""
    model, rand = tiny_model(), randoms()
    prompts = [rand(0, 256, rand(4, 30)) for _ in range(8)]
    max_new_tokens = rand(8, 40, len(prompts))
    longest = max(len(p) + n for p, n in zip(prompts, max_new_tokens))
    e = L.FastEngine(model, NOTOK, backend, kv_tokens=longest + 40, max_batch=6, block_size=4, preempt=preempt,
                     cuda_graphs=graphs, multi_step=4, fused=False, reserve=False)  # admit what fits now: it preempts
    sids = [e.add(p, L.SamplingParams(max_new_tokens=n, ignore_eos=True))[0] for p, n in zip(prompts, max_new_tokens)]
    outs = e.run()
    finished = {sid: (len(p), len(outs[sid])) for sid, p in zip(sids, prompts)}
    check_events(e.events, finished, e.stats, e.kv.capacity() if backend == "paged" else None)
    assert e.stats["preemptions"] > 0, "the run never preempted (stats['preemptions'] is 0)"
    kind = "swap_out" if preempt == "swap" else "preempt"
    assert any(ev.kind == kind for ev in e.events), f"preemptions were counted, but no {kind!r} event was logged"


def test_lesson_schedulers_log_the_same_events():
    """02's and 05's own loops (their simulations, no model) log events the same account agrees with."""
    P, R = L.lesson("02_paged_cache_manager"), L.lesson("05_radix_scheduler")
    rng = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    prompt, output = torch.randint(1, 200, (300,), generator=rng).tolist(), torch.randint(1, 300, (300,), generator=rng)
    sched = P.simulate(prompt, output.tolist(), num_blocks=400, block_size=16)
    finished = {r.rid: (len(r.prompt), len(r.output)) for r in sched.finished}
    assert check_events(sched.events, finished, sched.stats, 400 * 16)["preempt"] > 0
    reqs = R.chat_workload(__import__("numpy").random.default_rng(int(torch.randint(0, 10**6, ()))))
    longest = max(len(p) + len(o) for p, o, _ in reqs)
    s = R.Scheduler(R.L03.TokenKVCache(1, 3 * longest, 1, 1, 8, longest), "lpm", 8, reserve=False)
    made = [s.add(p, len(o), target=o) for p, o, _ in reqs]
    s.run()
    check_events(s.events, {r.rid: (len(r.prompt), len(r.output)) for r in made}, s.stats)
    assert any(ev.kind == "evict" for ev in s.events)


def test_cli_progress_on_a_terminal_only(smollm, capsys, monkeypatch):
    """A progress bar on a terminal only, not under --quiet; the stats line's singular; --events' lines."""
    import sys
    argv = ["--max-new-tokens", "3", "Hi", "Name a color."]
    L.main(argv)
    err = capsys.readouterr().err
    assert "serving" not in err and "2 sequences, " in err and "0 preemptions" in err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    L.main(argv)
    err = capsys.readouterr().err
    assert re.search(r"serving: .*2/2 .*decode [\d,.]+ tok/s", err), err
    L.main(argv + ["--quiet"])
    assert capsys.readouterr().err == ""
    monkeypatch.undo()
    L.main(["--max-new-tokens", "3", "--events", "Hi"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("step ")]
    assert [line.split()[2] for line in lines] == ["admit", "prefill", "decode", "decode", "finish"], err
    assert "1 sequence, " in err
    L.main(["--n", "2", "--max-new-tokens", "2", "--json", "Hi"])
    cap = capsys.readouterr()
    assert "warning: --n 2 at --temperature 0 (greedy) gives 2 identical samples" in cap.err
    outs = [json.loads(line) for line in cap.out.splitlines()]
    assert [(o["prompt_index"], o["prompt"], o["sample"]) for o in outs] == [(0, "Hi", 0), (0, "Hi", 1)]


def test_help_says_each_default_once(capsys):
    refuses(SystemExit, L.cli_args, ["--help"])
    text = capsys.readouterr().out
    blocks = re.split(r"\n  (?=[-a-z])", text.split("options:")[1])  # one block per flag
    twice = [b for b in blocks if b.count("default") > 1]
    assert len(blocks) > 20 and not twice, twice
    assert "(default: None)" not in text and "(default: False)" not in text and "(default: 16)" in text


def test_cli_chunked_and_mixed_steps_answer_alike_with_timings(smollm, capsys):
    """--schedule mixed --chunk-tokens 7 answers the default's tokens, with TTFT and tok/s; a bad budget is one line."""
    prompts = ["What is the capital of France?", "Name three primary colors and say why they are primary."]
    got = []
    for flags in ([], ["--schedule", "mixed", "--chunk-tokens", "7"]):
        L.main(["--json", "--max-new-tokens", "6", *flags, *prompts])
        outs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        got.append([o["token_ids"] for o in outs])
        assert all(o["ttft_s"] > 0 and o["tok_s"] > 0 for o in outs), outs
    assert got[1] == got[0]
    assert "--chunk-tokens must be >= 1" in str(refuses(SystemExit, L.main, ["--chunk-tokens", "0", "hi"]).code)


def test_bench_serve_machinery_on_a_cpu(tmp_path):
    """`bench_engine.py serve` on a tiny model: all served, the schedules' tokens equal, percentiles ordered, a plot."""
    import bench_engine as B  # tests/bench_engine.py (pytest puts tests/ on sys.path)
    args, plot = tiny_model(max_seq_len=256).args, tmp_path / "serve.png"
    schedules = {name: (mixed, chunk and 16) for name, (mixed, chunk) in B.SERVE_SCHEDULES.items()}
    r = B.bench_serve("cpu", rates=(50,), n_seqs=10, lengths=(4, 24), long=(60, 120), long_prompts=2,
                      schedules=schedules, args=args, shape="tiny", plot=str(plot))
    assert r["same_tokens"] and len(r["long_prompts"]) == 2 and plot.stat().st_size > 10_000
    assert list(r["rates"][50]) == list(B.SERVE_SCHEDULES)
    for x in r["rates"][50].values():
        assert x["requests"] == 10 and x["output_tok_s"] > 0
        assert x["ttft_p50_ms"] <= x["ttft_p99_ms"] and x["itl_p50_ms"] <= x["itl_p99_ms"] <= x["itl_max_ms"]
        parts = x["itl_max_steps"]  # the longest gap's steps and the time outside them add up to it
        assert len(parts) >= 2 and parts[-1][0] == "outside steps" and parts[-1][1] > -1e-6
        assert abs(sum(ms for _, ms in parts) - x["itl_max_ms"]) < 1e-6 and all(ms > 0 for _, ms in parts[:-1])
        waits(x, outside=0.2)
    assert "same tokens in every schedule: True" in B.serve_report(r)


def waits(x, outside=0.0):
    """serve's ttft_waits, slowest first: each TTFT = queued + its steps, give or take `outside` of it."""
    w = x["ttft_waits"]
    assert w and abs(w[0]["ttft"] - x["ttft_max_ms"]) < 1e-6 and all(a["ttft"] >= b["ttft"] for a, b in zip(w, w[1:]))
    for a in w:
        steps = sum(a[kind][0] for kind in ("prefill", "mixed", "decode") if kind in a)
        assert a["queued"] >= 0 and (1 - outside) * a["ttft"] - 1e-6 <= a["queued"] + steps <= a["ttft"] + 1e-6, a


def test_serve_simulated_on_a_cpu_says_where_first_tokens_wait():
    """`serve --simulate`: every schedule's slowest first tokens' TTFT is exactly their queue plus their steps."""
    import bench_engine as B
    r = B.simulate_serve(rates=(50,), n_seqs=24, lengths=(4, 24), long=(60, 120), long_prompts=2)
    assert list(r["rates"][50]) == list(B.SERVE_SCHEDULES) and len(r["long_prompts"]) == 2
    for x in r["rates"][50].values():
        assert 0 < x["ttft_p50_ms"] <= x["ttft_p99_ms"] <= x["ttft_max_ms"] and x["itl_p99_ms"] <= x["itl_max_ms"]
        waits(x)
    assert "the slowest first tokens" in B.serve_report(r)


def test_cli_regex_is_pythons_alone_and_schemas_strict_unless_exact(tmp_path, capsys, monkeypatch):
    """Issue 56: bad regex arguments are one line before the model loads; --json-schema is strict unless -exact."""
    monkeypatch.setattr(L, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "boolean"}')
    for argv, msg in [(["--regex", "(?~a)"], "unknown extension ?~"), (["--regex", ""], "empty"),
                      (["--regex", "a", "--json-schema", str(schema)], "--regex and --json-schema")]:
        code = refuses(SystemExit, L.main, argv + ["hi"]).code
        assert isinstance(code, str) and code.startswith("error: ") and "\n" not in code and msg in code, code
    m06, seen = L.lesson("06_jump_forward_fsm"), []
    monkeypatch.setattr(m06, "schema_to_regex", lambda s, strict=True: seen.append(strict) or 1 / 0)
    for exact in ([], ["--json-schema-exact"]):
        refuses(ZeroDivisionError, L.main, ["--json-schema", str(schema), *exact, "hi"])
    assert seen == [True, False]


def test_cli_constrained_answer_closes_within_max_new_tokens(smollm, tmp_path, capsys):
    """Issue 56: an unbounded array closes within --max-new-tokens: finish_reason "stop", and the document parses."""
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object", "properties": {"fruits": {"type": "array", "items": {"type": "string"}}}, '
                      '"required": ["fruits"]}')
    L.main(["--json", "--json-schema", str(schema), "--max-new-tokens", "24", "List one hundred fruits."])
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] == "stop" and len(out["token_ids"]) <= 24, out
    assert isinstance(json.loads(out["text"])["fruits"], list)


@pytest.mark.parametrize("backend", ["token", "paged"])
def test_finish_reasons_counts_and_stop_ids_against_generate(backend):
    """The engine's tokens and finish reasons equal generate()'s, with stop ids, max_new_tokens and ignore_eos."""
    model, C = tiny_model(seed=11), L.lesson("01_kv_cache")
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 9, 17)]
    free = L.generate(model, C.ContiguousKVCache.for_model(model, 3, 64), prompts, 12)
    stop = [free[0][4], free[1][0]]  # prompt 0 stops at its 5th token (or before), prompt 1 at its first
    for n_new in (1, 2, 7, 12):
        want = L.generate(model, C.ContiguousKVCache.for_model(model, 3, 64), prompts, n_new, stop_ids=stop)
        for ignore in (False, True):
            tok = type("Tok", (), {"stop_ids": stop, "eos_id": stop[0]})()
            e = L.Engine(model, tok, backend, kv_tokens=256, max_batch=2)
            for p in prompts:
                e.add(p, L.SamplingParams(max_new_tokens=n_new, ignore_eos=ignore))
            got = e.run()
            for sid, out in got.items():
                assert out == ([o[:n_new] for o in free][sid] if ignore else want[sid]), (n_new, ignore, sid)
                assert e.finish_reasons[sid] == ("stop" if out[-1] in stop and not ignore else "length")


def test_n_samples_each_draw_from_seed_plus_i():
    """Sample i of n draws as a lone request seeded seed + i, whatever runs beside it; samples share the prompt's KV."""
    model, prompt = tiny_model(seed=12), list(range(5, 15))

    def run_one(n, seed, also=()):
        e = L.Engine(model, NOTOK, "token", kv_tokens=512, max_batch=4)
        for p in also:
            e.add(p, L.SamplingParams(max_new_tokens=6, temperature=1.0))
        ids, out = e.add(prompt, L.SamplingParams(max_new_tokens=6, temperature=1.0, n=n, seed=seed)), e.run()
        return [out[i] for i in ids], e.stats["cached_tokens"]
    many, cached = run_one(3, 40, also=[[1, 2, 3]])
    assert many == [run_one(1, 40 + i)[0][0] for i in range(3)] and len({tuple(o) for o in many}) == 3
    assert cached > 0, "samples 2 and 3 computed their prompt again: they should reuse sample 1's"
