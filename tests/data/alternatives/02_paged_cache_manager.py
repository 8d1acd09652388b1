"""02's exercises written a second way, from the attendee's copy alone (its docstrings and ideas, not the lesson's
bodies): other names, other order, other error wording. `workshop.py verify` grades each (it must pass, as the
lesson's does); the file is parsed, never imported."""


class BlockManager:
    def append(self, seq, n: int) -> list:
        table, have, size = self.block_tables.get(seq, []), self.num_tokens.get(seq, 0), self.block_size
        shared_partial = n > 0 and bool(table) and have % size != 0 and self.ref_count[table[-1]] > 1
        fresh = -(-(have + n) // size) - len(table)
        wanted = fresh + (1 if shared_partial else 0)
        if wanted > self.num_free:
            raise OutOfBlocks(f"{seq!r} wants {wanted} more blocks; the pool has {self.num_free}")
        self.block_tables[seq] = table
        copies = []
        if shared_partial:
            old, new = table[-1], self._take()
            self._release(old)
            table[-1] = new
            copies.append((old, new))
        for _ in range(fresh):
            table.append(self._take())
        self.num_tokens[seq] = have + n
        return copies

    def fork(self, parent, child):
        if child in self.block_tables:
            raise ValueError(f"{child!r} is taken")
        try:
            table = self.block_tables[parent]
        except KeyError:
            raise KeyError(f"no sequence {parent!r} to fork") from None
        self.block_tables[child] = table.copy()
        self.num_tokens[child] = self.num_tokens[parent]
        for block in table:
            self.ref_count[block] = self.ref_count[block] + 1

    def free(self, seq):
        table = self.block_tables.pop(seq, None)
        if table is None:
            raise KeyError(f"no sequence {seq!r}")
        while table:
            self._release(table.pop())
        self.num_tokens.pop(seq)


class Scheduler:
    def preempt(self, req):
        swap = self.preempt_mode == "swap"
        self.log("swap_out" if swap else "preempt", req, req.kv_len)
        self.stats["preemptions"] = self.stats["preemptions"] + 1
        if not swap:
            self.release(req)
            self.waiting.insert(0, req)
            return
        saved = self.kv.swap_out(req.rid)
        req.in_kv = False
        self.swapped.append((req, saved))
