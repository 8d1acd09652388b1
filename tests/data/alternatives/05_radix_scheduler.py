"""05's exercises written a second way, from the attendee's copy alone (its docstrings and ideas, not the lesson's
bodies): a scan for the least recently used leaf instead of a heap, other names, other order. `workshop.py verify`
grades each (it must pass, as the lesson's does); the file is parsed, never imported."""


class RadixCache:
    def match_prefix(self, tokens, compute_last=True):
        usable = max(len(tokens) - 1 if compute_last else len(tokens), 0) // self.page * self.page
        parts, node = self._walk(tuple(tokens[:usable]))
        if self.allocator is None:
            return tuple(tokens[:sum(len(p) for p in parts)]), node
        if not parts:
            return torch.empty(0, dtype=torch.long), node
        return torch.cat(list(parts)), node

    def insert(self, tokens, slots=None) -> int:
        whole = len(tokens) - len(tokens) % self.page
        key = tuple(tokens[:whole])
        parts, node = self._walk(key)
        cached = 0
        for p in parts:
            cached += len(p)
        if cached == len(key):
            return cached
        rest = key[cached:]
        value = rest if slots is None else slots[cached:whole].clone()
        self.serial += 1
        leaf = Node(rest, value, node, self.serial)
        leaf.last_access = self.clock
        node.children[self._first(key, cached)] = leaf
        self.evictable += len(rest)
        if self.allocator is not None:
            self.allocator.inc_ref(value)
        return cached

    def evict(self, n: int) -> int:
        freed = 0
        while freed < n:
            leaves = [x for x in self._nodes() if x is not self.root and not x.children and x.lock_ref == 0]
            if not leaves:
                break
            x = min(leaves, key=lambda x: (x.last_access, x.serial))
            if self.allocator is not None:
                self.allocator.free(x.value)
            del x.parent.children[self._first(x.key, 0)]
            self.evictable -= len(x.key)
            freed += len(x.key)
        return freed


POLICIES = {
    "lpm": lambda tree, rng, w: [r for _, _, r in sorted((-len(r.prefix), i, r) for i, r in enumerate(w))],
}
