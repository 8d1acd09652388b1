"""
01_kv_cache.py -- naive KV caching: what it saves, and what reserving max length wastes.

    python 01_kv_cache.py [--json] [--plot PATH]

Token n+1 attends over the keys and values (K, V) of tokens 0..n. Generation has two phases:
- prefill: the prompt's T tokens pass through at once; each weight matrix meets a (T, dim) activation -- a GEMM
  doing ~T multiply-adds per weight read: compute-bound.
- decode: one new token per request per step; a (1, dim) activation meets every weight -- a GEMV doing one
  multiply-add per weight read: memory-bound. Batching B requests makes it a (B, dim) GEMM again, so the batch
  size -- capped by the KV memory each request holds -- sets decode throughput.
Without a cache (nanoGPT's generate) each step re-runs the whole prefix: O(n) tokens of work for token n. With
one (gpt-fast's static KVCache: `k_cache[:, pos] = k`) a step computes only the new token: O(1). Three ways, same
tokens: (a) `greedy(kv=None)` recomputes; (b) `greedy` on `StaticKVCache`, gpt-fast's cache for one request;
(c) `ContiguousKVCache`, the same idea for a batch (padded rows, the picture to beat), driven by
`llama3_generate.generate`. It is the first `KVCache`: the seam every later backend implements (02 paged blocks,
03 token slots). The model calls kv.prepare before a forward and kv.attend in every layer, and all backends keep
one picture -- token i of table row r in slot table[r, i // page] * page + i % page -- so one Triton kernel (04)
and one CUDA graph (the engine's) read them all; `attend_table` is that read in PyTorch.

Imports: a lesson imports only earlier lessons at module level (01 imports none of them). A demo
that runs the model (01, 02, 06) loads llama3_generate inside the function, and loading that imports
the lessons its engine uses (01, 02, 03, 05, 06; 04 where Triton is).

Every request reserves its whole future at admission:

    max_len (ContiguousKVCache): a row of max_seq_len slots per request
        row 0 |A A A A a a a . . . x x x x x x|
        row 1 |B B b . x x x x x x x x x x x x|
        rest  |- - - - - - -|                     (what is left of the pool: less than a row)
    pow2: an extent of the next power of two >= the final length, first-fit into one arena (oracle: exact length)
              |A A A a . x x x|- - -|B B b .|C C C C c c . x|- -|     waiting: D needs 4 slots

        A B C  prompt tokens, a b c generated ones: live token states
        .      reserved for tokens still to be generated (reserved-for-future)
        x      reserved past the request's final length: internal fragmentation
        -      free, but the next request fits in no hole: external fragmentation

`account` simulates such a pool on a synthetic trace: all requests queue at t=0 (a backlog keeps the
pool under pressure); each decode step the queue's head takes the first hole that fits its
reservation (FCFS: nobody overtakes it), every running request stores one more token, and a request
that got its last token frees its extent. At each step while someone waits, every slot counts in
exactly one category (live, future, internal, external: free slots while someone waits), so they add
up to the pool size. Schemes: `max_len` reserves max_seq_len; `pow2` the next power of two >= prompt
+ output (the paper's "Orca (Pow2)": at most 2x over); `oracle` exactly prompt + output. The mean
number of running requests is the batch each scheme allows.

References: Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention" (vLLM; its Fig. 2 found 20.4% / 26.8% / 38.2% of KV memory live for max-length /
Pow2 / Oracle on its own trace -- the paper's figures, not measured here); gpt-fast (generate.py,
KVCache); nanoGPT (model.py, generate).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import deque

import numpy as np
import torch
import torch.nn.functional as F

# ======== THE IDEA, 1: the seam -- the model hands each layer's q, k, v to a KV cache =============

def attend_dense(q, k, v):
    """Reference attention for one request: q (n, H, D) are the LAST n of the L positions in k, v
    (L, Hkv, D): query i, at L - n + i, sees keys 0 .. L - n + i (causal). GQA: Hkv divides H."""
    n, L = q.shape[0], k.shape[0]
    mask = None
    if n > 1:
        # (n, L)
        mask = torch.arange(L, device=q.device) <= torch.arange(L - n, L, device=q.device)[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, enable_gqa=True)  # (H, n, D)
    return out.transpose(0, 1)


def attend_decode(q, k, v, seq_lens):
    """Batched reference decode: q (B, H, D) is each request's newest token, the last of its
    seq_lens[b] keys in k, v (B, L, Hkv, D) (gathered per request, masked past seq_lens[b])."""
    mask = torch.arange(k.shape[1], device=q.device) < seq_lens[:, None]  # (B, L)
    # (B, H, 1, D)
    out = F.scaled_dot_product_attention(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None, None], enable_gqa=True)
    return out[:, :, 0]


def store_kv(k_pool, v_pool, slots, k, v):
    """A step's cache write: k, v (T, Hkv, D) into slots (T,) of one layer's pools (slots, Hkv, D)."""
    k_pool[slots], v_pool[slots] = k, v


def table_slots(table, rows, n: int, page: int = 1) -> torch.Tensor:
    """The pool slots of tokens 0..n-1 of table rows `rows` (B ints), LongTensor (B, n): token i of
    row r sits in slot table[r, i // page] * page + i % page, every backend's picture (KVCache)."""
    i = torch.arange(n, device=table.device)
    rows = torch.as_tensor(rows, device=table.device).long()
    return table[rows][:, i // page].long() * page + i % page


def attend_table(q, k_pool, v_pool, table, rows, seq_lens, page: int = 1):
    """Decode attention through a table (04's kernel in PyTorch): q (B, H, D), a query per request;
    k_pool, v_pool (slots, Hkv, D) of one layer; rows, seq_lens (B,): table rows and lengths."""
    # (B, L): columns past a length are stale
    slots = table_slots(table, rows, int(seq_lens.max()), page)
    return attend_decode(q, k_pool[slots], v_pool[slots], seq_lens)  # masks them; (B, H, D)


def to_device(x, device):
    """A host tensor (a backend's lists, say) on `device` without waiting for the GPU's queued
    work: copied from pinned memory, which PyTorch keeps until the copy has run (a pageable buffer
    is read only when the copy runs, after the work queued before it: freed and reused by then)."""
    cuda = torch.device(device).type == "cuda"
    return x.pin_memory().to(device, non_blocking=True) if cuda else x.to(device)


class KVCache:
    """The seam between the model and its KV memory, which every backend (01, 02, 03) implements:

        positions = kv.prepare(seq_ids, n_new)  # before a forward: room for n_new[i] tokens of seq_ids[i]
        out = kv.attend(layer, q, k, v)         # in every layer: store k, v; attend over all that is visible
        kv.free(seq_id)                         # a request is done (or preempted)

    All keep one picture, so one kernel (04) and one CUDA graph (the engine's) read them all: table
    row r's token i lives in slot table[r, i // page] * page + i % page of layer_pools(layer) -- 01:
    a row is one page of max_seq_len; 02: a block table, page = block size; 03: req_to_token,
    page 1. prepare() leaves the step here: tok_slots (T,) where its tokens go, batch (rows, starts,
    n_new) on the host, batch_rows and batch_lens (B,) on the device. A backend implements prepare,
    free, layer_pools, pad_row, used and capacity."""
    page: int
    table: torch.Tensor               # (rows, pages per row) int32
    # 04's kernels (use_kernels); None: the PyTorch path through the table
    decode_attn = extend_attn = None
    store_kv = staticmethod(store_kv)  # 04's: K and V in one kernel
    # 05's radix tree may share its slots between requests (03's pool, 02's blocks)
    shares_prefixes = False

    # -------- the seam: what the model calls ------------------------------------------------------

    def prepare(self, seq_ids, n_new) -> torch.Tensor:
        """Room for n_new[i] more tokens of seq_ids[i], all or nothing (02's OutOfBlocks when full,
        nothing changed); returns each new token's position in its request, (T,)."""
        raise NotImplementedError

    def attend(self, layer, q, k, v):
        kp, vp = self.layer_pools(layer)
        self.store_kv(kp, vp, self.tok_slots, k, v)  # the whole cache write: one scatter per pool per step
        rows, starts, n_new = self.batch
        # decode: one query per request, batched; a mixed step's decode rows too (they lead, 05), so
        # they neither pad prefill's tiles of query rows nor read their keys unsplit
        d = next((i for i, n in enumerate(n_new) if n != 1), len(n_new))
        outs, t = [], d
        if d:
            decode = self.decode_attn or attend_table
            outs.append(decode(q[:d], kp, vp, self.table, self.batch_rows[:d], self.batch_lens[:d],
                               page=self.page))
        if d < len(n_new) and self.extend_attn is not None:  # prefill in one launch
            # a copy: rows d.. as a view start off Triton's 16-byte alignment (another compile)
            table_rows = self.batch_rows[d:].clone() if d else self.batch_rows
            outs.append(self.extend_attn(q[d:], kp, vp, self.table, table_rows, starts[d:], n_new[d:],
                                         page=self.page))
        elif d < len(n_new):
            for r, p, n in zip(rows[d:], starts[d:], n_new[d:]):
                # prefill: gather each request's slots, one request at a time
                idx = table_slots(self.table, [r], p + n, self.page)[0]  # (p + n,)
                outs.append(attend_dense(q[t:t + n], kp[idx], vp[idx]))
                t += n
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def free(self, seq_id):
        """Drop a request's KV."""
        raise NotImplementedError

    # -------- what every backend tells the engine (its pool, its table's scratch row, its size) ---

    def layer_pools(self, layer):
        """K and V of one layer as flat pools of slots, (slots, n_kv_heads, head_dim) each."""
        raise NotImplementedError

    def pad_row(self) -> int:
        """A table row of scratch slots for CUDA graphs' padding rows (they write there and read one token)."""
        raise NotImplementedError

    def used(self) -> int:
        """KV slots taken now (reserved rows, whole blocks or single slots)."""
        raise NotImplementedError

    def capacity(self) -> int:
        """KV slots in all."""
        raise NotImplementedError

    def room(self) -> int | None:
        """Tokens new requests may take now without preempting anyone; None: only the number of rows limits."""
        return None

    # -------- the engine's hooks: building a cache for a pool, Triton kernels, CUDA graphs --------

    @classmethod
    def for_pool(cls, model, tokens: int, max_batch: int, max_len: int, pad: int = 0,
                 block_size: int = 16):
        """The engine's cache: `tokens` KV slots for at most max_batch sequences of max_len tokens,
        plus `pad` scratch rows for CUDA graphs' padding -> (cache, sequences it runs at once)."""
        raise NotImplementedError

    def use_kernels(self, decode, extend=None, store=None):
        """Attend through 04's Triton kernels (or any function of their signature): decode, prefill (extend), and
        the cache write (store)."""
        self.decode_attn, self.extend_attn, self.store_kv = decode, extend, store or store_kv

    def bind_decode(self, slots, rows, lens):
        """A CUDA graph's decode step: its static buffers (slots to write, table rows, lengths)
        become the step's metadata, so that a replay reads what the host wrote into them."""
        n = len(rows)
        self.batch = ([0] * n, [0] * n, [1] * n)
        self.tok_slots, self.batch_rows, self.batch_lens = slots, rows, lens


# ======== THE IDEA, 2: caching K and V -- (a) none, (b) one request, (c) a batch through the seam ====

class StaticKVCache:
    """gpt-fast's KVCache for ONE request: max_seq_len slots per layer, filled in position order."""

    def __init__(self, model, max_seq_len: int):
        a, w = model.args, model.tok_embeddings.weight
        self.k = torch.zeros(a.n_layers, max_seq_len, a.n_kv_heads, a.head_dim, dtype=w.dtype,
                             device=w.device)
        self.v = torch.zeros_like(self.k)  # both (n_layers, max_seq_len, n_kv_heads, head_dim)
        self.len = 0

    def prepare(self, seq_ids, n_new):
        if self.len + n_new[0] > self.k.shape[1]:
            # refuse before any write: nothing out of bounds, nothing changed
            raise ValueError(f"{self.len + n_new[0]} tokens exceed max_seq_len={self.k.shape[1]}")
        self.pos = torch.arange(self.len, self.len + n_new[0], device=self.k.device)
        self.len += n_new[0]
        return self.pos

    def attend(self, layer, q, k, v):
        self.k[layer, self.pos] = k  # the whole cache: k_cache[:, pos] = k
        self.v[layer, self.pos] = v
        return attend_dense(q, self.k[layer, :self.len], self.v[layer, :self.len])

    def free(self, seq_id):
        self.len = 0


class ContiguousKVCache(KVCache):
    """gpt-fast's static cache for a batch: each request owns one row of max_seq_len slots, reserved
    up front. k_cache, v_cache: (n_layers, max_batch, max_seq_len, n_kv_heads, head_dim). A row is
    one page of max_seq_len slots in a table of one column: slot = row * max_seq_len + position."""

    def __init__(self, n_layers, max_batch, max_seq_len, n_kv_heads, head_dim, dtype=torch.float32,
                 device="cpu"):
        shape = (n_layers, max_batch, max_seq_len, n_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.max_seq_len, self.device = max_seq_len, device
        self.free_rows = list(range(max_batch))
        self.rows: dict = {}  # seq_id -> row
        self.lens = [0] * max_batch  # tokens stored in each row
        self.page = max_seq_len   # a row is one page: the table maps row r to page r
        # (max_batch, 1)
        self.table = torch.arange(max_batch, dtype=torch.int32, device=device)[:, None]

    def layer_pools(self, layer):
        # slot = row * max_seq_len + i
        return self.k_cache[layer].flatten(0, 1), self.v_cache[layer].flatten(0, 1)

    def pad_row(self) -> int:
        return self.free_rows.pop()

    def used(self) -> int:
        return len(self.rows) * self.max_seq_len

    def capacity(self) -> int:
        return self.k_cache.shape[1] * self.max_seq_len

    @classmethod
    def for_model(cls, model, max_batch: int, max_seq_len: int | None = None):
        a, w = model.args, model.tok_embeddings.weight
        return cls(a.n_layers, max_batch, max_seq_len or a.max_seq_len, a.n_kv_heads, a.head_dim,
                   w.dtype, w.device)

    @classmethod
    def for_pool(cls, model, tokens, max_batch, max_len, pad=0, block_size=16):
        # every running sequence reserves a row of max_len slots
        rows = max(1, min(max_batch, tokens // max_len))
        return cls.for_model(model, rows + pad, max_len), rows

    def prepare(self, seq_ids, n_new):
        """Make room for n_new[i] tokens of seq_ids[i]; returns their positions (T,). Everything is
        checked before anything changes, so a refused batch leaves the cache as it was: ValueError
        for a request id twice in the batch, no free row for a new request, or over max_seq_len."""
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"duplicate request ids in one batch: {list(seq_ids)}")
        new = [s for s in seq_ids if s not in self.rows]
        if len(new) > len(self.free_rows):
            raise ValueError(f"no free cache row for request {new[len(self.free_rows)]}: "
                             f"all {len(self.rows)} rows are reserved")
        for s, n in zip(seq_ids, n_new):
            have = self.lens[self.rows[s]] if s in self.rows else 0
            if have + n > self.max_seq_len:
                raise ValueError(f"request {s}: {have + n} tokens exceed max_seq_len={self.max_seq_len}")
        for s in new:
            self.rows[s] = self.free_rows.pop(0)
        rows = [self.rows[s] for s in seq_ids]
        starts = [self.lens[r] for r in rows]
        positions = torch.cat([torch.arange(p, p + n) for p, n in zip(starts, n_new)])
        self.batch = (rows, starts, list(n_new))
        tok_rows = torch.repeat_interleave(torch.tensor(rows), torch.tensor(n_new))
        # (T,) flat slot of each token
        self.tok_slots = (tok_rows * self.max_seq_len + positions).to(self.device)
        self.batch_rows, self.batch_lens = torch.tensor(  # (B,) each, in one copy
            [rows, [p + n for p, n in zip(starts, n_new)]], dtype=torch.int32).to(self.device)
        for r, n in zip(rows, n_new):
            self.lens[r] += n
        return positions.to(self.device)

    def free(self, seq_id):
        row = self.rows.pop(seq_id)
        self.lens[row] = 0
        self.free_rows.append(row)


def greedy(model, prompt, max_new_tokens, kv=None):
    """Greedy decode of one prompt -> (new tokens, logits (max_new_tokens, vocab)). kv=None: (a),
    nanoGPT, each step re-runs the sequence; a cache: (b), the prompt once, then the newest."""
    import llama3_generate as L
    ids, logits = list(prompt), []
    for step in range(max_new_tokens):
        # the tokens whose K and V this step computes
        x = ids if kv is None or step == 0 else ids[-1:]
        backend = kv if kv is not None else L.NoCache()
        positions = backend.prepare([0], [len(x)])
        logits.append(model(torch.tensor(x, device=positions.device), positions, backend, logits_at=[len(x) - 1])[0])
        ids.append(int(logits[-1].argmax()))
    if kv is not None:
        kv.free(0)
    return ids[len(prompt):], torch.stack(logits)


def generate_contiguous(model, prompt, max_new_tokens, max_seq_len=2048, kv=None):
    """(c): ContiguousKVCache written by the model through its seam, decoded by llama3_generate.generate."""
    import llama3_generate as L
    kv = kv if kv is not None else ContiguousKVCache.for_model(model, 1, max_seq_len)
    logits = []
    # (vocab,) per step
    hook = model.register_forward_hook(lambda mod, args, out: logits.append(out[-1]))
    try:
        tokens = L.generate(model, kv, [prompt], max_new_tokens)[0]
    finally:
        hook.remove()
    return tokens, torch.stack(logits)


def step_ms(model, position: int, cached: bool, repeats: int = 3) -> float:
    """Best-of-`repeats` time of the step making token `position`: uncached, all position + 1
    tokens; cached, only the newest (its stored K/V stay zero: values do not change the cost)."""
    import llama3_generate as L
    best = float("inf")
    for _ in range(repeats):
        kv, n = (StaticKVCache(model, position + 1), 1) if cached else (L.NoCache(), position + 1)
        if cached:
            kv.prepare([0], [position])  # as if the earlier tokens were stored
        t0 = time.perf_counter()
        model(torch.randint(0, 1000, (n,)), kv.prepare([0], [n]), kv, logits_at=[n - 1])
        best = min(best, 1e3 * (time.perf_counter() - t0))
    return best


# ======== THE IDEA, 3: where the reserved memory goes =============================================

# mean prompt / output tokens of the two public traces
TRACES = {"sharegpt": (161, 338), "alpaca": (19, 58)}
SCHEMES = ("max_len", "pow2", "oracle")
CATEGORIES = ("live", "future", "internal", "external")


def synthetic_trace(kind: str = "sharegpt", n: int = 1000, seed: int = 0, max_seq_len: int = 2048,
                    sigma: float = 1.0):
    """Request lengths drawn from log-normals with ShareGPT-like or Alpaca-like means (no download)
    -> (prompt_lens, output_lens): int64 arrays of n, each >= 1, prompt + output <= max_seq_len."""
    mean_in, mean_out = TRACES[kind]
    rng = np.random.default_rng(seed)
    # log-normal with that mean
    draw = lambda mean: rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, n)
    prompt = np.clip(np.rint(draw(mean_in)), 1, max_seq_len // 2).astype(np.int64)
    output = np.clip(np.rint(draw(mean_out)), 1, max_seq_len - prompt).astype(np.int64)
    return prompt, output


def reservation(scheme: str, prompt, output, max_seq_len: int):
    """Slots each request reserves at admission."""
    need = prompt + output
    # next power of 2 >= n
    pow2 = lambda: np.minimum([1 << (int(n) - 1).bit_length() for n in need], max_seq_len)
    table = {"max_len": lambda: np.full_like(need, max_seq_len), "pow2": pow2,
             "oracle": lambda: need}
    if scheme not in table:
        raise ValueError(f"unknown scheme {scheme!r}: choose from {SCHEMES}")
    return np.asarray(table[scheme](), dtype=np.int64)


def first_fit(running, size: int, pool_tokens: int):
    """Start of the first hole of >= size slots between the extents (sorted by start), or None."""
    end = 0
    for start, reserved, *_ in running:
        if start - end >= size:
            return end
        end = start + reserved
    return end if pool_tokens - end >= size else None


def simulate(prompt, output, reserve, pool_tokens: int):
    """Yields (running, n_waiting) per decode step while requests wait; running: [start, reserved,
    r, generated] by start (r holds prompt[r] + generated; it ends at prompt + output)."""
    if reserve.max() > pool_tokens:
        raise ValueError(f"a request reserves {reserve.max()} slots but the pool has only {pool_tokens}")
    waiting, running = deque(range(len(prompt))), []
    while waiting or running:
        while waiting and (start := first_fit(running, reserve[waiting[0]], pool_tokens)) is not None:
            # FCFS: admit the head of the queue while it fits; nobody overtakes it
            r = waiting.popleft()
            running.append([start, int(reserve[r]), r, 0])
            running.sort()
        if waiting:
            yield running, len(waiting)
        for x in running:
            # one decode step: each request stores one more token; finished ones free their extent
            x[3] += 1
        running = [x for x in running if x[3] < output[x[2]]]


def breakdown(running, prompt, output, pool_tokens: int) -> dict:
    """Slots of one snapshot per category (someone waits, so every free slot counts as external)."""
    live = sum(int(prompt[r]) + g for _, _, r, g in running)
    final = sum(int(prompt[r] + output[r]) for _, _, r, _ in running)
    reserved = sum(size for _, size, _, _ in running)
    return {"live": live, "future": final - live, "internal": reserved - final,
            "external": pool_tokens - reserved}


def account(prompt, output, scheme: str, pool_tokens: int, max_seq_len: int) -> dict:
    """Mean share of the pool per category over all saturated steps, the mean batch, and one snapshot to draw."""
    totals, batch, steps, snap = dict.fromkeys(CATEGORIES, 0), 0, 0, None
    reserve = reservation(scheme, prompt, output, max_seq_len)
    for running, n_waiting in simulate(prompt, output, reserve, pool_tokens):
        for c, n in breakdown(running, prompt, output, pool_tokens).items():
            totals[c] += n
        batch, steps = batch + len(running), steps + 1
        if snap is None and n_waiting <= len(prompt) // 2:
            # draw the pool once half the trace is admitted
            snap = [list(x) for x in running]
    if not steps:
        raise ValueError("the whole trace fits in the pool at once: nothing waits, choose a smaller pool")
    out = {c: totals[c] / (steps * pool_tokens) for c in CATEGORIES}
    return {**out, "batch": batch / steps, "steps": steps, "snapshot": snap}


def paint(running, prompt, output, pool_tokens: int):
    """Slot-by-slot map of one snapshot: owner request (-1: nobody) and category index (CATEGORIES) per slot."""
    owner, cat = np.full(pool_tokens, -1), np.full(pool_tokens, 3)
    for start, size, r, g in running:
        owner[start:start + size], cat[start:start + size] = r, 2
        cat[start:start + prompt[r] + output[r]] = 1
        cat[start:start + prompt[r] + g] = 0
    return owner, cat


def plot_pool(results, prompt, output, pool_tokens: int, path: str, width: int = 2048):
    """One panel per scheme: the pool as rows of `width` slots. Owners alternate blue/green; faded = future."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend needed
    from matplotlib.patches import Patch
    # live x2, future x2, internal, external, pad
    colours = np.array([(0.12, 0.47, 0.71), (0.2, 0.63, 0.17), (0.67, 0.8, 0.9), (0.7, 0.87, 0.54),
                        (0.55, 0.55, 0.55), (0.9, 0.2, 0.2), (1, 1, 1)])
    fig = Figure(figsize=(10, 2.2 * len(results)))
    axes = fig.subplots(len(results), 1, squeeze=False)[:, 0]
    for ax, (scheme, res) in zip(axes, results.items()):
        owner, cat = paint(res["snapshot"], prompt, output, pool_tokens)
        parity = np.cumsum(np.r_[0, owner[1:] != owner[:-1]]) % 2  # flips at every owner boundary
        code = np.where(cat == 0, parity, np.where(cat == 1, 2 + parity, cat + 2))
        rows = -(-pool_tokens // width)
        # (rows, width, 3)
        ax.imshow(colours[np.r_[code, np.full(rows * width - pool_tokens, 6)].reshape(rows, width)],
                  aspect="auto", interpolation="nearest")
        live = 100 * (cat == 0).mean()
        ax.set_title(f"{scheme}: {len(res['snapshot'])} requests, {live:.1f}% of the pool live",
                     fontsize=10)
        ax.set_yticks([]), ax.set_xlabel(f"token slot within a row of {width}", fontsize=8)
    labels = ("live", "", "reserved for future", "", "internal fragmentation",
              "external fragmentation")
    fig.legend(handles=[Patch(color=c, label=t) for c, t in zip(colours, labels) if t],
               loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    return path


def cpu_threads():  # every lesson's demo and the engine's command line call it
    """Half of torch's default CPU threads (one on 2 cores) unless OMP_NUM_THREADS is set, here and
    in its children. Why: a matmul split over all cores waits for its slowest thread, so one core
    busy elsewhere made 2-core decode 3-20x slower; one thread is as fast on a quiet machine."""
    if "OMP_NUM_THREADS" not in os.environ:  # the user's choice stands (torch reads it itself)
        os.environ["OMP_NUM_THREADS"] = str(n := max(1, torch.get_num_threads() // 2))
        torch.set_num_threads(n)


# ======== DEMO: the lesson, measured ==============================================================

def memory_report(n_requests=1000, pool_tokens=32768, max_seq_len=2048, seed=0, plot=None) -> dict:
    """Every scheme on both traces; `live_fraction`: ShareGPT's (the paper's), drawn to `plot`."""
    traces = {}
    for kind in TRACES:
        prompt, output = synthetic_trace(kind, n_requests, seed, max_seq_len)
        res = {s: account(prompt, output, s, pool_tokens, max_seq_len) for s in SCHEMES}
        if plot and kind == "sharegpt":
            # max_len: a row per request
            plot_pool(res, prompt, output, pool_tokens, plot, width=max_seq_len)
        # unrounded: rounded here and again when printed, 0.24453 read 24.4% (02, printing the same
        # figure, said 24.5%)
        traces[kind] = {s: {k: v for k, v in r.items() if k != "snapshot"} for s, r in res.items()}
    return {"live_fraction": {s: traces["sharegpt"][s]["live"] for s in SCHEMES}, "traces": traces,
            "pool_tokens": pool_tokens, "max_seq_len": max_seq_len, "requests": n_requests,
            "plot": plot}


def generation_report(model=None, tok=None, new_tokens=6, positions=(16, 64, 256),
                      question="What is a KV cache?"):
    """(a), (b), (c) on the model (default: SmolLM2): same tokens? logit gap to (a), s/token; step time vs position."""
    import llama3_generate as L
    model, tok = (model, tok) if model else L.load_model()
    prompt, runs, fed = tok.chat(question), {}, []
    # tokens per forward
    hook = model.register_forward_pre_hook(lambda mod, args: fed.append(len(args[0])))
    try:
        for name, run in (("a_no_cache", lambda: greedy(model, prompt, new_tokens)),
                          ("b_static_cache",
                           lambda: greedy(model, prompt, new_tokens, StaticKVCache(model, 2048))),
                          ("c_contiguous", lambda: generate_contiguous(model, prompt, new_tokens))):
            t0, fed[:] = time.perf_counter(), []
            runs[name] = (*run(), (time.perf_counter() - t0) / new_tokens, sum(fed))
    finally:
        hook.remove()
    (ref, ref_logits, *_), a = runs["a_no_cache"], model.args
    return {"prompt_tokens": len(prompt), "text": tok.decode(ref), "new_tokens": new_tokens,
            "methods": {k: {"same_tokens": t == ref,
                            "max_logit_diff": float((lg - ref_logits).abs().max()),
                            "tokens_computed": n, "s_per_token": round(s, 3)}
                        for k, (t, lg, s, n) in runs.items()},
            "step_ms": [{"position": p, "no_cache": round(step_ms(model, p, False), 1),
                         "cached": round(step_ms(model, p, True), 1)} for p in positions],
            # K and V, every layer
            "kv_bytes_per_token_fp16": 2 * a.n_layers * a.n_kv_heads * a.head_dim * 2}


def print_generation(g: dict):
    print(f"== Three ways to generate {g['new_tokens']} tokens (greedy, fp32), prompt of {g['prompt_tokens']} tokens"
          f" -> {g['text']!r}")
    for k, r in g["methods"].items():
        print(f"  {k:15s} same tokens as (a): {r['same_tokens']!s:5s}  max |logit - (a)| {r['max_logit_diff']:.1e}"
              f"  {r['tokens_computed']:4d} tokens through the model  {r['s_per_token']:.3f} s/token")
    print("  position | (a) no cache: tokens computed    ms | (b) cache: tokens computed    ms | (a)/(b)")
    for r in g["step_ms"]:
        print(f"  {r['position']:8d} | {r['position'] + 1:27d} {r['no_cache']:5.0f} | {1:24d} {r['cached']:5.0f} |"
              f" {r['no_cache'] / r['cached']:5.1f}x")
    n, r = g["step_ms"][-1]["position"] + 1, g["step_ms"][-1]
    print(f"  the {n}-token pass costs {r['no_cache'] / n:.1f} ms per token, "
          f"{r['cached'] * n / r['no_cache']:.0f}x less"
          f" than a 1-token decode step: prefill is a GEMM, decode a GEMV reading every weight for one token")


def print_memory(m: dict, kv_bytes_per_token: int | None = None):
    size = f" = {m['pool_tokens'] * kv_bytes_per_token / 2**30:.2f} GiB of fp16 K+V" if kv_bytes_per_token else ""
    print(f"== KV pool of {m['pool_tokens']} token slots{size}, max_seq_len {m['max_seq_len']}, {m['requests']} "
          f"requests queued at t=0, FCFS first-fit; share of the pool, mean over the steps while requests wait")
    for kind, res in m["traces"].items():
        print(f"{kind} (mean prompt/output {TRACES[kind][0]}/{TRACES[kind][1]})\n  scheme     live  future internal"
              f" external | batch")
        for s, r in res.items():
            print(f"  {s:8s}" + "".join(f" {100 * r[c]:6.1f}%" for c in CATEGORIES) + f" | {r['batch']:5.1f}")
    print("  (the vLLM paper measured 20.4% / 26.8% / 38.2% live for max_len / pow2 / oracle on ITS trace)")
    if m["plot"]:
        print(f"pool picture (sharegpt, one step): {m['plot']}")


def main(argv=None):
    p = argparse.ArgumentParser(description="naive KV caching, and what reserving max length wastes")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--plot", default="/tmp/01_kv_cache_pool.png",
                   help="where to save the pool picture ('' for none)")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--pool-tokens", type=int, default=32768, help="KV budget in token slots")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-model", action="store_true",
                   help="skip the real model's three ways to generate (the memory figures only)")
    a = p.parse_args(argv)
    cpu_threads()  # one thread on 2 cores (why: in its docstring)
    if a.requests < 2 or a.new_tokens < 1 or a.max_seq_len < 2:
        p.error("--requests must be >= 2, --new-tokens >= 1, --max-seq-len >= 2")
    if a.pool_tokens < a.max_seq_len:
        p.error(f"--pool-tokens {a.pool_tokens} cannot hold one max_len reservation of {a.max_seq_len} slots")
    try:
        m = memory_report(a.requests, a.pool_tokens, a.max_seq_len, a.seed, a.plot or None)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    g = None if a.no_model else generation_report(new_tokens=a.new_tokens)
    if a.json:
        return print(json.dumps({**m, "generate": g} if g else m))
    if g:
        print_generation(g), print()
    print_memory(m, g and g["kv_bytes_per_token_fp16"])


if __name__ == "__main__":
    main()
