"""The foundation: llama3_generate.py's model, loaders and tokenizers against independent references
(transformers' LlamaForCausalLM and tokenizers, Meta's llama_models tokenizer)."""
import importlib
import importlib.util
import json
import os
import re

import pytest
import torch

import llama3_generate as L
from helpers import ROOT, refuses, to_meta_order

CHAT = "What is the capital of France?"
TEXTS = ["Hello world", "naïve café — 東京 🤗🎉 emoji", "def f(x):\r\n    return x ** 2  # ok\r\n", "  two  spaces\t\ttabs\n\n\n",
         "Numbers 12345 and 3.14159, 1,000,000!", "I'm you're they'll WE'VE", "<|im_start|>user\nhi<|im_end|>",
         "<|begin_of_text|><|start_header_id|>user<|end_header_id|>", "x  1  22 333", "\u00a0non-breaking\u2009thin"]


def contiguous(model, batch, length):
    return importlib.import_module("01_kv_cache").ContiguousKVCache.for_model(model, batch, length)


def ban(ids):
    return lambda rows, logits: logits.index_fill_(1, torch.tensor(ids), -float("inf"))


def test_greedy_equals_transformers(smollm, hf_smollm):
    model, tok = smollm
    hf, _ = hf_smollm
    ids = tok.chat(CHAT)
    ours = L.generate(model, contiguous(model, 1, 128), [ids], 32, process_logits=ban(tok.stop_ids))[0]
    x = torch.tensor([ids])
    ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, do_sample=False,
                      suppress_tokens=tok.stop_ids)[0, len(ids):].tolist()
    assert ours == ref
    with torch.no_grad():  # and the logits of the whole sequence
        hl = hf(torch.tensor([ids + ref])).logits[0]
    ol = model(torch.tensor(ids + ref), torch.arange(len(ids) + 32), L.NoCache())
    assert (ol - hl).abs().max() < 1e-3 * hl.abs().max()


def test_batched_greedy_equals_transformers(smollm, hf_smollm):
    model, tok = smollm
    hf, _ = hf_smollm
    prompts = [tok.chat(p) for p in ("Hi", "Name three primary colors and explain why they are called that.", CHAT)]
    ours = L.generate(model, contiguous(model, 3, 128), prompts, 12, process_logits=ban(tok.stop_ids))
    width = max(map(len, prompts))  # transformers batches with left padding and an attention mask
    x = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    ref = hf.generate(x, attention_mask=mask, max_new_tokens=12, do_sample=False, suppress_tokens=tok.stop_ids)
    assert ours == ref[:, width:].tolist()


def test_llama3_tokenizer_equals_meta():
    from llama_models.llama3.tokenizer import Tokenizer as MetaTokenizer
    ours, meta = L.llama3_tokenizer(), MetaTokenizer.get_instance()
    for s in TEXTS:
        assert ours.encode(s) == meta.encode(s, bos=False, eos=False), s
        assert ours.encode(s, bos=True, allow_special=True) == meta.encode(s, bos=True, eos=False, allowed_special="all"), s
        assert ours.decode(ours.encode(s)) == s
    assert ours.special["<|begin_of_text|>"] == 128000 and ours.special["<|eot_id|>"] == 128009
    assert ours.vocab_size == 128256 and ours.stop_ids[0] == 128009


def test_llama3_chat_template():
    tok = L.llama3_tokenizer()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": CHAT}]
    text = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            f"<|start_header_id|>user<|end_header_id|>\n\n{CHAT}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert tok.chat(msgs) == tok.encode(text, allow_special=True)


def test_smollm_tokenizer_equals_transformers(smollm, hf_smollm):
    from tokenizers import pre_tokenizers
    _, tok = smollm
    _, htok = hf_smollm
    # transformers' GGUF converter drops the `tokenizer.ggml.pre = smollm` digit split that SmolLM2's published
    # tokenizer.json and llama.cpp apply; restore it so digits are compared against the real pre-tokenizer.
    htok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    for s in TEXTS + ["\x04control\x06 bytes", "rare plane \U00040000 char", " \x04abc x\x06\x06y"]:
        assert tok.encode(s, allow_special=True) == htok.encode(s, add_special_tokens=False), repr(s)
        assert tok.decode(htok.encode(s, add_special_tokens=False)) == htok.decode(htok.encode(s, add_special_tokens=False))
    ref = htok.apply_chat_template([{"role": "user", "content": CHAT}], add_generation_prompt=True)
    assert tok.chat(CHAT) == list(getattr(ref, "input_ids", ref))


def tiny_hf_model(vocab_size, tie):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab_size, rms_norm_eps=1e-5, max_position_embeddings=512,
                      tie_word_embeddings=tie, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64})
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # bigger than the default init so every weight matters
            p.normal_(0, 0.2)
    return model


def assert_same_logits(ours, hf, vocab_size):
    x = torch.randint(0, vocab_size, (300,))  # long enough that the llama3 rope scaling matters
    with torch.no_grad():
        ref = hf(x[None]).logits[0]
    assert (ours(x, torch.arange(len(x)), L.NoCache()) - ref).abs().max() < 1e-4 * ref.abs().max()


@pytest.mark.parametrize("tie", [False, True])
def test_hf_checkpoint_loads(tmp_path, tie):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    hf = tiny_hf_model(512, tie)
    hf.save_pretrained(tmp_path)  # config.json + model.safetensors
    btok = Tokenizer(models.BPE())
    btok.pre_tokenizer, btok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    btok.train_from_iterator(TEXTS * 20 + [open(L.__file__).read()], trainer)
    btok.save(str(tmp_path / "tokenizer.json"))
    model, tok = L.load_model(str(tmp_path))
    assert model.args.tie_embeddings == tie and model.args.rope_scaling["factor"] == 8.0
    assert_same_logits(model, hf, 512)
    ref = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    for s in TEXTS:
        assert tok.encode(s) == ref.encode(s), s
    assert tok.stop_ids == [tok.special["<|endoftext|>"]] and tok.chat("hi there") == ref.encode("hi there")  # no template


@pytest.mark.parametrize("shards", [1, 2])
def test_meta_checkpoint_loads(tmp_path, shards):
    hf = tiny_hf_model(128256, tie=False)
    cfg, sd = hf.config, hf.state_dict()
    meta = {ours: sd[theirs] for theirs, ours in L.hf_names(cfg.num_hidden_layers).items()}
    for i in range(cfg.num_hidden_layers):  # the inverse of HF's Meta -> HF permutation, written independently
        meta[f"layers.{i}.attention.wq.weight"] = to_meta_order(meta[f"layers.{i}.attention.wq.weight"], 4)
        meta[f"layers.{i}.attention.wk.weight"] = to_meta_order(meta[f"layers.{i}.attention.wk.weight"], 2)
    for s in range(shards):  # model-parallel shards: column-parallel split on dim 0, row-parallel (wo, w2) on dim 1
        part = {k: v if "norm" in k else v.chunk(shards, 1 if k.endswith(("wo.weight", "w2.weight")) else 0)[s].clone()
                for k, v in meta.items()}
        torch.save(part, tmp_path / f"consolidated.{s:02d}.pth")
    # hidden_dim 160 = 32 * ceil(1.875 * int(8 * 64 / 3) / 32) in Meta's formula
    json.dump({"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 128256, "multiple_of": 32,
               "ffn_dim_multiplier": 0.94, "norm_eps": 1e-5, "rope_theta": 500000.0, "use_scaled_rope": True,
               "max_seq_len": 512}, open(tmp_path / "params.json", "w"))
    src = os.path.join(os.path.dirname(importlib.util.find_spec("llama_models").origin), "llama3", "tokenizer.model")
    (tmp_path / "tokenizer.model").write_bytes(open(src, "rb").read())
    hf.config.rope_scaling["original_max_position_embeddings"] = 8192  # what Meta's apply_scaling hard-codes
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hf.config)
    model, tok = L.load_model(str(tmp_path))
    assert model.args.hidden_dim == 160
    assert_same_logits(model, hf, 128256)
    assert tok.encode("hello", bos=True)[0] == 128000


def run_main(capsys, *argv):
    return refuses(SystemExit, L.main, list(argv)).code, capsys.readouterr().err


def test_bad_inputs_are_clear_errors(tmp_path, capsys):
    import gguf
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + os.urandom(64))
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_tensor("x", torch.zeros(4).numpy())
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "meta").mkdir()
    (tmp_path / "meta" / "params.json").write_text("{}")
    cases = [(["--model", str(tmp_path / "nope.gguf")], "not found"),
             (["--model", str(tmp_path / "junk.gguf")], "not a readable GGUF"),
             (["--model", str(tmp_path / "gpt2.gguf")], "unsupported GGUF architecture 'gpt2'"),
             (["--model", str(tmp_path / "empty_dir")], "neither params.json"),
             (["--model", str(tmp_path / "meta")], "consolidated.00.pth"),
             (["--device", "tpu"], "device"), (["--dtype", "float8"], "invalid choice"),
             (["--max-new-tokens", "9000", "hi"], "exceeds the model's context"), ([""], "empty prompt")]
    for argv, msg in cases:
        code, err = run_main(capsys, *argv)
        assert code != 0 and msg in (err + str(code)), (argv, code, err)
        assert "Traceback" not in err


def test_quiet_prints_only_the_completion(smollm, capsys):
    model, tok = smollm
    L.main(["--quiet", "--max-new-tokens", "8", CHAT])
    out = capsys.readouterr().out
    ref = L.generate(model, contiguous(model, 1, 64), [tok.chat(CHAT)], 8, stop_ids=tok.stop_ids)[0]
    assert out == tok.decode([t for t in ref if t not in tok.stop_ids]) + "\n"


def test_sampling_is_seeded_and_top_p_restricts():
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    a = L.sample(logits, 1.0, 0.9, torch.Generator().manual_seed(3))
    assert torch.equal(a, L.sample(logits, 1.0, 0.9, torch.Generator().manual_seed(3)))
    for _ in range(50):  # top_p: every sample lies in the smallest set of tokens whose mass reaches p
        t, p = L.sample(logits, 1.0, 0.5, None), logits.softmax(-1)
        for row in range(4):
            order = p[row].argsort(descending=True)
            assert t[row] in order[: int((p[row][order].cumsum(0) < 0.5).sum()) + 1]
    assert torch.equal(L.sample(logits, 0, 1.0), logits.argmax(-1))


def cli_subprocess(*argv, env=None):
    import subprocess
    import sys
    return subprocess.run([sys.executable, os.path.join(ROOT, "llama3_generate.py"), *argv], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=600)


def test_help_and_bad_numbers():
    """--help says each flag's default; a bad number is one line naming the flag, before the model loads."""
    p = cli_subprocess("--help")
    assert p.returncode == 0, p.stderr
    flags = set(re.findall(r"^  (--[a-z-]+)", p.stdout, re.M))
    assert {"--model", "--max-new-tokens", "--backend", "--json", "--kv-tokens", "--multi-step"} <= flags
    assert p.stdout.count("(default:") >= 10
    for argv, flag in ((["--max-new-tokens", "0"], "--max-new-tokens"), (["--n", "0"], "--n"),
                       (["--top-p", "1.5"], "--top-p"), (["--temperature", "-1"], "--temperature")):
        p = cli_subprocess(*argv, "--model", "/no/such/model.gguf", "hi")
        assert p.returncode != 0 and p.stderr.count("\n") == 1 and flag in p.stderr, (argv, p.stderr)
        assert "Traceback" not in p.stderr and "/no/such" not in p.stderr, (argv, p.stderr)


def test_bad_input_is_one_line(tmp_path):
    """Every refusal: non-zero exit, one line on stderr naming the problem, no traceback, nothing run."""
    class Payload:
        def __reduce__(self):
            return os.system, (f"echo pwned > {tmp_path / 'pwned'}",)
    (tmp_path / "evil").mkdir()
    json.dump({"dim": 64, "n_layers": 1, "n_heads": 4, "vocab_size": 300}, open(tmp_path / "evil" / "params.json", "w"))
    torch.save({"tok_embeddings.weight": Payload()}, tmp_path / "evil" / "consolidated.00.pth")
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "string", "format": "hostname"}')
    cases = [(["--model", str(tmp_path / "evil")], "holds pickled code"),
             (["--regex", "([a-z"], "unterminated character set"),
             (["--regex", "(?:.é|😀+){100}"], "too complex"),
             (["--json-schema", str(schema)], "format 'hostname'"),
             (["--kv-tokens", str(10**14)], "free"),
             (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1")]
    for argv, msg in cases:
        p = cli_subprocess(*argv, "hi")
        err = p.stderr.strip()
        assert p.returncode != 0 and msg in err and "\n" not in err and "Traceback" not in err, (argv, err)
        assert "weights_only=False" not in err
    assert not (tmp_path / "pwned").exists()


READING_PATH = ("01_kv_cache.py", "02_paged_cache_manager.py", "03_token_allocator.py", "04_triton_token_attn.py",
                "05_radix_scheduler.py", "06_jump_forward_fsm.py", "llama3_generate.py")


@pytest.mark.parametrize("name", READING_PATH)
def test_code_files_read_in_lines_of_120_characters(name):
    """The seven files of the README's reading path: no line over 120 characters."""
    long = [i + 1 for i, line in enumerate(open(os.path.join(ROOT, name), encoding="utf-8").read().splitlines())
            if len(line) > 120]
    assert not long, f"{name}: lines over 120 characters: {long}"


def test_every_file_compiles_without_warnings():
    """No source file makes Python warn as it compiles (an invalid escape broke the CLI's quiet output on 3.12)."""
    import glob
    import warnings
    for path in sorted(glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "tests", "*.py"))):
        with open(path, encoding="utf-8") as f, warnings.catch_warnings():
            warnings.simplefilter("error")
            compile(f.read(), path, "exec")
