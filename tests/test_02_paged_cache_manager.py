"""02: paged attention vs a float64 reference, the real model through the paged cache vs 01's contiguous cache
(with preemption), fork + copy-on-write vs unshared runs, and the block manager's invariants under random use."""
import copy
import importlib
import json
import random

import numpy as np
import pytest
import torch
from helpers import backend_against_brute_force, dense_reference, refuses

P = importlib.import_module("02_paged_cache_manager")
kv01 = importlib.import_module("01_kv_cache")


def random_paged_batch(seq_lens, q_lens, block_size, H, Hkv, D, dtype=torch.float32, device="cpu", seed=0):
    """Random K/V scattered over a randomly permuted pool (other slots poisoned), and the contiguous copies."""
    g, need = torch.Generator().manual_seed(seed), [P.cdiv(L, block_size) for L in seq_lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g)
    k_cache = torch.full((num_blocks, block_size, Hkv, D), 1e4)  # poison: any slot read by mistake ruins the output
    v_cache = torch.full((num_blocks, block_size, Hkv, D), -1e4)
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    ks, vs, off = [], [], 0
    for i, L in enumerate(seq_lens):
        blocks = perm[off:off + need[i]]
        off += need[i]
        table[i, :need[i]] = blocks
        k, v = torch.randn(L, Hkv, D, generator=g), torch.randn(L, Hkv, D, generator=g)
        slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:L]
        k_cache.view(-1, Hkv, D)[slots], v_cache.view(-1, Hkv, D)[slots] = k, v
        ks.append(k)
        vs.append(v)
    q = torch.randn(sum(q_lens), H, D, generator=g)
    to = lambda x: x.to(device, dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return to(q), to(k_cache), to(v_cache), table.to(device), lens, ks, vs


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("mixed", [False, True], ids=["decode", "mixed"])
def test_paged_attention_matches_float64_reference(block_size, mixed):
    seq_lens = [1, 5, 16, 17, 33, 7]
    q_lens = [1, 5, 3, 17, 1, 2] if mixed else [1] * len(seq_lens)
    q, k_cache, v_cache, table, lens, ks, vs = random_paged_batch(seq_lens, q_lens, block_size, H=6, Hkv=2, D=8,
                                                                  seed=block_size + mixed)
    out, t = P.paged_attention(q, k_cache, v_cache, table, lens, q_lens, path="torch"), 0
    for n, k, v in zip(q_lens, ks, vs):
        torch.testing.assert_close(out[t:t + n].double(), dense_reference(q[t:t + n], k, v, len(k) - n), atol=1e-5,
                                   rtol=1e-5)
        t += n


def test_prepare_positions_and_slots_match_brute_force():
    kv = P.PagedKVCache(1, 64, 4, 1, 1)
    kv.prepare([7, 3], [6, 1])
    pos = kv.prepare([3, 9, 7], [5, 2, 1])
    expect_pos, expect_slot = [], []
    for s, start, n in ((3, 1, 5), (9, 0, 2), (7, 6, 1)):
        table = kv.manager.block_tables[s]
        for p in range(start, start + n):
            expect_pos.append(p)
            expect_slot.append(table[p // 4] * 4 + p % 4)
    assert pos.tolist() == expect_pos and kv.tok_slots.tolist() == expect_slot
    assert kv.batch_lens.tolist() == [6, 2, 7] and kv.batch[2] == [5, 2, 1]


def test_greedy_decode_equals_contiguous_cache(smollm):
    import llama3_generate as L
    model, tok = smollm
    prompts = [tok.chat("What is the capital of France?"), tok.chat("Count to five."), tok.encode("Once upon a")]
    ref = L.generate(model, kv01.ContiguousKVCache.for_model(model, len(prompts), 128), prompts, 12)
    paged = P.PagedKVCache.for_model(model, 64, 16)
    assert L.generate(model, paged, prompts, 12) == ref
    assert paged.manager.num_free == 64 and paged.manager.check()  # generate freed everything
    for preempt in ("recompute", "swap"):  # a pool of 22 blocks of 4 tokens holds barely one and a half requests
        out, sched = P.serve(model, prompts, 12, num_blocks=22, block_size=4, preempt=preempt)
        assert sched.stats["preemptions"] > 0, preempt
        assert out == ref, preempt
        assert sched.kv.manager.num_free == 22 and sched.kv.manager.check()


def test_fork_copy_on_write_matches_unshared_runs(smollm):
    model, tok = smollm
    prompt, B = tok.chat("Tell me a story."), 8
    assert len(prompt) % B, "the prompt must end inside a block so that the samples share a partly filled block"
    kv = P.PagedKVCache.for_model(model, 64, B)
    model(torch.tensor(prompt), kv.prepare([0], [len(prompt)]), kv)
    kv.fork(0, 1)
    kv.fork(0, 2)
    m = kv.manager
    assert all(m.ref_count[b] == 3 for b in m.block_tables[0]) and m.check()
    g = torch.Generator().manual_seed(1)
    conts = {s: torch.randint(0, 49152, (5,), generator=g).tolist() for s in (0, 1, 2)}
    steps = [{0: 1, 1: 3, 2: 1}, {0: 1, 1: 1, 2: 2}, {0: 3, 1: 1, 2: 2}]  # ragged: several tokens into the shared block
    done, logits = {s: 0 for s in conts}, {s: [] for s in conts}
    for step in steps:
        seqs = list(step)
        toks = [t for s in seqs for t in conts[s][done[s]:done[s] + step[s]]]
        last = torch.tensor([step[s] for s in seqs]).cumsum(0) - 1
        out = model(torch.tensor(toks), kv.prepare(seqs, [step[s] for s in seqs]), kv, logits_at=last)
        for s, row in zip(seqs, out):
            done[s] += step[s]
            logits[s].append((len(prompt) + done[s], row))
        assert m.check()
    n_full = len(prompt) // B
    assert all(m.ref_count[m.block_tables[0][i]] == 3 for i in range(n_full))  # the prompt's full blocks stay shared
    assert len({m.block_tables[s][n_full] for s in conts}) == 3  # the partly filled one was copied on write
    for s in conts:  # unshared run of prompt + this sample's tokens through 01's cache
        ref_kv, seq = kv01.ContiguousKVCache.for_model(model, 1, 64), prompt + conts[s]
        ref = model(torch.tensor(seq), ref_kv.prepare([0], [len(seq)]), ref_kv)
        for n, row in logits[s]:
            torch.testing.assert_close(row, ref[n - 1], atol=2e-3, rtol=1e-3)
        for layer in range(model.args.n_layers):
            for got, cache in zip(kv.gather(s, layer), (ref_kv.k_cache, ref_kv.v_cache)):
                torch.testing.assert_close(got, cache[layer, 0, :len(seq)], atol=1e-4, rtol=1e-4)


def snapshot(m):
    return list(m.free_blocks), list(m.ref_count), copy.deepcopy(m.block_tables), dict(m.num_tokens)


@pytest.mark.parametrize("seed", range(4))
def test_random_alloc_append_fork_free_keeps_invariants_and_contents(seed):
    """Brute-force model: every sequence's token tags as a Python list; the pool must give them back exactly."""
    rng, B = random.Random(seed), [1, 3, 4, 8][seed]
    kv, oracle, next_id, tag = P.PagedKVCache(1, 24, B, 1, 1), {}, 0, 1.0
    m = kv.manager
    for _ in range(300):
        op = rng.choice(["new", "append", "append", "fork", "free"])
        if op == "fork" and oracle:
            parent = rng.choice(list(oracle))
            kv.fork(parent, next_id)
            oracle[next_id], next_id = list(oracle[parent]), next_id + 1
        elif op == "free" and oracle:
            s = rng.choice(list(oracle))
            kv.free(s)
            del oracle[s]
        else:
            seqs = [next_id] if op == "new" or not oracle else rng.sample(list(oracle), rng.randint(1, len(oracle)))
            n_new = [rng.randint(0 if op != "new" else 1, 2 * B + 1) for _ in seqs]
            before, need = snapshot(m), m.batch_blocks_needed(seqs, n_new)
            one_by_one = copy.deepcopy(m)  # the brute-force answer: the same appends one after the other
            try:
                for s_, n_ in zip(seqs, n_new):
                    one_by_one.append(s_, n_)
                fits = True
            except P.OutOfBlocks:
                fits = False
            try:
                pos = kv.prepare(seqs, n_new)
            except P.OutOfBlocks:
                assert need > m.num_free and not fits, (
                    f"prepare({seqs}, {n_new}) was refused, but it needs {need} blocks and {m.num_free} are free")
                assert snapshot(m) == before, f"a refused prepare({seqs}, {n_new}) changed the manager: {blocks(m)}"
                continue
            assert fits and m.num_free == one_by_one.num_free == len(before[0]) - need, (
                f"prepare({seqs}, {n_new}) left {m.num_free} blocks free; appending one sequence after the other "
                f"leaves {one_by_one.num_free if fits else 'no room (OutOfBlocks)'}, the estimate said "
                f"{len(before[0]) - need}")
            expect = [p for s, n in zip(seqs, n_new) for p in range(len(oracle.get(s, [])), len(oracle.get(s, [])) + n)]
            assert pos.tolist() == expect, f"prepare({seqs}, {n_new}) gave positions {pos.tolist()}; want {expect}"
            tags = torch.arange(tag, tag + len(pos))
            kv.k_cache[0].flatten(0, 1)[kv.tok_slots] = tags[:, None, None]
            for s, n in zip(seqs, n_new):
                oracle.setdefault(s, []).extend(tags[:n].tolist())
                tags, tag = tags[n:], tag + n
            next_id = max(next_id, max(seqs) + 1)
        assert m.check(), blocks(m)
        want = {s: len(t) for s, t in oracle.items()}
        assert want == m.num_tokens, f"after {op}, the sequences hold {m.num_tokens} tokens; want {want}"
        for s, tags_s in oracle.items():
            got = kv.gather(s, 0)[0].flatten().tolist()
            assert got == tags_s, (f"after {op}, sequence {s} reads back the tokens written as {got}; "
                                   f"want {tags_s} (a block shared or freed too early?)")
    for s in list(oracle):
        kv.free(s)
    assert m.num_free == m.num_blocks and m.check(), f"everything freed, yet {blocks(m)}"


def test_clear_errors():
    m = P.BlockManager(4, 4, watermark=0.0)
    refuses(KeyError, m.free, "nope", match="unknown sequence")
    m.append(0, 16)
    before = snapshot(m)
    refuses(P.OutOfBlocks, m.append, 0, 1, match="need 1 blocks but only 0")  # over-committing: refused, no change
    refuses(P.OutOfBlocks, m.append, 1, 3)
    assert snapshot(m) == before and m.check()
    refuses(KeyError, m.fork, 5, 6, match="unknown sequence")
    m.fork(0, 1)
    refuses(ValueError, m.fork, 0, 1, match="already exists")
    m.free(0)
    m.free(1)
    refuses(RuntimeError, m._release, 0, match="released more often")  # a block given back twice
    m.ref_count[2] = 1  # corrupt: a block referenced by no table
    refuses(AssertionError, m.check, match="refcount != owners")
    kv = P.PagedKVCache(1, 8, 4, 1, 1)
    refuses(ValueError, kv.prepare, [1, 1], [1, 1], match="twice")
    refuses(KeyError, kv.free, 3)
    refuses(P.OutOfBlocks, P.simulate, [50], [10], 4, 4, match="cannot fit")  # a request bigger than the pool
    refuses(ValueError, P.Scheduler, P.BlockManager(4, 4), 64, "swap", match="swap needs a PagedKVCache")
    sched, big = P.Scheduler(P.PagedKVCache(1, 2, 4, 1, 1)), P.Request(0, [0] * 9, 1)  # 3 blocks: more than the pool
    refuses(P.OutOfBlocks, sched.prepare, [big], match="whole pool")
    assert sched.kv.manager.num_free == 2 and not big.in_kv and sched.kv.manager.check()
    empty = torch.zeros(2, 16, 1, 8)
    refuses(ValueError, P.paged_attention, torch.zeros(1, 2, 8), empty, empty, torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), [1], "flash", match="flash path needs")
    for argv in (["--requests", "0"], ["--trace", "nope"]):
        assert refuses(SystemExit, P.main, argv).code == 2


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_scheduler_preempts_and_keeps_every_request_kv(preempt):
    """A trace through a pool that holds only a few requests: after every step each running request reads back
    exactly its own K tags (10000 * request + position), through swaps and recomputes."""
    p, o = kv01.synthetic_trace("alpaca", 40, seed=3)
    kv = P.PagedKVCache(1, P.cdiv(int((p + o).max()), 4) + 8, 4, 1, 1)  # the longest request fits alone
    sched = P.Scheduler(kv, 64, preempt)
    sched.waiting.extend(P.Request(i, [0] * int(pi), int(oi)) for i, (pi, oi) in enumerate(zip(p, o)))

    def forward(batch, tokens, positions):
        seq = torch.tensor([r.rid for r, n in zip(batch, [r.n_new for r in batch]) for _ in range(n)])
        kv.k_cache[0].flatten(0, 1)[kv.tok_slots] = (10000 * seq + positions).float()[:, None, None]
        for r in sched.running:
            n, got = kv.manager.num_tokens[r.rid], kv.gather(r.rid, 0)[0].flatten().tolist()
            want = (10000 * r.rid + torch.arange(n)).tolist()
            assert got == want, (f"({preempt}) request {r.rid} reads back K tagged {got[:8]}...; want its own "
                                 f"positions, {want[:8]}...")
        kv.manager.check()
        return [0] * len(batch)
    sched.run(forward)
    assert sched.stats["preemptions"] > 0, f"({preempt}) the trace ran without a preemption"
    got = [len(r.output) for r in sorted(sched.finished, key=lambda r: r.rid)]
    assert got == o.tolist(), f"({preempt}) the requests finished with {got} tokens; want {o.tolist()}"
    assert kv.manager.num_free == kv.manager.num_blocks and kv.manager.check(), \
        f"({preempt}) every request finished, yet {blocks(kv.manager)}"


def test_batch_estimate_counts_copy_on_write_once_per_shared_block():
    """Two sharers of a partly filled block: the first to write copies it, the second then owns it alone."""
    m = P.BlockManager(2, 4, 0.0)
    m.append("p", 2)
    m.fork("p", "c")
    need = m.batch_blocks_needed(["p", "c"], [1, 1])
    assert need == 1, f"a parent and its child each add a token to their shared block: {need} blocks; want 1"
    copies = m.prepare(["p", "c"], [1, 1])
    assert copies == [(0, 1)], f"prepare's copies {copies}; want one, block 0 into 1 (copy-on-write once)"
    assert m.check()


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_random_traces_finish_in_a_pool_the_largest_request_fits(preempt):
    """Issue 22.2: random traces and watermarks finish in a pool the largest request fits alone."""
    rng = random.Random()
    for _ in range(40):
        n, B = rng.randint(1, 6), rng.choice([1, 2, 4])
        p, o = [rng.randint(1, 12) for _ in range(n)], [rng.randint(1, 12) for _ in range(n)]
        blocks = max(P.cdiv(pi + oi - 1, B) for pi, oi in zip(p, o))
        watermark = rng.choice([0.0, 0.01, 0.25, 0.5])
        if preempt == "recompute":
            sched = P.simulate(p, o, blocks, B, max_running=rng.randint(1, 4), watermark=watermark)
        else:
            sched = P.Scheduler(P.PagedKVCache(1, blocks, B, 1, 1, watermark=watermark), rng.randint(1, 4), "swap")
            sched.waiting.extend(P.Request(i, [0] * pi, oi) for i, (pi, oi) in enumerate(zip(p, o)))
            sched.run(lambda batch, tokens, positions: [0] * len(batch))
        assert [len(r.output) for r in sorted(sched.finished, key=lambda r: r.rid)] == o, (p, o, B, watermark)
    for args in (([1, 5], [3, 3], 8, 1, 4, 0.25), ([1, 197], [3, 3], 200, 1, 4)):  # the two traces
        assert len(P.simulate(*args).finished) == 2


@pytest.mark.parametrize("B", [1, 4, 16])
def test_simulation_statistics_are_consistent(B):
    p, o = kv01.synthetic_trace("sharegpt", 60, seed=B)
    num_blocks = 4096 // B
    sched = P.simulate(p, o, num_blocks, B)
    assert sorted(len(r.output) for r in sched.finished) == sorted(o.tolist())
    assert any(waiting for *_, waiting in sched.decode_log) and sched.stats["preemptions"] > 0
    for running, live, used, _ in sched.decode_log:  # paging wastes less than one block per running request
        assert 0 <= used * B - live < running * B and used <= num_blocks


@pytest.mark.parametrize("beam", [False, True], ids=["parallel", "beam"])
def test_sharing_saved_equals_distinct_history_count(beam):
    """sharing_saved: sequences share block j exactly when their histories agree to its end (an independent model)."""
    p, o = kv01.synthetic_trace("alpaca", 12, seed=7)
    B, width, rng, held, unshared, uid = 4, 3, np.random.default_rng(0), 0, 0, 0
    for pi, oi in zip(p.tolist(), o.tolist()):
        hist = [tuple(["prompt"] * pi)] * width
        for step in range(oi):
            if step:
                if beam:
                    hist = [hist[parent] for parent in rng.integers(0, width, width)]
                hist = [h + (uid + i,) for i, h in enumerate(hist)]
                uid += width
            held += len({(j, h[:(j + 1) * B]) for h in hist for j in range(P.cdiv(len(h), B))})
            unshared += width * P.cdiv(len(hist[0]), B)
    assert P.sharing_saved(p, o, width, beam, block_size=B, seed=0) == pytest.approx(1 - held / unshared, rel=1e-12)


def test_json_report(capsys):
    P.main(["--json", "--no-model", "--requests", "100", "--budget", "8192"])
    res = json.loads(capsys.readouterr().out)
    live = res["live_fraction"]
    assert set(live) == {"1", "16", "256"} and all(0 < x <= 1 for x in live.values())
    assert min(live.values()) > res["live_fraction_max_len"] and res["batch"]["16"] > res["batch_max_len"]
    assert set(res["sharing_saved"]) == {"parallel", "beam"}


# ---------------------------------------------------------------------------------------------- GPU (flash-attn)

@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_flash_path_equals_torch_path(D):
    pytest.importorskip("flash_attn")
    seq_lens = [1, 255, 256, 257, 700, 1500]
    for q_lens in ([1] * len(seq_lens), [1, 100, 256, 3, 700, 1]):
        q, kc, vc, table, lens, ks, vs = random_paged_batch(seq_lens, q_lens, 256, H=8, Hkv=2, D=D,
                                                            dtype=torch.bfloat16, device="cuda", seed=D)
        assert P.flash_ok(kc)
        flash = P.paged_attention(q, kc, vc, table, lens, q_lens, path="flash").float()
        ref = P.paged_attention(q, kc, vc, table, lens, q_lens, path="torch").float()
        exact = torch.cat([dense_reference(q[t - n:t].cpu(), k.bfloat16(), v.bfloat16(), len(k) - n).float()
                           for n, t, k, v in zip(q_lens, np.cumsum(q_lens), ks, vs)]).cuda()
        print(f"\nD={D} q_lens={q_lens}: |flash - torch| max {(flash - ref).abs().max():.2e}, "
              f"|flash - fp64| max {(flash - exact).abs().max():.2e}, |torch - fp64| max {(ref - exact).abs().max():.2e}")
        torch.testing.assert_close(flash, ref, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(flash, exact, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_random_weight_model_decodes_through_flash_path():
    pytest.importorskip("flash_attn")
    import llama3_generate as L
    torch.manual_seed(0)
    args = L.ModelArgs(dim=512, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=1000, hidden_dim=1024, max_seq_len=2048)
    model = L.Transformer(args).to("cuda", torch.bfloat16).eval()
    prompts, logits = [torch.randint(0, 1000, (n,)).tolist() for n in (300, 5, 600)], {}
    for path in ("flash", "torch"):
        kv, lens = P.PagedKVCache.for_model(model, 16, 256, path=path), [len(p) for p in prompts]
        rows = [model(torch.tensor(sum(prompts, []), device="cuda"), kv.prepare([0, 1, 2], lens), kv,
                      logits_at=torch.tensor(lens, device="cuda").cumsum(0) - 1)]
        for step in range(4):  # teacher-forced decode: same inputs on both paths
            rows.append(model(torch.tensor([step, 7, 9], device="cuda"), kv.prepare([0, 1, 2], [1, 1, 1]), kv))
        logits[path] = torch.stack(rows)
    diff = (logits["flash"] - logits["torch"]).abs().max() / logits["torch"].abs().max()
    print(f"\nrandom-weight model, flash vs torch path logits: max |diff| / max |logit| = {diff:.2e}")
    assert diff < 2e-2


def random_table_workload(kv, steps, rng):
    """Random steps of a PagedKVCache (grow, fork, free, swap), yielding after each prepare; unused entries -1."""
    live, swapped, next_id = [], [], 0
    for _ in range(steps):
        kv.table[kv.free_rows] = -1  # poison what no row uses; what a row uses must survive from earlier writes
        for s, row in kv.rows.items():
            kv.table[row, len(kv.manager.block_tables[s]):] = -1
        op = rng.random()
        if (op < 0.15 or len(kv.free_rows) < 2) and live:
            s = live.pop(rng.randrange(len(live)))
            kv.free(s)
        elif op < 0.22 and live:
            kv.fork(rng.choice(live), next_id)
            live.append(next_id)
            next_id += 1
        elif op < 0.28 and live:
            s = live.pop(rng.randrange(len(live)))
            swapped.append((s, kv.swap_out(s)))
        elif op < 0.36 and swapped and kv.manager.can_allocate(swapped[0][1][2], alone=True):
            s, saved = swapped.pop(0)
            kv.swap_in(s, saved)
            live.append(s)
        else:
            batch = rng.sample(live, rng.randint(0, len(live))) + ([next_id] if rng.random() < 0.4 else [])
            n_new = [rng.randint(1, 9) if s == next_id else rng.choice([1, 1, rng.randint(1, 5)]) for s in batch]
            keep = [i for i, (s, n) in enumerate(zip(batch, n_new)) if kv.lens.get(s, 0) + n <= kv.max_seq_len]
            batch, n_new = [batch[i] for i in keep], [n_new[i] for i in keep]
            if not batch:
                continue
            try:
                positions = kv.prepare(batch, n_new)
            except P.OutOfBlocks:
                continue
            if next_id in batch:
                live.append(next_id)
                next_id += 1
            yield batch, n_new, positions
        assert kv.manager.check()


def test_device_tables_follow_the_manager():
    """The device table, rows, lengths and slots CUDA graphs read equal the BlockManager's after every random step."""
    rng = random.Random(int(torch.randint(0, 10**6, ())))
    kv, steps = P.PagedKVCache(1, 40, 4, 1, 2, max_seqs=12, max_seq_len=64), 0
    for batch, n_new, positions in random_table_workload(kv, 800, rng):
        m, B = kv.manager, kv.block_size
        for s in m.block_tables:
            if s in kv.rows:
                blocks = m.block_tables[s]
                assert kv.table[kv.rows[s], :len(blocks)].tolist() == blocks, s
        want_pos = [p for s, n in zip(batch, n_new) for p in range(m.num_tokens[s] - n, m.num_tokens[s])]
        want_slots = [m.block_tables[s][p // B] * B + p % B for s, n in zip(batch, n_new)
                      for p in range(m.num_tokens[s] - n, m.num_tokens[s])]
        assert positions.tolist() == want_pos and kv.tok_slots.tolist() == want_slots
        assert kv.batch_rows.tolist() == [kv.rows[s] for s in batch]
        assert kv.batch_lens.tolist() == [m.num_tokens[s] for s in batch]
        assert len(set(kv.rows.values())) == len(kv.rows) and not set(kv.rows.values()) & set(kv.free_rows)
        steps += 1
    assert steps > 200


@pytest.mark.triton
def test_kernels_read_the_device_tables():
    """04's kernels read a PagedKVCache's device table as float64 attention over the BlockManager's (NaN past it)."""
    m04 = importlib.import_module("04_triton_token_attn")
    rng = random.Random(int(torch.randint(0, 10**6, ())))
    kv = P.PagedKVCache(1, 48, 4, 2, 16, max_seqs=12, max_seq_len=64)
    kv.pad_row()
    nan_block = kv.manager.block_tables["pad"][0]
    kv.k_cache[0, nan_block], kv.v_cache[0, nan_block] = float("nan"), float("nan")
    k_pool, v_pool = kv.layer_pools(0)
    checked = 0
    for batch, n_new, positions in random_table_workload(kv, 150, rng):
        kv.table[kv.table < 0] = nan_block
        T = sum(n_new)
        k_pool[kv.tok_slots], v_pool[kv.tok_slots] = torch.randn(T, 2, 16), torch.randn(T, 2, 16)
        q, (_, starts, _) = torch.randn(T, 4, 16), kv.batch
        if all(n == 1 for n in n_new):
            out = m04.token_decode_attention(q, k_pool, v_pool, kv.table, kv.batch_rows, kv.batch_lens, page=4)
        else:
            out = m04.token_extend_attention(q, k_pool, v_pool, kv.table, kv.batch_rows, starts, n_new, page=4)
        t = 0
        for s, n in zip(batch, n_new):
            L, blocks = kv.manager.num_tokens[s], kv.manager.block_tables[s]
            slots = [blocks[i // 4] * 4 + i % 4 for i in range(L)]
            ref = P.L01.attend_dense(q[t:t + n].double(), k_pool[slots].double(), v_pool[slots].double())
            torch.testing.assert_close(out[t:t + n].double(), ref, atol=1e-5, rtol=1e-5)
            t += n
        checked += 1
    assert checked > 25


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_preemption_order_against_the_policy(preempt):
    """vLLM's policy on every step of random traces: first come first served; the newest running request is the
    victim; a recomputed one goes back to the queue's head, swapped ones come back first, in the order they left."""
    rng = random.Random(preempt)
    for trial in range(12):
        n, B = rng.randint(4, 9), rng.choice([1, 2, 4])
        p, o = [rng.randint(1, 10) for _ in range(n)], [rng.randint(2, 12) for _ in range(n)]
        blocks = max(P.cdiv(pi + oi - 1, B) for pi, oi in zip(p, o)) + rng.randint(0, 3)
        kv = P.PagedKVCache(1, blocks, B, 1, 1, watermark=0.0, max_seqs=rng.randint(1, 5))  # few rows: held back
        sched = P.Scheduler(kv, rng.randint(2, 6), preempt)
        sched.waiting.extend(P.Request(i, [0] * pi, oi) for i, (pi, oi) in enumerate(zip(p, o)))
        swapped_out, swapped_in = [], []
        while sched.busy:
            before, seen = [r.rid for r in sched.running], len(sched.events)
            sched.step(lambda batch, tokens, positions: [0] * len(batch))
            new = sched.events[seen:]
            order = before + [e.rid for e in new if e.kind == "swap_in"]  # running, oldest (re)admission first
            victims = [order.index(e.rid) for e in new if e.kind in ("preempt", "swap_out")]
            kept = [order.index(r.rid) for r in sched.running if r.rid in order]
            assert all(v > k for v in victims for k in kept), (
                f"({preempt}) running {order}, the step preempted {victims} (places in that list) and kept "
                f"{kept}: the newest must go first; events {new}")
            assert victims == sorted(victims, reverse=True), f"({preempt}) newest first, one by one: {new}"
            waiting = [r.rid for r in sched.waiting]
            assert waiting == sorted(waiting), (f"({preempt}) the queue is {waiting} after {new}: a preempted "
                                                "request goes back to its head")
            assert all(r.rid < w for r in sched.running for w in waiting), (
                f"({preempt}) requests {[r.rid for r in sched.running]} run while {waiting} wait: nobody overtakes")
            swapped_in += [e.rid for e in new if e.kind == "swap_in"]
            if any(e.kind == "admit" for e in new):  # swapped ones come back before anyone new is admitted
                assert len(swapped_in) == len(swapped_out), (
                    f"({preempt}) a request was admitted while swapped-out ones waited: {new}")
            swapped_out += [e.rid for e in new if e.kind == "swap_out"]
        assert swapped_in == swapped_out, f"swapped out {swapped_out}, back in {swapped_in}: first out, first back"
        got = [len(r.output) for r in sorted(sched.finished, key=lambda r: r.rid)]
        assert got == o, f"({preempt}) the requests finished with {got} tokens; want {o}"


@pytest.mark.parametrize("B", [1, 3, 4])
def test_admission_takes_exactly_what_fits_above_the_watermark(B):
    """The first step admits the longest first-come run whose blocks leave the watermark free (brute force)."""
    rng = random.Random(B)
    for _ in range(60):
        blocks, wm = rng.randint(4, 30), rng.choice([0.0, 0.1, 0.2, 0.34])
        p = [rng.randint(1, rng.choice([3 * B + 2, blocks * B])) for _ in range(rng.randint(1, 8))]  # or one alone
        sched = P.Scheduler(P.BlockManager(blocks, B, wm), rng.randint(1, 8))
        sched.waiting.extend(P.Request(i, [0] * pi, 3) for i, pi in enumerate(p))
        want, taken = [], 0
        for i, pi in enumerate(p):
            need = -(-pi // B)
            if len(want) == sched.max_running or blocks - taken - need < (0 if i == 0 else int(wm * blocks)):
                break
            want.append(i)
            taken += need
        assert [r.rid for r in sched.admit()] == want, (blocks, wm, p)


@pytest.mark.parametrize("block_size,seed", [(1, 0), (4, 1), (5, 2)])
def test_paged_cache_batches_against_a_brute_force_model(block_size, seed):
    """01's brute-force drive through the paged backend, in a pool of exactly three 12-token requests."""
    kv = P.PagedKVCache(1, 3 * P.cdiv(12, block_size), block_size, 2, 8, watermark=0.0, max_seqs=3, max_seq_len=12)
    backend_against_brute_force(kv, seed)
    assert kv.manager.num_free == kv.manager.num_blocks and kv.manager.check() and sorted(kv.free_rows) == [0, 1, 2]


# ------------------------------------------------------------------ the workshop's exercises, on small cases, in words

def blocks(m):
    """The manager in words: each sequence's table and tokens, the refcounts of used blocks, the free list."""
    used = {b: c for b, c in enumerate(m.ref_count) if c}
    return (f"tables {m.block_tables}, tokens {m.num_tokens}, refcounts {used}, "
            f"{m.num_free} of {m.num_blocks} blocks free")


def test_append_takes_whole_blocks_and_copies_a_shared_partial_one():
    """append on a pool of 6 blocks of 4 tokens, then on one of 10 blocks: whole blocks as needed, none while the
    last has room; no room: OutOfBlocks, nothing changed; a shared full last block is not copied, a shared partly
    filled one is, by each writer but the last (returned as (src, dst))."""
    m = P.BlockManager(6, 4, 0.0)
    for seq, n, new_blocks in (("a", 5, 2), ("a", 3, 0), ("a", 1, 1), ("b", 4, 1), ("b", 0, 0)):
        before, have = blocks(m), len(m.block_tables.get(seq, []))
        copies = m.append(seq, n)
        assert copies == [], f"append({seq!r}, {n}) returned copies {copies} with nothing shared; want []"
        assert len(m.block_tables[seq]) == have + new_blocks, (
            f"append({seq!r}, {n}) with {before}: {seq!r} holds {len(m.block_tables[seq])} blocks; want "
            f"{have + new_blocks} (whole blocks of 4 tokens, a new one only when the last is full)")
        assert m.check(), f"after append({seq!r}, {n}): {blocks(m)}"
    snap, state = snapshot(m), blocks(m)
    refuses(P.OutOfBlocks, m.append, "c", 9, what=f"append('c', 9) (3 blocks) with {state}")
    assert snapshot(m) == snap, f"append('c', 9) was refused but changed the manager: {state} became {blocks(m)}"
    refuses(P.OutOfBlocks, m.append, "a", 12, what=f"append('a', 12) (3 more blocks) with {state}")
    assert snapshot(m) == snap, f"append('a', 12) was refused but changed the manager: {state} became {blocks(m)}"
    m = P.BlockManager(10, 4, 0.0)
    m.append("full", 8)
    m.fork("full", "twin")
    state = blocks(m)
    assert m.append("twin", 1) == [], f"append('twin', 1) copied a full shared block ({state}); want no copy"
    assert m.block_tables["twin"][:2] == m.block_tables["full"], f"the full blocks stopped being shared: {blocks(m)}"
    assert [m.ref_count[b] for b in m.block_tables["full"]] == [2, 2] and m.num_free == 7, blocks(m)
    m.append("half", 6)
    m.fork("half", "h2")
    m.fork("half", "h3")
    last, state = m.block_tables["half"][1], blocks(m)
    assert m.blocks_needed("h2", 1) == 1 and m.blocks_needed("h2", 3) == 2, state  # the copy, then a new block
    copies = m.append("h2", 1)
    assert copies == [(last, m.block_tables["h2"][1])], (
        f"append('h2', 1) with {state} returned copies {copies}; block {last} is partly filled and shared by 3: "
        f"want [({last}, the new block)] and h2's table pointing at the copy")
    assert m.ref_count[last] == 2, f"after the copy block {last} has refcount {m.ref_count[last]}; want 2"
    assert m.append("h3", 2) == [(last, m.block_tables["h3"][1])] and m.ref_count[last] == 1, \
        f"the second writer must copy too: {blocks(m)}"
    state = blocks(m)
    assert m.append("half", 2) == [] and m.block_tables["half"][1] == last, (
        f"append('half', 2) with {state}: the last holder of block {last} writes in place; got {blocks(m)}")
    assert m.check() and m.num_free == 10 - 7, blocks(m)  # full (and twin): 2, twin: 1, half: 2, h2 and h3: a copy each


def test_fork_shares_every_block_and_refuses_clearly():
    """fork on a pool of 6 blocks of 4: the child gets its own copy of the table, the token count, and each block
    one more reference; an unknown parent is a KeyError and a child that exists a ValueError, nothing changed."""
    m = P.BlockManager(6, 4, 0.0)
    m.append("p", 6)
    state = blocks(m)
    m.fork("p", "c")
    assert m.block_tables.get("c") == m.block_tables["p"], f"after fork('p', 'c') with {state}: {blocks(m)}"
    assert m.num_tokens.get("c") == 6, f"after fork('p', 'c') the child has {m.num_tokens.get('c')} tokens; want 6"
    refs = [m.ref_count[b] for b in m.block_tables["p"]]
    assert refs == [2, 2], f"after fork('p', 'c') the shared blocks' refcounts are {refs}; want [2, 2]"
    m.block_tables["c"].append(5)
    assert m.block_tables["p"] != m.block_tables["c"], \
        "the child's table is the parent's own list (a change to one changes the other): copy it"
    m.block_tables["c"].pop()
    snap, state = snapshot(m), blocks(m)
    refuses(KeyError, m.fork, "nobody", "x", what=f"fork('nobody', 'x') with {state} (unknown parent)")
    refuses(ValueError, m.fork, "p", "c", what=f"fork('p', 'c') with {state} ('c' exists)")
    assert snapshot(m) == snap, f"a refused fork changed the manager: {state} became {blocks(m)}"
    assert m.check(), blocks(m)


def test_free_gives_a_block_back_when_nobody_holds_it():
    """free on a pool of 6 blocks of 4: each of the sequence's blocks loses one reference and joins the free list
    at 0; the sequence is forgotten (table and tokens); an unknown one is a KeyError, nothing changed."""
    m = P.BlockManager(6, 4, 0.0)
    m.append("p", 6)
    m.fork("p", "c")
    m.append("c", 3)  # c: a copy of p's second block, and a block of its own
    snap, state = snapshot(m), blocks(m)
    refuses(KeyError, m.free, "nobody", what=f"free('nobody') with {state}")
    assert snapshot(m) == snap, f"a refused free changed the manager: {state} became {blocks(m)}"
    shared, own = m.block_tables["p"][0], m.block_tables["c"][1:]
    m.free("c")
    assert "c" not in m.block_tables and "c" not in m.num_tokens, f"free('c') left 'c' behind: {blocks(m)}"
    assert m.ref_count[shared] == 1 and shared not in m.free_blocks, (
        f"free('c') with {state}: block {shared}, still held by 'p', has refcount {m.ref_count[shared]} "
        f"and is {'' if shared in m.free_blocks else 'not '}free; want refcount 1, not free")
    assert all(b in m.free_blocks and m.ref_count[b] == 0 for b in own), (
        f"free('c') with {state}: 'c''s own blocks {own} must be free again; got {blocks(m)}")
    m.free("p")
    assert m.num_free == 6 and m.check(), f"after freeing everything: {blocks(m)}"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempt_logs_the_kv_it_drops_then_drops_it(mode):
    """preempt of a request holding 7 tokens of KV, another waiting: counted, logged (tokens: the 7 it held, logged
    before anything is dropped); swap: it joins `swapped` with what swap_out saved and in_kv False; recompute: its
    KV is released (kv_len 0, in_kv False) and it waits at the head of the queue."""
    kv = P.PagedKVCache(1, 8, 4, 1, 1)
    sched = P.Scheduler(kv, 4, mode)
    r, other = P.Request(0, [1] * 7, 4), P.Request(1, [1] * 30, 4)
    sched.waiting.append(r)
    batch, _ = sched.schedule()
    sched.postprocess(batch, [[2]])
    sched.waiting.append(other)
    held = r.kv_len
    assert held == 7 and sched.running == [r], f"the set-up: r holds {held} tokens (want 7), running {sched.running}"
    sched.running.remove(r)
    n_events = len(sched.events)
    sched.preempt(r)
    kind = "swap_out" if mode == "swap" else "preempt"
    new = sched.events[n_events:]
    assert sched.stats["preemptions"] == 1, f"preempt ({mode}) counted {sched.stats['preemptions']} preemptions"
    assert [(e.kind, e.rid) for e in new] == [(kind, 0)], \
        f"preempt ({mode}) logged {new}; want one event {kind!r} for request 0"
    assert new[0].tokens == held, (f"preempt ({mode}) logged {new[0].tokens} tokens of KV; the request held {held} "
                                   "before it was preempted (log it before the KV is dropped)")
    assert not r.in_kv, f"after preempt ({mode}) req.in_kv is still True: its KV is no longer in the pool"
    assert 0 not in kv.manager.block_tables, f"after preempt ({mode}) the pool still holds request 0's blocks"
    if mode == "swap":
        assert len(sched.swapped) == 1 and sched.swapped[0][0] is r, \
            f"after a swap-out, swapped is {list(sched.swapped)}; want [(the request, what swap_out saved)]"
        saved = sched.swapped[0][1]
        assert isinstance(saved, tuple) and saved[2] == held, \
            "swapped holds the request with something that is not what kv.swap_out(rid) returned"
        assert list(sched.waiting) == [other], "a swapped-out request does not wait in the queue"
    else:
        assert r.kv_len == 0, f"after preempt (recompute) kv_len is {r.kv_len}; want 0 (release(req) drops its KV)"
        assert list(sched.waiting) == [r, other], (
            f"after preempt (recompute) the queue holds requests {[w.rid for w in sched.waiting]}; want [0, 1]: "
            "the preempted one first")
