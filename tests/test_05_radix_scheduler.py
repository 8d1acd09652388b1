"""05: radix tree against a brute-force prefix dictionary, eviction/locking invariants, the scheduler's DFS claim,
and the real model producing the same tokens with and without the prefix cache."""
import importlib
import itertools
import json
import random

import numpy as np
import pytest
import torch
from helpers import kv_less, refuses, tiny_model

R = importlib.import_module("05_radix_scheduler")
T = importlib.import_module("03_token_allocator")
P02 = importlib.import_module("02_paged_cache_manager")


class Brute:
    """Every cached prefix of whole pages (tuple) -> the slots of its last page: a radix tree, uncompressed."""

    def __init__(self, page=1):
        self.slot, self.page = {}, page

    def lcp(self, seq):
        n = 0
        while n + self.page <= len(seq) and tuple(seq[:n + self.page]) in self.slot:
            n += self.page
        return n

    def insert(self, seq, slots):
        n, P = self.lcp(seq), self.page
        for i in range(n, len(seq) // P * P, P):
            self.slot[tuple(seq[:i + P])] = tuple(slots[i:i + P])
        return n

    def match(self, seq, compute_last=True):
        k = self.lcp(seq[:len(seq) - 1] if compute_last else seq)
        return [x for i in range(self.page, k + 1, self.page) for x in self.slot[tuple(seq[:i])]]

    def keep(self, live):
        """Drop the prefixes whose slots were freed; what remains must still be closed under taking prefixes."""
        self.slot = {k: s for k, s in self.slot.items() if s[0] in live}
        assert all(len(k) == self.page or k[:-self.page] in self.slot for k in self.slot), "a hole in a path"

    def tokens(self):
        return len(self.slot) * self.page


def live_slots(alloc, page=1):
    """Slots in use: 03's referenced slots, or every slot of 02's referenced blocks."""
    return {b * page + i for b in torch.nonzero(alloc.mem_state).flatten().tolist() for i in range(page)}


def random_seq(rng, vocab, lo=1, hi=24):
    return [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))]


def insert_new(tree, kv, seq):
    """What a finished request does: its own slots, insert, then drop its references (duplicates are freed)."""
    kv.prepare(["new"], [len(seq)])
    slots = kv.slots("new")
    n = tree.insert(seq, slots)
    kv.free("new")
    return n, slots


@pytest.mark.parametrize("page", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_match_insert_evict_lock_vs_brute_force(seed, page):
    """Pages of 1 (03's slots) and of 2 and 4 tokens (02's blocks): after every random op the tree answers as the
    brute-force dictionary, evicts exactly the slots it says, and refcounts + free count add up (check)."""
    rng = random.Random(seed * 7 + page)
    vocab = rng.choice([2, 3, 5])  # tiny vocabularies: lots of shared prefixes and mid-edge splits
    kv = kv_less(page, 600)
    alloc = kv.allocator
    tree, brute, seqs, locks, longest = R.RadixCache(alloc, page), Brute(page), [], [], 0
    for op in range(500):
        kind = rng.random()
        if kind < 0.4 and alloc.available() * page >= 24 + page:
            seq = random_seq(rng, vocab)
            n, slots = insert_new(tree, kv, seq)
            want = brute.insert(seq, slots.tolist())
            assert n == want, f"op {op}: insert({seq}) with pages of {page} returned {n}; {want} tokens were cached"
            seqs.append(seq)
        elif kind < 0.7:
            seq = rng.choice(seqs) + random_seq(rng, vocab, 0, 4) if seqs and rng.random() < 0.7 else random_seq(rng, vocab)
            compute_last = rng.random() < 0.7
            slots, node = tree.match_prefix(seq, compute_last)
            want = brute.match(seq, compute_last)
            assert slots.tolist() == want, (f"op {op}: match_prefix({seq}, compute_last={compute_last}) with pages "
                                            f"of {page} returned slots {slots.tolist()}; a brute-force list of the "
                                            f"cached prefixes says {want}")
            longest = max(longest, len(want))
            assert len(want) <= len(seq) - compute_last, "the brute force left no token to compute"
            if rng.random() < 0.3 and want:  # lock it, like a running request
                before, delta = tree.protected_size(), tree.inc_lock_ref(node)
                assert tree.protected_size() - before == -delta, (
                    f"inc_lock_ref returned {delta} (evictable tokens it changed); protected_size grew by "
                    f"{tree.protected_size() - before}")
                locks.append((node, [tuple(seq[:i]) for i in range(page, len(want) + 1, page)]))
        elif kind < 0.8 and locks:
            node, _ = locks.pop(rng.randrange(len(locks)))
            tree.dec_lock_ref(node)
        elif rng.random() < 0.5:  # (half the time: the tree grows deep enough to match several pages)
            n = rng.randint(1, 80)
            before, evictable = live_slots(alloc, page), tree.evictable_size()
            freed, after = tree.evict(n), live_slots(alloc, page)
            assert after <= before and len(before - after) == freed, (
                f"op {op}: evict({n}) said it freed {freed} tokens; {len(before - after)} slots came back")
            assert freed >= min(n, evictable) and (freed >= n or tree.evictable_size() == 0), (
                f"op {op}: evict({n}) freed {freed} of {evictable} evictable tokens; want at least {min(n, evictable)}")
            brute.keep(after)
        locked = {p for _, ps in locks for p in ps}
        assert all(p in brute.slot for p in locked), f"op {op}: a locked prefix was evicted"
        assert tree.protected_size() == len(locked) * page, (
            f"op {op}: the tree counts {tree.protected_size()} locked tokens; {len(locked) * page} are")
        assert tree.evictable_size() + tree.protected_size() == brute.tokens(), (
            f"op {op}: the tree counts {tree.evictable_size() + tree.protected_size()} tokens; it holds "
            f"{brute.tokens()}")
        tree.check()  # integrity after every op: refcounts == tree, tree + free == pool
    free = alloc.available() * page
    assert free + brute.tokens() == alloc.size * page, (f"the pool has {free} free slots and the tree should hold "
                                                        f"{brute.tokens()}: {alloc.size * page} in all")
    assert longest >= 3 * page, "no prefix of several pages was ever matched (the test's own inputs)"
    for node, _ in locks:
        tree.dec_lock_ref(node)
    tree.evict(10**9)
    assert alloc.available() == alloc.size, (f"after evicting everything unlocked, {alloc.available()} of "
                                             f"{alloc.size} pages are free")
    assert tree.evictable_size() == tree.protected_size() == 0, (
        f"an empty tree says {tree.evictable_size()} evictable and {tree.protected_size()} protected tokens")


def test_split_lru_order_and_pretty_print():
    kv = kv_less(1, 64)
    alloc = kv.allocator
    tree = R.RadixCache(alloc)
    insert_new(tree, kv, [1, 2, 3, 4, 5])
    _, b = insert_new(tree, kv, [7, 8, 9])
    insert_new(tree, kv, [6, 6])
    slots, node = tree.match_prefix([1, 2, 3, 9])  # ends inside the edge [1..5]: split it
    assert node.key == (1, 2, 3) and len(slots) == 3 and node.children[4].key == (4, 5)
    text = tree.pretty_print()
    assert "[1 2 3] len=3" in text and "[4 5] len=2" in text and "[7 8 9]" in text
    assert tree.match_prefix([1, 2, 3, 4, 5])[0].numel() == 4  # at most len - 1 tokens (splits [4 5] again)
    assert tree.evict(1) == 1  # [5]: matched by nobody since its insert, the least recently used leaf
    assert tree.match_prefix([1, 2, 3, 4, 5, 0])[0].numel() == 4
    free_before = alloc.available()
    assert tree.evict(1) == 3  # then [7 8 9]: inserted before [6 6], never matched since
    assert alloc.available() == free_before + 3 and all(alloc.mem_state[b] == 0)
    assert tree.match_prefix([7, 8, 9, 0])[0].numel() == 0
    tree.check()


def small_shared_prefix(seed=0, groups=6, per_group=6, prefix=48, question=6, output=5):
    return R.shared_prefix_workload(np.random.default_rng(seed), groups, per_group, prefix, question, output)


@pytest.mark.parametrize("policy", list(R.POLICIES))
def test_scheduler_integrity_every_step(policy):
    """Continuous batching with eviction: after every step, refcounts == tree + running rows, nothing leaks."""
    rng = np.random.default_rng(3)
    for reqs in (small_shared_prefix(), R.chat_workload(rng, chats=4, turns=3, system=16, user=6, output=5),
                 R.tot_workload(rng, problems=2, branch=2, depth=3, question=20, thought=6, hint=3)):
        longest = max(len(p) + len(o) - 1 for p, o, _ in reqs)
        for pool in (longest, 3 * longest):
            res = R.simulate(reqs, pool, policy, max_running=4, check=True)
            assert res["prompt_tokens"] == sum(len(p) for p, _, _ in reqs)
            assert res["prefill_tokens"] >= R.optimal_prefill(reqs)  # nobody beats the lower bound


@pytest.mark.parametrize("policy", list(R.POLICIES))
def test_whole_cached_prompt_fits_a_pool_it_fits_alone(policy):
    """Issue 22: a prompt the tree holds whole recomputes its last token in a pool it fits alone, stranding no slot."""
    R.simulate([([1], [100], None), ([1], [110, 111], None)], 2, policy, check=True)


@pytest.mark.parametrize("policy", list(R.POLICIES))
def test_random_workloads_finish_in_a_pool_the_largest_fits(policy):
    """Random workloads (shared prefixes, repeats, follow-ups) finish in a pool the largest request fits alone."""
    rng = np.random.default_rng()
    for _ in range(30):
        reqs = []
        for i in range(int(rng.integers(1, 8))):
            prompt = rng.integers(0, 3, int(rng.integers(1, 6))).tolist()
            j = int(rng.integers(len(reqs))) if reqs and rng.random() < 0.3 else None  # a follow-up of request j
            prompt = prompt if j is None else reqs[j][0] + reqs[j][1] + prompt  # its prompt + output + more
            reqs.append((prompt, rng.integers(0, 3, int(rng.integers(1, 5))).tolist(), j))
        pool = max(len(p) + len(o) - 1 for p, o, _ in reqs)
        res = R.simulate(reqs, pool, policy, max_running=int(rng.integers(1, 5)), check=True)
        assert res["prompt_tokens"] == sum(len(p) for p, _, _ in reqs), reqs


def prefixes(tokens, h=0):
    """An id of each prefix of the tokens following a prefix of id h (a chained hash: linear time)."""
    return list(itertools.accumulate(tokens, lambda h, t: hash((h, t)), initial=h))[1:]


STOP = -1  # the stop id of early-stopping outputs (workload tokens are >= 0)


def run_checking_every_slot(reqs, pool, policy, max_running, page=1, max_new_tokens=None, arrive=None, **options):
    """Schedule reqs [(prompt, output, after)] over a KV-less pool, checking after every step each slot's KV (a
    brute-force picture), refcounts and chunk budgets. max_new_tokens: default each output's length; arrive: steps."""
    max_new_tokens = max_new_tokens or [len(o) for _, o, _ in reqs]
    longest = max(len(p) + n - 1 for (p, _, _), n in zip(reqs, max_new_tokens))
    kv = kv_less(page, pool * page, max_running, longest)
    s = R.Scheduler(kv, policy, max_running, seed=int(np.random.default_rng().integers(1 << 30)), **options)
    made, arrive, s.beside = [], arrive or [0] * len(reqs), 0

    def arrivals():
        for (prompt, out, after), n in list(zip(reqs, max_new_tokens))[len(made):]:
            if arrive[len(made)] > s.stats["steps"]:
                break
            made.append(s.add(prompt, n, target=out, after=None if after is None else made[after], stop_ids=(STOP,)))
    arrivals()
    by_row, written, admit, ids = {}, {}, s.admit, {}  # ids: rid -> its tokens' prefix ids so far

    def prefix_ids(r, n):
        have = ids.setdefault(r.rid, [])
        have += prefixes(r.tokens[len(have):n], have[-1] if have else 0)
        return have[:n]

    part = None  # the prompt part-way in when the step began

    def admit_checked():  # a sibling waits for its first sample's prefill; a follow-up for the request it follows
        nonlocal part
        part = s.chunked if s.chunked is not None and s.chunked.chunk is not None else None
        new = admit()
        assert all(r.after is None or r.after.done or (r.prompt == r.after.prompt and r.after.kv_len >= len(r.prompt))
                   for r in new)
        return new
    s.admit = admit_checked
    prepare = s.prepare

    def prepare_checked(batch):  # prefill-first: admission counted the room, so nothing it let in is held back
        asked = list(batch)
        decode = sum(r in s.running for r in asked)
        budget = s.chunk_tokens and max(1, s.chunk_tokens - (decode if s.mixed else 0))  # prefill tokens a step
        assert not budget or sum(r.n_new for r in asked) - decode <= budget, "over the step's budget"
        assert part is None or part in asked and part.n_new >= min(part.missing, -(-budget // 2)) or (
            (not s.mixed or s.held) and batch is s.running), "starved"  # (a decode step between its chunks:
        # prefill-first; mixed while requests wait for KV)
        s.beside += part is not None and part.chunk is not None and any(r is not part and r not in s.running
                                                                        for r in asked)  # beside its next chunk
        out, positions = prepare(batch)
        assert s.mixed or s.chunk_tokens or batch is s.running or out == asked, "admitted, then held back"  # chunks:
        # decode steps between them grow the running ones
        return out, positions
    s.prepare = prepare_checked

    def forward(batch, tokens, positions):  # what a model would write: the KV of tokens[:position + 1]
        by_row.update({row: r for r in made if r.in_kv for row in [kv.rows.get(r.rid)] if row is not None})
        rows, starts, ns = kv.batch
        slots, t = kv.tok_slots.tolist(), 0
        next_ids = []
        for row, start, n in zip(rows, starts, ns):
            r = by_row[row]
            assert r.tokens[start:start + n] == tokens[t:t + n]
            for i, h in enumerate(prefix_ids(r, start + n)[start:]):
                written[slots[t + i]] = h
            t += n
            next_ids.append(r.target[len(r.output)])
        return next_ids

    def check():
        s.check()
        if s.chunked:  # its chunks are in the tree as they are computed, under its lock (which may lie deeper: a
            r = s.chunked  # preempted request recomputing its output matched some of that output in the tree)
            locked = tuple(path(r.node))
            least = min(r.kv_len, len(r.prompt)) // page * page  # pages: its full pages only
            assert locked == tuple(r.tokens[:len(locked)]) and least <= len(locked) <= r.kv_len
        for r in s.running + ([s.chunked] if s.chunked else []):
            assert [written[x] for x in kv.slots(r.rid)[:r.kv_len].tolist()] == prefix_ids(r, r.kv_len), r.rid
        stack = [(s.tree.root, 0)]
        while stack:
            node, h = stack.pop()
            for c in node.children.values():
                want = prefixes(c.key, h)
                assert [written[x] for x in c.value.tolist()] == want
                stack.append((c, want[-1]))
    while s.waiting or s.running or s.chunked or len(made) < len(reqs):
        s.step(forward) if s.busy else s.stats.update(steps=s.stats["steps"] + 1)  # nothing to do: time passes
        check()
        arrivals()
    assert [r.output for r in made] == [o for _, o, _ in reqs]
    assert kv.allocator.available() * page + s.tree.evictable_size() == pool * page
    return s


def random_workload(rng, n_max=8, vocab=3, prompt_max=6):
    """Prompts of few tokens (shared prefixes, repeats, nesting), n > 1 siblings and follow-ups."""
    reqs = []
    for _ in range(int(rng.integers(1, n_max))):
        out = rng.integers(0, vocab, int(rng.integers(1, 6))).tolist()
        kind = rng.random() if reqs else 1.0
        j = int(rng.integers(len(reqs))) if reqs else None
        if kind < 0.25:
            reqs.append((list(reqs[j][0]), out, j))  # a sibling sample of request j's prompt
        elif kind < 0.45:
            reqs.append((reqs[j][0] + reqs[j][1] + rng.integers(0, vocab, int(rng.integers(1, 4))).tolist(), out, j))
        else:
            reqs.append((rng.integers(0, vocab, int(rng.integers(1, prompt_max + 1))).tolist(), out, None))
    return reqs


def random_runs(trials, **workload):
    """trials random workloads (random_workload's kw) from a fresh seed: rng, reqs, their longest's tokens, a policy."""
    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 30)))
    for _ in range(trials):
        reqs = random_workload(rng, **workload)
        policy = list(R.POLICIES)[int(rng.integers(len(R.POLICIES)))]
        yield rng, reqs, max(len(p) + len(o) - 1 for p, o, _ in reqs), policy


@pytest.mark.parametrize("reserve,mixed,chunked", [(True, True, False), (False, False, False), (False, True, False),
                                                   (True, True, True), (False, False, True), (False, True, True)],
                         ids=["paper", "engine", "preempt-mixed", "paper-chunked", "engine-chunked", "mixed-chunked"])
def test_scheduler_options_keep_every_slot_right(reserve, mixed, chunked):
    """The paper's scheduler and the engine's keep every slot right on random workloads, chunked or not."""
    totals = dict(preemptions=0, cached_tokens=0, cut=0, cut_preempted=0)
    for rng, reqs, longest, policy in random_runs(200 if chunked else 40, prompt_max=12 if chunked else 6):
        chunk = dict(chunk_tokens=int(rng.integers(1, 7))) if chunked else {}
        s = run_checking_every_slot(reqs, longest + int(rng.integers(0, 4)), policy, int(rng.integers(1, 5)),
                                    reserve=reserve, mixed=mixed, max_prefill_tokens=int(rng.integers(4, 16)), **chunk)
        for k in ("preemptions", "cached_tokens"):
            totals[k] += s.stats[k]
        fed = {}  # rid -> tokens computed since its admission; a prefill short of the whole is a cut
        for e in s.events:
            if e.kind == "admit":
                fed[e.rid] = e.tokens
            elif e.kind == "prefill":  # (a request's id is its index in reqs)
                fed[e.rid] += e.tokens
                totals["cut"] += fed[e.rid] < len(reqs[e.rid][0])
            elif e.kind in ("preempt", "hold_back"):
                totals["cut_preempted"] += 0 < fed.get(e.rid, 0) < len(reqs[e.rid][0])
                fed[e.rid] = 0
    assert totals["cached_tokens"] > 0
    assert (totals["preemptions"] > 0) != reserve  # reserving up front never preempts; the engine's way does
    assert (totals["cut"] > 0) == chunked
    cut_preempted = totals["cut_preempted"] > 0  # decodes outgrow the pool (prefill-first: between chunks, at times)
    assert cut_preempted if chunked and mixed and not reserve else cut_preempted <= (chunked and not reserve)


@pytest.mark.parametrize("mixed", [False, True], ids=["prefill-first", "mixed"])
def test_prompts_arriving_behind_a_chunked_one_go_in_beside_it(mixed):
    """Random arrivals into chunked steps: every slot right, and prompts behind a chunked one go in beside it."""
    beside = 0
    for rng, reqs, longest, policy in random_runs(80, prompt_max=24):
        arrive = sorted(rng.integers(0, 12, len(reqs)).tolist())
        s = run_checking_every_slot(reqs, 2 * longest + int(rng.integers(0, 8)), policy, int(rng.integers(2, 6)),
                                    arrive=arrive, reserve=[False, "expected"][int(rng.integers(2))], mixed=mixed,
                                    chunk_tokens=int(rng.integers(2, 13)))
        beside += s.beside
    assert beside > 0


@pytest.mark.parametrize("page", [2, 4])
@pytest.mark.parametrize("reserve,mixed,chunked", [(True, True, False), (False, False, False), (False, True, True)],
                         ids=["paper", "engine", "mixed-chunked"])
def test_paged_tree_keeps_every_slot_right(page, reserve, mixed, chunked):
    """The same brute-force check over 02's blocks, the tree keyed by pages: every slot right; hits are whole pages."""
    cached = pages = 0
    for rng, reqs, longest, policy in random_runs(60, vocab=2, prompt_max=12):
        blocks = -(-longest // page) + int(rng.integers(0, 4))
        chunk = dict(chunk_tokens=int(rng.integers(1, 7))) if chunked else {}
        s = run_checking_every_slot(reqs, blocks, policy, int(rng.integers(1, 5)), page=page, reserve=reserve,
                                    mixed=mixed, max_prefill_tokens=int(rng.integers(4, 16)), **chunk)
        cached += s.stats["cached_tokens"]
        pages += sum(e.tokens % page for e in s.events if e.kind == "admit")  # a hit is whole pages
    assert cached > 0 and pages == 0


def admission_workload(rng, n, hi, early):
    """n requests of the engine benchmark's shape opening with one of two shared heads; early: random stops."""
    heads = [rng.integers(0, 50, hi // 2).tolist() for _ in range(2)]
    reqs, max_new_tokens = [], []
    for _ in range(n):
        p, m = rng.integers(hi // 8, hi + 1, 2).tolist()
        prompt = (heads[int(rng.integers(2))][:int(rng.integers(0, p))] + rng.integers(0, 50, p).tolist())[:p]
        out = rng.integers(0, 50, int(rng.integers(1, m + 1)) if early else m).tolist()
        reqs.append((prompt, out + [STOP] if len(out) < m else out, None))
        max_new_tokens.append(m)
    return reqs, max_new_tokens


@pytest.mark.parametrize("page,hi,n,share", [(1, 40, 48, 0.4), (16, 96, 32, 0.4), (256, 320, 32, 0.25)])
def test_look_ahead_admission_keeps_every_slot_right_and_rarely_preempts(page, hi, n, share):
    """Look-ahead admission keeps every slot right, holds nothing back, and preempts at most twice, <= fits-now."""
    seed = int(np.random.default_rng().integers(1 << 30))
    rng, preempted = np.random.default_rng(seed), {}
    for early in (False, True):
        reqs, max_new_tokens = admission_workload(rng, n, hi, early)
        pool = -(-max(int(share * sum(len(p) + m for (p, _, _), m in zip(reqs, max_new_tokens))),
                      2 * hi) // page)
        for reserve in (False, "expected"):
            s = run_checking_every_slot(reqs, pool, "lpm", n, page=page, reserve=reserve,
                                        mixed=False, max_new_tokens=max_new_tokens)
            preempted[early, reserve] = s.stats["preemptions"]
            assert not any(e.kind == "hold_back" for e in s.events)
            assert s.seen[0] / s.seen[1] == 1 if not early else s.seen[0] / s.seen[1] < 1  # fits_ahead's ratio
    assert preempted[False, "expected"] <= min(2, preempted[False, False]), (seed, preempted)  # (fits now: 2 at least
    # on most draws; a few draws preempt less)


@pytest.mark.parametrize("page", [1, 3, 16])
def test_fits_ahead_vs_a_step_by_step_model(page):
    """fits_ahead's running sum equals the step-by-step model it folds (each request's pages at each future step)."""
    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 30)))
    for _ in range(150):
        n_run, n_new = int(rng.integers(0, 12)), int(rng.integers(1, 4))
        reqs = [R.Req(k, [1] * int(rng.integers(1, 40)), int(rng.integers(1, 30))) for k in range(n_run + n_new)]
        for r in reqs[:n_run]:
            r.output = [2] * int(rng.integers(0, r.max_new_tokens))
        seen = np.array([rng.uniform(0.1, 1) * (k := int(rng.integers(1, 5))), k]) if rng.random() < 0.7 else None
        ratio = 1 if seen is None else seen[0] / seen[1]
        ends = [max(1, int(ratio * (r.max_new_tokens - len(r.output)) + 0.999)) for r in reqs]
        held = [len(r.tokens) + (k >= n_run) for k, r in enumerate(reqs)]
        peak = max(sum(-(-(h + s) // page) * page for h, e in zip(held, ends) if s < e) for s in range(max(ends)))
        for blocks in {peak // page - 1, peak // page, peak // page + 1} - {0}:
            s = R.Scheduler(kv_less(page, blocks * page), reserve="expected")
            s.running, s.seen = reqs[:n_run], s.seen if seen is None else seen
            rows = np.concatenate([s.expected(s.running), s.expected(reqs[n_run:], ahead=1)])
            assert s.fits_ahead(rows) == (peak <= blocks * page)


def test_lpm_never_worse_than_fcfs_and_reaches_the_bound():
    reqs = small_shared_prefix(seed=1)
    c_min = R.optimal_prefill(reqs)
    assert c_min == 6 * 48 + 36 * 6  # prefixes once + every question (random tokens: no accidental sharing here)
    longest = max(len(p) + len(o) - 1 for p, o, _ in reqs)
    for pool in (longest, 2 * longest, 4 * longest, 8 * longest, 40 * longest):
        for running in (1, 4):
            lpm = R.simulate(reqs, pool, "lpm", max_running=running)["prefill_tokens"]
            assert lpm <= R.simulate(reqs, pool, "fcfs", max_running=running)["prefill_tokens"], (pool, running)
    # the DFS claim: one request at a time, a cache that holds the longest path -> every edge computed once
    assert R.simulate(reqs, longest, "lpm", max_running=1)["prefill_tokens"] == c_min
    assert R.simulate(reqs, 40 * longest, "lpm", max_running=8)["prefill_tokens"] == c_min
    assert R.simulate(reqs, longest, "fcfs", max_running=1)["prefill_tokens"] > c_min  # shuffled: fcfs thrashes


def test_optimal_prefill_counts_decoded_tokens_as_cached():
    reqs = R.chat_workload(np.random.default_rng(0), chats=3, turns=2, system=10, user=4, output=5)
    # each chat: turn 1 prompt (4 new) + turn 2 adds the answer's last token and 4 new; the system prompt once
    assert R.optimal_prefill(reqs) == 10 + 3 * (4 + 1 + 4)


def test_bad_input():
    kv = T.TokenKVCache(1, 32, 1, 1, 4, 32)
    refuses(ValueError, R.Scheduler, kv, "lifo", match="unknown policy")
    s = R.Scheduler(kv, "lpm")
    refuses(ValueError, s.add, list(range(30)), 8, match="cannot fit")
    refuses(ValueError, s.add, [], 4, match="cannot fit")
    refuses(SystemExit, R.main, ["--workload", "nope"])


def test_cli_json(capsys):
    out, printed = R.main(["--workload", "tree-of-thought", "--json"]), json.loads(capsys.readouterr().out)
    w = printed["workloads"]["tree-of-thought"]
    assert set(w["hit_rate"]) == set(R.POLICIES) and 0 < w["optimal_hit_rate"] < 1
    assert all(0 <= h <= w["optimal_hit_rate"] + 1e-12 for h in w["hit_rate"].values())
    assert printed["lpm_of_optimal_mean"] == out["lpm_of_optimal_mean"]
    c = printed["chunking"]  # the chunked-prefill timeline: what each schedule does to the decoding streams
    first, chunked, mixed = (c["schedules"][k] for k in R.SCHEDULES)
    assert first["max_step_tokens"] >= c["long_prompt"] and first["max_wait_tokens"] > c["long_prompt"]
    assert chunked["max_step_tokens"] == mixed["max_step_tokens"] == c["chunk_tokens"]
    assert chunked["max_wait_tokens"] <= c["chunk_tokens"] + c["decoding"] + 1  # prefill-first: a decode step
    assert mixed["max_wait_tokens"] <= c["chunk_tokens"]  # between two chunks (the last: L decodes too)
    assert first["long_prompt_first_token_after"] == c["long_prompt"]
    assert chunked["long_prompt_first_token_after"] > c["long_prompt"]  # the decode steps between its chunks


def test_a_mixed_step_is_followed_by_a_decode_step_but_a_long_prompts_chunks_run_back_to_back():
    """mixed: a burst of short prompts runs P d P d, a long prompt's chunks back to back; prefill-first: p d p d."""
    rng = np.random.default_rng()
    for mixed in (True, False):
        s = R.Scheduler(T.TokenKVCache(1, 4096, 1, 1, 16, 1024), "fcfs", 16, reserve=False, mixed=mixed,
                        chunk_tokens=64)
        for _ in range(3):  # streams
            s.add(R._toks(rng, 10), 40, target=R._toks(rng, 40))
        kinds = ""  # P: prompt tokens and decode tokens (mixed), p: prompt tokens only, d: decode only
        for step in range(20):
            if 3 <= step < 9:  # a burst: a short prompt a step
                s.add(R._toks(rng, 8), 20, target=R._toks(rng, 20))
            if step == 10:  # 200 tokens: 4 chunks of 64 - 9 running
                s.add(R._toks(rng, 200), 20, target=R._toks(rng, 20))
            logged = len(s.events)
            s.step()
            fed = {e.kind for e in s.events[logged:]}
            kinds += ("P" if "decode" in fed else "p") if "prefill" in fed else "d"
        if mixed:
            assert kinds[3:11] == "PdPdPdPd", f"the burst: {kinds[3:11]} (want P d P d: a decode step after each)"
            assert kinds[11:16] == "PPPPd", f"the long prompt: {kinds[11:16]} (want its 4 chunks back to back)"
        else:
            assert "P" not in kinds and "pp" not in kinds, f"prefill-first: {kinds} (want p d p d)"


def test_a_mixed_step_that_admits_while_requests_wait_for_rows_feeds_prompts_only():
    """mixed: a step that admits while every row is taken (held) is prefill-only; not held, it carries decodes."""
    rng = np.random.default_rng()
    s = R.Scheduler(T.TokenKVCache(1, 4096, 1, 1, 16, 1024), "fcfs", 4, reserve=False, mixed=True, chunk_tokens=64)
    for i in range(8):  # 4 rows, 8 requests: the rest wait for a row
        n = int(rng.integers(3, 30))
        s.add(R._toks(rng, int(rng.integers(4, 12))), n, target=R._toks(rng, n))
    seen = {True: 0, False: 0}  # admitting steps, by held
    while s.busy:
        held, running, logged = s.held, bool(s.running), len(s.events)
        s.step()
        kinds = {e.kind for e in s.events[logged:]}
        if "prefill" in kinds and running:
            seen[held] += 1
            assert ("decode" in kinds) != held, f"held {held}: an admitting step fed {sorted(kinds)}"
    assert seen[True] >= 2, f"admitting steps while held: {seen}"


@pytest.mark.slow
def test_real_model_same_tokens_with_and_without_cache(smollm, one_thread):
    import llama3_generate as L
    C = importlib.import_module("01_kv_cache")
    model, tok = smollm
    shared = tok.encode("You are a terse geography tutor. Answer in one short sentence. Examples: the capital of "
                        "Italy is Rome; the capital of Spain is Madrid; the capital of Japan is Tokyo.\n")
    prompts = [shared + tok.encode(q) for q in ("Q: capital of France?", "Q: capital of Peru?",
                                                "Q: largest ocean?", "Q: capital of Kenya?")]
    prompts.append(list(prompts[0]))  # an exact repeat: its whole prompt but the last token comes from the cache
    n_new = 12

    reference = lambda ps: L.generate(model, C.ContiguousKVCache.for_model(model, len(ps), 256), ps, n_new)
    # a pool too small for everything at once: requests wait, prefixes are shared and evicted
    got, sched = R.generate_cached(model, prompts, n_new, pool_size=3 * len(prompts[0]) + 2 * n_new, max_running=3)
    assert got == reference(prompts)
    assert sched.stats["cached_tokens"] >= 3 * len(shared)  # the cache was really used
    sched.check()
    # next turn of two of the chats: history + answer + new text, served from the same (warm) scheduler
    turn2 = [prompts[i] + got[i] + tok.encode(" And its population?") for i in (0, 2)]
    before = sched.stats["cached_tokens"]
    got2, _ = R.generate_cached(model, turn2, n_new, sched=sched)
    assert got2 == reference(turn2)
    assert sched.stats["cached_tokens"] - before > len(shared)
    sched.check()
    assert sched.kv.allocator.available() + sched.tree.evictable_size() == sched.kv.allocator.size


def leaf_paths(tree):
    """Every token sequence the tree caches whole (root to leaf), however its edges are cut."""
    out, stack = [], [(tree.root, ())]
    while stack:
        node, path = stack.pop()
        out += [path] if not node.children and path else []
        stack += [(c, path + c.key) for c in node.children.values()]
    return sorted(out)


@pytest.mark.parametrize("mixed", [False, True], ids=["prefill-first", "mixed"])
def test_chunked_prefill_gives_the_same_tokens_kv_and_tree(mixed, one_thread):
    """Chunked at a tiny and a medium budget, a random model gives unchunked tokens, tree and K, V."""
    rng = random.Random()
    model = tiny_model(rng.randrange(1 << 30), vocab_size=97, hidden_dim=96, max_seq_len=512)
    shared = [rng.randrange(97) for _ in range(40)]
    prompts = [shared + [rng.randrange(97) for _ in range(rng.randint(1, 30))] for _ in range(5)]
    prompts += [[rng.randrange(97) for _ in range(rng.randint(20, 60))], list(prompts[0])]

    def run(**kw):
        sched = R.Scheduler(T.TokenKVCache.for_model(model, 2048, 4), "lpm", 4, mixed=mixed, **kw)
        return R.generate_cached(model, prompts, 8, sched=sched)
    want, s0 = run()
    for chunk in (rng.randint(1, 7), rng.randint(8, 40)):
        got, s1 = run(chunk_tokens=chunk)
        assert got == want, chunk
        assert max(e.tokens for e in s1.events if e.kind == "prefill") <= chunk
        assert leaf_paths(s1.tree) == leaf_paths(s0.tree)
        s1.check()
        for p, out in zip(prompts, want):
            seq = p + out[:-1]  # all but the last token were fed back: cached at the end
            a, b = s0.tree.match_prefix(seq, compute_last=False)[0], s1.tree.match_prefix(seq, compute_last=False)[0]
            assert len(a) == len(b) == len(seq)
            for pool in ("k_pool", "v_pool"):
                torch.testing.assert_close(getattr(s1.kv, pool)[:, b], getattr(s0.kv, pool)[:, a])


@pytest.mark.parametrize("page", [1, 4, 16])
def test_cached_pages_hold_a_fresh_prefills_kv(page, one_thread):
    """Cached pages (03's slots or 02's blocks) hold the K, V of a fresh prefill of their path; tokens as uncached."""
    import llama3_generate as L
    C, rng = importlib.import_module("01_kv_cache"), random.Random()
    model = tiny_model(rng.randrange(1 << 30), vocab_size=97, hidden_dim=96, max_seq_len=512)
    shared = [rng.randrange(97) for _ in range(rng.randint(40, 70))]
    prompts = [shared + [rng.randrange(97) for _ in range(rng.randint(1, 30))] for _ in range(6)]
    prompts += [[rng.randrange(97) for _ in range(rng.randint(20, 60))], list(prompts[0]), prompts[1] + shared]

    def run(radix):
        tokens = 192  # the longest request and a little more: the rest wait, prefixes are evicted
        kv = T.TokenKVCache.for_model(model, tokens, 4) if page == 1 else \
            P02.PagedKVCache.for_model(model, tokens // page, page, watermark=0, max_seqs=4)
        return R.generate_cached(model, prompts, 8, sched=R.Scheduler(kv, "lpm", 3, radix=radix, reserve=False))
    want = L.generate(model, C.ContiguousKVCache.for_model(model, len(prompts), 256), prompts, 8)
    (got, s), (plain, s0) = run(True), run(False)
    assert got == plain == want
    assert s.stats["cached_tokens"] >= 2 * (len(shared) // page * page - page) and s0.stats["cached_tokens"] == 0
    assert all(e.tokens % page == 0 for e in s.events if e.kind == "admit") and s.stats["evicted_tokens"] > 0
    s.check()
    for path in leaf_paths(s.tree):
        slots = s.tree.match_prefix(path, compute_last=False)[0]
        assert len(path) % page == 0 and len(slots) == len(path)
        fresh = T.TokenKVCache.for_model(model, len(path), 1)
        with torch.no_grad():
            model(torch.tensor(path), fresh.prepare([0], [len(path)]), fresh, logits_at=torch.tensor([len(path) - 1]))
        for layer in range(model.args.n_layers):
            for got_pool, want_pool in zip(s.kv.layer_pools(layer), fresh.layer_pools(layer)):
                torch.testing.assert_close(got_pool[slots], want_pool[fresh.slots(0)])


def random_waiting(seed, page=1):
    """A radix tree over random prompts of a 2-token vocabulary and requests matched against it (prefix, node)."""
    rng, kv = random.Random(seed), kv_less(page, 4000, rows=40)
    sched = R.Scheduler(kv, "lpm", max_running=40)
    for _ in range(rng.randint(2, 10)):
        insert_new(sched.tree, kv, random_seq(rng, 2, 1, 10))
    reqs = [sched.add(random_seq(rng, 2, 1, 12), 2) for _ in range(rng.randint(1, 14))]
    for r in reqs:
        r.prefix, r.node = sched.tree.match_prefix(r.tokens)
    return sched, reqs


def test_lpm_orders_longest_cached_prefix_first_ties_first_come():
    """lpm, brute force: by the length of the cached prefix (Brute's longest common prefix, not the tree's word),
    longest first; equal lengths keep their arrival order; admit() takes them in that order when all fit."""
    for seed in range(30):
        sched, reqs = random_waiting(seed)
        brute = Brute()
        for path in leaf_paths(sched.tree):
            brute.insert(path, list(range(len(path))))
        want = sorted(reqs, key=lambda r: (-len(brute.match(r.tokens)), r.rid))
        got = [r.rid for r in R.POLICIES["lpm"](sched.tree, None, list(reqs))]
        assert got == [r.rid for r in want], (f"lpm ordered requests with cached prefixes of "
                                              f"{[len(r.prefix) for r in reqs]} tokens as {got}")
        admitted = [r.rid for r in sched.admit()]
        assert admitted == [r.rid for r in want], f"the scheduler admitted {admitted} in lpm order; want {got}"


def ancestors(node):
    """node, its parent, ..., the root."""
    out = [node]
    while out[-1].parent is not None:
        out.append(out[-1].parent)
    return out


def test_dfs_weight_visits_the_heaviest_subtree_first():
    """dfs-weight: sibling subtrees whole, the one with more waiting first; a node's requests after its subtree's."""
    for seed in range(30):
        sched, reqs = random_waiting(seed)
        order = R.POLICIES["dfs-weight"](sched.tree, None, list(reqs))
        assert sorted(r.rid for r in order) == [r.rid for r in reqs]
        below = lambda node: [i for i, r in enumerate(order) if node in ancestors(r.node)]  # its subtree's places
        for node in sched.tree._nodes():
            spans = [below(c) for c in sorted(node.children.values(), key=lambda c: c.serial)]
            for s in spans:
                assert not s or s == list(range(s[0], s[-1] + 1)), "a subtree's requests are not contiguous"
            busy = [(s[0], -len(s)) for s in spans if s]
            assert [n for _, n in sorted(busy)] == sorted(n for _, n in busy), "a lighter subtree went first"
            own = [i for i, r in enumerate(order) if r.node is node]
            assert all(i > j for i in own for s in spans for j in s), "a node's requests before its subtree's"


@pytest.mark.parametrize("mixed", [False, True], ids=["prefill-first", "mixed"])
def test_chunked_prefill_cuts_at_exactly_the_budget(mixed):
    """A prompt of L tokens, C a step, goes in chunks of C and a last of L % C, sampling in the last."""
    for C in (1, 3, 4, 7):
        for L in range(1, 3 * C + 2):
            sched = R.Scheduler(kv_less(1, 64), "fcfs", chunk_tokens=C, mixed=mixed)
            r, first = sched.add(list(range(1, L + 1)), 2, target=[0, 0]), None
            while sched.busy:
                sched.step()
                first = first if first is not None or not r.output else sched.stats["steps"]
            fed = [e.tokens for e in sched.events if e.kind == "prefill"]
            assert fed == [C] * (L // C) + ([L % C] if L % C else []), (C, L, fed)
            assert first == len(fed)  # steps counted from 1: the token comes with the last chunk
        sched = R.Scheduler(kv_less(1, 64), "fcfs", chunk_tokens=C + 1, mixed=mixed)
        a, b = sched.add([1] * C, 1, target=[0]), sched.add([2], 1, target=[0])
        sched.step()
        assert a.output == b.output == [0] and sched.chunked is None


def test_in_batch_sharing_waits_one_step_from_exactly_in_batch_min():
    """Two prompts sharing k new tokens: below IN_BATCH_MIN both prefill now; from it the second waits, a hit of k."""
    for k in (1, R.IN_BATCH_MIN - 1, R.IN_BATCH_MIN, R.IN_BATCH_MIN + 1):
        sched = R.Scheduler(kv_less(1, 400, rows=8), "lpm")
        a, b = (sched.add([7] * k + [t, 9], 1, target=[0]) for t in (1, 2))
        sched.run()
        admits = [(e.step, e.rid, e.tokens) for e in sched.events if e.kind == "admit"]
        wait = k >= R.IN_BATCH_MIN  # then b comes in the step after a's prefill, a hit of a's k tokens
        assert admits == [(0, a.rid, 0), (1, b.rid, k) if wait else (0, b.rid, 0)], (k, admits)


# ------------------------------------------------------------------ the workshop's exercises, on small cases, in words

def small_tree(page, prompts):
    """A tree over 03's token pool (page 1) or 02's blocks with the prompts inserted, and Brute beside it."""
    kv = kv_less(page, 64)
    tree, brute = R.RadixCache(kv.allocator, page), Brute(page)
    for seq in prompts:
        brute.insert(seq, insert_new(tree, kv, seq)[1].tolist())
    return kv, tree, brute


def path(node):
    """The tokens from the root to node."""
    out = []
    while node is not None and node.parent is not None:
        out[:0] = node.key
        node = node.parent
    return out


@pytest.mark.parametrize("page", [1, 2])
def test_match_prefix_finds_the_longest_cached_prefix_in_whole_pages(page):
    """match_prefix on a tree holding [1 2 3 4 5 6] and [1 2 3 9 9 9]: the slots of the longest cached prefix, whole
    pages only, at most len - 1 tokens with compute_last (one token is left to compute), and the node it ends at."""
    prompts = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9]]
    kv, tree, brute = small_tree(page, prompts)
    for q, cl in (([1, 2, 3, 4, 5, 6, 7], True), ([1, 2, 3, 4, 5, 6], True), ([1, 2, 3, 4, 5, 6], False),
                  ([1, 2, 3, 9], True), ([1, 2, 3, 4], False), ([1, 9], True), ([8, 8], True), ([1], True),
                  ([], False)):
        slots, node = tree.match_prefix(q, cl)
        want = brute.match(q, cl)
        call = f"match_prefix({q}, compute_last={cl}) with pages of {page} on a tree holding {prompts}"
        got = torch.as_tensor(slots).tolist()
        assert got == want, f"{call} returned {len(got)} slots {got}; want the {len(want)} slots {want} " \
            f"(of the tokens {q[:len(want)]})"
        assert path(node) == q[:len(want)], f"{call} returned the node of {path(node)}; want the node where " \
            f"{q[:len(want)]} ends"
    tree.check()


@pytest.mark.parametrize("page", [1, 2])
def test_insert_adds_what_is_new_and_says_what_was_cached(page):
    """insert, one prompt after another: the tree then matches what Brute matches, insert returns the tokens
    cached already (whole pages), the new leaf's slots take the tree's reference, and the sizes add up."""
    kv, tree, brute = small_tree(page, [])
    held = []
    for seq in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7], [1, 2, 7, 7], [1, 2, 3, 4, 5], [5], [8, 8, 8]):
        n, slots = insert_new(tree, kv, seq)
        want, call = brute.insert(seq, slots.tolist()), f"insert({seq}) with pages of {page} after {held}"
        assert n == want, f"{call} returned {n}; {want} of its tokens were cached already"
        held.append(seq)
        for s in held:
            got, want_s = tree.match_prefix(s, False)[0].tolist(), brute.match(s, False)
            assert got == want_s, f"after {call}, the tree matches {s} with slots {got}; want {want_s}"
        assert tree.evictable_size() == brute.tokens(), \
            f"after {call} the tree counts {tree.evictable_size()} evictable tokens; it holds {brute.tokens()}"
        tree.check()


def test_evict_takes_the_least_recently_used_unlocked_leaves():
    """evict on a tree [1 2 3] -> {[4 5], [7 8]}, and [6 6], then on a tree [1 2] -> {[3], [4]}: inserted in that
    order, so [4 5] is the least recently used leaf, then [7 8]; a parent left childless is a leaf, in the same call
    too; a locked node is never evicted."""
    kv, tree, _ = small_tree(1, [[1, 2, 3, 4, 5], [1, 2, 3, 7, 8], [6, 6]])
    alloc = kv.allocator
    slot = {tuple(p): tree.match_prefix(p, False)[0].tolist() for p in ([1, 2, 3, 4, 5], [1, 2, 3, 7, 8], [6, 6])}
    free0 = alloc.available()
    for n, want_freed, gone, story in (
            (1, 2, slot[(1, 2, 3, 4, 5)][3:], "the least recently used leaf, [4 5]"),
            (2, 2, slot[(1, 2, 3, 7, 8)][3:], "the next, [7 8]")):
        freed = tree.evict(n)
        assert freed == want_freed, f"evict({n}) freed {freed} tokens; want {want_freed}: {story}"
        back = [s for s in gone if alloc.mem_state[s] == 0]
        assert back == gone, f"evict({n}) must free {story}: its slots {gone}; {back} came back to the pool"
        assert alloc.available() == free0 + len(gone), \
            f"after evict({n}) {alloc.available() - free0} slots came back to the pool; want {len(gone)} ({story})"
        free0 = alloc.available()
        tree.check()
    _, node = tree.match_prefix([6, 6, 0])
    tree.inc_lock_ref(node)
    freed = tree.evict(100)
    assert freed == 3, f"evict(100) with [6 6] locked freed {freed} tokens; want 3: [1 2 3] (a leaf now), not [6 6]"
    assert tree.match_prefix([6, 6, 0])[0].numel() == 2, "evict took [6 6], which a request holds locked"
    tree.dec_lock_ref(node)
    assert tree.evict(0) == 0, "evict(0) freed tokens; want none"
    tree.check()
    kv, tree, _ = small_tree(1, [[1, 2, 3], [1, 2, 4]])
    freed = tree.evict(4)
    assert freed == 4, f"evict(4) on a tree [1 2] -> {{[3], [4]}} freed {freed} tokens; want 4: both leaves, then " \
        "[1 2], a leaf once they are gone (the same call)"
    tree.check()


def test_lpm_puts_the_longest_cached_prefix_first():
    """lpm on waiting requests whose cached prefixes (r.prefix) hold 2, 5, 0, 5, 1 tokens: longest first, ties in
    arrival order: 1, 3, 0, 4, 2."""
    from types import SimpleNamespace
    w = [SimpleNamespace(rid=i, prefix=torch.arange(k), node=None, tokens=[0] * n)
         for i, (k, n) in enumerate(zip([2, 5, 0, 5, 1], [9, 6, 8, 7, 3]))]
    got = [r.rid for r in R.POLICIES["lpm"](R.RadixCache(), random.Random(0), list(w))]
    assert got == [1, 3, 0, 4, 2], f"lpm ordered requests with cached prefixes of 2, 5, 0, 5, 1 tokens as {got}; " \
        "want [1, 3, 0, 4, 2] (longest first, ties in arrival order)"
