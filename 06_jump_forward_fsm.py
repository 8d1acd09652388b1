r"""
06_jump_forward_fsm.py -- constrained decoding with a compressed FSM and jump-forward (SGLang).

    python 06_jump_forward_fsm.py          # SGLang's character-profile regex, a Pydantic model
    python 06_jump_forward_fsm.py --regex '(yes|no), because [a-z ]{1,40}\.' --prompt "Wet?"
    python 06_jump_forward_fsm.py --bench  # schemas people write: 06 vs xgrammar, llguidance

Make every answer match a regex (or a JSON schema, compiled to one). The SGLang paper's three ways:
  1. per-token FSM masking (Outlines): regex -> finite-state machine; per state, the tokens that
     keep it alive; each step masks the logits to them. One forward pass per token even where
     nothing is left to choose: `", "house": "` costs several passes though the regex fixes it.
  2. interleaved: the program splits the format by hand into constants (prefilled) and gen() calls.
  3. compressed FSM + jump-forward (SGLang): merge each chain of singular transitions (one way out)
     into one edge labelled by its string; on reaching one, append it whole -- many tokens in one
     forward pass:

        state 7 --"G"--> 8 ====== 'ryffindor", "age": ' ======> 30       compressed edges
                --"S"--> 9 ====== 'lytherin", "age": ' =======> 30

The tokenization boundary: after `Gryffindor`, appending the jump string `", "age": ` as its own
tokens feeds the model `"` then `, "` -- a split it never saw in training, where `",` is one token.
So SGLang re-tokenizes prompt + output + jump string, keeps the longest common token prefix with
what the model has seen, and recomputes the K/V of the rest in one extend pass. We re-encode
output + jump after the fixed prompt ids (the chat template ends at a special token, so the two
agree; SGLang bails out when they "fuse"). KV: 01's contiguous cache plus `truncate`; the engine
reuses the prefix through 05's radix cache instead. Masking alone drifts too: made to spell
`"blood status"`, a small model picks fragments (`b`, `l`, `oo`, `d`, ...), emitting far more
tokens than the tokenizer would for the same text; the report prints both counts.

    regex --parse--> AST --Thompson--> byte NFA --subsets--> byte DFA --token bytes--> TokenIndex
    "[a-c]{2}"   ("rep", ("set", ((97, 99),)), 2, 2)    (n_states, 256) int32, -1 = dead   masks

The masks are walked as decoding asks, a state's the first time it is reached, then kept: a new
schema waits for its DFA and one state's walk before its first token, not for the whole index.

Read in order: the token index and the compressed FSM, then jump-forward decoding; then the
machinery they stand on, each part under its heading with its why (regex -> byte DFA, JSON schema
-> regex); the demo last.

References: Zheng et al., "SGLang: Efficient Execution of Structured Language Model Programs"
(2024) and the LMSYS blog "Fast JSON Decoding for Local LLMs with Compressed Finite State Machine"
(2024); Willard & Louf, "Efficient Guided Generation for LLMs" (Outlines, 2023); Thompson (1968);
Russ Cox, "Regular Expression Matching Can Be Simple And Fast"; Rust regex-syntax's utf8.rs;
interegular, the regex parser Outlines and SGLang used.
"""
import argparse
import contextlib
import functools
import gc
import importlib
import json
import math
import os
import re
import runpy
import sys
import textwrap
import time
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import torch

L01 = importlib.import_module("01_kv_cache")


# ======== THE IDEA, 1: a token index over the regex's DFA, and the compressed FSM ================

@dataclass
class TokenTrie:
    """Every non-special token's bytes as a trie, nodes sorted by (length, bytes) so that node k's
    children are the contiguous nodes first[k]:first[k + 1]. Node 0 is the root."""
    first: np.ndarray     # (n_nodes + 1,) offsets of each node's children
    byte: np.ndarray      # (n_nodes,) byte on the edge into each node
    token_at: np.ndarray  # (n_nodes,) the token whose bytes end at this node, or -1
    token_bytes: list     # token id -> bytes (b"" for special tokens)
    alphabet: np.ndarray  # (256,) bool: the bytes that are one-byte tokens
    joined: np.ndarray    # (all tokens' bytes + 1,) uint8: token after token, then a 0
    offset: np.ndarray    # (vocab + 1,) where each token's bytes begin in joined
    length: np.ndarray    # (vocab,) their lengths
    longest: int          # the longest's
    starts: np.ndarray    # (256,) how many tokens begin with each byte
    splits: dict = field(default_factory=dict)  # see split

    def split(self, loop: np.ndarray) -> tuple:
        """loop (256,) bool: the tokens whose bytes all lie in it (bool, (vocab,)); the others' ids, and where in
        joined each one's first byte outside it sits. Kept per loop (a JSON string's characters)."""
        key = np.packbits(loop).tobytes()
        if key not in self.splits:
            where = np.where(loop[self.joined], len(self.joined), np.arange(len(self.joined)))
            first = np.minimum.reduceat(where, self.offset[:-1])  # (an empty token's: the next's)
            inside, some = first >= self.offset[1:], self.length > 0  # some: not an empty (special) token
            others = np.flatnonzero(~inside & some)
            self.splits[key] = inside & some, others, first[others]
        return self.splits[key]


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
    # non-decreasing: siblings are contiguous
    parent = np.array([node[p[:-1]] for p in prefixes[1:]])
    token_at = np.full(len(prefixes), -1, np.int32)
    token_at[[node[b] for b in vocab if b]] = [i for i, b in enumerate(vocab) if b]
    alphabet = np.zeros(256, bool)
    alphabet[[b[0] for b in vocab if len(b) == 1]] = True
    assert alphabet[list(set(b"".join(vocab)))].all(), "a byte inside a token is not itself a token"
    first = (np.searchsorted(parent, np.arange(len(prefixes) + 1)) + 1).astype(np.int32)
    joined, offset = np.frombuffer(b"".join(vocab) + b"\0", np.uint8), np.cumsum([0] + [len(b) for b in vocab])
    return TokenTrie(first, np.array([0] + [p[-1] for p in prefixes[1:]], np.uint8), token_at, vocab, alphabet,
                     joined, offset, np.diff(offset), max(map(len, vocab)),
                     np.bincount([b[0] for b in vocab if b], minlength=256))


class TokenIndex:
    """Per DFA state, the tokens whose bytes keep the DFA alive (Outlines' index), a packed bitmask;
    EOS only in accepting states, no other special token ever. A state's row is walked when a mask
    first asks for it (row), then kept. The DFA keeps only bytes that are one-byte tokens, then only
    states that can still accept: a live byte path is then a token path, so decoding never reaches
    a state with no allowed token unless it may stop. Also the compressed FSM: jump(state)."""

    def __init__(self, pattern: str, tok):
        t0 = time.perf_counter()
        full = compile_regex(pattern)  # a bad regex: refused before the vocabulary's walk
        self.trie = trie = token_trie(tok)
        self.eos, self.vocab = tok.eos_id, len(trie.token_bytes)
        table = np.where(trie.alphabet[None, :], full.table, -1)
        # trimmed again only if a state lost an edge to another (SmolLM2 lacks 0xF1, not 0xF3)
        lost, byte = np.nonzero(table != full.table)
        kept = (table[lost] == full.table[lost, byte][:, None]).any(1).all()
        self.dfa = dfa = DFA(table, full.accept) if kept else DFA(*_trim(table, full.accept))
        if not dfa.accept.any():
            raise ValueError(f"regex {pattern!r} matches nothing this tokenizer can produce")
        self.dist = _to_accept(dfa).astype(np.int16)  # one-byte tokens to the nearest accept
        # forced: one byte out, and EOS not allowed
        self.forced = ((dfa.table >= 0).sum(1) == 1) & ~dfa.accept
        self.rows, self.jumps = {}, {}
        self.row(0)  # what the first mask needs, no more
        self.build_s = time.perf_counter() - t0

    def row(self, state: int) -> tuple:
        """(packed allowed tokens, the most one needs, the least one but EOS needs (0: none)), kept."""
        if state not in self.rows:
            need = self.needs([state])[0]
            assert need.any(), "a live state without an allowed token"
            mask, worst = np.packbits(need > 0), int(need.max())
            need[self.eos] = 0
            least = need[need > 0]
            self.rows[state] = mask, worst, int(least.min()) if least.size else 0
        return self.rows[state]

    def needs(self, states) -> np.ndarray:
        """(len(states), vocab) int16: per state, 1 + the bytes from where each token leads to the
        nearest accept (EOS: 1 where accepting); 0: not allowed. The token trie is walked alongside
        the DFA, breadth-first, keeping only the (start, DFA state, trie node) triples alive. But
        inside a JSON string almost every token is allowed, and a trie walk visits them all. So for
        one state where most tokens begin with the bytes that lead to one next state (the string's
        own state, or a bounded string's next) and those bytes lead on alike (chain), a token made
        of them alone ends at chain[its length], looked up at once; only the others are walked,
        each from its first other byte."""
        trie, table, dist = self.trie, self.dfa.table, self.dist + 1  # 1: the token itself
        state = np.asarray(states, np.int32)
        owner, node, need = np.arange(len(state)), np.zeros_like(state), np.zeros((len(state), self.vocab), np.int16)
        row = table[state[0]] if len(state) == 1 else np.full(256, -1)
        loop = row == (np.bincount(row[row >= 0]).argmax() if (row >= 0).any() else -2)  # the bytes to the likeliest
        # most tokens start with one of them, and stay alive (else a trie walk is short)
        chain = self.chain(int(state[0]), loop) if trie.starts[loop].sum() > 0.9 * self.vocab else None
        if chain is not None and chain[min(8, trie.longest)] >= 0:
            stays, others, at = trie.split(loop)
            ends, stop = chain[at - trie.offset[others]], trie.offset[others + 1]
            live = np.flatnonzero(ends >= 0)  # where each other token's first bytes, all in `loop`, led
            while live.size:  # then each one's bytes from `at` on, all tokens a byte at a time
                ends[live] = table[ends[live], trie.joined[at[live]]]
                at = at + 1  # a copy: the split is kept
                live = live[(ends[live] >= 0) & (at[live] < stop[live])]
            need[0] = np.where(stays, np.where(chain >= 0, dist[chain], 0)[trie.length], 0)
            need[0, others], node = np.where(ends >= 0, dist[ends], 0), node[:0]
        while len(node):  # one trie level per step: every alive triple to each child of its node
            n_kids = trie.first[node + 1] - trie.first[node]
            child = np.repeat(trie.first[node] - np.cumsum(n_kids) + n_kids, n_kids) + np.arange(n_kids.sum())
            owner, state = np.repeat(owner, n_kids), table[np.repeat(state, n_kids), trie.byte[child]]
            alive = np.flatnonzero(state >= 0)
            owner, state, node = owner[alive], state[alive], child[alive]
            end = np.flatnonzero(trie.token_at[node] >= 0)  # the pairs where a token's bytes end
            need[owner[end], trie.token_at[node[end]]] = dist[state[end]]
        need[:, self.eos] = self.dfa.accept[states]
        return need

    def chain(self, state: int, loop) -> np.ndarray | None:
        """Where k bytes of `loop` lead from `state`, k = 0 .. the longest token's length (-1: dead),
        or None if they part ways somewhere: a string's characters, its own state again or the next."""
        chain = [state]
        while len(chain) <= self.trie.longest:
            then = np.unique(self.dfa.table[chain[-1], loop]) if chain[-1] >= 0 else [-1]
            if len(then) > 1 or then[0] == chain[-1]:  # parted; or a loop, or dead: so on to the end
                return None if len(then) > 1 else np.array(chain + chain[-1:] * (self.trie.longest + 1 - len(chain)))
            chain.append(int(then[0]))
        return np.array(chain)

    def allowed(self, state: int, tokens_left=math.inf) -> torch.Tensor:
        """(vocab,) bool: the tokens allowed in `state`. With `tokens_left` tokens left (this one
        included) and room for a shortest completion in one-byte tokens, only those after which it
        still fits: the answer ends within max_new_tokens (without such room yet, all)."""
        mask, worst, _ = self.row(state)
        if not self.dist[state] <= tokens_left < worst:
            return torch.from_numpy(np.unpackbits(mask, count=self.vocab).view(bool))
        need = self.needs([state])[0]
        return torch.from_numpy((need > 0) & (need <= tokens_left))

    def finish(self, state: int, tokens_left=math.inf):
        """Whether decoding ends in `state` with `tokens_left` tokens left, before asking the model
        (the lesson's loop and the engine's Seq both ask here). "stop": EOS is the only token that
        allowed(state, tokens_left) holds, or no token is left where the regex may end; "length":
        none is left before it may. None: go on, and allowed(state, tokens_left) holds a token (the
        first of a shortest completion that fits, or EOS)."""
        # a jump-forward may use up the tokens exactly: allowed(state, 0) is empty, EOS included
        if tokens_left < 1:
            return "stop" if self.dfa.accept[state] else "length"
        return ("stop" if self.dfa.accept[state] and not 0 < self.row(state)[2] <= tokens_left
                else None)

    def step(self, state: int, token: int) -> int:
        return self.dfa.walk(state, self.trie.token_bytes[token])

    def jump(self, state: int) -> bytes:
        """The compressed edge from `state`: its maximal chain of singular transitions (b"" if
        none)."""
        if state not in self.jumps:
            out, s = bytearray(), state
            while self.forced[s]:
                out.append(int(np.argmax(self.dfa.table[s] >= 0)))
                s = int(self.dfa.table[s, out[-1]])
            self.jumps[state] = bytes(out)
        return self.jumps[state]

    def jump_forward(self, state: int, text: bytes, output: list, tok,
                     max_new_tokens=math.inf) -> tuple:
        """Jump-forward from `state`, after `output` (token ids) wrote `text`: append the forced
        string (whole characters), re-tokenize the text, keep the longest common token prefix with
        `output` (the rest's K/V is recomputed). -> (state, text, output, tokens kept), unchanged if
        nothing is forced, or the new output would pass max_new_tokens or lose the room a shortest
        completion had (then the model writes it itself)."""
        jump = text + self.jump(state)
        jump = jump[len(text):len(jump.decode("utf-8", "ignore").encode())]  # whole characters only
        new, end = tok.encode((text + jump).decode()) if jump else [], self.dfa.walk(state, jump)
        # room for a shortest completion (see allowed)
        fits = lambda n, s: n + self.dist[s] <= max_new_tokens
        if (not jump or len(new) > max_new_tokens
                or fits(len(output), state) and not fits(len(new), end)):
            return state, text, output, len(output)
        return end, text + jump, new, len(os.path.commonprefix([output, new]))

    def compressed_edges(self) -> dict:
        """{head: jump} per maximal chain (head: forced; the start or entered by a choice)."""
        # a state may also lie inside another's chain
        heads = np.union1d(0, self.dfa.table[~self.forced])
        return {int(s): self.jump(int(s)) for s in heads if s >= 0 and self.forced[s]}


# ======== THE IDEA, 2: jump-forward decoding ====================================================

def sample(logits, temperature: float, top_p: float, generator=None):
    """logits (B, vocab) -> (B,) token ids; temperature 0: greedy; top_p: the smallest nucleus >=
    top_p. Masked logits (-inf) get probability 0. The model file samples with it too."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        p_sorted, idx = probs.sort(-1, descending=True)
        # drop: the tokens once the mass before them reaches top_p
        drop = (p_sorted.cumsum(-1) - p_sorted) >= top_p
        drop[:, 0] = False  # but never the likeliest (a top_p under float32's least is 0 there)
        p_sorted[drop] = 0
        probs = torch.zeros_like(probs).scatter_(-1, idx, p_sorted)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def constrained_decode(index: TokenIndex, tok, prompt_ids, logits_fn, max_new_tokens=256, jump_forward=True,
                       temperature=0.0, seed=0) -> dict:
    """logits_fn(ids, keep) -> next-token logits (vocab,) after ids, where ids[:keep] are unchanged
    since its previous call (their K/V can be reused). Returns output ids, text, finished (False:
    cut short by max_new_tokens before the regex matched, finish "length") and the forward passes
    taken."""
    gen = torch.Generator().manual_seed(seed)
    ids, n0, keep, state, text = list(prompt_ids), len(prompt_ids), 0, 0, b""
    stats = dict(forward_passes=0, tokens_computed=0, jumps=0, jumped_bytes=0)
    t0 = time.perf_counter()
    while len(ids) - n0 < max_new_tokens:
        jumped = index.jump_forward(state, text, ids[n0:], tok, max_new_tokens) if jump_forward else (state, text)
        # the forced string appended, re-tokenized: the common token prefix's K/V is kept
        if jumped[1] != text:
            stats["jumps"] += 1
            stats["jumped_bytes"] += len(jumped[1]) - len(text)
            state, text, out, kept = jumped
            ids, keep = list(prompt_ids) + out, min(keep, n0 + kept)
        tokens_left = max_new_tokens - (len(ids) - n0)  # the answer closes in time
        if index.finish(state, tokens_left):  # nothing left to choose, or no tokens: no model call
            break
        allowed = index.allowed(state, tokens_left)
        logits = logits_fn(ids, keep)  # (vocab,)
        stats["forward_passes"] += 1
        stats["tokens_computed"] += len(ids) - keep
        keep = len(ids)
        # the model may pad its vocab
        ok = torch.zeros(len(logits), dtype=torch.bool, device=logits.device)
        ok[:len(allowed)] = allowed
        t = int(sample(logits.masked_fill(~ok, float("-inf"))[None], temperature, 1.0, gen)[0])
        if t == index.eos:  # allowed only where the regex may end
            break
        ids.append(t)
        text, state = text + tok.token_bytes(t), index.step(state, t)
    text, finished = text.decode("utf-8", "replace"), bool(index.dfa.accept[state])
    seconds = time.perf_counter() - t0
    return dict(ids=ids[n0:], text=text, finished=finished, seconds=seconds, **stats)


class RollbackCache(L01.ContiguousKVCache):
    """01's contiguous cache plus what jump-forward needs: forgetting a request's last tokens."""

    def truncate(self, seq_id, n):
        row = self.rows[seq_id]
        assert 0 <= n <= self.lens[row], (n, self.lens[row])
        self.lens[row] = n  # slots past n get overwritten by the next prepare()


def model_logits_fn(model, max_seq_len=2048):
    """A logits_fn for constrained_decode: the model over a RollbackCache, computing ids[keep:]."""
    kv = RollbackCache.for_model(model, 1, min(max_seq_len, model.args.max_seq_len))

    def logits_fn(ids, keep):
        if 0 in kv.rows:
            kv.truncate(0, keep)
        positions = kv.prepare([0], [len(ids) - keep])
        return model(positions.new_tensor(ids[keep:]), positions, kv, logits_at=[-1])[0]
    return logits_fn


# ======== THE MACHINERY, 1: regex -> byte DFA (hand-written: the automaton IS the lesson) ========
# Why bytes: BPE tokens are byte strings, and some are not valid UTF-8 alone (pieces of emoji, CJK);
# a byte DFA walks every token alike. Classes are sorted code-point ranges (never 1.1M-entry tables)
# that Thompson compiles to UTF-8 byte-range sequences (RE2's split), so the table is 256 wide.
# Syntax: literals, escapes, [classes] with ranges and ^, `.`, * + ? {m} {m,} {,n} {m,n} (and lazy
# forms), |, (...), (?:...). \w \d \s are ASCII (re.ASCII), as in interegular (Unicode \w puts
# hundreds of mid-character states in each repetition of `[\w]{1,16}`); the rest is Unicode. Subset
# construction can blow up: past MAX_DFA_STATES states or COMPILE_BUDGET_S seconds a regex is
# refused. Three more groups, beyond Python's: (?&A|B) matches what both A and B match, (?~A) every
# UTF-8 string A does not: a DFA is closed under intersection and complement (below); (?,A) the
# strings that ", " + them A matches: a list (, x)* without its first ", ", x written once, not
# twice.

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
    r"""Recursive descent: alt := cat ('|' cat)*; cat := (atom quantifier?)*. AST: ("set", ranges) |
    ("cat", [nodes]) | ("alt", [nodes]) | ("rep", node, lo, hi or None). schema=True: a JSON-schema
    pattern, read by validators with Unicode \d \w \s; our ASCII ones are subsets, but their
    complements (\D, [^\d], ...) supersets that let through what validators reject: refused."""

    def __init__(self, pattern: str, schema=False):
        self.p, self.i, self.schema, self.negated = pattern, 0, schema, False

    def error(self, msg, at=None):
        raise ValueError(f"invalid regex {self.p!r}: {msg} at position {self.i if at is None else at}")

    def peek(self):
        return self.p[self.i] if self.i < len(self.p) else None

    def take(self):
        self.i += 1
        return self.p[self.i - 1]

    def parse(self):
        node = self.alt()
        # only ')' stops alt()
        return node if self.i == len(self.p) else self.error("unbalanced parenthesis")

    def alt(self):
        branches = [self.cat()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.cat())
        return branches[0] if len(branches) == 1 else ("alt", tuple(branches))

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
        return ("cat", tuple(items))  # tuples: a node is hashable, its DFA cached (_group_dfa)

    def quantifier(self, peek=False):
        """(lo, hi or None), consumed unless peek, or None; a `{` not quantifying is literal."""
        m = re.compile(r"([*+?])|\{([0-9]*)(,?)([0-9]*)\}").match(self.p, self.i)
        if not m or m[0] == "{}":
            return None
        c, lo, comma, hi = m.groups()
        q = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c] if c else (int(lo or 0), None if comma and not hi else
                                                                         int(hi or lo))
        if q[1] is not None and q[0] > q[1]:
            self.error("min repeat greater than max repeat")
        if max(q[0], q[1] or 0) > 1000:
            self.error("repeat count above 1000")
        if not peek:
            self.i = m.end()
        return q

    def atom(self):
        _spend(0)
        if self.quantifier(peek=True):
            self.error("nothing to repeat")
        c = self.take()
        if c == "(":
            op = self.p[self.i + 1:self.i + 2] if self.peek() == "?" else ""
            if op == ":" or op in "&~," and op and not self.schema:
                self.i += 2
            elif op:
                self.error("unsupported group syntax '(?' (only (...) and (?:...))")
            node = self.alt()
            self.i += 1
            if self.p[self.i - 1:self.i] != ")":
                self.error("missing ), unterminated subpattern")
            return {"&": ("and", node[1] if node[0] == "alt" else (node,)), "~": ("not", node), ",": ("tail", node)
                    }.get(op, node)
        if c in "^$":
            self.error(f"anchor {c!r} is not supported (the whole output must match anyway)", self.i - 1)
        if c == ".":
            return ("set", _negate([(10, 10)]))  # everything but a newline, as without re.DOTALL
        return ("set", self.charclass() if c == "[" else self.escape(False) if c == "\\" else ((ord(c), ord(c)),))

    def escape(self, in_class):
        r"""Escapes: \d \w \s \D \W \S (ASCII), \n \t ..., \xhh \uhhhh \Uhhhhhhhh, punctuation."""
        if self.i >= len(self.p):
            self.error("trailing backslash")
        c = self.take()
        if c.lower() in ASCII_CLASSES:
            if self.schema and (c.isupper() or self.negated):
                self.error(f"\\{c} {'inside [^...] ' * self.negated}in a schema pattern (validators: Unicode)")
            return _negate(ASCII_CLASSES[c.lower()]) if c.isupper() else ASCII_CLASSES[c]
        if c in ESCAPES or (c == "b" and in_class):
            code = ESCAPES.get(c, 8)
        elif c in "xuU":
            n = {"x": 2, "u": 4, "U": 8}[c]
            digits = self.p[self.i:self.i + n]
            if len(digits) < n or any(d not in "0123456789abcdefABCDEF" for d in digits) or int(digits, 16) > MAX_CHAR:
                self.error(f"incomplete escape \\{c}{digits}")
            self.i, code = self.i + len(digits), int(digits, 16)
        elif c.isascii() and c.isalnum():
            self.error(f"unsupported escape \\{c}", self.i - 2)  # backreferences, \b, \A, \Z ...
        else:
            code = ord(c)  # escaped punctuation is itself
        return ((code, code),)

    def charclass(self):
        negate = self.negated = self.peek() == "^"
        self.i += negate
        ranges, start = [], self.i
        member = lambda c: self.escape(True) if c == "\\" else ((ord(c), ord(c)),)  # one char
        while self.peek() != "]" or self.i == start:  # a leading ] is literal
            if self.i >= len(self.p):
                self.error("unterminated character set", start - 1 - negate)
            lo = member(self.take())
            if self.peek() == "-" and self.p[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                hi = member(self.take())
                if len(lo) + len(hi) != 2 or lo[0][0] != lo[0][1] or hi[0][0] != hi[0][1] or lo[0][0] > hi[0][0]:
                    self.error("bad character range")
                lo = ((lo[0][0], hi[0][0]),)
            ranges += lo
        self.i, self.negated = self.i + 1, False
        return _negate(ranges) if negate else tuple(sorted(ranges))


# -------- AST -> byte NFA (Thompson) -> byte DFA (subset construction) ----------------------------

def _split(lo: tuple, hi: tuple, low: int, high: int) -> list:
    """Equal-length digit sequences lo <= hi (digits low..high) -> digit-range sequences ((a0, b0),
    (a1, b1), ...) matching exactly lo..hi: fix the first digit while lo and hi share it, else
    split off lo's block, the whole blocks between, and hi's (_digits; UTF-8's base-64 tails)."""
    n = len(lo) - 1
    if lo[1:] == (low,) * n and hi[1:] == (high,) * n:  # one whole block (or a single digit)
        return [((lo[0], hi[0]),) + ((low, high),) * n]
    if lo[0] == hi[0]:
        return [((lo[0], lo[0]),) + s for s in _split(lo[1:], hi[1:], low, high)]
    return ([((lo[0], lo[0]),) + s for s in _split(lo[1:], (high,) * n, low, high)]
            + [((lo[0] + 1, hi[0] - 1),) + ((low, high),) * n] * (hi[0] - lo[0] > 1)
            + [((hi[0], hi[0]),) + s for s in _split((low,) * n, hi[1:], low, high)])


@functools.lru_cache(maxsize=4096)
def utf8_ranges(lo, hi):
    """Code points lo..hi -> byte-range sequences ((b0_lo, b0_hi), (b1_lo, b1_hi), ...) matching
    exactly their UTF-8 encodings: per length (no surrogates), _split over continuation bytes."""
    spans = ((max(lo, a), min(hi, b)) for a, b in ((0, 0x7F), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFF),
                                                   (0x10000, MAX_CHAR)))
    return [seq for a, b in spans if a <= b for seq in _split(*(tuple(chr(c).encode()) for c in (a, b)), 0x80, 0xBF)]


class _NFA:
    def __init__(self):
        self.eps, self.edges = [], []  # per state: [target], [(lo_byte, hi_byte, target)]

    def state(self):
        self.eps.append([]), self.edges.append([])
        return len(self.eps) - 1

    def build(self, node):
        """Thompson construction -> (start, end) of node's fragment."""
        kind, s = node[0], self.state()
        _spend(len(self.eps) // 16)  # a large NFA's cost after the last check (determinize, free)
        if kind == "tail":  # (?,A): A's fragment, entered where ", " leads from its start
            a, end = self.build(node[1])
            now = _reach(self.eps, [a])
            for byte in b", ":
                now = _reach(self.eps, {t for q in now for lo, hi, t in self.edges[q] if lo <= byte <= hi})
            self.eps[s] += sorted(now)
            return s, end
        # determinize the parts on their own, combine them pairwise, embed the result
        if kind in ("and", "not"):
            d = _group_dfa(node)
            base, end = len(self.eps), [self.state() for _ in range(len(d.table) + 1)][-1]
            self.eps[s].append(base)
            t = d.table  # runs of one target: (state, first byte), up to the next run's first byte
            q, a = np.nonzero(np.concatenate([np.ones((len(t), 1), bool), t[:, 1:] != t[:, :-1]], 1))
            b = np.append(a[1:], 256)
            b[np.append(q[1:] != q[:-1], True)] = 256
            for q, a, b, target in zip(*(x.tolist() for x in (q, a, b, t[q, a]))):
                if target >= 0:
                    self.edges[base + q].append((a, b - 1, base + target))
            for q in np.flatnonzero(d.accept).tolist():
                self.eps[base + q].append(end)
            return s, end
        if kind == "set":
            tails = {(): self.state()}  # one state per distinct remaining byte-range suffix, shared
            for seq in (seq for lo, hi in node[1] for seq in utf8_ranges(lo, hi)):
                # its proper suffixes, shortest first (no closure: no cycle)
                for k in range(len(seq) - 1, 0, -1):
                    if seq[k:] not in tails:
                        tails[seq[k:]] = self.state()
                        self.edges[tails[seq[k:]]].append((*seq[k], tails[seq[k + 1:]]))
                self.edges[s].append((*seq[0], tails[seq[1:]]))
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


def _reach(adj, seeds) -> set:
    """What seeds reach along adj[state] = [next states] (epsilon closures, live states)."""
    seen, todo = set(seeds), list(seeds)
    while todo:
        for t in adj[todo.pop()]:
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return seen


# far above what the lessons build; a hostile pattern is refused in seconds, not hours
MAX_DFA_STATES = 20_000
COMPILE_BUDGET_S = 1.0   # every regex or schema compiles, or is refused, within this
_deadline = [math.inf]   # perf_counter() past which the compile under way is refused


@contextlib.contextmanager
def budget():
    """Compiles inside share one deadline (a schema's, with its regexes'), a fifth early: what runs
    between two checks (trimming, embedding a DFA) fits in the rest."""
    outer, _deadline[0] = _deadline[0], min(_deadline[0], time.perf_counter() + 0.8 * COMPILE_BUDGET_S)
    collect = gc.isenabled()
    # a compile makes millions of small lists, none in a cycle: collecting costs a third of its time
    gc.disable()
    try:
        yield
    finally:
        _deadline[0] = outer
        collect and gc.enable()


def _spend(n_states):
    # trimming them: ~10 us each
    if n_states > MAX_DFA_STATES or time.perf_counter() + 1e-5 * n_states > _deadline[0]:
        raise ValueError(f"regex too complex: its automaton passes {MAX_DFA_STATES:,} states or {COMPILE_BUDGET_S} s "
                         f"(nested repeats of alternatives that overlap multiply them); simplify the pattern")


def _determinize(nfa, start, accept):
    """Subset construction; each DFA state's bytes split into intervals with the same NFA targets.
    Subsets may blow up (nested repeats of overlapping alternatives): past the budget, refused."""
    # keep: the states that matter (fewer DFA states); closed: the closures of targets seen
    keep = lambda raw: frozenset(q for q in _reach(nfa.eps, raw) if nfa.edges[q] or q == accept)
    sets, closed = [keep([start])], {}
    ids, rows = {sets[0]: 0}, []
    while len(rows) < len(sets):
        edges = [e for s in sets[len(rows)] for e in nfa.edges[s]]
        row, cuts = np.full(256, -1, np.int32), sorted({lo for lo, _, _ in edges} | {hi + 1 for _, hi, _ in edges})
        at, raws = {c: i for i, c in enumerate(cuts)}, [[] for _ in cuts]
        for lo, hi, t in edges:  # each target into the intervals between cuts that its range covers
            for i in range(at[lo], at[hi + 1]):
                raws[i].append(t)
        _spend(len(sets))
        for a, b, raw in zip(cuts, cuts[1:], map(frozenset, raws)):
            if raw not in closed:
                closed[raw] = keep(raw)
            if closed[raw]:
                row[a:b] = ids.setdefault(closed[raw], len(ids))
                if len(ids) > len(sets):  # a subset not seen before
                    sets.append(closed[raw])
        rows.append(row)
    return np.stack(rows), np.array([accept in s for s in sets])


def _graph(table) -> tuple:
    """(successors, predecessors): each state's, as lists of states."""
    src, byte = np.nonzero(table >= 0)
    succ, pred = [[] for _ in table], [[] for _ in table]
    for a, b in zip(*(x.tolist() for x in np.divmod(np.unique(src * len(table) + table[src, byte]), len(table)))):
        succ[a].append(b)
        pred[b].append(a)
    return succ, pred


def _to_accept(dfa) -> np.ndarray:
    """Bytes from each state to the nearest accepting one (breadth-first over reversed edges)."""
    pred, dist = _graph(dfa.table)[1], np.where(dfa.accept, 0, -1)
    todo = np.flatnonzero(dfa.accept).tolist()
    for s in todo:  # grows while read: a queue
        for p in pred[s]:
            if dist[p] < 0:
                dist[p] = dist[s] + 1
                todo.append(p)
    return dist


def _trim(table, accept):
    """Keep the states on a path start -> accepting (start stays 0); other transitions go -1."""
    succ, pred = _graph(table)
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
    """table (n_states, 256) int32: next state or -1 (dead); accept (n_states,); start 0."""
    table: np.ndarray
    accept: np.ndarray

    def walk(self, state: int, data: bytes) -> int:
        for b in data:
            state = int(self.table[state, b]) if state >= 0 else -1
        return state

    def fullmatch(self, text: str) -> bool:
        s = self.walk(0, text.encode("utf-8", "surrogatepass"))
        return s >= 0 and bool(self.accept[s])


def _product(a: DFA, b: DFA, keep) -> DFA:
    """The product construction: a and b side by side, one state per pair (b's -1: dead), accepting
    where keep(a accepts, b accepts) (A and B: and; A and not B: a & ~b). A dead a stops."""
    pairs, ids, rows, nb = [(0, 0)], {1: 0}, [], len(b.table) + 1
    while len(rows) < len(pairs):
        _spend(len(pairs))
        i, j = pairs[len(rows)]
        live = np.flatnonzero(a.table[i] >= 0)
        codes = (a.table[i, live].astype(np.int64) * nb + (b.table[j, live] if j >= 0 else -1) + 1).tolist()
        for code in codes:
            if code not in ids:
                ids[code] = len(pairs)
                pairs.append((code // nb, code % nb - 1))
        rows.append(np.full(256, -1, np.int32))
        rows[-1][live] = [ids[c] for c in codes]
    i, j = np.array(pairs).T
    return DFA(*_trim(np.stack(rows), keep(a.accept[i], (j >= 0) & b.accept[j])))


@functools.lru_cache(maxsize=1024)  # a schema repeats them: each object's other keys, each pattern
def _group_dfa(node) -> DFA:
    """(?&A|B): A's and B's DFAs, and-ed pairwise; (?~A): every UTF-8 string but A's."""
    return (functools.reduce(lambda a, b: _product(a, b, np.logical_and), map(_to_dfa, node[1])) if node[0] == "and"
            else _product(_group_dfa(("and", (ANY_UTF8,))), _to_dfa(node[1]), lambda a, b: a & ~b))


def _to_dfa(node) -> DFA:
    nfa = _NFA()
    return DFA(*_trim(*_determinize(nfa, *nfa.build(node))))


# every UTF-8 string: what (?~A) complements within
ANY_UTF8 = ("rep", ("set", ((0, MAX_CHAR),)), 0, None)


class SchemaRegex(str):
    """A regex from the schema compiler: only these may use 06's groups (?&...) (?~...) (?,...)."""


def compile_regex(pattern: str) -> DFA:
    """A SchemaRegex, or a user's regex in Python's syntax (re.compile must accept it) -> DFA."""
    if not isinstance(pattern, SchemaRegex):
        why = None if pattern else "empty (it allows only an empty answer)"
        try:
            re.compile(pattern)
        except re.error as e:
            why = f"{e} (a regex in Python's syntax)"
        if why:
            raise ValueError(f"invalid regex {pattern!r}: {why}")
    return _compile(str(pattern))  # a SchemaRegex's DFA, cached under its text by schema_to_regex


@functools.lru_cache(maxsize=64)
def _compile(pattern: str) -> DFA:
    with budget():
        return _to_dfa(_Parser(pattern).parse())


# ======== THE MACHINERY, 2: JSON schema -> regex ================================================
# A fixed whitespace policy, json.dumps' layout (one line, ", " between items, ": " after keys,
# strings as ensure_ascii=False writes them), properties in schema order: keys, quotes and
# separators become jump strings. Exact or refused: the KEYWORDS of each type, COMBINATORS (not and
# oneOf on DFAs), FORMATS; bounded numbers are written as plain decimals. UNSUPPORTED keywords are
# refused by name; any other keyword is an annotation, which validators ignore (title, $comment,
# x-..., formats they do not check). Where a subset is written (see approximate()), the parts a
# `not` complements are refused. Optional properties cost jump-forward: where the member before one
# ends, the FSM holds a choice (`, "key": `, the next key or `}`) only the model can make, where a
# required key is jumped.

_HEX = "[0-9a-fA-F]"
# a string's character as json.dumps writes one: one text
STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\bfnrt]|\\u00(?:0[0-7bef]|1[0-9a-f]))'
# digits bounded, so a rambling model still ends; no -0 (one text each)
INTEGER = r"(?:0|-?[1-9][0-9]{0,15})"
INT_LIMIT = 10**16 - 1                 # the largest INTEGER matches
NUMBER = r"-?(?:0|[1-9][0-9]{0,15})(?:\.[0-9]{1,16})?(?:[eE][+-]?[0-9]{1,3})?"
_YEAR, _LEAP = r"(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)", r"(?:0[48]|[2468][048]|[13579][26])"
# a real calendar day, year 0001-9999 (date.fromisoformat)
DATE = (rf"(?:{_YEAR}-(?:(?:0[1-9]|1[0-2])-(?:0[1-9]|1[0-9]|2[0-8])|(?:0[13-9]|1[0-2])-(?:29|30)|(?:0[13578]|1[02])-31)"
        rf"|(?:[0-9]{{2}}{_LEAP}|{_LEAP}00)-02-29)")
TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
# what jsonschema's FormatChecker accepts (uuid: its usual form; date-time: T and Z upper case)
FORMATS = {"uuid": f"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}",
           "ipv4": r"(?:(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}"
                   r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])", "date": DATE, "time": TIME,
           "date-time": DATE + "T" + TIME, "email": r'[^"\\\x00-\x1f]*@[^"\\\x00-\x1f]*'}
# RFC 3986's (a subset)
_PCHAR, _NC = (rf"(?:[A-Za-z0-9\-._~!$&'()*+,;={c}]|%{_HEX}{{2}})" for c in (":@", "@"))
_REF = lambda first: (rf"(?://(?:[A-Za-z0-9\-._~!$&'()*+,;=]|%{_HEX}{{2}})*(?::[0-9]*)?(?:/{_PCHAR}*)*|/(?:{_PCHAR}+"
                      rf"(?:/{_PCHAR}*)*)?|{first}+(?:/{_PCHAR}*)*)?(?:\?(?:{_PCHAR}|[/?])*)?(?:#(?:{_PCHAR}|[/?])*)?")
# scheme:, then path, ?query, #fragment
FORMATS["uri"] = r"[a-zA-Z][a-zA-Z0-9+.\-]*:" + _REF(_PCHAR)
# a relative reference: no ':' in its first segment
_URI_REF = f"(?:{FORMATS['uri']}|{_REF(_NC)})"
FORMATS.update({"idn-email": FORMATS["email"], "regex": "[A-Za-z0-9 _-]*", "uri-reference": _URI_REF},
               **dict.fromkeys(("iri", "iri-reference"), FORMATS["uri"]))
UNEXACT_FORMATS = {"hostname", "idn-hostname", "ipv6", "uri-template", "json-pointer", "relative-json-pointer",
                   "duration", "color"}  # checked by some validators, no regex here
# they change which documents are valid; this compiler cannot say how (but NO_OPS' values)
UNSUPPORTED = {"contains", "minContains", "maxContains", "unevaluatedItems", "unevaluatedProperties",
               "propertyNames", "$dynamicRef", "$recursiveRef", "extends", "disallow", "divisibleBy"}
NO_OPS = {"propertyNames": {}}
DEPENDENCIES = ("dependencies", "dependentRequired", "dependentSchemas")
# the characters a JSON string holds unescaped: keys written freely, patterns matched
SAFE = r'[^"\\\x00-\x1f]*'
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
KEYWORDS = {"string": {"minLength", "maxLength", "pattern", "format"}, "integer": {*BOUNDS, "multipleOf"},
            "number": {*BOUNDS, "multipleOf"}, "boolean": set(), "null": set(),
            "array": {"items", "minItems", "maxItems", "uniqueItems", "prefixItems", "additionalItems"},
            "object": {"properties", "required", "additionalProperties", "patternProperties", "minProperties",
                       "maxProperties", *DEPENDENCIES}}  # each constrains its own type only
VALUE_CHECKS = [  # (keywords, test, what their value must be)
    (("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"),
     lambda v: type(v) is int and v >= 0, "a non-negative integer"),
    (BOUNDS, lambda v: type(v) in (int, float) and math.isfinite(v), "a finite number"),
    (("multipleOf",), lambda v: type(v) in (int, float) and 0 < v < math.inf, "a positive number"),
    (("enum", "anyOf", "allOf", "oneOf", "prefixItems"), lambda v: isinstance(v, list) and len(v) > 0,
     "a non-empty list"),
    (("properties", "patternProperties", *DEPENDENCIES), lambda v: isinstance(v, dict), "an object"),
    (("pattern", "$ref"), lambda v: isinstance(v, str), "a string"),
    (("additionalProperties", "additionalItems", "not", "if", "then", "else"), lambda v: isinstance(v, (dict, bool)),
     "a schema"), (("items",), lambda v: isinstance(v, (dict, bool, list)), "a schema or a list of them"),
    (("required",), lambda v: isinstance(v, list) and all(isinstance(k, str) for k in v), "a list of names"),
    (("format",), lambda v: v not in UNEXACT_FORMATS, f"a format a regex states exactly ({', '.join(FORMATS)})"),
    (("type",), lambda v: all(isinstance(t, str) and t in KEYWORDS for t in
                              ([v] if isinstance(v, str) else v if isinstance(v, list) else [0])),
     f"a type ({' '.join(KEYWORDS)}) or a list of them")]
COMBINATORS = {"type", "enum", "const", "anyOf", "allOf", "oneOf", "not", "$ref", "if"}
# a recursive $ref is unrolled this deep, then accepts nothing (optional parts, anyOf branches drop)
MAX_REF_DEPTH = 3
# a schema that allows anything writes objects and arrays nested ANY_DEPTH deep, then scalars
# (deeper where the regex stays under ANY_TEXT and fits the budget: 2, at the root and its members
# up to 8)
ANY_DEPTH = 1
ANY_TEXT = 25_000
# marks the parts a `not` complements with its path (an annotation to the rest), see negated
NEGATED = "\x00negated"
MAX_LENGTH = 128   # a string under a larger maxLength is written at most this long
FRACTION = 16      # digits after the point of a bounded number (written without exponent)


def _literal(value) -> str:
    return "".join("\\" + c if c in r"\.^$*+?{}[]()|-" else c for c in _plain(value))


def _digits(lo: str, hi: str) -> list:
    """Regexes of the digit strings lo..hi (one length): _split's ranges, [0-9] runs [0-9]{k}."""
    texts = ("".join(str(a) if a == b else f"[{a}-{b}]" for a, b in seq) for seq in _split(
        tuple(map(int, lo)), tuple(map(int, hi)), 0, 9))
    return [re.sub(r"(?:\[0-9\]){2,}", lambda m: f"[0-9]{{{m[0].count('[')}}}", text) for text in texts]


def _natural_range(lo: int, hi: int) -> list:
    """Regexes for the naturals lo..hi (no leading zeros)."""
    spans = ((max(lo, 10 ** (n - 1) * (n > 1)), min(hi, 10 ** n - 1)) for n in range(len(str(lo)), len(str(hi)) + 1))
    # one length of digits at a time
    return [r for a, b in spans if a <= b for r in _digits(str(a), str(b))]


def integer_range(lo: int, hi: int, magnitudes=_natural_range, least=1) -> str:
    """A regex of exactly the integers lo..hi as JSON writes them (no -0, no leading zeros): the
    magnitudes' regexes, "-" before the negatives' down to `least` (number_range: 0, -0.0 is 0)."""
    parts = magnitudes(max(lo, 0), hi) if hi >= 0 else []
    if -lo >= least:
        parts.append("-(?:" + "|".join(magnitudes(max(-hi, least), -lo)) + ")")
    return "(?:" + "|".join(parts) + ")"


def _fraction_digits(lo: str, hi: str) -> list:
    """Regexes of the digit strings t, 1 to len(lo) long, with lo <= t padded with zeros <= hi."""
    n = len(lo)
    if lo == "0" * n and hi == "9" * n:  # any digits (none if n is 0)
        return [f"[0-9]{{1,{n}}}"] * (n > 0)

    def then(a, b):  # what follows the first digit: may be nothing only if a is all zeros
        alts = _fraction_digits(a, b)
        return f"(?:{'|'.join(alts)})" + "?" * (a == "0" * len(a)) if alts else ""
    d0, d1 = int(lo[0]), int(hi[0])
    if d0 == d1:
        return [lo[0] + then(lo[1:], hi[1:])]
    middle = [f"[{d0 + 1}-{d1 - 1}]" + (f"[0-9]{{0,{n - 1}}}" if n > 1 else "")] if d1 - d0 > 1 else []
    return [lo[0] + then(lo[1:], "9" * (n - 1))] + middle + [hi[0] + then("0" * (n - 1), hi[1:])]


def number_range(lo: int, hi: int) -> str:
    """A regex of exactly the decimals -?int(.digits)? (no exponent, FRACTION digits at most) whose
    value times 10**FRACTION lies in lo..hi: split on the integer part, then bound the fraction."""
    scale = 10 ** FRACTION

    def magnitudes(a, b):  # 0 <= a <= b
        (ia, fa), (ib, fb) = divmod(a, scale), divmod(b, scale)

        def fraction(x, y):  # nothing after the integer is a zero fraction
            dot = r"\.(?:" + "|".join(_fraction_digits(str(x).zfill(FRACTION), str(y).zfill(FRACTION))) + ")"
            return f"(?:{dot})?" if x == 0 else dot
        if ia == ib:
            return [str(ia) + fraction(fa, fb)]
        middle = [f"(?:{'|'.join(_natural_range(ia + 1, ib - 1))})" + fraction(0, scale - 1)] if ib > ia + 1 else []
        return [str(ia) + fraction(fa, scale - 1)] + middle + [str(ib) + fraction(0, fb)]
    return integer_range(lo, hi, magnitudes, least=0)  # signs as for integers; -0 and -0.0 are zero


def _decimal_bound(bound, lower: bool, exclusive: bool) -> int:
    """The least (lower) or greatest (upper) decimal, times 10**FRACTION, validators find inside
    `bound`: they parse a decimal to the nearest float, so all from halfway between the last float
    inside and the first outside do (halfway too if it rounds inward). Bounded numbers lie within
    +-2**53, where integers are exact floats: compared the same parsed or not."""
    f, outward = float(max(-2 ** 60, min(2 ** 60, bound))), (-math.inf if lower else math.inf)
    while (f < bound or exclusive and f == bound) if lower else (f > bound or exclusive and f == bound):
        f = math.nextafter(f, -outward)  # the last float inside
    half = (Fraction(f) + Fraction(math.nextafter(f, outward))) / 2
    x, inward = half * 10 ** FRACTION, float(half) == f
    return (math.ceil(x) if inward else math.floor(x) + 1) if lower else (math.floor(x) if inward else math.ceil(x) - 1)


def _pattern(pattern: str) -> str:
    """A schema `pattern` as validators read it (re.search: a top-level branch without ^ or $ takes
    anything before or after), intersected (?&...) with the characters JSON writes unescaped."""
    # split on | outside groups and classes (a wrong split fails to parse: refused)
    branches, depth = [[]], 0
    for t in re.findall(r"\\.?|\[\^?\]?(?:\\.|[^\]\\])*\]|[()|^$]|[^\\\[()|^$]+|.", pattern, re.S):
        depth += (t == "(") - (t == ")")
        branches.append([]) if t == "|" and not depth else branches[-1].append(t)
    cores = [("".join(b[b[:1] == ["^"]:len(b) - (b[-1:] == ["$"])]), b[:1] == ["^"], b[-1:] == ["$"]) for b in branches]
    # refuses what validators read otherwise (\D \W \S)
    [_Parser(core, schema=True).parse() for core, _, _ in cores]
    return f"(?&(?:{'|'.join(f'{SAFE * (not h)}(?:{c}){SAFE * (not t)}' for c, h, t in cores)})|{SAFE})"


def _shape(value) -> dict:
    """A schema of value's types and keys, in order: beside others, the layout writes value."""
    if isinstance(value, dict):
        return {"type": "object", "properties": {k: _shape(v) for k, v in value.items()}}
    if isinstance(value, list):
        return {"type": "array", "items": {"anyOf": [_shape(v) for v in value]} if value else False}
    return {"type": {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null"}[type(value)]}


def _plain(value) -> str:
    """json.dumps' text, floats as plain decimals."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {_plain(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(map(_plain, value)) + "]"
    if isinstance(value, float):
        return np.format_float_positional(value, trim="-")
    return json.dumps(value, ensure_ascii=False)


def _fail(path, msg):
    raise ValueError(f"{path}: {msg}")


class _Empty(ValueError):
    """Unsatisfiable (sub)schema: an anyOf branch or optional property drops, else refused."""


class _SchemaCompiler:
    """A schema is the conjunction of all its keywords, so regex() compiles a list of schemas that
    must all hold: $ref (its siblings kept, unless the draft ignores them), allOf and true/false
    flatten into that list; an anyOf distributes the rest over its branches; an enum or const keeps
    only the values the rest accepts; else each type the list allows is one alternative, built from
    every member's keywords for that type. A part nothing satisfies drops out (an optional property,
    an anyOf branch), else the schema is refused."""

    def __init__(self, root, depth=ANY_DEPTH, strict=True):
        self.root, self.depth, self.strict = root, depth, strict
        # drafts 3-7: a $ref's siblings are ignored
        self.legacy = isinstance(root, dict) and re.fullmatch(
            r"http://json-schema\.org/draft-0[3467]/schema#?", str(root.get("$schema")))

    def regex(self, parts, path, refs=()) -> str:
        _spend(0)
        parts, refs = self.flatten(parts, path, refs)
        for i, p in enumerate(parts):
            key = next((k for k in ("anyOf", "oneOf", "not", "const", "enum") if k in p), None)
            if key is None:
                continue
            rest = parts[:i] + [{k: v for k, v in p.items() if k != key}] + parts[i + 1:]
            if key == "anyOf":  # A and (B or C) = (A and B) or (A and C)
                return self.union([functools.partial(self.regex, rest + [_mark(p, b)], f"{path}.anyOf[{j}]", refs)
                                   for j, b in enumerate(p["anyOf"])], path, "anyOf branch")
            if key == "oneOf":  # exactly one branch: each one, and not the others
                one = p["oneOf"]
                alone = [{"allOf": [b] + [{"not": c} for c in one[:j] + one[j + 1:]]} for j, b in enumerate(one)]
                return self.regex(rest + [_mark(p, {"anyOf": alone})], path, refs)
            # the documents of the rest that its schema rejects: A and not B, on their DFAs
            if key == "not":
                out, negated = self.regex(rest, path, refs), self.negated(rest, p["not"], f"{path}.not", refs)
                return out if negated is None else f"(?&(?:{out})|(?~{negated}))"
            values = p["enum"] if key == "enum" else [p["const"]]
            if any(isinstance(v, (dict, list)) for v in values):
                self.approximate(parts, "an enum's objects and arrays are written in one key order")
            kept = [_literal(v) for v in values if self.accepts(rest, v, path, refs)]
            if not kept:
                raise _Empty(f"{path}: no value of its {key} {values!r} is valid under the rest of the schema")
            return "(?:" + "|".join(kept) + ")"
        types = set(KEYWORDS)
        for p in parts:
            if "type" in p:
                named = {p["type"]} if isinstance(p["type"], str) else set(p["type"])
                # an integer is a number
                types &= named | ({"integer"} if "number" in named else set())
        if not types:
            raise _Empty(f"{path}: its types {[p['type'] for p in parts if 'type' in p]} have none in common")
        if "integer" in types and "number" not in types and any("number" in str(p.get("type")) for p in parts):
            self.approximate(parts, "a number that is an integer is written only as an integer")
        if not any(k in p for p in parts for k in COMBINATORS | set().union(*KEYWORDS.values())):
            # any value: at the root and its members self.depth deep (one copy each); past 2 levels,
            # arrays of scalars (linear)
            top = not refs.count("*") and refs.count(".") + refs.count("[") < 2
            refs += ("^",) * top
            depth = self.depth if "^" in refs else min(self.depth, ANY_DEPTH + 1)
            if refs.count("*") >= depth or refs[-1:] == ("[",) and refs.count("*") > ANY_DEPTH + 1:
                self.approximate(parts, f"any value is written at most {depth} deep")
                types -= {"object", "array"}
            refs += ("*",)
        types -= {"integer"} if "number" in types else set()
        out = self.union([functools.partial(self.typed, t, parts, path, refs) for t in sorted(types)], path, "type")
        # regex text past 2 MB is too much too (each object repeats a free value's text, ...)
        _spend(len(out) // 100)
        return out

    def negated(self, rest, schema, path, refs):
        """The regex of rest and schema, to be complemented: it must hold every document of rest's
        layout that the schema accepts, so approximating its parts (marked NEGATED) is refused."""
        with contextlib.suppress(_Empty):  # it accepts nothing: its complement, everything
            return self.regex(rest + [_mark({NEGATED: path}, schema)], path, refs)

    def closes(self, parts) -> bool:
        """Strict mode (XGrammar's strict_mode): an object or array that names members or items, and
        says nothing of others, gets none; in a `not`, the specification's reading (exact)."""
        return self.strict and not any(p.get(NEGATED) for p in parts)

    def approximate(self, parts, why):
        """The regex holds fewer documents than the parts allow: harmless unless in a `not`."""
        for p in (p for p in parts if p.get(NEGATED) and len(p) > 1):
            _fail(p[NEGATED], f"cannot be complemented exactly: {why}")

    def flatten(self, parts, path, refs):
        """(plain dict schemas, the $refs entered on the way), each checked keyword by keyword."""
        out, todo = [], list(parts)
        while todo:
            s = todo.pop(0)
            if s is True:
                continue
            if s is False:
                raise _Empty(f"{path}: the schema false accepts nothing")
            if not isinstance(s, dict):
                _fail(path, f"a schema must be an object, got {type(s).__name__}")
            if self.legacy and "$ref" in s:
                s = {k: v for k, v in s.items() if k in ("$ref", NEGATED)}
            for key in (k for k in s if k in UNSUPPORTED and s[k] != NO_OPS.get(k, ())):
                _fail(path, f"unsupported keyword {key!r} (it would change which documents are valid, and this "
                            f"compiler cannot express it)")
            for keys, ok, what in VALUE_CHECKS:
                for key in (k for k in keys if k in s and not ok(s[k])):
                    _fail(path, f"{key} {s[key]!r} is not {what}")
            if "$ref" in s:
                if refs.count(s["$ref"]) >= MAX_REF_DEPTH:
                    self.approximate([s], f"recursive $ref {s['$ref']!r} is unrolled {MAX_REF_DEPTH} deep")
                    raise _Empty(f"{path}: recursive $ref {s['$ref']!r} is unrolled {MAX_REF_DEPTH} deep, no deeper")
                todo, refs = [_mark(s, self.resolve(s["$ref"], path))] + todo, refs + (s["$ref"],)
            out.append({k: v for k, v in s.items() if k not in ("$ref", "allOf", "if")})
            cond = [{"anyOf": [{"allOf": [s["if"], s.get("then", True)]}, {"allOf": [{"not": s["if"]}, s.get(
                "else", True)]}]}] if "if" in s else []  # (if and then) or (not if and else)
            # depth first: a part's parts stay together
            todo[:0] = [_mark(s, c) for c in s.get("allOf", []) + cond]
        return out, refs

    def resolve(self, ref, path):
        node = self.root
        # a JSON pointer into the schema
        for key in ref.split("/")[1:] if ref[:2] in ("#", "#/") else [None]:
            key = key and key.replace("~1", "/").replace("~0", "~")
            if not (isinstance(node, dict) and key in node):
                _fail(path, f"cannot resolve $ref {ref!r} (only references into this schema: #/$defs/...)")
            node = node[key]
        return node

    def union(self, makers, path, what) -> str:
        """(?:a|b|...) of the alternatives that accept something; _Empty if none does."""
        out, why = [], []
        for make in makers:
            try:
                out.append(make())
            except _Empty as e:
                why.append(e)
        if not out:
            raise why[0] if len(why) == 1 else _Empty(f"{path}: no {what} accepts anything ({why[0]}, ...)")
        return out[0] if len(out) == 1 else "(?:" + "|".join(out) + ")"

    def accepts(self, parts, value, path, refs) -> bool:
        """Whether `value` is a document of every schema in `parts`: their regex matches its
        json.dumps text, or _plain's (1e-07 as 0.0000001: how bounded numbers are written)."""
        try:
            dfa = _compile(self.regex([_shape(value)] + parts, path, refs))
        except _Empty:
            return False
        return dfa.fullmatch(json.dumps(value, ensure_ascii=False)) or dfa.fullmatch(_plain(value))

    def typed(self, kind, parts, path, refs) -> str:
        """The documents of one type that every part accepts: all its keywords for that type."""
        kw = {k: [p[k] for p in parts if k in p] for k in KEYWORDS[kind] if any(k in p for p in parts)}
        if kind == "string":
            return self.string(kw, parts, path)
        if kind in ("integer", "number"):
            return self.numeric(kind, kw, parts, path)
        if kind == "object":
            return r"\{" + self.members(parts, path, refs) + r"\}"
        if kind == "array":
            return self.array(kw, parts, path, refs)
        return {"boolean": "(?:true|false)", "null": "null"}[kind]

    def string(self, kw, parts, path) -> str:
        """A string within all lengths, matching all patterns and formats (if without escapes)."""
        lo, hi = max(kw.get("minLength", [0])), min(kw.get("maxLength", [math.inf]))
        if lo > hi:
            raise _Empty(f"{path}: minLength {lo} is above maxLength {hi}")
        if MAX_LENGTH < hi < math.inf:  # each character up to it is some 15 DFA states
            self.approximate(parts, f"a string under a maxLength is written at most {MAX_LENGTH} "
                                    "characters long")
            hi = max(lo, MAX_LENGTH)
        chars = f'{STRING_CHAR}{{{lo},{"" if hi == math.inf else hi}}}'
        formats = [FORMATS[f] for f in kw.get("format", []) if f in FORMATS]  # others: annotations
        exact = [_pattern(p) for p in kw.get("pattern", [])] + formats
        if not exact:
            return f'"{chars}"'
        self.approximate(parts, "a pattern or format is matched on strings without escapes only")
        both = exact + [chars] * bool(lo or hi < math.inf)
        return '"(?&' + "|".join(f"(?:{e})" for e in both) + ')"'

    def numeric(self, kind, kw, parts, path) -> str:
        """An integer or a number within every bound (decimals: at most FRACTION of them)."""
        if kind == "number":
            self.approximate(parts, "a number is written in one of its several ways")
        if any(not (1 / v).is_integer() or math.frexp(1 / v)[0] != 0.5 for v in kw.get("multipleOf", [])):
            _fail(path, f"'multipleOf' {kw['multipleOf']} is not supported (but 1, 1/2, 1/4, ...: "
                        "every integer)")
        kind = "integer" if "multipleOf" in kw else kind  # a number too is written as an integer
        lows = [(v, k == "exclusiveMinimum") for k in ("minimum", "exclusiveMinimum") for v in kw.get(k, [])]
        highs = [(v, k == "exclusiveMaximum") for k in ("maximum", "exclusiveMaximum") for v in kw.get(k, [])]
        if not lows + highs:
            return INTEGER if kind == "integer" else NUMBER
        if kind == "integer":
            lo = max([-INT_LIMIT] + [math.floor(v) + 1 if ex else math.ceil(v) for v, ex in lows])
            hi = min([INT_LIMIT] + [math.ceil(v) - 1 if ex else math.floor(v) for v, ex in highs])
            if lo > hi:
                raise _Empty(f"{path}: no integer lies in [{lo}, {hi}]")
            return integer_range(lo, hi)
        top = 2 ** 53 * 10 ** FRACTION - 1  # decimals as integers, times 10**FRACTION
        lo = max([-top] + [_decimal_bound(v, True, ex) for v, ex in lows])
        hi = min([top] + [_decimal_bound(v, False, ex) for v, ex in highs])
        if lo > hi:
            raise _Empty(f"{path}: no number with at most {FRACTION} decimals lies in bounds {lows + highs}")
        return number_range(lo, hi)

    def array(self, kw, parts, path, refs) -> str:
        """Items all parts accept, by position (heads, then the rest), in minItems..maxItems."""
        lo, hi = max(kw.get("minItems", [0])), min(kw.get("maxItems", [math.inf]))
        if any(p.get("uniqueItems") for p in parts):  # no two items alike: surely, with at most one
            self.approximate(parts, "an array of unique items is written with at most one")
            hi = min(hi, 1) if lo <= 1 else _fail(path, "uniqueItems with minItems above 1 is not supported")
        heads, tail = [_items(p) for p in parts], ""
        n = max((len(head) for head, _, _ in heads), default=0)
        if self.closes(parts) and n and not any(named for _, _, named in heads):  # no more after
            heads = [(head, False, True) for head, _, _ in heads]
        for i in reversed(range(min(n + 1, hi))):  # position n stands for every item past the head
            schemas = [_mark(p, head[i] if i < len(head) else rest) for p, (head, rest, _) in zip(parts, heads)]
            try:
                item = self.regex(schemas, f"{path}[{i}]", refs + ("[",))
            except _Empty:
                hi, tail = i, ""
                continue
            tail = (f"(?:, {item}){{{max(lo - n, 0)},{'' if hi == math.inf else hi - n}}}"
                    if i == n else f"(?:, {item}{tail})" + "?" * (i >= lo))
        if lo > hi:
            raise _Empty(f"{path}: minItems {lo} is above the {hi} items it can hold")
        return rf"\[(?,{tail})\]" if lo else rf"\[(?:(?,{tail}))?\]"

    def members(self, parts, path, refs) -> str:
        """The `"key": value` members, joined by ", ": every property a part names, in order (one
        not required may be left out, and is if no value satisfies it), then others in any order
        (keys without escapes; values by patternProperties, else additionalProperties): (?,...) of
        ", "-led members writes each value once."""
        names = list(dict.fromkeys(k for p in parts for k in [*p.get("properties", {}), *p.get("required", [])]))
        required, pats = {k for p in parts for k in p.get("required", [])}, []
        for p in parts:
            pats += [q for q in p.get("patternProperties", {}) if q not in pats]
            for a, need in ((a, d) for key in DEPENDENCIES for a, d in p.get(key, {}).items()):
                if a in required and isinstance(need, list):
                    required |= set(need)
                    names += [k for k in need if k not in names]
                elif a in required:
                    _fail(path, f"a dependent schema of a required property ({a!r}) is not supported")
                elif not (isinstance(need, list) and set(need) <= required):  # never written
                    self.approximate(parts, f"property {a!r} with dependencies is not written")
                    parts, names = parts + [{"properties": {a: False}}], names + [a] * (a not in names)
        fields = []
        for k in names:
            own = lambda p: [s for q, s in p.get("patternProperties", {}).items() if re.search(q, k)] + (
                [p["properties"][k]] if k in p.get("properties", {}) else []) or [p.get("additionalProperties", True)]
            try:
                value = self.regex([_mark(p, s) for p in parts for s in own(p)], f"{path}.{k}", refs + (".",))
                fields.append((f"(?:, {_literal(k)}: {value})", k in required))
            except _Empty:
                if k in required:
                    raise
        # strict: the named members (and patternProperties' keys) only, unless additionalProperties
        # says otherwise
        others = []
        shut = self.closes(parts) and (names or pats) and not any("additionalProperties" in p for p in parts)
        # a class of keys each: q's (None: no pattern's), no other's, no name
        for q in [None] * (not shut) + pats:
            key = [f'"{SAFE}"'] + [f"(?~(?:{'|'.join(map(_literal, names))}))"] * bool(names) + [
                f'"{_pattern(r)}"' if r == q else f'(?~"{_pattern(r)}")' for r in pats]
            with contextlib.suppress(_Empty):
                others.append(f"(?&{'|'.join(key)}): " + self.regex([_mark(p, p.get("patternProperties", {}).get(
                    q, p.get("additionalProperties", True))) for p in parts], f"{path}.*", refs + (".",)))
        if len(pats) > 1:
            self.approximate(parts, "a key two patternProperties match is not written")
        if others and set(names) - {k for p in parts if not p.get(NEGATED) for k in [*p.get("properties", {}),
                                                                                    *p.get("required", [])]}:
            self.approximate(parts, "an object's other members are written after the properties it names")
        low = max((p.get("minProperties", 0) for p in parts), default=0)
        high = min((p.get("maxProperties", math.inf) for p in parts), default=math.inf)
        if low > max(len(required), 1):
            _fail(path, f"'minProperties' {low}, more than the properties required, is not supported")
        # then only the required ones, if too many
        if high < len(fields) + (math.inf if others else 0):
            self.approximate(parts, "an object under maxProperties is written with fewer members")
            fields, others = [f for f in fields if f[1] or len(fields) <= high], []
        if high < len(required):
            raise _Empty(f"{path}: maxProperties {high} is below the {len(required)} properties required")
        body = "".join(f + "?" * (not req) for f, req in fields) + (f"(?:, (?:{'|'.join(others)}))*" if others else "")
        return f"(?,{body})" if required or low else f"(?:(?,{body}))?"


def _items(p) -> tuple:
    """(the schemas of an array's first items, of every item after them, whether p names the
    latter): prefixItems and items (2020-12), or items as a list and additionalItems (before)."""
    old = isinstance(p.get("items"), list)
    rest = "additionalItems" if old else "items"
    return p.get("prefixItems", p["items"] if old else []), p.get(rest, True), rest in p


def _mark(parent, schema):
    """schema, marked NEGATED if its parent is: it comes from what a `not` complements."""
    return {**schema, NEGATED: parent[NEGATED]} if parent.get(NEGATED) and isinstance(schema, dict) else schema


def schema_to_regex(schema, path="$", strict=True) -> SchemaRegex:
    """A JSON schema -> a regex of exactly the documents in 06's layout that it accepts (the subset:
    this section's heading), or a ValueError naming what it cannot express, or that no document
    satisfies it; its DFA is compiled (and cached) within the same COMPILE_BUDGET_S. strict (the
    default, XGrammar's): an object or array naming its members or items gets no others unless it
    says so (additionalProperties, patternProperties, items past prefixItems), else a small model
    invents members until max_tokens cuts it; False: the specification's (any other member)."""
    try:
        with budget():
            t0, out = time.perf_counter(), _SchemaCompiler(schema, ANY_DEPTH, strict).regex([schema], path)
            if not _compile(out).accept.any():
                raise _Empty("its parts exclude each other")
            rate, deep = (time.perf_counter() - t0) / len(out), out  # seconds per character
            # free values deeper, up to 8, while the regex stays short and fits the budget left (its
            # time estimated); else as they were
            with contextlib.suppress(ValueError):
                for depth in range(ANY_DEPTH + 1, 9):
                    text = _SchemaCompiler(schema, depth, strict).regex([schema], path)
                    over = len(text) >= ANY_TEXT or rate * len(text) > _deadline[0] - time.perf_counter()
                    if text == deep or over:
                        break
                    deep = text
                out = _compile(deep) and deep
            return SchemaRegex(out)
    except _Empty as e:
        raise ValueError(f"{path}: no document satisfies this schema ({e})") from None


# ======== DEMO: masking only vs jump-forward, same model, same run ===============================

CHARACTER_REGEX = (  # SGLang's example, examples/frontend_language/usage/json_decode.py
    r"""\{\n    "name": "[\w\d\s]{1,16}",\n"""
    r"""    "house": "(Gryffindor|Slytherin|Ravenclaw|Hufflepuff)",\n"""
    r"""    "blood status": "(Pure-blood|Half-blood|Muggle-born)",\n"""
    r"""    "occupation": "(student|teacher|auror|ministry of magic|death eater|"""
    r"""order of the phoenix)",\n"""
    r"""    "wand": \{\n        "wood": "[\w\d\s]{1,16}",\n        "core": "[\w\d\s]{1,16}",\n"""
    r"""        "length": [0-9]{1,2}\.[0-9]{0,2}\n    \},\n    "alive": "(Alive|Deceased)",\n"""
    r"""    "patronus": "[\w\d\s]{1,16}",\n    "bogart": "[\w\d\s]{1,16}"\n\}""")
DEMO_PROMPT = "Please describe the character Hermione Granger from Harry Potter."
MODES = ("masking_only", "jump_forward")


def demo_model():
    """The demo's Pydantic model, as users hand one to a constrained decoder
    (Model.model_json_schema()): nested models ($defs/$ref), an Enum, a Literal, bounded int and
    float, lengths, two fields with defaults (not required); extra="forbid" (additionalProperties
    false), else the model may write other members. 06 compiles schema dicts."""
    from enum import Enum
    from typing import Annotated, Literal, Optional

    from pydantic import BaseModel, ConfigDict, Field

    class House(str, Enum):
        GRYFFINDOR, SLYTHERIN, RAVENCLAW, HUFFLEPUFF = "Gryffindor", "Slytherin", "Ravenclaw", "Hufflepuff"

    class Wand(BaseModel):
        model_config = ConfigDict(extra="forbid")
        wood: str = Field(max_length=16)
        core: Literal["phoenix feather", "dragon heartstring", "unicorn hair"]
        length: float = Field(ge=7, le=16, description="inches")

    class Character(BaseModel):
        model_config = ConfigDict(extra="forbid")
        name: str = Field(max_length=24)
        house: House
        age: int = Field(ge=11, le=150)
        wand: Wand
        patronus: Optional[str] = Field(default=None, max_length=16)
        friends: list[Annotated[str, Field(max_length=24)]] = Field(default=[], max_length=3)
    return Character


def compare(model, tok, name, pattern, prompt, max_new_tokens=256, pydantic=None) -> dict:
    """Build the index, then decode the same prompt masking-only and with jump-forward (greedy).
    Checks each completion: the DFA and Python's `re` accept it, its ids decode to it, and, given
    the Pydantic model whose schema `pattern` is, its model_validate_json."""
    index, prompt_ids = TokenIndex(pattern, tok), tok.chat(prompt)
    cache_len = len(prompt_ids) + 2 * max_new_tokens + 512  # room for re-tokenized jump strings too
    runs = [constrained_decode(index, tok, prompt_ids, model_logits_fn(model, cache_len), max_new_tokens,
                               jump_forward=(mode == "jump_forward")) for mode in MODES]
    for r in runs:
        text = r["text"]
        matches = r["finished"] and index.dfa.fullmatch(text) and _python_re_accepts(pattern, text)
        r.update(completion=text, matches=bool(matches), decodes=tok.decode(r["ids"]) == text,
                 valid=r["finished"] and _validates(pydantic, text), output_tokens=len(r["ids"]),
                 tokenizer_tokens=len(tok.encode(text)))  # the tokenizer's count for the same text
    edges, (a, b) = index.compressed_edges(), runs
    out = dict(name=name, regex=pattern, dfa_states=len(index.dfa.table), index_build_s=round(index.build_s, 3),
               compressed_edges=len(edges), compressed_bytes=sum(map(len, edges.values())),
               **{key: {mode: r[key] for mode, r in zip(MODES, runs)} for key in a if key not in ("ids", "text")},
               forward_pass_ratio=a["forward_passes"] / max(1, b["forward_passes"]),
               speedup=a["seconds"] / b["seconds"])
    return {**out, "validator": f"{pydantic.__name__}.model_validate_json"} if pydantic else out


def _python_re_accepts(pattern, text) -> bool:
    """The independent check, where re reads it (not 06's own groups)."""
    with contextlib.suppress(re.error):
        return re.fullmatch(pattern, text, re.ASCII) is not None
    return True


def _validates(pydantic, text) -> bool:
    with contextlib.suppress(ValueError):  # pydantic's ValidationError is a ValueError
        return not pydantic or pydantic.model_validate_json(text) is not None
    return False


def report(prompt, runs) -> None:
    print(f"prompt: {prompt!r}")
    for r in runs:
        print(f"\n=== {r['name']}: {r['dfa_states']} DFA states, first mask ready in {r['index_build_s']:.2f} s; "
              f"compressed FSM: {r['compressed_edges']} jump edges, {r['compressed_bytes']} forced bytes")
        for mode in MODES:
            print(f"--- {mode}:\n{r['completion'][mode]}")
        for mode in MODES:
            x = {k: v[mode] for k, v in r.items() if isinstance(v, dict)}  # this mode's figures
            print(f"  {mode:13s} forward passes {x['forward_passes']:4d}   tokens computed {x['tokens_computed']:4d}   "
                  f"output tokens {x['output_tokens']:4d} (tokenizer: {x['tokenizer_tokens']:4d})   "
                  f"jumps {x['jumps']:3d}   {x['seconds']:6.2f} s   matches: {x['matches']}")
        ok = lambda key: "yes" if all(r[key].values()) else "NO"
        print(f"  jump-forward: {r['forward_pass_ratio']:.2f}x fewer forward passes, {r['speedup']:.2f}x faster")
        checked = (f"checked, both answers: finished and accepted by the DFA and by Python's re (where it reads the "
                   f"regex): {ok('matches')}; their token ids decode to the text: {ok('decodes')}" +
                   (f"; {r['validator']} accepts it: {ok('valid')}" if "validator" in r else ""))
        print(textwrap.fill(checked + ".", 116, initial_indent="  ", subsequent_indent="    "))


def main(argv=None):
    ap = argparse.ArgumentParser(description="Constrained decoding: masking only vs compressed FSM + jump-forward.")
    ap.add_argument("--regex", help="constrain to this regex (Python syntax subset, see the docstring)")
    ap.add_argument("--json-schema", metavar="FILE", help="constrain to this JSON schema")
    ap.add_argument("--prompt", default=DEMO_PROMPT)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--model", help="model path (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--json", action="store_true", help="print one JSON object: the first run's figures (completion, "
                    "forward_passes, ..., each keyed by masking_only / jump_forward), runs: every run's")
    ap.add_argument("--bench", action="store_true", help="06 vs xgrammar and llguidance: tests/bench_06.py (CPU)")
    args = ap.parse_args(argv)
    import llama3_generate as L
    L01.cpu_threads()  # one thread on 2 cores (why: in its docstring)
    # the peers beside 06 (they are not the lesson): held schemas, compile and mask times
    if args.bench:
        return runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests", "bench_06.py"),
                              run_name="__main__")
    if args.max_new_tokens < 1:
        ap.error("--max-new-tokens must be >= 1")
    try:  # bad input fails here, before the model loads
        tasks = [("regex", args.regex, None)] if args.regex is not None else []
        if args.json_schema:
            with open(args.json_schema) as f:
                tasks.append((f"JSON schema {args.json_schema}", schema_to_regex(json.load(f)), None))
        if not tasks:
            character = demo_model()
            tasks = [("character profile regex (SGLang)", CHARACTER_REGEX, None),
                     ("Pydantic model Character", schema_to_regex(character.model_json_schema()), character)]
        for _, pattern, _ in tasks:
            compile_regex(pattern)
    except ImportError:
        sys.exit("error: the demo's model needs pydantic (pip install -r requirements.txt), or pass --regex")
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        sys.exit(f"error: {e}")
    try:
        model, tok = L.load_model(args.model)
        runs = [compare(model, tok, name, pattern, args.prompt, args.max_new_tokens, pydantic)
                for name, pattern, pydantic in tasks]
    except (L.UserError, ValueError) as e:
        sys.exit(f"error: {e}")
    print(json.dumps({**runs[0], "runs": runs})) if args.json else report(args.prompt, runs)


if __name__ == "__main__":
    main()
