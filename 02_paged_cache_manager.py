"""
02_paged_cache_manager.py -- vLLM's PagedAttention: KV blocks, block tables, sharing, preemption.

01 reserved max_seq_len slots per request, and most of them never held a token. PagedAttention cuts
the KV pool into fixed-size blocks of `block_size` tokens, like OS pages: a request takes a block
only when its last one is full, the blocks need not be contiguous, and a per-request *block table*
maps logical blocks to physical ones. The only waste is the unfilled tail of each request's last
block.

    request A, 27 tokens                      one pool for all layers: k_cache, v_cache
    logical block   0     1     2     3       (num_layers, num_blocks, block_size, n_kv_heads, head_dim)
    block table   [ 5 ] [ 2 ] [ 7 ] [ 3 ]     physical block:  0   1   2   3   4   5   6   7
    tokens         8/8   8/8   8/8   3/8 <-- tail waste        .   .  A,B  A   B  A,B  .   A
    request B = fork(A) after 19 tokens: table [5, 2, 4]; blocks 5 and 2 have refcount 2 (shared
    prompt), B's partly filled block 7 -> 4 was copied on B's first write (copy-on-write)

The pieces, in the order this file defines them:
  BlockManager   bookkeeping only: deterministic free list, block tables grown on demand, reference
                 counts, fork (parallel sampling n > 1, beam search), copy-on-write, a watermark for
                 admission, and `check()` -- free + used == total, every refcount == its owners.
  paged_attention  one interface, two paths: flash-attn's `flash_attn_with_kvcache(..., block_table=)`
                 on CUDA when block_size % 256 == 0 (FA2's paged-KV rule) and dtype is fp16/bf16, else
                 PyTorch: gather each request's blocks through its table, then attention.
  PagedKVCache   01's KVCache over blocks (prepare / attend / free), plus fork and swap_out / swap_in.
                 Slot mappings are built with tensor ops, not per-token loops. The block tables also live on
                 the device, one fixed row per sequence, written per step only where they changed, so CUDA
                 graphs and 04's kernels read them for any block size (03's pool is the page-size-1 case).
  Scheduler      continuous batching, the one step loop of the project -- schedule() (admit, then room in the
                 KV), the model, postprocess() -- that 05 and the engine extend. Running out of blocks is a
                 scheduling event: the newest running request is preempted (recomputed later, or swapped to
                 CPU memory), never a crash. simulate() drives it with no model at all.

Run: `python 02_paged_cache_manager.py [--trace alpaca] [--requests N] [--budget SLOTS] [--no-model] [--json]`.

Imports: 01 (the seam, KVCache) at module level. The demo loads llama3_generate (the model),
and loading it imports the lessons its engine uses (01, 02, 03, 05, 06; see 01).

References: Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention" (SOSP 2023); vLLM v0 block_manager / scheduler; nano-vllm's block_manager.py and
scheduler.py (style); FlashAttention-2's flash_attn_with_kvcache (paged KV, page size multiple of
256).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
from collections import Counter, deque, namedtuple

import numpy as np
import torch

L01 = importlib.import_module("01_kv_cache")


# ======== THE IDEA, 1: paging -- blocks, block tables, reference counts, copy-on-write ============

class OutOfBlocks(RuntimeError):
    """The pool cannot hold what was asked; nothing was changed. A scheduler answers this by preempting."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Which physical blocks each sequence owns. Knows nothing about tensors (nano-vllm's BlockManager)."""

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.watermark_blocks = int(watermark * num_blocks)
        # deterministic: take from the front, freed blocks go to the back
        self.free_blocks = deque(range(num_blocks))
        self.ref_count = [0] * num_blocks
        self.block_tables: dict = {}  # seq_id -> [physical block of logical block 0, 1, ...]
        self.num_tokens: dict = {}    # seq_id -> tokens stored
        # block -> references a prefix cache holds (05's radix tree, through BlockRefs)
        self.cached = Counter()

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def _take(self) -> int:
        block = self.free_blocks.popleft()
        self.ref_count[block] = 1
        return block

    def _release(self, block: int):
        if self.ref_count[block] <= 0:
            raise RuntimeError(f"block {block} released more often than it was taken "
                               f"(refcount {self.ref_count[block]})")
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free_blocks.append(block)

    def blocks_needed(self, seq, n: int, copied: Counter | None = None) -> int:
        """Free blocks that appending n tokens to seq takes: new blocks, plus a copy of its partial
        last block if shared (copy-on-write). copied: per block, the copies earlier appends of the
        batch made (the last sharer to write owns it alone, copying nothing)."""
        table = self.block_tables.get(seq)
        if not table:
            return cdiv(n, self.block_size)
        have, last, copied = self.num_tokens[seq], table[-1], Counter() if copied is None else copied
        cow = n > 0 and have % self.block_size != 0 and self.ref_count[last] - copied[last] > 1
        copied[last] += cow
        return cdiv(have + n, self.block_size) - len(table) + cow

    def batch_blocks_needed(self, seqs, n_new) -> int:
        copied = Counter()
        return sum(self.blocks_needed(s, n, copied) for s, n in zip(seqs, n_new))

    def can_allocate(self, n_tokens: int, taken: int = 0, alone: bool = False) -> bool:
        """Admit a new request only if a watermark of blocks stays free: it preempts no running one
        at once. One that would run alone preempts nobody: it needs only to fit."""
        return self.num_free - taken - cdiv(n_tokens, self.block_size) >= (0 if alone else self.watermark_blocks)

    def append(self, seq, n: int) -> list:
        """Grow seq by n tokens (a new seq_id starts a sequence). -> the (src, dst) block copies
        copy-on-write needs. Too few free blocks: OutOfBlocks, before any change."""
        need = self.blocks_needed(seq, n)
        if need > self.num_free:  # checked before any change: a refusal leaves the pool as it was
            raise OutOfBlocks(f"sequence {seq!r}: {n} more tokens need {need} blocks but only {self.num_free} are free")
        copies, table = [], self.block_tables.setdefault(seq, [])
        if need > cdiv(self.num_tokens.get(seq, 0) + n, self.block_size) - len(table):
            # copy-on-write
            src = table[-1]
            self._release(src)
            table[-1] = dst = self._take()
            copies.append((src, dst))
        table += [self._take() for _ in range(need - len(copies))]
        self.num_tokens[seq] = self.num_tokens.get(seq, 0) + n
        return copies

    def prepare(self, seq_ids, n_new) -> list:
        """Append n_new[i] tokens to seq_ids[i], all or nothing -> the copy-on-write copies. So a
        BlockManager is also a backend without tensors (prepare / free) to simulate a scheduler."""
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a sequence appears twice in one batch: {list(seq_ids)}")
        if (need := self.batch_blocks_needed(seq_ids, n_new)) > self.num_free:
            raise OutOfBlocks(f"the batch needs {need} blocks but only {self.num_free} are free")
        return [c for s, n in zip(seq_ids, n_new) for c in self.append(s, n)]

    def fork(self, parent, child):
        """child starts as parent's exact copy and shares every block (refcount + 1): parallel
        sampling, beam search. An unknown parent is a KeyError, a child that exists a ValueError."""
        if parent not in self.block_tables:
            raise KeyError(f"fork: unknown sequence {parent!r}")
        if child in self.block_tables:
            raise ValueError(f"fork: sequence {child!r} already exists")
        self.block_tables[child] = list(self.block_tables[parent])
        self.num_tokens[child] = self.num_tokens[parent]
        for b in self.block_tables[child]:
            self.ref_count[b] += 1

    def free(self, seq):
        """Drop seq: each of its blocks loses a reference, free again at 0. Unknown seq: KeyError."""
        if seq not in self.block_tables:
            raise KeyError(f"free: unknown sequence {seq!r}")
        for b in reversed(self.block_tables.pop(seq)):
            self._release(b)
        del self.num_tokens[seq]

    def check(self) -> bool:
        """The invariants: free + used == total, refcount == number of owning tables, tables sized to their tokens."""
        owners = Counter(b for t in self.block_tables.values() for b in t) + self.cached
        used = sum(c > 0 for c in self.ref_count)
        problems = [msg for bad, msg in [
            (len(set(self.free_blocks)) != self.num_free or any(self.ref_count[b] for b in self.free_blocks),
             "free list holds duplicates or referenced blocks"),
            (self.num_free + used != self.num_blocks,
             f"free {self.num_free} + used {used} != total {self.num_blocks}"),
            (any(self.ref_count[b] != owners.get(b, 0) for b in range(self.num_blocks)),
             "a block's refcount != owners"),
            (any(len(t) != cdiv(self.num_tokens[s], self.block_size) for s, t in self.block_tables.items()),
             "a block table does not match its token count")] if bad]
        if problems:
            raise AssertionError("block manager corrupted: " + "; ".join(problems))
        return True


class BlockRefs:
    """The blocks as 05's radix tree sees a pool (03's TokenAllocator: available, inc_ref, free,
    mem_state): a reference per cached page, one whole block named by its slots (block * B + i)."""

    def __init__(self, manager, device):
        self.m, self.size, self.device = manager, manager.num_blocks, device
        # free blocks; 02's invariants
        self.available, self.check = lambda: manager.num_free, manager.check

    def _blocks(self, slots):
        return (torch.as_tensor(slots)[::self.m.block_size] // self.m.block_size).tolist()

    def inc_ref(self, slots):
        for b in self._blocks(slots):
            self.m.ref_count[b], self.m.cached[b] = self.m.ref_count[b] + 1, self.m.cached[b] + 1

    def free(self, slots):
        for b in self._blocks(slots):
            self.m.cached[b] -= 1
            self.m._release(b)

    @property
    def mem_state(self):  # (num_blocks,) int32 refcounts, as 03's
        return torch.tensor(self.m.ref_count, dtype=torch.int32, device=self.device)


@functools.cache
# -------- attention through the block tables (flash-attn or PyTorch) ------------------------------

def flash_attn():
    """flash-attn's paged-KV kernels (decode: flash_attn_with_kvcache; ragged prefill:
    flash_attn_varlen_func; both read the block table), or None where not installed (CPU, CI)."""
    with contextlib.suppress(ImportError):
        return importlib.import_module("flash_attn")


def flash_ok(k_cache) -> bool:
    """FA2 reads paged KV only on CUDA, in fp16/bf16, with blocks of a multiple of 256 tokens."""
    return (flash_attn() is not None and k_cache.is_cuda and k_cache.shape[1] % 256 == 0
            and k_cache.dtype in (torch.float16, torch.bfloat16))


def paged_attention(q, k_cache, v_cache, block_table, seq_lens, q_lens, path: str = "auto"):
    """Attention of a flat ragged batch over one layer's paged cache (its new k, v already written).

    q (T, H, D): q_lens[i] new tokens of request i, request after request: the LAST q_lens[i] of its
    seq_lens[i]. k_cache, v_cache (num_blocks, block_size, Hkv, D); block_table (batch, max_blocks)
    int32; seq_lens (batch,) int32. path: "auto" (flash-attn where flash_ok, else PyTorch), "flash"
    or "torch". Returns (T, H, D)."""
    if path == "flash" or (path == "auto" and flash_ok(k_cache)):
        if not flash_ok(k_cache):
            raise ValueError("flash path needs flash-attn, CUDA tensors, fp16/bf16 and block_size % 256 == 0")
        fa = flash_attn()
        if len(set(q_lens)) == 1:  # decode (or equal chunks): one call, q (batch, n, H, D)
            out = fa.flash_attn_with_kvcache(q.view(len(q_lens), q_lens[0], *q.shape[1:]), k_cache,
                                             v_cache, cache_seqlens=seq_lens,
                                             block_table=block_table, causal=True)
            # causal mask aligned bottom-right: q are the last tokens of each request
            return out.flatten(0, 1)
        # (batch + 1,) q offsets
        cu_q = torch.tensor([0, *q_lens], device=q.device).cumsum(0, dtype=torch.int32)
        # (batch + 1,) key offsets
        cu_k = torch.cat([seq_lens.new_zeros(1), seq_lens.cumsum(0, dtype=torch.int32)])
        max_k = k_cache.shape[1] * block_table.shape[1]
        # ragged prefill
        return fa.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(q_lens), max_k,
                                         causal=True, block_table=block_table)
    if all(n == 1 for n in q_lens):
        # decode: gather every request's blocks at once, mask past each length
        # (batch, max_blocks * B, Hkv, D)
        K, V = k_cache[block_table].flatten(1, 2), v_cache[block_table].flatten(1, 2)
        return L01.attend_decode(q, K, V, seq_lens)
    outs, t, B = [], 0, k_cache.shape[1]
    for i, (n, L) in enumerate(zip(q_lens, seq_lens.tolist())):  # prefill: one request at a time
        blocks = block_table[i, :cdiv(L, B)]
        outs.append(L01.attend_dense(q[t:t + n], k_cache[blocks].flatten(0, 1)[:L],
                                      v_cache[blocks].flatten(0, 1)[:L]))
        t += n
    return torch.cat(outs)


# -------- 01's seam over blocks: PagedKVCache -----------------------------------------------------

class PagedKVCache(L01.KVCache):
    """01's seam (KVCache) over blocks. table (max_seqs, max_blocks) int32 on the device, one fixed
    row per sequence, is what flash-attn, 04's kernels and the engine's CUDA graphs read; the
    BlockManager stays the truth, and a step writes only what changed (new block ids, and the block
    a copy-on-write replaced), never whole tables from lists. Unused entries are never read
    (lengths bound them; tests poison them). 05's radix tree shares whole blocks by reference
    (add_prefix, share_prefix; BlockRefs: its own); a prompt's partial last block is recomputed."""
    shares_prefixes = True

    def __init__(self, n_layers, num_blocks, block_size, n_kv_heads, head_dim, dtype=torch.float32,
                 device="cpu", watermark=0.01, path="auto", max_seqs=256, max_seq_len=None):
        self.manager = BlockManager(num_blocks, block_size, watermark)
        shape = (n_layers, num_blocks, block_size, n_kv_heads, head_dim)
        # (n_layers, num_blocks, block_size, Hkv, D)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size, self.device, self.path = block_size, torch.device(device), path
        self.page = block_size    # 04's kernels: slot = table[row, pos // page] * page + pos % page
        # default: one sequence may fill the pool
        self.max_seq_len = max_seq_len or num_blocks * block_size
        self.table = torch.zeros(max_seqs, cdiv(self.max_seq_len, block_size), dtype=torch.int32,
                                 device=device)  # (max_seqs, max_blocks) int32
        self.free_rows = list(range(max_seqs))
        # rows: seq_id -> its row of self.table; written: row -> (blocks the device row holds, the
        # last of them), what the next write skips
        self.rows, self.written = {}, {}
        self.lens = self.manager.num_tokens  # seq_id -> tokens stored (the manager's own dict)
        # what 05's radix tree holds references through
        self.allocator = BlockRefs(self.manager, self.device)

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int = 16, **kw):
        a, w = model.args, model.tok_embeddings.weight
        return cls(a.n_layers, num_blocks, block_size, a.n_kv_heads, a.head_dim, w.dtype, w.device,
                   **kw)

    @classmethod
    def for_pool(cls, model, tokens, max_batch, max_len, pad=0, block_size=16):
        # rounded up: the pool holds every request of up to `tokens`
        blocks = cdiv(tokens, block_size) + pad
        return cls.for_model(model, blocks, block_size, max_seqs=max_batch + 1 + pad,
                             max_seq_len=max_len), max_batch

    def layer_pools(self, layer):
        """(num_blocks * block_size, n_kv_heads, head_dim) K and V of one layer: slot = block * block_size + i."""
        return self.k_cache[layer].flatten(0, 1), self.v_cache[layer].flatten(0, 1)

    def prepare(self, seq_ids, n_new):
        """Make room for n_new[i] tokens of seq_ids[i] (all or nothing: OutOfBlocks leaves the pool unchanged)."""
        m, B = self.manager, self.block_size
        starts = [m.num_tokens.get(s, 0) for s in seq_ids]
        for s, p, n in zip(seq_ids, starts, n_new):
            if p + n > self.max_seq_len and self.max_seq_len < m.num_blocks * B:
                # else: OutOfBlocks below
                raise ValueError(f"sequence {s}: {p + n} tokens exceed max_seq_len={self.max_seq_len}")
        fresh = [s for s in seq_ids if s not in self.rows]
        if len(fresh) > len(self.free_rows):
            raise OutOfBlocks(f"{len(fresh)} new sequences, only {len(self.free_rows)} free block-table rows")
        copies = m.prepare(seq_ids, n_new)
        if copies:  # copy-on-write: duplicate the shared blocks, every layer at once
            src, dst = torch.tensor(copies, device=self.device).T
            self.k_cache[:, dst], self.v_cache[:, dst] = self.k_cache[:, src], self.v_cache[:, src]
        self._write_tables(seq_ids)
        rows = [self.rows[s] for s in seq_ids]
        # (B,) each, in one copy that waits for no queued GPU work
        n_t, start_t, row_t = L01.to_device(torch.tensor([list(n_new), starts, rows]), self.device)
        # (T,); the size spares a sync
        per_token = lambda x: torch.repeat_interleave(x, n_t, output_size=sum(n_new))
        # (T,)
        origin = n_t.cumsum(0) - n_t - start_t  # (B,) where each request's token 0 would sit
        positions = torch.arange(sum(n_new), device=self.device) - per_token(origin)
        # (T,) flat slot
        self.tok_slots = self.table[per_token(row_t), positions // B].long() * B + positions % B
        self.batch = (rows, starts, list(n_new))
        # (B,) what the kernels read
        self.batch_rows, self.batch_lens = row_t.int(), (start_t + n_t).int()
        return positions

    def pad_row(self) -> int:
        """A table row for CUDA graphs' padding: every entry is one scratch block, owned by a
        sequence ("pad") that no scheduler sees, so the manager's invariants hold."""
        self.manager.append("pad", 1)
        row = self.free_rows.pop()
        self.table[row] = self.manager.block_tables["pad"][0]
        return row

    def _write_tables(self, seq_ids):
        """Bring seq_ids' device rows up to the manager's tables in one scatter: blocks appended
        since the last write, and the last one again if copy-on-write replaced it."""
        where, blocks = [], []
        for s in seq_ids:
            if s not in self.rows:
                self.rows[s] = row = self.free_rows.pop()
                self.written[row] = (0, None)
            row, table = self.rows[s], self.manager.block_tables[s]
            n, last = self.written[row]
            first = n - 1 if n and table[n - 1] != last else n
            where += [(row, i) for i in range(first, len(table))]
            blocks += table[first:]
            self.written[row] = (len(table), table[-1] if table else None)
        if blocks:
            w = L01.to_device(torch.tensor(where), self.device)  # (changes, 2)
            self.table[w[:, 0], w[:, 1]] = L01.to_device(torch.tensor(blocks, dtype=torch.int32), self.device)

    def used(self) -> int:
        return (self.manager.num_blocks - self.manager.num_free) * self.block_size

    def capacity(self) -> int:
        return self.manager.num_blocks * self.block_size

    def room(self) -> int:
        # above the watermark
        return (self.manager.num_free - self.manager.watermark_blocks) * self.block_size

    def attend(self, layer, q, k, v):
        """01's attend (04's kernels, or PyTorch through the table), or flash-attn's where it runs:
        path="auto": decode, and prefill without 04's extend kernel; path="flash": everything."""
        # (num_blocks, block_size, Hkv, D)
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        n_new = self.batch[2]
        # decode, or prefill without 04's extend kernel
        auto = flash_ok(k_cache) and (all(n == 1 for n in n_new) or self.extend_attn is None)
        if not (self.path == "flash" or (self.path == "auto" and auto)):
            return super().attend(layer, q, k, v)
        self.store_kv(*self.layer_pools(layer), self.tok_slots, k, v)  # write this step's k, v into their slots
        table = self.table[self.batch_rows.long()]  # the full width: the same in every CUDA graph
        return paged_attention(q, k_cache, v_cache, table, self.batch_lens, n_new, self.path)

    def free(self, seq_id):
        self.manager.free(seq_id)
        if seq_id in self.rows:  # a sequence forked but never prepared has no row yet
            self.free_rows.append(self.rows.pop(seq_id))

    def fork(self, parent, child):
        self.manager.fork(parent, child)  # the child's row is written at its first prepare

    def _blocks(self, seq_id):
        return torch.tensor(self.manager.block_tables[seq_id], dtype=torch.long, device=self.device)

    def slots(self, seq_id) -> torch.Tensor:
        """The sequence's slot per token (block * block_size + i), LongTensor (len,): what 05's radix tree stores."""
        blocks, B = self._blocks(seq_id), self.block_size
        # (len,)
        return (blocks[:, None] * B + torch.arange(B, device=self.device)).flatten()[:self.lens[seq_id]]

    def add_prefix(self, seq_id, slots):
        """Start seq_id on cached whole blocks (05's tree hands out full pages only): one more reference each."""
        if seq_id in self.lens:
            raise ValueError(f"add_prefix: sequence {seq_id!r} already exists")
        self.manager.block_tables[seq_id], self.lens[seq_id] = [], len(slots)
        for b in self.allocator._blocks(slots):
            self.manager.block_tables[seq_id].append(b)
            self.manager.ref_count[b] += 1

    def share_prefix(self, seq_id, slots, start=0):
        """Point seq_id's blocks from token start (a block's first) at the cache's copies of the
        same tokens; its own duplicates go back now."""
        table = self.manager.block_tables[seq_id]
        for i, b in enumerate(self.allocator._blocks(slots), start // self.block_size):
            if table[i] != b:
                self.manager.ref_count[b] += 1
                self.manager._release(table[i])
                table[i] = b
                # its device row is written afresh at the next prepare
                self.written[self.rows[seq_id]] = (0, None)

    def gather(self, seq_id, layer):
        """(tokens, Hkv, D) K and V of one sequence, in order (for tests and pictures)."""
        blocks, n = self._blocks(seq_id), self.manager.num_tokens[seq_id]
        k, v = self.k_cache[layer, blocks], self.v_cache[layer, blocks]
        return k.flatten(0, 1)[:n], v.flatten(0, 1)[:n]

    def swap_out(self, seq_id):
        """Copy a sequence's blocks to CPU memory and free them (shared blocks come back private on swap_in)."""
        blocks = self._blocks(seq_id)
        saved = (self.k_cache[:, blocks].cpu(), self.v_cache[:, blocks].cpu(),
                 self.manager.num_tokens[seq_id])
        self.free(seq_id)
        return saved

    def swap_in(self, seq_id, saved):
        k, v, n = saved
        self.manager.append(seq_id, n)
        blocks = self._blocks(seq_id)
        self.k_cache[:, blocks], self.v_cache[:, blocks] = k.to(self.device), v.to(self.device)


# ======== THE IDEA, 2: scheduling -- continuous batching, preemption when blocks run out ==========

class Request:
    """A request in flight: its KV holds tokens[:kv_len]; the next step feeds tokens[kv_len:] (the
    prompt once admitted, a token in decode, prompt + output after a recompute preemption)."""

    def __init__(self, rid, prompt, max_new_tokens, stop_ids=()):
        self.rid = rid                   # request id: the backend's sequence id too
        self.prompt = list(prompt)       # token ids
        self.max_new_tokens = max_new_tokens  # output tokens, at most (the engine reads this one)
        self.stop_ids = set(stop_ids)    # a token that ends the output (EOS)
        self.output = []                 # token ids generated so far
        self.kv_len = 0                  # tokens[:kv_len] have K/V in the backend
        self.in_kv = False               # the backend holds a row (or block table) for it
        self.done = False

    @property
    def tokens(self):
        return self.prompt + self.output

    @property
    def missing(self) -> int:  # tokens its KV lacks
        return len(self.prompt) + len(self.output) - self.kv_len

    n_new = missing  # tokens the next step feeds (05's chunked prefill feeds a part)

    @property
    def tokens_left(self) -> int:  # tokens it may still output
        return self.max_new_tokens - len(self.output)

    samples = True  # the next step feeds all its KV lacks, so a token is sampled after it

    @property
    def feed(self) -> list:  # the tokens the next step feeds
        return self.tokens[self.kv_len:self.kv_len + self.n_new]

    def append(self, token):
        """A sampled token; it may end the request (the engine's requests add constraints and jump-forward)."""
        self.output.append(token)
        self.done = token in self.stop_ids or self.tokens_left <= 0


# one scheduling decision, logged as it is made (see Scheduler)
Event = namedtuple("Event", "step kind rid tokens")
EVENTS = {  # kind: what `tokens` counts
    "admit": "prompt tokens already cached (its KV held from the start)",
    "hold_back": "0 (admitted, did not fit)",
    "prefill": "tokens computed into its KV",
    "decode": "tokens computed into its KV (k in a multi-step chunk)",
    "evict": "cached tokens evicted (rid None: the pool's, 05)",
    "preempt": "tokens of KV dropped (recompute later)",
    "swap_out": "tokens of KV copied to CPU memory",
    "swap_in": "tokens of KV copied back",
    "requeue": "tokens of KV dropped (jump-forward changed tokens in it, the engine)",
    "finish": "output tokens"}


class Scheduler:
    """Continuous batching (nano-vllm's, cut down): the one step loop of 02, 05 and the engine.

        batch, positions = sched.schedule()       # admit(), then room in the KV for the step (prepare)
        ids = forward(batch, tokens, positions)   # the model (or a stand-in): a next token per request
        sched.postprocess(batch, ids)             # append, finish, keep running or requeue

    Each step either prefills the requests admit() lets in, or decodes one token of every running
    request (vLLM's prefill-first order; 05 adds mixed steps). When the pool cannot hold a step,
    prepare() first lets make_room() free something (05 evicts cached prefixes there), then holds
    the newest admitted request back, then preempts the newest running one: recompute (free its KV
    now, prefill prompt + output so far later) or swap (copy its blocks to CPU memory, copy them
    back when they fit). 05's Scheduler is this class with another admit().

    Every decision is logged to `events` as made: Event(step, kind, rid, tokens), kinds in EVENTS
    (step: its forward, from 0); a tuple per request and step, cheap enough to stay on."""

    def __init__(self, kv, max_running: int = 64, preempt: str = "recompute"):
        """kv: any backend (prepare / free) raising OutOfBlocks when full, or a bare BlockManager to
        simulate a trace without tensors; swap needs swap_out / swap_in (PagedKVCache)."""
        self.m = kv if isinstance(kv, BlockManager) else getattr(kv, "manager", None)
        unswappable = preempt == "swap" and not isinstance(kv, PagedKVCache)
        if preempt not in ("recompute", "swap") or unswappable:
            raise ValueError(f"preempt must be 'recompute' or 'swap' (swap needs a PagedKVCache), not {preempt!r}")
        self.kv, self.max_running, self.preempt_mode = kv, max_running, preempt
        self.waiting, self.running, self.swapped, self.finished = deque(), [], deque(), []
        self.stats = dict(preemptions=0, steps=0)
        # an Event per scheduling decision; (running, live tokens, used blocks, anyone waiting) per
        # decode step (a BlockManager)
        self.events, self.decode_log = [], []

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def reset(self):
        """Forget the last run: counters, events, finished requests (between runs of one warm engine)."""
        assert not self.busy, "reset() between runs"
        self.stats = dict.fromkeys(self.stats, 0)
        self.events, self.finished, self.decode_log = [], [], []

    def swap_in(self):
        """Swapped-out requests come back first, oldest first, when their blocks fit (then they
        decode again); 05's cached prefixes are evicted to make them fit."""
        fits = lambda n: self.m.can_allocate(n, alone=not self.running)
        while self.swapped and len(self.running) < self.max_running and (fits(n := self.swapped[0][0].kv_len) or (
                self.make_room(cdiv(n, self.m.block_size) * self.m.block_size) and fits(n))):
            req, saved = self.swapped.popleft()
            self.kv.swap_in(req.rid, saved)
            req.in_kv = True
            self.running.append(req)
            self.log("swap_in", req, req.kv_len)

    def admit(self) -> list:
        """vLLM's admission, after swap_in(): first come first served, while the prompt's blocks fit
        above the watermark. Returns the requests to prefill this step."""
        self.swap_in()
        m, batch, taken = self.m, [], 0
        while not self.swapped and self.waiting and len(self.running) + len(batch) < self.max_running:
            n = self.waiting[0].n_new
            if not m.can_allocate(n, taken, alone=not (self.running or batch)):
                break
            taken += cdiv(n, m.block_size)
            batch.append(self.waiting.popleft())
            self.log("admit", batch[-1], 0)
        return batch

    def log(self, kind, req, tokens):
        self.events.append(Event(self.stats["steps"], kind, None if req is None else req.rid, tokens))

    def batch(self, new):
        """This step's requests: the admitted ones (prefill-first), else the running ones (05 adds mixed steps)."""
        return new or self.running

    def schedule(self, new=None):
        """This step's batch, with room in the KV: (batch, positions). new: what admit() let in (None: admit now)."""
        new = self.admit() if new is None else new
        if not (new or self.running):
            n = self.waiting[0].n_new if self.waiting else self.swapped[0][0].kv_len if self.swapped else 0
            raise OutOfBlocks(f"nothing can run: a request of {n} tokens cannot fit next to what the pool holds")
        batch, positions = self.prepare(self.batch(new))
        if batch is self.running and self.m is not None:
            live = sum(self.m.num_tokens[r.rid] for r in batch)
            busy = bool(self.waiting or self.swapped)
            self.decode_log.append((len(batch), live, self.m.num_blocks - self.m.num_free, busy))
        return batch, positions

    def prepare(self, batch):
        """kv.prepare for this step's batch (admitted, running, or both). When the pool cannot hold
        it: make_room(), then hold back the newest admitted, then preempt the newest running one,
        and retry. -> (batch, positions); batch is self.running when nothing new fits."""
        while True:
            try:
                positions = self.kv.prepare([r.rid for r in batch], [r.n_new for r in batch])
                for r in batch:
                    r.in_kv = True
                return batch, positions
            except OutOfBlocks:
                if self.make_room(self.slots_needed(batch, [r.n_new for r in batch])) > 0:
                    continue
                if len(batch) == 1 and all(r is batch[0] for r in self.running):
                    # alone, after every eviction
                    raise OutOfBlocks(f"request {batch[0].rid} needs more KV than the whole pool holds") from None
                running = set(map(id, self.running))
                # new ones first
                victim = next((r for r in reversed(batch) if id(r) not in running), batch[-1])
                batch.remove(victim)
                if id(victim) in running:
                    if batch is not self.running:
                        self.running.remove(victim)
                    self.preempt(victim)
                else:
                    self.hold_back(victim)
                if not batch:  # nothing new fits next to the running ones: decode them instead
                    batch = self.running

    def slots_needed(self, batch, n_new) -> int:
        """KV slots kv.prepare(batch, n_new) takes now: tokens, or the whole blocks they start."""
        if self.m is None:
            return sum(n_new)
        return self.m.batch_blocks_needed([r.rid for r in batch], n_new) * self.m.block_size

    def free_slots(self):
        """prepare()'s room now: free slots (whole blocks, watermark too); None: 01's rows."""
        return self.kv.room() if self.m is None else self.m.num_free * self.m.block_size

    def make_room(self, n_tokens: int) -> int:
        """Free slots without touching a running request; returns how many. Nothing here (05 evicts its cache)."""
        return 0

    def preempt(self, req):
        """Take req (running, already out of self.running) off the pool: count it in
        stats["preemptions"], log it ("swap_out" or "preempt", tokens: the req.kv_len it holds,
        logged before anything is dropped), then swap: append (req, kv.swap_out(rid)) to
        self.swapped, req.in_kv = False (it keeps kv_len); recompute: release(req) and put it at the
        head of self.waiting."""
        self.stats["preemptions"] += 1
        self.log("swap_out" if self.preempt_mode == "swap" else "preempt", req, req.kv_len)
        if self.preempt_mode == "swap":
            # keeps kv_len: swap_in restores those tokens
            self.swapped.append((req, self.kv.swap_out(req.rid)))
            req.in_kv = False
        else:
            self.release(req)
            self.waiting.appendleft(req)

    def hold_back(self, req):
        """An admitted request that did not fit: its KV goes, and it waits at the head of the queue."""
        self.log("hold_back", req, 0)
        self.release(req)
        self.waiting.appendleft(req)

    def release(self, req):
        """Drop req's KV (05 first hands its computed tokens to the radix tree)."""
        if req.in_kv:
            self.kv.free(req.rid)
        req.kv_len, req.in_kv = 0, False

    def computed(self, req, n: int):
        """req's KV now holds n more tokens (05 also caches its prompt in the radix tree)."""
        req.kv_len += n

    def postprocess(self, batch, new_ids, steps: int = 1):
        """After the forward of `steps` steps: batch[i] fed its n_new tokens and got new_ids[i] (k
        ids after k decode steps, each fed the one before; none after a chunk short of its prompt's
        end). Append them until the request is done; finish it, keep it running, or requeue it
        (append said jump-forward changed tokens in its KV). Returns how many were appended."""
        was_running, stepped = set(map(id, self.running)), set(map(id, batch))
        # prefill-first leaves the running be
        self.running = [r for r in self.running if id(r) not in stepped]
        appended = 0
        for r, ids in zip(batch, new_ids):
            n, held, k = r.n_new, r.kv_len, 0
            kind = "decode" if id(r) in was_running else "prefill"
            if not ids:  # part of a prompt in: the next step feeds the rest (05's chunked prefill)
                self.computed(r, n)
                self.log(kind, r, n)
                continue
            for fed, t in zip([n] + [1] * (len(ids) - 1), ids):
                self.computed(r, fed)
                # None; or (the engine's jump-forward) the first of its tokens that changed
                changed = r.append(t)
                k += 1
                if r.done:
                    break
            appended += k
            self.log(kind, r, n + k - 1)  # tokens computed into its KV
            # jump-forward changed tokens in its KV:
            requeue = changed is not None and changed < r.kv_len
            if requeue:
                r.kv_len = changed  # only the KV before them holds (05's tree keeps it at release)
            if r.done:
                self.finish(r)
            elif not requeue:
                self.running.append(r)
            else:  # recompute the rest
                self.log("requeue", r, held + n + k - 1)
                self.release(r)
                self.waiting.appendleft(r)
        self.stats["steps"] += steps
        return appended

    def finish(self, req):
        req.done = True  # before release: 05 learns from finished requests there
        self.release(req)
        self.finished.append(req)
        self.log("finish", req, len(req.output))

    def pending(self) -> list:
        """Every request not finished: waiting, running, swapped out."""
        return [*self.waiting, *self.running, *(r for r, _ in self.swapped)]

    def abort(self, rid):
        """Finish request rid now, wherever it is (a server's client went away): its KV goes as at
        any finish. Returns it, or None where no unfinished request has that id."""
        req = next((r for r in self.pending() if r.rid == rid), None)
        if req is not None:
            self.waiting = deque(r for r in self.waiting if r is not req)
            self.running = [r for r in self.running if r is not req]
            self.swapped = deque((r, saved) for r, saved in self.swapped if r is not req)
            self.finish(req)
        return req

    def step(self, forward):
        """One iteration; forward(batch, tokens, positions) -> a next token per request (the model,
        or a stand-in), ignored where a chunk ends short of its prompt's end."""
        batch, positions = self.schedule()
        tokens = [t for r in batch for t in r.feed]
        samples = [r.samples for r in batch]
        ids = forward(batch, tokens, positions)
        self.postprocess(batch, [[t] if s else [] for t, s in zip(ids, samples)])

    def run(self, forward):
        """Step until every request is done. Returns the outputs in rid order."""
        while self.busy:
            self.step(forward)
        return [r.output for r in sorted(self.finished, key=lambda r: r.rid)]


# -------- the model through the scheduler ---------------------------------------------------------

def serve(model, prompts, max_new_tokens, num_blocks, block_size=16, preempt="recompute",
          stop_ids=(), max_running=64):
    """Greedy decoding of prompts (lists of ids) through a paged cache of num_blocks. -> (outputs, scheduler)."""
    kv = PagedKVCache.for_model(model, num_blocks, block_size)
    sched = Scheduler(kv, max_running, preempt)
    sched.waiting.extend(Request(i, p, max_new_tokens, stop_ids) for i, p in enumerate(prompts))
    return sched.run(greedy_forward(model, kv)), sched


def greedy_forward(model, kv):
    """The model as a scheduler's forward: one ragged forward, logits only at each request's last new token."""
    device = model.tok_embeddings.weight.device

    def forward(batch, tokens, positions):
        last = torch.tensor([r.n_new for r in batch], device=device).cumsum(0) - 1
        return model(torch.tensor(tokens, device=device), positions, kv,
                     logits_at=last).argmax(-1).tolist()
    return forward


# ======== DEMO: measurements -- the scheduler on a trace with no model, sharing, the report =======

def simulate(prompt_lens, output_lens, num_blocks, block_size=16, max_running=1024, watermark=0.01):
    """The same scheduler on a request trace with no model and no tensors (every sampled token is
    0): what the block manager alone allows. Returns the scheduler, holding its statistics."""
    sched = Scheduler(BlockManager(num_blocks, block_size, watermark), max_running)
    lens = zip(prompt_lens, output_lens)
    sched.waiting.extend(Request(i, [0] * int(p), int(o)) for i, (p, o) in enumerate(lens))
    sched.run(lambda batch, tokens, positions: [0] * len(batch))
    return sched


def sharing_saved(prompt_lens, output_lens, width: int, beam: bool, block_size=16, seed=0) -> float:
    """1 - blocks held with sharing / blocks of `width` unshared copies, summed over decode steps.
    Parallel sampling: the prompt is prefilled once and forked into `width` samples that diverge.
    Beam search (our model of it): after the prompt, each step each of the `width` new beams picks
    its parent uniformly among the old ones (fork parent -> child, then the old beams are freed):
    beams share the prompt and a history that coalesces a few steps back, as real beams do."""
    rng, m = np.random.default_rng(seed), BlockManager(1 << 20, block_size, 0.0)
    held = unshared = 0
    for p, o in zip(prompt_lens, output_lens):
        m.append("prompt", int(p))
        beams = [("b", 0, i) for i in range(width)]
        for b in beams:
            m.fork("prompt", b)
        m.free("prompt")
        for step in range(int(o)):
            if beam and step:
                new = [("b", step, i) for i in range(width)]
                for parent, child in zip(rng.integers(0, width, width), new):
                    m.fork(beams[parent], child)
                for b in beams:
                    m.free(b)
                beams = new
            for b in beams:
                m.append(b, 1 if step else 0)
            held += m.num_blocks - m.num_free
            unshared += width * cdiv(int(p) + step, block_size)
        for b in beams:
            m.free(b)
    return 1 - held / unshared


def measure(trace="sharegpt", n=1000, seed=0, budget_tokens=32768, max_seq_len=2048):
    """Live share of the pool and running batch while requests wait, paged (block 1, 16, 256) vs
    01's max-len rows (01's account, same trace and budget); then what sharing saves."""
    prompt, output = L01.synthetic_trace(trace, n, seed, max_seq_len)
    ref = L01.account(prompt, output, "max_len", budget_tokens, max_seq_len)
    res = {"trace": trace, "requests": n, "budget_tokens": budget_tokens, "live_fraction": {},
           "batch": {}, "preemptions": {}, "live_fraction_max_len": ref["live"],
           "batch_max_len": ref["batch"],
           "attention_path": "flash-attn" if flash_attn() and torch.cuda.is_available() else "pytorch"}
    for B in (1, 16, 256):
        sched = simulate(prompt, output, budget_tokens // B, B)
        # pool was full
        log = [st[:3] for st in sched.decode_log if st[3]] or [st[:3] for st in sched.decode_log]
        full = np.array(log, dtype=float)  # (running, live, used) per decode step
        res["live_fraction"][str(B)] = float(full[:, 1].mean() / budget_tokens)
        res["batch"][str(B)] = float(full[:, 0].mean())
        res["preemptions"][str(B)] = sched.stats["preemptions"]
    # vLLM measured sharing on Alpaca
    ap, ao = L01.synthetic_trace("alpaca", min(n, 200), seed, max_seq_len)
    res["sharing_saved"] = {kind: {str(w): sharing_saved(ap, ao, w, kind == "beam") for w in (2, 4, 6)}
                            for kind in ("parallel", "beam")}
    return res


def demo(max_new_tokens=16, num_blocks=20, block_size=4):
    """The real model through a pool too small for its batch: greedy outputs vs 01's contiguous cache."""
    import llama3_generate as L
    model, tok = L.load_model()
    prompts = [tok.chat(q) for q in ("Write a short poem about the sea.", "Why is the sky blue?", "Name the planets.")]
    ref = L.generate(model, L01.ContiguousKVCache.for_model(model, len(prompts), 256), prompts,
                     max_new_tokens, stop_ids=tok.stop_ids)
    res = {"num_blocks": num_blocks, "block_size": block_size, "text": tok.decode(ref[0])}
    for preempt in ("recompute", "swap"):
        out, sched = serve(model, prompts, max_new_tokens, num_blocks, block_size, preempt,
                           tok.stop_ids)
        res[preempt] = dict(equal_to_contiguous=out == ref, preemptions=sched.stats["preemptions"])
    return res


def print_report(res):
    d = res.get("demo")
    print(f"KV pool of {res['budget_tokens']} token slots, {res['trace']}-like trace of {res['requests']} requests, "
          f"averaged over decode steps while requests wait:\n  {'':24s} live share of pool  running requests")
    print(f"  {'01 max-len reservation':24s} {res['live_fraction_max_len']:18.1%}  {res['batch_max_len']:16.1f}")
    for b in res["live_fraction"]:
        print(f"  {'paged, block_size ' + b:24s} {res['live_fraction'][b]:18.1%}  {res['batch'][b]:16.1f}"
              f"   ({res['preemptions'][b]} preemptions)" + ("  FA2's smallest paged block" if b == "256" else ""))
    print(f"Memory saved by sharing blocks (Alpaca-like trace, {min(res['requests'], 200)} requests, block 16):")
    for kind, saved in res["sharing_saved"].items():
        print(f"  {kind:8s} " + "  ".join(f"width {w}: {x:5.1%}" for w, x in saved.items()))
    for p in ("recompute", "swap") if d else ():
        print(f"Real model, {d['num_blocks']} blocks of {d['block_size']} tokens, preempt={p}: {d[p]['preemptions']} "
              f"preemptions, greedy tokens == 01's contiguous cache: {d[p]['equal_to_contiguous']}")
    print((f"  sample: {d['text']!r}\n" if d else "") + f"Attention path here: {res['attention_path']}")


# -------- the command line ------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    ap.add_argument("--trace", choices=sorted(L01.TRACES), default="sharegpt")
    ap.add_argument("--requests", type=int, default=1000, help="requests in the synthetic trace")
    ap.add_argument("--budget", type=int, default=32768, help="KV budget in token slots")
    ap.add_argument("--no-model", action="store_true", help="skip the real-model preemption demo")
    args = ap.parse_args(argv)
    L01.cpu_threads()  # one thread on 2 cores (why: in its docstring)
    if args.requests < 1:
        ap.error("--requests must be >= 1")
    if args.budget < 2048 or args.budget % 2048:
        ap.error("--budget must be a positive multiple of 2048 token slots")
    res = measure(args.trace, args.requests, budget_tokens=args.budget)
    if not args.no_model:
        res["demo"] = demo()
    print(json.dumps(res)) if args.json else print_report(res)


if __name__ == "__main__":
    main()
