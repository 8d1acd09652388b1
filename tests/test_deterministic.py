"""Issue 64: deterministic (batch-invariant) mode. The needle test (vLLM's and SGLang's): a prompt alone, then in
random company (cached prefixes, chunks, mixed steps, every backend) gives the same bits in the mode, and not without
it (the negative test); the mode's pieces are checked against float64 too (consistent garbage would pass)."""
import random

import pytest
import torch

import llama3_generate as L
from helpers import NEW, NOTOK, needle_model, needle_trials


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_needle_is_bit_identical_in_any_company(dtype):
    assert needle_trials(needle_model(dtype), True, trials=12, seed=int(torch.randint(0, 10**6, ()))) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_needle_moves_with_the_mode_off(dtype):
    """The negative test: without the mode the same trials find the needle's logprobs moved."""
    assert needle_trials(needle_model(dtype), False, trials=12, seed=1)


@pytest.mark.parametrize("seed", [7, None])
def test_sampling_is_the_same_in_any_company(seed):
    """temperature > 0: each request draws from its own seeded stream, so the same seed gives the same text."""
    params = L.SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=seed, logprobs=1)
    assert needle_trials(needle_model(), True, trials=6, seed=2, params=params) == []


@pytest.mark.gpu
@pytest.mark.parametrize("logprobs", [None, 1])  # None: greedy, the multi-step CUDA-graph path
def test_needle_on_a_gpu(logprobs):
    """On a GPU: 04's kernels, CUDA graphs, multi-step decode (the negative test compares logprobs)."""
    params = L.SamplingParams(max_new_tokens=NEW, logprobs=logprobs)
    model = needle_model(torch.bfloat16, "cuda")
    assert needle_trials(model, True, trials=16, seed=3, params=params) == []
    if logprobs:
        model = needle_model(torch.bfloat16, "cuda")
        assert needle_trials(model, False, trials=16, seed=3, params=params)


def test_deterministic_logits_are_the_models():
    """The mode's model (its matmuls and attention) gives the default's logits up to rounding."""
    model, prompt = needle_model(), torch.randint(0, 256, (40,))
    logits = {}
    for mode in (False, True):
        e = L.FastEngine(model, NOTOK, kv_tokens=256, max_batch=2, deterministic=mode)
        logits[mode] = model(prompt, e.kv.prepare([0], [len(prompt)]), e.kv)
    assert (logits[True] - logits[False]).abs().max() <= 1e-4 * logits[False].abs().max()


def invariant_rows(linear, dtype, device, K=96, N=80, ms=(1, 2, 3, 5, 17, 33, 70)):
    """The needle row's bits from `linear` among M random rows, for each M (one value: invariant); vs float64."""
    w, needle = (torch.randn(*shape, device=device).to(dtype) for shape in ((N, K), (K,)))
    got = set()
    for M in ms:
        x, i = torch.randn(M, K, device=device).to(dtype), random.randrange(M)
        x[i] = needle
        y, ref = linear(x, w), x.double() @ w.double().t()
        assert (y.double() - ref).abs().max() <= 2e-2 * ref.abs().max(), M
        got.add(y[i].double().sum().item())
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_linear_on_a_cpu(dtype):
    assert len(invariant_rows(L.invariant_linear, dtype, "cpu")) == 1
    # what it fixes: F.linear's row at M = 1 (a GEMV) and 2-3 has other bits than at 4+ (fp32)
    assert len(invariant_rows(torch.nn.functional.linear, torch.float32, "cpu")) > 1


def attention_problem(device, dtype, Hkv=2, G=3, D=32, slots=300):
    """One request of n tokens at random slots of a pool holding NaN elsewhere; q for all n."""
    n = int(torch.randint(40, 140, ()))
    kp, vp = (torch.full((slots, Hkv, D), float("nan"), device=device).to(dtype) for _ in range(2))
    table = torch.randperm(slots, device=device)[:n].int()[None]
    for pool in (kp, vp):
        pool[table[0].long()] = torch.randn(n, Hkv, D, device=device).to(dtype)
    return torch.randn(n, Hkv * G, D, device=device).to(dtype), kp, vp, table, n


def one_reduction(extend, decode, device, dtype):
    """A query's output is the same bits whole, as a chunk after a cached prefix, or as a decode step's."""
    q, kp, vp, table, n = attention_problem(device, dtype)
    whole = extend(q, kp, vp, table, [0], [0], [n])
    k, v = (p[table[0].long()].double() for p in (kp, vp))
    ref = L.lesson("01_kv_cache").attend_dense(q.double(), k, v)
    assert (whole.double() - ref).abs().max() <= (1e-5 if dtype == torch.float32 else 2e-2)
    for cut in (1, n // 3, n - 1):  # a cached prefix of `cut` tokens, the rest in one chunk
        assert torch.equal(extend(q[cut:], kp, vp, table, [0], [cut], [n - cut]), whole[cut:])
    lens = torch.tensor([n], device=device)
    assert torch.equal(decode(q[-1:], kp, vp, table, torch.zeros_like(lens), lens), whole[-1:])


def test_attend_pieces_is_one_reduction():
    one_reduction(L.attend_pieces, L.decode_pieces, "cpu", torch.float32)


@pytest.mark.triton
def test_attention_kernel_is_one_reduction():
    L04, cuda = L.lesson("04_triton_token_attn"), torch.cuda.is_available()
    one_reduction(L04.deterministic_extend_attention, L04.deterministic_decode_attention,
                  "cuda" if cuda else "cpu", torch.bfloat16 if cuda else torch.float32)


@pytest.mark.triton
def test_invariant_matmul_kernel():
    cuda, matmul = torch.cuda.is_available(), L.lesson("04_triton_token_attn").invariant_matmul
    dtype, device = (torch.bfloat16, "cuda") if cuda else (torch.float32, "cpu")
    assert len(invariant_rows(matmul, dtype, device, ms=(1, 3, 70, 300))) == 1


@pytest.mark.triton
def test_invariant_swiglu_is_the_models_swiglu_in_one_kernel():
    """The fused gate-and-up product: the bits of the matmul then 04's swiglu, whatever M; float64's answer."""
    L04, cuda = L.lesson("04_triton_token_attn"), torch.cuda.is_available()
    dtype, device = (torch.bfloat16, "cuda") if cuda else (torch.float32, "cpu")
    w13 = torch.randn(2 * 48, 64, device=device).to(dtype)
    for M in (1, 5, 70):
        x = torch.randn(M, 64, device=device).to(dtype)
        fused = L04.invariant_swiglu(x, w13)
        assert torch.equal(fused, L04.swiglu(*L04.invariant_matmul(x, w13).chunk(2, -1)))
        ref = L.swiglu(*(x.double() @ w13.double().t()).chunk(2, -1))
        assert (fused.double() - ref).abs().max() <= 2e-2 * ref.abs().max(), M


SHAPES = {"Llama-3.2-1B": dict(dim=2048, hidden=8192, qkv=3072, vocab=128256),
          "SmolLM2-135M": dict(dim=576, hidden=1536, qkv=960, vocab=49152)}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_invariant_matmul_tiles_keep_the_bits_on_a_gpu(shape):
    """The tile follows M (matmul_tiles), the bits of a needle row do not, on every product of the model."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    L04, s = L.lesson("04_triton_token_attn"), SHAPES[shape]
    tiles = set()
    for N, K, glu in ((s["qkv"], s["dim"], False), (s["dim"], s["dim"], False), (2 * s["hidden"], s["dim"], True),
                      (s["dim"], s["hidden"], False), (s["vocab"], s["dim"], False)):
        w, needle, got = torch.randn(N, K, device="cuda").bfloat16() * 0.05, torch.randn(K, device="cuda"), set()
        for M in (1, 16, 64, 256, 1024):
            x, i = torch.randn(M, K, device="cuda").bfloat16(), random.randrange(M)
            x[i] = needle
            got.add(L04.invariant_matmul(x, w, glu=glu)[i].float().cpu().numpy().tobytes())
            tiles.add(L04.matmul_tiles(M, N // (1 + glu), x.dtype, L04.num_sms(x.device)))
        assert len(got) == 1, (N, K, glu)
    assert len(tiles) >= 3  # the tiles did move with M
