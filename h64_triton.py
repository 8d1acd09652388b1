"""Issue 64 prototype, the GPU half (goes into 04 once #63's layout lands): a batch-invariant matmul, and 04's
attention with one reduction for every query.

cuBLAS picks a kernel (tile shape, split-K) from M, so a row's bits follow the batch; here one tile configuration
serves every M and the K loop runs whole in one program (no split-K): each output element sums K in BLOCK_K steps
in the same order, whatever the other rows. Attention: 04's decode kernel splits a context into a number of splits
chosen from the batch, and prefill, decode and mixed steps run different kernels; deterministic mode sends every
query, decode ones too, through the extend kernel with one configuration: each query's keys reduce in BLOCK_N tiles
from key 0, in order, whatever the batch, the chunk, or how much of the prefix was cached."""
import importlib
import json
import os

import torch

m04 = importlib.import_module("04_triton_token_attn")  # first: it sets TRITON_INTERPRET on a CPU
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# one tile configuration for every M (block_m, block_n, block_k, warps, stages); fp32: small tiles compile fast
MATMUL_CONFIG = {torch.bfloat16: (64, 64, 64, 4, 4), torch.float16: (64, 64, 64, 4, 4),
                 torch.float32: (32, 32, 32, 4, 1)}
if os.environ.get("H64_MATMUL_CONFIG"):  # measurement only: the config call 1's sweep chose
    MATMUL_CONFIG[torch.bfloat16] = tuple(json.loads(os.environ["H64_MATMUL_CONFIG"]))
GROUP_M = 8  # row blocks walked together (L2 reuse of the weight tiles): the order programs run, not what they sum


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every M: no shape-specialised code paths
def _matmul(A, W, C, M, N, K, s_am, s_wn, s_cm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, GROUP: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr):
    pid, grid_n = tl.program_id(0), tl.cdiv(N, BLOCK_N)
    grid_m = tl.cdiv(M, BLOCK_M)
    first = pid // (GROUP * grid_n) * GROUP
    rows = tl.minimum(grid_m - first, GROUP)
    pid_m, pid_n = first + pid % rows, pid % (GROUP * grid_n) // rows
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # the whole K in one program, in order: no split-K
        k = k0 + offs_k
        a = tl.load(A + offs_m[:, None] * s_am + k[None, :], mask=(offs_m[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(W + offs_n[:, None] * s_wn + k[None, :], mask=(offs_n[:, None] < N) & (k[None, :] < K), other=0.0)
        if DOT_F32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PREC)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(C + offs_m[:, None] * s_cm + offs_n[None, :], acc.to(C.dtype.element_ty), mask=mask)


def invariant_matmul(x, w, config=None):
    """F.linear(x, w) (x (..., K), w (N, K)): each row's bits the same whatever M and whatever the other rows."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    (M, K), N = x.shape, w.shape[0]
    bm, bn, bk, warps, stages = config or MATMUL_CONFIG[x.dtype]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        f32 = m04.INTERPRET or x.dtype == torch.float32
        _matmul[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](
            x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            GROUP=GROUP_M, DOT_F32=f32, PREC="ieee" if f32 else "tf32", num_warps=warps, num_stages=stages)
    return out.view(*shape[:-1], N)


# the extend kernel's one configuration in deterministic mode, for prefill and decode alike: 16 query rows per
# program (decode's G heads of one token fill them; 04's prefill tiles of 128 rows would waste 124 of 128 there)
DETERMINISTIC_CONFIG = {torch.bfloat16: dict(rows=16, block_n=64, num_warps=4, num_stages=2),
                        torch.float16: dict(rows=16, block_n=64, num_warps=4, num_stages=2),
                        torch.float32: dict(rows=16, block_n=32, num_warps=4, num_stages=1)}


def extend_deterministic(q, k_pool, v_pool, req_to_token, req_rows, prefix_lens, extend_lens, page=1):
    return m04.token_extend_attention(q, k_pool, v_pool, req_to_token, req_rows, prefix_lens, extend_lens,
                                      page=page, **DETERMINISTIC_CONFIG[q.dtype])


def decode_deterministic(q, k_pool, v_pool, req_to_token, req_rows, seq_lens, page=1, out=None):
    """A decode step through the extend kernel: one new token per request after seq_len - 1 cached ones. Everything
    stays on the device (no host lengths), so a CUDA graph can hold it."""
    B, H, D = q.shape
    Hkv = k_pool.shape[1]
    cfg, dev = DETERMINISTIC_CONFIG[q.dtype], q.device
    G = H // Hkv
    per = triton.cdiv(G, cfg["rows"])  # blocks per token (1 unless a group has more heads than a block has rows)
    b = torch.arange(B, device=dev, dtype=torch.int32)
    blocks = torch.stack([b.repeat_interleave(per), torch.arange(per, device=dev, dtype=torch.int32).repeat(B)
                          * cfg["rows"]], 1).flatten()
    seq_lens = torch.as_tensor(seq_lens, device=dev)
    prefix = (seq_lens - 1).int()
    out = torch.empty_like(q) if out is None else out
    scale = D ** -0.5 * 1.4426950408889634
    f32 = m04.INTERPRET or q.dtype == torch.float32
    rows = torch.as_tensor(req_rows, device=dev)
    m04._extend[(B * per, Hkv)](
        q.contiguous(), k_pool, v_pool, req_to_token, rows, prefix, torch.ones_like(prefix), b, blocks, out, scale,
        k_pool.stride(0), v_pool.stride(0), req_to_token.stride(0), page, GROUP=G, HEAD_DIM=D, BLOCK_R=cfg["rows"],
        BLOCK_N=cfg["block_n"], DOT_F32=f32, PREC="ieee" if f32 else "tf32", num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    return out


def bench(configs=((64, 64, 64, 4, 4), (128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (64, 32, 64, 4, 4),
                   (64, 128, 64, 4, 3), (128, 128, 64, 4, 3), (64, 64, 128, 4, 3), (128, 64, 64, 8, 4)),
          ms=(1, 64, 256, 4096, 32768)):
    """GPU: the invariant matmul per config vs cuBLAS on the 1B shape's weights (us), and whether configs agree;
    writes the config of least engine-workload cost (about 700 decode steps at M=256, 5 prefills of 32k rows)."""
    from triton.testing import do_bench
    shapes = dict(wqkv=(3072, 2048), wo=(2048, 2048), w13=(16384, 2048), w2=(2048, 8192), head=(128256, 2048))
    out = {}
    for name, (N, K) in shapes.items():
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / 30
        for M in ms if name != "head" else [m for m in ms if m <= 256]:  # prefill's logits: a few rows
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            row = {"cublas": do_bench(lambda: x @ w.t(), rep=20) * 1e3}
            ref = None
            for c in configs:
                row[str(c)] = do_bench(lambda: invariant_matmul(x, w, c), rep=20) * 1e3
                y = invariant_matmul(x, w, c)
                ref = y if ref is None else ref
                row[str(c) + " same as first"] = bool(torch.equal(y, ref))
            out[f"{name} M={M}"] = row
            print(name, M, json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}),
                  flush=True)
    cost = {c: sum(700 * out[f"{n} M=256"][c] + (5 * out[f"{n} M=32768"][c] if n != "head" else 0) for n in shapes)
            for c in ["cublas"] + [str(c) for c in configs]}
    print("cost (us):", json.dumps({k: round(v) for k, v in cost.items()}))
    best = min((c for c in configs), key=lambda c: cost[str(c)])
    print("best", best, f"{cost[str(best)] / cost['cublas']:.2f}x cublas")
    with open("/tmp/h64_cfg", "w") as f:
        f.write(json.dumps(list(best)))
    return out


if __name__ == "__main__":
    bench()
