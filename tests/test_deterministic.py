"""Issue 64: deterministic (batch-invariant) mode. The needle test (vLLM's and SGLang's): a prompt
runs alone, then at a random position in batches of random sizes with random other prompts, with and
without a cached prefix, chunked and not, mixed steps and not, on every backend; in deterministic
mode its tokens and logprobs are the same bits every time. The same trials with the mode off must
find a difference (the negative test: proof that they can fail). The mode's pieces are checked
against float64 too (consistent garbage would pass the needle test)."""
import random

import pytest
import torch

import llama3_generate as L

NOTOK = type("NoTok", (), {"stop_ids": [], "eos_id": -1})()  # no stop token: max_new_tokens each
NEW = 12  # tokens each needle generates


def needle_model(dtype=torch.float32, device="cpu", seed=0, n_kv_heads=2):
    """A random 2-layer Llama (4 heads, GQA 4:2 by default, head_dim 32), weights (std 0.3) big
    enough for rounding to show."""
    torch.manual_seed(seed)
    args = L.ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, vocab_size=256, hidden_dim=256,
                       max_seq_len=256, rope_theta=10000.0)
    with torch.device(device):
        model = L.Transformer(args).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model.to(dtype)


class Engines:
    """One engine per backend, reset between runs (no cached prefix left; its CUDA graphs stay), its
    schedule and chunking set per run."""

    def __init__(self, model, **kw):
        self.model, self.kw, self.engines = model, kw, {}

    def get(self, backend="token", block_size=16, chunk_tokens=None, schedule="prefill-first"):
        key = (backend, block_size)
        if key not in self.engines:
            self.engines[key] = L.Engine(self.model, NOTOK, backend=backend, block_size=block_size,
                                         kv_tokens=4096, max_batch=16, **self.kw)
        e = self.engines[key]
        e.reset()
        e.sched.set_schedule(schedule == "mixed", chunk_tokens)
        return e


def needle_run(e, prompts, at: int, params, warm=()):
    """Serve `prompts` together (`warm` first, alone, into the radix cache); returns the needle's
    (prompts[at]) tokens and logprobs."""
    for w in warm:
        e.add(w, L.SamplingParams(max_new_tokens=2))
        e.run()
    first = e.n_seqs
    for i, p in enumerate(prompts):
        other = L.SamplingParams(max_new_tokens=random.randint(1, NEW + 4))
        e.add(p, params if i == at else other)
    e.run()
    seq = next(s for s in e.sched.finished if s.rid == first + at)
    return seq.output, [lp for lp, _ in seq.logprobs]


def trial_options(rng):
    """One trial's company and engine: batch size, cache, chunking, schedule, backend."""
    backend = rng.choice(["token", "paged", "contiguous"])
    return dict(n=rng.randint(2, 10), cached=backend != "contiguous" and rng.random() < 0.5,
                kw=dict(backend=backend, block_size=rng.choice([4, 16]),
                        chunk_tokens=rng.choice([None, rng.randint(8, 40)]),
                        schedule=rng.choice(["prefill-first", "mixed"])))


def needle_trials(model, deterministic: bool, trials: int, seed=0, params=None) -> list:
    """One needle alone, then in `trials` random companies: the trials whose needle differed."""
    rng, vocab = random.Random(seed), model.args.vocab_size
    random.seed(seed)
    words = lambda n: [rng.randrange(vocab) for _ in range(n)]
    needle = words(rng.randint(20, 60))
    params = params or L.SamplingParams(max_new_tokens=NEW, logprobs=1)
    engines = Engines(model, deterministic=deterministic)
    alone = needle_run(engines.get(), [needle], 0, params)
    moved = []
    for t in range(trials):
        o = trial_options(rng)
        others = [words(rng.randint(1, 90)) for _ in range(o["n"] - 1)]
        at = rng.randrange(o["n"])
        prompts = others[:at] + [needle] + others[at:]
        # a cached prefix: a prompt sharing the needle's first tokens runs before
        warm = [needle[:rng.randint(8, len(needle))] + words(3)] if o["cached"] else []
        if needle_run(engines.get(**o["kw"]), prompts, at, params, warm) != alone:
            moved.append((t, o, at))
    return moved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_needle_is_bit_identical_in_any_company(dtype):
    model = needle_model(dtype)
    assert needle_trials(model, True, trials=12, seed=int(torch.randint(0, 10**6, ()))) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_needle_moves_with_the_mode_off(dtype):
    """The negative test: without the mode the same trials find the needle's logprobs moved, so the
    test above can fail."""
    assert needle_trials(needle_model(dtype), False, trials=12, seed=1)


@pytest.mark.parametrize("seed", [7, None])
def test_sampling_is_the_same_in_any_company(seed):
    """temperature > 0: each request draws from its own seeded stream (without a seed: seeded with
    the engine's), so the same seed gives the same text."""
    params = L.SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=seed, logprobs=1)
    assert needle_trials(needle_model(), True, trials=6, seed=2, params=params) == []


@pytest.mark.gpu
@pytest.mark.parametrize("logprobs", [None, 1])  # None: greedy, the multi-step CUDA-graph path
def test_needle_on_a_gpu(logprobs):
    """On a GPU: 04's kernels, CUDA graphs, multi-step decode. The negative test compares logprobs
    (on a random model greedy tokens rarely flip; their logprobs always move)."""
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
        e = L.Engine(model, NOTOK, kv_tokens=256, max_batch=2, deterministic=mode)
        logits[mode] = model(prompt, e.kv.prepare([0], [len(prompt)]), e.kv)
    assert (logits[True] - logits[False]).abs().max() <= 1e-4 * logits[False].abs().max()


def invariant_rows(linear, dtype, device, K=96, N=80, ms=(1, 2, 3, 5, 17, 33, 70)):
    """The needle row's bits from `linear` at a random place among M random rows, for each M (one
    value if the rows are invariant); each product checked against float64."""
    w, needle = (torch.randn(*shape, device=device).to(dtype) for shape in ((N, K), (K,)))
    got = set()
    for M in ms:
        x = torch.randn(M, K, device=device).to(dtype)
        i = random.randrange(M)
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
    """A query's output, the same bits whether its prompt ran whole, as a chunk after a cached
    prefix, or it is a decode step's; the whole prompt's checked against float64."""
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
    L04 = L.lesson("04_triton_token_attn")
    cuda = torch.cuda.is_available()
    one_reduction(L04.deterministic_extend_attention, L04.deterministic_decode_attention,
                  "cuda" if cuda else "cpu", torch.bfloat16 if cuda else torch.float32)


@pytest.mark.triton
def test_invariant_matmul_kernel():
    cuda = torch.cuda.is_available()
    matmul = L.lesson("04_triton_token_attn").invariant_matmul
    dtype, device = (torch.bfloat16, "cuda") if cuda else (torch.float32, "cpu")
    rows = invariant_rows(matmul, dtype, device, ms=(1, 3, 70, 300))
    assert len(rows) == 1
