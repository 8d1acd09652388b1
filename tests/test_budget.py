"""The size budget the README states, held here (tinygrad keeps its line count in CI): the seven files' code lines
(not comments, docstrings or blank lines), the core's lines (llama3_generate.py from the top to its banner), tests/'s
lines, and no backslash continuation in the seven. A feature pays for its lines by making something else simpler."""
import ast
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEVEN = ["01_kv_cache.py", "02_paged_cache_manager.py", "03_token_allocator.py", "04_triton_token_attn.py",
         "05_radix_scheduler.py", "06_jump_forward_fsm.py", "llama3_generate.py"]
DEFS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def code_lines(src: str) -> int:
    """Lines that are not blank, not comments and not docstrings (a module's, class's or function's)."""
    doc = set()
    for node in ast.walk(ast.parse(src)):
        first = node.body[0] if isinstance(node, DEFS) and node.body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            doc.update(range(first.lineno, first.end_lineno + 1))
    lines = enumerate(src.splitlines(), 1)
    return sum(1 for i, line in lines if line.strip() and not line.strip().startswith("#") and i not in doc)


def measure(sources: dict) -> dict:
    """sources: path (from the root) -> text. The budget's four figures."""
    seven = [sources[f] for f in SEVEN]
    core = sources["llama3_generate.py"].split("# The core ends here")[0]
    return dict(code=sum(map(code_lines, seven)), core=core.count("\n") - 1,
                tests=sum(s.count("\n") for f, s in sources.items() if f.startswith("tests/")),
                continuations=sum(len(re.findall(r"\\\n", s)) for s in seven))


def over(figures: dict, limits: dict) -> list:
    """What is over budget, a line each."""
    return [f"{k}: {figures[k]:,} lines, over the {limits[k]:,} the README allows" for k in limits
            if figures[k] > limits[k]]


def readme_limits() -> dict:
    """The README's budget line: the seven files' code, the core, tests/ (and no continuation)."""
    text = open(os.path.join(ROOT, "README.md")).read()
    m = re.search(r"at most ([\d,]+) lines of code.*?the core at most ([\d,]+) lines.*?tests/ at most ([\d,]+)",
                  text, re.S)
    assert m, "the README states no budget (the seven files' code, the core, tests/)"
    return dict(zip(("code", "core", "tests"), (int(x.replace(",", "")) for x in m.groups())), continuations=0)


def sources() -> dict:
    files = SEVEN + [os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "tests", "**", "*.py"),
                                                                 recursive=True)]
    return {f: open(os.path.join(ROOT, f)).read() for f in files}


def test_the_project_keeps_the_readme_budget():
    figures = measure(sources())
    assert not over(figures, readme_limits()), over(figures, readme_limits())


def test_one_line_over_budget_is_caught():
    """At the figures as they are, nothing is over; one more line of each kind is, and says which."""
    src = sources()
    exact = measure(src)
    assert not over(exact, exact)
    core = src["llama3_generate.py"].replace("\nclass Engine:", "\nONE_MORE = 1\n\n\nclass Engine:", 1)
    grown = measure({**src, "llama3_generate.py": core})
    assert [line.split(":")[0] for line in over(grown, exact)] == ["code", "core"]
    assert code_lines("'''doc'''\n# a comment\n\nx = 1\n") == 1
    cont = measure({**src, "01_kv_cache.py": src["01_kv_cache.py"] + "x = 1 + \\\n    2\n"})
    assert [line.split(":")[0] for line in over(cont, exact)] == ["code", "continuations"]
    tests = measure({**src, "tests/helpers.py": src["tests/helpers.py"] + "\n"})
    assert over(tests, exact) == [f"tests: {exact['tests'] + 1:,} lines, over the {exact['tests']:,} the README allows"]


def test_the_core_names_nothing_below_its_banner():
    """The core is complete above its banner: it calls, subclasses or reads no name defined below it (the fast
    engine, TP, the server plug in at the seams the core defines), and looks nothing up by getattr."""
    src = open(os.path.join(ROOT, "llama3_generate.py")).read()
    core = src[:src.index("# The core ends here")]
    below = set()
    for node in ast.parse(src).body[len(ast.parse(core).body):]:
        names = [node] if hasattr(node, "name") else getattr(node, "targets", [])
        below |= {n.name if hasattr(n, "name") else n.id for n in names if hasattr(n, "name") or hasattr(n, "id")}
    used = {n.id for n in ast.walk(ast.parse(core)) if isinstance(n, ast.Name)}
    assert not below & used, f"the core names {sorted(below & used)}, defined below its banner"
    assert not {"getattr", "hasattr"} & used, "the core looks an attribute up by name"


if __name__ == "__main__":  # the figures the README's budget line quotes
    print(", ".join(f"{k} {v:,}" for k, v in measure(sources()).items()))
