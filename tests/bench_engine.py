"""bench_engine.py -- the engine's benchmarks: decode (batch 1 vs transformers; CPU or GPU) and, on a GPU, engine,
serve (serve --simulate: on a CPU, a cost model), admission, serve-http, prefix and deterministic (`--help` says
what each measures), each a report or (--json) one JSON object, through the engine's public API."""
import argparse
import gc
import json
import math
import os
import socket
import sys
import tempfile
import time
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # the repository root; tests/ (helpers) for runpy's callers

import torch  # noqa: E402

import llama3_generate as L  # noqa: E402
from helpers import LLAMA_SHAPES, NOTOK, random_model, to_transformers  # noqa: E402,F401 (bench_tp's too)


def seconds(fn, *args):
    """Wall time of fn(*args), the GPU (if any) synchronised before and after."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn(*args)
    sync()
    return time.perf_counter() - t0


def hf_generate(hf, x, n: int, mask=None, **kw):
    """transformers' greedy generate of exactly n new tokens after x (batch, len): the peer in every benchmark."""
    with torch.inference_mode():
        return hf.generate(x, attention_mask=torch.ones_like(x) if mask is None else mask, max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=0, **kw)


def copy_bandwidth(device) -> float:
    """GB/s of a large device-to-device copy, bytes read plus written: the most a weight-bound decode step gets."""
    x = torch.empty(2**30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    return 2 * 20 * x.numel() / seconds(lambda: [y.copy_(x) for _ in range(20)]) / 1e9


def free():
    """Free the engines gone out of scope (an engine and its graph decoder hold each other; warm_up froze the heap)."""
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def weight_bytes(model) -> int:
    """Bytes one batch-1 decode step must read: every weight (the embedding table only where it is also the head)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if n != "tok_embeddings.weight" or model.args.tie_embeddings)


def engine_decode_tok_s(model, tok, prompt, n: int, rounds: int = 2, **kw):
    """Batch-1 decode through a warm engine, n minus 1 tokens, best of `rounds`: (tok/s, prefill tok/s, e)."""
    e = L.FastEngine(model, tok, "token", kv_tokens=len(prompt) + n + 16, max_batch=1, radix=False, **kw)
    e.warm_up()
    run = lambda k: (e.add(prompt, L.SamplingParams(max_new_tokens=k, ignore_eos=True)), e.run())
    t1, tn = math.inf, math.inf
    for _ in range(rounds):
        t1, tn = min(t1, seconds(run, 1)), min(tn, seconds(run, n))
    return (n - 1) / (tn - t1), len(prompt) / t1, e


def bench(model, tok, prompt_ids, max_new_tokens: int, rounds: int = 2, log=lambda msg: None) -> dict:
    """`decode`: the engine's batch-1 decode vs transformers' generate (on a GPU also static, compiled), per prompt."""
    dev, n = model.tok_embeddings.weight.device, max_new_tokens
    hf = to_transformers(model)
    r = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "new_tokens": n,
         "prompts": len(prompt_ids)}
    ours = prefill = 0.0
    for i, ids in enumerate(prompt_ids):
        log(f"bench: engine, prompt {i + 1}/{len(prompt_ids)} (warm-up, then {rounds} rounds)")
        tok_s, pre_s, _ = engine_decode_tok_s(model, tok, ids, n, rounds)
        ours, prefill = ours + (n - 1) / tok_s, prefill + len(ids) / pre_s  # seconds, summed over prompts
    r["decode_tok_s"], r["prefill_tok_s"] = len(prompt_ids) * (n - 1) / ours, sum(map(len, prompt_ids)) / prefill
    peers = {"transformers": {}}
    if dev.type == "cuda":
        peers["transformers_static_compiled"] = {"cache_implementation": "static"}  # generate compiles its forward
    for name, kw in peers.items():
        total = 0.0
        for i, ids in enumerate(prompt_ids):
            log(f"bench: {name}, prompt {i + 1}/{len(prompt_ids)}")
            x = torch.tensor([ids], device=dev)
            gen = lambda k: hf_generate(hf, x, k, **kw)
            gen(1), gen(n)  # warm-up (the static cache compiles once per cache length)
            t = [(seconds(gen, 1), seconds(gen, n)) for _ in range(rounds)]
            total += min(tn for _, tn in t) - min(t1 for t1, _ in t)
        r[f"{name}_decode_tok_s"] = len(prompt_ids) * (n - 1) / total
        r[f"speedup_vs_{name}"] = r["decode_tok_s"] / r[f"{name}_decode_tok_s"]
    if dev.type == "cuda":
        r["copy_GBps"] = copy_bandwidth(dev)
        r["weight_read_limit_tok_s"] = r["copy_GBps"] * 1e9 / weight_bytes(model)
        for name in ["decode"] + [f"{p}_decode" for p in peers]:
            r[f"{name}_share_of_limit"] = r[f"{name}_tok_s"] / r["weight_read_limit_tok_s"]
    return r


def bench_report(r: dict, dtype: str) -> str:
    limit = r.get("weight_read_limit_tok_s")
    share = lambda name: f" ({r[name + '_share_of_limit']:.0%} of the weight-read limit)" if limit else ""
    lines = [f"batch-1 decode, {r['new_tokens']} new tokens, {r['prompts']} prompt(s), {r['device']}, {dtype}:",
             f"  ours (the engine, as the CLI runs it)    {r['decode_tok_s']:8.1f} tok/s{share('decode')}"]
    for peer, label in (("transformers", "transformers generate, eager"),
                        ("transformers_static_compiled", "transformers, static cache, compiled")):
        if f"{peer}_decode_tok_s" in r:
            lines.append(f"  {label:<39} {r[peer + '_decode_tok_s']:8.1f} tok/s{share(peer + '_decode')}"
                         f"  -> ours {r['speedup_vs_' + peer]:.2f}x")
    if limit:
        lines.append(f"  weight-read limit {limit:,.0f} tok/s (copy bandwidth {r['copy_GBps']:,.0f} GB/s)")
    lines.append(f"  prefill (ours) {r['prefill_tok_s']:,.0f} tok/s")
    return "\n".join(lines)


def run_stopping(e, stops: dict) -> dict:
    """e.run(), where sequence sid is aborted after stops[sid] tokens (an EOS max_new_tokens did not foresee)."""
    ended = []
    on_token = lambda s: ended.append(s.rid) if len(s.output) >= stops[s.rid] else None
    while e.busy:
        e.step(on_token)
        for sid in ended:
            e.abort(sid)
        ended.clear()
    return e.finished


def step_kernels_per_layer(e, b: int) -> float:
    """Kernels a layer in one decode step of b rows: a replay of its CUDA graph, every row on the padding row."""
    g, replay = e.graphs, e.graphs.graph(b)[0]
    g.rows[:b], g.positions[:b], g.lens[:b] = g.pad_row, 0, 1
    return gpu_busy(replay)["kernels"] / e.model.args.n_layers


def gpu_busy(run) -> dict:
    """The GPU's busy share of run() (the union of its kernels' intervals, profiled in a pass of its own) and gaps."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        p.export_chrome_trace(os.path.join(d, "trace.json"))
        with open(os.path.join(d, "trace.json")) as f:
            kernels = sorted((x["ts"], x["ts"] + x["dur"]) for x in json.load(f)["traceEvents"]
                             if x.get("cat") == "kernel")
    gaps, end = [], kernels[0][1]
    for start, stop in kernels:
        if start > end:
            gaps.append(start - end)
        end = max(end, stop)
    span = end - kernels[0][0]
    return dict(gpu_busy=1 - sum(gaps) / span, gpu_span_s=span / 1e6, gaps_over_1ms=sum(g > 1000 for g in gaps),
                idle_in_gaps_under_5us_s=sum(g for g in gaps if g < 5) / 1e6, longest_gap_ms=max(gaps, default=0) / 1e3,
                kernels=len(kernels))


def serve_timed(model, tok, prompts, lens, backend, kv_tokens, stops=None, busy=False, **kw) -> dict:
    """One warm engine serving the workload (EOS ignored; stops: early ends): throughput, memory; busy: profiled."""
    e = L.FastEngine(model, tok, backend, kv_tokens=kv_tokens, max_batch=len(prompts), max_seq_len=2048, **kw)
    e.warm_up(len(prompts))  # every bucket's graph captured, the kernels compiled, before timing
    add = lambda: [e.add(p, L.SamplingParams(max_new_tokens=n, ignore_eos=True))[0] for p, (_, n) in zip(prompts, lens)]
    sids = add()
    elapsed = seconds(run_stopping, e, dict(zip(sids, stops))) if stops else seconds(e.run)
    st, out_tokens, cap = e.stats, sum(map(len, e.finished.values())), e.kv.capacity()
    a, w = model.args, model.tok_embeddings.weight
    kv_bytes = 2 * a.n_layers * a.n_kv_heads * a.head_dim * w.element_size()  # a token's K and V, all layers
    read = st["decode_steps"] * weight_bytes(model) + st["decode_kv_read"] * kv_bytes  # what decode read
    counts = {k: st[k] for k in ("decode_s", "decode_tokens", "decode_steps", "decode_chunks", "one_step_decodes")}
    return dict(**counts, decode_GB=read / 1e9, seqs=len(prompts), max_prefill_tokens=e.sched.max_prefill_tokens,
                output_tokens=out_tokens, seconds=elapsed, tok_s=out_tokens / elapsed,
                prefill_tok_s=st["prefill_tokens"] / st["prefill_s"], decode_tok_s=st["decode_tokens"] / st["decode_s"],
                peak_running=st["peak_running"], kv_tokens=cap, peak_kv_used=st["peak_kv_used"] / cap,
                peak_live_tokens=st["peak_live_tokens"] / cap,
                radix_hit_rate=st["cached_tokens"] / max(1, st["prompt_tokens"]), preemptions=st["preemptions"],
                recomputed_tokens=st["recomputed_tokens"]) | (busy_pass(e, add) if busy else {})


def busy_pass(e, add) -> dict:
    """gpu_busy of the same run again, on the same warm engine (its cache and figures reset first)."""
    e.reset()
    add()
    return gpu_busy(e.run) | dict(step_kernels_per_layer=step_kernels_per_layer(e, e.graphs.buckets[-1]))


def roofline(row: dict, gbps: float):
    """Decode tok/s if each decode step only read its weights and KV at the copy bandwidth, and the share of it."""
    row["decode_roofline_tok_s"] = row["decode_tokens"] / (row["decode_GB"] / gbps)
    row["decode_share_of_roofline"] = row["decode_tok_s"] / row["decode_roofline_tok_s"]


BENCH_BACKENDS = {"token": dict(backend="token"), "paged 16": dict(backend="paged", block_size=16),
                  "paged 256": dict(backend="paged", block_size=256), "contiguous": dict(backend="contiguous")}


def bench_backends(model, tok, prompts, lens, pools=(("same pool", 2048), ("equal KV memory", 512))) -> dict:
    """Every backend on the same workload, for each (name, KV tokens per sequence) of `pools`."""
    out = {}
    for pool, per_seq in pools:
        rows = {}
        for name, kw in BENCH_BACKENDS.items():
            rows[name] = serve_timed(model, tok, prompts, lens, kv_tokens=per_seq * len(prompts), **kw)
            free()
        for row in rows.values():
            row["vs_token"] = row["tok_s"] / rows["token"]["tok_s"]
        out[pool] = rows
    return out


ADMISSIONS = L.lesson("05_radix_scheduler").ADMISSIONS  # name: Scheduler(reserve=...), the engine's reserve=


def bench_admissions(model, tok, prompts, lens, per_seq=512, backends=("token", "paged 16", "paged 256")) -> dict:
    """`admission`: the equal-memory workload through each of 05's admissions and backends, full and early stops."""
    rng = torch.Generator().manual_seed(1)
    stops, out = [int(torch.randint(1, n + 1, (), generator=rng)) for _, n in lens], {}
    for workload, st in (("full length", None), ("early stops", stops)):
        for name in backends:
            rows = out.setdefault(workload, {})[name] = {}
            for admission, reserve in ADMISSIONS.items():
                rows[admission] = serve_timed(model, tok, prompts, lens, kv_tokens=per_seq * len(prompts), stops=st,
                                        reserve=reserve, **BENCH_BACKENDS[name])
                free()
    return out


def backends_report(backends: dict) -> str:
    lines = []
    for pool, rows in backends.items():
        lines += [f"{pool}:", f"  {'backend':<12}{'KV tokens':>10}{'tok/s':>9}{'prefill':>9}{'decode':>9}"
                  f"{'running':>8}{'live':>6}{'preempted':>10}{'recomputed':>11}{'vs first':>9}{'roofline':>9}"
                  f"{'1-step':>7}{'chunks':>7}"]
        first = next(iter(rows.values()))
        lines += [f"  {name:<12}{r['kv_tokens']:>10,}{r['tok_s']:>9,.0f}{r['prefill_tok_s']:>9,.0f}"
                  f"{r['decode_tok_s']:>9,.0f}{r['peak_running']:>8}{r['peak_live_tokens']:>6.0%}{r['preemptions']:>10}"
                  f"{r['recomputed_tokens']:>11,}{r['tok_s'] / first['tok_s']:>8.2f}x"
                  f"{r.get('decode_share_of_roofline', math.nan):>9.0%}{r['one_step_decodes']:>7}"
                  f"{r['decode_chunks']:>7}"
                  for name, r in rows.items()]
    return "\n".join(lines)


def roofline_report(row: dict, gbps: float) -> str:
    """`engine`'s serving run against its roofline, and how often decode fell back to one step."""
    return (f"serving, {row['seqs']} requests (token, same pool, {row['peak_running']} running): decode "
            f"{row['decode_tok_s']:,.0f} tok/s, {row['decode_share_of_roofline']:.0%} of the roofline "
            f"{row['decode_roofline_tok_s']:,.0f} (weights + live KV read per step at {gbps:,.0f} GB/s); one-step "
            f"decodes {row['one_step_decodes']} of {row['one_step_decodes'] + row['decode_chunks']} decode calls, "
            f"{row['decode_steps']:,} decode steps" + (f"\nthe GPU busy {row['gpu_busy']:.1%} of the run "
            f"({row['gpu_span_s']:.2f} s, profiled apart): idle gaps over 1 ms {row['gaps_over_1ms']}, the longest "
            f"{row['longest_gap_ms']:.1f} ms; gaps under 5 us (kernel to kernel) "
            f"{row['idle_in_gaps_under_5us_s'] * 1e3:.0f} ms; a full batch's decode step, "
            f"{row['step_kernels_per_layer']:.1f} kernels a layer" if "gpu_busy" in row else ""))


def draw(n_seqs: int, seed: int = 0):
    """nano-vllm's bench.py workload, seeded: prompt and output lengths uniform in [100, 1024], ids in [0, 128000)."""
    rng = torch.Generator().manual_seed(seed)
    lens = torch.randint(100, 1025, (n_seqs, 2), generator=rng).tolist()
    return [torch.randint(0, 128000, (p,), generator=rng).tolist() for p, _ in lens], lens


def engine_workload(device="cuda", n_seqs=256):
    """`engine`'s: a tokenizer stand-in, a random Llama-3.2-1B shape, n_seqs prompts and (prompt, output) lengths."""
    return NOTOK, random_model(LLAMA_SHAPES["llama-3.2-1b"], device), *draw(n_seqs)


def bench_engine(device="cuda", n_seqs=256, hf_batch=64) -> dict:
    """`engine`: nano-vllm's workload on a random 1B shape, every backend, batch-1 decode on 1B and 8B shapes."""
    r = {"device": torch.cuda.get_device_name(), "copy_GBps": copy_bandwidth(device)}
    tok, model, prompts, lens = engine_workload(device, n_seqs)

    r["serve_1b"] = serve_timed(model, tok, prompts, lens, "token", n_seqs * 2048, busy=True)
    r["backends"] = bench_backends(model, tok, prompts, lens)
    for row in [r["serve_1b"]] + [row for rows in r["backends"].values() for row in rows.values()]:
        roofline(row, r["copy_GBps"])
    hf, batch = to_transformers(model), prompts[:hf_batch]
    width = max(map(len, batch))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
    pad = torch.tensor([width - len(p) for p in batch], device=device)  # (batch,) left padding
    mask, hf_new = (torch.arange(width, device=device) >= pad[:, None]).long(), 256
    hf_generate(hf, ids[:2, -16:], 4, mask[:2, -16:])  # warm-up
    r["transformers_1b_batch64_tok_s"] = hf_batch * hf_new / seconds(hf_generate, hf, ids, hf_new, mask)
    r["serve_speedup_vs_transformers"] = r["serve_1b"]["tok_s"] / r["transformers_1b_batch64_tok_s"]

    def batch1(model, hf, name, n=256):
        """Wall time of whole requests (128-token prompt), n tokens minus 1 token."""
        decode_tok_s = lambda **kw: engine_decode_tok_s(model, tok, prompts[1][:128], n, **kw)[0::2]
        ours, e = decode_tok_s()
        limit = r["copy_GBps"] * 1e9 / weight_bytes(model)
        g = e.graphs  # the GPU-side floor of a step: replays back to back, no host work between, on the padding
        g.rows[0], g.positions[0], g.lens[0] = g.pad_row, 128, 129  # row (which stays put) at a 129-token context
        k = e.multi_step  # replays of batch 1's k-step graph
        replay_tok_s = 4 * k / seconds(lambda: [g.graphs[1, k]() for _ in range(4)])
        x = torch.tensor([prompts[1][:128]], device=device)
        t = {k: seconds(hf_generate, hf, x, k) for k in (1, 33, 1, 33)}  # the second pair counts (warm)
        r[f"batch1_{name}"] = dict(decode_tok_s=ours, weight_read_limit_tok_s=limit, fraction_of_limit=ours / limit,
                                   step_kernels_per_layer=step_kernels_per_layer(e, 1),
                                   graph_replay_tok_s=replay_tok_s,
                                   one_step_per_sync_tok_s=decode_tok_s(multi_step=1)[0],
                                   unfused_tok_s=decode_tok_s(fused=False)[0], transformers_tok_s=32 / (t[33] - t[1]))

    batch1(model, hf, "1b")
    del model, hf
    free()
    model = random_model(LLAMA_SHAPES["llama-3-8b"], device)
    hf = to_transformers(model)
    batch1(model, hf, "8b")
    return r


# (mixed, chunk_tokens): 05's Scheduler options. The budget from the H200's step time (1B shape): a step of
# 6,144 tokens takes ~45 ms, under half of prefill-first's ITL p99, and a 16k prompt needs 3 chunks (4,096: 5)
SERVE_SCHEDULES = {name: (mixed, 6144 if chunked else None)
                   for name, (mixed, chunked) in L.lesson("05_radix_scheduler").SCHEDULES.items()}


def serve_arrivals(engine, prompts, lens, arrivals) -> dict:
    """Requests arrive at the given times while the engine steps: TTFT, ITL (vLLM's), the longest gap's steps."""
    got, start, seen, steps, begun = set(), {}, {}, [], {}  # steps: (end, tokens fed by kind, seconds) each
    on_token = lambda s: got.add(s.rid)
    t0, i = time.perf_counter(), 0
    while i < len(prompts) or engine.busy:
        now = time.perf_counter() - t0
        while i < len(prompts) and arrivals[i] <= now:
            sid = engine.add(prompts[i], L.SamplingParams(max_new_tokens=lens[i][1], ignore_eos=True))[0]
            start[sid], i = arrivals[i], i + 1
        if not engine.busy:
            time.sleep(max(0.0, arrivals[i] - now))
            continue
        fed, began = {k: engine.stats[f"{k}_tokens"] for k in ("prefill", "decode", "mixed")}, time.perf_counter()
        logged = len(engine.events)
        engine.step(on_token)
        end = time.perf_counter()
        now = end - t0
        steps.append((now, {k: engine.stats[f"{k}_tokens"] - n for k, n in fed.items()}, end - began))
        for ev in engine.events[logged:]:  # admitted in this step: its first step (TTFT's queued part ends)
            if ev.kind == "admit":
                begun.setdefault(ev.rid, began - t0)
        for sid in got:
            seen.setdefault(sid, []).append(now)
        got.clear()
    longest, a, b = max((b - a, a, b) for d in seen.values() for a, b in zip(d, d[1:]))
    inside = [[", ".join(f"{k} {n:,}" for k, n in fed.items() if n) or "tokens in flight landed", s * 1e3]
              for end, fed, s in steps if a < end <= b]  # what the longest gap was made of
    kinds = [(end - sec, end, max(("decode", "prefill", "mixed"), key=lambda k: (k != "decode") * fed[k]))
             for end, fed, sec in steps]  # (start, end, the kind of step) each
    sids = sorted(start)
    times, arrived, sized = [seen[k] for k in sids], [start[k] for k in sids], [lens[k] for k in sids]
    return dict(requests=len(prompts)) | latency(times, arrived, sized) | dict(
        outputs=engine.run(), itl_max_steps=inside + [["outside steps", longest * 1e3 - sum(ms for _, ms in inside)]],
        ttft_waits=ttft_waits([d[0] for d in times], arrived, [begun[k] for k in sids], sized, kinds))


def serve_workload(rng, device, n_seqs, lengths, long, long_prompts, args, shape):
    """`serve`'s draws from rng: (lens, longest, args, model, prompts), long_prompts of them `long`; no device: no
    model (it draws nothing from rng)."""
    lens = torch.randint(lengths[0], lengths[1] + 1, (n_seqs, 2), generator=rng).tolist()
    for i in torch.randperm(n_seqs, generator=rng)[:long_prompts].tolist():
        lens[i][0] = int(torch.randint(long[0], long[1] + 1, (), generator=rng))
    longest, args = max(p + n for p, n in lens), args or LLAMA_SHAPES[shape]
    model = device and random_model(replace(args, max_seq_len=max(args.max_seq_len, longest)), device,
                                    torch.bfloat16 if device == "cuda" else torch.float32)
    prompts = [torch.randint(0, args.vocab_size, (p,), generator=rng).tolist() for p, _ in lens]
    return lens, longest, args, model, prompts


def bench_serve(device="cuda", rates=(16, 32, 64), n_seqs=320, lengths=(100, 1024), long=(8192, 16384),
                long_prompts=8, schedules=SERVE_SCHEDULES, multi_step=4, shape="llama-3.2-1b", args=None, plot=None,
                log=lambda msg: None) -> dict:
    """`serve`: Poisson arrivals at each rate, the schedules taking turns on one warm engine; plot: the p99s."""
    rng = torch.Generator().manual_seed(0)  # the workload's draws, then the arrivals'
    lens, longest, args, model, prompts = serve_workload(rng, device, n_seqs, lengths, long, long_prompts, args, shape)
    e = L.FastEngine(model, NOTOK, "token", kv_tokens=n_seqs * 1024 + longest, max_batch=min(256, n_seqs),
                     max_seq_len=longest, multi_step=multi_step)
    e.warm_up(e.max_batch)
    r = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "shape": shape, "requests": n_seqs,
         "long_prompts": sorted(p for p, _ in lens if p > lengths[1]), "schedules": schedules,
         "multi_step": e.multi_step, "rates": {}}
    for rate in rates:
        arrivals = torch.empty(n_seqs).exponential_(rate, generator=rng).cumsum(0).tolist()  # Poisson: exp. gaps
        runs = r["rates"][rate] = {}
        for name, (mixed, chunk_tokens) in schedules.items():
            e.sched.set_schedule(mixed, chunk_tokens)
            runs[name] = serve_arrivals(e, prompts, lens, arrivals)
            e.reset()
            log(f"{rate} req/s, {name}: " + ", ".join(f"{k} {v:,.1f}" for k, v in runs[name].items()
                                                      if isinstance(v, float | int)))
        outs = [runs[name].pop("outputs") for name in runs]
        r["same_tokens"] = r.get("same_tokens", True) and all(o == outs[0] for o in outs)
    if plot:
        serve_plot(r, plot)
    return r


# serve --simulate's step cost (s), fitted to the H200's 1B shape (bf16): an eager step with prompts takes
# PREFILL_S + TOKEN_S a token fed + PAIR_S a (query, key) pair of its prompts + CTX_S a token of context a
# decode row reads; a CUDA-graph decode step DECODE_S + CTX_S a token of context
PREFILL_S, TOKEN_S, PAIR_S, DECODE_S, CTX_S = 4e-3, 4.5e-6, 0.5e-9, 3e-3, 10e-9


def step_seconds(batch, decoding: set) -> float:
    """The cost model's time for one step of batch (decoding: ids of the rows that decode)."""
    ctx = sum(x.kv_len for x in batch if id(x) in decoding)
    if all(id(x) in decoding for x in batch):
        return DECODE_S + CTX_S * ctx
    fed = sum(x.n_new for x in batch)
    pairs = sum(x.n_new * (x.kv_len + x.n_new / 2) for x in batch if id(x) not in decoding)
    return PREFILL_S + TOKEN_S * fed + PAIR_S * pairs + CTX_S * ctx


def simulate_serve(rates=(16, 32, 64), n_seqs=320, lengths=(100, 1024), long=(8192, 16384), long_prompts=8,
                   schedules=SERVE_SCHEDULES, vocab=128256, multi_step=4, plot=None, log=lambda msg: None) -> dict:
    """`serve --simulate`: serve's draws through 05's Scheduler on step_seconds' clock (a cost model); plot: serve's."""
    R, T = L.lesson("05_radix_scheduler"), L.lesson("03_token_allocator")
    rng, args = torch.Generator().manual_seed(0), replace(LLAMA_SHAPES["llama-3.2-1b"], vocab_size=vocab)
    lens, longest, _, _, prompts = serve_workload(rng, None, n_seqs, lengths, long, long_prompts, args, None)
    r = {"device": "cpu (simulated)", "shape": "llama-3.2-1b", "requests": n_seqs, "schedules": schedules,
         "rates": {}, "long_prompts": sorted(p for p, _ in lens if p > lengths[1])}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensor ops: a thread pool only adds overhead (05's simulate)
    for rate in rates:
        arrivals = torch.empty(n_seqs).exponential_(rate, generator=rng).cumsum(0).tolist()
        for name, (mixed, chunk_tokens) in schedules.items():
            kv = T.TokenKVCache(1, n_seqs * 1024 + longest, 1, 1, min(256, n_seqs) + 1, longest)
            s = R.Scheduler(kv, "lpm", min(256, n_seqs), 32768, reserve="expected", mixed=mixed,
                            chunk_tokens=chunk_tokens, lookahead=multi_step)
            x = r["rates"].setdefault(rate, {})[name] = simulate_arrivals(s, prompts, lens, arrivals, multi_step)
            log(f"{rate} req/s, {name}: " + ", ".join(f"{k} {v:,.1f}" for k, v in x.items() if k != "ttft_waits"))
    torch.set_num_threads(threads)
    if plot:
        serve_plot(r, plot)
    return r


def simulate_arrivals(s, prompts, lens, arrivals, multi_step) -> dict:
    """simulate_serve's run of one schedule: latency()'s figures, and where the slowest first tokens waited."""
    now, i, n, seen, begun, steps = 0.0, 0, len(prompts), [[] for _ in lens], {}, []
    while i < n or s.busy:
        while i < n and arrivals[i] <= now:
            s.add(prompts[i], lens[i][1], target=[i % 1000 + 10] * lens[i][1])
            i += 1
        if not s.busy:
            now = arrivals[i]
            continue
        batch, got, t0 = None, set(), now
        for k in range(multi_step):  # a decode step: multi_step of them, one delivery
            batch, _ = s.schedule(None if batch is None else [])
            decoding = set(map(id, s.running))
            now += step_seconds(batch, decoding)
            got.update(x.rid for x in batch if x.samples)
            prefill = sum(x.n_new for x in batch if id(x) not in decoding)
            for x in batch:
                begun.setdefault(x.rid, t0)
            s.postprocess(batch, [[x.target[len(x.output)]] if x.samples else [] for x in batch])
            if prefill or not s.running:
                break
        steps.append((t0, now, "decode" if not prefill else "mixed" if s.mixed else "prefill"))
        for rid in got:
            seen[rid].append(now)
    x = latency(seen, arrivals, lens)
    short = [d[0] - t for d, t, (p, _) in zip(seen, arrivals, lens) if p <= 1024]
    x.update(steps=s.stats["steps"], short_ttft_p99_ms=torch.tensor(short).quantile(0.99).item() * 1e3)
    x["ttft_waits"] = ttft_waits([d[0] for d in seen], arrivals, [begun[k] for k in range(n)], lens, steps)
    return x


def ttft_waits(first, arrivals, begun, lens, steps, top=4) -> list:
    """Where the `top` slowest first tokens waited (ms): queued, then each kind of step until the first token."""
    out = []
    for k in sorted(range(len(first)), key=lambda k: arrivals[k] - first[k])[:top]:
        row = dict(prompt=lens[k][0], ttft=(first[k] - arrivals[k]) * 1e3, queued=(begun[k] - arrivals[k]) * 1e3)
        for a, b, kind in steps:
            if begun[k] <= a < first[k]:
                ms, count = row.get(kind, (0.0, 0))
                row[kind] = (ms + (b - a) * 1e3, count + 1)
        out.append(row)
    return out


def waits_report(r: dict) -> list:
    """serve_report's lines on where the slowest first tokens waited."""
    lines = ["the slowest first tokens: prompt tokens, TTFT = queued + steps from its first step (ms, count):"]
    for rate, runs in r["rates"].items():
        for name, x in runs.items():
            lines += [f"{rate:>5}  {name:<23}" + "; ".join(
                f"{w['prompt']:,} {w['ttft']:.0f} = {w['queued']:.0f} + " + " + ".join(
                    f"{k} {w[k][0]:.0f} ({w[k][1]})" for k in ("prefill", "mixed", "decode") if k in w)
                for w in x.get("ttft_waits", [])[:2])]
    return lines


def serve_plot(r: dict, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    rates = list(r["rates"])
    for name in r["schedules"]:
        for ax, key in zip(axes, ("itl_p99_ms", "ttft_p99_ms")):
            ax.plot(rates, [r["rates"][q][name][key] for q in rates], marker="o", label=name)
    for ax, title in zip(axes, ("inter-token latency p99 (ms)", "time to first token p99 (ms)")):
        ax.set(xlabel="request rate (req/s, Poisson)", title=title, xscale="log", ylim=(0, None))
        ax.set_xticks(rates, [str(q) for q in rates], minor=False)
        ax.set_xticks([], minor=True)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{r['requests']} requests on a random {r['shape']} (bf16), {len(r['long_prompts'])} of them "
                 f"{min(r['long_prompts']):,}-{max(r['long_prompts']):,} tokens long; {r['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def serve_report(r: dict) -> str:
    lines = [f"{r['device']}:", f"{'rate':>5}  {'schedule':<23}{'tok/s':>8}{'TTFT p50/p99/max ms':>21}"
             f"{'ITL p50/p99/max ms':>21}{'TPOT p50/p99 ms':>17}"]
    for rate, runs in r["rates"].items():
        lines += [f"{rate:>5}  {name:<23}{x['output_tok_s']:>8,.0f}{x['ttft_p50_ms']:>7.0f} /{x['ttft_p99_ms']:>5.0f} /"
                  f"{x['ttft_max_ms']:>5.0f}{x['itl_p50_ms']:>8.1f} /{x['itl_p99_ms']:>5.0f} /{x['itl_max_ms']:>5.0f}"
                  f"{x['tpot_p50_ms']:>10.2f} /{x['tpot_p99_ms']:>5.2f}" for name, x in runs.items()]
    lines += waits_report(r)
    if "same_tokens" not in r:  # simulated: no steps timed, the tokens are the workload's
        return "\n".join(lines)
    lines += ["the longest gap, steps inside it (tokens fed, ms) and the time outside any step:"]
    lines += [f"{rate:>5}  {name:<23}{x['itl_max_ms']:>5.0f} ms = " + " + ".join(f"[{what}] {ms:.0f}" for what, ms in
                                                                         x["itl_max_steps"])
              for rate, runs in r["rates"].items() for name, x in runs.items()]
    return "\n".join(lines + [f"same tokens in every schedule: {r['same_tokens']}"])


LATENCY = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms", "tpot_p99_ms")


def latency(seen: list, arrivals, lens) -> dict:
    """From each request's delivery times (seconds from the start): serve_arrivals' throughput and percentiles."""
    pct = lambda xs, q: torch.tensor(xs, dtype=torch.float64).quantile(q / 100).item() * 1e3  # ms
    gaps = [b - a for d in seen for a, b in zip(d, d[1:])]
    tpot = [(d[-1] - d[0]) / (n - 1) for d, (_, n) in zip(seen, lens) if n > 1]
    ttft = [d[0] - t for d, t in zip(seen, arrivals)]
    return dict(output_tok_s=sum(n for _, n in lens) / max(d[-1] for d in seen), ttft_p50_ms=pct(ttft, 50),
                ttft_p99_ms=pct(ttft, 99), ttft_max_ms=max(ttft) * 1e3, itl_p50_ms=pct(gaps, 50),
                itl_p99_ms=pct(gaps, 99), itl_max_ms=max(gaps) * 1e3,
                tpot_p50_ms=pct(tpot, 50), tpot_p99_ms=pct(tpot, 99))


def http_client(url: str, model: str, prompts, lens, arrivals) -> list:
    """In a process of its own: each request sent at its arrival time, streamed (HTTP/1.1 by hand: a library's client
    took more CPU than the server): delivery times and completion tokens each, and the client's CPU seconds."""
    import asyncio
    from urllib.parse import urlsplit
    u = urlsplit(url)

    async def one(i, t0):
        await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
        body = json.dumps(dict(model=model, prompt=prompts[i], max_tokens=lens[i][1], ignore_eos=True, temperature=0,
                               stream=True, stream_options={"include_usage": True})).encode()
        r, w = await asyncio.open_connection(u.hostname, u.port)
        w.write(f"POST {u.path}/completions HTTP/1.1\r\nHost: {u.netloc}\r\nConnection: close\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        seen, last, rest = [], None, b""
        while data := await r.read(1 << 16):  # the server closes the connection after [DONE]
            *events, rest = (rest + data).split(b"\n\n")  # whole events; chunked framing lies between them
            for ev in (ev[ev.find(b"data: "):] for ev in events):
                if ev.startswith(b"data: {") and b'"text": ""' not in ev and b'"usage"' not in ev:
                    seen.append(time.perf_counter() - t0)
                last = ev if ev.startswith(b"data: {") else last
        w.close()
        return seen, json.loads(last[6:])["usage"]["completion_tokens"]

    async def run():
        t0 = time.perf_counter()
        return await asyncio.gather(*(one(i, t0) for i in range(len(prompts))))
    cpu = time.process_time()
    return asyncio.run(run()), time.process_time() - cpu


class ProxyEngine(L.FastEngine):
    """serve-http's CPU proxy of a GPU engine: real host work, its model a sleep without the GIL; random tokens."""

    def __init__(self, model, tok, step_s=0.004, prefill_tok_s=200_000, launches=32, **kw):
        super().__init__(model, tok, "token", cuda_graphs=False, **kw)
        self.step_s, self.prefill_tok_s, self.launches = step_s, prefill_tok_s, launches

    def gpu(self, seconds):
        for _ in range(self.launches):
            time.sleep(0)
        time.sleep(seconds)

    def forward(self, batch, positions):
        self.gpu(sum(s.n_new for s in batch) / self.prefill_tok_s)

    def choose(self, batch, logits, k=None):
        return torch.randint(0, 128000, (len(batch),) + ((k,) if k else ())).tolist()

    def step(self, on_token=None):
        batch, t0 = self.sched.running, time.perf_counter()
        if self.sched.waiting or self.sched.chunked or not batch:
            return super().step(on_token)  # admit, prefill (or 1-step decode when nothing is admitted)
        k = min([self.multi_step] + [s.tokens_left for s in batch])
        try:
            self.kv.prepare([s.rid for s in batch], [k] * len(batch))
        except L.OutOfBlocks:
            return super().step(on_token)  # the 1-step path evicts or preempts
        self.gpu(k * self.step_s)
        self.postprocess(batch, self.choose(batch, None, k), k, on_token)
        self.counts["decode_s"] += time.perf_counter() - t0


PROXY = dict(device="cpu", rates=(1000,), n_seqs=256, lengths=(100, 400), long_prompts=0, multi_step=4,
             args=replace(LLAMA_SHAPES["llama-3.2-1b"], dim=64, n_layers=1, n_heads=4, n_kv_heads=1, hidden_dim=64))


def bench_http(device="cuda", rates=(16, 32, 64), n_seqs=320, lengths=(100, 1024), long=(8192, 16384),
               long_prompts=8, multi_step=4, shape="llama-3.2-1b", args=None, proxy=None, log=lambda msg: None) -> dict:
    """`serve-http`: `serve`'s load in process, then through `--serve`'s server on loopback: what HTTP costs."""
    import multiprocessing
    rng = torch.Generator().manual_seed(0)  # the workload's draws, then the arrivals'
    lens, longest, args, model, prompts = serve_workload(rng, device, n_seqs, lengths, long, long_prompts, args, shape)
    tok = L.llama3_tokenizer()  # the server sends text: Llama 3's tokenizer (its vocabulary is the 1B shape's)
    kw = dict(kv_tokens=n_seqs * 1024 + longest, max_batch=min(256, n_seqs), max_seq_len=longest,
              multi_step=multi_step)
    if proxy is not None:
        torch.set_num_threads(1)  # the pool's bookkeeping is the GPU's work: on busy cores, one thread spares waits
    e = ProxyEngine(model, tok, **proxy, **kw) if proxy is not None else L.FastEngine(model, tok, "token", **kw)
    e.warm_up(e.max_batch)
    r = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "shape": shape, "requests": n_seqs,
         "multi_step": e.multi_step, "rates": {}}
    if proxy is not None:
        r["shape"] += f" proxy (a sleep of {e.step_s * 1e3:g} ms per decode step, host work real)"
    draws = {rate: torch.empty(n_seqs).exponential_(rate, generator=rng).cumsum(0).tolist() for rate in rates}
    for rate, arrivals in draws.items():
        cpu = time.process_time()  # this process's CPU seconds: the engine's host work (HTTP's are its own process's)
        x = serve_arrivals(e, prompts, lens, arrivals)
        x = {k: v for k, v in x.items() if k in LATENCY} | {"cpu_s": time.process_time() - cpu}
        r["rates"][rate] = {"in process": x}
        e.reset()
        log(f"{rate} req/s in process: {x}")
    worker = L.EngineThread(e)
    url = f"http://127.0.0.1:{worker.serve_http(socket.create_server(('127.0.0.1', 0)), 'bench', 16, 'warning')}/v1"
    worker.start()
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        for rate, arrivals in draws.items():
            cpu = time.process_time()
            got, client_cpu = pool.apply(http_client, (url, "bench", prompts, lens, arrivals))
            seen, tokens = zip(*got)
            while e.busy:
                time.sleep(0.05)
            e.reset()
            x = r["rates"][rate]["HTTP"] = latency(seen, arrivals, lens)
            x["cpu_s"], x["client_cpu_s"] = time.process_time() - cpu, client_cpu
            x["served_whole"] = list(tokens) == [n for _, n in lens]
            x["cost_vs_in_process"] = r["rates"][rate]["in process"]["output_tok_s"] / x["output_tok_s"] - 1
            log(f"{rate} req/s HTTP: {x}")
    worker.close()
    return r


def http_report(r: dict) -> str:
    lines = [f"{r['device']}, random {r['shape']}, {r['requests']} requests, Poisson arrivals, prefill-first, "
             f"multi-step {r['multi_step']}",
             f"{'rate':>5}  {'path':<11}{'tok/s':>8}{'TTFT p50/p99 ms':>17}{'ITL p50/p99 ms':>16}"
             f"{'TPOT p50/p99 ms':>17}{'CPU s':>7}{'HTTP cost':>10}"]
    for rate, runs in r["rates"].items():
        lines += [f"{rate:>5}  {path:<11}{x['output_tok_s']:>8,.0f}{x['ttft_p50_ms']:>9.0f} /{x['ttft_p99_ms']:>5.0f}"
                  f"{x['itl_p50_ms']:>9.1f} /{x['itl_p99_ms']:>5.0f}{x['tpot_p50_ms']:>9.1f} /{x['tpot_p99_ms']:>6.1f}"
                  f"{x['cpu_s']:>7.2f}" + (f"{x['cost_vs_in_process']:>+10.1%} (client CPU {x['client_cpu_s']:.2f} s)"
                                           if "cost_vs_in_process" in x else "")
                  for path, x in runs.items()]
    whole = all(runs["HTTP"]["served_whole"] for runs in r["rates"].values())
    return "\n".join(lines + [f"CPU s: the engine process's (the HTTP server runs in a process of its own); every HTTP "
                               f"request got its max_tokens: {whole}"])


PREFIX_CONFIGS = {"token": dict(backend="token"), "token, no cache": dict(backend="token", radix=False),
                  "paged 16": dict(backend="paged", block_size=16),
                  "paged 16, no cache": dict(backend="paged", block_size=16, radix=False),
                  "paged 256": dict(backend="paged", block_size=256)}


def shared_document(model, tok, questions=16, doc_tokens=4090, max_new_tokens=32, configs=PREFIX_CONFIGS,
                    rounds=2) -> dict:
    """`questions` requests over one `doc_tokens`-token document through a warm engine per config: hit rate, prefill
    tokens, seconds and throughput, and whether the tokens equal its backend's without the cache."""
    rng, V = torch.Generator().manual_seed(0), model.args.vocab_size
    doc = torch.randint(0, V, (doc_tokens,), generator=rng).tolist()
    prompts = [doc + torch.randint(0, V, (int(torch.randint(16, 65, (), generator=rng)),), generator=rng).tolist()
               for _ in range(questions)]
    longest = max(map(len, prompts)) + max_new_tokens
    rows, outs = {}, {}
    for name, kw in configs.items():
        e = L.FastEngine(model, tok, kv_tokens=questions * (longest + 256), max_batch=questions,
                         max_seq_len=longest + 256, **kw)
        e.warm_up(questions)
        for _ in range(rounds):
            e.reset()
            for p in prompts:
                e.add(p, L.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
            elapsed = seconds(lambda: outs.__setitem__(name, list(e.run().values())))
        st = e.stats
        rows[name] = dict(hit_rate=st["cached_tokens"] / st["prompt_tokens"], cached_tokens=st["cached_tokens"],
                          prefill_computed=st["prefill_tokens"], prefill_s=st["prefill_s"],
                          prefill_tok_s=st["prompt_tokens"] / st["prefill_s"], seconds=elapsed)
        del e
        free()
    for name, row in rows.items():
        plain = name.split(",")[0] + ", no cache"
        if plain in outs:
            row["same_tokens_as_no_cache"] = sum(a == b for a, b in zip(outs[name], outs[plain])) / questions
            row["prefill_vs_no_cache"] = row["prefill_tok_s"] / rows[plain]["prefill_tok_s"]
        if "token" in rows:
            row["saved_vs_token"] = row["cached_tokens"] / max(1, rows["token"]["cached_tokens"])
    return dict(questions=questions, doc_tokens=doc_tokens, prompt_tokens=sum(map(len, prompts)), configs=rows)


def bench_prefix(device="cuda", **kw) -> dict:
    """`prefix`: shared_document on SmolLM2-135M (bf16, where installed) and on the random 1B shape."""
    r = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    try:
        r["smollm2-135m"] = shared_document(L.load_model(None, device, torch.bfloat16)[0], NOTOK, **kw)
    except L.UserError as e:
        r["smollm2-135m"] = {"skipped": str(e)}
    free()
    r["llama-3.2-1b"] = shared_document(random_model(LLAMA_SHAPES["llama-3.2-1b"], device), NOTOK, **kw)
    return r


def prefix_report(r: dict) -> str:
    lines = [f"device: {r['device']}"]
    for model, w in r.items():
        if model == "device":
            continue
        if "skipped" in w:
            lines.append(f"{model}: skipped ({w['skipped']})")
            continue
        lines += [f"{model}: {w['questions']} questions over one {w['doc_tokens']}-token document "
                  f"({w['prompt_tokens']:,} prompt tokens)",
                  f"  {'config':<20}{'hit rate':>9}{'computed':>10}{'prefill s':>10}{'prefill tok/s':>14}"
                  f"{'vs no cache':>12}{'saved vs token':>15}{'same tokens':>12}"]
        for name, c in w["configs"].items():
            lines.append(f"  {name:<20}{c['hit_rate']:>9.1%}{c['prefill_computed']:>10,}{c['prefill_s']:>10.3f}"
                         f"{c['prefill_tok_s']:>14,.0f}{c.get('prefill_vs_no_cache', 1):>11.1f}x"
                         f"{c.get('saved_vs_token', 0):>15.1%}{c.get('same_tokens_as_no_cache', 1):>12.0%}")
    return "\n".join(lines)


QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
             "What is 12 times 12?", "Why is the sky blue?", "Give me a tip for learning to cook.",
             "What is a prime number?", "Describe a cat in one sentence.", "How do plants make food?",
             "What does a KV cache store?", "Tell me a short joke.", "What is the boiling point of water?",
             "Who wrote Romeo and Juliet?", "Explain gravity to a child.", "List three fruits.",
             "What is machine learning?", "How many legs does a spider have?", "Suggest a name for a dog.",
             "What is the largest planet?", "How do I make tea?", "What is photosynthesis?",
             "Write one line about autumn.", "What is the speed of light?", "Why do we sleep?",
             "What is an atom?", "Name a famous painter.", "How does a rainbow form?", "What is 7 plus 8?",
             "Give a synonym for happy.", "What causes wind?", "What is the moon made of?",
             "How do bees make honey?"]


def same_answers(model, tok, prompts, max_new_tokens=96, deterministic=False) -> dict:
    """How many greedy answers in one batch, and again cached, are the same as each prompt's alone."""
    e = L.FastEngine(model, tok, "token", kv_tokens=len(prompts) * (max(map(len, prompts)) + max_new_tokens + 64),
                     max_batch=len(prompts), deterministic=deterministic)
    params = L.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)

    def run(batch, reset=True):
        e.reset() if reset else None
        for p in batch:
            e.add(p, params)
        return list(e.run().values())
    alone, batch = [run([p])[0] for p in prompts], run(prompts)
    cached = run(prompts, reset=False)  # the batch's prompts (and answers) are in the radix cache now
    parted = [[next((i for i, (x, y) in enumerate(zip(o, a)) if x != y), None) for o, a in zip(outs, alone)]
              for outs in (batch, cached)]  # per prompt: the first token unlike alone's (None: the same)
    return dict(prompts=len(prompts), max_new_tokens=max_new_tokens, same_in_batch=parted[0].count(None),
                same_cached=parted[1].count(None), parted_in_batch=parted[0], parted_cached=parted[1],
                cached_tokens=e.stats["cached_tokens"])


def bench_deterministic(device="cuda", n_seqs=256, smollm=True) -> dict:
    """`deterministic`: FastEngine(deterministic=True) vs default: throughput, batch 1, SmolLM2's answers."""
    r = {"device": torch.cuda.get_device_name()}
    if smollm:
        try:
            model, tok = L.load_model(None, device, torch.bfloat16)
            prompts = [tok.chat(q) for q in QUESTIONS]
            r["smollm2_same_answers"] = {m: same_answers(model, tok, prompts, deterministic=m == "deterministic")
                                         for m in ("default", "deterministic")}
        except L.UserError as e:
            r["smollm2_same_answers"] = {"skipped": str(e)}
        free()
    tok, model, prompts, lens = engine_workload(device, n_seqs)
    for mode in ("default", "deterministic"):
        kw = dict(deterministic=mode == "deterministic")
        r[f"serve_1b_{mode}"] = serve_timed(model, tok, prompts, lens, "token", n_seqs * 2048, **kw)
        free()
        r[f"batch1_1b_{mode}_tok_s"] = engine_decode_tok_s(model, tok, prompts[1][:128], 256, **kw)[0]
        free()
    r["serve_ratio"] = r["serve_1b_deterministic"]["tok_s"] / r["serve_1b_default"]["tok_s"]
    r["batch1_ratio"] = r["batch1_1b_deterministic_tok_s"] / r["batch1_1b_default_tok_s"]
    return r


def deterministic_report(r: dict) -> str:
    lines = [f"device: {r['device']}"]
    for mode, a in r.get("smollm2_same_answers", {}).items():
        lines.append(f"SmolLM2 {mode}: {a}" if mode == "skipped" else
                     f"SmolLM2-135M bf16, {a['prompts']} prompts x {a['max_new_tokens']} greedy tokens, {mode}: the "
                     f"same as alone in a batch {a['same_in_batch']}/{a['prompts']}, cached {a['same_cached']}/"
                     f"{a['prompts']}")
    d, x = r["serve_1b_default"], r["serve_1b_deterministic"]
    lines += [f"engine workload (1B shape): default {d['tok_s']:,.0f} tok/s, deterministic {x['tok_s']:,.0f} "
              f"({r['serve_ratio']:.2f}x; prefill {x['prefill_tok_s'] / d['prefill_tok_s']:.2f}x, decode "
              f"{x['decode_tok_s'] / d['decode_tok_s']:.2f}x)",
              f"batch-1 decode (1B shape): default {r['batch1_1b_default_tok_s']:,.0f} tok/s, deterministic "
              f"{r['batch1_1b_deterministic_tok_s']:,.0f} ({r['batch1_ratio']:.2f}x)"]
    return "\n".join(lines)


def cli_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="The engine's benchmarks.")
    sub = ap.add_subparsers(dest="command", required=True)
    dec = sub.add_parser("decode", help="batch-1 decode speed of the engine vs transformers on the same weights")
    dec.add_argument("prompt", nargs="*", default=["What is the capital of France?"], help="one or more prompts "
                     "(each timed alone; default: 'What is the capital of France?')")
    dec.add_argument("--model", help="GGUF file, Meta checkpoint dir or Hugging Face dir "
                     "(default: SmolLM2-135M-Instruct)")
    dec.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    dec.add_argument("--dtype", default="float32", choices=list(L.DTYPES),
                     help="weights and activations (default: float32)")
    dec.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per request (default: 128)")
    dec.add_argument("--no-chat", action="store_true", help="raw text prompts instead of the chat template")
    sub.add_parser("engine", help="GPU: serving benchmark on random Llama 3 shapes")
    srv = sub.add_parser("serve", help="GPU: latency under Poisson arrivals (TTFT, inter-token latency) for "
                         "prefill-first and mixed chunked steps on a random Llama-3.2-1B shape")
    srv.add_argument("--plot", help="save its latency plot (PNG) here")
    srv.add_argument("--simulate", action="store_true", help="on a CPU: the same load through 05's scheduler with no "
                     "model, each step timed by a cost model fitted to the H200 (step_seconds)")
    sub.add_parser("admission", help="GPU: the engine workload at equal KV memory (512 tokens a sequence), outputs to "
                   "max_new_tokens and with early stops, through 05's three admissions on token, paged 16 and "
                   "paged 256")
    http = sub.add_parser("serve-http", help="GPU: serve's Poisson load (prefill-first) in process and through the "
                          "HTTP server (--serve) on loopback: TTFT, ITL, TPOT and what HTTP costs")
    http.add_argument("--cpu-proxy", type=float, metavar="MS", help="on a CPU: 256 requests at once of 100-400 tokens "
                      "through ProxyEngine, its model a sleep of MS ms per decode step (the GPU's host/device split)")
    sub.add_parser("prefix", help="GPU: 16 questions over one 4,090-token document: radix-cache hit rate and "
                   "prefill throughput, token vs paged 16 and 256 vs no cache (SmolLM2-135M, random 1B shape)")
    sub.add_parser("deterministic", help="GPU: FastEngine(deterministic=True) vs default: the engine workload and "
                   "batch-1 decode (1B shape); SmolLM2's answers alone, in a batch and cached")
    for p in sub.choices.values():
        p.add_argument("--json", action="store_true", help="the figures as one JSON object")
    args = ap.parse_args(argv)
    if args.command == "decode" and args.max_new_tokens < 2:
        ap.error(f"--max-new-tokens must be >= 2 (decode is timed as n tokens minus 1), got {args.max_new_tokens}")
    return args


def main(argv=None):
    args = cli_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    proxy, simulate = getattr(args, "cpu_proxy", None) is not None, getattr(args, "simulate", False)
    if args.command != "decode" and not torch.cuda.is_available() and not proxy and not simulate:
        sys.exit(f"error: bench_engine.py {args.command} needs a CUDA GPU")
    runs = {  # command: (its figures, their report)
        "engine": (bench_engine, lambda r: json.dumps(r, indent=1) + "\n" + backends_report(r["backends"]) + "\n" +
                   roofline_report(r["serve_1b"], r["copy_GBps"])),
        "admission": (lambda: {"device": torch.cuda.get_device_name(), **bench_admissions(*engine_workload())},
                      lambda r: r["device"] + "\n" + backends_report(
                          {f"{w}, {b}": rows for w, by in r.items() if w != "device" for b, rows in by.items()})),
        "deterministic": (bench_deterministic, deterministic_report), "prefix": (bench_prefix, prefix_report),
        "serve": (lambda: simulate_serve(log=log, plot=args.plot) if simulate else bench_serve(plot=args.plot, log=log),
                  serve_report),
        "serve-http": (lambda: bench_http(**PROXY, proxy=dict(step_s=args.cpu_proxy / 1e3), log=log) if proxy else
                       bench_http(log=log), http_report)}
    if args.command in runs:
        figures, report = runs[args.command]
        r = figures()
        return print(json.dumps(r) if args.json else report(r))
    try:
        model, tok = L.load_model(args.model, L.parse_device(args.device), L.DTYPES[args.dtype])
        ids = L.encode_prompts(tok, args.prompt, not args.no_chat, args.max_new_tokens, model.args.max_seq_len)
    except (L.UserError, ValueError) as e:
        sys.exit(f"error: {e}")
    r = bench(model, tok, ids, args.max_new_tokens, log=log)
    print(json.dumps(r) if args.json else bench_report(r, args.dtype))


if __name__ == "__main__":
    main()
