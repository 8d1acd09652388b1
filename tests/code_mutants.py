"""Bugs in the code no attendee writes: lesson code outside the workshop's exercises (01's free and masks, 02's
copy-on-write and admission, 03's prepare, 04's extend kernel, 05's admission, 06's index and sampling) and the
engine. Each must make its stage's own CPU tests fail, as tests/mutants.py's attendee bugs must; the same runner
runs both (`python tests/mutants.py [stage ...]`). No exercise is graded on these: the workshop copy keeps this
code as the lesson wrote it. A mutant inside an exercise's body belongs in tests/mutants.py, where the workshop
grades it too (`workshop.py verify` checks the split).
"""
from mutants import Mutant

CODE_MUTANTS = [
    # ---- 01: the contiguous cache's prepare / attend / free, and the reference attention ----
    Mutant("01", "ContiguousKVCache.free", "free forgets to reset the row's length (the next request starts after "
           "the old tokens)", "        row = self.rows.pop(seq_id)\n        self.lens[row] = 0\n",
           "        row = self.rows.pop(seq_id)\n"),
    Mutant("01", "ContiguousKVCache.free", "free forgets to return the row (rows leak)",
           "        self.lens[row] = 0\n        self.free_rows.append(row)\n", "        self.lens[row] = 0\n"),
    Mutant("01", "attend_dense", "causal mask: a query does not see its own key",
           "mask = torch.arange(L, device=q.device) <= torch.arange(L - n, L, device=q.device)[:, None]",
           "mask = torch.arange(L, device=q.device) < torch.arange(L - n, L, device=q.device)[:, None]"),
    Mutant("01", "attend_decode", "decode mask reads one key past each length",
           "mask = torch.arange(k.shape[1], device=q.device) < seq_lens[:, None]",
           "mask = torch.arange(k.shape[1], device=q.device) <= seq_lens[:, None]"),

    # ---- 02: BlockManager (append, copy-on-write, fork, free) and the Scheduler's preemption ----
    Mutant("02", "BlockManager.blocks_needed",
           "copy-on-write also when the shared last block is full (a needless copy)",
           "cow = n > 0 and have % self.block_size != 0 and", "cow = n > 0 and"),
    Mutant("02", "BlockManager.blocks_needed", "copy-on-write forgotten when the block is shared by two (refcount > "
           "2 taken for > 1)", "self.ref_count[last] - copied[last] > 1", "self.ref_count[last] - copied[last] > 2"),
    Mutant("02", "BlockManager.blocks_needed",
           "copy-on-write counted per sequence, not once per shared block in a batch",
           "self.ref_count[last] - copied[last] > 1", "self.ref_count[last] > 1"),
    Mutant("02", "BlockManager.blocks_needed", "blocks needed rounded down instead of up", "return cdiv(have + n, "
           "self.block_size) - len(table) + cow", "return (have + n) // self.block_size - len(table) + cow"),
    Mutant("02", "BlockManager.blocks_needed", "a new sequence's blocks rounded down",
           "        if not table:\n            return cdiv(n, self.block_size)",
           "        if not table:\n            return n // self.block_size"),
    Mutant("02", "BlockManager._release", "a shared block goes back to the free list while another sequence still "
           "holds it", "        if self.ref_count[block] == 0:\n            self.free_blocks.append(block)",
           "        if self.ref_count[block] <= 1:\n            self.free_blocks.append(block)"),
    Mutant("02", "BlockManager.can_allocate",
           "admission keeps the watermark free with one block to spare (>= taken for >)",
           "- cdiv(n_tokens, self.block_size) >= (0 if alone else self.watermark_blocks)",
           "- cdiv(n_tokens, self.block_size) > (0 if alone else self.watermark_blocks)"),
    Mutant("02", "Scheduler.admit", "a request that would run alone must still leave the watermark",
           "if not m.can_allocate(n, taken, alone=not (self.running or batch)):", "if not m.can_allocate(n, taken):"),
    Mutant("02", "Scheduler.prepare", "preemption picks the oldest running request instead of the newest",
           "victim = next((r for r in reversed(batch) if id(r) not in running), batch[-1])",
           "victim = next((r for r in reversed(batch) if id(r) not in running), batch[0])"),
    Mutant("02", "Scheduler.hold_back", "a held-back request is requeued at the tail",
           "        self.log(\"hold_back\", req, 0)\n        self.release(req)\n        self.waiting.appendleft(req)",
           "        self.log(\"hold_back\", req, 0)\n        self.release(req)\n        self.waiting.append(req)"),
    Mutant("02", "Scheduler.swap_in", "swapped-out requests come back newest first",
           "req, saved = self.swapped.popleft()", "req, saved = self.swapped.pop()"),
    Mutant("02", "Request.append", "a request ends one token late (its room counted past zero)", "self.done = token "
           "in self.stop_ids or self.room <= 0", "self.done = token in self.stop_ids or self.room < 0"),
    Mutant("02", "PagedKVCache._write_tables", "the device table skips the block copy-on-write replaced",
           "first = n - 1 if n and table[n - 1] != last else n", "first = n"),
    Mutant("02", "Scheduler.admit", "admission counts blocks taken this step one short",
           "taken += cdiv(n, m.block_size)", "taken += n // m.block_size"),

    # ---- 03: TokenAllocator alloc (cumsum / searchsorted), alloc_contiguous, free; TokenKVCache ----
    Mutant("03", "TokenAllocator.inc_ref", "inc_ref accepts a free slot",
           "if lo < 0 or hi >= self.size or low_ref <= 0:", "if lo < 0 or hi >= self.size or low_ref < 0:"),
    Mutant("03", "TokenKVCache.prepare", "prepare: each request's first new token offset counts its own tokens "
           "(cumsum, not exclusive)", "first = n_t.cumsum(0) - n_t", "first = n_t.cumsum(0)"),
    Mutant("03", "TokenKVCache.free", "free forgets the request's req_to_token row",
           "        self.req_pool.free(self.rows.pop(seq_id))\n", "        self.rows.pop(seq_id)\n"),
    Mutant("03", "TokenKVCache.prepare", "prepare refuses a request exactly max_seq_len long",
           "if n < 0 or p + n > self.max_seq_len:", "if n < 0 or p + n >= self.max_seq_len:"),
    Mutant("03", "TokenKVCache.share_prefix",
           "share_prefix points at the shared slots without taking a reference on them",
           "        self.allocator.inc_ref(slots)\n        self.req_to_token[row, start:",
           "        self.req_to_token[row, start:"),

    # ---- 04: the decode kernel's tile loop (online softmax), the split combine, the extend kernel's mask ----
    Mutant("04", "_chunk", "a split's chunk rounded down: the last tokens belong to no split",
           "return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N",
           "return tl.cdiv(seq_len // num_splits, BLOCK_N) * BLOCK_N"),
    Mutant("04", "_stage1", "a split reads past the request's length",
           "end = tl.minimum(start + chunk, seq_len)", "end = start + chunk"),
    Mutant("04", "_stage1", "the tile mask includes one key past the split's end",
           "        n = n0 + offs_n\n        nmask = n < end\n", "        n = n0 + offs_n\n        nmask = n <= end\n"),
    Mutant("04", "_stage1", "a split's log-sum-exp mixes natural log into log2 units",
           "m_i + tl.log2(l_i), mask=hmask)", "m_i + tl.log(l_i), mask=hmask)"),
    Mutant("04", "_extend", "extend: causal mask key < query (a token does not see itself)",
           "n[None, :] <= pos[:, None], m_i", "n[None, :] < pos[:, None], m_i"),
    Mutant("04", "_extend", "extend: the block's key range stops one short of its last query",
           "hi = prefix + tl.minimum((r0 + BLOCK_R - 1) // GROUP + 1, n_new)",
           "hi = prefix + tl.minimum((r0 + BLOCK_R - 1) // GROUP, n_new)"),
    Mutant("04", "extend_plan", "extend: each request's first query offset counts its own tokens",
           "q_start = extend.cumsum(0, dtype=torch.int32) - extend", "q_start = extend.cumsum(0, dtype=torch.int32)"),
    Mutant("04", "extend_plan", "extend: row blocks cover new tokens, not (token, head) pairs",
           "for r in range(0, n * group, rows)]", "for r in range(0, n, rows)]"),
    Mutant("04", "_slot", "a page's slot forgets the page size (table entry + offset)",
           "    return entry * page + n % page", "    return entry + n % page"),

    # ---- 05: RadixCache match_prefix / insert (split) / evict (LRU, locks), lpm order, chunked prefill ----
    Mutant("05", "RadixCache._split", "the edge split keeps one token too many on the new node",
           "new = Node(child.key[:n], child.value[:n], child.parent, self.serial)",
           "new = Node(child.key[:n + 1], child.value[:n + 1], child.parent, self.serial)"),
    Mutant("05", "RadixCache._walk", "a walk does not stamp the nodes it passes (LRU sees only inserts)",
           "            child.last_access = self.clock\n            values.append(child.value)",
           "            values.append(child.value)"),
    Mutant("05", "_common", "_common counts one token past the first difference",
           "    while edge[j] == key[i + j]:\n        j += 1\n    return j",
           "    while edge[j] == key[i + j]:\n        j += 1\n    return j + 1"),
    Mutant("05", "RadixCache.inc_lock_ref", "lock: ancestors are not locked (only the node itself)",
           "            node.lock_ref += 1\n            node = node.parent\n        return delta",
           "            node.lock_ref += 1\n            break\n        return delta"),
    Mutant("05", "_dfs_weight.visit", "dfs-weight visits the lightest subtree first",
           "for c in sorted(node.children.values(), key=lambda c: -weight[c]):",
           "for c in sorted(node.children.values(), key=lambda c: weight[c]):"),
    Mutant("05", "Scheduler.admit_ready", "reserve: a request reserves max_new slots for decode, one too many",
           "need = -(-(extend + (r.max_new_tokens - 1 if self.reserve is True else 0)) // block) * block",
           "need = -(-(extend + (r.max_new_tokens if self.reserve is True else 0)) // block) * block"),
    Mutant("05", "Scheduler.admit_ready",
           "chunked prefill: a cut prompt's chunk is one short of what is left of the step",
           "r.chunk = step - prefill if cut else None", "r.chunk = max(1, step - prefill - 1) if cut else None"),
    Mutant("05", "Scheduler.admit", "chunked prefill: the part-way prompt's share rounds down (it keeps less than "
           "half a step)", "r.chunk - max(1, int(step * CHUNK_KEEPS + 0.999))",
           "r.chunk - max(1, int(step * CHUNK_KEEPS))"),
    Mutant("05", "Scheduler.admit_ready", "a prompt sharing a prefix with one admitted this step waits even below "
           "IN_BATCH_MIN", "if aware and len(batch.match_prefix(r.tokens)[0]) >= cached + IN_BATCH_MIN:",
           "if aware and len(batch.match_prefix(r.tokens)[0]) > cached:"),
    Mutant("05", "RadixCache._walk", "a node split at a page boundary one page early",
           "n = _common(child.key, key, i) // self.page * self.page",
           "n = max(self.page, (_common(child.key, key, i) - 1) // self.page * self.page)"),

    # ---- 06: TokenIndex (allowed, jump / compressed edges) and jump-forward decoding ----
    Mutant("06", "TokenIndex.__init__", "forced: a state with one byte out is forced even when it may stop "
           "(accepting)", "self.forced = ((dfa.table >= 0).sum(1) == 1) & ~dfa.accept",
           "self.forced = (dfa.table >= 0).sum(1) == 1"),
    Mutant("06", "TokenIndex.needs", "EOS allowed in every state, not only accepting ones",
           "need[:, self.eos] = self.dfa.accept[states]", "need[:, self.eos] = 1"),
    Mutant("06", "TokenIndex.needs", "the index walk drops pairs in DFA state 0 (a state id taken for 'dead')",
           "alive = np.flatnonzero(state >= 0)", "alive = np.flatnonzero(state > 0)"),
    Mutant("06", "TokenIndex.compressed_edges",
           "compressed edges: heads only where a choice enters, not the start state",
           "heads = np.union1d(0, self.dfa.table[~self.forced])", "heads = np.unique(self.dfa.table[~self.forced])"),
    Mutant("06", "sample", "top-p drops the token that crosses p (the nucleus is one short)",
           "drop = (p_sorted.cumsum(-1) - p_sorted) >= top_p", "drop = p_sorted.cumsum(-1) > top_p"),
    Mutant("06", "sample", "top-p keeps a token whose more likely ones reach p exactly (one past the smallest "
           "nucleus)", "drop = (p_sorted.cumsum(-1) - p_sorted) >= top_p",
           "drop = (p_sorted.cumsum(-1) - p_sorted) > top_p"),
    Mutant("06", "sample", "top-p may drop every token (a top_p under float32's least): multinomial fails",
           "drop[:, 0] = False", "pass"),
    Mutant("06", "sample", "top-p sorts ascending: the nucleus is made of the least likely tokens",
           "p_sorted, idx = probs.sort(-1, descending=True)", "p_sorted, idx = probs.sort(-1)"),
    Mutant("06", "sample", "temperature multiplies instead of divides",
           "probs = torch.softmax(logits / temperature, dim=-1)",
           "probs = torch.softmax(logits * temperature, dim=-1)"),

    # ---- the engine (llama3_generate.py): Seq.append's finish, Engine.add's n samples, Engine.forward, generate ----
    Mutant("engine", "Seq.append", "a sequence ends one token late (its room counted past zero)",
           "self.done = stop or self.room <= 0", "self.done = stop or self.room < 0"),
    Mutant("engine", "Seq.append", "ignore_eos ignored: a stop id ends the sequence anyway",
           "stop = eos and (not p.ignore_eos or self.index is not None)", "stop = eos"),
    Mutant("engine", "Seq.append", "the finish reason reads the token, not the decision (ignore_eos reports stop)",
           "self.finish = \"stop\" if stop else \"length\"", "self.finish = \"stop\" if eos else \"length\""),
    Mutant("engine", "Seq.append", "a constrained sequence whose regex allows only EOS still asks the model",
           "stop = self.index.finish(self.fsm, self.room) == \"stop\"",
           "stop = self.index.finish(self.fsm, self.room) == \"length\""),
    Mutant("engine", "Engine.add", "n samples with a seed all draw from the same generator",
           "manual_seed((seed + i) % 2**64)", "manual_seed(seed % 2**64)"),
    Mutant("engine", "Engine.forward", "logits taken at each sequence's first new token instead of its last",
           "last = (torch.tensor(n_new).cumsum(0) - 1)[",
           "last = (torch.tensor(n_new).cumsum(0) - torch.tensor(n_new))["),
    Mutant("engine", "generate", "the static loop keeps decoding past a stop id",
           "            active = [i for i in active if out[i][-1] not in stop_ids]\n", ""),
]
