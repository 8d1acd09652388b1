"""04's kernels vs float64 references: on a CPU through the Triton interpreter (small shapes), compiled on a GPU
(@pytest.mark.gpu, larger ones)."""
import importlib
import json

import pytest
import torch
from helpers import random_model, refuses

try:
    m = importlib.import_module("04_triton_token_attn")
except ImportError as e:  # no Triton (macOS, Windows): skipped with 04's one line
    pytest.skip(str(e), allow_module_level=True)
LENS = [1, 2, 15, 16, 17, 300]  # the tile edges (BLOCK_N=64 >= 16) and a multi-tile, multi-split request
ATOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}  # elementwise, outputs are O(1)


def run_and_check(P, dtype, **kw):
    """Poison the output, run the kernel, compare every element with the float64 reference."""
    out = torch.full(P[0].shape, float("nan"), dtype=dtype, device=P[0].device)
    res = m.token_decode_attention(*P, out=out, **kw)
    assert res.data_ptr() == out.data_ptr() and res.dtype == dtype
    ref = m.reference_decode_attention(*P, sm_scale=kw.get("sm_scale"), page=kw.get("page", 1))
    assert torch.isfinite(out).all(), "the kernel left outputs unwritten (NaN)"
    err = (out.double() - ref).abs()
    bad = err > ATOL[dtype] * (1 + ref.abs())
    assert not bad.any(), (f"the kernel's output is off by up to {err.max().item():.2g} from float64 softmax attention "
                           f"(lengths {P[-1].tolist()}, {kw}): {int(bad.sum())} of {bad.numel()} elements; the worst "
                           f"in request {int(bad.nonzero()[0, 0])}")
    assert m.rel_err(out, ref) <= m.TOLERANCE[dtype]


# every dtype meets every GQA ratio (1, 3, 4), both head dims and both slot layouts, with 1..4 splits
CASES = [  # (dtype, n_q_heads, n_kv_heads, head_dim, scattered, num_splits)
    (torch.float32, 2, 2, 64, True, None), (torch.float32, 6, 2, 128, False, 3), (torch.float32, 4, 1, 64, True, 1),
    (torch.float16, 2, 2, 128, True, 2), (torch.float16, 3, 1, 64, True, None), (torch.float16, 8, 2, 128, False, 4),
    (torch.bfloat16, 1, 1, 64, False, 3), (torch.bfloat16, 6, 2, 128, True, 1), (torch.bfloat16, 4, 1, 128, True, None),
]


@pytest.mark.parametrize("dtype,H,Hkv,D,scattered,splits", CASES,
                         ids=[f"{str(c[0])[6:]}-gqa{c[1] // c[2]}-d{c[3]}-{'scat' if c[4] else 'contig'}-s{c[5]}"
                              for c in CASES])
def test_matches_reference(dtype, H, Hkv, D, scattered, splits):
    P = m.make_problem(LENS, H, Hkv, D, dtype, scattered=scattered, seed=H * 1000 + D * 10 + (splits or 0))
    run_and_check(P, dtype, num_splits=splits)


def test_empty_splits_and_custom_scale():
    """More splits than tiles: empty chunks must drop out of the merge; sm_scale is honoured."""
    P = m.make_problem([1, 300, 70], 4, 2, 64, torch.float32, seed=5)
    run_and_check(P, torch.float32, num_splits=9, sm_scale=0.3)


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_pdl_variant(splits):
    """pdl=True (the first tile loaded before the wait, the newest token patched in): the same arithmetic."""
    P = m.make_problem(LENS, 6, 2, 64, torch.float32, seed=int(torch.randint(0, 10**6, ())))
    run_and_check(P, torch.float32, num_splits=splits, pdl=True)


def test_q_may_be_a_view_of_the_projection():
    """Decode and prefill read q in place as a view of the projection's output."""
    q, k, v, r2t, rows, lens = m.make_problem([3, 70], 6, 2, 64, torch.float32, seed=int(torch.randint(0, 10**6, ())))
    wide = torch.randn(len(lens), 6 + 2, 64)
    wide[:, :6] = q
    view = wide[:, :6]
    assert not view.is_contiguous()
    got = m.token_decode_attention(view, k, v, r2t, rows, lens)
    assert torch.equal(got, m.token_decode_attention(q, k, v, r2t, rows, lens))
    assert m.rel_err(got, m.reference_decode_attention(q, k, v, r2t, rows, lens)) <= m.TOLERANCE[torch.float32]
    prefix, extend = [0, 60], [3, 10]
    P, wide = extend_problem(prefix, extend, 6, 2, 64, torch.float32, seed=3), torch.randn(sum(extend), 8, 64)
    wide[:, :6] = P[0]
    got = m.token_extend_attention(wide[:, :6], *P[1:])
    assert torch.equal(got, m.token_extend_attention(*P))
    assert m.rel_err(got, m.reference_extend_attention(*P)) <= m.TOLERANCE[torch.float32]


def test_reference_is_softmax_attention():
    """The reference itself, against a hand-written loop for one request and one head."""
    q, k, v, r2t, rows, lens = m.make_problem([5, 3], 4, 2, 16, torch.float64, seed=2)
    ref, slots = m.reference_decode_attention(q, k, v, r2t, rows, lens), r2t[rows[1], :3].long()
    s = torch.stack([q[1, 3] @ k[i, 1] for i in slots]) / 4.0  # query head 3 reads kv head 3 // 2 = 1
    torch.testing.assert_close(ref[1, 3], (s.softmax(0)[:, None] * v[slots, 1]).sum(0))


def test_choose_num_splits():
    assert m.choose_num_splits(1, 8, 4096, 132) == 64           # batch 1: split down to 64-token chunks
    assert m.choose_num_splits(32, 8, 1024, 132) == 1           # 256 programs already cover 132 SMs
    assert m.choose_num_splits(8, 8, 16384, 132) == 8           # one wave of 4 programs per SM
    for b, L in [(1, 1), (3, 300), (8, 16384), (1, 10**6), (16, 100)]:
        s = m.choose_num_splits(b, 8, L, 132)
        assert 1 <= s <= max(1, -(-L // m.MIN_CHUNK)) and (s == 1 or b * 8 * s <= m.RESIDENT * 132)


def test_bad_shapes_raise():
    q, k, v, r2t, rows, lens = m.make_problem([4], 4, 2, 64, seed=0)
    # 3 q heads on 2 kv heads
    refuses(ValueError, m.token_decode_attention, q[:, :3], k, v, r2t, rows, lens, match="bad shapes")
    refuses(ValueError, m.token_decode_attention, q, k, v, r2t, rows, lens.repeat(2), match="need shape")
    refuses(ValueError, m.token_decode_attention, q, k, v, r2t, rows, lens * 0, match=">= 1")


def test_python_lists_for_rows_and_lengths():
    """03 may hand plain lists: same answer as tensors."""
    P = m.make_problem([3, 70], 4, 2, 64, torch.float16, seed=4)
    ref = m.reference_decode_attention(*P)
    out = m.token_decode_attention(*P[:4], P[4].tolist(), P[5].tolist())
    torch.testing.assert_close(out.double(), ref, atol=ATOL[torch.float16], rtol=ATOL[torch.float16])


def test_cli_json(capsys, monkeypatch):
    monkeypatch.setattr(m, "CHECKS", [(4, 2, 64)])  # one head layout per dtype keeps the interpreter quick
    m.main(["--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["max_rel_err"] < m.TOLERANCE[torch.bfloat16] and all(r["ok"] for r in report["checks"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("H,Hkv,D", [(32, 8, 128), (9, 3, 64), (8, 8, 64), (64, 4, 128)])
def test_gpu_matches_reference(dtype, H, Hkv, D):
    lens = LENS + [4097, 1000]
    for scattered in (True, False):
        P = m.make_problem(lens, H, Hkv, D, dtype, "cuda", scattered=scattered, seed=H * D)
        for splits in (None, 1, 7, 64):
            run_and_check(P, dtype, num_splits=splits)


@pytest.mark.gpu
def test_gpu_large_batch_bf16():
    run_and_check(m.make_problem([2048] * 64 + [1, 17], 32, 8, 128, torch.bfloat16, "cuda", seed=3), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 256, 4100])
def test_gpu_pages(page):
    """Compiled, bf16: 02's block tables and a 4,100-slot row as one page, decode and extend."""
    P = m.paged_problem(m.make_problem(LENS + [4097], 32, 8, 128, torch.bfloat16, "cuda", seed=page), page, page)
    for splits in (None, 1, 7):
        run_and_check(P, torch.bfloat16, page=page, num_splits=splits)
    E = m.paged_problem(extend_problem([0, 700, 3000], [1000, 1, 300], 32, 8, 128, torch.bfloat16, seed=page,
                                       device="cuda"), page, page)
    extend_and_check(E, m.TOLERANCE[torch.bfloat16], page=page)


def extend_and_check(P, tol, **kw):
    """Poison the output, run the prefill kernel, compare with the float64 reference: (out, reference)."""
    out = torch.full(P[0].shape, float("nan"), dtype=P[0].dtype, device=P[0].device)
    assert m.token_extend_attention(*P, out=out, **kw).data_ptr() == out.data_ptr()
    ref = m.reference_extend_attention(*P, page=kw.get("page", 1))
    assert torch.isfinite(out).all(), "the kernel left outputs unwritten (NaN)"
    assert m.rel_err(out, ref) <= tol, kw
    return out, ref


def extend_problem(prefix, extend, H, Hkv, D, dtype, scattered=True, seed=0, device="cpu"):
    """A ragged prefill batch: request b has prefix[b] cached tokens and extend[b] new ones (NaN elsewhere)."""
    P = m.make_problem([p + n for p, n in zip(prefix, extend)], H, Hkv, D, dtype, device, scattered, seed)
    q = torch.randn(sum(extend), H, D, generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)
    return (q, *P[1:5], prefix, extend)


EXTEND_CASES = [  # (dtype, n_q_heads, n_kv_heads, head_dim, prefix lens, extend lens)
    (torch.float32, 9, 3, 64, [0, 0, 0], [1, 2, 37]),          # no prefix: plain causal prefill; SmolLM2's heads
    (torch.float32, 8, 2, 128, [70, 5, 130], [1, 1, 1]),        # 1-token extends: decode written as an extend
    (torch.float32, 4, 4, 64, [150, 0, 63], [20, 65, 64]),      # long prefixes, tile edges, no GQA
    (torch.float16, 9, 3, 64, [17, 100], [31, 3]),
    (torch.bfloat16, 8, 2, 128, [64, 1], [16, 80]),
    (torch.bfloat16, 6, 2, 64, [0, 33], [90, 7]),
]


@pytest.mark.parametrize("dtype,H,Hkv,D,prefix,extend", EXTEND_CASES,
                         ids=[f"{str(c[0])[6:]}-{c[1]}/{c[2]}-d{c[3]}-{len(c[4])}req" for c in EXTEND_CASES])
def test_extend_matches_reference(dtype, H, Hkv, D, prefix, extend):
    """The prefill kernel against float64: each new token sees the cached prefix and the new tokens up to itself."""
    seed = int(torch.randint(0, 10**6, ()))
    P = extend_problem(prefix, extend, H, Hkv, D, dtype, scattered=seed % 4 != 0, seed=seed)
    out, ref = extend_and_check(P, m.TOLERANCE[dtype])  # poisoned: every element must be written
    torch.testing.assert_close(out.double(), ref, atol=ATOL[dtype], rtol=ATOL[dtype])


def test_extend_random_ragged_batches():
    """Random head layouts, prefixes, extends and tile sizes: the extend kernel equals float64."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    rand = lambda lo, hi: int(torch.randint(lo, hi, (), generator=g))
    for _ in range(6):
        Hkv, group, D = rand(1, 3), [1, 2, 3, 4][rand(0, 4)], [64, 128][rand(0, 2)]
        B = rand(1, 4)
        P = extend_problem([rand(0, 90) for _ in range(B)], [rand(1, 40) for _ in range(B)], Hkv * group, Hkv, D,
                           torch.float32, seed=rand(0, 10**6))
        cfg = dict(rows=[16, 32, 256][rand(0, 3)], block_n=[16, 64][rand(0, 2)])  # small tiles: many blocks, phases
        extend_and_check(P, 1e-5, **cfg)


@pytest.mark.parametrize("page", [4, 16, 23, 64])
def test_pages_decode_and_extend(page):
    """page > 1: the kernels read 02's block tables and 01's rows (23: no power of two)."""
    seed = int(torch.randint(0, 10**6, ()))
    P = m.paged_problem(m.make_problem([1, 5, 23, 70], 6, 2, 64, torch.float32, seed=seed), page, seed)
    run_and_check(P, torch.float32, page=page, num_splits=[None, 1, 3][seed % 3])
    run_and_check(P, torch.float32, page=page, pdl=True)
    E = m.paged_problem(extend_problem([0, 3, 40], [9, 1, 30], 6, 2, 64, torch.float32, seed=seed), page, seed)
    extend_and_check(E, 1e-5, page=page, rows=32, block_n=16)  # small tiles: many, across pages


def test_token_backend_prefill_through_the_kernel():
    """03's TokenKVCache with the extend kernel gives the model's own prefill."""
    L, T = importlib.import_module("llama3_generate"), importlib.import_module("03_token_allocator")
    model = random_model(L.ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, hidden_dim=128,
                                     max_seq_len=256), "cpu", torch.float32, seed=int(torch.randint(0, 10**6, ())))
    logits = []
    for kernel in (False, True):
        kv = T.TokenKVCache.for_model(model, 256, 4, 128)
        kv.extend_attn = m.token_extend_attention if kernel else None
        torch.manual_seed(3)
        prompts = [torch.randint(0, 64, (n,)) for n in (5, 40, 17)]
        out = model(torch.cat(prompts), kv.prepare([0, 1, 2], [5, 40, 17]), kv, logits_at=torch.tensor([4, 44, 61]))
        kv.add_prefix(3, kv.slots(1)[:30])  # a new request reusing 30 cached tokens, extended by 12
        out2 = model(torch.randint(0, 64, (12,)), kv.prepare([3], [12]), kv)
        logits.append((out, out2))
    for a, b in zip(*logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("H,Hkv,D", [(32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_extend_matches_reference_and_flash_attn(H, Hkv, D, dtype):
    """Compiled, at realistic sizes: float64, and flash-attn where installed."""
    prefix, extend = [0, 700, 3, 1500], [300, 1, 257, 64]
    P = extend_problem(prefix, extend, H, Hkv, D, dtype, seed=int(torch.randint(0, 10**6, ())))
    P = tuple(x.cuda() if torch.is_tensor(x) else x for x in P)
    out, _ = extend_and_check(P, m.TOLERANCE[dtype])
    if dtype == torch.float32:
        return
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        pytest.skip("flash-attn not installed: compared with the float64 reference only")
    q, kp, vp, r2t, rows = P[:5]
    k, v = (torch.cat([x[r2t[r, :p + n].long()] for r, p, n in zip(rows.tolist(), prefix, extend)]) for x in (kp, vp))
    cu = lambda lens: torch.tensor([0] + lens, device="cuda").cumsum(0).int()
    ref = flash_attn_varlen_func(q, k, v, cu(extend), cu([p + n for p, n in zip(prefix, extend)]), max(extend),
                                 max(p + n for p, n in zip(prefix, extend)), causal=True)
    assert m.rel_err(out, ref.double()) <= m.TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])  # interpreter:
def test_pointwise_kernels_equal_the_models_functions(dtype):                       # bf16 arithmetic is garbage
    """rms_norm (with the residual add and without), apply_rope and swiglu kernels equal the model's functions in
    float64, on the model's views."""
    import llama3_generate as L
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    rand = lambda *s: torch.randn(*s, generator=g).to(dev, dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for T, H, D, dim, hidden in ((5, 9, 64, 576, 1536), (3, 8, 128, 1024, 2816), (1, 3, 64, 96, 40)):
        x, w = rand(T, dim), rand(dim)
        torch.testing.assert_close(m.rms_norm(x, w, 1e-5).double(), L.rms_norm(x.double(), w.double(), 1e-5), **tol)
        res = rand(T, dim)  # the residual add inside the norm: (the norm of x + res, x + res)
        for got, want in zip(m.rms_norm(x, w, 1e-5, res), L.rms_norm(x.double(), w.double(), 1e-5, res.double())):
            torch.testing.assert_close(got.double(), want, **tol)
        qkv = rand(T, (H + 2) * D)  # q and k as views of one projection's output, as the model splits them
        q, pos = qkv[:, :H * D].view(T, H, D), torch.randint(0, 4096, (T,), generator=g)
        cos, sin = (t[pos].to(dev) for t in L.rope_tables(L.ModelArgs(dim=H * D, n_heads=H, max_seq_len=4096)))
        want = L.apply_rope(q.double(), cos.double(), sin.double())
        torch.testing.assert_close(m.apply_rope(q, cos, sin).double(), want, **tol)
        pools = [torch.full((64, 2, D), float("nan"), dtype=dtype, device=dev) for _ in range(4)]  # poisoned
        slots, (k, v) = torch.randperm(64, generator=g)[:T].to(dev), qkv.view(T, H + 2, D)[:, H - 2:].split(2, 1)
        m.store_kv(*pools[:2], slots, k, v)
        pools[2][slots], pools[3][slots] = k, v  # PyTorch's two scatters
        assert all(torch.equal(a.nan_to_num(7), b.nan_to_num(7)) for a, b in zip(pools[:2], pools[2:]))
        gate, up = rand(T, 2 * hidden).chunk(2, -1)
        torch.testing.assert_close(m.swiglu(gate, up).double(), L.swiglu(gate.double(), up.double()), **tol)
