"""bench_03.py -- 03's token allocator beside its peers: alloc(n) + free on a half-full, scattered pool against a
Python set and 02's BlockManager, at n = 1, 64 and 4096, on the CPU (on a GPU also on CUDA, and one decode step's
alloc + free against the step itself), printed after 03's own figures.

    python tests/bench_03.py            # or: python 03_token_allocator.py --bench  (its flags: --json, --seed, ...)
"""
import importlib
import os
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # the repository root; tests/ (helpers: bench_decode_share's model)
m = importlib.import_module("03_token_allocator")


class PythonSetAllocator:
    """The peer: free slots in a Python set, one interpreter step per token (set.pop: its fastest)."""

    def __init__(self, size: int, device="cpu"):
        self.free_slots, self.used, self.device = set(range(size)), set(), device

    def alloc(self, n: int):
        if n > len(self.free_slots):
            return None
        picked = [self.free_slots.pop() for _ in range(n)]
        self.used.update(picked)
        return torch.tensor(picked, device=self.device)  # the slots must reach the device for attention anyway

    def free(self, idx):
        idx = idx.tolist()
        if not self.used.issuperset(idx):
            raise ValueError("free of a slot that is not allocated")
        self.used.difference_update(idx)
        self.free_slots.update(idx)


class BlockPeer:
    """02's BlockManager (bookkeeping only: no slot tensor is built), blocks of 16, behind alloc(n) / free(handle)."""

    def __init__(self, size: int, device="cpu"):
        self.bm, self.n = m.L02.BlockManager(size // 16, 16, 0.0), 0

    def alloc(self, n: int):
        self.n += 1
        self.bm.append(self.n, n)
        return self.n

    def free(self, seq):
        self.bm.free(seq)


def half_full(a, size: int, seed: int = 0):
    """Fill the pool, then free a random half: the free slots (or blocks) end up scattered."""
    perm = torch.randperm(size, generator=torch.Generator().manual_seed(seed))
    if isinstance(a, BlockPeer):
        held = [a.alloc(16) for _ in range(size // 16)]
        for j in perm[perm < len(held)][:len(held) // 2].tolist():
            a.free(held[j])
    else:
        held = a.alloc(size)
        a.free(held[perm[:size // 2].to(held.device)])


def time_alloc_free(a, n: int, budget_s: float = 0.2, sync=lambda: None) -> float:
    """Seconds per alloc(n) + free of what it returned."""
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < budget_s or calls < 3:
        a.free(a.alloc(n))
        calls += 1
    sync()
    return (time.perf_counter() - t0) / calls


def throughput(device="cpu", size=65536, batches=(1, 64, 4096), budget_s=0.2, seed=0):
    """alloc+free calls/s and tokens/s of the token allocator and its peers, same pool size, same run."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    peers, rows = {"token": m.TokenAllocator, "python_set": PythonSetAllocator, "blocks_02": BlockPeer}, {}
    for n in batches:
        rows[n] = r = {}
        for name, cls in peers.items():
            try:
                a = cls(size, device)
            except Exception:                                       # 02 missing or broken: compare without it
                continue
            half_full(a, size, seed)
            time_alloc_free(a, n, 0.02, sync)                       # warm-up
            t = time_alloc_free(a, n, budget_s, sync)
            r[name] = {"calls_per_s": 1 / t, "tokens_per_s": n / t}
            r[f"speedup_vs_{name}"] = r["token"]["calls_per_s"] / r[name]["calls_per_s"]
        del r["speedup_vs_token"]
    return rows


def bench_decode_share(batch=32, context=512, steps=20, device="cuda"):
    """GPU: one decode step's alloc + free vs the step itself (random-weight Llama-3.2-1B shape, bf16)."""
    from dataclasses import replace

    from helpers import LLAMA_SHAPES, random_model
    args = replace(LLAMA_SHAPES["llama-3.2-1b"], max_seq_len=4096)
    model = random_model(args, device)  # seed 0, bf16
    size, seqs, sync = batch * (context + steps), list(range(batch)), torch.cuda.synchronize
    kv = m.TokenKVCache.for_model(model, size, max_requests=batch, max_seq_len=context + steps)
    tokens = torch.randint(0, args.vocab_size, (batch * context,), device=device)
    model(tokens, kv.prepare(seqs, [context] * batch), kv, logits_at=torch.arange(batch, device=device))  # prefill
    prep, step = [], []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        pos = kv.prepare(seqs, [1] * batch)                  # alloc(batch) + req_to_token writes
        sync()
        t1 = time.perf_counter()
        model(tokens[:batch], pos, kv)
        sync()
        prep.append(t1 - t0)
        step.append(time.perf_counter() - t0)
    spare = m.TokenAllocator(size, device)
    half_full(spare, size)
    af, step, prep = time_alloc_free(spare, batch, 0.2, sync), float(np.median(step)), float(np.median(prep))
    return {"device": torch.cuda.get_device_name(), "batch": batch, "context": context, "decode_step_ms": step * 1e3,
            "alloc_free_us": af * 1e6, "alloc_free_share_of_step": af / step, "prepare_share_of_step": prep / step}


def measure(n_requests=200, seed=0, budget_s=0.2, cuda=None):
    """03's figures, then its peers' beside them on the CPU (and on CUDA where there is a GPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops don't parallelise, and on a shared 2-core box 2 threads time erratically
    try:
        r, tp = m.measure(n_requests, seed), throughput(budget_s=budget_s, seed=seed)
        r.update(throughput_cpu_pool_65536=tp,
                 alloc_free_speedup_vs_python_set={n: row["speedup_vs_python_set"] for n, row in tp.items()})
        if torch.cuda.is_available() if cuda is None else cuda:
            r["throughput_cuda_pool_1M"] = throughput("cuda", size=1 << 20, seed=seed)
            r["gpu_decode"] = bench_decode_share()
    finally:
        torch.set_num_threads(threads)
    return r


def report(r):
    m.report(r)
    for key, tp in [(k, v) for k, v in r.items() if k.startswith("throughput")]:
        print(f"\nalloc(n) + free on a half-full, scattered pool ({key.split('_', 1)[1]}):")
        for n, row in tp.items():
            for name in [k for k in row if not k.startswith("speedup")]:
                vs = "" if name == "token" else f"   token allocator = {row['speedup_vs_' + name]:.2f}x"
                print(f"  n={n!s:<5} {name:10s} {row[name]['calls_per_s']:11,.0f} calls/s "
                      f"{row[name]['tokens_per_s']:14,.0f} tokens/s{vs}")
    if "gpu_decode" in r:
        d = r["gpu_decode"]
        print(f"\n{d['device']}: decode step of a random Llama-3.2-1B (bf16, batch {d['batch']}, context "
              f"{d['context']}) {d['decode_step_ms']:.2f} ms; "
              f"alloc+free of {d['batch']} slots {d['alloc_free_us']:.0f} us"
              f" = {d['alloc_free_share_of_step']:.2%} of it; the whole prepare() {d['prepare_share_of_step']:.2%}")
    print("\nThe cumsum allocator does O(pool) tensor work in O(1) Python steps: a Python set wins for single tokens, "
          "the tensor\nallocator for big batches.")


if __name__ == "__main__":
    m.main(["--bench", *sys.argv[1:]])
