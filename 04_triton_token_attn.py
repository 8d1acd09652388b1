"""
04_triton_token_attn.py -- token attention in Triton: flash-decoding for a decode step, and the
prefill (extend) kernel for many new tokens over a cached prefix, both reading K/V through the token
table.

    python 04_triton_token_attn.py            # CPU (Triton interpreter) or GPU: kernels vs float64 reference
    python 04_triton_token_attn.py --bench    # GPU: time, GB/s, vs flash-attn (paged) and SDPA (contiguous)

03's token pool stores K and V one slot per token, anywhere in the pool; `req_to_token[row, i]` says
which slot holds token i of a request. A decode step has one new query per request, so attention is
a matrix-vector product per head: it reads every cached K/V byte once and does ~1 FLOP per byte. It
is memory-bound, and the only number that matters is achieved bandwidth against the device's copy
bandwidth.

Flash-decoding (Dao et al. 2023, "Flash-Decoding for long-context inference"; SGLang's
decode_attention.py and vLLM's paged attention v2 do the same): one program per (request, kv head)
leaves the GPU idle when batch x kv_heads is small (batch 1 x 8 heads = 8 programs on 132 SMs). So
split each request's context into chunks across programs, and merge:

    tokens of request b:  |---- split 0 ----|---- split 1 ----|---- split 2 ----|--- split 3 ---|
    stage 1, program (kv head h, split s, request b):  read slots req_to_token[row_b, chunk_s] of head h
        for all query heads of h's group at once:  S = Q_g K^T   (Q_g = G query heads, padded to 16 rows)
        online softmax over its chunk  ->  partial output o_s (G, D) and log-sum-exp lse_s (G,)
    stage 2, program (q head, request b):  out = sum_s o_s * exp(lse_s - lse) with lse = logsumexp_s(lse_s)

GQA: the G = n_q_heads / n_kv_heads query heads of a group share one load of each K/V tile (one
`tl.dot` over a 16-row tile) instead of re-reading K/V once per query head. `choose_num_splits`
splits only when batch x kv_heads leaves SMs idle (else stage 1 writes the answer and stage 2 is
skipped): one wave of about 4 resident programs per SM, chunks >= 64 tokens. Splits past a short
request's last token return at once, so a CUDA graph may fix the split count for the longest context
it will see.

Every backend, one kernel: token i of table row r sits at slot table[r, i // P] * P + i % P
(`_slot`): P = 1 for 03's token pool (req_to_token holds slots), the block size for 02's paged pool,
max_len for 01's contiguous rows. This file holds every Triton kernel of the project, so only their
users need Triton (Linux): the lesson first, then its float64 references, check and command line,
then, in an appendix, the kernels the engine borrows (batch-1 fused decode, the Lamport all-reduce,
argmax, the model's pointwise steps).

Third, deterministic mode (THE IDEA, 3): why a bf16 answer moves with the batch it runs in (each
kernel picks its reduction order from the batch's shapes), and the same two kernels plus a matmul
that keep it still: one attention reduction for every query, over keys in pieces of a fixed size,
and a matmul that sums K in one order, its tile free to follow M.

Imports: torch, Triton, then 01 (table_slots, the host twin of `_slot`; cpu_threads) at module
level; no model.

CPU: TRITON_INTERPRET=1 (set here when there is no CUDA) runs the same kernels in numpy. Its traps:
bf16 `tl.dot` is garbage (operands are cast to fp32 when interpreting) and fp32->bf16 casts
truncate.

Benchmark: `--bench` times both kernels on a GPU against flash-attn (paged decode, varlen prefill)
and PyTorch SDPA on the same data (tests/bench_04.py); the configs below were tuned that way, the
README keeps the figures.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import math
import os
import runpy
import sys

import torch

NEEDS_TRITON = ("04_triton_token_attn needs Triton, which has wheels for Linux only (pip install -r requirements.txt "
                "on Linux); the model, the CLI and lessons 01-03, 05, 06 run without it")
if not torch.cuda.is_available():
    # before triton.jit runs below: the interpreter is picked at decoration time
    os.environ.setdefault("TRITON_INTERPRET", "1")
try:
    import triton
    import triton.language as tl
except ImportError:
    # macOS, Windows: one line, not a traceback (the engine then runs its PyTorch paths)
    if __name__ == "__main__":
        sys.exit(f"error: {NEEDS_TRITON}")
    raise ImportError(NEEDS_TRITON) from None

L01 = importlib.import_module("01_kv_cache")  # table_slots: the host twin of the kernels' _slot

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
LOG2E = 1.4426950408889634  # the kernels' softmax runs in exp2: scores are scaled by log2(e)
GDC = tl.constexpr(not INTERPRET)


# ======== THE IDEA, 1: decode -- flash-decoding, one query per request, split over the context ====

@triton.jit
def pdl_launch_next(PDL: tl.constexpr):
    """Programmatic dependent launch (PDL): the next kernel in the stream may start launching now."""
    if PDL and GDC:  # grid dependency control exists only in compiled kernels
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """PDL: wait until the previous kernel has finished and its writes are visible."""
    if PDL and GDC:
        tl.extra.cuda.gdc_wait()


@triton.jit
def _chunk(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Tokens per split, tile-aligned (one ragged tile); splits from cdiv(seq_len, chunk) on hold none."""
    return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def _slot(R2T, row, s_r2t, n, nmask, page, CACHE: tl.constexpr):
    """The pool slot of token n of table row `row` (int64), read where nmask (None: everywhere).
    Page 1: 03's req_to_token holds slots; page P: 02's block table holds blocks of P slots, slot =
    table[n // P] * P + n % P (01's contiguous row: one page of max_len). One kernel for all three
    backends: `page` is an argument, not a constexpr, so all page sizes share a compilation, and
    Triton compiles an int argument equal to 1 as the constant 1: `n // 1`, `n % 1` fold away."""
    if nmask is None:
        entry = tl.load(R2T + row * s_r2t + n // page, cache_modifier=CACHE).to(tl.int64)
    else:
        entry = tl.load(R2T + row * s_r2t + n // page, mask=nmask, other=0, cache_modifier=CACHE).to(tl.int64)
    return entry * page + n % page


@triton.jit
def _kv_tile(K, V, R2T, row, s_r2t, n, nmask, kvmask, s_ks, s_vs, kvh, HEAD_DIM: tl.constexpr,
             CACHE: tl.constexpr, page):
    """K and V rows (BLOCK_N, HEAD_DIM) of kv head kvh for tokens n of table row `row`, read where
    kvmask; CACHE: the loads' cache modifier. Masks None: a whole tile, nothing to check."""
    offs_d = tl.arange(0, HEAD_DIM)
    slot = _slot(R2T, row, s_r2t, n, nmask, page, CACHE)  # (BLOCK_N,)
    if nmask is None:
        k = tl.load(K + slot[:, None] * s_ks + kvh * HEAD_DIM + offs_d[None, :], cache_modifier=CACHE)
        v = tl.load(V + slot[:, None] * s_vs + kvh * HEAD_DIM + offs_d[None, :], cache_modifier=CACHE)
    else:
        k = tl.load(K + slot[:, None] * s_ks + kvh * HEAD_DIM + offs_d[None, :],
                    mask=kvmask[:, None], other=0.0, cache_modifier=CACHE)
        v = tl.load(V + slot[:, None] * s_vs + kvh * HEAD_DIM + offs_d[None, :],
                    mask=kvmask[:, None], other=0.0, cache_modifier=CACHE)
    return k, v


@triton.jit
def _attend(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_F32: tl.constexpr, PREC: tl.constexpr):
    """One K/V tile into the running (max, sum, output) of the online softmax; visible: which
    (query, key) pairs count, (1, BLOCK_N) or (rows, BLOCK_N), or None: all of them (no mask to
    compute)."""
    if DOT_F32:
        k, v = k.to(tl.float32), v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # (BLOCK_H, BLOCK_N) in log2 units
    if visible is not None:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_splits"])  # one compiled kernel for every split count
def _stage1(Q, K, V, R2T, ROWS, LENS, MID, OUT, qk_scale, num_splits, s_q, s_ks, s_vs, s_r2t, page,
            GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
            BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr,
            PDL: tl.constexpr = False):
    # head fastest: neighbours share slots
    kvh, split, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # programmatic dependent launch (see token_decode_attention): start the next kernel
    pdl_launch_next(PDL)
    # q heads; out (batch, H, HEAD_DIM) contiguous, like MID's two parts; q's rows s_q apart
    H = tl.num_programs(0) * GROUP
    # .cg (L2, the coherent level): PDL reads these early
    seq_len = tl.load(LENS + b, cache_modifier=".cg")
    row = tl.load(ROWS + b, cache_modifier=".cg").to(tl.int64)
    chunk = _chunk(seq_len, num_splits, BLOCK_N)
    start = split * chunk
    if start >= seq_len:
        # an empty split (a short request): stage 2 counts only the splits that hold tokens
        return
    end = tl.minimum(start + chunk, seq_len)
    offs_h, offs_d, offs_n = tl.arange(0, BLOCK_H), tl.arange(0, HEAD_DIM), tl.arange(0, BLOCK_N)
    # (batch, head) rows of this kv head's query group; >= GROUP: padding
    heads = b * H + kvh * GROUP + offs_h
    hmask = offs_h < GROUP
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_H], tl.float32)                 # running sum of exp2
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)       # (BLOCK_H, HEAD_DIM) unnormalised output
    n = start + offs_n
    nmask = n < end
    if PDL:
        # the first tile before the wait: all but the
        # newest token, which the kernel we wait for writes
        k, v = _kv_tile(K, V, R2T, row, s_r2t, n, nmask, nmask & (n < seq_len - 1), s_ks, s_vs, kvh,
                        HEAD_DIM, ".cg", page)
    pdl_wait(PDL)  # the previous kernel has finished and its writes (q, the newest K/V) are visible
    q_at = Q + b.to(tl.int64) * s_q + (kvh * GROUP + offs_h)[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(q_at, mask=hmask[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    if PDL:
        new = (n == seq_len - 1)[:, None]
        last = _slot(R2T, row, s_r2t, seq_len - 1, None, page, "")
        k = tl.where(new, tl.load(K + last * s_ks + kvh * HEAD_DIM + offs_d)[None, :], k)
        v = tl.where(new, tl.load(V + last * s_vs + kvh * HEAD_DIM + offs_d)[None, :], v)
        m_i, l_i, acc = _attend(q, k, v, nmask[None, :], m_i, l_i, acc, qk_scale, DOT_F32, PREC)
    for n0 in range(start + BLOCK_N if PDL else start, end, BLOCK_N):
        n = n0 + offs_n
        nmask = n < end
        k, v = _kv_tile(K, V, R2T, row, s_r2t, n, nmask, nmask, s_ks, s_vs, kvh, HEAD_DIM, "", page)
        m_i, l_i, acc = _attend(q, k, v, nmask[None, :], m_i, l_i, acc, qk_scale, DOT_F32, PREC)
    out = acc / l_i[:, None]
    if DIRECT:  # one split, nothing to merge: write the answer
        tl.store(OUT + heads[:, None] * HEAD_DIM + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=hmask[:, None])
    else:
        # MID = partial outputs (batch, H, num_splits,
        # HEAD_DIM), then their lse (batch, H, num_splits)
        mid = heads * num_splits + split
        tl.store(MID + mid[:, None] * HEAD_DIM + offs_d[None, :], out, mask=hmask[:, None])
        tl.store(MID + tl.num_programs(2) * H * num_splits * HEAD_DIM + mid, m_i + tl.log2(l_i), mask=hmask)


@triton.jit(do_not_specialize=["num_splits"])
def _stage2(MID, OUT, LENS, num_splits, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
            BLOCK_N: tl.constexpr, PDL: tl.constexpr = False):
    h, b = tl.program_id(0), tl.program_id(1)
    pdl_launch_next(PDL)
    offs_s, offs_d = tl.arange(0, BLOCK_S), tl.arange(0, HEAD_DIM)
    seq_len = tl.load(LENS + b, cache_modifier=".cg")  # under PDL before the wait, as in stage 1
    # the splits that hold tokens
    smask = offs_s < tl.cdiv(seq_len, _chunk(seq_len, num_splits, BLOCK_N))
    pdl_wait(PDL)
    mid = (b * tl.num_programs(0) + h) * num_splits + offs_s  # (BLOCK_S,)
    lse = tl.load(MID + tl.num_programs(1) * tl.num_programs(0) * num_splits * HEAD_DIM + mid,
                  mask=smask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # split 0 always holds tokens, so the max is finite
    o = tl.load(MID + mid[:, None] * HEAD_DIM + offs_d[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(OUT + (b * tl.num_programs(0) + h) * HEAD_DIM + offs_d, out.to(OUT.dtype.element_ty))


@functools.lru_cache(maxsize=None)
def num_sms(device) -> int:
    """The device's SM count; on the CPU an H200's, so the interpreter runs the split counts a GPU would."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def pdl_kw(pdl: bool) -> dict:
    return dict(PDL=True, launch_pdl=True) if pdl else {}


# split-kernel programs an SM holds at once (smem-bound), shortest chunk worth a program
RESIDENT, MIN_CHUNK = 4, 64


def choose_num_splits(batch: int, n_kv_heads: int, max_len: int, sms: int) -> int:
    """1 when every SM already streams a (request, kv head); else one wave of resident programs, chunks >= 64."""
    programs = batch * n_kv_heads
    if programs >= sms:
        return 1  # no partials to write and merge, one launch
    return max(1, min(RESIDENT * sms // programs, triton.cdiv(max_len, MIN_CHUNK), 128))


# tuned on an H200: long chunks like big tiles, split ones 64-token tiles (4-5 programs per SM)
UNSPLIT_CONFIG = dict(block_n=128, num_warps=4, num_stages=2)
SPLIT_CONFIG = dict(block_n=64, num_warps=4, num_stages=2)
# fp32 (the exact checks: tokens equal transformers'): an fp32 `tl.dot` is unrolled into FMAs per
# thread, and at the tiles above ptxas took 4 s (decode) and 40 s (extend) per kernel; these compile
# in about a second
F32_CONFIG = dict(decode=dict(block_n=32, num_warps=4, num_stages=1),
                  extend=dict(rows=32, block_n=32, num_warps=4, num_stages=1))


def token_decode_attention(q, k_pool, v_pool, req_to_token, req_rows, seq_lens, num_splits=None,
                           sm_scale=None, out=None, pdl=False, page=1, **config):
    """out[b] = softmax(q[b] K_b^T * sm_scale) V_b with K_b, V_b = pool[req_to_token[req_rows[b],
    :seq_lens[b]]]; page > 1: req_to_token is a block table of `page`-slot pages (02's pool; 01's
    rows are one page each).

    q (batch, n_q_heads, head_dim); k_pool, v_pool (num_slots, n_kv_heads, head_dim) of one layer,
    each slot's row contiguous; req_to_token (max_requests, width) int32/int64; req_rows, seq_lens
    (batch,) ints (tensors on q's device avoid copies), every seq_len >= 1. Returns (batch,
    n_q_heads, head_dim) in q's dtype, in `out` if given. num_splits=None picks one from batch and
    the longest seq_len, or req_to_token's width when seq_lens are on the device (reading them would
    sync). `config` overrides UNSPLIT_CONFIG / SPLIT_CONFIG. pdl (GPU, the engine's fused batch-1
    decode): programmatic dependent launch, each kernel lets the next start. Stage 1 then reads
    lengths, slots and its first K/V tile, all but the newest token, before it waits; so the kernel
    before it (which writes q and that token) must let it start only after its own wait."""
    (B, H, D), Hkv = q.shape, k_pool.shape[1]
    # the checks: shapes, and every length >= 1 where the lengths are on the host
    if (v_pool.shape != k_pool.shape or k_pool.shape[2] != D or H % Hkv or D < 16 or D & (D - 1)
            or k_pool.stride()[1:] != (D, 1) or v_pool.stride()[1:] != (D, 1)):
        shapes = f"q {tuple(q.shape)}, k_pool {tuple(k_pool.shape)}, v_pool {tuple(v_pool.shape)}"
        raise ValueError(f"bad shapes: {shapes} (need n_q_heads % n_kv_heads == 0, a power-of-two "
                         "head_dim >= 16, contiguous slots)")
    if not torch.is_tensor(seq_lens) or seq_lens.device.type == "cpu":
        # cheap to check and read on the host
        seq_lens = torch.as_tensor(seq_lens)
        if seq_lens.numel() and int(seq_lens.min()) < 1:
            raise ValueError("every seq_len must be >= 1 (the new token is already in the pool)")
        max_len = int(seq_lens.max()) if seq_lens.numel() else 1
    else:
        max_len = req_to_token.shape[1] * page  # an upper bound: reading a device tensor would sync
    # on q's device (as_tensor: no copy where they are)
    req_rows, seq_lens = (torch.as_tensor(x, device=q.device) for x in (req_rows, seq_lens))
    if req_rows.shape != (B,) or seq_lens.shape != (B,):
        got = f"{tuple(req_rows.shape)}, {tuple(seq_lens.shape)}"
        raise ValueError(f"req_rows, seq_lens need shape ({B},), got {got}")
    num_splits = num_splits or choose_num_splits(B, Hkv, max_len, num_sms(q.device))
    f32 = INTERPRET or q.dtype == torch.float32
    tuned = SPLIT_CONFIG if num_splits > 1 else UNSPLIT_CONFIG
    cfg = config or (F32_CONFIG["decode"] if f32 and not INTERPRET else tuned)
    # no copies when they already are: q's heads side by side (its rows may be a view's)
    q = q if q.stride()[1:] == (D, 1) else q.contiguous()
    r2t = req_to_token.contiguous()
    if out is None:
        out = q.new_empty(q.shape)  # (batch, n_q_heads, head_dim)
    elif out.shape != q.shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(q.shape)} tensor")
    # one fp32 buffer: partial outputs (B, H, splits, D), then their log2-sum-exp2 (B, H, splits)
    mid = out
    if num_splits > 1:
        mid = torch.empty(B * H * num_splits * (D + 1), dtype=torch.float32, device=q.device)
        if INTERPRET:  # NaN under the interpreter, so tests catch a partial nobody wrote
            mid.fill_(float("nan"))
    # fold in log2(e): exp2 is cheap
    scale = (sm_scale if sm_scale is not None else D ** -0.5) * LOG2E
    _stage1[(Hkv, num_splits, B)](
        q, k_pool, v_pool, r2t, req_rows, seq_lens, mid, out, scale, num_splits, q.stride(0),
        k_pool.stride(0), v_pool.stride(0), r2t.stride(0), page,
        GROUP=H // Hkv, BLOCK_H=max(16, triton.next_power_of_2(H // Hkv)), HEAD_DIM=D,
        BLOCK_N=cfg["block_n"], DIRECT=num_splits == 1, DOT_F32=f32, PREC="ieee" if f32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_kw(pdl))
    if num_splits > 1:
        _stage2[(H, B)](mid, out, seq_lens, num_splits, HEAD_DIM=D,
                        BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_N=cfg["block_n"],
                        num_warps=4 if num_splits <= 64 else 8, **pdl_kw(pdl))
    return out


# ======== THE IDEA, 2: prefill (extend) -- many new tokens per request, over a cached prefix ======
# A prefill step feeds each request its new tokens: a whole prompt, or only the suffix after a radix
# hit (05). Query i of request b sits at position prefix_b + i and sees every key at positions <=
# its own. The new tokens' K/V are already in the pool (attend() writes them first), so everything
# is read through req_to_token, as in decode, and the prefix is never copied out. Many queries per
# request make attention matrix x matrix: compute-bound, the regime flash-attention's tiling was
# made for.
#
#     program (row block j, kv head h):  BLOCK_R rows of one request's (new token, query head of h's group)
#                                        pairs: one Q tile loads each K/V tile once for the group, no padding
#     phase 1, keys before the block's first query: all visible, whole tiles without a mask
#     phase 2, the diagonal, up to the block's last query:  the causal mask  key <= query
#     online softmax across both phases (running max, sum, output), as in decode's stage 1
#
#         keys ->   |<------------- phase 1: no mask ------------->|<-- phase 2 -->|
#     block j rows  | prefix (cached)      | new tokens before j   | \  causal     |
#
# All requests' blocks go in one launch: the host lists (request, first row) pairs from the
# new-token counts it already knows, so no device lengths are read to size the grid.

@triton.jit
def _extend(Q, K, V, R2T, ROWS, PREFIX, EXTEND, QSTART, BLOCKS, OUT, qk_scale, s_q, s_ks, s_vs, s_r2t,
            page, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
            BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr,
            DECODE: tl.constexpr = False):
    j, kvh = tl.program_id(0), tl.program_id(1)
    H = tl.num_programs(1) * GROUP
    if DECODE:  # one new token per request b, after PREFIX[b] - 1 cached (PREFIX: the lengths)
        per = (GROUP + BLOCK_R - 1) // BLOCK_R  # blocks per token
        b, r0 = j // per, j % per * BLOCK_R
        prefix, n_new, q0 = tl.load(PREFIX + b) - 1, 1, b
    else:  # this block: request b, its rows r0..; q0: b's first token in the ragged batch
        b, r0 = tl.load(BLOCKS + 2 * j), tl.load(BLOCKS + 2 * j + 1)
        prefix, n_new, q0 = tl.load(PREFIX + b), tl.load(EXTEND + b), tl.load(QSTART + b)
    row = tl.load(ROWS + b).to(tl.int64)
    offs_r, offs_d, offs_n = tl.arange(0, BLOCK_R), tl.arange(0, HEAD_DIM), tl.arange(0, BLOCK_N)
    # (R,) row -> new token, head in the group
    tok, g = (r0 + offs_r) // GROUP, (r0 + offs_r) % GROUP
    rmask = tok < n_new
    # (R,) row of q / out viewed (T * H, D)
    qrow = (q0 + tok).to(tl.int64) * H + kvh * GROUP + g
    # q may be a view (s_q: its token stride), out is contiguous
    q_at = Q + (q0 + tok).to(tl.int64)[:, None] * s_q + (kvh * GROUP + g)[:, None] * HEAD_DIM
    q = tl.load(q_at + offs_d[None, :], mask=rmask[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    pos = prefix + tok                                              # (R,) each query's position
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], tl.float32)
    # keys < lo: visible to every row here
    lo = prefix + r0 // GROUP
    # one past the block's last query
    hi = prefix + tl.minimum((r0 + BLOCK_R - 1) // GROUP + 1, n_new)
    lo_full = lo - lo % BLOCK_N
    for n0 in range(0, lo_full, BLOCK_N):
        # phase 1: whole tiles, nothing masked
        k, v = _kv_tile(K, V, R2T, row, s_r2t, n0 + offs_n, None, None, s_ks, s_vs, kvh, HEAD_DIM, "", page)
        m_i, l_i, acc = _attend(q, k, v, None, m_i, l_i, acc, qk_scale, DOT_F32, PREC)
    for n0 in range(lo_full, hi, BLOCK_N):
        # phase 2: the rest of phase 1, then the diagonal
        n = n0 + offs_n
        k, v = _kv_tile(K, V, R2T, row, s_r2t, n, n < hi, n < hi, s_ks, s_vs, kvh, HEAD_DIM, "", page)
        m_i, l_i, acc = _attend(q, k, v, n[None, :] <= pos[:, None], m_i, l_i, acc, qk_scale, DOT_F32, PREC)
    # every query sees itself: l_i > 0
    out = acc / l_i[:, None]
    tl.store(OUT + qrow[:, None] * HEAD_DIM + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=rmask[:, None])


# Per head_dim; rows = BLOCK_R (new token, query head) pairs per program. Tuned on an H100 (bf16)
# over rows, BLOCK_N, warps and stages by the worst ratio to flash_attn_varlen_func on
# tests/bench_04.py's EXTEND_SHAPES, timed in one call.
EXTEND_CONFIG = {128: dict(rows=128, block_n=32, num_warps=4, num_stages=3),
                 64: dict(rows=128, block_n=64, num_warps=4, num_stages=3)}

_plan = {}  # the last step's host table on the device: every layer of a step reuses it


def extend_plan(prefix_lens, extend_lens, group: int, rows: int, device):
    """(blocks, prefix, extend, q_start) on the device for one ragged batch: blocks lists (request,
    first row) pairs, rows counted over (new token, head in its group); once a step, all layers."""
    key = (tuple(prefix_lens), tuple(extend_lens), group, rows, device)
    if key not in _plan:
        prefix, extend = (torch.tensor(x, dtype=torch.int32) for x in key[:2])  # (B,) each
        blocks = torch.tensor([(b, r) for b, n in enumerate(key[1]) for r in range(0, n * group, rows)],
                              dtype=torch.int32).flatten()                      # (num_blocks * 2,)
        q_start = extend.cumsum(0, dtype=torch.int32) - extend  # (B,) first token of each request
        _plan.clear()
        # copies that wait for no queued GPU work
        _plan[key] = [L01.to_device(x, device) for x in (blocks, prefix, extend, q_start)]
    return _plan[key]


def token_extend_attention(q, k_pool, v_pool, req_to_token, req_rows, prefix_lens, extend_lens,
                           sm_scale=None, out=None, page=1, **config):
    """Prefill attention over the token pool: out[t] = softmax(q[t] K^T * scale) V over request b's
    keys at positions <= the query's. q (T, n_q_heads, head_dim): a ragged batch, request after
    request, T = sum(extend_lens); k_pool, v_pool, req_rows, page as in token_decode_attention, the
    new tokens' K/V already at req_to_token[row, prefix:prefix + extend]; prefix_lens, extend_lens
    (B,) host ints (they size the grid). Returns (T, n_q_heads, head_dim), q's dtype."""
    (T, H, D), Hkv = q.shape, k_pool.shape[1]
    prefix_lens, extend_lens = ([int(n) for n in x] for x in (prefix_lens, extend_lens))
    if (v_pool.shape != k_pool.shape or k_pool.shape[2] != D or H % Hkv or D < 16 or D & (D - 1)
            or sum(extend_lens) != T or min(extend_lens, default=0) < 1 or min(prefix_lens, default=0) < 0):
        raise ValueError(f"bad shapes: q {tuple(q.shape)}, k_pool {tuple(k_pool.shape)}, extend_lens "
                         f"{extend_lens} (need sum(extend_lens) == T, each >= 1, a power-of-two head_dim)")
    f32 = INTERPRET or q.dtype == torch.float32
    tiles = EXTEND_CONFIG.get(D, EXTEND_CONFIG[64 if D < 128 else 128])
    cfg = {**(F32_CONFIG["extend"] if f32 and not INTERPRET else tiles), **config}
    blocks, prefix, extend, q_start = extend_plan(prefix_lens, extend_lens, H // Hkv, cfg["rows"], q.device)
    # (T, n_q_heads, head_dim), contiguous whatever q's strides
    out = q.new_empty(q.shape) if out is None else out
    scale = (sm_scale if sm_scale is not None else D ** -0.5) * LOG2E
    q = q if q.stride()[1:] == (D, 1) else q.contiguous()  # a token's heads side by side
    _extend[(len(blocks) // 2, Hkv)](
        q, k_pool, v_pool, req_to_token,
        torch.as_tensor(req_rows).to(q.device, non_blocking=True), prefix, extend, q_start, blocks,
        out, scale, q.stride(0), k_pool.stride(0), v_pool.stride(0), req_to_token.stride(0), page,
        GROUP=H // Hkv, HEAD_DIM=D, BLOCK_R=cfg["rows"], BLOCK_N=cfg["block_n"], DOT_F32=f32,
        PREC="ieee" if f32 else "tf32", num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


# ======== THE IDEA, 3: the same answer whatever the batch (deterministic mode) ====================
# Greedy decoding should give one answer per prompt, yet in bf16 an answer changes with whatever
# else is in the batch (SmolLM2 on an H200: 5 of 32 answers the same alone and in a batch of 32;
# README). Not concurrency but batch variance (Thinking Machines, "Defeating Nondeterminism in LLM
# Inference"): float addition is not associative, and each kernel picks its reduction order from
# the shapes of its call, not from the row:
#
#     matmul     cuBLAS picks a tile and split-K from M (the step's tokens): K summed in other
#                pieces
#     decode     choose_num_splits picks the split count from batch x kv heads: another split
#                point in a request's keys, other partials merged by stage 2
#     prefill    a cached or chunked prompt's query runs another kernel (decode's, or extend with
#                its rows in other blocks) than the same query in the whole prompt
#
# Deterministic mode (FastEngine(deterministic=True); SGLang's --enable-deterministic-inference, vLLM's
# VLLM_BATCH_INVARIANT=1) makes each order a function of the row alone:
#
#     attention  every query, prefill or decode, through `_extend` with one key tile: its keys
#                reduce in BLOCK_N tiles from key 0, in order (a fixed split SIZE, not a split
#                count); rows per program are free (16 for decode, 128 for prefill)
#     matmul     `_matmul`: the whole K in one program, in order; the tile follows M (16 rows at
#                decode's batch 1, 128 for a prefill): which rows and columns share a program
#                never moves a row's sum, only how K is cut would
#
#     the keys of a query at position 150 (8 kv heads, 132 SMs):
#         default, batch 1:   3 splits |0..63|64..127|128..150|, stage 2 merges them
#         default, batch 64:  1 split, 128-key tiles |0..127|128..150|
#         deterministic:      |0..63|64..127|128..150| in order, one program, whatever the batch
#
# The pointwise kernels (APPENDIX) were invariant already: one program per row. What it costs is in
# the README (tests/bench_engine.py deterministic).

# The tile follows M, the K tile stays: a row's sum is the chain acc += A[:, k:k+16] W[k:k+16] over
# K in order, whatever BLOCK_M and BLOCK_N (which rows and columns share a program) and however many
# programs run; only how K is cut into products would move it. Checked per shape on a GPU
# (tests/test_deterministic.py, M = 1 to 1,024). (top M, (block_m, block_n, block_k, warps,
# stages)); block_n then halves until the tiles fill the SMs (narrow outputs such as wo's at M = 1).
MATMUL_TILES = {torch.bfloat16: [(16, (16, 64, 256, 4, 5)), (64, (64, 32, 128, 4, 4)),
                                 (256, (64, 64, 64, 4, 4)), (None, (128, 128, 64, 8, 3))],
                torch.float32: [(None, (32, 32, 32, 4, 1))]}  # fp32's small tiles compile fast
MATMUL_TILES[torch.float16] = MATMUL_TILES[torch.bfloat16]


def matmul_tiles(M: int, N: int, dtype, sms: int, glu=False) -> tuple:
    """(block_m, block_n, block_k, warps, stages) of an (M, K) x (K, N) product (glu: 2 W tiles)."""
    bm, bn, bk, warps, stages = next(t for top, t in MATMUL_TILES[dtype] if top is None or M <= top)
    while bn > 16 and triton.cdiv(M, bm) * triton.cdiv(N, bn) < sms // 2:
        bn //= 2
    while stages > 2 and (bm + bn * (1 + glu)) * bk * 2 * stages > 200_000:  # shared memory
        stages -= 1
    return bm, bn, bk, warps, stages


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every M
def _matmul(A, W, C, M, N, K, s_am, s_wn, s_cm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, GROUP: tl.constexpr, GLU: tl.constexpr, DOT_F32: tl.constexpr,
            PREC: tl.constexpr):
    pid, grid_n, grid_m = tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(M, BLOCK_M)
    first = pid // (GROUP * grid_n) * GROUP  # GROUP row blocks walk the columns together (L2 reuse)
    rows = tl.minimum(grid_m - first, GROUP)
    pid_m, pid_n = first + pid % rows, pid % (GROUP * grid_n) // rows
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # GLU: W's rows N.. (w3), the same chain
    for k0 in range(0, K, BLOCK_K):  # the whole K here, in order: no split-K
        k = k0 + offs_k
        in_k = k[None, :] < K
        a = tl.load(A + offs_m[:, None] * s_am + k[None, :], mask=(offs_m[:, None] < M) & in_k,
                    other=0.0)
        w_at = W + offs_n[:, None] * s_wn + k[None, :]
        w = tl.load(w_at, mask=(offs_n[:, None] < N) & in_k, other=0.0)
        if DOT_F32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PREC)
        if GLU:
            w = tl.load(w_at + N * s_wn, mask=(offs_n[:, None] < N) & in_k, other=0.0)
            up = tl.dot(a, tl.trans(w.to(a.dtype)), up, input_precision=PREC)
    out = acc.to(C.dtype.element_ty)
    if GLU:  # _swiglu's arithmetic on the two products as rounded: the same bits as unfused
        g = out.to(tl.float32)
        out = (g * tl.sigmoid(g)).to(C.dtype.element_ty) * up.to(C.dtype.element_ty)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(C + offs_m[:, None] * s_cm + offs_n[None, :], out, mask=mask)


def invariant_matmul(x, w, glu=False):
    """F.linear(x, w) (x (..., K), w (N, K)), each row's bits whatever M and the other rows. glu:
    w stacks (w1; w3), and the result is the model's swiglu of the two halves, in one kernel."""
    shape, x = x.shape, x.reshape(-1, x.shape[-1])
    x = x if x.stride(-1) == 1 else x.contiguous()
    (M, K), N = x.shape, w.shape[0] // (2 if glu else 1)
    bm, bn, bk, warps, stages = matmul_tiles(M, N, x.dtype, num_sms(x.device), glu)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    f32 = INTERPRET or x.dtype == torch.float32
    if M:
        _matmul[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](
            x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0), BLOCK_M=bm, BLOCK_N=bn,
            BLOCK_K=bk, GROUP=8, GLU=glu, DOT_F32=f32, PREC="ieee" if f32 else "tf32",
            num_warps=warps, num_stages=stages)
    return out.view(*shape[:-1], N)


def invariant_swiglu(x, w13):
    """The model's swiglu(*F.linear(x, w13).chunk(2, -1)), batch-invariant, in one kernel."""
    return invariant_matmul(x, w13, glu=True)


# `_extend`'s configuration in the mode. Only block_n (the key tile) is the reduction's: a row's
# softmax runs over key tiles [0, block_n), [block_n, 2 block_n), ... whatever rows share its
# program (a tile past its position adds exact zeros), as BLOCK_M is free for the matmul. So
# decode holds 16 rows a program (a token's G heads), prefill 128 (fp32: one small tile for both).
DETERMINISTIC_CONFIG = {torch.bfloat16: dict(rows=16, block_n=128, num_warps=4, num_stages=2),
                        torch.float16: dict(rows=16, block_n=128, num_warps=4, num_stages=2),
                        torch.float32: dict(rows=16, block_n=32, num_warps=4, num_stages=1)}
DETERMINISTIC_PREFILL = {torch.bfloat16: dict(rows=128, num_stages=3),
                         torch.float16: dict(rows=128, num_stages=3), torch.float32: {}}


def deterministic_extend_attention(q, k_pool, v_pool, req_to_token, req_rows, prefix_lens,
                                   extend_lens, page=1):
    """token_extend_attention with DETERMINISTIC_CONFIG's key tile (01's extend_attn, the mode)."""
    cfg = {**DETERMINISTIC_CONFIG[q.dtype], **DETERMINISTIC_PREFILL[q.dtype]}
    return token_extend_attention(q, k_pool, v_pool, req_to_token, req_rows, prefix_lens,
                                  extend_lens, page=page, **cfg)


def deterministic_decode_attention(q, k_pool, v_pool, req_to_token, req_rows, seq_lens, page=1):
    """A decode step through `_extend` (01's decode_attn in deterministic mode): one new token per
    request after seq_len - 1 cached ones, so the same bits as that query in a prefill. The kernel
    reads its blocks from seq_lens on the device (DECODE): no plan, so a CUDA graph holds it."""
    (B, H, D), Hkv = q.shape, k_pool.shape[1]
    cfg, dev = DETERMINISTIC_CONFIG[q.dtype], q.device
    lens, out = torch.as_tensor(seq_lens, device=dev), q.new_empty(q.shape)
    f32 = INTERPRET or q.dtype == torch.float32
    q = q if q.stride()[1:] == (D, 1) else q.contiguous()  # a token's heads side by side
    _extend[(B * triton.cdiv(H // Hkv, cfg["rows"]), Hkv)](
        q, k_pool, v_pool, req_to_token, torch.as_tensor(req_rows, device=dev), lens,
        lens, lens, lens, out, D ** -0.5 * LOG2E, q.stride(0), k_pool.stride(0), v_pool.stride(0),
        req_to_token.stride(0), page, GROUP=H // Hkv, HEAD_DIM=D, BLOCK_R=cfg["rows"],
        BLOCK_N=cfg["block_n"], DOT_F32=f32, PREC="ieee" if f32 else "tf32", DECODE=True,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


# ======== DEMO: float64 references through the same table, the check, the command line ============
# -------- float64 references, random problems, the check ------------------------------------------
def reference_decode_attention(q, k_pool, v_pool, req_to_token, req_rows, seq_lens, sm_scale=None, page=1):
    """Float64 ground truth for decode: one new token per request, i.e. extend over seq_len - 1 cached tokens."""
    return reference_extend_attention(q, k_pool, v_pool, req_to_token, req_rows,
                                      [int(n) - 1 for n in seq_lens], [1] * len(q), sm_scale, page)


def reference_extend_attention(q, k_pool, v_pool, req_to_token, req_rows, prefix_lens, extend_lens,
                               sm_scale=None, page=1):
    """Float64, one request at a time: query i of request b attends to its keys at positions <= prefix_b + i."""
    T, H, D = q.shape
    G = H // k_pool.shape[1]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    out, t = torch.empty(T, H, D, dtype=torch.float64, device=q.device), 0
    for row, p, n in zip(torch.as_tensor(req_rows).tolist(), list(map(int, prefix_lens)), list(map(int, extend_lens))):
        slots = L01.table_slots(req_to_token, [row], p + n, page)[0]  # the host twin of _slot
        k = k_pool[slots].double().repeat_interleave(G, dim=1)                  # (p + n, H, D)
        v = v_pool[slots].double().repeat_interleave(G, dim=1)
        s = torch.einsum("thd,lhd->htl", q[t:t + n].double(), k) * scale       # (H, n, p + n)
        visible = torch.arange(p + n, device=q.device)[None, :] <= (p + torch.arange(n, device=q.device))[:, None]
        out[t:t + n] = torch.einsum("htl,lhd->thd", s.masked_fill(~visible, float("-inf")).softmax(-1), v)
        t += n
    return out


def make_problem(seq_lens, n_q_heads=4, n_kv_heads=2, head_dim=64, dtype=torch.float32,
                 device="cpu", scattered=True, seed=0):
    """Random decode step over a pool: each request's tokens at random slots (or in one contiguous
    run). Unused slots hold NaN and unused req_to_token entries point at one, so reading past a
    request poisons it. Returns (q, k_pool, v_pool, req_to_token, req_rows, seq_lens) on device."""
    g = torch.Generator(device).manual_seed(seed)
    kw = dict(device=device, dtype=dtype)
    B, total, Hkv, D = len(seq_lens), int(sum(seq_lens)), n_kv_heads, head_dim
    num_slots = total + 16
    perm = torch.randperm(num_slots, generator=g, device=device)
    slots = perm[:total] if scattered else torch.arange(7, 7 + total, device=device)
    nan_slot = int(perm[total]) if scattered else 0
    # (num_slots, n_kv_heads, head_dim)
    k_pool, v_pool = (torch.full((num_slots, Hkv, D), float("nan"), **kw) for _ in range(2))
    k_pool[slots] = torch.randn(total, Hkv, D, generator=g, **kw)
    v_pool[slots] = torch.randn(total, Hkv, D, generator=g, **kw)
    req_to_token = torch.full((B + 3, max(seq_lens) + 5), nan_slot, dtype=torch.int32, device=device)
    # requests sit in arbitrary rows
    req_rows = torch.randperm(B + 3, generator=g, device=device)[:B]
    start = 0
    for r, n in zip(req_rows.tolist(), seq_lens):
        req_to_token[r, :n] = slots[start:start + n].int()
        start += n
    q = torch.randn(B, n_q_heads, D, generator=g, **kw)  # (batch, n_q_heads, head_dim)
    return q, k_pool, v_pool, req_to_token, req_rows, torch.tensor(seq_lens, dtype=torch.int32, device=device)


def paged_problem(problem, page: int, seed: int = 0):
    """The same problem (make_problem's, or the tests' extend ones), each request's table row
    copied to random pages of `page` slots: 02's block table (one page of max_len: 01's rows).
    Unused pages hold NaN, unused entries point at one; the tuple with pools and table replaced."""
    q, k_pool, v_pool, r2t, rows = problem[:5]
    g = torch.Generator(k_pool.device).manual_seed(seed)
    width, dev = -(-r2t.shape[1] // page), k_pool.device
    pages = torch.randperm(len(rows) * width + 3, generator=g, device=dev)
    kp = torch.full((len(pages) * page, *k_pool.shape[1:]), float("nan"), dtype=k_pool.dtype, device=dev)
    # (num_pages * page, n_kv_heads, head_dim)
    vp = torch.full_like(kp, float("nan"))
    table = torch.full((r2t.shape[0], width), int(pages[-1]), dtype=torch.int32, device=dev)
    for i, r in enumerate(rows.tolist()):
        table[r] = pages[i * width:(i + 1) * width].int()
        # token j of row r moves from r2t[r, j] to here
        slots = L01.table_slots(table, [r], r2t.shape[1], page)[0]
        kp[slots], vp[slots] = k_pool[r2t[r].long()], v_pool[r2t[r].long()]
    return (q, kp, vp, table, *problem[4:])


def rel_err(out, ref) -> float:
    # NaN anywhere gives NaN, which fails every check
    return float((out.double() - ref).norm() / ref.norm())


# norm-wise, vs float64
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
# (n_q_heads, n_kv_heads, head_dim): SmolLM2's GQA 3, and GQA 4 at d=128
CHECKS = [(9, 3, 64), (8, 2, 128)]


def check(device, lens=(1, 2, 15, 16, 17, 300)):
    """The CLI's lesson: both kernels vs the float64 references for each dtype, on scattered slots."""
    rows = []
    for dtype in TOLERANCE:
        for H, Hkv, D in CHECKS:
            P = make_problem(list(lens), H, Hkv, D, dtype, device, seed=len(rows))
            splits = choose_num_splits(len(lens), Hkv, max(lens), num_sms(torch.device(device)))
            decode_err = rel_err(token_decode_attention(*P, num_splits=splits), reference_decode_attention(*P))
            # a prompt, a decode-like token, a suffix after a radix hit
            prefix, extend = [0, 40, 129], [33, 1, 20]
            lens = [p + n for p, n in zip(prefix, extend)]
            seed = len(rows) + 1
            _, k_pool, v_pool, r2t, req_rows, _ = make_problem(lens, H, Hkv, D, dtype, device, seed=seed)
            # (new tokens, n_q_heads, head_dim)
            q = torch.randn(sum(extend), H, D, device=device).to(dtype)
            E = (q, k_pool, v_pool, r2t, req_rows, prefix, extend)
            extend_err = rel_err(token_extend_attention(*E), reference_extend_attention(*E))
            for kernel, n, err in (("decode", splits, decode_err), ("extend", None, extend_err)):
                rows.append(dict(kernel=kernel, dtype=str(dtype).split(".")[1], n_q_heads=H,
                                 n_kv_heads=Hkv, head_dim=D, num_splits=n, rel_err=err,
                                 ok=err <= TOLERANCE[dtype]))
    return rows


def print_check(rows, name, cuda):
    """The report of check(): what was compared, why it matters, what the kernels do on a GPU."""
    print(f"""device: {name}
What is checked: the two kernels the engine runs on a GPU -- decode (one new token per request) and extend
(prefill: new tokens over a cached prefix) -- against float64 attention over the same K/V, gathered through
req_to_token. Every request's tokens sit at random slots of the pool and every other slot holds NaN, so a read
past a request's length, or through a wrong slot, turns the error into NaN. Decode is split over the context,
and the split must not change the answer. Passing means: on a GPU the engine's tokens come from this attention.
decode: lengths 1, 2, 15, 16, 17, 300; extend: new tokens 33, 1, 20 over cached prefixes 0, 40, 129""")
    for r in rows:
        split = f"splits {r['num_splits']}" if r["num_splits"] else "        "
        print(f"  {r['kernel']:>6} {r['dtype']:>8}  q heads {r['n_q_heads']:2d} / kv heads {r['n_kv_heads']}  "
              f"d={r['head_dim']:3d}  {split}  rel err {r['rel_err']:.2e} (tolerance "
              f"{TOLERANCE[getattr(torch, r['dtype'])]:g})  {'ok' if r['ok'] else 'FAIL'}")
    where = "" if cuda else " (here the Triton interpreter runs the same code in numpy, slowly)"
    print(f"""What the kernels do on a GPU{where}:
decode reads every cached K/V byte once for ~1 FLOP per byte, so its speed is memory bandwidth. One program
per (kv head, chunk of the context, request) streams its chunk's K/V once for all the query heads of its group,
keeping a running softmax; a second launch merges the chunks by their log-sum-exp. The split count fills the
SMs when batch x kv heads would leave them idle (`--bench` compares it with flash-attn on a GPU). Extend tiles
like flash-attention: whole K/V tiles before a block's first query run unmasked, only the diagonal is masked.""")


# -------- the command line (--bench: tests/bench_04.py) -------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description="Flash-decoding over a token pool: check vs float64, or --bench on GPU.")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--bench", action="store_true", help="GPU benchmark vs flash-attn and SDPA: tests/bench_04.py")
    args = ap.parse_args(argv)
    L01.cpu_threads()  # one thread on 2 cores (why: in its docstring)
    cuda = torch.cuda.is_available() and not INTERPRET
    if args.bench and not cuda:
        sys.exit("error: --bench needs a CUDA GPU (this machine runs the kernel through the Triton interpreter)")
    name = torch.cuda.get_device_name() if cuda else "CPU (TRITON_INTERPRET=1)"
    rows = check("cuda" if cuda else "cpu")
    report = dict(device=name, max_rel_err=max(r["rel_err"] for r in rows), checks=rows)
    if args.bench:
        # the kernels beside flash-attn and SDPA (they are not the lesson): tests/bench_04.py
        bench = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests", "bench_04.py"))
        report["bench"] = bench["bench"]()
        print(f"prefill (extend) kernel vs flash_attn_varlen_func, {name}, bf16:", file=sys.stderr)
        report["bench_extend"] = bench["bench_extend"]()
    if args.json:
        print(json.dumps(report))
    else:
        print_check(rows, name, cuda)
        if args.bench:
            bench["print_bench"](report["bench"], name)
    if not all(r["ok"] for r in rows):
        sys.exit("error: kernel disagrees with the float64 reference beyond tolerance")


# ======== APPENDIX: kernels the engine borrows ====================================================
# -------- the batch-1 decode step in six kernels per layer ----------------------------------------
# One token's decode step reads every weight once for 2 FLOPs per weight: a chain of matrix-vector
# products, bound by memory bandwidth. The plain model spends ~20 kernels per layer on it, and
# cuBLAS's GEMVs on small matrices stay far below the copy bandwidth. Here one program streams whole
# weight rows (1-4 per program, thousands of programs) and everything elementwise rides along in the
# same pass:
#
#   _embed      h = tok_embeddings[token]
#   _qkv_rope   xn = rms_norm(h)  ->  q, k, v rows  ->  RoPE on q, k  ->  q to a buffer, k, v into the pool slot
#   04's kernel attention over req_to_token (two launches when it splits the context)
#   _gemv       h += wo @ attn                     (residual add in the epilogue)
#   _gemv       act = silu(w1 @ xn) * (w3 @ xn)    (norm in the prologue: sum of squares in the same loop)
#   _gemv       h += w2 @ act
#
# The RMS scale is applied after the dot, (W (x * g)) * rsqrt(mean x^2 + eps), so x is read only
# once. Each kernel is a small wave with a ramp and a tail, so on a GPU every launch uses
# programmatic dependent launch (PDL): a kernel lets the next one start at once, and the next loads
# its first weight tile (weights never depend on the previous kernel) before it waits;
# CudaGraphDecoder chains k whole steps, argmax included, so. Tried on an H200 and slower: one
# persistent kernel per layer with grid barriers (a barrier cost more than a launch), L2 bulk
# prefetches instead of loads, loading the residual or the slot before the loop.


@triton.jit
def _gemv_tile(acc, acc3, ss, w, w3, X, G, cols, NORM: tl.constexpr, GLU: tl.constexpr):
    """One BLOCK_K-wide step of _gemv: x (and its sum of squares) at cols, times the weight tile(s)."""
    x = tl.load(X + cols).to(tl.float32)
    if NORM:
        ss += x * x
        x *= tl.load(G + cols).to(tl.float32)
    acc += w.to(tl.float32) * x[None, :]
    if GLU:
        acc3 += w3.to(tl.float32) * x[None, :]
    return acc, acc3, ss


@triton.jit
def _gemv(X, G, W, W3, RES, OUT, PEERS, K, eps, NORM: tl.constexpr, GLU: tl.constexpr,
          RESID: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PUSH: tl.constexpr = 0,
          PDL: tl.constexpr = False):
    """OUT[rows] = W[rows] @ xn (+ RES[rows]); xn = rms_norm(X) * G if NORM else X; GLU: silu(W xn)
    * (W3 xn). PDL: the first weight tile loads before waiting for the previous kernel. PUSH
    (tensor parallelism): the rows go to OUT on each of PUSH ranks, PEERS their addresses."""
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    ss = tl.zeros([BLOCK_K], tl.float32)
    start: tl.constexpr = BLOCK_K if PDL else 0
    if PDL:
        # the next kernel may start launching; weights do not depend on this one's inputs, x does
        pdl_launch_next(PDL)
        w = tl.load(W + rows[:, None] * K + cols[None, :])
        w3 = tl.load(W3 + rows[:, None] * K + cols[None, :]) if GLU else w
        pdl_wait(PDL)  # the previous kernel has finished and its writes are visible
        acc, acc3, ss = _gemv_tile(acc, acc3, ss, w, w3, X, G, cols, NORM, GLU)
    for k0 in range(start, K, BLOCK_K):
        w = tl.load(W + rows[:, None] * K + (k0 + cols)[None, :])
        w3 = tl.load(W3 + rows[:, None] * K + (k0 + cols)[None, :]) if GLU else w
        acc, acc3, ss = _gemv_tile(acc, acc3, ss, w, w3, X + k0, G + k0, cols, NORM, GLU)
    scale = tl.rsqrt(tl.sum(ss, 0) / K + eps) if NORM else 1.0
    y = tl.sum(acc, 1) * scale
    if GLU:
        y = y / (1 + tl.exp(-y)) * (tl.sum(acc3, 1) * scale)
    if RESID:  # OUT may be RES: each program reads its own rows before writing them
        y += tl.load(RES + rows).to(tl.float32)
    if PUSH:
        _push(PEERS, OUT, rows, y, PUSH)
    else:
        tl.store(OUT + rows, y.to(OUT.dtype.element_ty))


@triton.jit
def _qkv_rope(X, G, WQ, WK, WV, COS, SIN, POS, ROW, R2T, s_r2t, page, Q, KP, VP, K, eps, q_rows,
              kv_rows, HALF: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
              PDL: tl.constexpr = False):
    """Program p computes BLOCK_P of the row pairs (j, j + HALF) of one q, k or v head, the pairs
    RoPE rotates together: rotation and KV write need no second kernel. The slot comes from the
    table here (_slot): multi-step graphs advance pos on the device. PDL as in _gemv."""
    # the program's first pair; BLOCK_P divides HALF
    first = tl.program_id(0) * BLOCK_P
    head = (first // HALF) * 2 * HALF                   # its head's first row in [wq; wk; wv]
    j = first % HALF + tl.arange(0, BLOCK_P)            # (BLOCK_P,) pairs within the head
    if head < q_rows:
        w, dst = WQ + head * K, Q + head
    elif head < q_rows + kv_rows:
        w, dst = WK + (head - q_rows) * K, KP + (head - q_rows)
    else:
        w, dst = WV + (head - q_rows - kv_rows) * K, VP + (head - q_rows - kv_rows)
    cols = tl.arange(0, BLOCK_K)
    # (BLOCK_P, BLOCK_K) tiles of rows j; + HALF * K: rows j + HALF
    w += j[:, None].to(tl.int64) * K + cols[None, :]
    acc1 = tl.zeros([BLOCK_P, BLOCK_K], tl.float32)
    acc2 = tl.zeros([BLOCK_P, BLOCK_K], tl.float32)
    ss = tl.zeros([BLOCK_K], tl.float32)
    start: tl.constexpr = BLOCK_K if PDL else 0
    if PDL:
        w1, w2 = tl.load(w), tl.load(w + HALF * K)
        pdl_wait(PDL)
        # after the wait: 04's stage 1 then starts with all before us done (see 04's pdl)
        pdl_launch_next(PDL)
    pos = tl.load(POS)  # the position and slot early: their loads overlap the weight stream
    slot = _slot(R2T, tl.load(ROW).to(tl.int64), s_r2t, pos, None, page, "")
    rotate = head < q_rows + kv_rows  # v is not rotated
    cos = tl.where(rotate, tl.load(COS + pos * HALF + j), 1.0)
    sin = tl.where(rotate, tl.load(SIN + pos * HALF + j), 0.0)
    if PDL:
        acc1, acc2, ss = _gemv_tile(acc1, acc2, ss, w1, w2, X, G, cols, True, True)
    for k0 in range(start, K, BLOCK_K):
        acc1, acc2, ss = _gemv_tile(acc1, acc2, ss, tl.load(w + k0), tl.load(w + HALF * K + k0),
                                    X + k0, G + k0, cols, True, True)
    scale = tl.rsqrt(tl.sum(ss, 0) / K + eps)
    y1, y2 = tl.sum(acc1, 1) * scale, tl.sum(acc2, 1) * scale
    if head >= q_rows:  # k and v go to the pool slot
        dst += slot * kv_rows
    tl.store(dst + j, (y1 * cos - y2 * sin).to(dst.dtype.element_ty))
    tl.store(dst + j + HALF, (y2 * cos + y1 * sin).to(dst.dtype.element_ty))


@triton.jit
def _embed(TOK, E, OUT, K, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """OUT = E[TOK[0]]: the embedding lookup as a PDL link (torch's kernel would break the chain)."""
    pdl_launch_next(PDL)
    pdl_wait(PDL)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(OUT + cols, tl.load(E + tl.load(TOK).to(tl.int64) * K + cols))


def fused_decode_ok(model) -> bool:
    a = model.args
    # BLOCK_K = gcd(config, K) >= 16
    return a.dim % 16 == 0 and a.hidden_dim % 16 == 0 and a.head_dim % 2 == 0


# (rows per program, BLOCK_K, num_warps) per call site: an H200 sweep's best at the 8B shape's TP 1,
# 2, 4 (within 4%)
FUSED_CONFIG = dict(qkv=(2, 1024, 2),  # qkv: RoPE pairs (2 rows each) per program
                     o=(4, 1024, 2), w13=(1, 1024, 4), w2=(4, 512, 8), head=(8, 512, 2))


def gemv(x, w, out, norm=None, w3=None, residual=None, eps=0.0, config=(1, 1024, 4), pdl=False, push=None):
    """out = w @ x (x (K,), w (N, K)), with _gemv's options; out may be `residual` (in place). pdl:
    see fused_decode. push: int64 (ranks,) addresses of out's place on every rank (_gemv's PUSH)."""
    (N, K), (rows_per_program, block_k, num_warps) = w.shape, config
    # the interpreter pays per program
    rows_per_program = math.gcd(N, 128 if INTERPRET else rows_per_program)
    _gemv[(N // rows_per_program,)](
        x, norm if norm is not None else x, w, w3 if w3 is not None else w,
        residual if residual is not None else out, out, push if push is not None else out, K, eps,
        NORM=norm is not None, GLU=w3 is not None, RESID=residual is not None,
        BLOCK_N=rows_per_program, BLOCK_K=math.gcd(block_k, K),
        PUSH=0 if push is None else len(push), num_warps=num_warps, **pdl_kw(pdl))
    return out


# -------- Lamport's one-shot all-reduce: tensor-parallel ranks sum without a barrier --------------

@triton.jit
def _push(PEERS, OUT, at, y, WORLD: tl.constexpr):
    """y (fp32) stored in OUT's dtype at offsets `at` of every rank's buffer, PEERS their addresses
    (Lamport's push). A NaN goes as the canonical one, never an empty slot's bits (_lamport_sum)."""
    y = tl.where(y == y, y, float("nan")).to(OUT.dtype.element_ty)
    for r in tl.static_range(WORLD):
        tl.store(tl.load(PEERS + r).to(tl.pointer_type(OUT.dtype.element_ty)) + at, y)


@triton.jit
def _lamport_sum(SLOTS, OUT, N, WORLD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """OUT = the sum of SLOTS' WORLD rows of N (their bits as integers) in rank order, in fp32. A
    rank's row fills as its pushes land (_gemv's PUSH, _lamport_push), and an element still all ones
    has not landed: the data is its own flag, so no barrier (Lamport's one-shot all-reduce, as
    TensorRT-LLM's). Read, each goes back to all ones."""
    # the next kernel may load its first weight tile while the peers' pushes land
    pdl_launch_next(PDL)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for r in tl.static_range(WORLD):
        x = tl.load(SLOTS + r * N + cols, volatile=True)
        while tl.max((x == -1).to(tl.int32), 0) > 0:
            x = tl.load(SLOTS + r * N + cols, volatile=True)
        acc += x.to(OUT.dtype.element_ty, bitcast=True).to(tl.float32)
        tl.store(SLOTS + r * N + cols, tl.full([BLOCK], -1, x.dtype))
    pdl_wait(PDL)  # this rank's previous kernel is done: OUT may be its residual
    tl.store(OUT + cols, acc.to(OUT.dtype.element_ty))


def lamport_sum(slots, out, pdl=True):
    """out (N,) = the sum of slots (ranks, N) (out's dtype, or its integers) through _lamport_sum."""
    world, n = slots.shape
    slots = slots.view(torch.int16 if slots.element_size() == 2 else torch.int32)  # all ones: empty
    # batch 1's few programs start at once; batches' are many
    block = math.gcd(n, 512 if n <= 8192 else 2048)
    _lamport_sum[(n // block,)](slots, out, n, WORLD=world, BLOCK=block, **pdl_kw(pdl))
    return out


@triton.jit
def _lamport_push(X, PEERS, N, RANK, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """X (N,) into row RANK of the (WORLD, N) slots on every rank, PEERS their addresses."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    # (fp32: exact for bf16 and fp32)
    _push(PEERS, X, RANK * N + cols, tl.load(X + cols).to(tl.float32), WORLD)


def lamport_push(x, peers, rank: int):
    """x (n elements) into row `rank` of the (world, n) slots at the start of every rank's set; peers: its addresses."""
    n = x.numel()
    _lamport_push[(n // math.gcd(n, 2048),)](x, peers, n, rank, WORLD=len(peers), BLOCK=math.gcd(n, 2048))


def lamport_all_reduce(x, slots, peers, rank: int, out=None):
    """out (x itself by default) = x summed over the ranks, Lamport's way at any size (a batch's wo
    and w2, after cuBLAS): x pushed into every rank's slots (a set: world x >= n elements, all
    ones), then this rank's added up. Consecutive calls alternate between two sets: a fast peer may
    push the next sum while this rank reads."""
    n = x.numel()
    lamport_push(x, peers, rank)
    return lamport_sum(slots.view(-1)[:len(peers) * n].view(-1, n), x if out is None else out, pdl=False)

# -------- the batch-1 decode step, layer by layer -------------------------------------------------

def fused_decode(model, kv, tokens, positions, pdl=None):
    """One decode step of one sequence in six kernels per layer: model(tokens, positions, kv) at
    batch 1, over any backend's pool (kv.layer_pools, kv.table, kv.page). kv.batch_rows, batch_lens
    hold the step's table row and length (CudaGraphDecoder's static buffers); the slot comes from
    the table. Returns fp32 logits (1, vocab). pdl: launch every kernel with PDL (see above); None:
    on a GPU. Under tensor parallelism (model.tp) wo and w2 push partial sums (rank 0's with the
    residual) into every rank's tp.lamport, where _lamport_sum adds them up (tp(part) where there
    is none: gloo); each rank computes its rows tp.vocab of the logits, which tp gathers."""
    a, attn, tp = model.args, token_decode_attention, model.tp if model.tp.world > 1 else None
    cfg, pdl, emb = FUSED_CONFIG, tokens.is_cuda if pdl is None else pdl, model.tok_embeddings.weight
    # (dim,) the residual stream, updated in place
    h = torch.empty(a.dim, dtype=emb.dtype, device=emb.device)

    def add(x, w, config, use):
        # h += w @ x, summed over the ranks under TP (uses of tp.lamport alternate)
        if tp is None:
            return gemv(x, w, h, residual=h, config=config, pdl=pdl)
        res = h if tp.rank == 0 else None
        if tp.algo != "lamport":  # no symmetric memory (gloo), or a benchmark's other all-reduce
            return tp(gemv(x, w, tp.part[:a.dim], residual=res, config=config, pdl=pdl), out=h, use=use)
        slots = tp.lamport[use, :tp.world * a.dim].view(tp.world, a.dim)
        gemv(x, w, slots[tp.rank], residual=res, config=config, pdl=pdl, push=tp.push[use])
        return lamport_sum(slots, h, pdl)
    block = math.gcd(a.dim, 256)
    _embed[(a.dim // block,)](tokens, emb, h, a.dim, BLOCK=block, **pdl_kw(pdl))
    q = torch.empty(a.n_heads, a.head_dim, dtype=h.dtype, device=h.device)
    att = torch.empty(1, a.n_heads, a.head_dim, dtype=h.dtype, device=h.device)
    act = torch.empty(a.hidden_dim, dtype=h.dtype, device=h.device)
    half, q_rows, kv_rows = a.head_dim // 2, a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    pairs = math.gcd(half, cfg["qkv"][0])  # RoPE pairs per _qkv_rope program
    for i, layer in enumerate(model.layers):
        at, ff = layer.attention, layer.feed_forward
        kp, vp = kv.layer_pools(i)  # (num_slots, n_kv_heads, head_dim) each
        _qkv_rope[((q_rows + 2 * kv_rows) // 2 // pairs,)](
            h, layer.attention_norm.weight, *at.qkv_weights(), model.rope_cos, model.rope_sin,
            positions, kv.batch_rows, kv.table, kv.table.stride(0), kv.page, q, kp, vp, a.dim,
            a.norm_eps, q_rows, kv_rows, HALF=half, BLOCK_P=pairs,
            BLOCK_K=math.gcd(cfg["qkv"][1], a.dim), num_warps=cfg["qkv"][2], **pdl_kw(pdl))
        attn(q[None], kp, vp, kv.table, kv.batch_rows, kv.batch_lens, out=att, pdl=pdl, page=kv.page)
        add(att.view(-1), at.wo.weight, cfg["o"], 0)
        w1, w3 = ff.w13.weight.chunk(2)  # gate and up, stacked
        gemv(h, w1, act, norm=layer.ffn_norm.weight, w3=w3, eps=a.norm_eps, config=cfg["w13"], pdl=pdl)
        add(act, ff.w2.weight, cfg["w2"], 1)
    logits = torch.empty(1, a.vocab_size, dtype=torch.float32, device=h.device)
    lo, hi = tp.vocab if tp else (0, a.vocab_size)  # this rank's rows of the head
    mine = gemv(h, model.output.weight[lo:hi], (tp.logits if tp else logits[0])[lo:hi],
                norm=model.norm.weight, eps=a.norm_eps, config=cfg["head"], pdl=pdl)
    return (tp(tp.logits, out=logits[0]) if tp else mine)[None]

# -------- argmax on the device --------------------------------------------------------------------

@triton.jit
def _argmax(X, PART, V, CHUNKS, POS, LENS, ROWS, HIST, pad_row, FIRST, TOTAL, RANKS,
            BLOCK: tl.constexpr, FINISH: tl.constexpr, ADVANCE: tl.constexpr, HK: tl.constexpr,
            PDL: tl.constexpr = False):
    """Greedy tokens of X (B, V) in two launches: program (b, c) writes the max of chunk c of row b
    with its first index packed in one int64 (float bits made order-preserving, then TOTAL - index
    so ties pick the lowest index); FINISH then takes each row's largest key, of RANKS blocks (B,
    CHUNKS) of them. torch's argmax reduces a 128k-wide row in one block (28 us). X's columns are
    tokens FIRST.. of TOTAL (TP: each rank's rows of the head). ADVANCE (multi-step graphs): also
    log the token at HIST[b, pos % HK] and move the row to its next position."""
    b, c = tl.program_id(0), tl.program_id(1)
    pdl_launch_next(PDL)
    pdl_wait(PDL)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    if FINISH:
        n = RANKS * CHUNKS
        keys = tl.load(PART + (offs // CHUNKS) * tl.num_programs(0) * CHUNKS + b * CHUNKS + offs % CHUNKS,
                       mask=offs < n, other=0)
        # pad with a real key
        best = tl.max(tl.where(offs < n, keys, tl.load(PART + b * CHUNKS)), 0)
        token = TOTAL - (best & 0xFFFFFFFF)
        tl.store(X + b, token)
        if ADVANCE:
            pos = tl.load(POS + b)
            tl.store(HIST + b * HK + pos % HK, token)
            # padding rows stay on their scratch slot
            live = (tl.load(ROWS + b) != pad_row).to(pos.dtype)
            tl.store(POS + b, pos + live)
            tl.store(LENS + b, tl.load(LENS + b) + live.to(tl.int32))
    else:
        # fp32 bits below
        x = tl.load(X + b * V + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m = tl.max(x, 0)
        i = tl.min(tl.where(x == m, offs, V), 0)
        bits = m.to(tl.int32, bitcast=True)
        key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) * 4294967296 + (TOTAL - FIRST - i)
        tl.store(PART + b * CHUNKS + c, key)


def argmax(logits, out, advance=None, pdl=False, vocab=None, gather=None):
    """out (B,) int64 = logits (B, V) (any float dtype) .argmax(-1), through _argmax. advance =
    (positions (B,) int64, lens (B,) int32, rows (B,), hist (B, HK) int64, pad_row): then also the
    step's advance (see _argmax). Tensor parallelism's split head: vocab = (first, total), logits'
    columns are tokens first.. of total, and gather(keys (B, chunks)) gives every rank's keys
    (ranks, B, chunks): each rank finds the same token."""
    B, V = logits.shape
    block = 4096
    chunks = triton.cdiv(V, block)
    first, total = vocab or (0, V)
    part = torch.empty(B, chunks, dtype=torch.int64, device=logits.device)
    _argmax[(B, chunks)](logits, part, V, chunks, part, part, part, part, 0, first, total, 1,
                         BLOCK=block, FINISH=False, ADVANCE=False, HK=1, **pdl_kw(pdl))
    part = gather(part) if gather else part
    pos, lens, rows, hist, pad_row = advance or (part, part, part, part, 0)
    _argmax[(B, 1)](out, part, V, chunks, pos, lens, rows, hist, pad_row, first, total,
                    part.numel() // (B * chunks), BLOCK=triton.next_power_of_2(part.numel() // B),
                    FINISH=True, ADVANCE=advance is not None, HK=hist.shape[-1], **pdl_kw(pdl))
    return out

# -------- the model's pointwise steps -------------------------------------------------------------
# The model's pointwise steps, one kernel each (Transformer.use_kernels gives them to the model on a
# GPU): in PyTorch, RMSNorm, RoPE and SwiGLU are a handful of tiny kernels apiece, which at small
# batches cost more in launches than the weights take to read. torch.compile fused them too, for
# about 9 s of every process's start-up (importing dynamo and inductor, tracing); these compile
# once, into Triton's cache. Same arithmetic as the model's PyTorch functions: fp32 inside, rounded
# to the input's dtype where they round.

@triton.jit
def _rms_norm(X, RES, W, OUT, SUM, N, s_x, eps, BLOCK: tl.constexpr, ADD: tl.constexpr):
    row, cols = tl.program_id(0).to(tl.int64), tl.arange(0, BLOCK)
    x = tl.load(X + row * s_x + cols, mask=cols < N, other=0.0)
    if ADD:  # the residual add first, rounded to x's dtype as the model's add rounds
        res = tl.load(RES + row * N + cols, mask=cols < N, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(SUM.dtype.element_ty)
        tl.store(SUM + row * N + cols, x, mask=cols < N)
    x = x.to(tl.float32)
    y = (x * tl.rsqrt(tl.sum(x * x, 0) / N + eps)).to(OUT.dtype.element_ty)
    tl.store(OUT + row * N + cols, y * tl.load(W + cols, mask=cols < N), mask=cols < N)


@triton.jit
def _rope(X, COS, SIN, OUT, H, s_x, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # one token, all its heads: pairs (j, j + HALF) of each head
    h, j = tl.arange(0, BLOCK_H)[:, None], tl.arange(0, HALF)[None, :]
    x = X + t * s_x + h * 2 * HALF + j
    x1 = tl.load(x, mask=h < H, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF, mask=h < H, other=0.0).to(tl.float32)
    cos, sin = tl.load(COS + t * HALF + j), tl.load(SIN + t * HALF + j)
    out = OUT + (t * H + h) * 2 * HALF + j
    tl.store(out, (x1 * cos - x2 * sin).to(OUT.dtype.element_ty), mask=h < H)
    tl.store(out + HALF, (x2 * cos + x1 * sin).to(OUT.dtype.element_ty), mask=h < H)


@triton.jit
def _swiglu(GATE, UP, OUT, N, s_g, s_u, BLOCK: tl.constexpr):
    t, cols = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(GATE + t * s_g + cols, mask=cols < N).to(tl.float32)
    silu = (g * tl.sigmoid(g)).to(OUT.dtype.element_ty)
    tl.store(OUT + t * N + cols, silu * tl.load(UP + t * s_u + cols, mask=cols < N), mask=cols < N)


@triton.jit
def _store_kv(K, V, KP, VP, SLOTS, N, s_k, s_v, BLOCK: tl.constexpr):
    t, cols = tl.program_id(0).to(tl.int64), tl.arange(0, BLOCK)  # one token, all its heads
    slot, live = tl.load(SLOTS + t).to(tl.int64), cols < N
    tl.store(KP + slot * N + cols, tl.load(K + t * s_k + cols, mask=live), mask=live)
    tl.store(VP + slot * N + cols, tl.load(V + t * s_v + cols, mask=live), mask=live)


def store_kv(k_pool, v_pool, slots, k, v):
    """k_pool[slots], v_pool[slots] = k, v in one kernel (PyTorch's: two): k, v (T, n_kv_heads, head_dim) with
    each token's heads contiguous; the pools (slots, n_kv_heads, head_dim) contiguous: the KV cache's write."""
    k, v = (x if x.stride()[1:] == (x.shape[2], 1) else x.contiguous() for x in (k, v))
    n = k[0].numel()
    _store_kv[(k.shape[0],)](k, v, k_pool, v_pool, slots, n, k.stride(0), v.stride(0), BLOCK=triton.next_power_of_2(n))


def rms_norm(x, weight, eps: float, res=None):
    """x (T, dim), rows contiguous -> (T, dim): the model's rms_norm; res (T, dim) contiguous: -> (the norm of
    x + res, x + res), one kernel."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # (T, dim)
    add = out if res is None else torch.empty_like(out)
    _rms_norm[(x.shape[0],)](x, x if res is None else res.contiguous(), weight, out, add, x.shape[1], x.stride(0),
                             eps, BLOCK=triton.next_power_of_2(x.shape[1]), ADD=res is not None)
    return out if res is None else (out, add)


def apply_rope(x, cos, sin):
    """x (T, heads, head_dim), each token's heads contiguous; cos, sin (T, head_dim / 2) fp32: the model's."""
    T, H, D = x.shape
    x = x if x.stride()[1:] == (D, 1) else x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # (T, heads, head_dim)
    _rope[(T,)](x, cos.contiguous(), sin.contiguous(), out, H, x.stride(0), HALF=D // 2,
                BLOCK_H=triton.next_power_of_2(H))
    return out


def swiglu(gate, up):
    """silu(gate) * up, each (T, hidden) with rows contiguous (the halves of one GEMM's output): the model's."""
    T, N = gate.shape
    gate, up = (y if y.stride(-1) == 1 else y.contiguous() for y in (gate, up))
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)  # (T, hidden)
    _swiglu[(T, triton.cdiv(N, 1024))](gate, up, out, N, gate.stride(0), up.stride(0), BLOCK=1024)
    return out


if __name__ == "__main__":
    main()
