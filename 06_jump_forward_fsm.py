r"""
06_jump_forward_fsm.py -- constrained decoding with a compressed FSM and jump-forward (SGLang).

    python 06_jump_forward_fsm.py          # SGLang's character-profile regex and a JSON schema, both ways
    python 06_jump_forward_fsm.py --regex '(yes|no), because [a-z ]{1,40}\.' --prompt "Is water wet?"

Make every answer match a regex (or a JSON schema, compiled to one). The SGLang paper's three ways:
  1. per-token FSM masking (Outlines): regex -> finite-state machine; per state, the tokens that keep it
     alive; each step masks the logits to them. One forward pass per token even where nothing is left to
     choose: `", "house": "` costs several passes though the regex fully determines it.
  2. interleaved: the program splits the format by hand into constants (prefilled) and gen() calls.
  3. compressed FSM + jump-forward (SGLang): merge each chain of singular transitions (one way out) into one
     edge labelled by its string; on reaching one, append it whole -- many tokens in one forward pass:

        state 7 --"G"--> 8 ====== 'ryffindor", "age": ' ======> 30       compressed edges
                --"S"--> 9 ====== 'lytherin", "age": ' =======> 30

The tokenization boundary: after `Gryffindor`, appending the jump string `", "age": ` as its own tokens feeds
the model `"` then `, "` -- a split it never saw in training, where `",` is one token. So SGLang re-tokenizes
prompt + output + jump string, keeps the longest common token prefix with what the model has seen, and
recomputes the K/V of the rest in one extend pass. We re-encode output + jump after the fixed prompt ids
(the chat template ends at a special token, so the two agree; SGLang bails out when they "fuse"). KV: 01's
contiguous cache plus `truncate`; the engine reuses the prefix through 05's radix cache instead. Masking
alone drifts too: made to spell `"blood status"`, a small model picks fragments (`b`, `l`, `oo`, `d`, ...),
emitting far more tokens than the tokenizer would for the same text; the report prints both counts.

    regex --parse--> AST --Thompson--> byte NFA --subsets--> byte DFA --tokenizer bytes, trim--> TokenIndex
    "[a-c]{2}"   ("rep", ("set", ((97, 99),)), 2, 2)    table (n_states, 256) int32, -1 = dead    masks, jumps

Hand-written: the automaton IS the lesson. Why bytes: BPE tokens are byte strings, and 313 SmolLM2 tokens are
not valid UTF-8 alone (pieces of emoji, CJK); a byte DFA walks every token alike. Classes are sorted code-
point ranges (never 1.1M-entry tables) that Thompson compiles to UTF-8 byte-range sequences (RE2's split),
so the table is 256 wide; jump strings are cut at a character boundary before re-tokenizing. Syntax:
literals, escapes, [classes] with ranges and ^, `.`, * + ? {m} {m,} {,n} {m,n} (and lazy forms), |, (...),
(?:...). \w \d \s are ASCII (re.ASCII), as in interegular, the parser Outlines and SGLang used (Unicode \w,
~700 ranges, puts hundreds of mid-character states in each repetition of `[\w]{1,16}`); the rest is Unicode.

SmolLM2 lacks 21 byte values (some ASCII controls, 0xF1, 0xF2, bytes UTF-8 never uses): the DFA keeps only
bytes the vocabulary has, then only states that can still accept. Each kept byte is itself a token, so a
live byte path is a token path: decoding never reaches a state with no allowed token unless it may stop.
JSON schema -> regex, fixed whitespace policy: json.dumps' layout (one line, ", " between items, ": " after
keys), every property present, in schema order -- keys, quotes and separators all become jump strings.
The subset is exact or refused, never ignored: type string (minLength/maxLength counted in characters, an
anchored `pattern` over characters JSON writes unescaped, format uuid/ipv4), integer (minimum, maximum,
exclusiveMinimum/Maximum as exact digit ranges), number, boolean, null, object (properties, required,
additionalProperties), array (items, minItems/maxItems), enum, const, anyOf, and annotations (title,
description, ...). Any other keyword (multipleOf, uniqueItems, oneOf, not, ...) is refused by name.
Subset construction can blow up (`(?:.é|😀+){100}` has 122,600 states): past 20,000 states a regex is refused.

References: Zheng et al., "SGLang: Efficient Execution of Structured Language Model Programs" (2024) and the
LMSYS blog "Fast JSON Decoding for Local LLMs with Compressed Finite State Machine" (2024); Willard & Louf,
"Efficient Guided Generation for LLMs" (Outlines, 2023); Thompson (1968); Russ Cox, "Regular Expression
Matching Can Be Simple And Fast"; Rust regex-syntax's utf8.rs.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import math
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

K01 = importlib.import_module("01_kv_cache")

MAX_CHAR = 0x10FFFF
ASCII_CLASSES = {"d": ((48, 57),), "w": ((48, 57), (65, 90), (95, 95), (97, 122)), "s": ((9, 13), (32, 32))}
ESCAPES = {"n": 10, "t": 9, "r": 13, "f": 12, "v": 11, "a": 7}


# -------- Regex -> AST. A character set is a tuple of code-point ranges ((lo, hi), ...) -----------

def _negate(ranges):
    """The code points in none of the ranges, as sorted ranges."""
    out, nxt = [], 0
    for lo, hi in sorted(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = max(nxt, hi + 1)
    return tuple(out + [(nxt, MAX_CHAR)] * (nxt <= MAX_CHAR))


class _Parser:
    """Recursive descent: alt := cat ('|' cat)*; cat := (atom quantifier?)*.
    AST: ("set", ranges) | ("cat", [nodes]) | ("alt", [nodes]) | ("rep", node, lo, hi or None)."""

    def __init__(self, pattern: str):
        self.p, self.i = pattern, 0

    def error(self, msg, at=None):
        raise ValueError(f"invalid regex {self.p!r}: {msg} at position {self.i if at is None else at}")

    def peek(self):
        return self.p[self.i] if self.i < len(self.p) else None

    def take(self):
        self.i += 1
        return self.p[self.i - 1]

    def parse(self):
        node = self.alt()
        return node if self.i == len(self.p) else self.error("unbalanced parenthesis")  # only ')' stops alt()

    def alt(self):
        branches = [self.cat()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.cat())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def cat(self):
        items = []
        while self.peek() not in (None, "|", ")"):
            node, q = self.atom(), self.quantifier()
            if q:
                self.i += self.peek() == "?"  # lazy x*? matches the same strings
                if self.quantifier(peek=True):
                    self.error("multiple repeat (possessive quantifiers are not supported)")
                node = ("rep", node, *q)
            items.append(node)
        return ("cat", items)

    def quantifier(self, peek=False):
        """-> (lo, hi or None), consumed unless peek, or None. A `{` that is no quantifier is a literal."""
        c, at = self.peek(), self.i
        if c in ("*", "+", "?"):
            q, end = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c], at + 1
        elif c == "{" and "}" in self.p[at:]:
            end = self.p.index("}", at) + 1
            lo, comma, hi = self.p[at + 1:end - 1].partition(",")
            if not (lo or comma) or not all(x == "" or x.isascii() and x.isdigit() for x in (lo, hi)):
                return None
            q = (int(lo or 0), None if comma and not hi else int(hi or lo))
            if q[1] is not None and q[0] > q[1]:
                self.error("min repeat greater than max repeat", at)
            if max(q[0], q[1] or 0) > 1000:
                self.error("repeat count above 1000", at)
        else:
            return None
        self.i = at if peek else end
        return q

    def atom(self):
        if self.quantifier(peek=True):
            self.error("nothing to repeat")
        c = self.take()
        if c == "(":
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                self.error("unsupported group syntax '(?' (only (...) and (?:...))")
            node = self.alt()
            self.i += 1
            return node if self.p[self.i - 1:self.i] == ")" else self.error("missing ), unterminated subpattern")
        if c in "^$":
            self.error(f"anchor {c!r} is not supported (the whole output must match anyway)", self.i - 1)
        if c == ".":
            return ("set", _negate([(10, 10)]))  # everything but a newline, as without re.DOTALL
        return ("set", self.charclass() if c == "[" else self.escape(False) if c == "\\" else ((ord(c), ord(c)),))

    def escape(self, in_class):
        r"""After a backslash: \d \w \s (ASCII) and complements, \n \t ..., \xhh \uhhhh \Uhhhhhhhh, punctuation."""
        if self.i >= len(self.p):
            self.error("trailing backslash")
        c = self.take()
        if c.lower() in ASCII_CLASSES:
            return _negate(ASCII_CLASSES[c.lower()]) if c.isupper() else ASCII_CLASSES[c]
        if c in ESCAPES or (c == "b" and in_class):
            code = ESCAPES.get(c, 8)
        elif c in "xuU":
            digits = self.p[self.i:self.i + {"x": 2, "u": 4, "U": 8}[c]]
            if len(digits) < {"x": 2, "u": 4, "U": 8}[c] or any(d not in "0123456789abcdefABCDEF" for d in digits) \
                    or int(digits, 16) > MAX_CHAR:
                self.error(f"incomplete escape \\{c}{digits}")
            self.i, code = self.i + len(digits), int(digits, 16)
        elif c.isascii() and c.isalnum():
            self.error(f"unsupported escape \\{c}", self.i - 2)  # backreferences, \b, \A, \Z ...
        else:
            code = ord(c)  # escaped punctuation is itself
        return ((code, code),)

    def charclass(self):
        negate = self.peek() == "^"
        self.i += negate
        ranges, start = [], self.i
        while self.peek() != "]" or self.i == start:  # a leading ] is literal
            if self.i >= len(self.p):
                self.error("unterminated character set", start - 1 - negate)
            c = self.take()
            lo = self.escape(True) if c == "\\" else ((ord(c), ord(c)),)
            if self.peek() == "-" and self.p[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                c = self.take()
                hi = self.escape(True) if c == "\\" else ((ord(c), ord(c)),)
                if len(lo) + len(hi) != 2 or lo[0][0] != lo[0][1] or hi[0][0] != hi[0][1] or lo[0][0] > hi[0][0]:
                    self.error("bad character range")
                lo = ((lo[0][0], hi[0][0]),)
            ranges += lo
        self.i += 1
        return _negate(ranges) if negate else tuple(sorted(ranges))


# -------- AST -> byte NFA (Thompson) -> byte DFA (subset construction) ----------------------------

def utf8_ranges(lo, hi):
    """Code points lo..hi -> byte-range sequences ((b0_lo, b0_hi), (b1_lo, b1_hi), ...) matching exactly
    their UTF-8 encodings: split until each byte position is one range. Surrogates are skipped."""
    out, todo = [], [(lo, hi)]
    while todo:
        lo, hi = todo.pop()
        split = next((m for m in (0x7F, 0x7FF, 0xD7FF, 0xDFFF, 0xFFFF) if lo <= m < hi), None)
        if split is not None:  # different encoded lengths (or the surrogate block) on each side
            todo += [(lo, split), (split + 1, hi)]
            continue
        if 0xD800 <= lo <= 0xDFFF:
            continue
        for i in (1, 2, 3):  # lo must start, and hi end, a full block of the trailing i continuation bytes
            m = (1 << 6 * i) - 1
            if lo & ~m != hi & ~m and lo & m:
                todo += [(lo, lo | m), ((lo | m) + 1, hi)]
                break
            if lo & ~m != hi & ~m and hi & m != m:
                todo += [(lo, (hi & ~m) - 1), (hi & ~m, hi)]
                break
        else:
            out.append(tuple(zip(chr(lo).encode(), chr(hi).encode())))
    return out


class _NFA:
    def __init__(self):
        self.eps, self.edges = [], []  # per state: [target], [(lo_byte, hi_byte, target)]

    def state(self):
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def build(self, node):
        """Thompson construction -> (start, end) of node's fragment."""
        kind, s = node[0], self.state()
        if kind == "set":
            tails = {(): self.state()}  # one state per distinct remaining byte-range suffix, shared

            def tail(seq):
                if seq not in tails:
                    tails[seq] = self.state()
                    self.edges[tails[seq]].append((*seq[0], tail(seq[1:])))
                return tails[seq]
            self.edges[s] += [(*seq[0], tail(seq[1:])) for lo, hi in node[1] for seq in utf8_ranges(lo, hi)]
            return s, tails[()]
        if kind == "alt":
            e = self.state()
            for a, b in map(self.build, node[1]):
                self.eps[s].append(a)
                self.eps[b].append(e)
            return s, e
        e = s  # cat, or a repeat: its lo mandatory copies first
        for a, b in map(self.build, node[1] if kind == "cat" else [node[1]] * node[2]):
            self.eps[e].append(a)
            e = b
        if kind == "cat":
            return s, e
        end = self.state()
        if node[3] is None:  # x{lo,}: then a loop
            a, b = self.build(node[1])
            self.eps[e] += [a, end]
            self.eps[b] += [a, end]
        else:  # x{lo,hi}: then hi - lo nested optional copies, x(x(x)?)?
            for a, b in map(self.build, [node[1]] * (node[3] - node[2])):
                self.eps[e] += [a, end]
                e = b
            self.eps[e].append(end)
        return s, end

    def closure(self, states):
        return frozenset(_reach(self.eps, states))


def _reach(adj, seeds) -> set:
    """Everything reachable from seeds along adj[state] = [next states] (epsilon closures, live states)."""
    seen, todo = set(seeds), list(seeds)
    while todo:
        for t in adj[todo.pop()]:
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return seen


MAX_DFA_STATES = 20_000  # ~40x the largest automaton the lessons build; a hostile pattern is refused in seconds


def _determinize(nfa, start, accept, max_states=MAX_DFA_STATES):
    """Subset construction; each DFA state's bytes split into intervals with the same NFA targets. Subsets can
    be exponentially many (`(?:.é|😀+){100}` has 122,600): past max_states the regex is refused."""
    sets = [nfa.closure([start])]
    ids, rows = {sets[0]: 0}, []
    while len(rows) < len(sets):
        if len(sets) > max_states:
            raise ValueError(f"regex too complex: its automaton passes {max_states:,} states (nested repeats of "
                             f"alternatives that overlap multiply them); simplify the pattern")
        edges = [e for s in sets[len(rows)] for e in nfa.edges[s]]
        row = np.full(256, -1, np.int32)
        cuts = sorted({lo for lo, _, _ in edges} | {hi + 1 for _, hi, _ in edges})
        for a, b in zip(cuts, cuts[1:]):
            targets = nfa.closure({t for lo, hi, t in edges if lo <= a and b - 1 <= hi})
            if targets:
                if targets not in ids:
                    ids[targets] = len(sets)
                    sets.append(targets)
                row[a:b] = ids[targets]
        rows.append(row)
    return np.stack(rows), np.array([accept in s for s in sets])


def _trim(table, accept):
    """Keep the states on some path start -> accepting (start stays 0); transitions elsewhere become -1."""
    src, byte = np.nonzero(table >= 0)
    succ, pred = [[] for _ in table], [[] for _ in table]
    for a, b in np.unique(np.stack([src, table[src, byte]], 1), axis=0).tolist():
        succ[a].append(b)
        pred[b].append(a)
    live = _reach(pred, np.flatnonzero(accept).tolist())  # can still accept
    if 0 not in live:
        return np.full((1, 256), -1, np.int32), np.zeros(1, bool)  # the empty language
    keep = np.zeros(len(table), bool)
    keep[list(_reach([[t for t in ts if t in live] for ts in succ], [0]))] = True
    new = np.full(len(table) + 1, -1, np.int32)  # new[-1] = -1 keeps dead transitions dead
    new[np.flatnonzero(keep)] = np.arange(keep.sum())
    return new[table[keep]], accept[keep]


@dataclass
class DFA:
    """Byte-level DFA: table (n_states, 256) int32 = next state or -1 (dead); accept (n_states,); start 0."""
    table: np.ndarray
    accept: np.ndarray

    def walk(self, state: int, data: bytes) -> int:
        for b in data:
            if state < 0:
                break
            state = int(self.table[state, b])
        return state

    def fullmatch(self, text: str) -> bool:
        s = self.walk(0, text.encode("utf-8", "surrogatepass"))
        return s >= 0 and bool(self.accept[s])

    def restrict(self, alphabet: np.ndarray) -> "DFA":
        """Only the bytes alphabet (256,) bool allows, trimmed again."""
        return DFA(*_trim(np.where(alphabet[None, :], self.table, -1), self.accept))


@functools.lru_cache(maxsize=64)
def compile_regex(pattern: str) -> DFA:
    nfa = _NFA()
    return DFA(*_trim(*_determinize(nfa, *nfa.build(_Parser(pattern).parse()))))


# -------- Token-level index and the compressed FSM ------------------------------------------------

@dataclass
class TokenTrie:
    """Every non-special token's bytes as a trie, nodes sorted by (length, bytes) so that node k's children
    are the contiguous nodes first[k]:first[k + 1]. Node 0 is the root."""
    first: np.ndarray     # (n_nodes + 1,) offsets of each node's children
    byte: np.ndarray      # (n_nodes,) byte on the edge into each node
    token_at: np.ndarray  # (n_nodes,) the token whose bytes end at this node, or -1
    token_bytes: list     # token id -> bytes (b"" for special tokens)
    alphabet: np.ndarray  # (256,) bool: the bytes that are one-byte tokens


@functools.lru_cache(maxsize=4)
def token_trie(tok) -> TokenTrie:
    special, vocab = set(tok.special.values()), []
    for i in range(tok.vocab_size):
        try:
            vocab.append(b"" if i in special else tok.token_bytes(i))
        except KeyError:  # an id the vocabulary leaves unused
            vocab.append(b"")
    prefixes = sorted({b[:k] for b in vocab for k in range(len(b) + 1)}, key=lambda b: (len(b), b))
    node = {p: i for i, p in enumerate(prefixes)}
    parent = np.array([node[p[:-1]] for p in prefixes[1:]])  # non-decreasing: siblings are contiguous
    token_at = np.full(len(prefixes), -1, np.int32)
    token_at[[node[b] for b in vocab if b]] = [i for i, b in enumerate(vocab) if b]
    alphabet = np.zeros(256, bool)
    alphabet[[b[0] for b in vocab if len(b) == 1]] = True
    assert alphabet[list(set(b"".join(vocab)))].all(), "a byte inside a token is not itself a token"
    first = (np.searchsorted(parent, np.arange(len(prefixes) + 1)) + 1).astype(np.int32)
    return TokenTrie(first, np.array([0] + [p[-1] for p in prefixes[1:]], np.uint8), token_at, vocab, alphabet)


class TokenIndex:
    """Per DFA state, the tokens whose bytes keep the DFA alive (Outlines' index), as a packed bitmask
    (n_states, vocab / 8); EOS only in accepting states, no other special token ever. Built once per
    (regex, tokenizer) by walking the token trie alongside the DFA, breadth-first, for a chunk of start
    states at once, keeping only the (state, node) pairs still alive: a string state walks most of the
    trie, a literal state a few nodes. Also holds the compressed FSM: jump(state) -> forced string."""

    def __init__(self, pattern: str, tok, chunk: int = 256):
        t0 = time.perf_counter()
        self.trie = trie = token_trie(tok)
        self.eos, self.vocab = tok.eos_id, len(trie.token_bytes)
        self.dfa = dfa = compile_regex(pattern).restrict(trie.alphabet)
        if not dfa.accept.any():
            raise ValueError(f"regex {pattern!r} matches nothing this tokenizer can produce")
        masks = []
        for c0 in range(0, len(dfa.table), chunk):
            owner = np.arange(c0, min(len(dfa.table), c0 + chunk), dtype=np.int32)  # alive pairs: start state,
            state, node = owner.copy(), np.zeros_like(owner)  # the DFA state after node's bytes, the trie node
            allowed = np.zeros((len(owner), self.vocab), bool)  # (chunk, vocab)
            while len(node):  # one trie level per step: every alive pair to each child of its node
                n_kids = trie.first[node + 1] - trie.first[node]
                child = np.repeat(trie.first[node] - np.cumsum(n_kids) + n_kids, n_kids) + np.arange(n_kids.sum())
                owner, state = np.repeat(owner, n_kids), dfa.table[np.repeat(state, n_kids), trie.byte[child]]
                alive = np.flatnonzero(state >= 0)
                owner, state, node = owner[alive], state[alive], child[alive]
                token = trie.token_at[node]
                allowed[owner[token >= 0] - c0, token[token >= 0]] = True
            allowed[:, self.eos] = dfa.accept[c0:c0 + chunk]
            assert allowed.any(1).all(), "a live state without an allowed token"
            masks.append(np.packbits(allowed, axis=1))
        self.mask = np.concatenate(masks)  # (n_states, ceil(vocab / 8)) uint8
        self.forced = ((dfa.table >= 0).sum(1) == 1) & ~dfa.accept  # one byte out, and EOS not allowed
        self.jumps, self.build_s = {}, time.perf_counter() - t0

    def allowed(self, state: int) -> torch.Tensor:
        """(vocab,) bool: the tokens allowed in `state`."""
        return torch.from_numpy(np.unpackbits(self.mask[state], count=self.vocab).view(bool))

    def step(self, state: int, token: int) -> int:
        return self.dfa.walk(state, self.trie.token_bytes[token])

    def jump(self, state: int) -> bytes:
        """The compressed edge from `state`: its maximal chain of singular transitions (b"" if none)."""
        if state not in self.jumps:
            out, s = bytearray(), state
            while self.forced[s]:
                out.append(int(np.argmax(self.dfa.table[s] >= 0)))
                s = int(self.dfa.table[s, out[-1]])
            self.jumps[state] = bytes(out)
        return self.jumps[state]

    def compressed_edges(self) -> dict:
        """{head state: jump string} for every maximal chain (heads: forced states no forced state leads to)."""
        forced, t = np.flatnonzero(self.forced), self.dfa.table
        inner = {int(t[s][t[s] >= 0][0]) for s in forced}
        return {int(s): self.jump(int(s)) for s in forced if s not in inner}


# -------- Decoding: masking only, or masking + jump-forward with re-tokenization ------------------

def sample(logits, temperature: float, top_p: float, generator=None):
    """logits (B, vocab) -> (B,) token ids. temperature 0 is greedy; top_p keeps the smallest nucleus >= top_p.
    A mask is logits set to -inf before this: those tokens get probability 0 (the model file samples with it too)."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        p_sorted, idx = probs.sort(-1, descending=True)
        p_sorted[(p_sorted.cumsum(-1) - p_sorted) > top_p] = 0  # drop tokens once the mass before them exceeds top_p
        probs = torch.zeros_like(probs).scatter_(-1, idx, p_sorted)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def constrained_decode(index: TokenIndex, tok, prompt_ids, logits_fn, max_new_tokens=256, jump_forward=True,
                       temperature=0.0, seed=0) -> dict:
    """logits_fn(ids, keep) -> next-token logits (vocab,) after ids, where ids[:keep] are unchanged since
    its previous call (their K/V can be reused). Returns output ids, text and the forward passes taken."""
    gen = torch.Generator().manual_seed(seed)
    ids, n0, keep, state, text = list(prompt_ids), len(prompt_ids), 0, 0, b""
    stats = dict(forward_passes=0, tokens_computed=0, jumps=0, jumped_bytes=0)
    t0, finished = time.perf_counter(), False
    while len(ids) - n0 < max_new_tokens:
        jump = text + (index.jump(state) if jump_forward else b"")
        jump = jump[len(text):len(jump.decode("utf-8", "ignore").encode())]  # whole characters only
        if jump:  # append the forced string, re-tokenize, keep the common token prefix
            text, state = text + jump, index.dfa.walk(state, jump)
            new = list(prompt_ids) + tok.encode(text.decode())
            common = next((i for i, (a, b) in enumerate(zip(ids, new)) if a != b), min(len(ids), len(new)))
            ids, keep = new, min(keep, common)
            stats["jumps"], stats["jumped_bytes"] = stats["jumps"] + 1, stats["jumped_bytes"] + len(jump)
        allowed = index.allowed(state)
        if allowed[index.eos] and allowed.sum() == 1:  # nothing left to choose: done, no model call
            finished = True
            break
        logits = logits_fn(ids, keep)  # (vocab,)
        stats["forward_passes"] += 1
        stats["tokens_computed"] += len(ids) - keep
        keep = len(ids)
        ok = torch.zeros(len(logits), dtype=torch.bool, device=logits.device)  # the model may pad its vocab
        ok[:len(allowed)] = allowed
        t = int(sample(logits.masked_fill(~ok, float("-inf"))[None], temperature, 1.0, gen)[0])
        if t == index.eos:
            finished = True
            break
        ids.append(t)
        text, state = text + tok.token_bytes(t), index.step(state, t)
    return dict(ids=ids[n0:], text=text.decode("utf-8", "replace"), finished=finished,
                seconds=time.perf_counter() - t0, **stats)


class RollbackCache(K01.ContiguousKVCache):
    """01's contiguous cache plus the one operation jump-forward needs: forget a request's last tokens."""

    def truncate(self, seq_id, n):
        row = self.rows[seq_id]
        assert 0 <= n <= self.lens[row], (n, self.lens[row])
        self.lens[row] = n  # slots past n get overwritten by the next prepare()


def model_logits_fn(model, max_seq_len=2048):
    """A logits_fn for constrained_decode running the model through RollbackCache: computes ids[keep:] only."""
    kv = RollbackCache.for_model(model, 1, min(max_seq_len, model.args.max_seq_len))
    device = model.tok_embeddings.weight.device

    def logits_fn(ids, keep):
        if 0 in kv.rows:
            kv.truncate(0, keep)
        positions = kv.prepare([0], [len(ids) - keep])
        last = torch.tensor([len(ids) - keep - 1], device=device)
        return model(torch.tensor(ids[keep:], device=device), positions, kv, logits_at=last)[0]
    return logits_fn


# -------- JSON schema -> regex --------------------------------------------------------------------

_HEX = "[0-9a-fA-F]"
STRING_CHAR = (  # one character of a JSON string: unescaped, a short escape, \uXXXX, or a \uD8xx\uDCxx pair
    r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u(?:[0-9a-cA-CefEF]' + _HEX + "{3}|[dD][0-7]" + _HEX + "{2})"
    r"|\\u[dD][89abAB]" + _HEX + r"{2}\\u[dD][c-fC-F]" + _HEX + "{2})")
INTEGER = r"-?(?:0|[1-9][0-9]{0,15})"  # digits bounded, so a rambling model still ends
INT_LIMIT = 10**16 - 1                 # the largest INTEGER matches
NUMBER = INTEGER + r"(?:\.[0-9]{1,16})?(?:[eE][+-]?[0-9]{1,3})?"
FORMATS = {"uuid": f"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}",  # formats a regex states exactly
           "ipv4": r"(?:(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}"
                   r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"}
ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
               "writeOnly"}  # keywords that never change which documents are valid
KEYWORDS = {None: {"type", "enum", "const", "anyOf"}, "string": {"minLength", "maxLength", "pattern", "format"},
            "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}, "number": set(),
            "boolean": set(), "null": set(), "array": {"items", "minItems", "maxItems"},
            "object": {"properties", "required", "additionalProperties"}}


def _literal(value) -> str:
    return "".join("\\" + c if c in r"\.^$*+?{}[]()|-" else c for c in json.dumps(value, ensure_ascii=False))


def _digits(lo: str, hi: str) -> list:
    """Regexes for the digit strings of one length from lo to hi (the classic range-to-regex split)."""
    if lo == hi:
        return [lo]
    if lo[0] == hi[0]:
        return [lo[0] + r for r in _digits(lo[1:], hi[1:])]
    n, d0, d1 = len(lo) - 1, int(lo[0]), int(hi[0])
    if lo[1:] == "0" * n and hi[1:] == "9" * n:  # a whole block: [d0-d1] then any n digits
        return [f"[{d0}-{d1}]" + ("[0-9]" + f"{{{n}}}" if n else "")]
    out = [lo[0] + r for r in _digits(lo[1:], "9" * n)]
    if d1 - d0 > 1:
        out += [f"[{d0 + 1}-{d1 - 1}]" + ("[0-9]" + f"{{{n}}}" if n else "")]
    return out + [hi[0] + r for r in _digits("0" * n, hi[1:])]


def _natural_range(lo: int, hi: int) -> list:
    """Regexes for the naturals lo..hi (no leading zeros)."""
    out = []
    for n in range(len(str(lo)), len(str(hi)) + 1):
        a, b = max(lo, 10 ** (n - 1) if n > 1 else 0), min(hi, 10 ** n - 1)
        if a <= b:
            out += _digits(str(a), str(b))
    return out


def integer_range(lo: int, hi: int) -> str:
    """A regex for exactly the integers lo..hi written as JSON writes them (no -0, no leading zeros)."""
    parts = _natural_range(max(lo, 0), hi) if hi >= 0 else []
    if lo < 0:
        parts += ["-(?:" + "|".join(_natural_range(max(-hi, 1), -lo)) + ")"]
    return "(?:" + "|".join(parts) + ")"


def _json_safe(pattern: str) -> bool:
    """Whether every string the pattern matches is written in JSON as is (no quote, backslash or control byte)."""
    live = compile_regex(pattern).table >= 0
    return not (live[:, :0x20].any() or live[:, ord('"')].any() or live[:, ord("\\")].any())


def schema_to_regex(schema, path="$") -> str:
    """A JSON schema -> a regex of exactly the documents json.dumps would write that the schema accepts, or a
    ValueError naming what it cannot express. Supported: type string (minLength/maxLength in characters; an
    anchored `pattern` over characters JSON writes unescaped; format uuid, ipv4), integer (minimum, maximum,
    exclusiveMinimum, exclusiveMaximum: exact ranges), number, boolean, null, object (properties, required,
    additionalProperties: every listed property is written, no other), array (items, minItems/maxItems); enum,
    const, anyOf; annotations (title, description, default, ...). Refused, by name: every other keyword
    (multipleOf, uniqueItems, oneOf, allOf, not, prefixItems, minProperties, ...), ranges on numbers, other
    formats. Layout: json.dumps' (", " and ": "), every property, in schema order."""
    def fail(msg):
        raise ValueError(f"{path}: {msg}")
    if not isinstance(schema, dict):
        fail(f"a schema must be an object, got {type(schema).__name__}")
    kind = schema.get("type")
    if "type" in schema and not (isinstance(kind, str) and kind in KEYWORDS):
        fail(f"unsupported schema type {kind!r} (string integer number boolean null object array; enum const anyOf)")
    for key in schema:
        if key not in ANNOTATIONS | KEYWORDS[None] | KEYWORDS.get(kind, set()):
            fail(f"unsupported keyword {key!r}" + (f" for type {kind!r}" if kind else "") +
                 " (it would change which documents are valid, and this compiler cannot express it)")
    for key in ("enum", "anyOf"):
        if key in schema and (not isinstance(schema[key], list) or not schema[key]):
            fail(f"{key} must be a non-empty list")
    if "enum" in schema or "const" in schema:
        return "(?:" + "|".join(_literal(v) for v in schema.get("enum", [schema.get("const")])) + ")"
    if "anyOf" in schema:
        return "(?:" + "|".join(schema_to_regex(s, f"{path}.anyOf[{i}]") for i, s in enumerate(schema["anyOf"])) + ")"
    lo_key, hi_key = ("minItems", "maxItems") if kind == "array" else ("minLength", "maxLength")
    lo, hi = schema.get(lo_key, 0), schema.get(hi_key)
    for key, v in ((lo_key, lo), (hi_key, hi)):
        if v is not None and (type(v) is not int or v < 0):
            fail(f"{key} must be a non-negative integer, got {v!r}")
    if hi is not None and lo > hi:
        fail(f"{lo_key} {lo} is above maximum {hi}")
    if kind == "string":
        if "format" in schema and schema["format"] not in FORMATS:
            fail(f"unsupported format {schema['format']!r} (supported: {', '.join(FORMATS)})")
        exact = [schema[k] for k in ("pattern", "format") if k in schema]
        if exact and (len(exact) > 1 or lo_key in schema or hi_key in schema):
            fail("pattern or format together with other string keywords is not supported")
        if "pattern" in schema:
            p = schema["pattern"]
            if not (isinstance(p, str) and p.startswith("^") and p.endswith("$") and not p.endswith("\\$")):
                fail(f"pattern {p!r}: only anchored patterns (^...$) are supported")
            if not _json_safe(p[1:-1]):
                fail(f"pattern {p!r} may match a quote, backslash or control character, which JSON escapes")
            return f'"(?:{p[1:-1]})"'
        if "format" in schema:
            return f'"{FORMATS[schema["format"]]}"'
        return f'"{STRING_CHAR}{{{lo},{"" if hi is None else hi}}}"'
    if kind == "integer":
        bounds = {k: schema[k] for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if k in schema}
        for k, v in bounds.items():
            if type(v) not in (int, float) or v != v or abs(v) == float("inf"):
                fail(f"{k} must be a finite number, got {v!r}")
        if not bounds:
            return INTEGER
        low = max([-INT_LIMIT] + [math.ceil(bounds[k]) for k in ("minimum",) if k in bounds] +
                  [math.floor(bounds[k]) + 1 for k in ("exclusiveMinimum",) if k in bounds])
        high = min([INT_LIMIT] + [math.floor(bounds[k]) for k in ("maximum",) if k in bounds] +
                   [math.ceil(bounds[k]) - 1 for k in ("exclusiveMaximum",) if k in bounds])
        if low > high:
            fail(f"no integer lies in [{low}, {high}]")
        return integer_range(low, high)
    if kind in ("number", "boolean", "null"):
        return {"number": NUMBER, "boolean": "(?:true|false)", "null": "null"}[kind]
    if kind == "object":
        if not isinstance(schema.get("properties", {}), dict):
            fail("properties must be an object")
        props = schema.get("properties", {})
        missing = [k for k in schema.get("required", []) if k not in props]
        if missing:
            fail(f"required property {missing[0]!r} is not in properties (only listed properties are written)")
        fields = [_literal(k) + ": " + schema_to_regex(v, f"{path}.{k}") for k, v in props.items()]
        return r"\{" + ", ".join(fields) + r"\}"
    if kind == "array":
        if "items" not in schema:
            fail("an array needs 'items'")
        item = schema_to_regex(schema["items"], f"{path}[]")
        more = f"(?:, {item}){{{max(lo - 1, 0)},{'' if hi is None else max(hi - 1, 0)}}}"
        return r"\[\]" if hi == 0 else rf"\[{item}{more}\]" if lo else rf"\[(?:{item}{more})?\]"
    fail("a schema needs a type (string integer number boolean null object array) or enum, const, anyOf")


# -------- Demo: masking only vs jump-forward, same model, same run --------------------------------

CHARACTER_REGEX = (  # SGLang's example, examples/frontend_language/usage/json_decode.py
    r"""\{\n    "name": "[\w\d\s]{1,16}",\n    "house": "(Gryffindor|Slytherin|Ravenclaw|Hufflepuff)",\n"""
    r"""    "blood status": "(Pure-blood|Half-blood|Muggle-born)",\n"""
    r"""    "occupation": "(student|teacher|auror|ministry of magic|death eater|order of the phoenix)",\n"""
    r"""    "wand": \{\n        "wood": "[\w\d\s]{1,16}",\n        "core": "[\w\d\s]{1,16}",\n"""
    r"""        "length": [0-9]{1,2}\.[0-9]{0,2}\n    \},\n    "alive": "(Alive|Deceased)",\n"""
    r"""    "patronus": "[\w\d\s]{1,16}",\n    "bogart": "[\w\d\s]{1,16}"\n\}""")
DEMO_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "house": {"enum": ["Gryffindor", "Slytherin", "Ravenclaw", "Hufflepuff"]}, "age": {"type": "integer"},
    "wand": {"type": "object", "properties": {"wood": {"type": "string", "maxLength": 16},
                                              "core": {"type": "string", "maxLength": 16}, "length": {"type": "number"}}},
    "alive": {"type": "boolean"}, "friends": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3}}}
DEMO_PROMPT = "Please describe the character Hermione Granger from Harry Potter."
MODES = ("masking_only", "jump_forward")


def compare(model, tok, name, pattern, prompt, max_new_tokens=256) -> dict:
    """Build the index, then decode the same prompt masking-only and with jump-forward (greedy)."""
    index, prompt_ids = TokenIndex(pattern, tok), tok.chat(prompt)
    cache_len = len(prompt_ids) + 2 * max_new_tokens + 512  # room for re-tokenized jump strings too
    runs = [constrained_decode(index, tok, prompt_ids, model_logits_fn(model, cache_len), max_new_tokens,
                               jump_forward=(mode == "jump_forward")) for mode in MODES]
    for r in runs:
        r.update(completion=r["text"], matches=r["finished"] and index.dfa.fullmatch(r["text"]),
                 output_tokens=len(r["ids"]), tokenizer_tokens=len(tok.encode(r["text"])))  # tokenizer: same text
    edges = index.compressed_edges()
    out = dict(name=name, regex=pattern, dfa_states=len(index.dfa.table), index_build_s=round(index.build_s, 3),
               compressed_edges=len(edges), compressed_bytes=sum(map(len, edges.values())))
    for key in ("completion", "matches", "forward_passes", "tokens_computed", "output_tokens", "tokenizer_tokens",
                "jumps", "seconds"):
        out[key] = {mode: r[key] for mode, r in zip(MODES, runs)}
    out["forward_pass_ratio"] = runs[0]["forward_passes"] / max(1, runs[1]["forward_passes"])
    out["speedup"] = runs[0]["seconds"] / runs[1]["seconds"]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description="Constrained decoding: masking only vs compressed FSM + jump-forward.",
                                 epilog="--json: one object {completion, forward_passes, seconds, ...} (each keyed by "
                                        "masking_only / jump_forward) for the first run, plus runs: [every run]")
    ap.add_argument("--regex", help="constrain to this regex (Python syntax subset, see the docstring)")
    ap.add_argument("--json-schema", metavar="FILE", help="constrain to this JSON schema")
    ap.add_argument("--prompt", default=DEMO_PROMPT)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--model", help="model path (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.max_new_tokens < 1:
        ap.error("--max-new-tokens must be >= 1")
    try:  # bad input fails here, before the model loads
        tasks = [("regex", args.regex)] if args.regex is not None else []
        if args.json_schema:
            with open(args.json_schema) as f:
                tasks.append((f"JSON schema {args.json_schema}", schema_to_regex(json.load(f))))
        tasks = tasks or [("character profile regex (SGLang)", CHARACTER_REGEX),
                          ("JSON schema", schema_to_regex(DEMO_SCHEMA))]
        for _, pattern in tasks:
            compile_regex(pattern)
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        sys.exit(f"error: {e}")
    import llama3_generate as L
    try:
        model, tok = L.load_model(args.model)
        runs = [compare(model, tok, name, pattern, args.prompt, args.max_new_tokens) for name, pattern in tasks]
    except (L.UserError, ValueError) as e:
        sys.exit(f"error: {e}")
    if args.json:
        print(json.dumps({**runs[0], "runs": runs}))
        return
    print(f"prompt: {args.prompt!r}")
    for r in runs:
        print(f"\n=== {r['name']}: {r['dfa_states']} DFA states, token index built in {r['index_build_s']:.2f} s; "
              f"compressed FSM: {r['compressed_edges']} jump edges, {r['compressed_bytes']} forced bytes")
        for mode in MODES:
            print(f"--- {mode}:\n{r['completion'][mode]}")
        for mode in MODES:
            g = {k: v[mode] for k, v in r.items() if isinstance(v, dict)}
            print(f"  {mode:13s} forward passes {g['forward_passes']:4d}   tokens computed {g['tokens_computed']:4d}   "
                  f"output tokens {g['output_tokens']:4d} (tokenizer: {g['tokenizer_tokens']:4d})   jumps {g['jumps']:3d}"
                  f"   {g['seconds']:6.2f} s   matches: {g['matches']}")
        print(f"  jump-forward: {r['forward_pass_ratio']:.2f}x fewer forward passes, {r['speedup']:.2f}x less wall time")


if __name__ == "__main__":
    main()
