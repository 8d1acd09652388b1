"""Shared fixtures. GPU tests skip cleanly without CUDA; the default model loads once per session."""
import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm():
    """(model, tokenizer) of the default SmolLM2-135M-Instruct GGUF, fp32 on CPU."""
    import llama3_generate as L
    return L.load_model()


@pytest.fixture(scope="session")
def hf_smollm():
    """transformers' own GGUF loader on the same file: an independent dequantisation, model and tokenizer."""
    import llama3_generate as L
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = L.default_model_path()
    d, f = os.path.dirname(path), os.path.basename(path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(d, gguf_file=f)
