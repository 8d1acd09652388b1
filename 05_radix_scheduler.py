"""
05_radix_scheduler.py -- SGLang's RadixAttention: a radix tree of cached KV, LRU eviction, cache-aware scheduling.

Many requests share prompt prefixes: a system prompt, few-shot examples, a document asked several
questions, the history of a chat, the trunk of a tree-of-thought search. RadixAttention keeps the KV
of finished requests in a radix tree keyed by token ids (edges hold token runs, values hold the KV
slots of 03's pool), so a new request computes only its uncached suffix. When memory runs out,
unlocked leaves are evicted least-recently-used first; a running request locks the path it uses
(lock_ref counts on every node up to the root).

    (1) request A: sys+Q1 -> A1      (2) B = sys+Q2: match "sys",      (3) C = sys+Q1+A1+Q3 (next chat turn):
                                         split the edge, add a leaf       reuses the whole A path
      root                             root                              root
       '- [sys Q1 A1]                   '- [sys]                          '- [sys]
                                            |- [Q1 A1]                        |- [Q1 A1]
                                            '- [Q2 B1]                        |   '- [Q3 C1]
                                                                              '- [Q2 B1]  <- LRU leaf: evicted first
    Values: each edge's tokens map to slot ids in 03's TokenAllocator pool; the tree holds one reference per slot.

Pages: the same tree runs over 02's blocks (page = block_size): edges, matches and evictions come in
whole pages, a hit adds the tree's blocks to the request's block table by reference, and a prefix is
shared only up to its last full page (its partial last page is recomputed) -- SGLang's
page_size > 1. The report's pages row shows what that costs.

Hit rate = cached prompt tokens / all prompt tokens (1 - prefill tokens computed / prompt tokens).
Lower bound: every token of the workload's prompt tree must be computed at least once, so prefill C
>= sum of the edge lengths of that tree (not counting tokens a request's decode already produced:
the previous turns of a chat). The optimal hit rate follows: 1 - C_min / prompt tokens (88.2% for
the generated-shared-prefix workload: (2048 + 16*128) of 16*2176).

Cache-aware scheduling (the paper's Algorithm 1): each step, match every waiting request's prefix,
sort the queue by policy, admit requests while their new tokens fit in free + evictable slots
(locking their prefixes), evict LRU leaves if allocation falls short, run one batch (prefill of the
admitted + one decode token of every running request: continuous batching), insert finished requests
into the tree and unlock them. Longest-prefix-match first (lpm) is a depth-first walk of the tree:
the request sharing the deepest cached node runs next, so a subtree is finished while its path is
still cached; with room for the longest path, LRU only evicts finished subtrees and every edge is
computed exactly once, C = sum of edge lengths (the paper's Theorem 3.1). fcfs and random jump
between subtrees and recompute evicted prefixes; dfs-weight (SGLang) walks the tree visiting the
subtree with the most waiting requests first.

Details that matter (as in SGLang): a prompt goes into the tree right after its prefill, not only
when the request finishes, so requests arriving while it decodes already hit it; a cache-aware
policy holds back a request sharing >= 32 uncached tokens with one admitted in the same step
(in-batch prefix caching: next step it is a hit); admission reserves every slot a request will take
(prompt suffix + max_new_tokens - 1), so the running batch never runs out. Where lpm stays below
the optimum: siblings admitted together each recompute a short shared piece (under the 32-token
rule), and a small pool evicts prefixes that concurrently running requests could not all keep.

The same class schedules llama3_generate.py's engine, with three options (see Scheduler):
reserve=False admits without reserving decode slots and, when the pool runs short, evicts and then
preempts through 02's Scheduler, which this one extends; mixed=False runs prefill steps apart from
decode steps (vLLM's order), so decode batches stay CUDA-graph-able, with a decode step between two
prefill steps while requests decode; chunk_tokens cuts long prompts into chunks (Sarathi-Serve's
chunked prefill), so that no running request waits longer than one chunk's step (prefill-first: and
a decode step) for its next token -- the report's last table shows the step timeline.

Imports: 02 (Request, Scheduler) and 03 (the token pool) at module level; no model.

References: Zheng et al. 2024, "SGLang: Efficient Execution of Structured Language Model Programs"
(RadixAttention, Algorithm 1); sglang/srt/mem_cache/radix_cache.py and managers/schedule_policy.py
(lpm, dfs-weight, in-batch prefix caching, chunked requests); Agrawal et al. 2024, "Taming
Throughput-Latency Tradeoff in LLM Inference with Sarathi-Serve" (chunked prefill, stall-free
batching); mini-sglang for the invariant style.
Run: python 05_radix_scheduler.py [--workload W] [--policy P] [--json]
"""
from __future__ import annotations

import argparse
import heapq
import importlib
import json
import random
import time
from collections import defaultdict, deque

import numpy as np
import torch

# Request, Scheduler: continuous batching and preemption
L02 = importlib.import_module("02_paged_cache_manager")
# TokenAllocator pool + TokenKVCache backend (add_prefix, slots)
L03 = importlib.import_module("03_token_allocator")


# ======== THE IDEA, 1: a radix tree of cached KV, LRU eviction, locks on the paths in use =========

class Node:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "serial")

    def __init__(self, key=(), value=None, parent=None, serial=0):
        self.children = {}       # first token of the child's edge -> child
        # key: tuple of token ids on the edge into this node
        self.parent, self.key, self.value = parent, key, value
        # value: LongTensor (len(key),) of KV slots
        self.lock_ref, self.last_access, self.serial = 0, 0, serial


def _common(edge, key, i):
    """How many leading tokens of edge equal key[i:]."""
    n = min(len(edge), len(key) - i)
    if key[i:i + n] == edge[:n]:
        # fast path: the whole edge (or all that is left of key) matches, C-speed compare
        return n
    j = 0
    while edge[j] == key[i + j]:
        j += 1
    return j


class RadixCache:
    """Token ids -> KV slots in a TokenAllocator pool or 02's BlockRefs (allocator=None: a token
    radix tree only). page: tokens per key unit (02's block_size; 1: a token): edges, matches,
    inserts and evictions in whole pages, children keyed by their first page, a page one block."""

    def __init__(self, allocator=None, page=1):
        self.allocator, self.clock, self.serial, self.page = allocator, 0, 0, page
        self.root = Node()
        self.root.lock_ref = 1  # never evicted
        self.evictable, self.protected = 0, 0  # tokens under unlocked / locked nodes

    def _first(self, key, i):
        # the child key of an edge starting at key[i]: its first token, or page
        return key[i] if self.page == 1 else key[i:i + self.page]

    def evictable_size(self) -> int:
        return self.evictable

    def protected_size(self) -> int:
        return self.protected

    def _split(self, child, n):
        """Cut child's edge after n tokens: parent -> new[:n] -> child[n:]. Sizes and locks are unchanged."""
        self.serial += 1
        new = Node(child.key[:n], child.value[:n], child.parent, self.serial)
        new.lock_ref, new.last_access = child.lock_ref, child.last_access
        new.children = {self._first(child.key, n): child}
        child.parent.children[self._first(child.key, 0)] = new
        child.key, child.value, child.parent = child.key[n:], child.value[n:], new
        return new

    def _walk(self, key):
        """Follow key (whole pages) down, splitting the edge it ends in -> (values, last node)."""
        self.clock += 1
        node, values, i = self.root, [], 0
        while i < len(key) and (child := node.children.get(self._first(key, i))) is not None:
            # >= one page: the child's key is its first
            n = _common(child.key, key, i) // self.page * self.page
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = self.clock
            values.append(child.value)
            node, i = child, i + n
        return values, node

    def match_prefix(self, tokens, compute_last=True):
        """(slots LongTensor (m,), last node) of the longest cached prefix. compute_last: match at
        most len - 1 tokens, so at least one token is computed and gives the logits of the next
        token."""
        key = tuple(tokens[:len(tokens) - 1] if compute_last else tokens)
        values, node = self._walk(key[:len(key) // self.page * self.page])
        if self.allocator is None:  # bookkeeping: the token ids stand for their slots
            return key[:sum(map(len, values))], node
        slots = torch.cat(values) if len(values) > 1 else values[0] if values else torch.empty(0, dtype=torch.long)
        return slots, node

    def insert(self, tokens, slots=None) -> int:
        """Cache tokens -> slots (LongTensor (len,)), their full pages only (the partial last one
        stays the caller's, recomputed by whoever needs it); returns how many leading tokens were
        already cached. The tree takes its own reference (inc_ref) on the slots it stores; the
        caller then releases its references as usual, which frees its duplicate slots (the first
        `returned` ones it computed itself)."""
        key = tuple(tokens[:len(tokens) // self.page * self.page])
        values, node = self._walk(key)
        n = sum(len(v) for v in values)
        if n < len(key):
            self.serial += 1
            leaf = Node(key[n:], key[n:] if slots is None else slots[n:len(key)].clone(), node, self.serial)
            leaf.last_access = self.clock
            node.children[self._first(key, n)] = leaf
            self.evictable += len(leaf.key)
            if self.allocator is not None:
                self.allocator.inc_ref(leaf.value)
        return n

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def evict(self, n: int) -> int:
        """Evict unlocked leaves, least recently used first, until >= n tokens are freed; returns tokens freed."""
        heap = [(x.last_access, x.serial, x) for x in self._nodes() if not x.children and x.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < n and heap:
            _, _, x = heapq.heappop(heap)
            if self.allocator is not None:
                # drop the tree's reference: the slots return to the pool
                self.allocator.free(x.value)
            freed += len(x.key)
            self.evictable -= len(x.key)
            parent = x.parent
            del parent.children[self._first(x.key, 0)]
            if not parent.children and parent.lock_ref == 0:  # a parent left childless is the next candidate
                heapq.heappush(heap, (parent.last_access, parent.serial, parent))
        return freed

    def inc_lock_ref(self, node) -> int:
        """Protect node and its ancestors from eviction; returns the change of evictable_size (<= 0)."""
        delta = 0
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable -= len(node.key)
                self.protected += len(node.key)
                delta -= len(node.key)
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, node) -> int:
        """Undo one inc_lock_ref(node); returns the change of evictable_size (>= 0)."""
        if node is not self.root and node.lock_ref <= 0:
            raise ValueError("dec_lock_ref: node is not locked")
        delta = 0
        while node is not self.root:
            if node.lock_ref == 1:
                self.evictable += len(node.key)
                self.protected -= len(node.key)
                delta += len(node.key)
            node.lock_ref -= 1
            node = node.parent
        return delta

    def check(self, held=()):
        """Integrity: edges well formed, locks nested, sizes add up, and with a pool every slot's
        refcount == (1 if the tree holds it) + (times it appears in `held`: the running requests'
        rows), so that tree slots + request-only slots + free slots == pool size."""
        sizes, slots = [0, 0], []
        for node in self._nodes():
            kids = node.children
            assert node is self.root or node.lock_ref >= sum(c.lock_ref for c in kids.values()), "locks not nested"
            for t, c in kids.items():
                assert c.parent is node and len(c.key) > 0 and self._first(c.key, 0) == t, "bad edge"
                assert len(c.key) % self.page == 0, "an edge holds a partial page"
                assert len(c.key) == len(c.value), "edge and value lengths differ"
                sizes[c.lock_ref > 0] += len(c.key)
                slots.append(c.value)
        assert sizes == [self.evictable, self.protected], f"sizes {sizes} != {[self.evictable, self.protected]}"
        if self.allocator is None:
            return
        a, P = self.allocator, self.page
        tree = torch.cat(slots).to(a.device) if slots else torch.empty(0, dtype=torch.long, device=a.device)
        assert tree.unique().numel() == tree.numel(), "a slot appears twice in the tree"
        pages = tree.view(-1, P)  # (pages, P): each must be one block's P slots, in order
        assert torch.equal(pages, pages[:, :1] + torch.arange(P, device=a.device)), "a page is not one whole block"
        # refcounted units: slots, or 02's blocks
        units = [x.to(a.device)[::P] // P for x in (tree, *held)]
        want = torch.bincount(torch.cat(units), minlength=a.size)
        assert torch.equal(want.int(), a.mem_state), "refcounts != tree + running requests"
        assert int((want > 0).sum()) + a.available() == a.size, "tree + request slots + free != pool size"
        a.check()

    def pretty_print(self, decode=None, width=8) -> str:
        """One line per node: its tokens (or decode(tokens)), length, lock count, last access."""
        lines = [f"root  evictable={self.evictable} protected={self.protected}"]

        def show(node, pre):
            kids = sorted(node.children.values(), key=lambda c: c.serial)
            for k, c in enumerate(kids):
                last = k == len(kids) - 1
                text = repr(decode(list(c.key[:width]))) if decode else " ".join(map(str, c.key[:width]))
                more = " ..." if len(c.key) > width else ""
                lines.append(f"{pre}{'`-- ' if last else '|-- '}[{text}{more}] len={len(c.key)} "
                             f"lock={c.lock_ref} t={c.last_access}")
                show(c, pre + ("    " if last else "|   "))
        show(self.root, "")
        return "\n".join(lines)


# ======== THE IDEA, 2: cache-aware scheduling with continuous batching ============================

class Req(L02.Request):
    """02's request (prompt, output, kv_len) plus what the radix scheduler tracks."""

    def __init__(self, rid, prompt, max_new_tokens, target=None, after=None, stop_ids=()):
        super().__init__(rid, prompt, max_new_tokens, stop_ids)
        self.target = target    # simulation: the output to replay, token by token
        # a Req whose KV it needs first (its first sample, or the turn it follows)
        self.after = after
        self.prefix = None      # slots of its longest cached prefix (match_prefix)
        self.node = None        # the tree node it locks (its prefix, then its prompt)
        self.reserve = 0        # reserve=True: slots still reserved for its remaining steps
        self.admitted = 0       # admissions so far (> 1 after a preemption)
        # KV tokens a recompute preemption dropped (what readmission computes again)
        self.dropped = 0
        self.chunk = None       # chunked prefill: the next step feeds at most this many tokens

    @property
    def n_new(self) -> int:  # tokens the next step feeds: all that its KV lacks, or a chunk of them
        return self.missing if self.chunk is None else min(self.missing, self.chunk)

    @property
    def samples(self) -> bool:  # the step feeds all its KV lacks, so a token is sampled after it
        return self.chunk is None or self.chunk >= self.missing

    @property
    def ready(self) -> bool:
        # `after` computed this prompt (a sibling sample), or finished (a follow-up turn)
        return self.after is None or self.after.done or self.after.kv_len >= len(self.prompt)


def _dfs_weight(tree, rng, waiting):
    """SGLang's dfs-weight: walk the tree visiting the child with most waiting requests below it first."""
    at = defaultdict(list)
    for r in waiting:
        at[r.node].append(r)
    weight, order = {}, []

    def calc(node):
        weight[node] = len(at[node]) + sum(calc(c) for c in node.children.values())
        return weight[node]

    def visit(node):
        for c in sorted(node.children.values(), key=lambda c: -weight[c]):
            if weight[c]:
                visit(c)
        order.extend(at[node])
    calc(tree.root)
    visit(tree.root)
    return order


# (tree, rng, waiting) -> waiting in admission order;
# cache-aware ones read r.prefix / r.node (matched)
POLICIES = {
    "fcfs": lambda tree, rng, w: list(w),
    # stable: ties stay first-come first-served
    "lpm": lambda tree, rng, w: sorted(w, key=lambda r: -len(r.prefix)),
    "random": lambda tree, rng, w: rng.sample(w, len(w)),
    "dfs-weight": _dfs_weight,
}
CACHE_AWARE = ("lpm", "dfs-weight")
# a prompt part-way in keeps this share of a step's budget; prompts fitting whole may take the rest
CHUNK_KEEPS = 0.5
# a request sharing >= this many uncached tokens with one admitted this step waits one step
IN_BATCH_MIN = 32


class Scheduler(L02.Scheduler):
    """Algorithm 1 over 03's TokenKVCache (or 02's blocks) + a RadixCache, on 02's continuous batching (its step loop:
    schedule, forward, postprocess; and preemption): this class admits and caches. The options, the paper's first:
      reserve=True  admission reserves every slot a request will take (prompt suffix +
                    max_new_tokens - 1), so nothing is ever preempted. False: admit while the
                    prompts fit the pool now (free_tokens()) and the step's prefill budget; when
                    decoding outgrows the pool, evict, then preempt (02; recompute is mostly a
                    cache hit, as the preempted request's computed tokens stay in the tree).
      reserve="expected"  (the engine's) look ahead, as LightLLM's router: also admit only while, at every step
                    from now, the pool holds what the running requests will hold then, each growing a token a step
                    until its expected end (a share of its tokens_left, learned: see fits_ahead).
      mixed=True    a step runs the admitted prefills with one decode token of every running request (SGLang),
                    then a decode step: mixed steps back to back give a stream one token a step, a decode step
                    gives it k (the engine's CUDA graphs, multi-step chunks), so under a burst of prompts the
                    streams fall behind and free their rows late, and the queue's first tokens wait for them.
                    A prompt part-way in runs its chunks back to back (each gives every stream a token): its
                    first token comes a step sooner per chunk. While requests wait for KV or rows (held), a
                    step that admits is prefill-only (`solo`), the streams' tokens left to decode steps.
                    False: prefill-first (vLLM's order, the engine's: decode steps stay pure, CUDA-graph-able), a
                    decode step between two prefill steps while requests decode (a burst of prompts or a long one's
                    chunks do not stall the streams step after step).
      chunk_tokens  chunked prefill (Sarathi-Serve; SGLang's chunked_prefill_size): no step feeds more than this
                    many tokens (mixed: decode tokens count too); a prompt that does not fit what is left of the
                    step's budget is cut there and continued next step (`chunked`, at most one request at a time,
                    goes first), its KV and its tree path growing chunk by chunk; prompts that fit whole in half a
                    step go in beside its next chunk, which keeps the other half (CHUNK_KEEPS): a short prompt does
                    not wait for a long one's chunks. None: a prompt runs whole (max_prefill_tokens bounds a step,
                    but the first request admitted is taken whatever its size).
      radix=False   no tree (01's contiguous rows, --no-radix); lpm and dfs-weight then fall back to fcfs.
      lookahead=k   the engine decodes k steps per host round trip (multi-step chunks), and a chunk takes
                    its k slots before its first step (03: no waste is not no room): admission keeps k
                    slots free for every running request (vLLM's lookahead slots; expected() adds them),
                    and run_ahead() sizes each chunk to what the pool holds.

    The step timeline (P: prefill tokens, d: one decode token per running request; a long prompt L arrives):
      prefill-first          d d d [PPPPPPPPPPPPPPPP L] d d d                every stream waits for all of L
      prefill-first, chunks  d d d [PPPP] d [PPPP] d [PPPP] d [PPPP] d d d  a chunk's wait; L's token 3 steps later
      mixed, chunks          d d d [PPPd] [PPPd] [PPPd] [PPPd] d d d         a token to every stream each step"""

    def __init__(self, kv, policy="lpm", max_running=32, max_prefill_tokens=16384, seed=0,
                 radix=True, reserve=True, mixed=True, preempt="recompute", chunk_tokens=None,
                 lookahead=0):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
        if reserve is True and not radix:
            raise ValueError("reserve=True counts the radix tree's evictable slots: it needs radix=True")
        super().__init__(kv, max_running, preempt)
        self.tree = RadixCache(kv.allocator, kv.page) if radix else None
        self.policy, self.reserve, self.max_prefill_tokens = policy, reserve, max_prefill_tokens
        self.lookahead = lookahead  # slots each running request keeps free to run ahead
        self.set_schedule(mixed, chunk_tokens)
        # the request whose prompt is part-way in (chunked prefill)
        self.chunked, self.prefilled = None, False
        # held: the last admission left requests waiting for KV or rows; solo (mixed): this step's
        # prompts run without the decode tokens (held)
        self.held = self.solo = False
        self.seed, self.rng, self.n_req = seed, random.Random(seed), 0
        self.stats.update(prompt_tokens=0, cached_tokens=0, steps=0, evicted_tokens=0,
                          recomputed_tokens=0, peak_running=0)
        # (sum of output / max_new_tokens, requests) for fits_ahead: a prior of one (every output
        # runs to its max_new_tokens)
        self.seen = np.ones(2)

    @property
    def busy(self) -> bool:
        return super().busy or self.chunked is not None

    def pending(self) -> list:
        # and a prompt part-way in
        return super().pending() + ([self.chunked] if self.chunked is not None else [])

    def reset(self):
        """Forget the last run, its cached prefixes too (a warm engine's runs start alike)."""
        super().reset()
        self.seen = np.ones(2)
        if self.tree:
            self.tree.evict(self.kv.capacity())
        self.rng.seed(self.seed)

    def set_schedule(self, mixed: bool, chunk_tokens=None):
        """The step's shape (see the class docstring); between runs, so one warm engine can serve under each."""
        if chunk_tokens is not None and chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1 (or None), not {chunk_tokens}")
        self.mixed, self.chunk_tokens = mixed, chunk_tokens

    def add(self, prompt, max_new_tokens, target=None, after=None, stop_ids=()):
        n, cap, max_len = len(prompt), self.kv.capacity(), self.kv.max_seq_len
        if not n or max_new_tokens < 1 or n + max_new_tokens - 1 > min(cap, max_len):
            raise ValueError(f"request of {n} + {max_new_tokens} tokens cannot fit this "
                             f"pool ({cap} slots, max_seq_len {max_len})")
        r = Req(self.n_req, prompt, max_new_tokens, target, after, stop_ids)
        self.n_req += 1
        self.waiting.append(r)
        return r

    def free_tokens(self):
        """KV tokens new requests may take now without preempting: 03's free slots plus what the
        tree may evict, or 02's free blocks above its watermark; None: max_running limits (01)."""
        room = self.kv.room()
        return None if room is None else room + (self.tree.evictable_size() if self.tree else 0)

    def admit(self):
        """Algorithm 1's admission: match the ready requests' cached prefixes, order by policy,
        take them while the step's budget and the pool allow (reserve: all slots they take; else
        their prompts, after a token per running one); lock prefixes, open rows."""
        self.swap_in()
        if self.prefilled and self.running and not (self.mixed and self.chunked and not self.held):
            # a decode step between two prefill (or mixed) steps: a stream waits one prefill step at
            # most, and decodes k tokens, not one, between two admissions
            self.prefilled = False
            return []
        # held: the queue drains as fast as the running ones finish, and a decode token costs more in an
        # eager mixed step than in a decode step's CUDA graph (H200 step log): admit in a prefill-only step
        self.solo = self.mixed and self.held
        free_rows, new, prefill, spare = self.max_running - len(self.running), [], 0, None
        self.held = bool(self.waiting) and (free_rows <= 0 or bool(self.swapped))
        if self.chunk_tokens is None:  # tokens this step may feed
            step = self.max_prefill_tokens
        else:
            step = self.chunk_tokens - (len(self.running) if self.mixed and not self.solo else 0)
        if self.chunked is not None:
            # a prompt part-way in goes first; it holds its KV and its lock already
            r = self.chunked
            r.chunk = max(1, step) if r.missing > step else None
            new, prefill, free_rows = [r], r.n_new, free_rows - 1
            if r.chunk is not None:  # what it leaves of its chunk for others
                spare = r.chunk - max(1, int(step * CHUNK_KEEPS + 0.999))
        if free_rows <= 0 or self.swapped or not self.waiting:
            return new
        if self.reserve is True:
            free = self.free_tokens() - sum(r.reserve for r in self.running + new)
            if free < min(r.max_new_tokens for r in self.waiting):
                # every request needs >= max_new_tokens (the engine's too)
                self.held = True
                return new  # nothing can be admitted: skip the matching
        else:
            # admitting what does not fit would only be held
            # back by prepare(), one failed allocation each
            # the running ones' next tokens first, and the rest of the chunked prompt
            free = self.free_tokens()
            free = None if free is None else free - len(self.running) - sum(r.missing for r in new)
        first = len(new)
        self.held = self.admit_ready(self.ordered(), new, free_rows, step, prefill, spare, free)
        if len(new) > first:
            taken = set(map(id, new))
            self.waiting = deque(r for r in self.waiting if id(r) not in taken)
        return new

    def cache_aware(self) -> bool:
        """Whether the policy orders by cached prefix (then every ready request is matched before ordering)."""
        return self.tree is not None and self.policy in CACHE_AWARE

    def ordered(self) -> list:
        """The ready requests in the policy's order, their cached prefixes matched first where it asks for them."""
        ready = [r for r in self.waiting if r.ready]
        aware = self.cache_aware()
        if aware:
            for r in ready:
                r.prefix, r.node = self.tree.match_prefix(r.tokens)
        if aware or self.policy not in CACHE_AWARE:
            ready = POLICIES[self.policy](self.tree, self.rng, ready)
        return ready

    def admit_ready(self, ready, new, free_rows, step, prefill, spare, free):
        """Append to new the ready requests in order while the step's tokens (step: it may feed,
        prefill: it feeds already, spare: the part-way prompt leaves), rows (free_rows) and pool
        (free: tokens after reserves) allow. -> held: the rest wait (rows or KV)."""
        # 03's slot, 02's block (01: free is None)
        tree, aware, block = self.tree, self.cache_aware(), self.kv.page
        batch, first = RadixCache(), len(new)  # batch: this step's prompts (in-batch prefix cache)
        ahead = None  # the running and admitted ones' expected lengths
        if self.reserve == "expected" and free is not None:
            ahead = np.concatenate([self.expected(self.running), self.expected(new, ahead=1)])
        for r in ready:
            if len(new) - first == free_rows:
                return True
            if tree is not None and not aware:
                r.prefix, r.node = tree.match_prefix(r.tokens)
            cached = len(r.prefix) if tree is not None else 0
            extend = len(r.prompt) + len(r.output) - cached
            over = prefill + extend - step  # > 0: it would overflow the step
            # it fits whole in the part-way prompt's spare tokens
            squeeze = spare is not None and 0 < over <= spare
            # chunk it (one at a time)
            cut = self.chunk_tokens is not None and over > 0 and not squeeze
            if (cut and (step - prefill < 1 or spare is not None)) or (new and over > 0 and not cut and not squeeze):
                break
            if aware and len(batch.match_prefix(r.tokens)[0]) >= cached + IN_BATCH_MIN:
                continue  # its prefix is being computed right now: next step it is a cache hit
            # a later match only splits below it
            delta = tree.inc_lock_ref(r.node) if tree is not None else 0
            if free is not None:
                # reserve: every slot it will ever take (prefill + all decode steps but one); else
                # its prompt's blocks whole pages
                need = -(-(extend + (r.max_new_tokens - 1 if self.reserve is True else 0)) // block) * block
                # with r
                grown = None if ahead is None else np.concatenate([ahead, self.expected([r], ahead=1)])
                if (need > free + delta or grown is not None and not self.fits_ahead(grown)) and (
                        self.reserve is True or new or self.running):  # alone, it only needs to fit
                    if tree is not None:
                        # the head of the queue does not fit: stop (no overtaking, no starvation)
                        tree.dec_lock_ref(r.node)
                    return True
                free, ahead = free + delta - need, grown
                if self.reserve is True:
                    r.reserve = need
            if tree is not None:
                self.kv.add_prefix(r.rid, r.prefix)
                r.kv_len, r.in_kv = cached, True
                if aware:
                    batch.insert(r.tokens)
            self.count_admission(r, cached)
            if squeeze:
                new[0].chunk, prefill, spare = new[0].chunk - over, prefill - over, spare - over
            r.chunk = step - prefill if cut else None
            new.append(r)
            self.log("admit", r, cached)
            prefill += r.n_new
            if cut:  # the step is full
                self.chunked = r
                break
        return False

    def count_admission(self, r, cached: int):
        """Hit rate: first admissions only; a re-admission counts what it computes again."""
        if not r.admitted:
            self.stats["prompt_tokens"] += len(r.prompt)
            self.stats["cached_tokens"] += cached
        # what a preemption cost: KV computed again
        self.stats["recomputed_tokens"] += max(0, r.dropped - cached)
        r.admitted, r.dropped = r.admitted + 1, 0

    def fits_ahead(self, rows) -> bool:
        """LightLLM's look-ahead over rows, expected() of the running, admitted and new requests:
        request j holds held_j + s KV tokens s steps from now (whole pages) until its expected end
        e_j, then frees them. Sorted by e descending, requests 0..i are alive up to step e_i - 1,
        where each holds the most: the peak is the largest of those sums, a running sum (held + P -
        1 = qP + r and e - 1 = aP + b: j's pages are q_j + a + [r_j >= P - b])."""
        P, (ends, held) = self.kv.page, rows.T
        order = np.argsort(-ends, kind="stable")
        (q, r), (a, b), i = np.divmod(held[order] + P - 1, P), np.divmod(ends[order] - 1, P), np.arange(len(ends))
        # ge[i, v]: requests 0..i with r >= v
        ge = np.eye(P + 1, dtype=int)[r].cumsum(0)[:, ::-1].cumsum(1)[:, ::-1]
        peak = P * (q.cumsum() + (i + 1) * a + ge[i, P - b]).max()
        return int(peak) <= self.kv.room() + self.kv.used()  # the pool, but 02's watermark

    def expected(self, reqs, ahead=0):
        """(e, held) per request: e is `ratio` of its tokens_left steps (the mean output /
        max_new_tokens of the finished requests, from 1: every output runs to max_new_tokens; a
        preemption counts as one that ran to max_new_tokens), held its KV tokens (+ ahead: a
        prefill step may leave the running ones be, so a new one is a step ahead; + lookahead: the
        slots of a chunk, up to its tokens_left, taken before its steps run)."""
        ratio, rows = self.seen[0] / self.seen[1], []
        for r in reqs:
            held = len(r.prompt) + len(r.output) + ahead + min(self.lookahead, r.tokens_left)
            rows.append((max(1, int(ratio * r.tokens_left + 0.999)), held))
        return np.array(rows, int).reshape(-1, 2)

    def run_ahead(self, batch, k, ahead=0) -> int:
        """Room for batch's multi-step chunk (greedy decode, k steps per host sync): the most
        steps, up to k, the pool holds now, each taking min(steps, tokens_left) slots (past its
        end: scratch); cached prefixes evicted for all k first. 0: not one fits (a one-step decode
        preempts, 02). ahead: tokens in flight (a list per request, or one number)."""
        ahead = ahead if isinstance(ahead, list) else [ahead] * len(batch)
        tokens_left = [r.tokens_left - a for r, a in zip(batch, ahead)]
        need = lambda steps: self.slots_needed(batch, [min(steps, n) for n in tokens_left])
        free = self.free_slots()
        if free is None or need(k) <= free:
            return k
        if self.evict(need(k) - free):
            free = self.free_slots()
        return max(steps for steps in range(k + 1) if need(steps) <= free)

    def evict(self, n_tokens) -> int:
        """Evict least-recently-used cached prefixes for n_tokens; returns how many went."""
        evicted = self.tree.evict(n_tokens) if self.tree and n_tokens > 0 else 0
        self.stats["evicted_tokens"] += evicted
        if evicted:
            self.log("evict", None, evicted)
        return evicted

    def make_room(self, n_tokens):
        """02's prepare() ran short of n_tokens: evict LRU cached prefixes; then, in a decode step
        (prefill-first runs them between a prompt's chunks), requeue the prompt part-way in."""
        evicted = self.evict(n_tokens - self.kv.room())
        if not evicted and self.chunked is not None and not self.prefilled:
            evicted = max(1, self.chunked.kv_len)  # (its computed tokens go into the tree)
            self.hold_back(self.chunked)
        return evicted

    def preempt(self, r):
        """02's preemption; swap: r's KV goes to CPU memory (private blocks when it comes back), so its path unlocks."""
        if self.preempt_mode == "swap" and self.tree is not None:
            self.tree.dec_lock_ref(r.node)
            r.node = self.tree.root
        r.dropped = r.kv_len if self.preempt_mode == "recompute" else 0
        self.seen += 1
        super().preempt(r)

    def computed(self, r, n):
        """r's KV now holds n more tokens; a step that computed some of its prompt shares what is
        in so far (cache_prompt). The engine calls this too, per token of a multi-step chunk."""
        r.kv_len, r.reserve = r.kv_len + n, r.reserve - n
        if r is self.chunked and not r.missing:
            # its last chunk: it runs with the others from now on
            self.chunked, r.chunk = None, None
        if self.tree is not None and len(r.prompt) > r.kv_len - n:
            self.cache_prompt(r)

    def cache_prompt(self, r):
        """Right after a prefill step, put r's prompt (as much of it as its KV holds: chunked
        prefill) into the tree and move r's lock down to it, so requests arriving while r decodes
        (its n > 1 siblings first) hit it. Where the tree already held some of it (a cached prompt's
        last token is computed again, for its logits), r switches to the tree's slots and its
        duplicates go back to the pool: the lock costs no slot that admit() counted evictable."""
        prompt, shared, x = r.prompt[:r.kv_len], 0, r.node
        while x is not self.tree.root:
            # r's first `shared` tokens are in the tree's slots already (its lock)
            shared, x = shared + len(x.key), x.parent
        # r computed copies of tokens [shared, n)
        n = self.tree.insert(prompt, self.kv.slots(r.rid))
        slots, node = self.tree.match_prefix(prompt, compute_last=False)
        if n > shared:
            self.kv.share_prefix(r.rid, slots[shared:n], shared)
        self.tree.inc_lock_ref(node)
        self.tree.dec_lock_ref(r.node)
        r.node = node

    def release(self, r):
        """Drop r's KV; its computed tokens go into the tree first (for later requests, or r after a preemption)."""
        # finished (or aborted): its share of max_new_tokens
        self.seen += (len(r.output) / r.max_new_tokens, 1) if r.done else 0
        if r.in_kv and self.tree is not None:
            if r.kv_len:
                self.tree.insert(r.tokens[:r.kv_len], self.kv.slots(r.rid))
            self.tree.dec_lock_ref(r.node)
        # the request's references go; its duplicates of tree slots return to the pool
        super().release(r)
        r.node = None
        if r is self.chunked:
            # held back or preempted part-way: it starts over (from the tree, where there is one)
            self.chunked, r.chunk = None, None

    def batch(self, new):
        """This step's batch: the admitted (+ the running, mixed); if none, the running ones."""
        self.prefilled = bool(new)
        return self.running + new if self.mixed and new and not self.solo else new or self.running

    def step(self, forward=None):
        """02's step; forward None: a simulation, where each request's next token is read from its target."""
        super().step(forward or (lambda batch, tokens, positions: [r.target[len(r.output)] for r in batch]))

    def run(self, forward=None, check=False):
        while self.busy:
            self.step(forward)
            self.stats["peak_running"] = max(self.stats["peak_running"], len(self.running))
            if check:
                self.check()

    def check(self):
        self.tree.check(held=[self.kv.slots(r.rid) for r in self.running + ([self.chunked] if self.chunked else [])])

    def hit_rate(self):
        return self.stats["cached_tokens"] / max(1, self.stats["prompt_tokens"])


# ======== THE IDEA, 3: the real model through the same scheduler ==================================

def generate_cached(model, prompts, max_new_tokens=32, sched=None, pool_size=4096, policy="lpm",
                    max_running=8, stop_ids=()):
    """Greedy decoding through a Scheduler (pass sched to keep it warm) -> (outputs, sched)."""
    if sched is None:
        sched = Scheduler(L03.TokenKVCache.for_model(model, pool_size, max_running), policy, max_running)

    reqs = [sched.add(p, max_new_tokens, stop_ids=stop_ids) for p in prompts]
    # prefill chunks of the new + a token per running, one forward
    sched.run(L02.greedy_forward(model, sched.kv))
    return [r.output for r in reqs], sched


# ======== DEMO: workloads (token ids only), the optimum, the simulations, the report ==============
# -------- workloads and the optimum ---------------------------------------------------------------

def _toks(rng, n):
    return rng.integers(10, 32000, n).tolist()


def shared_prefix_workload(rng, groups=64, per_group=16, prefix=2048, question=128, output=256):
    """SGLang's generated-shared-prefix: groups of prompts sharing a long system prefix, arriving shuffled."""
    heads = [_toks(rng, prefix) for _ in range(groups)]
    reqs = [(h + _toks(rng, question), _toks(rng, output), None) for h in heads for _ in range(per_group)]
    return [reqs[i] for i in rng.permutation(len(reqs))]


def few_shot_workload(rng, tasks=8, per_task=16, header=256, shots=512, question=32, output=32):
    """One instruction header for everyone, per-task few-shot examples, then a question."""
    top = _toks(rng, header)
    reqs = [(top + ex + _toks(rng, question), _toks(rng, output), None)
            for ex in (_toks(rng, shots) for _ in range(tasks)) for _ in range(per_task)]
    return [reqs[i] for i in rng.permutation(len(reqs))]


def chat_workload(rng, chats=32, turns=4, system=64, user=32, output=32):
    """Multi-turn chat: turn k+1's prompt = turn k's prompt + its answer + a new message (arrives after turn k)."""
    sysp, reqs = _toks(rng, system), []
    for _ in range(chats):
        prompt, prev = sysp + _toks(rng, user), None
        for _ in range(turns):
            out = _toks(rng, output)
            reqs.append((prompt, out, prev))
            prompt, prev = prompt + out + _toks(rng, user), len(reqs) - 1
    return reqs


def tot_workload(rng, problems=8, branch=3, depth=3, question=256, thought=32, hint=8):
    """Tree of thought: each node's answer is a thought; every child extends its parent's prompt + thought."""
    reqs = []

    def grow(prompt, parent, level):
        out = _toks(rng, thought)
        reqs.append((prompt, out, parent))
        me = len(reqs) - 1
        if level + 1 < depth:
            for _ in range(branch):
                grow(prompt + out + _toks(rng, hint), me, level + 1)
    for _ in range(problems):
        grow(_toks(rng, question), None, 0)
    return reqs


WORKLOADS = {  # name: (builder, scaled-down default kwargs, full-size kwargs)
    "generated-shared-prefix": (shared_prefix_workload, dict(groups=16, prefix=512, question=32, output=16), {}),
    "few-shot": (few_shot_workload, {}, dict(tasks=16, per_task=32, shots=2048, question=128, output=128)),
    "multi-turn-chat": (chat_workload, {}, dict(chats=128, turns=6, system=256, user=128, output=256)),
    "tree-of-thought": (tot_workload, {}, dict(problems=16, branch=4, depth=4, question=1024, thought=128)),
}


def optimal_prefill(reqs):
    """C_min = edges of the prompts' radix tree, minus tokens some request's decode produced (its
    output but the last token: fed back, cached), if requests decode different tokens (they do)."""
    tree = RadixCache()
    for prompt, _, _ in reqs:
        tree.insert(prompt)
    decoded = sum(max(0, len(tree.match_prefix(p + o[:-1], compute_last=False)[0]) - len(p))
                  for p, o, _ in reqs)  # matching splits edges, sizes stay
    return tree.evictable_size() - decoded


# -------- simulations: token ids through the same Scheduler ---------------------------------------

def simulate(reqs, pool_size, policy, max_running=32, max_prefill_tokens=16384, seed=0, check=False,
             page=1, max_new_tokens=None, **options):
    """Run a token-only workload through a TokenKVCache (page > 1: 02's PagedKVCache, its tree keyed
    by pages) without KV tensors (1 layer, 1 head, head_dim 1). max_new_tokens: each request's
    (default: its output's length; a shorter output ends in EOS, -1); options: Scheduler's."""
    max_new_tokens = max_new_tokens or [len(o) for _, o, _ in reqs]
    longest = max(len(p) + n - 1 for (p, _, _), n in zip(reqs, max_new_tokens))
    kv = L03.TokenKVCache(1, pool_size, 1, 1, max_running, longest) if page == 1 else L02.PagedKVCache(
        1, -(-pool_size // page), page, 1, 1, watermark=0, max_seqs=max_running,
        max_seq_len=longest)
    s = Scheduler(kv, policy, max_running, max_prefill_tokens, seed, **options)
    made = []
    for (prompt, out, after), n in zip(reqs, max_new_tokens):
        made.append(s.add(prompt, n, target=out, after=None if after is None else made[after], stop_ids=(-1,)))
    threads = torch.get_num_threads()
    # tiny tensor ops: a thread pool only adds overhead (and stalls on a busy machine)
    torch.set_num_threads(1)
    try:
        s.run(check=check)
    finally:
        torch.set_num_threads(threads)
    return dict(s.stats, hit_rate=s.hit_rate(),
                prefill_tokens=s.stats["prompt_tokens"] - s.stats["cached_tokens"],
                output_tokens=sum(len(r.output) for r in made),
                computed_tokens=sum(e.tokens for e in s.events if e.kind in ("prefill", "decode")))


# (mixed, chunked): the options compared here and in --bench-serve
SCHEDULES = {"prefill-first": (False, False), "prefill-first, chunked": (False, True),
             "mixed, chunked": (True, True)}


def chunking_timeline(chunk_tokens=256, long_prompt=2048, n_short=8, seed=0, behind=0):
    """A long prompt arrives while n_short requests decode. Per schedule: the tokens each step
    computes, and the decoding requests' waits between tokens, in tokens computed meanwhile (a
    step's time grows with its tokens). Engine options (reserve=False). behind: a prompt of that
    many tokens comes halfway through the long one's first step; its first token's wait too."""
    rng = np.random.default_rng(seed)
    shorts = [(_toks(rng, int(rng.integers(16, 64))), _toks(rng, 48)) for _ in range(n_short)]
    long_req, arrive = (_toks(rng, long_prompt), _toks(rng, 8)), 4  # it arrives before step 4
    out = {}
    for name, (mixed, chunked) in SCHEDULES.items():
        kv = L03.TokenKVCache(1, 4 * long_prompt, 1, 1, n_short + 2, long_prompt + 64)
        s = Scheduler(kv, "fcfs", n_short + 1 + (behind > 0), reserve=False, mixed=mixed,
                      chunk_tokens=chunk_tokens if chunked else None)
        reqs = [s.add(p, len(o), target=o) for p, o in shorts]
        work, last, waits, steps, first_token, late, behind_first = 0, {}, [], [], None, None, None
        while s.waiting or s.running or s.chunked or len(reqs) == n_short:
            if behind and s.stats["steps"] == arrive + 1 and late is None:
                late, t_late = s.add(_toks(rng, behind), 8, target=_toks(rng, 8)), work - steps[-1] / 2
            if s.stats["steps"] == arrive:
                reqs.append(s.add(long_req[0], len(long_req[1]), target=long_req[1]))
                t_arrive = work
            had, logged = [len(r.output) for r in reqs], len(s.events)
            s.step()
            steps.append(sum(e.tokens for e in s.events[logged:] if e.kind in ("prefill", "decode")))
            work += steps[-1]
            for r, n in zip(reqs, had):
                if len(r.output) > n:
                    if r.rid in last:
                        waits.append(work - last[r.rid])
                    last[r.rid] = work
            if first_token is None and len(reqs) > n_short and reqs[-1].output:
                first_token = work - t_arrive
            if late is not None and late.output and behind_first is None:
                behind_first = work - t_late
        out[name] = dict(steps=len(steps), step_tokens=steps[arrive:arrive + 12],
                         max_step_tokens=max(steps), max_wait_tokens=max(waits),
                         median_wait_tokens=float(np.median(waits)),
                         long_prompt_first_token_after=first_token, behind=behind_first)
    return dict(chunk_tokens=chunk_tokens, long_prompt=long_prompt, decoding=n_short, schedules=out)


# Scheduler(reserve=...)
ADMISSIONS = {"fits now": False, "reserve all": True, "look ahead": "expected"}
# the simulations' cost model: a step takes as long as this many tokens' compute, plus its tokens
STEP_COST = 1024


def admission_trace(n=64, lengths=(25, 256), per_seq=128, pages=(1, 16), seed=0):
    """bench_engine's equal-memory workload, scaled: n requests, prompt lengths and max_new_tokens
    uniform in `lengths`, per_seq pool tokens a request (under half what they take), prefill-first.
    Outputs run to max_new_tokens, or stop (EOS) uniformly in [1, max_new_tokens]. Per admission,
    page: simulate()'s figures and output tokens per STEP_COST of simulated time."""
    rng, out = np.random.default_rng(seed), {}
    lens = rng.integers(lengths[0], lengths[1] + 1, (n, 2)).tolist()
    reqs = [(_toks(rng, p), None, None) for p, _ in lens]
    stops = [int(rng.integers(1, m + 1)) for _, m in lens]
    for early in ("full length", "early stops"):
        # -1: EOS
        reqs = [(p, _toks(rng, k - 1) + [-1] if early == "early stops" and k < m else _toks(rng, m), None)
                for (p, _, _), (_, m), k in zip(reqs, lens, stops)]
        for page, (name, reserve) in ((page, a) for page in pages for a in ADMISSIONS.items()):
            r = out.setdefault(early, {}).setdefault(page, {})[name] = simulate(
                reqs, n * per_seq, "lpm", n, page=page, max_new_tokens=[m for _, m in lens],
                reserve=reserve, mixed=False)
            r["throughput"] = r["output_tokens"] * STEP_COST / (STEP_COST * r["steps"] + r["computed_tokens"])
    return dict(requests=n, lengths=lengths, per_seq=per_seq, workloads=out)


# -------- the command line and the report ---------------------------------------------------------

def cli_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--workload", choices=list(WORKLOADS), help="one workload (default: all)")
    ap.add_argument("--policy", choices=list(POLICIES), help="one policy (default: all)")
    ap.add_argument("--full", action="store_true", help="the full-size workloads (minutes, not seconds)")
    ap.add_argument("--max-running", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.max_running < 1:
        ap.error("--max-running must be >= 1")
    return args


def main(argv=None):
    args = cli_args(argv)
    L02.L01.cpu_threads()  # one thread on 2 cores (why: in its docstring)
    policies = [args.policy] if args.policy else list(POLICIES)
    t0 = time.perf_counter()
    report = measure_hit_rates(args, policies)
    prefix = measure_pages(report, args)
    chunking = chunking_timeline()
    chunking["behind"] = {k: r["behind"] for k, r in chunking_timeline(behind=32)["schedules"].items()}
    # --full: bench's sizes
    admission = admission_trace(*((256, (100, 1024), 512, (1, 16, 256)) if args.full else ()))
    all_runs = [runs for w in report.values() for runs in w["cache_sizes"].values()]
    lpm_ratios = [runs["lpm"]["of_optimal"] for runs in all_runs if "lpm" in runs]
    # top level: the first workload's (generated-shared-prefix by default)
    first = next(iter(report.values()))
    lpm_mean = float(np.mean(lpm_ratios)) if lpm_ratios else None
    summary = dict(hit_rate=first["hit_rate"], optimal_hit_rate=first["optimal_hit_rate"],
                   workloads=report, lpm_of_optimal_mean=lpm_mean, chunking=chunking,
                   admission=admission, seconds=time.perf_counter() - t0)
    if args.json:
        print(json.dumps(summary))
        return summary
    print_hit_rates(report, args.full, prefix)
    print_chunking(chunking)
    print_admission(admission)
    if lpm_ratios:
        print(f"\nlpm reaches {summary['lpm_of_optimal_mean']:.1%} of the optimal hit rate on average over these "
              f"workloads and pool sizes (SGLang reports ~96% for its cache-aware scheduling).")
    print(f"({summary['seconds']:.1f} s)")
    return summary


def measure_hit_rates(args, policies) -> dict:
    """Each workload at three pool sizes under each policy: hit rates, and the optimal one (every prompt cached)."""
    report = {}
    for name in [args.workload] if args.workload else list(WORKLOADS):
        build, small, full = WORKLOADS[name]
        reqs = build(np.random.default_rng(args.seed), **(full if args.full else small))
        prompt_tokens = sum(len(p) for p, _, _ in reqs)
        c_min = optimal_prefill(reqs)
        everything = RadixCache()  # the pool that caches every token of the workload
        for p, o, _ in reqs:
            everything.insert(p + o[:-1])
        longest = max(len(p) + len(o) - 1 for p, o, _ in reqs)
        # all of it, and room for a full batch
        total = everything.evictable_size() + args.max_running * longest
        sizes = sorted({max(2 * longest, int(f * total)) for f in (0.1, 0.3, 1.0)})
        w = report[name] = dict(requests=len(reqs), prompt_tokens=prompt_tokens,
                                optimal_prefill_tokens=c_min,
                                optimal_hit_rate=1 - c_min / prompt_tokens, cache_sizes={})
        for size in sizes:
            runs = {p: simulate(reqs, size, p, args.max_running, seed=args.seed) for p in policies}
            for r in runs.values():
                r["of_optimal"] = r["hit_rate"] / w["optimal_hit_rate"]
            w["cache_sizes"][size] = runs
        rates = {p: [runs[p]["hit_rate"] for runs in w["cache_sizes"].values()] for p in policies}
        w["hit_rate"] = {p: float(np.mean(rates[p])) for p in policies}  # mean over the pool sizes
    return report


def measure_pages(report, args):
    """lpm's hit rate at pages of 1, 16, 256 tokens (a prefix is shared up to its last full page)
    on the shared-prefix workload (into report); returns its prefix length (None without it)."""
    if "generated-shared-prefix" not in report:
        return None
    w, build, small, full = report["generated-shared-prefix"], *WORKLOADS["generated-shared-prefix"]
    kw = full if args.full else small
    prefix = kw.get("prefix", 2048) - 37  # a prefix no page divides, as a real document's length
    reqs = build(np.random.default_rng(args.seed), **{**kw, "prefix": prefix})
    w["pages"] = {P: simulate(reqs, max(w["cache_sizes"]), "lpm", args.max_running, page=P)["hit_rate"]
                  for P in (1, 16, 256)}
    w["pages_optimal"] = 1 - optimal_prefill(reqs) / sum(len(p) for p, _, _ in reqs)
    return prefix


def print_hit_rates(report, full: bool, prefix):
    print("RadixAttention simulation (token ids only; allocator + radix tree, no model)" +
          (" -- full size" if full else " -- scaled-down workloads, --full for SGLang's sizes"))
    for name, w in report.items():
        print(f"\n{name}: {w['requests']} requests, {w['prompt_tokens']} prompt tokens, "
              f"optimal prefill {w['optimal_prefill_tokens']} tokens = hit rate {w['optimal_hit_rate']:.1%}")
        print(f"  {'pool slots':>10}  {'policy':<11}{'hit rate':>9}{'of optimal':>11}{'prefill tok':>12}"
              f"{'evicted':>9}{'steps':>7}")
        for size, runs in w["cache_sizes"].items():
            for p, r in runs.items():
                print(f"  {size:>10}  {p:<11}{r['hit_rate']:>9.1%}{r['of_optimal']:>11.1%}"
                      f"{r['prefill_tokens']:>12}{r['evicted_tokens']:>9}{r['steps']:>7}")
        if "pages" in w:
            pages = ", ".join(f"{h:.1%} at page {P}" for P, h in w["pages"].items())
            print(f"  pages, lpm, prefix {prefix}: hit rate " + pages + f" (optimal {w['pages_optimal']:.1%})")


def print_chunking(c):
    print(f"\nChunked prefill: a {c['long_prompt']}-token prompt arrives while {c['decoding']} requests decode "
          f"(--chunk-tokens {c['chunk_tokens']} where chunked; a wait is counted in tokens computed meanwhile)")
    print(f"  {'schedule':<24}{'tokens per step from its arrival':<36}{'longest wait':>13}{'its first token':>16}"
          f"{'one behind it':>14}")
    for name, r in c["schedules"].items():
        print(f"  {name:<24}{' '.join(map(str, r['step_tokens'][:9])):<36}{r['max_wait_tokens']:>13}"
              f"{r['long_prompt_first_token_after']:>16}{c['behind'][name]:>14.0f}")
    print("  Prefill-first stalls every stream for the whole prompt; in chunks, for a chunk (a decode step runs "
          "between two prefill steps); mixed steps give each stream a token every chunk, no step between.")
    print("  One behind it: a 32-token prompt arriving halfway through its first step; chunked, it goes in beside it.")


def print_admission(a):
    print(f"\nAdmission: {a['requests']} requests, prompt lengths and max_new_tokens uniform in "
          f"{list(a['lengths'])}, a pool "
          f"of {a['per_seq']} tokens a request; throughput: output tokens per {STEP_COST} tokens' time (a step's cost)"
          f"\n  {'outputs':<12}{'page':>5}  {'admission':<12}{'preemptions':>12}{'peak running':>13}{'recomputed':>11}"
          f"{'steps':>7}{'throughput':>11}")
    rows = (f"  {w:<12}{page:>5}  {name:<12}{r['preemptions']:>12}{r['peak_running']:>13}"
            f"{r['recomputed_tokens']:>11}{r['steps']:>7}{r['throughput']:>11.2f}"
            for w, by in a["workloads"].items() for page, runs in by.items()
            for name, r in runs.items())
    print("\n".join(rows))
    print("  Fits now fills the pool and preempts; reserve all runs half as many; look ahead runs most, unpreempted.")


if __name__ == "__main__":
    main()
