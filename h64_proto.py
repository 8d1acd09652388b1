"""Issue 64 prototype (phase 1; merged into the engine and 04 once #63's layout lands): batch-invariant ops.

Why bits move with the batch: floating-point addition is not associative, and every reduction's order is chosen
from the shapes of the call it is in. A row's matmul goes through another BLAS kernel at M = 1 (a GEMV), 2-3 or 4+
rows; attention runs another kernel for decode, prefill and mixed steps, and splits keys by batch; a pointwise op
rounds its vector body and scalar tail differently, and threads cut a tensor at size-dependent points. Fix: every
row meets the same shapes, whatever the company: matmuls in tiles of TILE_M rows, attention reducing over keys in
PIECE-sized pieces from key 0, one routine for every query (prefill, chunk, cached suffix, decode)."""
import torch
import torch.nn.functional as F

TILE_M = 16  # rows per GEMM call: every row meets a (TILE_M, K) x (K, N) product, the same kernel whatever M
PIECE = 16   # keys per attention piece: every query reduces over keys [0, 16), [16, 32), ... in that order
ROWS = 16    # (token, head in group) query rows per attention tile


def tiles(x, n: int):
    """x (M, ...) padded with zero rows to a multiple of n, viewed (M // n, n, ...)."""
    pad = -x.shape[0] % n
    if pad:
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
    return x.view(-1, n, *x.shape[1:])


def invariant_linear(x, w):
    """F.linear(x, w), row by row the same bits whatever else is in x: (TILE_M, K) GEMMs, zero-padded."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    out = torch.cat([F.linear(t, w) for t in tiles(x, TILE_M)])[:x.shape[0]] if len(x) else F.linear(x, w)
    return out.view(*shape[:-1], w.shape[0])


def attend_pieces(q, k_pool, v_pool, table, rows, starts, n_new, page=1):
    """Causal attention of a ragged batch (q (T, H, D), request after request: n_new[b] new tokens of table row
    rows[b] after starts[b] cached ones) over the pools, each query reducing over its keys in PIECE-sized pieces
    from key 0 with fixed-shape products: its bits depend on its own request's keys alone."""
    rows, starts, n_new = ([int(v) for v in x] for x in (rows, starts, n_new))
    H, D, Hkv = q.shape[1], q.shape[2], k_pool.shape[1]
    G, out, t = H // Hkv, [], 0
    for r, p, n in zip(rows, starts, n_new):
        L = p + n
        i = torch.arange(tiles(torch.empty(L), PIECE).numel(), device=q.device)
        slots = table[r, (i // page).clamp(max=table.shape[1] - 1)].long() * page + i % page
        live = (i < L)[:, None, None]  # past the end: zeros (table entries there are stale, the pool may be NaN)
        k, v = (pool[slots].float().where(live, 0.0).transpose(0, 1) for pool in (k_pool, v_pool))  # (Hkv, Lp, D)
        qr = q[t:t + n].float().view(n, Hkv, G, D).permute(1, 0, 2, 3).reshape(Hkv, n * G, D)
        qt = tiles(qr.transpose(0, 1), ROWS).permute(2, 0, 1, 3)  # (Hkv, tiles, ROWS, D)
        pos = tiles(torch.arange(p, L, device=q.device).repeat_interleave(G), ROWS)  # (tiles, ROWS)
        o = attend_tiles(qt, k, v, pos, L)  # (Hkv, tiles, ROWS, D)
        o = o.reshape(Hkv, -1, D)[:, :n * G].reshape(Hkv, n, G, D).permute(1, 0, 2, 3)
        out.append(o.reshape(n, H, D).to(q.dtype))
        t += n
    return torch.cat(out)


def attend_tiles(qt, k, v, pos, L: int):
    """Online softmax over key pieces: qt (Hkv, nt, R, D), k, v (Hkv, Lp, D), pos (nt, R) query positions."""
    Hkv, nt, R, D = qt.shape
    scale = D ** -0.5
    m = torch.full((Hkv, nt, R), float("-inf"))
    l, acc = torch.zeros(Hkv, nt, R), torch.zeros(Hkv, nt, R, D)
    qb = qt.reshape(Hkv * nt, R, D)
    for j in range(0, L, PIECE):
        kj = k[:, j:j + PIECE, None].expand(Hkv, PIECE, nt, D).permute(0, 2, 1, 3).reshape(Hkv * nt, PIECE, D)
        vj = v[:, j:j + PIECE, None].expand(Hkv, PIECE, nt, D).permute(0, 2, 1, 3).reshape(Hkv * nt, PIECE, D)
        s = torch.bmm(qb, kj.transpose(1, 2)).view(Hkv, nt, R, PIECE) * scale
        key = torch.arange(j, j + PIECE)
        s = s.masked_fill((key > pos[..., None]) | (key >= L), float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        alpha, p = torch.exp(m - m_new), torch.exp(s - m_new[..., None])
        l = l * alpha + p.sum(-1)
        pv = torch.bmm(p.view(Hkv * nt, R, PIECE), vj).view(Hkv, nt, R, D)
        acc, m = acc * alpha[..., None] + pv, m_new
    return acc / l[..., None]


def decode_pieces(q, k_pool, v_pool, table, rows, seq_lens, page=1):
    """attend_pieces for a decode step (one query per request): the same routine, so the same bits as prefill."""
    lens = [int(n) for n in seq_lens]
    return attend_pieces(q, k_pool, v_pool, table, rows, [n - 1 for n in lens], [1] * len(lens), page)


def enable(engine, triton=None):
    """Prototype of Engine(deterministic=True): invariant matmuls, one attention routine for all (triton: 04's
    kernels and the Triton matmul, the GPU's; default on a GPU)."""
    import types
    model = engine.model
    triton = engine.device.type == "cuda" if triton is None else triton
    if triton:
        import h64_triton as T
        linear, decode, extend = T.invariant_matmul, T.decode_deterministic, T.extend_deterministic
    else:
        linear, decode, extend = invariant_linear, decode_pieces, attend_pieces
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.forward = lambda x, m=m: linear(x, m.weight)

    @torch.inference_mode()
    def forward(self, tokens, positions, kv, logits_at=None, fp32=True, vocab=slice(None)):
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        for layer in self.layers:
            h = layer(h, cos, sin, kv)
        if logits_at is not None:
            h = h[logits_at]
        logits = linear(self.norm(h), self.output.weight[vocab])
        return logits.float() if fp32 else logits
    model.forward = types.MethodType(forward, model)
    engine.kv.use_kernels(decode, extend)
    return engine


def engine(model, tok, deterministic=False, triton=None, **kw):
    import llama3_generate as L
    if deterministic:
        kw["fused"] = False
    e = L.Engine(model, tok, **kw)
    return enable(e, triton) if deterministic else e
