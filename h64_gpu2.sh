# GPU call 2 (from .h64, SmolLM2 joined into /tmp/site): bench_engine.py deterministic with call 1's config
export PYTHONUNBUFFERED=1 H64_MATMUL_CONFIG=$(cat /tmp/h64_cfg)
echo "matmul config: $H64_MATMUL_CONFIG"
timeout 400 python3 -c "import h64_shim, runpy, sys; sys.argv = ['bench_engine.py', 'deterministic', '--json']; runpy.run_path('tests/bench_engine.py', run_name='__main__')" 2>&1 | tee $OUT/bench.json
