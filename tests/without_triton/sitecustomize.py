"""Put this folder first on PYTHONPATH to run anything as on a machine without Triton (macOS, Windows: Triton has
wheels for Linux only), subprocesses and notebook kernels included:

    PYTHONPATH=tests/without_triton python llama3_generate.py "Hi"
    PYTHONPATH=tests/without_triton python -m pytest

Python imports sitecustomize at start-up; a None in sys.modules makes `import triton` raise ImportError and
importlib.util.find_spec("triton") return None, as when it is not installed."""
import sys

sys.modules["triton"] = None
