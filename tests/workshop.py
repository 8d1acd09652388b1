"""The workshop: each stage's exercises are the functions that are its idea, cut out of a copy of the lesson, and one
grader says, exercise by exercise, whether the attendee's are right.

    python tests/workshop.py start 03     # workspace/03_token_allocator.py: 3 bodies to write, each with its idea
    python -m pytest tests/test_03_token_allocator.py --workspace     # grade them (one of them: --exercise alloc)
    python tests/workshop.py progress     # every stage's status and the score (--json for an instructor)
    python tests/workshop.py hint 03 alloc        # stuck: a question (--level 2: an example); `solution` last

The path: the stage's notebook explains the idea with its figure; write the exercises in workspace/; the grader
grades them; then read the lesson (03_token_allocator.py) as the reference and run it.

How a grade is made (the same for pytest and progress): each exercise written is graded alone, on the lesson with
only that body replaced by the attendee's (the lesson's code stands in for its siblings, written or not), by the
tests listed for it, in a child process with a time and a memory limit. A failure names the exercise on its first
line and says what was expected and what happened. Stage 07 is the engine: llama3_generate.py's Engine.step.
04's kernels run through Triton's interpreter (TRITON_INTERPRET=1, set for you), Linux only. tiny-llm (skyzh) and
CMU 11-868's grade.py do the same: a stub, a hint, a grade per exercise."""
from __future__ import annotations

import argparse
import ast
import contextlib
import difflib
import functools
import glob
import importlib.abc
import importlib.util
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKSPACE = os.path.join(ROOT, "workspace")  # git-ignored
ALTERNATIVES = os.path.join(ROOT, "tests", "data", "alternatives")  # other right answers, written from the copy
STUB = "your turn: "
MEMORY = 3 << 30  # bytes a graded run may take beyond what the grader holds (the model, torch)
KEEP = {"__main__", "workshop", "conftest", "mutants", "code_mutants"}  # the grader's own modules, kept in a grade


@dataclass(frozen=True)
class Exercise:
    stage: str      # "03"
    name: str       # qualname in the lesson: "TokenAllocator.alloc"
    idea: str       # what to do and what to watch for (the stub says it; the notebook too)
    hint: str       # hint 1: the idea as a question or a picture, no code (`workshop.py hint`)
    checks: str     # what its tests check, in words
    tests: tuple    # the tests of tests/test_<lesson>.py that grade it (names; "name[param]" for one case)
    seconds: int = 60  # a graded run longer than this fails (a loop that never ends)
    example: str = ""  # hint 2: a small example worked by hand (`workshop.py hint --level 2`)

    @property
    def id(self) -> str:
        return f"{self.stage} {self.name}"

    @property
    def short(self) -> str:  # alloc; lpm for POLICIES["lpm"]
        m = re.fullmatch(r'\w+\["(\w+)"\]', self.name)
        return m[1] if m else self.name.split(".")[-1]


LESSONS = {os.path.basename(p)[:2]: os.path.basename(p)[:-3] for p in sorted(glob.glob(os.path.join(ROOT, "0*.py")))}
LESSONS["07"] = "llama3_generate"  # the engine: its stage's tests are tests/test_engine.py, its notebook 07's
TESTS = {s: f"tests/test_{name}.py" for s, name in LESSONS.items()} | {"07": "tests/test_engine.py"}
NOTEBOOKS = {s: os.path.basename(p) for s in LESSONS
             for p in glob.glob(os.path.join(ROOT, "notebooks", s + "_*.ipynb"))}

EXERCISES = [
    Exercise("01", "ContiguousKVCache.prepare",
             "each request owns one row of max_seq_len slots: give a new request a free row, return the positions "
             "of its new tokens and where their K/V go. Watch: check that every request fits before changing "
             "anything (all or nothing); a slot depends on the row and the position",
             "Picture the cache as a grid: one row per request, as many columns as the longest request may grow. For "
             "a batch of requests, each adding some tokens, which row does each write, at which columns, and what "
             "must you know of every request before you hand out a single row?",
             "greedy decoding through your cache gives the no-cache tokens and logits; a request that does not fit is "
             "refused and leaves the cache untouched",
             ("test_contiguous_cache_fills_a_row_exactly",
              "test_contiguous_cache_batches_against_a_brute_force_model"),
             example="Rows of 8, row 0 held by request a with 3 tokens, row 1 free. Batch: a adds 1 token, b (new) "
                     "adds 4.\nb gets row 1. Positions: a -> [3], b -> [0, 1, 2, 3]; slot = row * 8 + position: a -> "
                     "[3], b -> [8, 9, 10, 11].\nLengths after: 4 and 4. Had a asked for 6 more (3 + 6 > 8), nothing "
                     "may change: b gets no row either."),
    Exercise("01", "KVCache.attend",
             "store this step's K/V at their slots, then let each query attend to its own request's keys only. "
             "Watch: decode (one query per request) and prefill (several, causal) read the pool differently; a "
             "request reads up to its length, no further",
             "Two jobs, in order: put this step's keys and values where the cache said they go, then attend. A "
             "generating step (one query per request) and a prompt (many queries, each seeing only the tokens up to "
             "its own) read the stored keys differently: which keys may the j-th new query of a request see?",
             "greedy decoding through the contiguous cache (its prefill and decode both attend here) gives the "
             "no-cache tokens and logits",
             ("test_contiguous_cache_batches_against_a_brute_force_model",),
             example="Request r lives in row 2 (rows of 8), holds 5 tokens, and prefills 3 more at positions 5, 6, "
                     "7: their keys and values go to slots 21, 22, 23.\nQuery 0 (position 5) sees positions 0..5 "
                     "(slots 16..21), query 1 sees 0..6, query 2 sees 0..7: 6, 7 and 8 keys.\nA generating step for "
                     "r alone has 1 query, and it sees all 8."),
    Exercise("02", "BlockManager.append",
             "grow a sequence by n tokens, taking whole blocks from the free list as needed; a partly filled last "
             "block that another sequence shares is copied before it is written (copy-on-write). Watch: refuse "
             "(OutOfBlocks) before changing anything; a full shared block is not copied",
             "A sequence holds some tokens in blocks of a fixed size and wants n more. How many new blocks does that "
             "take, counting the room left in its last block? And if that last block is shared with another sequence "
             "and not full, may you write into it?",
             "random appends, forks and frees keep the refcounts, the free list and every sequence's tokens exactly "
             "as a brute-force model says; a shared block is copied once",
             ("test_append_takes_whole_blocks_and_copies_a_shared_partial_one",
              "test_batch_estimate_counts_copy_on_write_once_per_shared_block",
              "test_random_alloc_append_fork_free_keeps_invariants_and_contents[1]"),
             example="Blocks of 4; a holds 6 tokens in blocks [0, 1] (block 1 holds 2: room for 2). Appending 5: 2 "
                     "fit in block 1, 3 need 1 new block.\nNow say a was forked first, so block 1 has refcount 2: "
                     "writing into it would change the fork's tokens. a copies it to a fresh block 2 (it returns (1, "
                     "2)), block 1 drops to refcount 1, and a still needs 1 more block: table [0, 2, 3], 2 blocks "
                     "taken. With 1 block free, that is a refusal, and nothing changes."),
    Exercise("02", "BlockManager.fork",
             "the child shares every block of the parent: its own copy of the table, the same token count, one "
             "more reference on each block. Watch: unknown parent: KeyError; a child that exists: ValueError",
             "After a fork, parent and child read the same tokens. What must the child own by itself, and what must "
             "each shared block know so that it is not handed out again while either of them still reads it?",
             "a forked sequence reads its parent's tokens, and its own after it writes (copy-on-write)",
             ("test_fork_shares_every_block_and_refuses_clearly",
              "test_random_alloc_append_fork_free_keeps_invariants_and_contents[1]"),
             example="Parent p: table [0, 1], 6 tokens, refcounts {0: 1, 1: 1}. Fork p into c: c's table is a new "
                     "list [0, 1] (so appending to c never changes p's), c has 6 tokens, refcounts {0: 2, 1: 2}, and "
                     "no block left the free list.\nForking p into c again: c exists, refused. Forking an unknown x: "
                     "refused."),
    Exercise("02", "BlockManager.free",
             "drop the sequence: each of its blocks loses one reference and is free again only when no one holds "
             "it. Watch: unknown sequence: KeyError",
             "A block may be held by several sequences. When one of them leaves, which of its blocks really become "
             "free again, and how do you know?",
             "freed blocks come back to the free list exactly when no other sequence holds them",
             ("test_free_gives_a_block_back_when_nobody_holds_it",
              "test_random_alloc_append_fork_free_keeps_invariants_and_contents[1]"),
             example="p holds [0, 1]; its fork c holds [0, 2, 3] (block 0 shared: refcount 2).\nFreeing c: block 3 "
                     "-> refcount 0, free; block 2 -> 0, free; block 0 -> 1, still p's. The free list grows by 2; "
                     "c's table and token count are gone; freeing c a second time is an error."),
    Exercise("02", "Scheduler.preempt",
             "take a running request out to make room: count it, log it with the tokens of KV it holds, then swap "
             "its blocks to CPU memory (it keeps its progress) or drop them and queue it first to recompute. "
             "Watch: log before anything is dropped; a swapped-out request's KV is no longer in the pool",
             "To make room you take a running request out. What must be written down first, while it still holds its "
             "KV? And where does it wait afterwards, so that it can finish: with its KV kept somewhere else, or with "
             "nothing, to start over?",
             "a pool too small for the trace preempts, and every request still finishes with its own KV intact",
             ("test_preempt_logs_the_kv_it_drops_then_drops_it", "test_scheduler_preempts_and_keeps_every_request_kv",
              "test_preemption_order_against_the_policy"),
             example="Request 0 holds 7 tokens of KV; requests 1 and 2 wait.\nRecompute: count 1 preemption, record "
                     "(preempt, 0, 7 tokens), give its blocks back, queue it first: waiting [0, 1, 2].\nSwap: record "
                     "(swap_out, 0, 7 tokens), copy its KV to CPU memory and keep it aside with that copy, marked as "
                     "out of the pool; its 7 tokens of progress stay."),
    Exercise("03", "TokenAllocator.alloc",
             "the n lowest free slots (refcount 0), taken (refcount 1), as a LongTensor; None when fewer than n "
             "are free. Watch: a refusal takes nothing; n_free follows every change; try it without a Python loop "
             "over the pool",
             "Slots with refcount 0 are free. Count from the left how many free slots you have seen so far: at which "
             "slot does that count first reach 1, 2, 3? Can you find those places for every k at once, with no loop?",
             "alloc returns the lowest free slots, exactly as a brute-force Python list does, and refuses cleanly",
             ("test_alloc_takes_the_lowest_free_slots", "test_random_ops_agree_with_brute_force"),
             example="Refcounts [1, 0, 2, 0, 0, 1, 0], n = 3. Free: [0, 1, 0, 1, 1, 0, 1]; count so far: [0, 1, 1, "
                     "2, 3, 3, 4].\nThe count first reaches 1 at slot 1, 2 at slot 3, 3 at slot 4: take [1, 3, "
                     "4].\nn = 5 with 4 free: None, and nothing is taken."),
    Exercise("03", "TokenAllocator.alloc_contiguous",
             "the first run of n consecutive free slots, taken; no run: fall back to alloc(n). Watch: a run may "
             "start at slot 0 or end at the last slot",
             "If you knew, for every position, how many free slots lie before it, how could one subtraction tell you "
             "that the n slots starting at i are all free? Which i do you want when several work, and what if none "
             "does?",
             "a run of n free slots is returned whenever one exists, the first one",
             ("test_alloc_contiguous_takes_the_first_run",
              "test_alloc_contiguous_returns_a_run_whenever_one_exists[0.5]",
              "test_random_ops_agree_with_brute_force"),
             example="Pool # . . # . . . # (#: held), n = 3. Free slots before positions 0..8: 0 0 1 2 2 3 4 5 "
                     "5.\nWindows of 3 (count at i + 3 minus count at i): i = 0: 2 - 0 = 2; i = 1: 2 - 0 = 2; i = 2: "
                     "3 - 1 = 2; i = 3: 4 - 2 = 2; i = 4: 5 - 2 = 3: the first run is slots 4, 5, 6.\nWith n = 4 no "
                     "window reaches 4: fall back to the 4 lowest free slots, [1, 2, 4, 5]."),
    Exercise("03", "TokenAllocator.free",
             "one reference less for each slot listed (a slot listed twice loses two); slots reaching 0 are free "
             "again. Watch: check everything first: a slot out of range or not allocated is a ValueError with "
             "nothing changed",
             "A slot listed twice loses two references. Before you change anything, what would make the whole call "
             "wrong (slots nobody holds, slots outside the pool), and how can you check every slot at once?",
             "freeing drops one reference per slot; double frees and foreign slots are refused without a change",
             ("test_free_drops_one_reference_per_slot_listed", "test_random_ops_agree_with_brute_force"),
             example="Refcounts [1, 2, 0, 1]. Freeing [1, 1, 3]: slot 1 is listed twice, 2 - 2 = 0; slot 3, 1 - 1 = "
                     "0: refcounts [1, 0, 0, 0], 2 more free slots.\nThen freeing [2]: slot 2 would go to -1: "
                     "refused, nothing changes.\nFreeing [0, 4]: slot 4 lies outside a pool of 4: refused, and slot "
                     "0 keeps its reference too."),
    Exercise("04", "_attend",
             "one tile of keys in the online softmax: its scores, the mask, a new running max; rescale what you "
             "have by how far the max moved, then add the tile. Watch: the scale is in log2 units (exp2)",
             "You carry a running result over the keys seen so far: the largest score, the softmax's denominator, "
             "and the weighted values. A new tile of keys brings a larger score: by how much must the old "
             "denominator and weighted values shrink, so that everything is measured against the new largest score?",
             "the decode kernel equals float64 softmax attention (the online softmax over tiles)",
             ("test_matches_reference[float32-gqa4-d64-scat-s1]",),
             example="Scores in base 2. Seen so far: [1, 3]: largest 3, denominator 2^(1-3) + 2^(3-3) = 1.25.\nNext "
                     "tile: [5, 2]: largest 5. Rescale the old denominator by 2^(3-5) = 0.25 -> 0.3125, add the "
                     "tile's 2^(5-5) + 2^(2-5) = 1.125: 1.4375 = 2^-4 + 2^-2 + 2^0 + 2^-3, as if all four came at "
                     "once. The weighted values are rescaled by the same 0.25. A key that may not be seen scores "
                     "minus infinity: 2^-inf = 0."),
    Exercise("04", "_stage2",
             "merge the splits' partial results, each weighed by its softmax mass (from its log-sum-exp). Watch: a"
             " split that holds no tokens",
             "Each split of a sequence's keys returns its own softmax-weighted output and the log of its own "
             "denominator. If one split's denominator is twice another's, how much more should its output count in "
             "the merge? And what should a split that saw no keys count?",
             "splitting a sequence over several programs and merging their partial softmaxes gives the reference",
             ("test_empty_splits_and_custom_scale",),
             example="Two splits, logs in base 2: A has log-denominator 3 (denominator 8) and output [1, 0]; B has 1 "
                     "(denominator 2) and output [0, 1].\nWeights 2^(3-3) = 1 and 2^(1-3) = 0.25: out = (1 * [1, 0] "
                     "+ 0.25 * [0, 1]) / 1.25 = [0.8, 0.2], the same as (8 * [1, 0] + 2 * [0, 1]) / 10.\nA split "
                     "with no keys has log-denominator minus infinity: weight 0."),
    Exercise("05", "RadixCache.match_prefix",
             "the longest cached prefix of tokens, in whole pages, and its slots. Watch: with compute_last one token "
             "is always left to compute (its logits give the next token); a page is matched whole or not at all",
             "The tree stores token sequences in pages. Given a prompt, how far down the tree can you walk? Why must "
             "the match end on a whole page, and one token short of the prompt when its last token's logits are "
             "needed?",
             "matches, inserts and evictions give what a brute-force list of cached prompts gives",
             ("test_match_prefix_finds_the_longest_cached_prefix_in_whole_pages",
              "test_match_insert_evict_lock_vs_brute_force[0-1]", "test_match_insert_evict_lock_vs_brute_force[1-2]"),
             example="Page size 2; the tree holds [1 2 3 4 5 6].\nPrompt [1 2 3 4 9], its last token to compute: "
                     "look up [1 2 3 4] (the last dropped): 4 tokens match, their slots.\nPrompt [1 2 3 4 5]: [1 2 3 "
                     "4] again: 4, not 5 (the model computes the last token).\nPrompt [1 2 3 9]: [1 2 3], whole "
                     "pages [1 2]: 2 tokens."),
    Exercise("05", "RadixCache.insert",
             "walk the cached prefix; what is left (whole pages) becomes a new leaf; return how many tokens were "
             "cached already. Watch: the leaf's slots take a reference; the tree counts them evictable",
             "Part of a new prompt may be in the tree already. Which part becomes a new leaf, which node does it hang "
             "from, and who must now hold a reference to its slots so that the pool does not hand them out again?",
             "the tree holds exactly the prompts inserted, shares their common prefixes, and counts refs right",
             ("test_insert_adds_what_is_new_and_says_what_was_cached",
              "test_match_insert_evict_lock_vs_brute_force[0-1]", "test_match_insert_evict_lock_vs_brute_force[1-2]"),
             example="Page size 1; the tree holds [1 2 3]. Inserting [1 2 4 5] with slots [10 11 12 13]: the walk "
                     "matches [1 2] (splitting [1 2 3] into [1 2] -> [3]); [4 5] with slots [12 13] becomes a leaf "
                     "under [1 2]; those 2 slots get one more reference and 2 more tokens can be evicted; it returns "
                     "2 (cached already)."),
    Exercise("05", "RadixCache.evict",
             "free at least n tokens, least recently used unlocked leaves first; a parent left childless may go "
             "next. Watch: never a locked node; stop once n are freed",
             "Which cached tokens are the safest to throw away? Think of the tree's leaves and when each was last "
             "used. When a leaf goes, its parent may become a leaf: may it go in the same call? And which nodes may "
             "never go?",
             "eviction frees the least recently used unlocked leaves first, never a locked one",
             ("test_evict_takes_the_least_recently_used_unlocked_leaves",
              "test_match_insert_evict_lock_vs_brute_force[0-1]", "test_match_insert_evict_lock_vs_brute_force[1-2]"),
             example="Tree root -> {[1 2 3] -> {[4 5] used at time 1, [7 8] at time 2}, [6 6] used at time "
                     "3, held by a running request}.\nEvicting 3 tokens: [4 5] first (the oldest leaf): 2 so far; "
                     "[7 8] next: 4, enough, stop.\nEvicting 1 more: [1 2 3] has no children left, so it is a leaf: "
                     "3 tokens. [6 6] stays while it is held."),
    Exercise("05", 'POLICIES["lpm"]',
             "the waiting requests, longest cached prefix first. Watch: ties keep their arrival order",
             "Requests that share a long cached prefix reuse the most KV when they go first. What order of the waiting "
             "queue does that suggest, and what should decide between two requests with equally long cached prefixes?",
             "longest-prefix-first admission caches at least as many prompt tokens as first come first served, and "
             "reaches the best possible order on a workload built for it",
             ("test_lpm_puts_the_longest_cached_prefix_first",
              "test_lpm_orders_longest_cached_prefix_first_ties_first_come"),
             example="Waiting, in arrival order: A (cached prefix of 2 tokens), B (5), C (0), D (5), E (1).\nLongest "
                     "first: B and D tie at 5 and B came first: B, D, then A (2), E (1), C (0)."),
    Exercise("06", "TokenIndex.jump",
             "the bytes the automaton forces from a state: while a state has exactly one way out and may not stop,"
             " take that byte. Watch: cache what you computed",
             "From some states of the automaton only one byte can come next, and the text may not end there. Follow "
             "such states: what string do you collect, where do you stop, and why remember it for next time?",
             "the compressed edges are exactly the DFA's chains of forced bytes",
             ("test_jump_follows_the_forced_bytes_and_stops_at_a_choice", "test_compressed_edges_are_the_forced_chains",
              "test_jump_is_the_forced_string_against_partial_matching"),
             example="Regex a{3,5}b after 'a': fewer than 3 a's cannot end and only 'a' may follow: 'aa', 2 bytes, "
                     "then a choice ('a' or 'b'): stop.\nAfter 'aaa': 'a' or 'b' may come: 0 bytes.\nRegex "
                     "ab(c|d)xyz after 'abc': 'xyz', 3 bytes, then the text may end: stop."),
    Exercise("06", "TokenIndex.jump_forward",
             "append the forced text without sampling, re-tokenized the way the tokenizer would write it. Watch: whole "
             "UTF-8 characters only; never pass max_new_tokens or leave less room than a shortest completion needs",
             "The forced bytes are known, but the model speaks in tokens: how do you turn the text plus the forced "
             "bytes back into the tokens the tokenizer would have written, which of the tokens generated so far "
             "survive, and when should you skip it?",
             "jump-forward gives what a byte-by-byte walk of the forced text gives, and never takes the room a "
             "shortest completion needs",
             ("test_jump_forward_appends_the_forced_text_in_whole_characters",
              "test_jump_forward_keeps_the_room_a_shortest_completion_had"),
             example="Generated so far, say, tokens [90, 1200] for '{\"na'; the automaton forces 'me\": '. "
                     "Re-tokenized, '{\"name\": ' is, say, [90, 609, 794]: the common prefix with [90, 1200] is 1 "
                     "token, so the K/V of 1 token is kept and the rest computed.\nForced bytes that end inside a "
                     "UTF-8 character wait for the rest of it; new tokens that would pass max_new_tokens, or leave "
                     "less room than the shortest completion needs: skip it."),
    Exercise("06", "constrained_decode",
             "decode where only the tokens the regex allows can be sampled: mask, sample, step the automaton, jump"
             " forward over forced text. Watch: stop where the automaton says it must finish, or at max_new_tokens",
             "At each point only some tokens keep the output a possible match: how do you stop the model choosing "
             "the others, when is the answer over (before the model is asked anything), and what changes after "
             "forced text is appended?",
             "every output matches the regex, with and without jump-forward, on random logits",
             ("test_constrained_decode_keeps_only_the_kv_a_jump_left_unchanged",
              "test_constrained_decode_stops_at_max_new_tokens_and_eos",
              "test_jump_is_the_forced_string_against_partial_matching[(ab|cd){1,3}e?]"),
             example="Regex (ab|cd){1,3}e?, one token per byte, 6 new tokens at most.\nStart: a or c may come; the "
                     "model draws a. After a only b may come: with jump-forward, b is appended without the "
                     "model.\nAfter ab: a, c, e or the end; the model draws e. Nothing may follow e: stop before "
                     "asking the model again. Output 'abe': 3 tokens, 2 model calls."),
    Exercise("07", "Engine.step",
             "one step of the engine: admit and schedule, run the model, pick each sequence's next token, "
             "post-process (append, finish, on_token), and count the step's seconds as its kind. Watch: the clock "
             "covers the whole step; the kind is what postprocess returns (prefill, decode or mixed)",
             "One turn of the engine, in order: who joins the batch, the model over the batch's tokens, a new token "
             "for each sequence that needs one, then the bookkeeping (append, finish, tell whoever streams). What kind "
             "of turn was it (prompts, generating, or both), and from when to when do you time it?",
             "the engine serves the same greedy tokens with and without the radix cache, its events account for "
             "every token of a run that preempts, a streaming caller hears every token, and each step's seconds "
             "count as its kind",
             ("test_radix_cache_same_tokens_on_every_sharing_backend[token]",
              "test_events_account_for_a_run_under_memory_pressure[token-recompute-False]",
              "test_each_step_counts_its_seconds_as_its_kind[eager]"),
             example="Running: A and B, generating; waiting: C, a 12-token prompt.\nThis step admits C: the batch is "
                     "C's 12 prompt tokens (prefill-first), the model runs once, C gets its first token, and the "
                     "step's 0.8 s count as prefill.\nNext step nobody waits: A, B and C feed 1 token each and get 1 "
                     "new one (3 in all); the step's 0.05 s count as decode."),
]


def exercises(stage=None) -> list:
    return [e for e in EXERCISES if stage in (None, e.stage)]


# -------- cutting a body out of a lesson -----------------------------------------------------------------

def _find(tree, qualname):
    node = tree
    for part in qualname.split("."):
        node = next(n for n in node.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
    return node


@functools.lru_cache(maxsize=16)
def _parse(source: str):
    return ast.parse(source)


def span(source: str, name: str, whole=False):
    """(start, end, indent): what an exercise's attendee writes, source[start:end]: a function's body after its
    docstring, or a lambda's expression in a dict (indent None); whole: from the definition or the dict key."""
    tree, lines = _parse(source), source.splitlines(keepends=True)
    at = lambda line, col: sum(map(len, lines[:line - 1])) + (len(lines[line - 1].encode()[:col].decode()) if col
                                                               else 0)  # ast's columns count UTF-8 bytes
    if m := re.fullmatch(r"(\w+)\[(.+)\]", name):  # a lambda in a dict
        d = next(n.value for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == m[1])
        k, e = next((k, v.body) for k, v in zip(d.keys, d.values) if k.value == ast.literal_eval(m[2]))
        first = k if whole else e
        return at(first.lineno, first.col_offset), at(e.end_lineno, e.end_col_offset), None
    fn = _find(tree, name)
    if whole:
        return at(fn.lineno, 0), at(fn.end_lineno + 1, 0), None
    doc = isinstance(fn.body[0], ast.Expr) and isinstance(getattr(fn.body[0].value, "value", None), str)
    first = fn.body[1] if doc and len(fn.body) > 1 else fn.body[0]
    return at(first.lineno, 0), at(fn.end_lineno + 1, 0), first.col_offset


def stub_text(ex: Exercise, indent) -> str:
    error = f"NotImplementedError({STUB + ex.idea!r})"
    return f"(_ for _ in ()).throw({error})" if indent is None else " " * indent + f"raise {error}\n"


def splice(source: str, bodies: dict) -> str:
    """source with what the attendee writes of each exercise in bodies, {name: text}, replaced by that text."""
    for a, b, _, name in sorted(((*span(source, n), n) for n in bodies), reverse=True):  # bottom up
        source = source[:a] + bodies[name] + source[b:]
    return source


def stub(source: str, exs) -> str:
    """source with each exercise's body replaced by raise NotImplementedError("your turn: <hint>")."""
    return splice(source, {e.name: stub_text(e, span(source, e.name)[2]) for e in exs})


def is_stub(source: str, ex: Exercise) -> bool:
    a, b, indent = span(source, ex.name)
    return source[a:b] == stub_text(ex, indent)


def body(source: str, name: str) -> str:
    """What the attendee writes of an exercise, as the lesson writes it (dedented)."""
    a, b, indent = span(source, name)
    return source[a:b] if indent is None else "".join(line[indent:] for line in source[a:b].splitlines(True))


def reference(stage: str) -> str:
    return pathlib.Path(ROOT, LESSONS[stage] + ".py").read_text(encoding="utf-8")


# -------- which lessons a run takes from the workspace ----------------------------------------------------

class _Finder(importlib.abc.MetaPathFinder):
    """Imports lesson `name` from `folder` where it is there (lessons are imported by name)."""

    def __init__(self, folder, names):
        self.folder, self.names = folder, set(names)

    def find_spec(self, name, path=None, target=None):
        file = os.path.join(self.folder, name + ".py")
        if name not in self.names or not os.path.exists(file):
            return None
        spec = importlib.util.spec_from_file_location(name, file)  # tracebacks show this file...
        spec.origin = os.path.join(ROOT, name + ".py")  # ...and __file__ the lesson's, so tests/bench_0X.py is found
        return spec


def use(stages, folder=None, say=True):
    """Import these stages' lessons from `folder` (default: $WORKSHOP_DIR, else workspace/); returns the finder."""
    folder = folder or os.environ.get("WORKSHOP_DIR") or WORKSPACE
    finder = _Finder(folder, [LESSONS[s] for s in stages])
    sys.meta_path.insert(0, finder)
    for s in stages if say else ():
        mine = os.path.exists(os.path.join(folder, LESSONS[s] + ".py"))
        print(f"{LESSONS[s]}: {'your copy in' if mine else 'the reference (not started in'} "
              f"{os.path.relpath(folder)}{'' if mine else ')'}")
    return finder


def started(folder=WORKSPACE) -> list:
    return [s for s, name in LESSONS.items() if os.path.exists(os.path.join(folder, name + ".py"))]


def find(stage, name):
    """The exercise of stage called name (TokenAllocator.alloc, or alloc), else None."""
    return next((e for e in exercises(stage) if name in (e.name, e.short) or e.name.endswith("." + name)), None)


# -------- one grade: an exercise's body in the lesson, its tests, in a child process with limits ----------------

@dataclass
class Grade:
    status: str           # "passes" | "fails" | "to do" | "not started"
    why: str = ""         # fails: the first line, naming the exercise and what went wrong
    detail: str = ""      # fails: the test, where, the traceback's last lines
    seconds: float = 0.0
    tests: list = field(default_factory=list)  # the tests run: [test id, outcome]


def _words(test_id: str) -> str:
    """test_alloc_returns_the_lowest[0.5] -> "alloc returns the lowest [0.5]"."""
    base, _, param = test_id.split("::")[-1].partition("[")
    return base.removeprefix("test_").replace("_", " ") + (f" [{param}" if param else "")


class _Collect:
    """pytest plugin in the child: each test's outcome, and the first failure as facts (type, message, frames)."""

    def __init__(self):
        self.tests, self.failure = [], None
        self.reserve = bytearray(32 << 20)  # taken under the child's memory limit, freed at a MemoryError

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        """Out of memory: what the test grew, and the reserve, freed before pytest builds its report."""
        try:
            return (yield)
        except MemoryError as e:
            self.reserve = None
            traceback.clear_frames(e.__traceback__)
            raise

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        rep = (yield).get_result()
        if rep.failed or rep.when == "call" or rep.skipped:
            self.tests.append([item.nodeid, rep.outcome])
        if rep.failed and self.failure is None and call.excinfo is not None:
            e = call.excinfo.value
            frames = [(f.filename, f.lineno, f.name, f.line or "") for f in traceback.extract_tb(call.excinfo.tb)]
            self.failure = dict(test=item.nodeid, type=type(e).__name__, msg=str(e).strip(), frames=frames,
                                doc=re.split(r"(?<=\.)\s", " ".join((getattr(item.function, "__doc__", None)
                                                                       or "").split()))[0])


def _run_tests(stage, source, tests, folder) -> dict:
    """In this process: tests of the stage's file on source as its lesson, lessons and tests imported afresh."""
    os.chdir(ROOT)
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # only pytest and the conftest
    path = os.path.join(folder, LESSONS[stage] + ".py")
    pathlib.Path(path).write_text(source, encoding="utf-8")
    for name, m in list(sys.modules.items()):  # the project's modules (lessons, helpers, tests), imported afresh:
        if name not in KEEP and (getattr(m, "__file__", None) or "").startswith(ROOT) and "-packages" not in m.__file__:
            del sys.modules[name]  # as in pytest's own run, whatever the grading process imported before
    finder = _Finder(folder, [LESSONS[stage]])
    sys.meta_path.insert(0, finder)
    quiet = [a for p in ("cacheprovider", "unraisableexception", "threadexception", "faulthandler", "workshop")
             for a in ("-p", "no:" + p)]
    args = [f"{TESTS[stage]}::{t}" for t in tests] + ["-x", "-q", "--assert=plain", "-p", "no:randomly", *quiet]
    collect = _Collect()
    try:
        with (open(os.path.join(folder, "log.txt"), "w") as log, contextlib.redirect_stdout(log),
              contextlib.redirect_stderr(log)):
            rc = int(pytest.main(args, plugins=[collect]))
    finally:
        sys.meta_path.remove(finder)
    return dict(rc=rc, tests=collect.tests, failure=collect.failure, lesson=path)


def _isolated(fn, seconds, memory=MEMORY) -> dict:
    """fn() in a forked child with `seconds` and `memory` bytes to spend (without fork: here, unlimited)."""
    import pickle
    if not hasattr(os, "fork"):
        return fn()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: whatever happens, it ends here (Ctrl-C: the parent stops it)
        code = 1
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            os.close(r)
            try:
                import resource
                with open("/proc/self/status") as f:
                    held = int(re.search(r"VmSize:\s+(\d+)", f.read())[1]) * 1024
                resource.setrlimit(resource.RLIMIT_AS, (held + memory, resource.RLIM_INFINITY))
            except (OSError, ImportError, ValueError, TypeError):
                pass  # no /proc (macOS): the time limit only
            try:
                out, code = pickle.dumps(fn()), 0
            except BaseException as e:  # noqa: BLE001 -- the parent reports it
                traceback.clear_frames(e.__traceback__)  # what it grew is freed before the report is built
                out = pickle.dumps(dict(error=f"{type(e).__name__}: {e}"))
            with os.fdopen(w, "wb") as f:
                f.write(out)
        finally:
            os._exit(code)
    os.close(w)
    import select
    data, t0, done = b"", time.monotonic(), False
    try:
        with os.fdopen(r, "rb") as f:
            while not done and select.select([f], [], [], max(0, seconds - time.monotonic() + t0))[0]:
                chunk = os.read(f.fileno(), 1 << 20)
                data, done = data + chunk, not chunk
    finally:  # past the time limit, or Ctrl-C here: the child is stopped
        done or os.kill(pid, 9)
        _, status = os.waitpid(pid, 0)
    if not done:
        return dict(error=f"it ran for more than {seconds} s (a loop that never ends?) and was stopped")
    if not data:
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        return dict(error=f"the grading process died (signal {sig}: out of memory?)" if sig else
                    f"the grading process exited with status {os.WEXITSTATUS(status)}")
    return pickle.loads(data)


def _lines(source, name) -> tuple:
    """(first, last): the lines of source that hold what the attendee writes of exercise name."""
    a, b, _ = span(source, name)
    return source[:a].count("\n") + 1, source[:max(b - 1, a)].count("\n") + 1


def _where(ex, failure, source, lesson_path, shift):
    """Who raised: ("yours", line in the attendee's copy) | ("lesson", function) | ("test", None)."""
    first, last = _lines(source, ex.name)
    mine = [f for f in failure["frames"] if f[0] == lesson_path]
    if not mine or os.path.dirname(failure["frames"][-1][0]) == os.path.join(ROOT, "tests"):
        return "test", None  # raised by a test (a check the lesson's code called back into, too)
    file, line, func, _ = mine[-1]
    if first <= line <= last:
        return "yours", line + shift
    return "lesson", (func, any(first <= n <= last for _, n, _, _ in mine))


def _at(ex, frames, source, lesson_path, shift, copy) -> str:
    """The last frames of a failure, each where a reader finds it: the attendee's copy, the lesson, or a test."""
    first, last = _lines(source, ex.name)
    ref_first, ref_last = _lines(reference(ex.stage), ex.name)
    out = []
    for f, n, fn, _ in [f for f in frames if f[0] == lesson_path or f[0].startswith(ROOT)
                        and "site-packages" not in f[0]][-4:]:  # a venv may live in ROOT
        if f != lesson_path:
            out.append(f"    {os.path.relpath(f, ROOT)}:{n} in {fn}")
        elif first <= n <= last:
            out.append(f"    {copy or 'your ' + ex.short}:{n + shift} in {fn}  (your {ex.short})")
        else:  # the lesson's code, below yours: moved by the lines yours has more than the lesson's
            n -= 0 if n < first else (last - first) - (ref_last - ref_first)
            out.append(f"    {LESSONS[ex.stage]}.py:{n} in {fn}  (the lesson's code)")
    return "\n".join(out)


def explain(ex, failure, source, lesson_path, shift=0, copy=None) -> tuple:
    """(the first line, the detail) of a failure: the exercise at fault and, in words, what went wrong."""
    kind, at = _where(ex, failure, source, lesson_path, shift)
    t, msg = failure["type"], failure["msg"].split("\n")[0]
    test, frames = _words(failure["test"]), failure["frames"]
    if t in ("AssertionError", "Failed") and kind == "test":
        what = msg or f"a check failed: `{frames[-1][3]}`"
    elif kind == "yours":
        what = f"your {ex.short} raised {t}: {msg} (line {at} of your copy)"
    elif kind == "lesson":
        func, called = at
        what = (f"the lesson's {func} found the state your {ex.short} left wrong: {msg}" if t == "AssertionError"
                else f"the lesson's {func}, {'called from' if called else 'after'} your {ex.short}, raised {t}: {msg}")
    else:
        what = f"the test could not use what your {ex.short} gave it: {t}: {msg}"
    where = _at(ex, frames, source, lesson_path, shift, copy)
    detail = f"  test: {test}" + (f" ({failure['doc']})" if failure["doc"] else "") + f"\n  at:\n{where}"
    return f"{ex.id} fails: {what}", detail


def grade_body(ex, text, shift=0, memory=MEMORY, copy=None) -> Grade:
    """Grade one exercise, text put into the lesson, in a child. shift: extra lines above it in the copy."""
    sys.path.insert(0, ROOT) if ROOT not in sys.path else None
    import llama3_generate  # noqa: F401 -- torch and what the lessons import, once for every child
    source, folder = splice(reference(ex.stage), {ex.name: text}), tempfile.mkdtemp(prefix="workshop-")
    t0 = time.monotonic()
    try:
        got = _isolated(lambda: _run_tests(ex.stage, source, ex.tests, folder), ex.seconds, memory)
        seconds = time.monotonic() - t0
        if "error" in got:
            return Grade("fails", f"{ex.id} fails: {got['error']}", "", seconds)
        if got["failure"]:
            why, detail = explain(ex, got["failure"], source, got["lesson"], shift, copy)
            return Grade("fails", why, detail, seconds, got["tests"])
        if got["rc"] != 0 or not any(o == "passed" for _, o in got["tests"]):
            log = pathlib.Path(folder, "log.txt").read_text().strip().splitlines()
            return Grade("fails", f"{ex.id} fails: its tests did not run (pytest exit {got['rc']}): "
                                  f"{log[-1] if log else ''}", "\n".join(log[-20:]), seconds, got["tests"])
        return Grade("passes", "", "", seconds, got["tests"])
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def grade_copy(ex, source, copy=None) -> Grade:
    """Grade ex as written in source (the attendee's copy of its lesson, at path copy)."""
    if is_stub(source, ex):
        return Grade("to do", f"{ex.id}: to do: {ex.idea}")
    a, b, _ = span(source, ex.name)
    shift = source[:a].count("\n") - reference(ex.stage)[:span(reference(ex.stage), ex.name)[0]].count("\n")
    return grade_body(ex, source[a:b], shift, copy=copy and os.path.relpath(copy))


class Mistake(Exception):
    """A mistake in an attendee's copy or command line, in one line: the commands exit 2, pytest a usage error."""


def copy_of(stage, folder) -> str:
    """The attendee's copy of the stage's lesson, which must parse and hold each exercise, else Mistake."""
    path = os.path.join(folder, LESSONS[stage] + ".py")
    src, rel = pathlib.Path(path).read_text(encoding="utf-8"), os.path.relpath(path)
    for e in [None, *exercises(stage)]:
        try:
            span(src, e.name) if e else compile(src, path, "exec")
        except SyntaxError as x:
            raise Mistake(f"{rel}, line {x.lineno}: {type(x).__name__}: {x.msg}; fix it, then grade again") from None
        except (StopIteration, AttributeError):
            raise Mistake(f"{rel} has no {e.name} any more (renamed or deleted?); `python tests/workshop.py start "
                          f"{stage} --force` starts it again (yours kept as .bak)") from None
    return src


def grade(stages, folder=WORKSPACE, say=None) -> dict:
    """{exercise: Grade} for every exercise of these stages in folder (not started: every one "not started")."""
    out = {}
    for s in stages:
        path = os.path.join(folder, LESSONS[s] + ".py")
        if not os.path.exists(path):
            out.update({e: Grade("not started") for e in exercises(s)})
            continue
        src = copy_of(s, folder)
        for e in exercises(s):
            out[e] = grade_copy(e, src, path)
            say and say(e, out[e])
    return out


# -------- pytest --workspace: one item per exercise, graded as progress grades it --------------------------------

class ExerciseFailed(Exception):
    pass


class ExerciseItem(pytest.Item):
    def __init__(self, *, exercise, grader, **kw):
        super().__init__(**kw)
        self.exercise, self.grader = exercise, grader

    def runtest(self):
        g = self.grader.grade(self.exercise)  # (one to do was skipped when collected)
        if g.status != "passes":
            raise ExerciseFailed(f"{g.why}\n{g.detail}\n  the idea: {self.exercise.idea}\n  stuck: python "
                                 f"tests/workshop.py hint {self.exercise.stage} {self.exercise.short}")

    def repr_failure(self, excinfo, style=None):
        return str(excinfo.value) if isinstance(excinfo.value, ExerciseFailed) else super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, 0, self.exercise.id


def stages_of(args) -> list:
    """The stages whose test files a pytest command line names (none named: every stage)."""
    named = sorted({s for a in args for s, t in TESTS.items() if os.path.basename(str(a).split("::")[0]) == t[6:]})
    return named or list(LESSONS)


class Grader:
    """pytest plugin (--workspace): a started stage's tests become one item per exercise, graded as progress does."""

    def __init__(self, config):
        self.folder = os.path.abspath(config.getoption("workspace_dir") or WORKSPACE)
        self.stages = [s for s in stages_of(config.args) if s in started(self.folder)]
        self.only = config.getoption("exercise") or []
        named = stages_of(config.args)
        for o in self.only:
            if not any(find(s, o) for s in named):
                raise pytest.UsageError(f"--exercise {o}: no such exercise in stage{'s' * (len(named) > 1)} "
                                       f"{', '.join(named)}; " + "; ".join(
                    f"{s}'s are {', '.join(e.short for e in exercises(s))}" for s in named if exercises(s)))
        try:
            self.copies = {s: copy_of(s, self.folder) for s in self.stages}
        except Mistake as e:
            raise pytest.UsageError(str(e)) from None
        self.grades, self.items, self.folded = {}, [], 0

    def grade(self, ex) -> Grade:
        if ex not in self.grades:
            self.grades[ex] = grade_copy(ex, self.copies[ex.stage],
                                         os.path.join(self.folder, LESSONS[ex.stage] + ".py"))
        return self.grades[ex]

    def pytest_report_header(self, config):
        where = os.path.relpath(self.folder, ROOT)
        return (f"workshop: grading stages {', '.join(self.stages)} from {where}/, each exercise alone"
                if self.stages else f"workshop: nothing started in {where}/ (python tests/workshop.py start 03): "
                                    "this run tests the reference lessons")

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, session, config, items):
        keep, dropped, added = [], [], {}
        for item in items:
            stage = next((s for s in self.stages if item.nodeid.split("::")[0].endswith(TESTS[s])), None)
            if stage is None:
                keep.append(item)
                continue
            dropped.append(item)
            if stage not in added:
                added[stage] = [ExerciseItem.from_parent(item.getparent(pytest.Module), name=e.name.replace('"', ""),
                                                         exercise=e, grader=self)
                                for e in exercises(stage) if not self.only or any(find(stage, o) is e
                                                                                  for o in self.only)]
                src = self.copies[stage]
                for it in added[stage]:
                    if is_stub(src, it.exercise):
                        it.add_marker(pytest.mark.skip(reason=f"{it.exercise.id}: to do"))
                keep += added[stage]
                self.items += added[stage]
        self.folded = len(dropped)  # not deselected: each grades an exercise, inside its item
        items[:] = keep

    def pytest_report_collectionfinish(self, config, start_path, items):
        if self.items:
            return (f"workshop: {self.folded} tests, one item per exercise they grade ({len(self.items)} here); "
                    f"{len(items)} items to run")

    def pytest_terminal_summary(self, terminalreporter):
        if not self.items:
            return
        terminalreporter.section("workshop")
        for ex, g in ((it.exercise, self.grades.get(it.exercise)) for it in self.items):
            status = g.status if g else "to do" if is_stub(self.copies[ex.stage], ex) else "not run"
            terminalreporter.line(f"  {status:8} {ex.id}")


# -------- the commands ------------------------------------------------------------------------------------

def start(stage, force=False, folder=WORKSPACE, say_next=True):
    path = os.path.join(folder, LESSONS[stage] + ".py")
    rel = os.path.relpath(path, ROOT)
    if os.path.exists(path) and not force:
        print(f"{rel} exists (your work): not overwritten; `start {stage} --force` starts it again "
              f"(the old copy is kept as {rel}.bak)")
        return 1
    os.makedirs(folder, exist_ok=True)
    if os.path.exists(path):
        shutil.copyfile(path, path + ".bak")
    src = stub(reference(stage), exercises(stage))
    pathlib.Path(path).write_text(src, encoding="utf-8")
    print(f"wrote {rel}: {len(exercises(stage))} exercises, each raising NotImplementedError until you write it")
    for line, e in sorted((src[:span(src, e.name)[0]].count("\n") + 1, e) for e in exercises(stage)):
        print(f"  line {line:4}  {e.name}: {e.idea}")
    if stage == "04":
        print("04's kernels run on a CPU through Triton's interpreter (TRITON_INTERPRET=1, set for you); Triton has "
              "Linux wheels only: on macOS or Windows do 04 on a Linux machine")
    say_next and print(
        f"next: open notebooks/{NOTEBOOKS[stage]} (the idea, its figure), write the functions in {rel}, and grade "
        f"them with\n  python -m pytest {TESTS[stage]} --workspace      (one: --exercise {exercises(stage)[0].short})"
        f"\n  python tests/workshop.py progress\nstuck: python tests/workshop.py hint {stage} "
        f"{exercises(stage)[0].short} (a question; --level 2: an example by hand), then `solution`")
    return 0


def progress(folder=WORKSPACE, as_json=False):
    """Every exercise's grade, each stage's count and the total; --json: one object for an instructor."""
    say = None if as_json else lambda e, g: print(f"  {e.stage}  {e.name:32} {g.status}" + (
        f"\n      {g.why.removeprefix(e.id + ' fails: ')}" if g.why and g.status == "fails" else ""), flush=True)
    grades = grade(list(LESSONS), folder, say)
    passed = sum(g.status == "passes" for g in grades.values())
    failed = int(any(g.status == "fails" for g in grades.values()))  # as pytest --workspace exits
    if as_json:
        print(json.dumps(dict(passed=passed, total=len(grades), exercises={
            e.id: dict(status=g.status, why=g.why) for e, g in grades.items()}), indent=1))
        return failed
    print()
    for s in LESSONS:
        mine = [g.status for e, g in grades.items() if e.stage == s]
        state = "not started" if mine[0] == "not started" else f"{mine.count('passes')} / {len(mine)} pass" + (
            f", {mine.count('fails')} fail" if "fails" in mine else "") + (
            f", {mine.count('to do')} to do" if "to do" in mine else "")
        print(f"stage {s} {LESSONS[s]:24} {state}")
    print(f"{passed} / {len(grades)} exercises")
    return failed


def hint(stage, name, level=1):
    """Hints in levels: 1 the idea as a question or a picture; 2 a small example worked by hand; then the solution."""
    e = find(stage, name)
    then = f"hint {stage} {e.short} --level 2" if level == 1 else f"solution {stage} {e.short}"
    text = (e.hint if level == 1 else e.example).replace("\n", "\n  ")
    print(f"{e.id}, hint {level} of 2:\n  {text}\nits tests check that {e.checks}\n"
          f"still stuck: python tests/workshop.py {then}")


def alternatives(stage) -> str | None:
    """tests/data/alternatives/<lesson>.py: each exercise written again, another right answer that must pass."""
    path = pathlib.Path(ALTERNATIVES, LESSONS[stage] + ".py")
    return path.read_text(encoding="utf-8") if path.exists() else None


def verifiable() -> list:
    """The stages verify grades here: those with exercises (04's need Triton, Linux only)."""
    return [s for s in LESSONS if exercises(s) and (s != "04" or importlib.util.find_spec("triton"))]


def verify(stages=None, say=print) -> list:
    """CI's proof that the grader grades, on the attendee's path: `start`, the lesson's bodies written into the
    copy, then `pytest --workspace` and `progress --json` (each a process, as an attendee runs it) pass every
    exercise; each mutant (each alternative) written into the copy fails in words, blamed on its exercise (passes),
    graded as both grade (grade_copy). Returns the problems (none: all well)."""
    import mutants
    stages, problems, folder = stages or verifiable(), [], tempfile.mkdtemp(prefix="workshop-verify-")
    path = lambda s: pathlib.Path(folder, LESSONS[s] + ".py")  # the attendee's copy
    for s in stages:
        with contextlib.redirect_stdout(None):
            start(s, folder=folder)
        ref, copy = reference(s), copy_of(s, folder)  # each exercise answered with the lesson's body:
        path(s).write_text(splice(copy, {e.name: ref[slice(*span(ref, e.name)[:2])] for e in exercises(s)}),
                           encoding="utf-8")
    run = lambda *a: subprocess.run([sys.executable, *a], cwd=ROOT, capture_output=True, text=True, env=dict(
        os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1"))  # no third-party plugins: a second saved
    tested = run("-m", "pytest", *(TESTS[s] for s in stages), "--workspace", "--workspace-dir", folder, "-rA")
    listed = json.loads(run("tests/workshop.py", "progress", "--json", "--dir", folder).stdout or "{}")
    for e in [e for s in stages for e in exercises(s)]:
        item = f"PASSED {TESTS[e.stage]}::{e.name}\n".replace('"', "")  # pytest's own outcome of its item
        got = ("passes" if item in tested.stdout else "fails", listed.get("exercises", {}).get(e.id, {}).get("status"))
        say(f"  {'ok ' if got == ('passes',) * 2 else 'BAD'} {e.id:34} the lesson's, pasted: pytest --workspace "
            f"{got[0]}, progress --json {got[1]}")
        problems += [f"{e.id}, the lesson's: {got}\n{tested.stdout[-3000:]}{tested.stderr}"] * (got != ("passes",) * 2)
    for s in stages:
        ref, alt, ems = reference(s), alternatives(s), mutants.of_exercises(s)
        cases = [(e, "alternative", t, "passes") for e in exercises(s)
                 if alt and (t := _written(alt, e, span(ref, e.name)[2])) is not None]
        cases += [(find(s, mu.exercise.name), f"mutant: {mu.what}", mu.body, "fails")
                  for mu in ems]  # find: mutants imports workshop, maybe a second copy
        problems += [f"{s}: mutant {mu.what!r} is stale: its snippet is not in {mu.where} exactly once"
                     if mutants.apply(ref, mu) is None else f"{s}: mutant {mu.what!r} lies in no exercise's body (no "
                     "attendee writes that code: it belongs in tests/code_mutants.py)" for mu in mutants.MUTANTS
                     if mutants.FILES[mu.stage] == LESSONS[s] + ".py" and mu.what not in {m.what for m in ems}]
        for e, what, text, want in cases:
            path(s).write_text(splice(ref, {e.name: text}), encoding="utf-8")  # the lesson, this body pasted
            g = grade_copy(e, copy_of(s, folder), str(path(s)))
            bad = bool(g.status != want or want == "fails" and (not g.why.startswith(e.id + " fails: ") or bare(g.why)
                                                           or undescribed(g.why, g.detail)))
            say(f"  {'ok ' if not bad else 'BAD'} {g.seconds:4.1f} s  {e.id:34} {what[:70]}: {g.status}" +
                (f"\n        {g.why}" if bad or want == "fails" else ""))
            problems += [f"{e.id} ({what}): {g.status}, want {want}\n{g.why}\n{g.detail}"] * bad
    shutil.rmtree(folder, ignore_errors=True)
    return problems


def bare(why: str) -> bool:
    """A failure not in words: a bare assert, values alone (`('ab', 'c')`, `0 > 0`), torch's "not close"."""
    text = words = why.split(" fails: ", 1)[-1]
    while (shorter := re.sub(r"\([^()]*\)|\[[^\[\]]*\]|\{[^{}]*\}", " ", words)) != words:
        words = shorter  # what lies outside brackets
    return (text.startswith("a check failed: ") or len(re.findall(r"[A-Za-z]{3,}", words)) < 3
            or "are not close" in text or "are not equal" in text)


def undescribed(why: str, detail: str) -> list:
    """What a failure's message shows of its input ("of N blocks", a tree) that its `test:` line does not."""
    test, shown = detail.split("\n")[0], [f"{n} blocks" for n in re.findall(r"of (\d+) blocks", why)]
    return [x for x in shown + re.findall(r"tree (\[[\d ]*\] -> \{[^}]*\})", why) if x not in test]


def _written(source, e, indent):
    """What source writes of e, re-indented to indent (the lesson's); None where it does not write e."""
    try:
        a, b, own = span(source, e.name)
    except StopIteration:
        return None
    return source[a:b] if own is None else "".join(" " * indent + line[own:] if line.strip() else line
                                                   for line in source[a:b].splitlines(True))


# -------- the notebooks' questions ------------------------------------------------------------------------
# (each question's truth, why and tempting answers: tests/questions.py, out of the notebook the attendee reads)

WITHHELD = "(withheld: this output answers a question above; run the cell once you have answered)\n"

def your_turn(stage) -> str:
    """The "Your turn" cell that ends the stage's notebook (`python tests/workshop.py notebooks` writes them)."""
    name, test = LESSONS[stage], TESTS[stage]
    rows = "\n".join(f"| `{e.name}` | {e.idea} | {e.checks} |" for e in exercises(stage))
    triton = ("\n\nOn a CPU the kernels run in Triton's interpreter (`TRITON_INTERPRET=1`, set for you); Triton has "
              "Linux wheels only, so on macOS or Windows do this stage on a Linux machine.") if stage == "04" else ""
    first = exercises(stage)[0].short
    return f"""## Your turn

Write this lesson's idea yourself, from this notebook: `python tests/workshop.py start {stage}` writes
`workspace/{name}.py` (git ignores it) with these bodies cut out; each docstring there is the contract.

| exercise | the idea, and what to watch for | graded: its tests check that |
|---|---|---|
{rows}

Write them in `workspace/{name}.py`, then grade them (each alone: the lesson's code stands in for the others):

    python -m pytest {test} --workspace    # one: --exercise {first}; a failure says which and why
    python tests/workshop.py progress    # every stage, and your score
    python tests/workshop.py hint {stage} {first}    # stuck: a question; --level 2 an example; `solution` last

When they pass, read `{name}.py` as the reference and run it. `WORKSHOP=1 jupyter lab` runs this notebook on
your copy (its first cell then imports `workspace/{name}.py`); its questions are still answered from the lesson,
and a check says where your copy gives another value.{triton}"""


def write_notebooks():
    """Each notebook's "Your turn" cell, and the outputs that answer a question withheld (cells tagged answers)."""
    import nbformat
    for stage, name in LESSONS.items():
        path = os.path.join(ROOT, "notebooks", NOTEBOOKS[stage])
        nb = nbformat.read(path, as_version=4)
        ours = nb.cells[-1].source.startswith("## Your turn")
        cell = nbformat.v4.new_markdown_cell(your_turn(stage), **({"id": nb.cells[-1].id} if ours else {}))
        nb.cells[-1:] = [cell] if ours else [nb.cells[-1], cell]
        for c in nb.cells:
            if "answers" in c.metadata.get("tags", []):  # its output answers a question: shown once run
                c.outputs = [nbformat.v4.new_output("stream", text=WITHHELD)]
        nbformat.write(nb, path)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage: `-h` shows it
        raise Mistake(message)


def main(argv=None):
    ap = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("start", help="write workspace/<lesson>.py with the stage's exercises to do")
    st.add_argument("stage", help="01 .. 07, or all")
    st.add_argument("--force", action="store_true", help="start again (your copy is kept as .bak)")
    pr = sub.add_parser("progress", help="every exercise's grade and the score")
    pr.add_argument("--json", action="store_true", help="one JSON object (an instructor collecting a room's)")
    for p in (st, pr):
        p.add_argument("--dir", default=WORKSPACE, help="the workspace folder (default: workspace/)")
    sub.add_parser("list", help="every exercise, its idea and the tests that grade it")
    for cmd, text in (("hint", "stuck: the idea as a question (--level 2: a small example worked by hand)"),
                      ("solution", "the lesson's body of an exercise (stuck after the hint? read it, then write "
                                   "yours)")):
        p = sub.add_parser(cmd, help=text)
        p.add_argument("stage")
        p.add_argument("name", help="TokenAllocator.alloc, or alloc")
        cmd == "hint" and p.add_argument("--level", type=int, choices=(1, 2), default=1)
    sub.add_parser("notebooks", help="(maintainers) rewrite each lesson notebook's last cell, \"Your turn\"")
    ve = sub.add_parser("verify", help="(CI) the lesson passes; each mutant fails, blamed on its exercise; each "
                                       "alternative passes")
    ve.add_argument("stages", nargs="*")
    a = ap.parse_args(argv)
    if a.cmd == "start":
        stages = [s for s in LESSONS if exercises(s)] if a.stage == "all" else [a.stage.zfill(2)]
        if any(s not in LESSONS for s in stages):
            ap.error(f"no stage {a.stage!r}: choose from {', '.join(LESSONS)} or all")
        rc = max(start(s, a.force, a.dir, say_next=len(stages) == 1) for s in stages)
        if len(stages) > 1:
            print("next, stage by stage: open its notebook, write its functions in "
                  f"{os.path.relpath(a.dir)}/, grade them with\n  python -m pytest tests/test_0N_....py "
                  "--workspace\n  python tests/workshop.py progress\nthen read the lesson and run it")
        return rc
    if a.cmd == "progress":
        return progress(a.dir, a.json)
    if a.cmd in ("hint", "solution"):
        e = find(a.stage.zfill(2), a.name) if a.stage.zfill(2) in LESSONS else None
        if e is None:
            near = difflib.get_close_matches(a.name, [x.short for x in exercises(a.stage.zfill(2))], 1)
            ap.error(f"no exercise {a.name!r} in stage {a.stage}{f'; did you mean {near[0]}?' * bool(near)} "
                     "(`python tests/workshop.py list` lists them)")
        if a.cmd == "hint":
            return hint(e.stage, e.name, a.level)
        return print(body(reference(e.stage), e.name).rstrip("\n"))
    if a.cmd == "notebooks":
        return write_notebooks()
    if a.cmd == "verify":
        t0, problems = time.monotonic(), verify(a.stages)
        print("\n\n".join(problems) or f"every exercise is graded ({time.monotonic() - t0:.0f} s)")
        return int(bool(problems))
    for e in EXERCISES:  # as the command line takes them: hint 05 lpm
        print(f"{e.stage} {e.short}{f' ({e.name})' * ('.' in e.name)}: {e.idea}\n    checks: {e.checks}\n    "
              f"graded by: {', '.join(e.tests)}")


if __name__ == "__main__":
    try:
        rc = main()
        sys.stdout.flush()  # here, so that a closed pipe raises where it is caught
    except (Mistake, KeyboardInterrupt) as e:  # one line: the mistake (exit 2), or Ctrl-C (130, as a shell's)
        rc = 2 if str(e) else 130
        print(f"workshop: {str(e) or 'stopped (Ctrl-C)'}", file=sys.stderr)
    except BrokenPipeError:  # `... | head` stopped reading: stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        rc = 141
    sys.exit(rc)
