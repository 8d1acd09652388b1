"""The README's measured figures are what the commands beside them print: each lesson's `--json` runs here, and the
seeded, deterministic figures the README quotes from it are looked up in its table row as it writes them (timed
figures depend on the machine: the README gives them as ranges). A change that moves a figure fails this test."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_row(lesson: str, what: str, path=os.path.join(ROOT, "README.md")) -> dict:
    """The README's "Measured results" row of `lesson` whose "what" cell starts with `what`."""
    table = open(path).read().split("## Measured results")[1]
    rows = [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in table.splitlines()
            if line.startswith("| ")]
    found = [r for r in rows if r[0] == lesson and r[1].startswith(what)]
    assert len(found) == 1, f"README: {len(found)} rows for lesson {lesson!r}, what {what!r}"
    return dict(zip(("what", "command", "measured"), found[0][1:]))


def lesson_run(script: str, *flags) -> subprocess.Popen:
    """`python SCRIPT --json FLAGS` as the README's reader runs it, started."""
    return subprocess.Popen([sys.executable, os.path.join(ROOT, script), "--json", *flags], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)


def printed(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-2000:]
    return json.loads(out)


@pytest.fixture(scope="module")
def runs(request):
    """The selected lessons' runs, all started at once (one thread each). {command: Popen}."""
    procs = {tuple(it.callspec.params["command"]): None for it in request.session.items
             if getattr(it, "originalname", "") == "test_readme_quotes_what_the_lesson_prints"}
    procs = {c: lesson_run(*c) for c in procs}
    yield procs
    for p in procs.values():
        p.kill()


pct = lambda x: f"{x:.1%}"
pct0 = lambda x: f"{x:.0%}"


def figures_01(j):
    live = j["live_fraction"]
    return {"": [f"{pct(live['max_len'])} / {pct(live['pow2'])} / {pct(live['oracle'])}"]}


def figures_02(j):
    live, batch, saved = j["live_fraction"], j["batch"], j["sharing_saved"]
    return {"live share with blocks": [" / ".join(pct(live[b]) for b in ("1", "16", "256")),
                                       f"{batch['16'] / j['batch_max_len']:.0f}x the running requests of 01"],
            "memory saved by sharing": [" / ".join(f"{100 * saved['parallel'][w]:.1f}" for w in "246") + "%",
                                        " / ".join(f"{100 * saved['beam'][w]:.0f}" for w in "246") + "%"]}


def figures_03(j):
    return {"live share of the token pool": [pct0(j["live_fraction"])]}


def figures_05(j):
    w = j["workloads"]["generated-shared-prefix"]
    sizes = list(w["cache_sizes"])[:2]  # the README quotes the two smaller pools
    runs = [w["cache_sizes"][s] for s in sizes]
    lpm, fcfs = (" / ".join(pct(r[p]["hit_rate"]) for r in runs) for p in ("lpm", "fcfs"))
    waits = " / ".join(f"{r['max_wait_tokens']:,}" for r in j["chunking"]["schedules"].values())
    behind = " / ".join(f"{t:,.0f}" for t in j["chunking"]["behind"].values())
    admission = [f"{early}page {page}: " + ", ".join(" / ".join(f"{r[key]:{f}}" for r in runs.values()) + unit
                                                    for key, f, unit in (("preemptions", "", " preemptions"),
                                                                         ("peak_running", "", " running"),
                                                                         ("throughput", ".2f", "")))
                 for early, (_, by_page) in zip(("", "early stops, "), j["admission"]["workloads"].items())
                 for page, runs in by_page.items()]
    return {"": [f"lpm {lpm} vs fcfs {fcfs} (optimum {pct(w['optimal_hit_rate'])})",
                 f"lpm reaches {pct(j['lpm_of_optimal_mean'])} of optimal"],
            "what": [" / ".join(f"{int(s):,}" for s in sizes) + " slots"],
            "chunked prefill": [f"{waits} tokens", f"first token after {behind} tokens"],
            "admission": admission,
            "pages": [" / ".join(map(pct, w["pages"].values())) + f" (optimum {pct(w['pages_optimal'])})"]}


def figures_06(j):
    (regex, pydantic), ratio = j["runs"], lambda r: f"{r['forward_passes']['masking_only']} vs " \
        f"{r['forward_passes']['jump_forward']} ({r['forward_pass_ratio']:.1f}x"
    return {"": [ratio(regex) + " fewer)", ratio(pydantic) + ")"]}


# (lesson cell, start of the "what" cell, script and flags, its --json -> {README cell: strings it must hold}; the
# key "" is the "measured" cell, "what" the "what" cell, any other key the start of another row of that lesson)
FIGURES = [
    ("01", "live share of a KV pool", ("01_kv_cache.py", "--no-model", "--plot", ""), figures_01),
    ("02", "live share with blocks", ("02_paged_cache_manager.py", "--no-model"), figures_02),
    ("03", "live share of the token pool", ("03_token_allocator.py",), figures_03),
    ("05", "radix-cache hit rate", ("05_radix_scheduler.py",), figures_05),
    ("06", "forward passes, masking only vs jump-forward", ("06_jump_forward_fsm.py",), figures_06),
]


def expected(figures, row, lesson):
    """[(README cell text, string it must hold)] for one FIGURES entry."""
    out = []
    for key, strings in figures.items():
        cell = row["measured"] if key == "" else row["what"] if key == "what" else readme_row(lesson, key)["measured"]
        out += [(cell, s) for s in strings]
    return out


@pytest.mark.parametrize("lesson,what,command,figures", FIGURES, ids=[f[0] for f in FIGURES])
def test_readme_quotes_what_the_lesson_prints(lesson, what, command, figures, runs):
    row = readme_row(lesson, what)
    assert row["command"].startswith(f"`python {command[0]}"), row["command"]
    missing = [f"{s!r} (README has: {cell!r})" for cell, s in expected(figures(printed(runs[command])), row, lesson)
               if s not in cell]
    assert not missing, f"README, lesson {lesson}: the command prints " + "; ".join(missing)


def test_readme_quotes_the_models_parity(smollm, hf_smollm):
    """The model row: greedy tokens identical to transformers' on SmolLM2, and the largest logit difference (~1e-4)."""
    import llama3_generate as L
    (model, tok), hf = smollm, hf_smollm[0]
    ids = tok.chat("What is the capital of France?")
    x = torch.tensor([ids])
    ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, do_sample=False,
                      suppress_tokens=tok.stop_ids)[0, len(ids):].tolist()
    ban = lambda rows, logits: logits.index_fill_(1, torch.tensor(tok.stop_ids), -math.inf)  # as transformers'
    ours = L.generate(model, L.lesson("01_kv_cache").ContiguousKVCache.for_model(model, 1, 128), [ids], 32,
                      process_logits=ban)[0]
    with torch.no_grad():
        diff = float((model(torch.tensor(ids + ref), torch.arange(len(ids) + 32), L.NoCache()) -
                      hf(torch.tensor([ids + ref])).logits[0]).abs().max())
    row = readme_row("model", "SmolLM2-135M greedy tokens and logits vs transformers")
    figure = f"identical tokens, max logit diff ~1e{round(math.log10(diff))}"
    assert ours == ref and figure in row["measured"], (figure, row["measured"], diff)
