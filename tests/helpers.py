"""What several test modules share (no test module imports another): worded checks, tiny random models,
one `serve`, 01's brute-force backend driver, the needle trials, random Llama shapes and their transformers
twin (the benchmarks' too), checkpoints in every format and the command line over them."""
import copy
import importlib
import json
import os
import random
import re
import signal
import subprocess
import sys
from collections import Counter

import numpy as np
import torch

import llama3_generate as L

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
L01 = importlib.import_module("01_kv_cache")


def ctrl_c_reaches():
    """Popen's preexec_fn: SIGINT as from a terminal (a background job's children start with it ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def refuses(exc, fn, *args, what: str = "", match: str = ""):
    """fn(*args) must raise exc, its message matching the regex match; returns it. what: the call in words."""
    try:
        fn(*args)
    except exc as e:
        assert re.search(match, str(e)), f"{what or fn} raised {exc.__name__}({e}), which does not match {match!r}"
        return e
    raise AssertionError(f"{what or fn} did not raise {exc.__name__}")


def tiny_model(seed=0, dtype=torch.float32, device="cpu", **kw):
    """A random 2-layer Llama (GQA 4:2; kw: other ModelArgs), weights of std 0.3: rounding shows."""
    torch.manual_seed(seed)
    args = L.ModelArgs(**{**dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, hidden_dim=128,
                                 max_seq_len=128, rope_theta=10000.0), **kw})
    with torch.device(device):
        model = L.Transformer(args).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model.to(dtype)


def kv_less(page, tokens, rows=4, max_seq_len=None):
    """A pool of `tokens` slots holding no K/V: 03's token pool (page 1) or 02's blocks of `page` tokens."""
    if page == 1:
        return importlib.import_module("03_token_allocator").TokenKVCache(1, tokens, 1, 1, rows, max_seq_len or tokens)
    return importlib.import_module("02_paged_cache_manager").PagedKVCache(
        1, tokens // page, page, 1, 1, watermark=0, max_seqs=rows, max_seq_len=max_seq_len)


def kv_left(e) -> int:
    """KV slots an idle engine holds once its radix cache lets go: only the graphs' padding row's may remain."""
    if e.sched.tree:
        e.sched.tree.evict(e.kv.capacity())
        e.kv.allocator.check()
    pad = {"token": 1, "paged": e.kv.page, "contiguous": 0}[e.backend]  # the graphs' padding row
    return e.kv.used() - (getattr(e, "graphs", None) is not None) * pad


def serve(model, tok, prompts, max_new_tokens, **kw):
    """Each prompt's tokens from a fresh engine (kw: its options), which must end holding no slot. -> (outs, e)."""
    e = L.FastEngine(model, tok, **{"max_batch": len(prompts), "max_seq_len": 128, **kw})
    for p, n in zip(prompts, max_new_tokens):
        e.add(p, L.SamplingParams(max_new_tokens=n))
    outs = list(e.run().values())
    assert kv_left(e) == 0, f"the engine still holds {kv_left(e)} KV slots after every request finished"
    return outs, e


def dense_reference(q, k, v, first):
    """float64 causal GQA attention: query i at position first + i sees keys 0..first + i."""
    n, H, D = q.shape
    k, v = (x.double().repeat_interleave(H // k.shape[1], dim=1) for x in (k, v))
    s = torch.einsum("nhd,lhd->hnl", q.double(), k) / D ** 0.5
    s = s.masked_fill(torch.arange(len(k))[None, :] > first + torch.arange(n)[:, None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)


def backend_against_brute_force(kv, seed, max_seqs=3, max_len=12, steps=40, H=4, D=8):
    """Drive a KVCache backend (room for max_seqs requests of max_len tokens) through random prefills, chunks, decodes
    and frees beside a Python model of every request's K/V: positions, lengths, slots and outputs (float64) checked."""
    g, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    Hkv = kv.layer_pools(0)[0].shape[1]
    for pool in kv.layer_pools(0):
        pool.fill_(1e4)  # poison (finite: a decode gathers masked stale columns too)
    model, slot, next_id = {}, {}, 0  # seq_id -> (K rows, V rows) stored so far; (seq_id, position) -> its slot
    for step in range(steps):
        live = list(model)
        if live and rng.random() < 0.25:  # a request ends: its room goes back
            s = live[rng.integers(len(live))]
            kv.free(s)
            del model[s]
            slot = {k: v for k, v in slot.items() if k[0] != s}
            continue
        seqs = [s for s in live if rng.random() < 0.7 and len(model[s][0]) < max_len]
        if len(model) < max_seqs and rng.random() < 0.6:
            seqs.append(next_id)
            model[next_id], next_id = ([], []), next_id + 1
        if not seqs:
            continue
        decode = rng.random() < 0.5 and all(model[s][0] for s in seqs)
        n_new = [1 if decode else int(rng.integers(1, max_len - len(model[s][0]) + 1)) for s in seqs]
        starts, pos = [len(model[s][0]) for s in seqs], kv.prepare(seqs, n_new)
        call = f"step {step}: prepare({seqs}, {n_new}) with lengths {starts}"
        want = [p for s0, n in zip(starts, n_new) for p in range(s0, s0 + n)]
        assert pos.tolist() == want, f"{call} returned positions {pos.tolist()}; want {want}"
        want = [s0 + n for s0, n in zip(starts, n_new)]
        assert kv.batch_lens.tolist() == want, f"{call} set batch_lens {kv.batch_lens.tolist()}; want {want}"
        slot.update(zip([(s, p) for s, s0, n in zip(seqs, starts, n_new) for p in range(s0, s0 + n)],
                        kv.tok_slots.tolist()))
        assert len(set(slot.values())) == len(slot), f"{call}: two live tokens share a slot (tok_slots " \
            f"{kv.tok_slots.tolist()})"
        for s in model:  # the table maps every live token to its slot
            if model[s][0] or s in seqs:
                n = starts[seqs.index(s)] + n_new[seqs.index(s)] if s in seqs else len(model[s][0])
                got = L01.table_slots(kv.table, [kv.rows[s]], n, kv.page)[0].tolist()
                assert got == [slot[s, p] for p in range(n)], (
                    f"{call}: the table maps request {s}'s {n} tokens to slots {got}; prepare wrote them to "
                    f"{[slot[s, p] for p in range(n)]} (tok_slots)")
        q, k, v = (torch.randn(sum(n_new), h, D, generator=g) for h in (H, Hkv, Hkv))
        out, t = kv.attend(0, q, k, v), 0
        for s, s0, n in zip(seqs, starts, n_new):
            model[s][0].extend(k[t:t + n]), model[s][1].extend(v[t:t + n])
            ref = dense_reference(q[t:t + n], torch.stack(model[s][0]), torch.stack(model[s][1]), s0)
            err = (out[t:t + n].double() - ref).abs().max().item()
            assert err <= 1e-5 + 1e-5 * ref.abs().max().item(), (
                f"{call}: attend's output for request {s} (positions {s0}..{s0 + n - 1}) is off by {err:.2g} from "
                "float64 attention over the request's own K/V, each query seeing the keys up to its position")
            t += n
    for s in list(model):
        kv.free(s)
    assert kv.used() == 0 and len(getattr(kv, "rows", {})) == 0


# ---- deterministic mode's needle: one prompt, alone and in random company ----

NOTOK = type("NoTok", (), {"stop_ids": [], "eos_id": -1})()  # no stop token: max_new_tokens each

NEW = 12  # tokens each needle generates


def needle_model(dtype=torch.float32, device="cpu", seed=0, n_kv_heads=2):
    """tiny_model with head_dim 32 (4 heads, GQA 4:n_kv_heads): the needle tests' model."""
    return tiny_model(seed, dtype, device, dim=128, n_kv_heads=n_kv_heads, hidden_dim=256, max_seq_len=256)


class Engines:
    """One engine per backend, reset between runs (its CUDA graphs stay), its schedule set per run."""

    def __init__(self, model, **kw):
        self.model, self.kw, self.engines = model, kw, {}

    def get(self, backend="token", block_size=16, chunk_tokens=None, schedule="prefill-first", rows=16):
        key = (backend, block_size, rows)
        if key not in self.engines:
            self.engines[key] = L.FastEngine(self.model, NOTOK, backend=backend, block_size=block_size,
                                             kv_tokens=4096, max_batch=rows, **self.kw)
        e = self.engines[key]
        e.reset()
        e.sched.set_schedule(schedule == "mixed", chunk_tokens)
        return e


def needle_run(e, prompts, at: int, params, warm=()):
    """Serve `prompts` together (`warm` first, into the radix cache): the needle's tokens and logprobs."""
    for w in warm:
        e.add(w, L.SamplingParams(max_new_tokens=2))
        e.run()
    first = e.n_seqs
    for i, p in enumerate(prompts):
        other = L.SamplingParams(max_new_tokens=random.randint(1, NEW + 4))
        e.add(p, params if i == at else other)
    e.run()
    seq = next(s for s in e.sched.finished if s.rid == first + at)
    return seq.output, [lp for lp, _ in seq.logprobs]


def trial_options(rng):
    """One trial's company and engine: batch size, cache, chunking, schedule, backend, rows."""
    backend = rng.choice(["token", "paged", "contiguous"])
    return dict(n=rng.randint(2, 10), cached=backend != "contiguous" and rng.random() < 0.5,
                kw=dict(backend=backend, block_size=rng.choice([4, 16]),
                        chunk_tokens=rng.choice([None, rng.randint(8, 40)]),
                        schedule=rng.choice(["prefill-first", "mixed"]), rows=rng.choice([16, 3])))


def needle_trials(model, deterministic: bool, trials: int, seed=0, params=None) -> list:
    """One needle alone, then in `trials` random companies: the trials whose needle differed."""
    rng, vocab = random.Random(seed), model.args.vocab_size
    random.seed(seed)
    words = lambda n: [rng.randrange(vocab) for _ in range(n)]
    needle, params = words(rng.randint(20, 60)), params or L.SamplingParams(max_new_tokens=NEW, logprobs=1)
    engines = Engines(model, deterministic=deterministic)
    alone, moved = needle_run(engines.get(), [needle], 0, params), []
    for t in range(trials):
        o = trial_options(rng)
        others, at = [words(rng.randint(1, 90)) for _ in range(o["n"] - 1)], rng.randrange(o["n"])
        prompts = others[:at] + [needle] + others[at:]
        # a cached prefix: a prompt sharing the needle's first tokens runs before
        warm = [needle[:rng.randint(8, len(needle))] + words(3)] if o["cached"] else []
        if needle_run(engines.get(**o["kw"]), prompts, at, params, warm) != alone:
            moved.append((t, o, at))
    return moved


# ---- random Llama shapes (the GPU machine has no checkpoints) and transformers' twin: the peer ----

LLAMA_SHAPES = {
    "llama-3.2-1b": L.ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, hidden_dim=8192,
                                rope_theta=500000.0, max_seq_len=8192, tie_embeddings=True,
                                rope_scaling={"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 8192}),
    "llama-3-8b": L.ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, hidden_dim=14336,
                              rope_theta=500000.0, max_seq_len=8192, tie_embeddings=False),
}


def random_model(args, device="cuda", dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    with torch.device(device):
        return L.Transformer(args).to(dtype).eval()


def meta_state_dict(model) -> dict:
    """The model's weights under Meta's names: the stacked projections (wqkv, w13) as views of their parts."""
    sd = model.state_dict()
    for i, layer in enumerate(model.layers):
        at, ff = f"layers.{i}.attention.", f"layers.{i}.feed_forward."
        sd.update(zip((at + "wq.weight", at + "wk.weight", at + "wv.weight"), layer.attention.qkv_weights()))
        sd.update(zip((ff + "w1.weight", ff + "w3.weight"), layer.feed_forward.w13.weight.detach().chunk(2)))
        del sd[at + "wqkv.weight"], sd[ff + "w13.weight"]
    return sd


def to_transformers(model):
    """The same weights in transformers' LlamaForCausalLM: the peer for benchmarks and GPU parity tests."""
    from transformers import LlamaConfig, LlamaForCausalLM
    a = model.args
    cfg = LlamaConfig(hidden_size=a.dim, intermediate_size=a.hidden_dim, num_hidden_layers=a.n_layers,
                      num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads, vocab_size=a.vocab_size,
                      rms_norm_eps=a.norm_eps, rope_theta=a.rope_theta, max_position_embeddings=a.max_seq_len,
                      tie_word_embeddings=a.tie_embeddings,
                      rope_scaling=dict(a.rope_scaling, rope_type="llama3") if a.rope_scaling else None)
    w = model.tok_embeddings.weight
    with torch.device(w.device):
        hf = LlamaForCausalLM._from_config(cfg, dtype=w.dtype)
    ours = meta_state_dict(model)
    hf.load_state_dict({k: ours[v] for k, v in L.hf_names(a.n_layers).items() if v in ours},
                       strict=not a.tie_embeddings)
    return hf.eval()


# ---- checkpoints in every format from one random model, and the CLI over them ----

MAX_NEW = 24

PROMPTS = ["Hi", "Name a color.", "What is the capital of France?", "def f(x):\n    return x * 2",
           "Write three words about the sea, then stop.", "torch.cat([a, b], dim=0) joins tensors along a dimension.",
           "Explain the KV cache in one sentence: why does a decode step not recompute the keys of earlier tokens?"]

SHAPES = {  # hidden_dim = Meta's formula for dim with multiple_of 256, so params.json needs nothing more
    "smol": dict(dim=576, n_heads=9, n_kv_heads=3, hidden_dim=1536, tie=True, rope_theta=100000.0),
    "gqa4": dict(dim=1024, n_heads=8, n_kv_heads=2, hidden_dim=2816, tie=False, rope_theta=500000.0),
}

FORMATS = ("gguf", "hf", "meta")


def llama3_special_names():
    """Meta's 256 special tokens in id order, as llama-models names them."""
    names = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
             "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
             "<|eot_id|>", "<|python_tag|>", "<|image|>"]
    return names + [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(names))]


def train_tokenizer():
    """A byte-level BPE with Llama 3's pre-tokenizer regex, 512 tokens + Llama 3's 256 special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(L.LLAMA3_PAT), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(PROMPTS * 20 + [open(os.path.join(ROOT, "llama3_generate.py")).read()], trainer)
    tok.add_special_tokens(llama3_special_names())  # ids 512..767, Meta's order
    return tok


def to_meta_order(w, heads):
    """HF rotates (i, i + d/2); Meta and GGUF store q/k rows in adjacent pairs (2i, 2i+1)."""
    return w.view(heads, 2, w.shape[0] // heads // 2, w.shape[1]).transpose(1, 2).reshape(w.shape)


def stop_early(hf, tok):
    """Make <|eot_id|> a common token's row (x1.01): some completions end early, the others run on."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # (a CPU shared by parallel test workers can crawl)
    hf.to(dev)
    eot, head = tok.special["<|eot_id|>"], hf.get_output_embeddings().weight
    ids = [torch.tensor([tok.chat(p)], device=dev) for p in PROMPTS]
    greedy = lambda: [hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, do_sample=False,
                                  eos_token_id=tok.stop_ids, pad_token_id=0)[0, x.shape[1]:].tolist() for x in ids]
    counts = Counter(t for out in greedy() for t in set(out[2:-2]))
    original = head[eot].clone()
    with torch.no_grad():
        for t in sorted(counts, key=counts.get, reverse=True)[:8]:
            head[eot] = head[t] * 1.01
            lengths = [len(o) for o in greedy()]
            if min(lengths) < MAX_NEW - 2 and max(lengths) == MAX_NEW:
                return hf.cpu()
        head[eot] = original
    raise AssertionError("no token found that makes some completions stop early")


def write_checkpoints(root, shape, seed):
    """One random Llama in each format, all from the same weights and vocabulary. Returns {format: path}, hf model."""
    from transformers import LlamaConfig, LlamaForCausalLM
    s, tok = SHAPES[shape], train_tokenizer()
    vocab = tok.get_vocab_size()
    cfg = LlamaConfig(hidden_size=s["dim"], intermediate_size=s["hidden_dim"], num_hidden_layers=2,
                      num_attention_heads=s["n_heads"], num_key_value_heads=s["n_kv_heads"], vocab_size=vocab,
                      rms_norm_eps=1e-5, rope_theta=s["rope_theta"], max_position_embeddings=2048,
                      tie_word_embeddings=s["tie"])
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():  # large weights: well-separated logits, so greedy ties are vanishingly rare
            p.normal_(0, 0.2)
    paths = {f: os.path.join(root, f"{shape}-{f}" + (".gguf" if f == "gguf" else "")) for f in FORMATS}
    tok.save(os.path.join(root, "tokenizer.json"))
    stop_early(hf, L.hf_tokenizer(os.path.join(root, "tokenizer.json")))
    hf.save_pretrained(paths["hf"])  # config.json + model.safetensors
    tok.save(os.path.join(paths["hf"], "tokenizer.json"))

    ours = {L.hf_names(2)[k]: v.detach().clone() for k, v in hf.state_dict().items() if k in L.hf_names(2)}
    if s["tie"]:
        ours.pop("output.weight", None)
    for i in range(2):
        for w, heads in (("wq", s["n_heads"]), ("wk", s["n_kv_heads"])):
            name = f"layers.{i}.attention.{w}.weight"
            ours[name] = to_meta_order(ours[name], heads)

    os.makedirs(paths["meta"])
    torch.save(ours, os.path.join(paths["meta"], "consolidated.00.pth"))
    json.dump({"dim": s["dim"], "n_layers": 2, "n_heads": s["n_heads"], "n_kv_heads": s["n_kv_heads"],
               "vocab_size": vocab, "multiple_of": 256, "norm_eps": 1e-5, "rope_theta": s["rope_theta"],
               "max_seq_len": 2048}, open(os.path.join(paths["meta"], "params.json"), "w"))
    base = tok.get_vocab(with_added_tokens=False)
    ranks = L._byte_level_ranks(base)  # byte-level strings -> bytes; rank = id
    assert sorted(ranks.values()) == list(range(len(base)))
    import base64
    with open(os.path.join(paths["meta"], "tokenizer.model"), "wb") as f:
        f.writelines(base64.b64encode(b) + b" %d\n" % r for b, r in sorted(ranks.items(), key=lambda x: x[1]))

    import gguf
    w = gguf.GGUFWriter(paths["gguf"], "llama")
    w.add_context_length(2048), w.add_embedding_length(s["dim"]), w.add_block_count(2)
    w.add_feed_forward_length(s["hidden_dim"]), w.add_head_count(s["n_heads"]), w.add_head_count_kv(s["n_kv_heads"])
    w.add_layer_norm_rms_eps(1e-5), w.add_rope_freq_base(s["rope_theta"])
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("llama-bpe")
    by_id = sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda x: x[1])
    w.add_token_list([t for t, _ in by_id])
    w.add_token_types([3 if i >= len(base) else 1 for _, i in by_id])  # 3: control (special)
    gg = {"tok_embeddings": "token_embd", "norm": "output_norm", "output": "output", "attention.wq": "attn_q",
          "attention.wk": "attn_k", "attention.wv": "attn_v", "attention.wo": "attn_output",
          "feed_forward.w1": "ffn_gate", "feed_forward.w3": "ffn_up", "feed_forward.w2": "ffn_down",
          "attention_norm": "attn_norm", "ffn_norm": "ffn_norm"}
    for name, t in ours.items():
        parts = name.split(".")
        key = f"blk.{parts[1]}.{gg['.'.join(parts[2:-1])]}" if parts[0] == "layers" else gg[parts[0]]
        w.add_tensor(key + ".weight", t.float().numpy())
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return paths, hf


def cli(*argv, device, capsys=None):
    """The command line as a process, or (capsys) main(argv) here: (--json's completions, stderr, stdout)."""
    if capsys is not None:
        L.main(["--device", device, *argv])  # an error exits (SystemExit): the test fails with its message
        out, err = capsys.readouterr()
    else:
        cmd = [sys.executable, os.path.join(ROOT, "llama3_generate.py"), "--device", device, *argv]
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
        assert p.returncode == 0 and "Traceback" not in p.stderr, (argv, p.stderr[-3000:])
        out, err = p.stdout, p.stderr
    outs = [json.loads(line) for line in out.splitlines() if line.startswith("{")] if "--json" in argv else None
    return outs, err, out


class Reference:
    """transformers' greedy generate on the same weights, prompt by prompt, cut after the first stop token."""

    def __init__(self, path, hf, device, memo):
        self.model, self.tok = L.load_model(path)  # CPU: tokenizer and the prompt encoding the CLI applies
        self.hf, self.device, self.memo = hf, device, memo

    def ids(self, prompts):
        return L.encode_prompts(self.tok, prompts, True, MAX_NEW, self.model.args.max_seq_len)

    def greedy(self, prompts, n=MAX_NEW):
        out = []
        for ids in self.ids(prompts):
            key = (tuple(ids), n, tuple(self.tok.stop_ids))
            if key not in self.memo:
                x = torch.tensor([ids], device=self.device)
                with torch.no_grad():
                    y = self.hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                         eos_token_id=self.tok.stop_ids, pad_token_id=0)[0, len(ids):].tolist()
                self.memo[key] = y[:next((i + 1 for i, t in enumerate(y) if t in self.tok.stop_ids), len(y))]
            out.append(self.memo[key])
        return out

    def near_argmax(self, prompts, outs, dtype, tol=0.25):
        """bf16: each token ours chose is within tol logit stds of transformers' best (rounding moves logits ~0.05 std,
        a near-tie up to 0.16; a wrong token sits a whole std or more below)."""
        hf = copy.deepcopy(self.hf).to(dtype)  # a copy: rounding the shared model would change later fp32 answers
        for ids, out in zip(self.ids(prompts), outs):
            x = torch.tensor([ids + out], device=self.device)
            with torch.no_grad():
                ref = hf(x).logits[0, len(ids) - 1:-1].float()  # (len(out), vocab)
            gap = ref.max(-1).values - ref[torch.arange(len(out)), torch.tensor(out, device=self.device)]
            assert (gap <= tol * ref.std()).all(), (gap / ref.std()).max()


def tokens(outs):
    """--json completions -> token ids per (prompt, sample), in prompt order."""
    return [o["token_ids"] for o in sorted(outs, key=lambda o: (o["prompt_index"], o["sample"]))]
