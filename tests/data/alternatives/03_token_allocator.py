"""03's exercises written a second way, from the attendee's copy alone (its docstrings and ideas, not the lesson's
bodies): Python loops for the tensor ops, other names, other error wording. `workshop.py verify` grades each (it
must pass, as the lesson's does); the file is parsed, never imported."""


class TokenAllocator:
    def alloc(self, n: int):
        if n < 0:
            raise ValueError(f"alloc: n must be >= 0, not {n}")
        if n > self.n_free:
            return None
        picked = []
        for slot, refs in enumerate(self.mem_state.tolist()):
            if len(picked) == n:
                break
            if refs == 0:
                picked.append(slot)
        for slot in picked:
            self.mem_state[slot] = 1
        self.n_free -= len(picked)
        return torch.tensor(picked, dtype=torch.long, device=self.device)

    def alloc_contiguous(self, n: int):
        if n < 1 or n > self.n_free:
            return self.alloc(n)
        begin, length = 0, 0
        for slot, refs in enumerate(self.mem_state.tolist()):
            if refs:
                length = 0
                continue
            if length == 0:
                begin = slot
            length += 1
            if length == n:
                self.mem_state[begin:begin + n] = 1
                self.n_free -= n
                return torch.arange(begin, begin + n, device=self.device)
        return self.alloc(n)

    def free(self, idx):
        drops = {}
        for s in torch.as_tensor(idx).reshape(-1).tolist():
            drops[s] = drops.get(s, 0) + 1
        for s, k in drops.items():
            if not 0 <= s < self.size:
                raise ValueError(f"slot {s} is outside the pool of {self.size}")
            if int(self.mem_state[s]) < k:
                raise ValueError(f"slot {s} freed {k} times but held {int(self.mem_state[s])} times")
        for s, k in drops.items():
            self.mem_state[s] -= k
            if int(self.mem_state[s]) == 0:
                self.n_free += 1
