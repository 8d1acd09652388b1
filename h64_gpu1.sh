# GPU call 1 (from .h64): the needle test and the Triton checks on the GPU, then the matmul config sweep
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 200 python3 -m pytest -q -p no:cacheprovider -m "gpu or triton" tests/test_deterministic.py 2>&1 | tee $OUT/needle.log | tail -40
timeout 150 python3 h64_triton.py 2>&1 | tee $OUT/matmul.log
