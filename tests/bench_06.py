"""bench_06.py -- 06's JSON-schema compiler beside xgrammar and llguidance (optional), on the CPU, on the schemas
held in tests/data and SmolLM2's tokenizer: how many compile, compile time and each token's mask time (p50/p99).

    python tests/bench_06.py            # or: python 06_jump_forward_fsm.py --bench
"""
import argparse
import gzip
import importlib
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
m = importlib.import_module("06_jump_forward_fsm")
SAMPLE = os.path.join(ROOT, "tests", "data", "06_schemas.json.gz")


def bench(tok, path=SAMPLE) -> dict:
    """{engine: {compiled, tokens, compile_ms_p50_p99, mask_us_p50_p99}}, each engine printed as it ends."""
    items, vocab, out = json.load(gzip.open(path)), m.token_trie(tok).token_bytes, {}
    engines = {"06": (lambda s: [m.TokenIndex(m.schema_to_regex(s, strict=False), tok), 0],  # [index, state]; as
                      lambda g: g[0].allowed(g[1]),  # the peers: the specification's reading (strict_mode=False)
                      lambda g, t: g.__setitem__(1, g[0].step(g[1], t)) or g[1] >= 0)}
    try:
        import xgrammar as xgr
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, stop_token_ids=[tok.eos_id])
        xc, bits = xgr.GrammarCompiler(info, max_threads=1), xgr.allocate_token_bitmask(1, len(vocab))
        engines["xgrammar"] = (lambda s: xgr.GrammarMatcher(xc.compile_json_schema(json.dumps(s), strict_mode=False)),
                               lambda g: g.fill_next_token_bitmask(bits), lambda g, t: g.accept_token(t))
    except ImportError:
        print("xgrammar is not installed: pip install xgrammar (to compare with it)")
    try:
        import llguidance as llg
        lt = llg.LLTokenizer(llg.TokenizerWrapper(type("T", (), dict(  # the vocabulary as bytes, as 06 sees it
            tokens=vocab, eos_token_id=tok.eos_id, bos_token_id=None, __call__=lambda _, b: tok.encode(b.decode())))()))
        engines["llguidance"] = (lambda s: llg.LLMatcher(lt, llg.LLMatcher.grammar_from_json_schema(s)),
                                 lambda g: g.compute_bitmask(), lambda g, t: g.consume_token(t))
    except ImportError:
        print("llguidance is not installed: pip install llguidance (to compare with it)")
    for name, (compile_, mask, advance) in engines.items():
        compile_s, mask_s = [], []
        for item in items:
            t0 = time.perf_counter()
            try:
                g = compile_(item["schema"])
                assert not getattr(g, "is_error", bool)()  # llguidance reports its refusals here
            except Exception:  # noqa: BLE001 -- each library refuses in its own way
                continue
            compile_s.append(time.perf_counter() - t0)
            for t in tok.encode(item["document"] or ""):
                t0 = time.perf_counter()
                mask(g)
                mask_s.append(time.perf_counter() - t0)
                if not advance(g, t):
                    break
        q = lambda xs, p, unit: round(float(np.percentile(xs, p)) * unit, 1) if xs else None  # noqa: E731
        out[name] = dict(compiled=f"{len(compile_s)}/{len(items)}", tokens=len(mask_s),
                         compile_ms_p50_p99=[q(compile_s, p, 1e3) for p in (50, 99)],
                         mask_us_p50_p99=[q(mask_s, p, 1e6) for p in (50, 99)])
        print(f"{name:10s} {out[name]}", flush=True)
    return out


if __name__ == "__main__":
    import llama3_generate as L
    L.L01.cpu_threads()  # one thread on 2 cores (why: in its docstring)
    ap = argparse.ArgumentParser(description="06 beside xgrammar and llguidance on held JSON schemas (CPU)")
    ap.add_argument("--model", help="model path (default: SmolLM2-135M-Instruct)")
    bench(L.load_model(ap.parse_known_args()[0].model)[1])  # known: 06's --bench runs this file with its own flags
