"""Shared fixtures. GPU tests skip cleanly without CUDA; the default model loads once per session."""
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
