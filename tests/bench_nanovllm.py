"""bench_nanovllm.py -- this engine beside nano-vllm (github.com/GeeeekExplorer/nano-vllm) on one CUDA GPU: its
bench.py workload (256 requests, lengths in [100, 1024], EOS ignored) on random Llama-3.2-1B-shaped weights (for
nano-vllm, which runs Qwen3 only, a Qwen3 checkpoint of that shape), the same draw for both, each timed warm.
`pip install git+https://github.com/GeeeekExplorer/nano-vllm` (it needs flash-attn), then:
python tests/bench_nanovllm.py [--nanovllm DIR] [--json]"""
import argparse
import atexit
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import bench_engine as B  # noqa: E402


def qwen3_checkpoint(args, out):
    """A random bf16 Qwen3 checkpoint of ModelArgs' shape as nano-vllm loads it, and a word-level tokenizer."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen3Config
    d, dim, hidden = args.head_dim, args.dim, args.hidden_dim
    cfg = Qwen3Config(vocab_size=args.vocab_size, hidden_size=dim, intermediate_size=hidden, head_dim=d,
                      num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
                      num_key_value_heads=args.n_kv_heads, rms_norm_eps=args.norm_eps, tie_word_embeddings=True,
                      max_position_embeddings=131072, rope_parameters={"rope_type": "default",
                                                                       "rope_theta": args.rope_theta})
    cfg.dtype = torch.bfloat16
    cfg.save_pretrained(out)
    c = json.load(open(os.path.join(out, "config.json")))  # nano-vllm reads config.rope_theta too
    json.dump(c | {"rope_theta": args.rope_theta}, open(os.path.join(out, "config.json"), "w"))
    vocab = {f"t{i}": i for i in range(args.vocab_size)}
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                   unk_token="t0", eos_token=f"t{args.vocab_size - 1}")
    fast.save_pretrained(out)
    rnd = lambda *shape: (torch.randn(*shape, device="cuda") * 0.02).bfloat16().cpu()
    q, kv, w = args.n_heads * d, args.n_kv_heads * d, {}
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        w.update({p + "self_attn.q_proj.weight": rnd(q, dim), p + "self_attn.k_proj.weight": rnd(kv, dim),
                  p + "self_attn.v_proj.weight": rnd(kv, dim), p + "self_attn.o_proj.weight": rnd(dim, q),
                  p + "mlp.gate_proj.weight": rnd(hidden, dim), p + "mlp.up_proj.weight": rnd(hidden, dim),
                  p + "mlp.down_proj.weight": rnd(dim, hidden)})
        w.update({p + n: torch.ones(size, dtype=torch.bfloat16) for n, size in (
            ("self_attn.q_norm.weight", d), ("self_attn.k_norm.weight", d), ("input_layernorm.weight", dim),
            ("post_attention_layernorm.weight", dim))})
    w.update({"model.embed_tokens.weight": rnd(args.vocab_size, dim), "model.norm.weight": torch.ones(dim).bfloat16()})
    save_file(w, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})


def run_nanovllm(path, prompts, lens) -> dict:
    """nano-vllm as its bench.py runs it (temperature 0.6: it refuses greedy), then warm on our draw."""
    from nanovllm import LLM, SamplingParams
    llm = LLM(path, max_model_len=4096)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for _, n in lens]
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
    r, g = {}, torch.Generator().manual_seed(1)
    for run, ids in (("first (compiles)", [torch.randint(0, 10000, (len(p),), generator=g).tolist() for p in prompts]),
                     ("warm", prompts)):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = llm.generate(ids, params, use_tqdm=False)
        torch.cuda.synchronize()
        t = time.perf_counter() - t
        assert [len(o["token_ids"]) for o in out] == [n for _, n in lens]
        r[run] = dict(seconds=t, tok_s=sum(n for _, n in lens) / t)
    llm.exit()
    atexit.unregister(llm.exit)  # done: its own exit hook would run it again
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(description="This engine beside nano-vllm on nano-vllm's bench.py workload.")
    ap.add_argument("--nanovllm", help="a clone of nano-vllm's repository (default: the installed package)")
    ap.add_argument("--seqs", type=int, default=256, help="requests (default: 256, as nano-vllm's bench.py)")
    ap.add_argument("--json", action="store_true", help="the figures as one JSON object")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("error: bench_nanovllm.py needs a CUDA GPU")
    if a.nanovllm:
        sys.path.insert(0, os.path.abspath(a.nanovllm))
    try:
        import nanovllm  # noqa: F401
    except ImportError as e:
        sys.exit(f"error: nano-vllm is not installed ({e}): see this file's docstring")
    shape, (prompts, lens) = B.LLAMA_SHAPES["llama-3.2-1b"], B.draw(a.seqs)
    r = {"device": torch.cuda.get_device_name(), "seqs": a.seqs, "output_tokens": sum(n for _, n in lens)}
    tok, model = B.NOTOK, B.random_model(shape, "cuda")
    for name in ("token", "paged 16"):  # ours first: nano-vllm sizes its KV pool from the memory left free
        r[name] = B.serve_timed(model, tok, prompts, lens, kv_tokens=a.seqs * 2048, **B.BENCH_BACKENDS[name])
    del model
    B.free()
    with tempfile.TemporaryDirectory() as path:
        qwen3_checkpoint(shape, path)
        r["nano-vllm"] = run_nanovllm(path, prompts, lens)
    peer = r["nano-vllm"]["warm"]["tok_s"]
    if a.json:
        return print(json.dumps(r))
    print(f"{r['device']}, {a.seqs} requests, {r['output_tokens']:,} output tokens, bf16, random Llama-3.2-1B shape")
    print(f"  nano-vllm, first run (torch.compile)  {r['nano-vllm']['first (compiles)']['tok_s']:>8,.0f} tok/s")
    print(f"  nano-vllm, warm                       {peer:>8,.0f} tok/s  1.00x")
    for name in ("token", "paged 16"):
        print(f"  this engine, {name:<25}{r[name]['tok_s']:>8,.0f} tok/s  {r[name]['tok_s'] / peer:.2f}x")


if __name__ == "__main__":
    main()
