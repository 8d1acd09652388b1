"""Held-out subtle bugs (mutants) an attendee writes: each must make its stage fail, in pytest and in the
workshop's grade, blamed on its own exercise.

    python tests/mutants.py [stage ...] [--list] [--only I ...] [--tests-from REV] [-k EXPR] [--timeout S]

stage: 01 .. 06, or engine; --tests-from main runs main's stage tests (what they caught before). A mutant is a
snippet (old) of the function it lies in (where: an exercise's name) and its bug (new): an off-by-one, a boundary
one step off, a case forgotten, an order reversed. apply matches old's tokens whatever the whitespace between
them, once inside where (else STALE). tests/code_mutants.py holds the bugs of code no attendee writes; this runner
runs both, one at a time in a copy of the repository (the stage's tests, `-x -q`), and prints caught / SURVIVED
(exit status 1 if any survived or went stale). `workshop.py verify` (CI) grades each of MUTANTS in its exercise.
References: mutation testing (DeMillo, Lipton, Sayward 1978); mutmut and cosmic-ray, here hand-picked.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import namedtuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = {"01": ["tests/test_01_kv_cache.py"], "02": ["tests/test_02_paged_cache_manager.py"],
         "03": ["tests/test_03_token_allocator.py"], "04": ["tests/test_04_triton_token_attn.py"],
         "05": ["tests/test_05_radix_scheduler.py"], "06": ["tests/test_06_jump_forward_fsm.py"],
         "engine": ["tests/test_engine.py"]}
FILES = {"01": "01_kv_cache.py", "02": "02_paged_cache_manager.py", "03": "03_token_allocator.py",
         "04": "04_triton_token_attn.py", "05": "05_radix_scheduler.py", "06": "06_jump_forward_fsm.py",
         "engine": "llama3_generate.py"}
SKIP = {"06": "not schemas_sound_and_complete and not not_and_one_of"}  # JSON-schema breadth (4 min): no mutant
# below touches the schema compiler; leaving tests out can only let a mutant survive, never catch one wrongly
Mutant = namedtuple("Mutant", "stage where what old new")  # stage: its file and tests; where: the function
GAP = r"(?:\s|\\\n)"  # what may lie between two of a snippet's tokens: spaces, line breaks, continuations

MUTANTS = [
    # ---- 01: the contiguous cache's prepare / attend / free, and the reference attention ----
    Mutant("01", "ContiguousKVCache.prepare", "a token's slot forgets its row's offset (row * max_seq_len)",
           "(tok_rows * self.max_seq_len + positions)", "(tok_rows + positions)"),
    Mutant("01", "ContiguousKVCache.prepare", "the lengths the decode reads are one short",
           "[rows, [p + n for p, n in zip(starts, n_new)]]", "[rows, [p + n - 1 for p, n in zip(starts, n_new)]]"),
    Mutant("01", "ContiguousKVCache.prepare", "new tokens' positions start one past the stored ones",
           "torch.cat([torch.arange(p, p + n) for p, n in zip(starts, n_new)])",
           "torch.cat([torch.arange(p + 1, p + n + 1) for p, n in zip(starts, n_new)])"),
    Mutant("01", "ContiguousKVCache.prepare", "a request exactly max_seq_len long is refused (boundary one step off)",
           "if have + n > self.max_seq_len:", "if have + n >= self.max_seq_len:"),
    Mutant("01", "ContiguousKVCache.prepare", "a new request's row is not taken off the free list (two requests "
           "share a row)", "self.rows[s] = self.free_rows.pop(0)", "self.rows[s] = self.free_rows[0]"),
    Mutant("01", "KVCache.attend", "prefill of several requests: every request reads the first one's queries",
           "            outs.append(attend_dense(q[t:t + n], kp[idx], vp[idx]))\n            t += n\n",
           "            outs.append(attend_dense(q[t:t + n], kp[idx], vp[idx]))\n"),
    Mutant("01", "KVCache.attend", "prefill reads one key short of the request's new length",
           "idx = table_slots(self.table, [r], p + n, self.page)[0]",
           "idx = table_slots(self.table, [r], p + n - 1, self.page)[0]"),
    Mutant("01", "ContiguousKVCache.prepare", "prepare overwrites a request's length instead of growing it",
           "            self.lens[r] += n\n        return positions",
           "            self.lens[r] = n\n        return positions"),
    Mutant("01", "ContiguousKVCache.prepare", "prepare gives new requests their rows before checking the lengths (a "
           "refused batch keeps them)", "        for s, n in zip(seq_ids, n_new):\n            have =",
           "        for s in new:\n            self.rows[s] = self.free_rows.pop(0)\n        new = []\n"
           "        for s, n in zip(seq_ids, n_new):\n            have ="),
    Mutant("01", "KVCache.attend", "attend stores k in the V pool too",
           "self.store_kv(kp, vp, self.tok_slots, k, v)", "self.store_kv(kp, vp, self.tok_slots, k, k)"),
    Mutant("01", "KVCache.attend", "prefill attends over the new tokens only, not the request's earlier ones (chunks "
           "forget the past)", "idx = table_slots(self.table, [r], p + n, self.page)[0]  # (p + n,)",
           "idx = table_slots(self.table, [r], p + n, self.page)[0][p:]"),
    Mutant("01", "KVCache.attend", "a batch is decode when ANY request feeds one token (a mixed batch takes the "
           "decode path)", "d = next((i for i, n in enumerate(n_new) if n != 1), len(n_new))",
           "d = len(n_new) if 1 in n_new else 0"),
    # ---- 02: BlockManager (append, copy-on-write, fork, free) and the Scheduler's preemption ----
    Mutant("02", "BlockManager.fork", "fork forgets the children's references (refcounts stay 1)",
           "        for b in self.block_tables[child]:\n            self.ref_count[b] += 1\n", ""),
    Mutant("02", "BlockManager.fork", "fork aliases the parent's table instead of copying it",
           "self.block_tables[child] = list(self.block_tables[parent])",
           "self.block_tables[child] = self.block_tables[parent]"),
    Mutant("02", "BlockManager.append", "append refuses when it needs exactly the blocks that are free (>= for >)",
           "        if need > self.num_free:  # checked", "        if need >= self.num_free:  # checked"),
    Mutant("02", "BlockManager.append", "append sets the token count to n instead of adding n",
           "self.num_tokens[seq] = self.num_tokens.get(seq, 0) + n", "self.num_tokens[seq] = n"),
    Mutant("02", "BlockManager.append", "copy-on-write keeps its reference on the shared block it replaced",
           "            src = table[-1]\n            self._release(src)\n", "            src = table[-1]\n"),
    Mutant("02", "BlockManager.append", "copy-on-write copies but does not say so (the copy is not returned)",
           "            copies.append((src, dst))\n        table += [self._take() for _ in range(need - len(copies))]",
           "        table += [self._take() for _ in range(need - 1 if src is not None else need)]"),
    Mutant("02", "BlockManager.fork", "fork lets a child that exists be overwritten", "        if child in "
           "self.block_tables:\n            raise ValueError", "        if False:\n            raise ValueError"),
    Mutant("02", "BlockManager.fork", "fork gives the child no tokens",
           "self.num_tokens[child] = self.num_tokens[parent]", "self.num_tokens[child] = 0"),
    Mutant("02", "BlockManager.free", "free forgets the sequence's blocks (they never come back)",
           "        for b in reversed(self.block_tables.pop(seq)):\n            self._release(b)\n",
           "        self.block_tables.pop(seq)\n"),
    Mutant("02", "BlockManager.free", "free keeps the sequence's token count",
           "            self._release(b)\n        del self.num_tokens[seq]", "            self._release(b)\n"),
    Mutant("02", "Scheduler.preempt", "preempt logs its event after the release (it says 0 tokens dropped)",
           "        self.log(\"swap_out\" if self.preempt_mode == \"swap\" else \"preempt\", req, req.kv_len)\n"
           "        if self.preempt_mode == \"swap\":",
           "        if self.preempt_mode != \"swap\":\n            self.release(req)\n"
           "        self.log(\"swap_out\" if self.preempt_mode == \"swap\" else \"preempt\", req, req.kv_len)\n"
           "        if self.preempt_mode == \"swap\":"),
    Mutant("02", "Scheduler.preempt", "a swap-out never sets in_kv = False",
           "            self.swapped.append((req, self.kv.swap_out(req.rid)))\n            req.in_kv = False\n",
           "            self.swapped.append((req, self.kv.swap_out(req.rid)))\n"),
    Mutant("02", "Scheduler.preempt", "preempt is not counted",
           "        self.stats[\"preemptions\"] += 1\n        self.log(\"swap_out\"", "        self.log(\"swap_out\""),
    Mutant("02", "Scheduler.preempt", "a swap-out is logged as a preempt", "self.log(\"swap_out\" if self.preempt_mode "
           "== \"swap\" else \"preempt\", req, req.kv_len)", "self.log(\"preempt\", req, req.kv_len)"),
    Mutant("02", "Scheduler.preempt", "a preempted request is requeued at the tail (it loses its place)",
           "            self.release(req)\n            self.waiting.appendleft(req)",
           "            self.release(req)\n            self.waiting.append(req)"),
    # ---- 03: TokenAllocator alloc (cumsum / searchsorted), alloc_contiguous, free; TokenKVCache ----
    Mutant("03", "TokenAllocator.alloc", "alloc looks for the 0th..n-1th free slot (off by one)",
           "want = torch.arange(1, n + 1, device=self.device)", "want = torch.arange(0, n, device=self.device)"),
    Mutant("03", "TokenAllocator.alloc", "searchsorted from the right (the slot after each free one)",
           "self._take(torch.searchsorted(cum, want))", "self._take(torch.searchsorted(cum, want, right=True))"),
    Mutant("03", "TokenAllocator.alloc", "alloc refuses to take the very last free slots",
           "        if n > self.n_free:\n            return None\n        cum",
           "        if n >= self.n_free:\n            return None\n        cum"),
    Mutant("03", "TokenAllocator.alloc_contiguous", "alloc_contiguous without the leading zero: every run starts one "
           "slot late", "c = F.pad((self.mem_state == 0).cumsum(0), (1, 0))", "c = (self.mem_state == 0).cumsum(0)"),
    Mutant("03", "TokenAllocator.alloc_contiguous",
           "alloc_contiguous returns a run that is not free when no run exists",
           "        if not bool(runs[start]):\n            return self.alloc(n)\n", ""),
    Mutant("03", "TokenAllocator.alloc_contiguous", "alloc_contiguous takes the run one slot further",
           "torch.arange(start, start + n, device=self.device))",
           "torch.arange(start + 1, start + n + 1, device=self.device))"),
    Mutant("03", "TokenAllocator.alloc_contiguous", "alloc_contiguous: a run of n - 1 free slots is good enough",
           "runs = (c[n:] - c[:-n]) == n", "runs = (c[n:] - c[:-n]) >= n - 1"),
    Mutant("03", "TokenAllocator.alloc", "alloc returns one slot fewer than asked",
           "want = torch.arange(1, n + 1, device=self.device)", "want = torch.arange(1, n, device=self.device)"),
    Mutant("03", "TokenAllocator.alloc", "alloc finds the slots but does not take them (refcounts stay 0)",
           "return self._take(torch.searchsorted(cum, want))", "return torch.searchsorted(cum, want)"),
    Mutant("03", "TokenAllocator.alloc", "alloc takes the highest free slots first",
           "return self._take(torch.searchsorted(cum, want))",
           "return self._take(torch.searchsorted(cum, cum[-1] + 1 - want))"),
    Mutant("03", "TokenAllocator.alloc_contiguous", "alloc_contiguous takes the last run, not the first",
           "start = int(runs.int().argmax())", "start = len(runs) - 1 - int(runs.int().flip(0).argmax())"),
    Mutant("03", "TokenAllocator.alloc_contiguous", "alloc_contiguous takes the run but forgets n_free",
           "return self._take(torch.arange(start, start + n, device=self.device))",
           "self.mem_state[start:start + n] = 1\n        return torch.arange(start, start + n, device=self.device)"),
    Mutant("03", "TokenAllocator.free", "free accepts an index one past the pool (boundary one step off)",
           "if lo < 0 or hi >= self.size:", "if lo < 0 or hi > self.size:"),
    Mutant("03", "TokenAllocator.free", "free accepts a negative index",
           "if lo < 0 or hi >= self.size:", "if hi >= self.size:"),
    Mutant("03", "TokenAllocator.free",
           "free writes the refcounts before it checks them (a refused free changes the pool)",
           "        if low_ref < 0:\n", "        self.mem_state[uniq] = left.clamp(min=0).to(torch.int32)\n"
           "        if low_ref < 0:\n"),
    Mutant("03", "TokenAllocator.free", "free counts every freed slot as free, shared ones too",
           "self.n_free += n_zero", "self.n_free += uniq.numel()"),
    Mutant("03", "TokenAllocator.free", "free drops one reference per distinct slot, not per repeat",
           "left = self.mem_state[uniq.clamp(0, self.size - 1)] - count",
           "left = self.mem_state[uniq.clamp(0, self.size - 1)] - 1"),
    # ---- 04: the decode kernel's tile loop (online softmax), the split combine, the extend kernel's mask ----
    Mutant("04", "_attend", "online softmax: the output accumulator is not rescaled by the new max",
           "acc = acc * alpha[:, None] + tl.dot(", "acc = acc + tl.dot("),
    Mutant("04", "_attend", "online softmax: the running sum is not rescaled by the new max",
           "l_i = l_i * alpha + tl.sum(p, 1)", "l_i = l_i + tl.sum(p, 1)"),
    Mutant("04", "_attend", "online softmax: exp instead of exp2 for the probabilities (scale is in log2 units)",
           "p = tl.exp2(s - m_new[:, None])", "p = tl.exp(s - m_new[:, None])"),
    Mutant("04", "_stage2", "the combine counts one empty split too",
           "smask = offs_s < tl.cdiv(seq_len, _chunk(seq_len, num_splits, BLOCK_N))",
           "smask = offs_s <= tl.cdiv(seq_len, _chunk(seq_len, num_splits, BLOCK_N))"),
    Mutant("04", "_stage2", "the combine weighs the splits with exp instead of exp2",
           "w = tl.exp2(lse - tl.max(lse, 0))", "w = tl.exp(lse - tl.max(lse, 0))"),
    Mutant("04", "_stage2", "the combine forgets to normalise by the weights' sum",
           "out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)", "out = tl.sum(o * w[:, None], 0)"),
    # ---- 05: RadixCache match_prefix / insert (split) / evict (LRU, locks), lpm order, chunked prefill ----
    Mutant("05", "RadixCache.evict", "evict takes the most recently used leaf first",
           "heap = [(x.last_access, x.serial, x) for x", "heap = [(-x.last_access, x.serial, x) for x"),
    Mutant("05", "RadixCache.evict", "evict also takes locked leaves",
           "if not x.children and x.lock_ref == 0]", "if not x.children]"),
    Mutant("05", "RadixCache.evict", "a parent left childless is never evicted",
           "            if not parent.children and parent.lock_ref == 0:  # a parent left childless is the next "
           "candidate\n                heapq.heappush(heap, (parent.last_access, parent.serial, parent))\n", ""),
    Mutant("05", "RadixCache.evict", "evict frees one leaf more than needed (<= n)",
           "while freed < n and heap:", "while freed <= n and heap:"),
    Mutant("05", "RadixCache.match_prefix", "match_prefix without compute_last: the whole prompt may be cached (no "
           "token left to compute)", "key = tuple(tokens[:len(tokens) - 1] if compute_last else tokens)",
           "key = tuple(tokens)"),
    Mutant("05", "RadixCache.insert", "insert's new leaf starts one token late", "leaf = Node(key[n:], key[n:] if "
           "slots is None else slots[n:len(key)].clone(), node, self.serial)", "leaf = Node(key[n + 1:], key[n + 1:] "
           "if slots is None else slots[n + 1:len(key)].clone(), node, " "self.serial)"),
    Mutant("05", "RadixCache.insert", "insert returns the tokens it added instead of those already cached",
           "                self.allocator.inc_ref(leaf.value)\n        return n",
           "                self.allocator.inc_ref(leaf.value)\n        return len(key) - n"),
    Mutant("05", "RadixCache.match_prefix", "match_prefix walks one token short of whole pages (a page walk that "
           "never ends at page 2)", "values, node = self._walk(key[:len(key) // self.page * self.page])",
           "values, node = self._walk(key[:max(len(key) // self.page * self.page - 1, 0)])"),
    Mutant("05", "RadixCache.match_prefix", "match_prefix returns the slots of the last edge only",
           "slots = torch.cat(values) if len(values) > 1 else values[0] if values", "slots = values[-1] if values"),
    Mutant("05", "RadixCache.insert", "insert caches a partial last page too",
           "key = tuple(tokens[:len(tokens) // self.page * self.page])\n        values, node = self._walk(key)\n"
           "        n = sum", "key = tuple(tokens)\n        values, node = self._walk(key)\n        n = sum"),
    Mutant("05", "RadixCache.insert", "insert's new leaf takes no reference on its slots",
           "            if self.allocator is not None:\n                self.allocator.inc_ref(leaf.value)\n", ""),
    Mutant("05", "RadixCache.insert", "insert does not count the new leaf as evictable",
           "            self.evictable += len(leaf.key)\n", ""),
    Mutant("05", "RadixCache.evict", "evict stops one token short of n", "while freed < n and heap:",
           "while freed < n - 1 and heap:"),
    Mutant("05", "RadixCache.evict", "evict forgets the evictable count",
           "            freed += len(x.key)\n            self.evictable -= len(x.key)\n",
           "            freed += len(x.key)\n"),
    Mutant("05", "RadixCache.evict", "evict unlinks a leaf but never frees its slots",
           "            if self.allocator is not None:\n                # drop the tree's reference",
           "            if False:\n                # drop the tree's reference"),
    Mutant("05", "POLICIES[\"lpm\"]", "lpm orders by the prompt's length, not its cached prefix",
           "\"lpm\": lambda tree, rng, w: sorted(w, key=lambda r: -len(r.prefix))",
           "\"lpm\": lambda tree, rng, w: sorted(w, key=lambda r: -len(r.tokens))"),
    Mutant("05", "POLICIES[\"lpm\"]", "lpm orders the shortest cached prefix first",
           "\"lpm\": lambda tree, rng, w: sorted(w, key=lambda r: -len(r.prefix))",
           "\"lpm\": lambda tree, rng, w: sorted(w, key=lambda r: len(r.prefix))"),
    Mutant("05", "POLICIES[\"lpm\"]", "lpm ties broken newest first (not stable FCFS)",
           "\"lpm\": lambda tree, rng, w: sorted(w, key=lambda r: -len(r.prefix))",
           "\"lpm\": lambda tree, rng, w: sorted(w, key=lambda r: (-len(r.prefix), -r.rid))"),
    # ---- 06: TokenIndex (allowed, jump / compressed edges) and jump-forward decoding ----
    Mutant("06", "TokenIndex.jump_forward",
           "jump-forward appends the forced string but leaves the DFA state where it was", "return end, text + jump, "
           "new, len(os.path.commonprefix", "return state, text + jump, new, len(os.path.commonprefix"),
    Mutant("06", "TokenIndex.jump", "jump runs on through a state where the text may end (it stops at a choice only)",
           "while self.forced[s]:", "while (self.dfa.table[s] >= 0).sum() == 1:"),
    Mutant("06", "TokenIndex.jump", "jump stops one byte short of the chain's end",
           "            self.jumps[state] = bytes(out)", "            self.jumps[state] = bytes(out[:-1])"),
    Mutant("06", "TokenIndex.jump_forward", "jump-forward keeps a partial UTF-8 character",
           "jump = jump[len(text):len(jump.decode(\"utf-8\", \"ignore\").encode())]", "jump = jump[len(text):]"),
    Mutant("06", "TokenIndex.jump_forward", "jump-forward ignores max_new_tokens",
           "if (not jump or len(new) > max_new_tokens or fits(", "if (not jump or fits("),
    Mutant("06", "constrained_decode", "constrained decoding samples from the unmasked logits",
           "t = int(sample(logits.masked_fill(~ok, float(\"-inf\"))[None], temperature, 1.0, gen)[0])",
           "t = int(sample(logits[None], temperature, 1.0, gen)[0])"),
    Mutant("06", "constrained_decode",
           "after a jump the KV keeps the old tokens (keep not cut back to the common prefix)",
           "ids, keep = list(prompt_ids) + out, min(keep, n0 + kept)", "ids = list(prompt_ids) + out"),
    Mutant("06", "constrained_decode", "decoding stops only when no token is left (asks the model "
           "where only EOS is allowed)", "if index.finish(state, tokens_left):  # nothing left",
           "if tokens_left < 1:  # nothing left"),
    Mutant("06", "constrained_decode", "decoding stops at max_new_tokens - 1 (one token short)",
           "tokens_left = max_new_tokens - (len(ids) - n0)  # the answer",
           "tokens_left = max_new_tokens - (len(ids) - n0) - 1  # the answer"),
    # ---- 07, the engine (llama3_generate.py): Engine.step ----
    Mutant("engine", "Engine.step", "every step's seconds count as decode, prefill's too", "self.counts[f\"{kind}_s\"] "
           "+= time.perf_counter() - t0", 'self.counts["decode_s"] += time.perf_counter() - t0'),
    Mutant("engine", "Engine.step", "the clock starts after the model ran (a step's seconds miss the forward pass)",
           "ids = self.next_tokens(batch, self.forward(batch, positions))", "ids = self.next_tokens(batch, self."
           "forward(batch, positions))\n        t0 = time.perf_counter()"),
    Mutant("engine", "Engine.step", "the step admits nobody (only the running sequences are scheduled)",
           "self.schedule(self.sched.admit())", "self.schedule([])"),
    Mutant("engine", "Engine.step", "postprocess is not handed on_token (a streaming caller hears nothing)",
           "self.postprocess(batch, ids, 1, on_token)", "self.postprocess(batch, ids)"),
    Mutant("engine", "Engine.step", "each row's next token is its logits' argmax (a prompt's chunk short of its end "
           "takes a token too)", "ids = self.next_tokens(batch, self.forward(batch, positions))",
           "ids = [[t] for t in self.forward(batch, positions).argmax(-1).tolist()]"),
]


def apply(src, mu):
    """(src with mu's bug, start, end of what it replaced), or None (STALE): mu.old's tokens must lie exactly once
    in mu.where's definition, whatever spaces and line breaks lie between them (a reflow moves those). An old that
    starts with its line's indentation takes the line's, and new is re-indented by as much."""
    import workshop as W
    try:
        a, b, _ = W.span(src, mu.where, whole=True)
    except StopIteration:  # the lesson renamed the function
        return None
    toks = re.findall(r"\w+|\S", mu.old)  # words, and every other character alone
    pat = re.escape(toks[0]) + "".join(GAP + ("+" if re.match(r"\w\w", x[-1] + y[0]) else "*") + re.escape(y)
                                       for x, y in zip(toks, toks[1:]))  # two words keep a space between them
    hits = [m.span() for m in re.compile(pat).finditer(src, a, b)]
    if len(hits) != 1:
        return None
    (s, e), line, new = hits[0], src.rfind("\n", 0, hits[0][0]) + 1, mu.new  # old from mid-line: new as written
    if mu.old[:1] == " " and not src[line:s].strip():  # old from its line's indentation: new moves with it
        by, s = s - line - (len(mu.old) - len(mu.old.lstrip(" "))), line
        new = re.sub(r"(?m)^ *(?=\S)", lambda m: " " * max(0, len(m[0]) + by), mu.new)
    e += re.match(r" *\n?", src[e:]).end() if mu.old.endswith("\n") else 0  # old to its line's end
    return src[:s] + new + src[e:], s, e


def of_exercises(stage) -> list:
    """The mutants of stage in an exercise's body (an attendee's bug), each with .exercise (the workshop's Exercise
    that where names) and .body (that body with the bug), for `workshop.py verify`."""
    import workshop as W
    out, src, ex = [], W.reference(stage), {e.name: e for e in W.exercises(stage)}
    for mu in MUTANTS:
        got = apply(src, mu) if FILES[mu.stage][:-3] == W.LESSONS.get(stage) and mu.where in ex else None
        if got is None:
            continue
        (mutated, at, end), grow = got, len(got[0]) - len(src)
        old, new = src[at:end], mutated[at:end + grow]
        head = len(os.path.commonprefix([old, new]))
        tail = len(os.path.commonprefix([old[head:][::-1], new[head:][::-1]]))
        a, b, _ = W.span(src, mu.where)
        if a <= at + head and end - tail <= b:  # the changed characters lie in the exercise's body
            out.append(ExerciseMutant(*mu, ex[mu.where], mutated[a:b + grow]))
    return out


ExerciseMutant = namedtuple("ExerciseMutant", Mutant._fields + ("exercise", "body"))


def copy_repo(dst, tests_from=None):
    """The files the tests read: top-level .py files, pytest.ini, tests/ (git-tracked and untracked, not ignored);
    tests_from: a git revision to take the stage tests from instead (what they caught before a change)."""
    names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\n")
    for n in filter(None, names):
        if (n.endswith(".py") and "/" not in n) or n == "pytest.ini" or n.startswith("tests/"):
            os.makedirs(os.path.join(dst, os.path.dirname(n)), exist_ok=True)
            if os.path.exists(os.path.join(ROOT, n)):
                shutil.copy2(os.path.join(ROOT, n), os.path.join(dst, n))
    for n in [t for ts in TESTS.values() for t in ts] if tests_from else []:
        with open(os.path.join(dst, n), "w") as f:
            f.write(subprocess.run(["git", "show", f"{tests_from}:{n}"], cwd=ROOT, capture_output=True, text=True,
                                   check=True).stdout)


def run(mutants, timeout, keep=False, tests_from=None, k=""):
    work = tempfile.mkdtemp(prefix="mutants-")
    copy_repo(work, tests_from)
    results = []
    try:
        for mu in mutants:
            path = os.path.join(work, FILES[mu.stage])
            src = open(path).read()
            if apply(src, mu) is None:
                results.append((mu, "STALE", 0.0))
                print(f"{mu.stage}  STALE     {mu.what} (snippet not in {mu.where} exactly once)", flush=True)
                continue
            open(path, "w").write(apply(src, mu)[0])
            t0 = time.time()
            try:
                cmd = [sys.executable, "-m", "pytest", *TESTS[mu.stage], "-x", "-q", "-p", "no:cacheprovider",
                       "-m", "not gpu", "-k", " and ".join(f"({x})" for x in (SKIP.get(mu.stage), k) if x)]
                p = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=timeout,
                                   env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
                lines = (p.stdout + p.stderr).splitlines()
                why = next((ln for ln in lines if ln.startswith(("FAILED", "ERROR"))), "")
                # 1: a test failed; 2: collection broke (the mutant broke an import); else the harness did
                verdict = "SURVIVED" if p.returncode == 0 else "caught" if why else f"rc={p.returncode}"
                why = why or (lines[-1] if lines else "")
            except subprocess.TimeoutExpired:
                verdict, why = "caught", "(timed out: counts as caught)"
            finally:
                open(path, "w").write(src)
            results.append((mu, verdict, time.time() - t0))
            print(f"{mu.stage}  {verdict:8s} {time.time() - t0:5.0f}s  {mu.what}  {why[:100]}", flush=True)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("stages", nargs="*", help=f"stages to run (default: all of {', '.join(FILES)})")
    p.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    p.add_argument("--only", type=int, nargs="*", help="indices (of --list) to run")
    p.add_argument("--timeout", type=float, default=900, help="seconds per mutant (a hang counts as caught)")
    p.add_argument("--keep", action="store_true", help="keep the temporary copy")
    p.add_argument("--tests-from", metavar="REV", help="run the stage tests of a git revision (e.g. main)")
    p.add_argument("-k", default="", help="only the tests pytest's -k selects (a quick look, not the verdict)")
    a = p.parse_args(argv)
    bad = [s for s in a.stages if s not in FILES]
    if bad:
        p.error(f"unknown stage {bad[0]!r}: choose from {', '.join(FILES)}")
    from code_mutants import CODE_MUTANTS  # imports this file's Mutant
    chosen = [(i, mu) for i, mu in enumerate(MUTANTS + CODE_MUTANTS) if (not a.stages or mu.stage in a.stages)
              and (a.only is None or i in a.only)]
    if a.list:
        for i, mu in chosen:
            print(f"{i:3d}  {mu.stage}  {'attendee' if i < len(MUTANTS) else 'code':8s}  {mu.where}: {mu.what}")
        return 0
    results = run([mu for _, mu in chosen], a.timeout, a.keep, a.tests_from, a.k)
    print("\nstage   mutants  caught  survived  stale  harness errors")
    for s in sorted({mu.stage for mu, _, _ in results}):
        r = [v for mu, v, _ in results if mu.stage == s]
        n = [r.count(v) for v in ("caught", "SURVIVED", "STALE")]
        print(f"{s:6s} {len(r):8d}  {n[0]:6d}  {n[1]:8d}  {n[2]:5d}  {len(r) - sum(n):14d}")
    return int(any(v != "caught" for _, v, _ in results))


if __name__ == "__main__":
    sys.exit(main())
