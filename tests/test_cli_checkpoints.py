"""The command line as a user runs it, on checkpoints written here in all three formats (GGUF, Hugging Face, Meta)
from the same random weights, in two Llama shapes (SmolLM2's attention; GQA-4 with head dim 128): greedy fp32 tokens
equal transformers' `generate` on the same weights, bf16 ones its argmax up to bf16 noise. On a CPU each format runs
as a process of its own; on CUDA (`pytest -m gpu`) every backend, dtype and engine path runs, through main(argv)."""
import copy
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import llama3_generate as L
from helpers import (FORMATS, MAX_NEW, PROMPTS, ROOT, SHAPES, Reference, cli, ctrl_c_reaches, refuses, tokens,
                     write_checkpoints)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{shape: ({format: path}, transformers model)}, written once per test module, fresh weights each session."""
    root, seed = tmp_path_factory.mktemp("ckpt"), int(torch.randint(0, 10**6, ()))
    return {shape: write_checkpoints(str(root), shape, seed + i) for i, shape in enumerate(SHAPES)}


@pytest.fixture(scope="module")
def refs(checkpoints):
    """refs(shape, fmt, device) -> Reference; transformers answers each prompt once per test run and device."""
    cache, peers = {}, {}

    def get(shape, fmt, device):
        if (shape, fmt, device) not in cache:
            paths, hf = checkpoints[shape]
            if (shape, device) not in peers:  # a copy per device: moving the one model would move it under others
                peers[shape, device] = copy.deepcopy(hf).to(device), {}
            peer, memo = peers[shape, device]
            cache[shape, fmt, device] = Reference(paths[fmt], peer, device, memo)
        return cache[shape, fmt, device]
    return get


def check_greedy(checkpoints, refs, shape, fmt, device, prompts, *flags, capsys=None, n=1):
    """The CLI's --json tokens equal transformers' greedy ones (n samples a prompt, all greedy)."""
    ref = refs(shape, fmt, device)
    outs, err, _ = cli("--model", checkpoints[shape][0][fmt], "--json", "--max-new-tokens", str(MAX_NEW), *flags,
                       *prompts, device=device, capsys=capsys)
    assert tokens(outs) == [r for r in ref.greedy(prompts) for _ in range(n)], (shape, fmt, flags)
    return outs, err


# ---- CPU: each format through the CLI, two prompts -----------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_cli_cpu_formats_match_transformers(checkpoints, refs, fmt):
    check_greedy(checkpoints, refs, "smol", fmt, "cpu", PROMPTS[1:3])


# ---- CUDA ----------------------------------------------------------------------------------------------------

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_token_backend_every_format(checkpoints, refs, shape, fmt, capsys):
    """The default backend (token pool, 04's kernels, CUDA graphs, multi-step; the last sequence fused batch-1)."""
    check_greedy(checkpoints, refs, shape, fmt, "cuda", PROMPTS, capsys=capsys)


@gpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("flags", [("paged",), ("paged", "--block-size", "256"), ("contiguous",)],
                         ids=["paged16", "paged256", "contiguous"])
def test_gpu_other_backends(checkpoints, refs, shape, flags, capsys):
    """Paged (16- and 256-slot pages) and contiguous, through the token backend's graphs and multi-step."""
    check_greedy(checkpoints, refs, shape, "hf", "cuda", PROMPTS, "--backend", *flags, capsys=capsys)


@gpu
@pytest.mark.parametrize("prompts,flags", [
    (PROMPTS[2:3], ()),                      # batch 1: fused decode, its k-step graph
    (PROMPTS[2:3], ("--no-fused",)),         # batch 1 through the plain model's graph
    (PROMPTS[1:3], ()),                      # two prompts: the crash of issue 18
    (PROMPTS, ("--eager",)),                 # no CUDA graphs at all
    (PROMPTS, ("--multi-step", "1")),        # one step per host sync
    (PROMPTS, ("--no-radix",)),
    (PROMPTS[:1] * 3, ("--n", "2")),         # repeated prompts and samples: all greedy, all the same
    (PROMPTS[2:3], ("--backend", "paged")),  # batch 1 fused over 02's block table
    (PROMPTS[2:3], ("--backend", "contiguous")),
    (PROMPTS[:1] * 3, ("--n", "2", "--backend", "paged", "--block-size", "256")),
    (PROMPTS[:1] * 3, ("--n", "2", "--backend", "contiguous")),
])
def test_gpu_engine_paths(checkpoints, refs, prompts, flags, capsys):
    n = int(flags[1]) if flags[:1] == ("--n",) else 1
    check_greedy(checkpoints, refs, "smol", "gguf", "cuda", prompts, *flags, capsys=capsys, n=n)


@gpu
def test_gpu_streaming_prints_the_completion(checkpoints, refs, capsys):
    """A single completion streams to stdout; with --quiet it is all the CLI prints."""
    ref = refs("gqa4", "meta", "cuda")
    want = ref.tok.decode([t for t in ref.greedy(PROMPTS[4:5])[0] if t not in ref.tok.stop_ids]) + "\n"
    argv = ("--model", checkpoints["gqa4"][0]["meta"], "--max-new-tokens", str(MAX_NEW))
    _, err, stdout = cli(*argv, PROMPTS[4], device="cuda", capsys=capsys)
    assert stdout == want and "warm-up" in err and "decode" in err
    _, err, stdout = cli(*argv, "--quiet", PROMPTS[4], device="cuda", capsys=capsys)
    assert stdout == want and err == ""


@gpu
def test_gpu_cli_process_is_quiet_and_seeded(checkpoints, capsys):
    """As a process of its own: --quiet prints the completions and nothing else; seeded bf16 sampling draws as here."""
    argv = ("--model", checkpoints["smol"][0]["hf"], "--quiet", "--dtype", "bfloat16", "--temperature", "1.0", "--n",
            "3", "--seed", "7", "--max-new-tokens", "16", *PROMPTS[:2])
    _, _, here = cli(*argv, device="cuda", capsys=capsys)
    _, err, there = cli(*argv, device="cuda")
    assert there == here and len(there.splitlines()) == 6 and err == ""


@gpu
@pytest.mark.parametrize("flags", [("token",), ("paged",), ("paged", "--preempt", "swap"),
                                   ("paged", "--block-size", "256", "--preempt", "swap")],
                         ids=["token", "paged16", "paged16-swap", "paged256-swap"])
def test_gpu_small_pool_preempts(checkpoints, refs, flags, capsys):
    """A pool of about two sequences: requests wait or are preempted (recompute, or swap); the tokens do not change."""
    longest = max(map(len, refs("gqa4", "hf", "cuda").ids(PROMPTS))) + MAX_NEW
    _, err = check_greedy(checkpoints, refs, "gqa4", "hf", "cuda", PROMPTS, "--backend", *flags,
                          "--kv-tokens", str(2 * longest + 16), capsys=capsys)
    assert int(re.search(r"peak KV use (\d+)%", err).group(1)) >= 80, err


@gpu
@pytest.mark.parametrize("backend", ["token", "paged", "contiguous"])
def test_gpu_chunked_and_mixed_steps(checkpoints, refs, backend, capsys):
    """Issue 34: chunked prefill and mixed steps (cutting a radix hit, in a tight pool) give transformers' tokens."""
    longest = max(map(len, refs("gqa4", "hf", "cuda").ids(PROMPTS))) + MAX_NEW
    for flags in (("--chunk-tokens", "5"), ("--schedule", "mixed", "--chunk-tokens", "7"),
                  ("--schedule", "mixed", "--chunk-tokens", "6", "--kv-tokens", str(2 * longest + 16))):
        check_greedy(checkpoints, refs, "gqa4", "hf", "cuda", PROMPTS, "--backend", backend, *flags, capsys=capsys)


@gpu
def test_gpu_shared_prefix_hits_the_radix_cache(checkpoints, refs, capsys):
    doc = "The quick brown fox jumps over the lazy dog. " * 10
    prompts = [doc + q for q in ("Who jumps?", "Who is lazy?", "What color is the fox?")]
    _, err = check_greedy(checkpoints, refs, "smol", "hf", "cuda", prompts, capsys=capsys)
    assert int(re.search(r"radix hit rate (\d+)%", err).group(1)) > 0, err


@gpu
@pytest.mark.parametrize("backend,flags", [("token", ()), ("paged", ("--block-size", "256")), ("contiguous", ())])
def test_gpu_bf16_backends(checkpoints, refs, backend, flags, capsys):
    """bf16 on every backend (paged with 256-token blocks: flash-attn's paged kernel where installed)."""
    ref = refs("gqa4", "gguf", "cuda")
    outs, _, _ = cli("--model", checkpoints["gqa4"][0]["gguf"], "--json", "--dtype", "bfloat16", "--backend", backend,
                     "--max-new-tokens", str(MAX_NEW), *flags, *PROMPTS, device="cuda", capsys=capsys)
    assert len(outs) == len(PROMPTS)
    ref.near_argmax(PROMPTS, [[t for t in o if t not in ref.tok.stop_ids] for o in tokens(outs)], torch.bfloat16)


@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_constrained_and_sampled(checkpoints, tmp_path, dtype, capsys):
    """One-step decode paths: a regex, a JSON schema (jump-forward), temperature sampling with --n; seeded."""
    model, pattern = checkpoints["smol"][0]["hf"], r"(yes|no), [a-z]{2,8}\."
    outs, _, _ = cli("--model", model, "--json", "--dtype", dtype, "--regex", pattern, "--n", "2", "--temperature",
                     "0.9", "--max-new-tokens", "32", *PROMPTS[:3], device="cuda", capsys=capsys)
    assert len(outs) == 6
    for o in outs:
        assert o["finish_reason"] == "length" or re.fullmatch(pattern, o["text"]), o
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"},
                                                                   "n": {"type": "integer"}}, "required": ["ok", "n"]}))
    outs, _, _ = cli("--model", model, "--json", "--dtype", dtype, "--json-schema", str(schema), "--max-new-tokens",
                     "48", *PROMPTS[:2], device="cuda", capsys=capsys)
    for o in outs:
        if o["finish_reason"] != "length":
            v = json.loads(o["text"])
            assert isinstance(v["ok"], bool) and isinstance(v["n"], int), o
    runs = [cli("--model", model, "--json", "--dtype", dtype, "--temperature", "1.0", "--n", "3", "--seed", "7",
                "--max-new-tokens", "16", *PROMPTS[:2], device="cuda", capsys=capsys)[0] for _ in range(2)]
    assert tokens(runs[0]) == tokens(runs[1]) and len(runs[0]) == 6  # seeded: reproducible


# ---- a checkpoint whose config disagrees with itself or its tensors: one line naming the field ---------------

def mutate_gguf(path, key, value):
    """Set a numeric field of a GGUF file in place, or (key "tensor:NAME") rename a tensor or poison it with NaN."""
    import gguf
    r = gguf.GGUFReader(path, "r+")
    if key.startswith("tensor:"):
        t = next(t for t in r.tensors if t.name == key[7:])
        if value == "nan":
            t.data[...] = float("nan")
        else:  # same length: the name bytes are overwritten in place
            t.field.parts[1][:] = list(value.encode())
    else:
        f = r.fields[key]
        f.parts[f.data[0]][0] = value
    del r


def mutate_dir(path, fmt, key, value):
    """params.json / config.json: set (None: delete) a field; "tensor:NAME": drop the tensor, or make it NaN."""
    if key.startswith("tensor:"):
        from safetensors.torch import load_file, save_file
        name, f = key[7:], os.path.join(path, "consolidated.00.pth" if fmt == "meta" else "model.safetensors")
        sd = torch.load(f) if fmt == "meta" else load_file(f)
        sd[name] = sd[name] * float("nan") if value == "nan" else sd.pop(name)[:0]
        sd = {k: v for k, v in sd.items() if v.numel()}  # (a dropped tensor: empty)
        torch.save(sd, f) if fmt == "meta" else save_file(sd, f, metadata={"format": "pt"})
        return
    f = os.path.join(path, "params.json" if fmt == "meta" else "config.json")
    cfg = json.load(open(f))
    if value is None:
        del cfg[key]
    else:
        cfg[key] = value
    json.dump(cfg, open(f, "w"))


# (field, bad value, what the one line must name) per format; the written checkpoints are the "smol" shape:
# width 576, 9 query / 3 KV heads, 2 layers, SwiGLU 1536, tied embeddings
MUTATIONS = {
    "gguf": [(k, v, k) for k, vs in [
        ("llama.block_count", (0, 1, 3)), ("llama.embedding_length", (0, 512)),
        ("llama.attention.head_count", (0, 7, 18)), ("llama.attention.head_count_kv", (0, 2, 9)),
        ("llama.feed_forward_length", (0, 1000)), ("llama.context_length", (0,)),
        ("llama.attention.layer_norm_rms_epsilon", (0.0, float("nan"))), ("llama.rope.freq_base", (-1.0, float("inf")))]
        for v in vs] + [("tensor:blk.1.attn_v.weight", "blk.1.attn_w.weight", "blk.1.attn_v.weight"),
                        ("tensor:blk.1.ffn_norm.weight", "nan", "blk.1.ffn_norm.weight")],
    "meta": [(k, v, k) for k, vs in [
        ("dim", (0, 512, None)), ("n_layers", (0, 1, 3, "2")), ("n_heads", (0, 7, 18)), ("n_kv_heads", (0, 2, 9)),
        ("multiple_of", (0, 1024)), ("norm_eps", (0, -1e-5)), ("rope_theta", (0,)), ("max_seq_len", (0,)),
        ("vocab_size", (100,))] for v in vs] + [
        ("tensor:layers.1.attention.wv.weight", "drop", "layers.1.attention.wv.weight"),
        ("tensor:layers.0.attention_norm.weight", "nan", "layers.0.attention_norm.weight")],
    "hf": [(k, v, k) for k, vs in [
        ("hidden_size", (0, 512)), ("num_hidden_layers", (0, 1, 3)), ("num_attention_heads", (None, 7, 18)),
        ("num_key_value_heads", (0, 2, 9)), ("intermediate_size", (0, 1000)), ("vocab_size", (100, 1000)),
        ("rms_norm_eps", (0,)), ("rope_theta", (0,)), ("max_position_embeddings", (0,))] for v in vs] + [
        ("tensor:model.layers.0.mlp.down_proj.weight", "drop", "model.layers.0.mlp.down_proj.weight"),
        ("tensor:model.norm.weight", "nan", "model.norm.weight")],
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_checkpoint_that_disagrees_with_itself_is_one_line(checkpoints, tmp_path, fmt):
    """A checkpoint field set to a value that does not fit the rest is refused in one line naming it, by the CLI too."""
    import shutil
    src = checkpoints["smol"][0][fmt]
    for i, (key, value, named) in enumerate(MUTATIONS[fmt]):
        path = str(tmp_path / f"{i}{'.gguf' if fmt == 'gguf' else ''}")
        (shutil.copy if fmt == "gguf" else shutil.copytree)(src, path)
        if i == 0:
            L.load_model(path)  # the copy itself is fine
        mutate_gguf(path, key, value) if fmt == "gguf" else mutate_dir(path, fmt, key, value)
        msg = str(refuses(L.UserError, L.load_model, path))
        assert named in msg and "\n" not in msg, (key, value, msg)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "llama3_generate.py"), "--model", path, "Hi"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and p.stderr.startswith("error: ") and named in p.stderr, (
        p.stderr)


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT cannot be sent to a process on Windows")
def test_ctrl_c_is_one_line_and_status_130():
    """Ctrl-C while the CLI streams a completion: one line on stderr, exit status 130, no traceback."""
    import signal
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "llama3_generate.py"), "--ignore-eos",
                          "--max-new-tokens", "1000", "Hi"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         preexec_fn=ctrl_c_reaches)
    assert p.stdout.read(1), "nothing streamed"  # decoding has begun
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and err.endswith("\ninterrupted\n") and "Traceback" not in err, (p.returncode, err)
