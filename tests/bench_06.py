"""bench_06.py -- 06's JSON-schema compiler beside xgrammar and llguidance (optional), on the CPU, on the schemas
held in tests/data (MaskBench: SchemaStore, GitHub, Kubernetes, function calling) and SmolLM2's tokenizer for all:
how many compile; compile time (the schema to its first mask); each token's mask time over a valid document, on the
first request (cold) and the next with the same schema (warm); invalid instances accepted; 06's ratios to each peer.

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
from jsonschema.validators import validator_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
m = importlib.import_module("06_jump_forward_fsm")
SAMPLE = os.path.join(ROOT, "tests", "data", "06_schemas.json.gz")


def engines(tok) -> dict:
    """{name: (compile, mask, advance, ends, reset)}: 06 in both readings, and the peers that are installed."""
    vocab, eos = m.token_trie(tok).token_bytes, tok.eos_id
    six = lambda strict: (lambda s: [m.TokenIndex(m.schema_to_regex(s, strict=strict), tok), 0],  # [index, state]
                          lambda g: g[0].allowed(g[1]), lambda g, t: g.__setitem__(1, g[0].step(g[1], t)) or g[1] >= 0,
                          lambda g: g[0].dfa.accept[g[1]], lambda g: g.__setitem__(1, 0))
    out = {"06 strict": six(True), "06 exact": six(False)}
    try:
        import xgrammar as xgr
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, stop_token_ids=[eos])
        xc, bits = xgr.GrammarCompiler(info, max_threads=1), xgr.allocate_token_bitmask(1, len(vocab))
        out["xgrammar"] = (lambda s: xgr.GrammarMatcher(xc.compile_json_schema(json.dumps(s))),  # strict_mode=True
                           lambda g: g.fill_next_token_bitmask(bits), lambda g, t: g.accept_token(t),
                           lambda g: g.accept_token(eos), lambda g: g.reset())
    except ImportError:
        print("xgrammar is not installed: pip install xgrammar (to compare with it)")
    try:
        import llguidance as llg
        lt = llg.LLTokenizer(llg.TokenizerWrapper(type("T", (), dict(  # the vocabulary as bytes, as 06 sees it
            tokens=vocab, eos_token_id=eos, bos_token_id=None, __call__=lambda _, b: tok.encode(b.decode())))()))
        out["llguidance"] = (lambda s: llg.LLMatcher(lt, llg.LLMatcher.grammar_from_json_schema(s)),  # no error
                             lambda g: g.compute_bitmask(), lambda g, t: g.validate_tokens([t]) and g.consume_token(t),
                             lambda g: g.is_accepting(), lambda g: g.reset())
    except ImportError:
        print("llguidance is not installed: pip install llguidance (to compare with it)")
    return out


def bench(tok, path=SAMPLE) -> dict:
    """{engine: {compiled, compile_ms (p50, p99, max), mask_us (p50, p99), warm_mask_us, invalid_accepted}}."""
    items, out = json.load(gzip.open(path)), {}
    for name, (compile_, mask, advance, ends, reset) in engines(tok).items():
        m._compile.cache_clear(), m._group_dfa.cache_clear()  # each reading from scratch
        compile_s, mask_s, bad = [], ([], []), 0
        for item in items:
            t0 = time.perf_counter()
            try:
                g = compile_(item["schema"])
                assert not getattr(g, "is_error", bool)()  # llguidance reports its refusals here
            except Exception:  # noqa: BLE001 -- each library refuses in its own way
                continue
            compile_s.append(time.perf_counter() - t0)
            for warm in (0, 1):  # the first request, then the next with the same schema
                for t in tok.encode(item["document"] or ""):
                    t0 = time.perf_counter()
                    mask(g)
                    mask_s[warm].append(time.perf_counter() - t0)
                    if not advance(g, t):
                        break
                reset(g)
            v = validator_for(item["schema"])(item["schema"])
            for doc in (d for d in item["invalid"] if not v.is_valid(d)):  # as the validator judges it
                bad += all(advance(g, t) for t in tok.encode(json.dumps(doc, ensure_ascii=False))) and bool(ends(g))
                reset(g)
        q = lambda xs, p, unit: round(float(np.percentile(xs, p)) * unit, 1)  # noqa: E731
        out[name] = dict(compiled=len(compile_s), compile_ms=[q(compile_s, p, 1e3) for p in (50, 99, 100)],
                         mask_us=[q(mask_s[0], p, 1e6) for p in (50, 99)],
                         warm_mask_us=[q(mask_s[1], p, 1e6) for p in (50, 99)], invalid_accepted=bad)
        print(f"{name:11s} of {len(items)}: {out[name]}", flush=True)
    for peer in (p for p in out if not p.startswith("06")):  # under 1: 06 takes less time
        ratio = lambda key, i: round(out["06 strict"][key][i] / out[peer][key][i], 2)  # noqa: E731
        print(f"06 strict / {peer}: compile p50 {ratio('compile_ms', 0)}, p99 {ratio('compile_ms', 1)}; "
              f"mask p99 {ratio('mask_us', 1)} (cold), {ratio('warm_mask_us', 1)} (warm)")
    return out


if __name__ == "__main__":
    import llama3_generate as L
    L.L01.cpu_threads()  # one thread on 2 cores (why: in its docstring)
    ap = argparse.ArgumentParser(description="06 beside xgrammar and llguidance on held JSON schemas (CPU)")
    ap.add_argument("--model", help="model path (default: SmolLM2-135M-Instruct)")
    bench(L.load_model(ap.parse_known_args()[0].model)[1])  # known: 06's --bench runs this file with its own flags
