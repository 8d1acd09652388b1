"""Shared fixtures. GPU tests skip cleanly without CUDA, Triton tests without Triton (it has wheels for Linux
only: `PYTHONPATH=tests/without_triton python -m pytest` runs the suite as on macOS or Windows); the default model
loads once per session."""
import importlib.util
import os

import pytest
import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
if not torch.cuda.is_available():  # Triton kernels run interpreted on a CPU; set before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (torch may, and its @jit helpers are fixed at that import)


def pytest_addoption(parser):
    g = parser.getgroup("workshop", "grade your own copy of a lesson (python tests/workshop.py start 03)")
    g.addoption("--workspace", action="store_true", help="the lessons of the test files run come from workspace/")
    g.addoption("--workspace-dir", help="another workspace folder")
    g.addoption("--exercise", action="append", help="grade only this exercise (alloc, or TokenAllocator.alloc)")


def pytest_configure(config):
    if not config.getoption("workspace") and (config.getoption("exercise") or config.getoption("workspace_dir")):
        raise pytest.UsageError("--exercise and --workspace-dir grade your copy: add --workspace")
    if config.getoption("workspace"):
        import workshop  # tests/workshop.py
        config.pluginmanager.register(workshop.Grader(config), "workshop")
    import llama3_generate  # after TRITON_INTERPRET (and the workspace's import hook)
    llama3_generate.L01.cpu_threads()  # one thread on 2 cores, for this process and those it starts (why: its docstring)


def pytest_collection_modifyitems(config, items):
    for marker, missing, reason in (("gpu", not torch.cuda.is_available(), "needs a CUDA GPU"),
                                    ("triton", not HAVE_TRITON, "needs Triton (Linux only)")):
        if missing:
            for item in items:
                if marker in item.keywords:
                    item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def one_thread():
    """Small batches on a 2-core machine shared with other jobs: one thread avoids oversubscribed thread pools."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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
