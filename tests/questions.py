"""The notebooks' questions, kept out of them (CS231n and d2l keep a solution out of the notebook the student reads;
nbgrader hides its tests until grading). A notebook asks with one line, `check("03.1", answer)`: the truth is
computed here from the lesson (under WORKSHOP=1 too, never from your copy), then why, and what a tempting wrong
answer misses. Under WORKSHOP=1, where your copy gives another value, one more line says so and how to grade it."""
import collections
import importlib
import importlib.util
import os
import random
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from workshop import LESSONS, ROOT, TESTS, WORKSPACE


@dataclass(frozen=True)
class Question:
    truth: object  # (the lesson's module, *what the check cell passes) -> (value, in words[, the answer -> value])
    right: str     # a right answer and a tempting wrong one, as an attendee writes them (tests/test_notebooks.py)
    tempting: str
    why: str
    wrong: dict = field(default_factory=dict)  # a tempting answer's value -> what it misses
    tells: str = ""     # a regex: what in a notebook's source or output would show the answer before it is given
    close: float = 0.0  # a number's tolerance
    yours: bool = True  # your copy's code computes it (under WORKSHOP=1 it is computed on your copy too)


def check(qid, answer, *given):
    """A question's check: unanswered, one line; right: why; wrong: "not yet", the truth and why."""
    if answer is None:
        return print("your answer first: write it in the cell above (answer = ...), run that cell, then this one")
    q = QUESTIONS[qid]
    value, words, of = (*q.truth(lesson(qid[:2]), *given), None)[:3]
    try:
        got = of(answer) if of else answer
    except Exception as e:  # noqa: BLE001 -- the attendee's line: say what it raised
        print(f"not yet: your answer raised {type(e).__name__}: {e}. Why: {q.why}")
    else:
        miss = next((f" ({m})" for w, m in q.wrong.items() if same(got, w, q.close)), "")
        print(f"right: {words}. Why: {q.why}" if same(got, value, q.close) else
              f"not yet: {f'you said {answer!r}' if of is None else f'your answer gives {got!r}'}, but {words}{miss}. "
              f"Why: {q.why}")
    yours(qid, q, value, given)


def yours(qid, q, value, given):
    """WORKSHOP=1: one line where the attendee's copy computes another value than the lesson."""
    path = os.path.join(os.environ.get("WORKSHOP_DIR") or WORKSPACE, LESSONS[qid[:2]] + ".py")
    if not (os.environ.get("WORKSHOP") and q.yours and os.path.exists(path)):
        return
    try:
        mine = q.truth(load(path, "_copy"), *given)[0]
        said = f"gives {mine!r}"
    except Exception as e:  # noqa: BLE001 -- a body still to write, or one that fails
        mine, said = e, f"raises {type(e).__name__}: {str(e)[:60]}"
    if not same(mine, value, q.close):
        print(f"(your copy {os.path.relpath(path)} {said} here, not the lesson's {value!r}: grade it with "
              f"python -m pytest {TESTS[qid[:2]]} --workspace)")


def lesson(stage):
    """The stage's lesson, from the repository's root (under WORKSHOP=1 its name may import your copy instead)."""
    name, path = LESSONS[stage], os.path.join(ROOT, LESSONS[stage] + ".py")
    mod = importlib.import_module(name)
    return mod if getattr(mod.__spec__.loader, "path", path) == path else load(path, "_lesson")


def load(path, suffix):
    """The module in path, under its name + suffix (the lesson's, loaded once; a copy's, again at every check)."""
    name = os.path.basename(path)[:-3] + suffix
    if suffix == "_lesson" and name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    sys.modules[name] = mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def same(a, b, close=0.0) -> bool:
    a, b = (x.tolist() if hasattr(x, "tolist") else x for x in (a, b))
    if isinstance(a, str) and isinstance(b, str):
        return a.strip().lower() == b.strip().lower()
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return abs(a - b) <= close * abs(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y, close) for x, y in zip(a, b))
    return a == b


# -------- each question's truth, from the lesson ---------------------------------------------------------------

def _row_slots(m):
    c = m.ContiguousKVCache(1, 4, 16, 1, 1)  # 1 layer, 4 rows of max_seq_len 16, 1 head of 1 dim
    c.prepare(["a", "b"], [3, 2])            # a: positions 0..2 in row 0, b: 0..1 in row 1
    pos, rows = c.prepare(["c", "a"], [2, 1]).tolist(), [c.rows["c"], c.rows["c"], c.rows["a"]]
    return (c.tok_slots.tolist(), f"prepare put c's and a's new tokens (rows {rows}, positions {pos}) at slots "
            f"{c.tok_slots.tolist()}", lambda f: [f(r, p) for r, p in zip(rows, pos)])


def _small(L):
    """A small model of SmolLM2's vocabulary: where the tokens a pass computes are counted, not what it says."""
    return L.Transformer(L.ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=32))


def _fed(m, prompt, n=4):
    model, fed = _small(importlib.import_module("llama3_generate")), []
    model.register_forward_pre_hook(lambda mod, args: fed.append(len(args[0])))  # tokens of each forward pass
    m.greedy(model, prompt, n), m.greedy(model, prompt, n, m.StaticKVCache(model, max_seq_len=256))
    return [sum(fed[:n]), sum(fed[n:])], f"{sum(fed[:n])} tokens without a cache, {sum(fed[n:])} with one"


def _max_len_batch(m, max_seq_len=8192):
    batch = m.account(*m.synthetic_trace("sharegpt", 200, 0, max_seq_len), "max_len", 32768, max_seq_len)["batch"]
    return batch, f"max_len runs {batch:g} requests at once"


def _blocks(m):
    """12 blocks of 4: A's 10-token prompt, forked twice, then B writes a token -> (the manager, B's copies)."""
    bm = m.BlockManager(num_blocks=12, block_size=4, watermark=0.0)
    bm.append("A", 10)
    bm.fork("A", "B"), bm.fork("A", "C")
    return bm, bm.append("B", 1)


def _copied(m):
    copies = _blocks(m)[1]
    return list(copies[0]), f"B's write copied (block, into block) {copies}"


def _freed(m):
    bm = _blocks(m)[0]
    bm.append("A", 3), bm.append("C", 1)  # A holds [0, 1, 4, 5] now
    before = set(bm.free_blocks)
    bm.free("A")
    back = sorted(set(bm.free_blocks) - before)
    return back, f"freeing A gave back blocks {back}"


def _block_count(m, sizes=(1, 15, 16, 17, 100)):
    took = []
    for n in sizes:
        bm = m.BlockManager(num_blocks=64, block_size=16, watermark=0.0)
        bm.append("s", n)
        took.append(len(bm.block_tables["s"]))
    return took, f"for n = {list(sizes)} the manager took {took} blocks", lambda f: [f(n) for n in sizes]


def _pool(m, size, give_back, shared=()):
    a = m.TokenAllocator(size)
    a.free(a.alloc(size)[list(give_back)])
    a.inc_ref(torch.tensor(shared, dtype=torch.long)) if shared else None
    return a


def _double_free(m):
    a = _pool(m, 10, [2, 5, 6, 8], [4])
    a.alloc(3), a.alloc_contiguous(1)
    before = a.mem_state.clone()
    try:
        a.free(torch.tensor([7, 7]))
        what = "a" if a.mem_state[7] == 0 else "b"
    except ValueError:
        what = "c" if torch.equal(a.mem_state, before) else "b"
    return what, f"the answer is ({what})"


def _splits_error(m):
    P = m.make_problem([1, 17, 300], n_q_heads=8, n_kv_heads=2, head_dim=64, dtype=torch.float16, seed=0)
    ref = m.reference_decode_attention(*P)
    errs = {s: m.rel_err(m.token_decode_attention(*P, num_splits=s), ref) for s in (1, 2, 5)}
    what = "b" if max(errs.values()) - min(errs.values()) <= 0.1 * max(errs.values()) else "ac"[errs[5] < errs[1]]
    return what, f"({what}): relative errors " + ", ".join(f"{s} splits {e:.2e}" for s, e in errs.items())


def _share(m):
    lse = torch.tensor([2.0, 2.0 + float(torch.tensor(3.0).log())], dtype=torch.float64)
    share = float((lse[1] - lse.logsumexp(0)).exp())
    return share, f"B's share is {share:.2f}"


def _tree(m):
    T = importlib.import_module("03_token_allocator")
    alloc = T.TokenAllocator(64)
    tree = m.RadixCache(alloc)
    for tokens in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8]):  # two requests finish: own slots -> tree, then let go
        slots = alloc.alloc(len(tokens))
        tree.insert(tokens, slots)
        alloc.free(slots)
    return tree, len(tree.match_prefix([1, 2, 3, 4, 5, 6, 9, 9])[0])


def _lpm(m):
    w = [SimpleNamespace(rid=i, prefix=torch.arange(k), node=None, tokens=[0] * 8)
         for i, k in enumerate([2, 5, 0, 5, 1])]
    order = [r.rid for r in m.POLICIES["lpm"](m.RadixCache(), random.Random(0), w)]
    return order, f"lpm ordered them {order}"


def _paged_match(m):
    got = []
    for P in (1, 16, 256):
        t = m.RadixCache(None, page=P)  # no allocator: token ids stand for their slots
        t.insert(list(range(475)) + list(range(1000, 1032)))
        got.append(len(t.match_prefix(list(range(475)) + [5000, 5001])[0]))
    return got, f"at P = 1, 16, 256 the match reused {got} tokens", lambda f: [f(475, P) for P in (1, 16, 256)]


def _first_jump(m, tok):
    jump = lambda rx: m.TokenIndex(rx, tok).jump(0).decode()  # noqa: E731 -- what jump-forward appends at the start
    return jump(r"Answer: (yes|no)"), "the jump from the start must be 'Answer: '", jump


def _jumps(m, tok):
    q = m.TokenIndex(r'\["ok", (yes|no), [0-9]\]', tok)
    got = [q.jump(s).decode() for s in (0, q.dfa.walk(0, b'["ok", y'))]
    return got, f"jump gives {got}"


def _enum(m):
    try:
        d = m.compile_regex(m.schema_to_regex({"type": "integer", "enum": [1, "a"]}))
        what = {(True, True): "a", (True, False): "b"}.get((d.fullmatch("1"), d.fullmatch('"a"')), "?")
    except ValueError:
        what = "c"
    return what, f"the answer is ({what})"


def _fewest_prefill(L, tok, prompts):
    done = {}
    for backend in ("contiguous", "paged", "token"):  # the prompts' prefill counted on a small model, one new token
        engine = L.Engine(_small(L), tok, backend, kv_tokens=2048, max_batch=8, max_seq_len=256)
        for p in prompts:
            engine.add(p, L.SamplingParams(max_new_tokens=1))
        engine.run()
        done[backend] = engine.stats["prefill_tokens"]
    fewest = min(done, key=done.get)
    return fewest, f"{fewest} computed the fewest ({done})"


def _lpm_order(L, tok, mixed):
    engine = L.Engine(_small(L), tok, "token", kv_tokens=400, max_batch=2, max_seq_len=256, policy="lpm")
    for p in mixed:  # the order the scheduler finishes them in, on a small model: every answer 8 tokens long
        engine.add(p, L.SamplingParams(max_new_tokens=8, ignore_eos=True))
    engine.run()
    at = [list(engine.finished).index(i) for i in (2, 4, 6, 8, 10)]
    what = "b" if at == list(range(at[0], at[0] + 5)) else "a"
    return what, f"the answer is ({what}): lpm finished {list(engine.finished)}"


def _page_slots(L):
    kv = importlib.import_module("02_paged_cache_manager").PagedKVCache(1, 8, 4, 1, 1, watermark=0)
    kv.manager.free_blocks = collections.deque([5, 2, 7, 0, 3, 1, 6, 4])  # blocks handed out scattered
    pos = kv.prepare([0, 1], [6, 3]).tolist()
    rows, table = [r for r, n in zip(kv.batch[0], kv.batch[2]) for _ in range(n)], kv.table.tolist()
    return (kv.tok_slots.tolist(), f"prepare put the tokens (rows {rows}, positions {pos}) in slots "
            f"{kv.tok_slots.tolist()}", lambda f: [f(table, 4, r, i) for r, i in zip(rows, pos)])


QUESTIONS = {
    "01.1": Question(
        _row_slots, "lambda r, p: r * 16 + p", "lambda r, p: p * 16 + r",
        "a request's row starts max_seq_len slots after the previous row's start, and its token at position p sits "
        "p slots into its row, written or not: that reserved tail is 01's waste",
        {(2, 18, 48): "that is p * max_seq_len + r: rows and positions swapped"},
        r"r \* 16 \+ p"),
    "01.2": Question(
        _fed, "[154, 40]", "[148, 40]",
        "without a cache each pass feeds the whole sequence again (37 + 38 + 39 + 40); with one, the prompt once, "
        "then only the newest token (37 + 1 + 1 + 1)",
        {(4 * 37, 40): "the sequence grows by one token a pass: 37, 38, 39, 40",
         (37, 4): "the first pass feeds the whole prompt, with or without a cache"},
        r"\b154\b|37 \+ 38"),
    "01.3": Question(
        _max_len_batch, "4", "16",
        "32,768 / 8,192 = 4 rows, whatever the lengths: the mean ShareGPT-like request needs about 500 tokens, so "
        "most of each row is reserved for tokens that never come",
        {16: "that is the batch at max_seq_len 2,048, in the table below: rows four times as long fit a quarter as "
             "many",
         32768 / 499: "that is how many average requests would fit if each took only what it uses (oracle)"},
        r"= 4 rows|runs 4 requests"),
    "02.1": Question(
        _copied, "[2, 3]", "[0, 3]",
        "blocks 0 and 1 are full, so nobody writes into them again: they stay shared. Block 2 holds 2 tokens and "
        "is shared by 3 sequences: B's token would land in A's and C's block, so B gets a copy in the first free "
        "block, 3",
        {(0, 3): "block 0 is full: a full shared block is never written, so never copied",
         (2, 2): "the copy needs a block of its own: block 2 stays A's and C's"},
        r"\(2, 3\)"),
    "02.2": Question(
        _freed, "[4, 5]", "[0, 1, 4, 5]",
        "a block is free again only when nobody holds it: 0 and 1 are still B's and C's (refcount 3 -> 2); 4 and 5 "
        "were A's alone",
        {(0, 1, 4, 5): "0 and 1 are shared with B and C: freeing A only drops one reference on them"},
        r"gave back blocks \[4"),
    "02.3": Question(
        _block_count, "lambda n: (n + 15) // 16", "lambda n: n // 16 + 1",
        "n tokens need n / 16 blocks rounded up: a block is taken only when the last one is full, so 16 tokens fit "
        "in 1 and the 17th opens a second",
        {(1, 1, 2, 2, 7): "n // 16 + 1 is one block too many when n is a multiple of 16",
         (0, 0, 1, 1, 6): "n // 16 rounds down: a partly filled block is still a block"},
        r"\(n \+ 15\) // 16|\[1, 1, 1, 2, 7\]"),
    "03.1": Question(
        lambda m: (t := _pool(m, 10, [2, 5, 6, 8], [4]).alloc(3).tolist(), f"alloc(3) took {t}"),
        "[2, 5, 6]", "[5, 6, 8]",
        "alloc takes the lowest free slots (refcount 0), wherever they are: they need not be neighbours, since "
        "req_to_token remembers each token's slot",
        {(5, 6, 8): "slot 2 is free too: the lowest come first",
         (2, 4, 5): "slot 4 is held twice (refcount 2), not free"},
        r"\[2, 5, 6\]"),
    "03.2": Question(
        _double_free, "'c'", "'a'",
        "slot 7 listed twice loses two references, and it holds one: a double free. free checks every slot before "
        "it changes anything, so the whole call is refused",
        {"a": "listed twice means two references dropped, and it holds one",
         "b": "a refcount below 0 would corrupt the pool: free checks first"},
        r"are not allocated"),
    "03.3": Question(
        lambda m: (t := _pool(m, 16, [1, 4, 5, 6, 9, 10, 11, 12, 14]).alloc_contiguous(4).tolist(),
                   f"alloc_contiguous(4) took {t}"), "[9, 10, 11, 12]", "[1, 4, 5, 6]",
        "the first window of 4 whose free count (c[i + 4] - c[i]) is 4 starts at slot 9; 4, 5, 6 is a run of only "
        "3",
        {(1, 4, 5, 6): "those are the 4 lowest free slots (alloc(4)): not a run",
         (4, 5, 6, 9): "4, 5, 6 is a run of 3; slot 7 is held, so 9 does not continue it"},
        r"\[9, 10, 11, 12\]"),
    "04.1": Question(
        _splits_error, "'b'", "'a'",
        "each split returns its softmax and its log-sum-exp, and the merge weighs them exactly: the split count "
        "changes who computes what, not the sum (up to rounding in the last bits)",
        {"a": "merging partial softmaxes is exact, not an approximation that adds error per split"},
        r"num_splits=\d: +relative error"),
    "04.2": Question(
        _share, "0.75", "1 / 3",
        "a chunk's weight is e^(its lse - the total lse): B's mass is e^ln3 = 3 times A's, so B gets 3 / (1 + 3) "
        "of it",
        {1 / 3: "that is B's mass over A's: the share is over both together",
         0.5: "the chunks are weighed by their softmax mass, not equally"},
        r"3 / \(1 \+ 3\)|share is 0\.75", close=0.01, yours=False),
    "04.3": Question(
        lambda m: (t := [m.choose_num_splits(B, 8, n, 132) for B, n in ((1, 4096), (32, 1024),
                                                                        (8, 16384))],
                   f"choose_num_splits gives {t}"), "[64, 1, 8]", "[66, 1, 8]",
        "1 x 8 = 8 programs fill few SMs: 4 x 132 // 8 = 66, but chunks of at least 64 tokens allow 4096 / 64 = "
        "64; 32 x 8 = 256 programs already cover 132 SMs: no split; 8 x 8 = 64 programs: 528 // 64 = 8",
        {(66, 1, 8): "66 splits would cut 4,096 tokens into chunks under 64 tokens",
         (64, 2, 8): "32 x 8 = 256 programs cover the 132 SMs already: no split"},
        r"splits = 64|= 64;"),
    "05.1": Question(
        lambda m: (n := _tree(m)[1], f"match_prefix found {n} tokens cached"), "6", "3",
        "the walk follows [1 2 3] then [4 5 6]: 6 tokens; 9 9 were never cached. (Only the prompt's very last "
        "token is always left to compute, for its logits: here it is not cached anyway.)",
        {3: "the walk goes on below [1 2 3], into its child [4 5 6]",
         8: "9 9 were never cached"},
        r"match: \[0, 1, 2, 3, 4, 5\]|found 6 tokens"),
    "05.2": Question(
        lambda m: (n := _tree(m)[0].evict(1), f"evict(1) would free {n} tokens"), "2", "3",
        "evict frees whole leaves, least recently used first: [7 8] (t=2); the match just now used [4 5 6] (t=3). "
        "One leaf of 2 tokens covers the 1 asked for",
        {1: "a leaf goes whole, not token by token",
         3: "[4 5 6] was inserted first, but the match just used it (t=3): [7 8] is the least recently used"},
        r"would free 2 tokens"),
    "05.3": Question(
        _lpm, "[1, 3, 0, 4, 2]", "[3, 1, 0, 4, 2]",
        "longest cached prefix first, so the most KV is reused while it is still cached; 1 and 3 tie at 5 and keep "
        "their arrival order",
        {(3, 1, 0, 4, 2): "1 and 3 tie: the earlier arrival goes first",
         (2, 4, 0, 1, 3): "that is shortest first"},
        r"\[1, 3, 0, 4, 2\]"),
    "05.4": Question(
        _paged_match, "lambda n, P: n // P * P", "lambda n, P: -(-n // P) * P",
        "a page is matched whole or not at all: the prefix rounds down to a multiple of P, and the partial last "
        "page is computed again",
        {(475, 480, 512): "rounding up would share tokens the pages do not hold: round down"},
        r"// ?(P|page) ?\* ?(P|page)|\b464\b"),
    "06.1": Question(
        _first_jump, "r'Answer: (yes|no)'", "r'Answer: yes|no'",
        "the first choice must come after the fixed text: 'Answer: ' is one chain of states with one way out, and "
        "(yes|no) is where the model chooses; | binds loosest, so the alternatives need parentheses",
        {"": "your regex lets the first byte vary (| binds loosest: 'Answer: yes|no' is 'Answer: yes' or 'no')",
         "Answer: yes": "yes is fixed text there: the model gets no choice at all"},
        r"Answer: \(yes\|no\)"),
    "06.2": Question(
        _jumps, """['["ok", ', 'es, ']""", """['["ok", ', 'yes, ']""",
        'a jump follows the states with one way out until a real choice: the start must write \'["ok", \' and then '
        "choose y or n; after y, 'es, ' is forced, up to the digit",
        {('["ok", ', 'yes, '): "the y was written already: the jump continues after it",
         ('["ok", y', 'es, '): "y or n is a choice, so the model makes it: the jump stops before it"},
        r"'es, '"),
    "06.3": Question(
        _enum, "'b'", "'a'",
        'a schema is the conjunction of its keywords: enum lists 1 and "a", and type: integer keeps only 1',
        {"a": '"a" is in the enum but not an integer: every keyword must hold at once',
         "c": "1 satisfies both keywords, so the schema has a document"},
        r"-> \(\?:1\)"),
    "07.1": Question(
        _fewest_prefill, "'token'", "'paged'",
        "the contiguous cache shares nothing and computes all 855; paged and token both reuse the cached document, "
        "but paged only in whole blocks of 16, so each question computes the partial last block again; the token "
        "pool shares to the token",
        {"paged": "paged shares whole blocks only: the partial last block of the shared prefix is computed again",
         "contiguous": "a contiguous row shares nothing: every prompt is computed whole"},
        r"prefill tokens computed, radix", yours=False),
    "07.2": Question(
        _lpm_order, "'b'", "'a'",
        "once the document is cached, every waiting question shares a long cached prefix and the unrelated prompts "
        "none: longest prefix first serves the questions back to back, while their prefix is still in the pool",
        {"a": "that is first come first served; lpm looks at what is cached"},
        r"lpm: finished in order", yours=False),
    "07.3": Question(
        _page_slots, "lambda table, P, r, i: table[r][i // P] * P + i % P", "lambda table, P, r, i: table[r][i // P]",
        "the table names the page of each P tokens: token i lies in page i // P, at offset i % P inside it; P = 1 "
        "is the token pool, P = max_len a contiguous row",
        {(5, 5, 5, 5, 2, 2, 7, 7, 7): "that is the page alone: times P, plus the offset inside it"},
        r"i // P\]? ?\* ?P ?\+ ?i % P", yours=False),
}
