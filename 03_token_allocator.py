"""
03_token_allocator.py -- LightLLM's TokenAttention pool: KV memory allocated one token at a time with torch.cumsum.

Paged attention (02) cuts the KV cache into blocks of B tokens; a request wastes up to B - 1 slots in its last block.
LightLLM's TokenAttention takes the idea to its end: page size 1. One pool of `size` KV slots is allocated up front
and every token of every request gets its own slot, wherever one is free. A request's slots need not be adjacent;
a table `req_to_token` remembers where each of its tokens lives, and attention gathers through it.

    k_pool, v_pool  (n_layers, size, n_kv_heads, head_dim)   one slot = one token's K (or V) in every layer
    mem_state       (size,) int32 refcount per slot           0 = free, 1 = used, 2+ = shared by a prefix cache

    slot:       0   1   2   3   4   5   6   7   8   9
    mem_state [ 1 | 1 | 0 | 1 | 2 | 0 | 0 | 1 | 0 | 1 ]
    owner       A   A   .   B   AB  .   .   B   .   A        (slot 4: a prefix shared by A and B)

    req_to_token  (max_requests, max_seq_len) int32           row r, column i = the slot of token i of request r
      row of A: [0, 1, 4, 9, ...]     row of B: [4, 3, 7, ...]   (only the first seq_len columns mean anything)

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
token in attention -- which is why 04 writes a Triton kernel that reads req_to_token directly.

References: LightLLM (ModelTC/lightllm, TokenAttention, `MemoryManager.alloc / alloc_contiguous / free` and
`mem_state`), SGLang (`ReqToTokenPool`, `token_to_kv_pool` / `TokenToKVPoolAllocator`), Kwon et al. 2023 (vLLM,
PagedAttention) for the block view compared against.
"""
from __future__ import annotations

import argparse
import importlib
import json
import random
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F


class TokenAllocator:
    """Refcounted KV slots: mem_state (size,) int32 on the pool's device; every op is a handful of tensor ops."""

    def __init__(self, size: int, device="cpu"):
        if size < 1:
            raise ValueError(f"pool size must be >= 1, got {size}")
        self.size, self.device = size, torch.device(device)
        self.mem_state = torch.zeros(size, dtype=torch.int32, device=device)  # (size,) refcounts, 0 = free
        self.n_free = size  # host copy of (mem_state == 0).sum(): alloc never has to ask the device

    def available(self) -> int:
        return self.n_free

    def _index(self, idx) -> torch.Tensor:
        return torch.as_tensor(idx, device=self.device).long().reshape(-1)

    def _take(self, idx):
        self.mem_state[idx] = 1
        self.n_free -= idx.numel()
        return idx

    def alloc(self, n: int):
        """n free slots (LongTensor (n,)), lowest indices first; None if fewer than n are free (nothing taken)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > self.n_free:
            return None
        cum = (self.mem_state == 0).cumsum(0)                                # (size,) free slots seen so far
        want = torch.arange(1, n + 1, device=self.device)                    # (n,) the 1st, 2nd, ... n-th free slot
        return self._take(torch.searchsorted(cum, want))

    def alloc_contiguous(self, n: int):
        """A run of n consecutive free slots if one exists (the first), else n scattered slots; None if < n free."""
        if n < 1 or n > self.n_free:
            return self.alloc(n)
        c = F.pad((self.mem_state == 0).cumsum(0), (1, 0))                   # (size + 1,) c[i] = free slots in [0, i)
        runs = (c[n:] - c[:-n]) == n                                         # (size - n + 1,) [i, i + n) all free?
        start = int(runs.int().argmax())                                     # first True (0 if none: checked next)
        if not bool(runs[start]):
            return self.alloc(n)
        return self._take(torch.arange(start, start + n, device=self.device))

    def free(self, idx):
        """Drop one reference to each slot in idx (repeats allowed); slots reaching 0 are free again.

        Freeing a free slot (double free, never allocated) or an out-of-range index raises ValueError and changes
        nothing: the decrement is computed out of place and only committed after one host check."""
        idx = self._index(idx)
        if idx.numel() == 0:
            return
        ones = torch.ones_like(idx, dtype=torch.int32)
        after = self.mem_state.index_add(0, idx.clamp(0, self.size - 1), -ones)  # clamp: a bad index must not crash
        lo, hi, low_ref, n_free = torch.stack([idx.min(), idx.max(), after.min().long(),
                                               (after == 0).sum()]).tolist()    # one host sync for all checks
        if lo < 0 or hi >= self.size:
            raise ValueError(f"free: slot index out of range [0, {self.size}): min {lo}, max {hi}")
        if low_ref < 0:
            bad = idx[after[idx] < 0].unique()[:8].tolist()
            raise ValueError(f"free: slots {bad} are not allocated (double free or never allocated); nothing freed")
        self.mem_state.copy_(after)
        self.n_free = n_free

    def inc_ref(self, idx):
        """Share slots that are in use (prefix caching): each needs one more free() before it is reusable."""
        idx = self._index(idx)
        if idx.numel() == 0:
            return
        if idx.min() < 0 or idx.max() >= self.size or (self.mem_state[idx] <= 0).any():
            raise ValueError("inc_ref: every slot must be allocated already (refcount >= 1) and in range")
        self.mem_state.index_add_(0, idx, torch.ones_like(idx, dtype=torch.int32))

    def check(self):
        """Invariants: refcounts >= 0 and free + used == size, with the host's free count matching the device's."""
        n_free, n_used, low = (self.mem_state == 0).sum().item(), (self.mem_state > 0).sum().item(), self.mem_state.min().item()
        assert low >= 0, f"negative refcount {low} in mem_state"
        assert n_free + n_used == self.size, f"free {n_free} + used {n_used} != size {self.size}"
        assert n_free == self.n_free, f"host thinks {self.n_free} slots are free, mem_state says {n_free}"


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


def torch_decode_attn(q, k_pool, v_pool, req_to_token, req_rows, seq_lens):
    """Decode attention through req_to_token (the PyTorch path 04's Triton kernel replaces).

    q (B, n_heads, head_dim) one query per request; k_pool, v_pool (size, n_kv_heads, head_dim) of one layer;
    req_rows (B,) rows of req_to_token; seq_lens (B,) tokens each request sees, the new one included."""
    L = int(seq_lens.max())
    slots = req_to_token[req_rows.long(), :L].long()                              # (B, L) padding columns: stale
    K, V = k_pool[slots].transpose(1, 2), v_pool[slots].transpose(1, 2)           # (B, n_kv_heads, L, head_dim)
    mask = torch.arange(L, device=q.device) < seq_lens[:, None]                   # (B, L) hides the stale columns
    out = F.scaled_dot_product_attention(q[:, :, None], K, V, attn_mask=mask[:, None, None], enable_gqa=True)
    return out[:, :, 0]                                                           # (B, n_heads, head_dim)


class PoolExhausted(RuntimeError):
    """prepare() found too few free slots or request rows; nothing was allocated, the caller may preempt and retry."""


class TokenKVCache:
    """The token-pool backend (prepare / attend / free): K/V live in slots anywhere in one shared pool."""

    def __init__(self, n_layers, size, n_kv_heads, head_dim, max_requests, max_seq_len,
                 dtype=torch.float32, device="cpu"):
        self.k_pool = torch.zeros(n_layers, size, n_kv_heads, head_dim, dtype=dtype, device=device)
        self.v_pool = torch.zeros_like(self.k_pool)              # (n_layers, size, n_kv_heads, head_dim)
        self.allocator = TokenAllocator(size, device)
        self.req_pool = ReqToTokenPool(max_requests, max_seq_len, device)
        self.req_to_token = self.req_pool.req_to_token           # (max_requests, max_seq_len) int32
        self.max_seq_len, self.device = max_seq_len, torch.device(device)
        self.rows, self.lens = {}, {}                            # seq_id -> row of req_to_token, tokens stored
        self.decode_attn = torch_decode_attn                     # swap in 04's kernel: same signature

    @classmethod
    def for_model(cls, model, size: int, max_requests: int = 64, max_seq_len: int | None = None):
        a, w = model.args, model.tok_embeddings.weight
        return cls(a.n_layers, size, a.n_kv_heads, a.head_dim, max_requests, max_seq_len or min(a.max_seq_len, size),
                   w.dtype, w.device)

    def _new_request(self, seq_id):
        row = self.req_pool.alloc()
        if row is None:
            raise PoolExhausted(f"no free request row for {seq_id}: all {len(self.rows)} rows are in use")
        self.rows[seq_id], self.lens[seq_id] = row, 0

    def prepare(self, seq_ids, n_new):
        """Allocate slots for n_new[i] tokens of seq_ids[i] (all or nothing); returns their positions (T,)."""
        n_new = [int(n) for n in n_new]
        starts = [self.lens.get(s, 0) for s in seq_ids]
        for s, p, n in zip(seq_ids, starts, n_new):
            if n < 0 or p + n > self.max_seq_len:
                raise ValueError(f"request {s}: {p} + {n} tokens exceed max_seq_len={self.max_seq_len}")
        fresh = [s for s in seq_ids if s not in self.rows]
        if len(fresh) > len(self.req_pool.free_rows):
            raise PoolExhausted(f"{len(fresh)} new requests but only {len(self.req_pool.free_rows)} free request rows")
        slots = self.allocator.alloc(sum(n_new))                 # (T,) one cumsum for the whole batch
        if slots is None:
            raise PoolExhausted(f"need {sum(n_new)} KV slots, only {self.allocator.available()} free")
        for s in fresh:
            self._new_request(s)
        rows = [self.rows[s] for s in seq_ids]
        n_t = torch.tensor(n_new, device=self.device)
        start_t = torch.tensor(starts, device=self.device)
        first = F.pad(n_t.cumsum(0), (1, 0))[:-1]                # (B,) offset of each request's first new token
        pos = torch.arange(len(slots), device=self.device) - torch.repeat_interleave(first - start_t, n_t)  # (T,)
        tok_rows = torch.repeat_interleave(torch.tensor(rows, device=self.device), n_t)                      # (T,)
        self.req_to_token[tok_rows, pos] = slots.int()          # token i of request r lives in slot slots[...]
        for s, n in zip(seq_ids, n_new):
            self.lens[s] += n
        self.batch = (rows, starts, n_new)
        self.tok_slots = slots
        self.batch_rows = torch.tensor(rows, device=self.device, dtype=torch.int32)                       # (B,)
        self.batch_lens = torch.tensor([p + n for p, n in zip(starts, n_new)], device=self.device, dtype=torch.int32)
        return pos

    def attend(self, layer, q, k, v):
        kp, vp = self.k_pool[layer], self.v_pool[layer]         # (size, n_kv_heads, head_dim)
        kp[self.tok_slots], vp[self.tok_slots] = k, v           # the whole cache write: one scatter per step
        rows, starts, n_new = self.batch
        if all(n == 1 for n in n_new):                          # decode: one query per request, batched
            return self.decode_attn(q, kp, vp, self.req_to_token, self.batch_rows, self.batch_lens)
        from llama3_generate import attend_dense                # prefill: gather each request's slots
        outs, t = [], 0
        for r, p, n in zip(rows, starts, n_new):
            idx = self.req_to_token[r, :p + n].long()
            outs.append(attend_dense(q[t:t + n], kp[idx], vp[idx]))
            t += n
        return torch.cat(outs)

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

    def free(self, seq_id):
        """Release request seq_id: one reference to each of its slots, and its req_to_token row."""
        self.allocator.free(self.slots(seq_id))
        self.req_pool.free(self.rows.pop(seq_id))
        del self.lens[seq_id]
