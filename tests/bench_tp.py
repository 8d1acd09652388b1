"""bench_tp.py -- tensor parallelism on GPUs: TP 1 against TP N (shard_model) on the random Llama 3 shapes.

    python tests/bench_tp.py --tp 2 [--json] [--breakdown]

1. parity: the 1B shape in fp32, 8 random prompts, 32 greedy tokens each: TP N's tokens equal TP 1's
2. batch-1 decode, the 8B shape in bf16, as the command line runs it (bench_engine's engine_decode_tok_s);
   --breakdown: each variant's tok/s and GPU ms per step (kernel configs, NCCL / one shot / Lamport all-reduce)
3. serving: nano-vllm's workload (256 requests, lengths uniform in [100, 1024]) on the 1B shape
Each TP size runs in processes of its own, as torchrun starts them; rank 0 writes the figures. --device cpu
--small runs the same over gloo with small shapes (a smoke test)."""
import argparse
import json
import os
import socket
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

import torch  # noqa: E402

import bench_engine as B  # noqa: E402
import llama3_generate as L  # noqa: E402

SMALL = dict(dim=256, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=2048, hidden_dim=512)  # --small


def shapes(small: bool):
    big = {k: B.LLAMA_SHAPES[k] for k in ("llama-3.2-1b", "llama-3-8b")}
    return {k: replace(v, **SMALL) for k, v in big.items()} if small else big


def model_on_ranks(shape, device, dtype):
    """The random model (seed 0: the same weights on every rank), this rank's shard of it under TP."""
    model = B.random_model(shape, device, dtype)
    if torch.distributed.is_initialized():
        L.shard_model(model, torch.distributed.get_rank(), torch.distributed.get_world_size())
    return model


class NoSum(L.TPSum):
    """model.tp with the adding left out: wrong tokens, the time without all-reduces."""

    def __init__(self, tp):
        self.__dict__.update(vars(tp))

    def __call__(self, x, out=None, use=0):
        return x if out is None else out.copy_(x)


def gpu_ms(fn, calls: int) -> float:
    """GPU ms per call of fn, called `calls` times back to back (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def step_ms(e, replays=10) -> float:
    """GPU ms per batch-1 decode step: e's 16-step graph replayed on a padding row (no host work between)."""
    g, k = e.graphs, e.multi_step
    saved = [x.clone() for x in (g.tokens, g.positions, g.rows, g.lens)]
    g.rows[0], g.lens[0], g.positions[0] = g.pad_row, 1, 0
    g.graphs[(1, k)]()
    ms = gpu_ms(g.graphs[(1, k)], replays) / k
    for x, v in zip((g.tokens, g.positions, g.rows, g.lens), saved):
        x.copy_(v)
    return ms


OLD_CONFIG = dict(qkv=(2, 512, 2), o=(4, 1024, 4), w13=(1, 1024, 4), w2=(4, 1024, 4), head=(4, 512, 4))  # issue 57's
M04 = L.lesson("04_triton_token_attn")


def decode_variants(model, tok, prompt, n, world) -> dict:
    """--breakdown: each variant's batch-1 (tok/s, GPU ms a step): old configs, each all-reduce, none."""
    tp, out, new = model.tp if model.tp.world > 1 else None, {}, M04.FUSED_CONFIG
    pytorch = dict(algo="one_shot")  # fused_decode's partial sums through model.tp's one shot
    variants = {"old configs (before)": dict(config=OLD_CONFIG), "new configs (after)": {}} if world == 1 else {
        "old configs, PyTorch's one shot (before)": dict(pytorch, config=OLD_CONFIG),
        "NCCL": dict(algo="nccl"), "PyTorch's one shot": pytorch, "Lamport's (after)": {},
        "no all-reduce (a copy in its place)": dict(algo="nccl", sum=NoSum)}
    keep = dict(vars(tp)) if tp else None
    for name, v in variants.items():
        if tp is not None:
            vars(tp).update(keep, **{k: x for k, x in v.items() if k in keep})
            model.tp = v.get("sum", lambda t: t)(tp)
        M04.FUSED_CONFIG = v.get("config", new)
        tok_s, _, e = B.engine_decode_tok_s(model, tok, prompt, n)
        out[name] = (tok_s, step_ms(e))
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:  # progress
            print(f"TP {world} {name}: {tok_s:,.0f} tok/s, {out[name][1]:.3f} ms a step", file=sys.stderr, flush=True)
        del e
        B.free()
    if tp is not None:
        model.tp = tp
        vars(tp).update(keep)
    M04.FUSED_CONFIG = new
    return out


ALGOS = {"nccl": "NCCL", "one_shot": "one shot", "lamport": "Lamport's"}


def all_reduce_bench(tp, device) -> dict:
    """--breakdown: bf16 all-reduces of 8 KB .. 2 MB by each algo: us, error vs fp64, NCCL's bits or not."""
    r, world, algo = {}, torch.distributed.get_world_size(), tp.algo
    for kb in (8, 64, 512, 1024, 2048):
        x = torch.randn(kb * 512, generator=torch.Generator(device).manual_seed(torch.distributed.get_rank()),
                        device=device).bfloat16()
        gathered = [torch.empty_like(x) for _ in range(world)]
        torch.distributed.all_gather(gathered, x)
        ref, r[f"{kb} KB"] = sum(t.double() for t in gathered), {}
        for tp.algo in ALGOS:
            out = [torch.empty_like(x) for _ in range(2)]
            pair = lambda: [tp(x, out=out[use], use=use) for use in (0, 1)]
            pair()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(32):
                    pair()
            g.replay()
            r[f"{kb} KB"][tp.algo] = dict(us=gpu_ms(g.replay, 5) * 1000 / 64, out=out[0],
                                          rel_err=float((out[0].double() - ref).norm() / ref.norm()))
            del g
        nccl = r[f"{kb} KB"]["nccl"]["out"]
        for a in r[f"{kb} KB"].values():
            a["nccl_bits"] = bool(torch.equal(a.pop("out"), nccl))
    tp.algo = algo
    return r


def rank_main(args):
    """One rank (or TP 1's single process): the three measurements; rank 0 prints them as JSON."""
    rank, world, device = L.tp_launch(SimpleNamespace(tp=int(os.environ.get("WORLD_SIZE", 1)), device=args.device), [])
    cuda, tok = device.startswith("cuda"), B.NOTOK
    one_b, eight_b = shapes(args.small).values()
    rng = torch.Generator().manual_seed(0)
    r = {"tp": world, "device": torch.cuda.get_device_name() if cuda else "cpu"}

    model = model_on_ranks(one_b, device, torch.float32)
    e = L.FastEngine(model, tok, "token", kv_tokens=8 * 160)
    for _ in range(8):
        e.add(torch.randint(0, one_b.vocab_size, (128,), generator=rng).tolist(), L.SamplingParams(max_new_tokens=32))
    r["parity_tokens"] = list(e.run().values())
    del model, e

    model = model_on_ranks(eight_b, device, torch.bfloat16 if cuda else torch.float32)
    prompt = torch.randint(0, eight_b.vocab_size, (128,), generator=rng).tolist()
    n = 256 if cuda else 16
    if args.breakdown and cuda:
        r["breakdown"] = decode_variants(model, tok, prompt, n, world)
        if world > 1:
            r["all_reduce"] = all_reduce_bench(model.tp, device)
    r["batch1_8b_decode_tok_s"] = B.engine_decode_tok_s(model, tok, prompt, n)[0]  # fused: 04's batch-1 kernels
    r["weight_GB_per_rank"] = B.weight_bytes(model) / 1e9
    del model
    B.free()

    model = model_on_ranks(one_b, device, torch.bfloat16 if cuda else torch.float32)
    n_seqs, top = (256, 1024) if cuda else (8, 48)
    lens = torch.randint(top // 10, top + 1, (n_seqs, 2), generator=rng).tolist()
    prompts = [torch.randint(0, one_b.vocab_size, (p,), generator=rng).tolist() for p, _ in lens]
    r["serve_1b"] = B.serve_timed(model, tok, prompts, lens, "token", n_seqs * 2 * top)
    if args.breakdown and cuda and world > 1:
        for model.tp.algo in ("one_shot", "nccl"):
            B.free()
            r[f"serve_1b_{model.tp.algo}"] = B.serve_timed(model, tok, prompts, lens, "token", n_seqs * 2 * top)
    if rank == 0:
        print(json.dumps(r), flush=True)


def launch(world: int, argv) -> dict:
    """This script's rank_main in `world` processes, as torchrun starts them; rank 0's figures."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        env = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", *argv], text=True,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL) for r in range(world)]
    out, codes = procs[0].communicate()[0], [p.wait() for p in procs]
    if any(codes):
        sys.exit(f"error: TP {world} failed (exit codes {codes})")
    return json.loads(out.splitlines()[-1])


def report(one: dict, many: dict) -> str:
    s1, sn = one["serve_1b"], many["serve_1b"]
    tp, b1, bn = many["tp"], one["batch1_8b_decode_tok_s"], many["batch1_8b_decode_tok_s"]
    lines = [
        f"device: {one['device']}; TP {tp} over " + ("gloo" if one["device"] == "cpu" else "Lamport's all-reduce "
                                                     "(NCCL over 2 MB)"),
        f"parity, 1B fp32, 8 prompts x 32 greedy tokens: TP {tp} tokens "
        f"{'equal' if one['parity_tokens'] == many['parity_tokens'] else 'DIFFER FROM'} TP 1's",
        f"batch-1 decode, 8B, fused kernels: TP 1 {b1:,.0f} tok/s, TP {tp} {bn:,.0f} tok/s: {bn / b1:.2f}x "
        f"(weights per rank {one['weight_GB_per_rank']:.1f} -> {many['weight_GB_per_rank']:.1f} GB)",
        f"serving, 1B, {s1['seqs']} requests: TP 1 {s1['tok_s']:,.0f} tok/s (decode {s1['decode_tok_s']:,.0f}), "
        f"TP {tp} {sn['tok_s']:,.0f} tok/s (decode {sn['decode_tok_s']:,.0f}): {sn['tok_s'] / s1['tok_s']:.2f}x"]
    for algo in ("one_shot", "nccl"):
        if f"serve_1b_{algo}" in many:
            s = many[f"serve_1b_{algo}"]
            lines.append(f"  TP {tp} with {ALGOS[algo]} all-reduces: {s['tok_s']:,.0f} tok/s "
                         f"(decode {s['decode_tok_s']:,.0f}): {s['tok_s'] / s1['tok_s']:.2f}x")
    if "breakdown" in many:
        lines.append("batch-1 decode, 8B, by variant: tok/s | GPU ms per step (graph replays) | x fused TP 1")
        for r in (one, many):
            for name, (tok_s, ms) in r["breakdown"].items():
                lines.append(f"  TP {r['tp']} {name:42s} {tok_s:7,.0f} | {ms:6.3f} | {tok_s / b1:5.2f}x")
    for size, a in many.get("all_reduce", {}).items():
        lines.append(f"all-reduce {size:>7s} bf16, us (error vs fp64; NCCL's bits?): " + ", ".join(
            f"{ALGOS[k]} {x['us']:5.1f} ({x['rel_err']:.1e}; {x['nccl_bits']})" for k, x in a.items()))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description="TP 1 vs TP N on random Llama 3 shapes.")
    ap.add_argument("--tp", type=int, default=2, help="ranks of the TP run (default: 2)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (gloo)")
    ap.add_argument("--small", action="store_true", help="small shapes and workloads (a smoke test on CPUs)")
    ap.add_argument("--json", action="store_true", help="the figures as one JSON object")
    ap.add_argument("--breakdown", action="store_true", help="batch-1 variants, all-reduce sizes, serving on NCCL")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)  # a rank started by launch()
    args = ap.parse_args()
    if args.rank:
        return rank_main(args)
    argv = ["--device", args.device] + (["--small"] if args.small else []) + (["--breakdown"] if args.breakdown else [])
    one, many = launch(1, argv), launch(args.tp, argv)
    print(json.dumps({"tp1": one, f"tp{args.tp}": many}) if args.json else report(one, many))


if __name__ == "__main__":
    main()
