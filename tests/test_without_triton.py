"""Where Triton has no wheels (macOS, Windows), what can run does run: the model, the CLI on every backend and the
lessons but 04 load without it, and 04 says in one line that it needs it. `tests/without_triton` (first on
PYTHONPATH) makes `import triton` fail as on such a machine; CI also runs 04's tests and the lessons' demos that way."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_TRITON = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests", "without_triton"), ROOT]))


def python(*args, env=NO_TRITON):
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_no_module_imports_triton_at_load_time():
    """Triton is imported only where a kernel is defined (04), and only when that path runs."""
    code = ("import importlib, sys\n"
            "for n in ('01_kv_cache', '02_paged_cache_manager', '03_token_allocator', '05_radix_scheduler',\n"
            "          '06_jump_forward_fsm', 'llama3_generate'):\n"
            "    importlib.import_module(n)\n"
            "assert 'triton' not in sys.modules, 'a module imported triton at load time'\n")
    p = python("-c", code, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr[-2000:]


def test_lesson_04_says_it_needs_triton_in_one_line():
    p = python("04_triton_token_attn.py")
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().count("\n") == 0 and "needs Triton" in p.stderr and "Linux" in p.stderr
    p = python("-c", "import importlib; importlib.import_module('04_triton_token_attn')")
    assert p.returncode == 1 and p.stderr.strip().splitlines()[-1].startswith("ImportError: 04_triton_token_attn needs")


@pytest.mark.slow
def test_cli_serves_every_backend_without_triton(smollm):
    """The CLI on each backend as on a Mac: the engine's greedy tokens here, one JSON object per prompt."""
    import llama3_generate as L
    prompts = ["Hi", "What is 2 + 2?"]
    model, tok = smollm
    engine = L.Engine(model, tok, kv_tokens=512)
    for p in prompts:
        engine.add(tok.chat(p), L.SamplingParams(max_new_tokens=8))
    want = list(engine.run().values())
    for backend in ("token", "paged", "contiguous"):
        p = python("llama3_generate.py", *prompts, "--json", "--max-new-tokens", "8", "--backend", backend)
        assert p.returncode == 0, p.stderr[-2000:]
        got = [json.loads(line)["token_ids"] for line in p.stdout.splitlines() if line.startswith("{")]
        assert got == want, (backend, got, want)
