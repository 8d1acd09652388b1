"""
bench_tp.py -- tensor parallelism on GPUs: TP 1 against TP N (llama3_generate.py's shard_model) on the random
Llama 3 shapes. Run from the repository root on a machine with N GPUs:

    python tests/bench_tp.py --tp 2          # one report: parity, batch-1 decode, serving
    python tests/bench_tp.py --tp 2 --json   # the figures as one JSON object

1. parity: the random 1B shape in fp32, 8 prompts of random tokens, 32 greedy tokens each: TP N's tokens equal TP 1's
2. batch-1 decode, the random 8B shape in bf16, as the command line runs it (token backend, CUDA graphs, greedy
   multi-step; TP N without the fused batch-1 kernels, which have no all-reduce): tok/s of whole requests minus
   their first token (bench_engine's engine_decode_tok_s), TP 1 also without the fused kernels
3. serving: nano-vllm's workload (256 requests, prompt and output lengths uniform in [100, 1024]) on the 1B shape

Each TP size runs in processes of its own, started as torchrun starts them (RANK, WORLD_SIZE, ...); rank 0
writes its figures. --device cpu --small runs the same on CPUs over gloo with small shapes (a smoke test)."""
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


def rank_main(args):
    """One rank (or TP 1's single process): the three measurements; rank 0 prints them as JSON."""
    rank, world, device = L.tp_launch(SimpleNamespace(tp=int(os.environ.get("WORLD_SIZE", 1)), device=args.device), [])
    cuda = device.startswith("cuda")
    tok = type("NoTok", (), {"stop_ids": [], "eos_id": -1})()
    one_b, eight_b = shapes(args.small).values()
    rng = torch.Generator().manual_seed(0)
    r = {"tp": world, "device": torch.cuda.get_device_name() if cuda else "cpu"}

    model = model_on_ranks(one_b, device, torch.float32)
    e = L.Engine(model, tok, "token", kv_tokens=8 * 160)
    for _ in range(8):
        e.add(torch.randint(0, one_b.vocab_size, (128,), generator=rng).tolist(), L.SamplingParams(max_new_tokens=32))
    r["parity_tokens"] = list(e.run().values())
    del model, e

    model = model_on_ranks(eight_b, device, torch.bfloat16 if cuda else torch.float32)
    prompt = torch.randint(0, eight_b.vocab_size, (128,), generator=rng).tolist()
    n = 256 if cuda else 16
    r["batch1_8b_decode_tok_s"] = B.engine_decode_tok_s(model, tok, prompt, n, fused=False)[0]
    if world == 1 and cuda:
        r["batch1_8b_decode_fused_tok_s"] = B.engine_decode_tok_s(model, tok, prompt, n)[0]
    r["weight_GB_per_rank"] = B.weight_bytes(model) / 1e9
    del model
    B.free()

    model = model_on_ranks(one_b, device, torch.bfloat16 if cuda else torch.float32)
    n_seqs, top = (256, 1024) if cuda else (8, 48)
    lens = torch.randint(top // 10, top + 1, (n_seqs, 2), generator=rng).tolist()
    prompts = [torch.randint(0, one_b.vocab_size, (p,), generator=rng).tolist() for p, _ in lens]
    r["serve_1b"] = B.serve(model, tok, prompts, lens, "token", n_seqs * 2 * top)
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
    out = procs[0].communicate()[0]
    codes = [p.wait() for p in procs]
    if any(codes):
        sys.exit(f"error: TP {world} failed (exit codes {codes})")
    return json.loads(out.splitlines()[-1])


def report(one: dict, many: dict) -> str:
    s1, sn = one["serve_1b"], many["serve_1b"]
    tp = many["tp"]
    return "\n".join([
        f"device: {one['device']}; TP {tp} over {'NCCL' if one['device'] != 'cpu' else 'gloo'}",
        f"parity, 1B fp32, 8 prompts x 32 greedy tokens: TP {tp} tokens "
        f"{'equal' if one['parity_tokens'] == many['parity_tokens'] else 'DIFFER FROM'} TP 1's",
        f"batch-1 decode, 8B: TP 1 {one['batch1_8b_decode_tok_s']:,.0f} tok/s (fused kernels: "
        f"{one.get('batch1_8b_decode_fused_tok_s', float('nan')):,.0f}), TP {tp} {many['batch1_8b_decode_tok_s']:,.0f}"
        f" tok/s: {many['batch1_8b_decode_tok_s'] / one['batch1_8b_decode_tok_s']:.2f}x (weights per rank "
        f"{one['weight_GB_per_rank']:.1f} -> {many['weight_GB_per_rank']:.1f} GB)",
        f"serving, 1B, {s1['seqs']} requests: TP 1 {s1['tok_s']:,.0f} tok/s (decode {s1['decode_tok_s']:,.0f}), "
        f"TP {tp} {sn['tok_s']:,.0f} tok/s (decode {sn['decode_tok_s']:,.0f}): {sn['tok_s'] / s1['tok_s']:.2f}x"])


def main():
    ap = argparse.ArgumentParser(description="TP 1 vs TP N on random Llama 3 shapes.")
    ap.add_argument("--tp", type=int, default=2, help="ranks of the TP run (default: 2)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (gloo)")
    ap.add_argument("--small", action="store_true", help="small shapes and workloads (a smoke test on CPUs)")
    ap.add_argument("--json", action="store_true", help="the figures as one JSON object")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)  # a rank started by launch()
    args = ap.parse_args()
    if args.rank:
        return rank_main(args)
    argv = ["--device", args.device] + (["--small"] if args.small else [])
    one, many = launch(1, argv), launch(args.tp, argv)
    print(json.dumps({"tp1": one, f"tp{args.tp}": many}) if args.json else report(one, many))


if __name__ == "__main__":
    main()
