"""
01_kv_cache.py -- naive KV caching, and what reserving max length wastes.

(lesson text, measurements and report: see issue 3 -- this file is being written)
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

TRACES = {"sharegpt": (161, 338), "alpaca": (19, 58)}  # mean prompt / output tokens of the two public traces


def synthetic_trace(kind: str = "sharegpt", n: int = 1000, seed: int = 0, max_seq_len: int = 2048, sigma: float = 1.0):
    """Request lengths drawn from log-normals with ShareGPT-like or Alpaca-like means (no download).

    Returns (prompt_lens, output_lens), int64 numpy arrays of n requests, each >= 1, prompt + output <= max_seq_len."""
    mean_in, mean_out = TRACES[kind]
    rng = np.random.default_rng(seed)
    draw = lambda mean: rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, n)  # log-normal with that mean
    prompt = np.clip(np.rint(draw(mean_in)), 1, max_seq_len // 2).astype(np.int64)
    output = np.clip(np.rint(draw(mean_out)), 1, max_seq_len - prompt).astype(np.int64)
    return prompt, output


class ContiguousKVCache:
    """gpt-fast's static cache: each request owns one row of max_seq_len slots, reserved up front.

    k_cache, v_cache: (n_layers, max_batch, max_seq_len, n_kv_heads, head_dim)
    """

    def __init__(self, n_layers, max_batch, max_seq_len, n_kv_heads, head_dim, dtype=torch.float32, device="cpu"):
        shape = (n_layers, max_batch, max_seq_len, n_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.max_seq_len, self.device = max_seq_len, device
        self.free_rows = list(range(max_batch))
        self.rows: dict = {}  # seq_id -> row
        self.lens = [0] * max_batch  # tokens stored in each row

    @classmethod
    def for_model(cls, model, max_batch: int, max_seq_len: int | None = None):
        a, w = model.args, model.tok_embeddings.weight
        return cls(a.n_layers, max_batch, max_seq_len or a.max_seq_len, a.n_kv_heads, a.head_dim, w.dtype, w.device)

    def prepare(self, seq_ids, n_new):
        """Make room for n_new[i] tokens of seq_ids[i]; returns their positions (T,)."""
        for s, n in zip(seq_ids, n_new):
            if s not in self.rows:
                if not self.free_rows:
                    raise ValueError(f"no free cache row for request {s}: all {len(self.rows)} rows are reserved")
                self.rows[s] = self.free_rows.pop(0)
            if self.lens[self.rows[s]] + n > self.max_seq_len:
                raise ValueError(f"request {s}: {self.lens[self.rows[s]] + n} tokens exceed max_seq_len={self.max_seq_len}")
        rows = [self.rows[s] for s in seq_ids]
        starts = [self.lens[r] for r in rows]
        positions = torch.cat([torch.arange(p, p + n) for p, n in zip(starts, n_new)])
        self.batch = (rows, starts, list(n_new))
        self.tok_rows = torch.repeat_interleave(torch.tensor(rows), torch.tensor(n_new)).to(self.device)
        self.tok_pos = positions.to(self.device)
        for r, n in zip(rows, n_new):
            self.lens[r] += n
        return self.tok_pos

    def attend(self, layer, q, k, v):
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        k_cache[self.tok_rows, self.tok_pos] = k  # the whole cache update: write this step's k, v at their positions
        v_cache[self.tok_rows, self.tok_pos] = v
        rows, starts, n_new = self.batch
        if all(n == 1 for n in n_new):  # decode: one query per request, batched over a length mask
            L = max(starts) + 1
            idx = torch.tensor(rows, device=q.device)
            K, V = k_cache[idx, :L].transpose(1, 2), v_cache[idx, :L].transpose(1, 2)  # (B, n_kv_heads, L, head_dim)
            mask = torch.arange(L, device=q.device) <= self.tok_pos[:, None]           # (B, L)
            out = F.scaled_dot_product_attention(q[:, :, None], K, V, attn_mask=mask[:, None, None], enable_gqa=True)
            return out[:, :, 0]
        from llama3_generate import attend_dense  # prefill: one request at a time
        outs, t = [], 0
        for r, p, n in zip(rows, starts, n_new):
            outs.append(attend_dense(q[t:t + n], k_cache[r, :p + n], v_cache[r, :p + n]))
            t += n
        return torch.cat(outs)

    def free(self, seq_id):
        row = self.rows.pop(seq_id)
        self.lens[row] = 0
        self.free_rows.append(row)
