"""bench_04.py -- 04's kernels beside their peers on a GPU, on the same data: the decode kernel against flash-attn's
paged decode and PyTorch SDPA (eager and CUDA-graph time, GB/s), the prefill kernel against flash_attn_varlen_func
(TFLOP/s, and on 256-slot pages). flash-attn is optional: where it fails, the row says why.

    python tests/bench_04.py            # or: python 04_triton_token_attn.py --bench (its check runs first)
"""
import importlib
import itertools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
m = importlib.import_module("04_triton_token_attn")
triton = m.triton

BENCH_SHAPES = ((1, 4096), (32, 1024), (32, 4096), (128, 2048), (8, 16384))  # decode: (batch, context)
EXTEND_SHAPES = (  # (batch, new tokens, cached tokens) per request: the prefill shapes
    (8, 1024, 0), (32, 512, 512), (1, 8192, 0), (4, 2048, 6144))


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, return_mode="median")  # triton's median ms, L2 flushed before each call


def _failed(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"[:100]  # flash-attn missing, or out of memory: say so, keep benchmarking


def _timings(fns):
    """Over copies of the inputs (out of L2): eager ms (do_bench median, L2 flushed), graph ms (CUDA-graph replay: a
    decode engine's cost) and host us (CPU time to issue one call)."""
    it = itertools.count()
    fn = lambda: fns[next(it) % len(fns)]()
    eager = triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
    graph = triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(50):
        fn()
    host_us = (time.perf_counter() - t) / 50 * 1e6
    torch.cuda.synchronize()
    return dict(ms=eager, graph_ms=graph, host_us=host_us)


def _flash_fn(P, page=256):
    """flash-attn's paged decode over a paged copy of the same K/V (pages in random order)."""
    from flash_attn import flash_attn_with_kvcache
    q, k_pool, v_pool, r2t, rows, lens = P
    B, L = len(lens), int(lens[0])
    perm = torch.randperm(B * L // page, device=q.device)
    pages = lambda pool: torch.empty_like(pool[:B * L].view(-1, page, *pool.shape[1:])).index_copy_(
        0, perm, pool[r2t[rows, :L].long()].view(-1, page, *pool.shape[1:]))  # (num_pages, page, n_kv_heads, D)
    kc, vc, table = pages(k_pool), pages(v_pool), perm.view(B, -1).int()
    return lambda: flash_attn_with_kvcache(q[:, None], kc, vc, cache_seqlens=lens, block_table=table)[:, 0]


def _sdpa_fn(P):
    """PyTorch SDPA on a contiguous (batch, n_kv_heads, L, head_dim) copy."""
    q, k_pool, v_pool, r2t, rows, lens = P
    kc, vc = (pool[r2t[rows, :int(lens[0])].long()].transpose(1, 2).contiguous() for pool in (k_pool, v_pool))
    return lambda: torch.nn.functional.scaled_dot_product_attention(q[:, :, None], kc, vc, enable_gqa=True)[:, :, 0]


def bench(shapes=BENCH_SHAPES, n_q_heads=32, n_kv_heads=8, head_dim=128, dtype=torch.bfloat16, **config):
    """Times the kernel (scattered and contiguous slots), flash-attn (paged) and SDPA on the same data."""
    dev = torch.device("cuda")
    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    copy_gbs = 2 * x.numel() / _ms(lambda: y.copy_(x)) / 1e6  # read + write
    del x, y
    l2, results = torch.cuda.get_device_properties(dev).L2_cache_size, []
    for B, L in shapes:
        kv_bytes = 2 * B * L * n_kv_heads * head_dim * dtype.itemsize  # K and V, each read once
        sets = [m.make_problem([L] * B, n_q_heads, n_kv_heads, head_dim, dtype, dev, seed=i)
                for i in range(max(1, min(8, -(-3 * l2 // kv_bytes))))]
        splits = m.choose_num_splits(B, n_kv_heads, L, m.num_sms(dev))
        ours = lambda P: (lambda: m.token_decode_attention(*P, num_splits=splits, **config))
        r = dict(batch=B, context=L, num_splits=splits, copy_gbs=copy_gbs, ours=_timings([ours(P) for P in sets]))
        r["err"] = m.rel_err(ours(sets[0])(), m.reference_decode_attention(*sets[0])) if B * L <= 65536 else None
        r["contig"] = _timings([ours(m.make_problem([L] * B, n_q_heads, n_kv_heads, head_dim, dtype, dev,
                                                  scattered=False))])
        for name, maker in (("flash", _flash_fn), ("sdpa", _sdpa_fn)):
            try:
                fns = [maker(P) for P in sets]
                r[name] = dict(_timings(fns), err_vs_ours=m.rel_err(fns[0](), ours(sets[0])().double()))
            except Exception as e:
                r[name] = dict(why=_failed(e))
            fns = None
        for t in (r["ours"], r["contig"], r["flash"], r["sdpa"]):
            t.update({k.replace("ms", "gbs"): kv_bytes / t[k] / 1e6 for k in ("ms", "graph_ms") if k in t})
        results.append(r)
        sets = None
        torch.cuda.empty_cache()
    return results


def bench_extend(shapes=EXTEND_SHAPES, heads=((32, 8, 128), (32, 8, 64), (9, 3, 64)), dtype=torch.bfloat16, **config):
    """The prefill kernel against flash_attn_varlen_func on the same data (ours through req_to_token from scattered
    slots, flash-attn on contiguous copies gathered untimed): median ms, TFLOP/s of the visible products."""
    dev, results = torch.device("cuda"), []
    for H, Hkv, D in heads:
        for B, n, p in shapes:
            _, kp, vp, r2t, rows, _ = m.make_problem([p + n] * B, H, Hkv, D, dtype, dev)
            q = torch.randn(B * n, H, D, device=dev, dtype=dtype)  # (new tokens, n_q_heads, head_dim)
            ours = lambda: m.token_extend_attention(q, kp, vp, r2t, rows, [p] * B, [n] * B, **config)
            r = dict(batch=B, new=n, cached=p, n_q_heads=H, n_kv_heads=Hkv, head_dim=D, ms=_ms(ours))
            r["tflops"] = 4 * B * H * D * (n * p + n * (n + 1) / 2) / r["ms"] / 1e9
            try:
                from flash_attn import flash_attn_varlen_func
                slots = r2t[rows, :p + n].long()                            # (B, p + n)
                k, v = kp[slots].flatten(0, 1), vp[slots].flatten(0, 1)     # (B * (p + n), n_kv_heads, D)
                cu_q = torch.arange(0, B + 1, device=dev, dtype=torch.int32) * n
                cu_k = torch.arange(0, B + 1, device=dev, dtype=torch.int32) * (p + n)
                flash = lambda k, v, **kw: flash_attn_varlen_func(q, k, v, cu_q, cu_k, n, p + n, causal=True, **kw)
                r["flash_ms"] = _ms(lambda: flash(k, v))
                r["ratio"] = r["flash_ms"] / r["ms"]  # ours / flash-attn speed
                r["err_vs_flash"] = m.rel_err(ours(), flash(k, v).double())
                # the same K/V as 256-slot pages (02's block table): flash-attn's paged varlen path, and ours
                bt = torch.arange(B * (p + n) // 256, device=dev, dtype=torch.int32).view(B, -1)  # (B, pages)
                kc, vc = k.view(-1, 256, Hkv, D), v.view(-1, 256, Hkv, D)   # (pages, 256, n_kv_heads, D)
                r["flash_paged_ms"] = _ms(lambda: flash(kc, vc, block_table=bt))
                r["ours_paged_ms"] = _ms(lambda: m.token_extend_attention(q, k, v, bt, torch.arange(B, device=dev),
                                                                           [p] * B, [n] * B, page=256, **config))
            except Exception as e:
                r["flash"] = _failed(e)
            results.append(r)
            print(f"  {H:2d}/{Hkv} d={D:3d} {B:3d} x {n:5d} new over {p:5d} cached | ours {r['ms']:7.3f} ms "
                  f"{r['tflops']:6.1f} TFLOP/s | flash-attn " + (f"{r['flash_ms']:7.3f} ms  ours {r['ratio']:.2f}x "
                  f"(err {r['err_vs_flash']:.1e}) | 256-slot pages: flash-attn {r['flash_paged_ms']:7.3f} ms, ours "
                  f"{r['ours_paged_ms']:7.3f} ms" if "ratio" in r else r["flash"]), flush=True)
    return results


def print_bench(results, name):
    """bench()'s table (bench_extend prints its rows as they come); n/a where flash-attn or SDPA failed."""
    print(f"\n{name}, copy bandwidth {results[0]['copy_gbs']:,.0f} GB/s (read + write); 32 q / 8 kv heads, d=128, "
          "bf16, scattered slots\nGB/s = K+V bytes / time; eager: do_bench median, L2 flushed; graph: CUDA-graph "
          "replay\nbatch context splits |  ours us  GB/s  graph us  GB/s | contig GB/s | flash us  GB/s  graph us | "
          "sdpa us | vs flash")
    na = lambda d, w: "" if "ms" in d else f"{'n/a':>{w}}"
    for r in results:
        o, c, f, s = r["ours"], r["contig"], r["flash"], r["sdpa"]
        flash = na(f, 24) or f"{f['ms'] * 1e3:8.1f} {f['gbs']:5,.0f} {f['graph_ms'] * 1e3:9.1f}"
        sdpa = na(s, 7) or f"{s['ms'] * 1e3:7.1f}"
        vs_flash = na(f, 0) or f"{f['ms'] / o['ms']:4.2f}x {f['graph_ms'] / o['graph_ms']:4.2f}x"
        print(f"{r['batch']:5d} {r['context']:7d} {r['num_splits']:6d} | {o['ms'] * 1e3:8.1f} {o['gbs']:5,.0f} "
              f"{o['graph_ms'] * 1e3:9.1f} {o['graph_gbs']:5,.0f} | {c['gbs']:11,.0f} | {flash} | {sdpa} | {vs_flash}")
        for k, d in (("flash", f), ("sdpa", s)):
            if "why" in d:
                print(f"      {k}: {d['why']}")


if __name__ == "__main__":
    m.main(["--bench", *sys.argv[1:]])
