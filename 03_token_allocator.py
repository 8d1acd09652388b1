"""
03_token_allocator.py -- LightLLM's TokenAttention pool: KV memory allocated one token at a time
with torch.cumsum.

Paged attention (02) cuts the KV cache into blocks of B tokens; a request wastes up to B - 1 slots
in its last block. LightLLM's TokenAttention takes the idea to its end: page size 1. One pool of
`size` KV slots is allocated up front and every token of every request gets its own slot, wherever
one is free. A request's slots need not be adjacent; a table `req_to_token` remembers where each of
its tokens lives, and attention gathers through it.

    k_pool, v_pool  (n_layers, size, n_kv_heads, head_dim)   one slot = one token's K (or V) in every layer
    mem_state       (size,) int32 refcount per slot           0 = free, 1 = used, 2+ = shared by a prefix cache

    slot:       0   1   2   3   4   5   6   7   8   9
    mem_state [ 1 | 1 | 0 | 1 | 2 | 0 | 0 | 1 | 0 | 1 ]
    owner       A   A   .   B   AB  .   .   B   .   A        (slot 4: a prompt prefix shared by A and B)

    req_to_token  (max_requests, max_seq_len) int32           row r, column i = the slot of token i of request r
      row of A: [4, 0, 1, 9, ...]     row of B: [4, 3, 7, ...]   (only the first seq_len columns mean anything)

The cumsum trick: allocating n slots is a few tensor ops on the pool's device, no Python loop over slots.
    mem_state      1 1 0 1 2 0 0 1 0 1
    free = (==0)   0 0 1 0 0 1 1 0 1 0
    cumsum(free)   0 0 1 1 1 2 3 3 4 4     running count of free slots up to and including each slot
    alloc(3): select free slots whose count is <= 3 -> slots 2, 5, 6  (LightLLM: `indexes[free & (cumsum <= n)]`)
    Same answer, fixed output shape and no host sync: searchsorted(cumsum, [1, 2, 3]) -- the first slot where the
    count reaches k is the k-th free slot. We keep the number of free slots on the host, so the "enough?" test is free.
    alloc_contiguous(n): window sums of the same cumsum, c[i + n] - c[i], count the free slots in [i, i + n); a value
    of n marks a run of n free slots starting at i (LightLLM's alloc_contiguous). Free = decrement the refcounts.

Page size 1 means no internal fragmentation (live-token share ~100%, see the report) at the price of a gather per
token in attention -- which is why 04 writes a Triton kernel that reads req_to_token directly. The price of the
cumsum: every call scans the whole pool and costs a dozen tensor ops (kernel launches on a GPU) plus one host sync
in free. So a Python set still wins for single tokens, the tensor allocator wins for big batches, and on a GPU
either is well under 1% of an eager decode step (--bench measures all three: tests/bench_03.py). This is LightLLM's
original MemoryManager (2023); today LightLLM and SGLang keep a tensor of free slot ids and slice n off its front
-- O(n) work, but no refcounts and no contiguous runs.

No waste is not no room. A decode loop that syncs with the host once per k steps (the engine's
multi-step chunks, vLLM's multi-step scheduling) takes the slots of all k tokens before the first
step runs: r running requests need r x k free slots. A pool that admission filled to its last slot
wastes nothing, and stalls that loop to one step per host round trip. So 05's scheduler keeps k
look-ahead slots per running request free (its lookahead), a chunk runs as many steps as fit, and
a request takes no slot past its max_new_tokens (a chunk's steps after its end write a scratch
slot): the slots held ahead are what it costs never to make the GPU wait.

Imports: 01 (the seam, cpu_threads) and 02 (OutOfBlocks) at module level; no model.

References: LightLLM (ModelTC/lightllm, TokenAttention, `MemoryManager.alloc / alloc_contiguous /
free` and `mem_state`), SGLang (`ReqToTokenPool`, `token_to_kv_pool` / `TokenToKVPoolAllocator`),
Kwon et al. 2023 (vLLM, PagedAttention) for the block view compared against.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy

import numpy as np
import torch
import torch.nn.functional as F

# KVCache: the seam and its attention through the table
L01 = importlib.import_module("01_kv_cache")
L02 = importlib.import_module("02_paged_cache_manager")  # OutOfBlocks: a token is a block of size 1


# ======== THE IDEA, 1: a pool of single-token slots, allocated with torch.cumsum ==================

class TokenAllocator:
    """Refcounted KV slots: mem_state (size,) int32 on the pool's device; every op is a handful of tensor ops."""

    def __init__(self, size: int, device="cpu"):
        if size < 1:
            raise ValueError(f"pool size must be >= 1, got {size}")
        self.size, self.device = size, torch.device(device)
        # (size,) refcounts, 0 = free
        self.mem_state = torch.zeros(size, dtype=torch.int32, device=device)
        self.n_free = size  # host copy of (mem_state == 0).sum(): alloc never has to ask the device

    def available(self) -> int:
        return self.n_free

    def _index(self, idx) -> torch.Tensor:
        return torch.as_tensor(idx, device=self.device).long().reshape(-1)

    def _take(self, idx):
        # not mem_state[idx] = 1: that copies the 1 to the GPU, a host sync
        self.mem_state.index_fill_(0, idx, 1)
        self.n_free -= idx.numel()
        return idx

    def alloc(self, n: int):
        """n free slots (LongTensor (n,)), lowest indices first; None if fewer than n are free (nothing taken)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > self.n_free:
            return None
        cum = (self.mem_state == 0).cumsum(0)  # (size,) free slots seen so far
        want = torch.arange(1, n + 1, device=self.device)  # (n,) the 1st, 2nd, ... n-th free slot
        return self._take(torch.searchsorted(cum, want))

    def alloc_contiguous(self, n: int):
        """A run of n consecutive free slots if one exists (the first), else n scattered slots; None if < n free."""
        if n < 1 or n > self.n_free:
            return self.alloc(n)
        # (size + 1,) c[i] = free slots in [0, i)
        c = F.pad((self.mem_state == 0).cumsum(0), (1, 0))
        # (size - n + 1,) [i, i + n) all free?
        runs = (c[n:] - c[:-n]) == n
        # first True (0 if none: checked next)
        start = int(runs.int().argmax())
        if not bool(runs[start]):
            return self.alloc(n)
        return self._take(torch.arange(start, start + n, device=self.device))

    def free(self, idx):
        """Drop one reference to each slot in idx (repeats allowed); slots reaching 0 are free
        again.

        Freeing a free slot (double free, never allocated) or an out-of-range index raises
        ValueError and changes nothing: every check happens in one host sync before the decrement.
        Cost O(n log n), not O(size)."""
        idx = self._index(idx)
        if idx.numel() == 0:
            return
        # (k,) sorted slots, times each is freed
        uniq, count = torch.unique(idx, return_counts=True)
        # clamp: a bad index must not crash a kernel
        left = self.mem_state[uniq.clamp(0, self.size - 1)] - count
        lo, hi, low_ref, n_zero = torch.stack([uniq[0], uniq[-1], left.min().long(),
                                               (left == 0).sum()]).tolist()
        if lo < 0 or hi >= self.size:
            raise ValueError(f"free: slot index out of range [0, {self.size}): min {lo}, max {hi}")
        if low_ref < 0:
            bad = uniq[left < 0][:8].tolist()
            raise ValueError(f"free: slots {bad} are not allocated (double free or never allocated); "
                             "nothing freed")
        self.mem_state[uniq] = left.to(torch.int32)
        self.n_free += n_zero

    def inc_ref(self, idx):
        """Share slots that are in use (prefix caching): each needs one more free() before it is reusable."""
        idx = self._index(idx)
        if idx.numel() == 0:
            return
        low_ref = self.mem_state[idx.clamp(0, self.size - 1)].min().long()
        # one host sync for every check
        lo, hi, low_ref = torch.stack([idx.min(), idx.max(), low_ref]).tolist()
        if lo < 0 or hi >= self.size or low_ref <= 0:
            raise ValueError("inc_ref: every slot must be allocated already (refcount >= 1) and in range")
        self.mem_state.index_add_(0, idx, torch.ones_like(idx, dtype=torch.int32))

    def check(self):
        """Invariants: refcounts >= 0 and free + used == size, with the host's free count matching the device's."""
        m = self.mem_state
        n_free, n_used, low = (m == 0).sum().item(), (m > 0).sum().item(), m.min().item()
        assert low >= 0, f"negative refcount {low} in mem_state"
        assert n_free + n_used == self.size, f"free {n_free} + used {n_used} != size {self.size}"
        assert n_free == self.n_free, f"host thinks {self.n_free} slots are free, mem_state says {n_free}"


# ======== THE IDEA, 2: 01's seam over the token pool: req_to_token, TokenKVCache ==================

class ReqToTokenPool:
    """req_to_token (max_requests, max_seq_len) int32: row r lists the KV slots of request r's tokens, in order."""

    def __init__(self, max_requests: int, max_seq_len: int, device="cpu"):
        self.req_to_token = torch.zeros(max_requests, max_seq_len, dtype=torch.int32, device=device)
        self.free_rows = list(range(max_requests))  # one entry per request, not per token

    def alloc(self):
        return self.free_rows.pop(0) if self.free_rows else None

    def free(self, row: int):
        if row in self.free_rows or not 0 <= row < self.req_to_token.shape[0]:
            raise ValueError(f"request row {row} is not allocated")
        self.free_rows.append(row)


class PoolExhausted(L02.OutOfBlocks):
    """prepare() found too few free slots or request rows; nothing was allocated, the caller may
    preempt and retry (02's Scheduler does: to it a slot is a block of one token)."""


class TokenKVCache(L01.KVCache):
    """The token-pool backend behind 01's seam: K/V in slots anywhere in one pool; req_to_token is
    01's table of one-slot pages, which 01's attend reads (04's kernels on a GPU)."""
    # add_prefix, share_prefix: 05's radix tree hands slots from request to request
    shares_prefixes = True

    def __init__(self, n_layers, size, n_kv_heads, head_dim, max_requests, max_seq_len,
                 dtype=torch.float32, device="cpu"):
        self.k_pool = torch.zeros(n_layers, size, n_kv_heads, head_dim, dtype=dtype, device=device)
        # (n_layers, size, n_kv_heads, head_dim)
        self.v_pool = torch.zeros_like(self.k_pool)
        self.allocator = TokenAllocator(size, device)
        self.req_pool = ReqToTokenPool(max_requests, max_seq_len, device)
        self.req_to_token = self.req_pool.req_to_token           # (max_requests, max_seq_len) int32
        self.max_seq_len, self.device = max_seq_len, torch.device(device)
        # seq_id -> row of req_to_token, tokens stored
        self.rows, self.lens = {}, {}
        # 02's block table with blocks of one slot
        self.table, self.page = self.req_to_token, 1

    def layer_pools(self, layer):
        return self.k_pool[layer], self.v_pool[layer]            # (size, n_kv_heads, head_dim) each

    def used(self) -> int:
        return self.allocator.size - self.allocator.available()

    def capacity(self) -> int:
        return self.allocator.size

    def room(self) -> int:
        return self.allocator.available()

    def pad_row(self) -> int:
        """A req_to_token row for CUDA graphs' padding: every entry is one scratch slot taken from the pool."""
        row, slot = self.req_pool.alloc(), int(self.allocator.alloc(1)[0])
        self.req_to_token[row] = slot
        return row

    @classmethod
    def for_model(cls, model, size: int, max_requests: int = 64, max_seq_len: int | None = None):
        a, w = model.args, model.tok_embeddings.weight
        return cls(a.n_layers, size, a.n_kv_heads, a.head_dim, max_requests,
                   max_seq_len or min(a.max_seq_len, size), w.dtype, w.device)

    @classmethod
    def for_pool(cls, model, tokens, max_batch, max_len, pad=0, block_size=16):
        # pad_row takes a slot of the pool
        return cls.for_model(model, tokens, max_batch + 1, max_len), max_batch

    def _new_request(self, seq_id):
        row = self.req_pool.alloc()
        if row is None:
            taken = len(self.rows)
            raise PoolExhausted(f"no free request row for {seq_id}: all {taken} rows are in use")
        self.rows[seq_id], self.lens[seq_id] = row, 0

    def prepare(self, seq_ids, n_new):
        """Allocate slots for n_new[i] tokens of seq_ids[i] (all or nothing); returns their positions (T,)."""
        n_new, starts = [int(n) for n in n_new], [self.lens.get(s, 0) for s in seq_ids]
        for s, p, n in zip(seq_ids, starts, n_new):
            if n < 0 or p + n > self.max_seq_len:
                raise ValueError(f"request {s}: {p} + {n} tokens exceed max_seq_len={self.max_seq_len}")
        if len(set(seq_ids)) < len(seq_ids):
            raise ValueError(f"prepare: a request is listed twice in {seq_ids}")
        fresh = [s for s in seq_ids if s not in self.rows]
        if len(fresh) > len(self.req_pool.free_rows):
            free_rows = len(self.req_pool.free_rows)
            raise PoolExhausted(f"{len(fresh)} new requests, only {free_rows} free request rows")
        # (T,) one cumsum for the whole batch
        slots = self.allocator.alloc(sum(n_new))
        if slots is None:
            free = self.allocator.available()
            raise PoolExhausted(f"need {sum(n_new)} KV slots, only {free} free")
        for s in fresh:
            self._new_request(s)
        rows = [self.rows[s] for s in seq_ids]
        # (B,) each, in one copy that waits for no queued GPU work
        host = torch.tensor([n_new, starts, rows], dtype=torch.long)
        n_t, start_t, row_t = L01.to_device(host, self.device)
        first = n_t.cumsum(0) - n_t  # (B,) offset of each request's first new token
        # (T,); the size spares a sync
        per_token = lambda x: torch.repeat_interleave(x, n_t, output_size=len(slots))
        pos = torch.arange(len(slots), device=self.device) - per_token(first - start_t)  # (T,)
        self.req_to_token[per_token(row_t), pos] = slots.int()  # token pos of row r -> its slot
        for s, n in zip(seq_ids, n_new):
            self.lens[s] += n
        self.batch, self.tok_slots = (rows, starts, n_new), slots
        # (B,) what decode_attn reads
        self.batch_rows, self.batch_lens = row_t.int(), (start_t + n_t).int()
        return pos

    def slots(self, seq_id) -> torch.Tensor:
        """The request's slot indices in token order, LongTensor (len,) (e.g. to insert into a radix tree)."""
        return self.req_to_token[self.rows[seq_id], :self.lens[seq_id]].long()

    def add_prefix(self, seq_id, slots):
        """Start request seq_id whose first len(slots) tokens are already in these slots (shared: inc_ref)."""
        if seq_id in self.rows:
            raise ValueError(f"add_prefix: request {seq_id} already exists")
        slots = self.allocator._index(slots)
        if slots.numel() > self.max_seq_len:
            raise ValueError(f"add_prefix: {slots.numel()} tokens exceed max_seq_len={self.max_seq_len}")
        self.allocator.inc_ref(slots)
        try:
            self._new_request(seq_id)
        except PoolExhausted:
            self.allocator.free(slots)
            raise
        self.req_to_token[self.rows[seq_id], :slots.numel()] = slots.int()
        self.lens[seq_id] = slots.numel()

    def share_prefix(self, seq_id, slots, start=0):
        """Point request seq_id's tokens start.. start + len(slots) at these slots (a prefix cache's
        copies of the same tokens): one reference moves from each of its own slots to the shared
        one, so a duplicate it computed returns to the pool now rather than when it finishes."""
        row, slots = self.rows[seq_id], self.allocator._index(slots)
        own = self.req_to_token[row, start:start + slots.numel()].long()
        self.allocator.inc_ref(slots)
        self.req_to_token[row, start:start + slots.numel()] = slots.int()
        self.allocator.free(own)

    def free(self, seq_id):
        """Release request seq_id: one reference to each of its slots, and its req_to_token row."""
        self.allocator.free(self.slots(seq_id))
        self.req_pool.free(self.rows.pop(seq_id))
        del self.lens[seq_id]


# ======== DEMO: measurements -- live tokens on a trace, the token pool against blocks and rows ====

def trace_live_fraction(prompt, output, max_batch=32, max_seq_len=2048, block_sizes=(16, 256)):
    """Serve a trace through the allocator (continuous batching, FIFO, a token a step per running
    request), comparing each step the live tokens with what each scheme holds: the token pool
    (measured), blocks of B tokens (sum of ceil(len / B) * B) and 01's max-length rows."""
    pool, reqs = TokenAllocator(max_batch * max_seq_len), ReqToTokenPool(max_batch, max_seq_len)
    # request -> [row, tokens cached, tokens still to sample]
    waiting, running = list(range(len(prompt))), {}
    held = dict.fromkeys(["live", "token_pool", "max_len_01", *block_sizes], 0)
    while waiting or running:
        while waiting and reqs.free_rows:
            # admit: prefill caches the prompt, samples token 1
            i = waiting.pop(0)
            row = reqs.alloc()
            reqs.req_to_token[row, :prompt[i]] = pool.alloc(int(prompt[i])).int()
            running[i] = [row, int(prompt[i]), int(output[i]) - 1]
        ids = [i for i in running if running[i][2] > 0]
        if ids:
            # decode: one alloc call for the whole batch
            rows, lens = torch.tensor([running[i][:2] for i in ids]).T
            reqs.req_to_token[rows, lens] = pool.alloc(len(ids)).int()
        for i in ids:
            running[i][1:] = running[i][1] + 1, running[i][2] - 1
        L = np.array([r[1] for r in running.values()])
        held["live"] += L.sum()
        held["token_pool"] += pool.size - pool.available()
        held["max_len_01"] += len(L) * max_seq_len
        for b in block_sizes:
            held[b] += (-(-L // b) * b).sum()
        for i in [i for i in running if running[i][2] == 0]:
            # finished: every slot and the row go back
            row, n, _ = running.pop(i)
            pool.free(reqs.req_to_token[row, :n])
            reqs.free(row)
    pool.check()
    assert pool.available() == pool.size, "slots leaked"
    return {("blocks_%d" % k if isinstance(k, int) else k): float(held["live"] / v)
            for k, v in held.items() if k != "live"}


def measure(n_requests=200, seed=0):
    """Every figure of the report, measured in this run (--bench adds the peers': tests/bench_03.py)."""
    prompt, output = L01.synthetic_trace("sharegpt", n_requests, seed)
    live = trace_live_fraction(prompt, output)
    return {"trace": f"synthetic sharegpt trace, {n_requests} requests, 32 running",
            "live_fraction": live["token_pool"], "live_fraction_by_scheme": live}


def report(r):
    print("03 token allocator -- LightLLM's TokenAttention pool (page size 1)\n")
    print(f"live-token share of the KV memory held, over every decode step of a {r['trace']}:")
    for k, v in r["live_fraction_by_scheme"].items():
        print(f"  {k:12s} {v:7.1%}")
    print("\nPage size 1 holds exactly the live tokens (--bench: alloc + free against a Python set and "
          "02's blocks).")


def main(argv=None):
    what = "LightLLM's token-granular KV allocator: live-token share and throughput"
    ap = argparse.ArgumentParser(description=what)
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    ap.add_argument("--bench", action="store_true",
                    help="alloc + free vs a Python set and 02's blocks (CPU; on a GPU also CUDA and the "
                    "share of a decode step): tests/bench_03.py")
    ap.add_argument("--requests", type=int, default=200, help="requests in the synthetic trace")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    L01.cpu_threads()  # one thread on 2 cores (why: in its docstring)
    if a.requests < 1:
        ap.error("--requests must be >= 1")
    # --bench: the peers beside the pool (not the lesson), after its figures
    bench = a.bench and runpy.run_path(
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests", "bench_03.py"))
    r = (bench["measure"] if bench else measure)(a.requests, a.seed)
    print(json.dumps(r)) if a.json else (bench["report"] if bench else report)(r)


if __name__ == "__main__":
    main()
