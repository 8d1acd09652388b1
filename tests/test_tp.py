"""Tensor parallelism (llama3_generate.py's shard_model): 2 CPU processes over gloo give exactly TP 1's tokens, on
every KV backend in pools where requests wait and are preempted; the command line in two ranks prints them once; a
model whose heads do not split is refused. On 2 GPUs (`pytest -m gpu tests/test_tp.py`) the same runs over NCCL."""
import contextlib
import io
import json
import multiprocessing
import os
import signal
import socket
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

import llama3_generate as L
from helpers import (NOTOK, PROMPTS, SHAPES, meta_state_dict, needle_model, needle_trials, random_model, refuses,
                     tokens, train_tokenizer)

PROMPTS, MAX_NEW = PROMPTS[:5], 16  # several prompts, in pools of about one and a half sequences


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A fresh Hugging Face directory of the CLI tests' GQA-4 shape and tokenizer, written without transformers."""
    s, tok, root = SHAPES["gqa4"], train_tokenizer(), str(tmp_path_factory.mktemp("tp"))
    args = L.ModelArgs(dim=s["dim"], n_layers=2, n_heads=s["n_heads"], n_kv_heads=s["n_kv_heads"],
                       vocab_size=tok.get_vocab_size(), hidden_dim=s["hidden_dim"], rope_theta=s["rope_theta"],
                       max_seq_len=2048, tie_embeddings=s["tie"])
    torch.manual_seed(int(torch.randint(0, 10**6, ())))
    ours = {k: v.normal_(0, 0.2) for k, v in meta_state_dict(L.Transformer(args)).items()}
    save_file({hf: ours[name].contiguous() for hf, name in L.hf_names(2).items()}, f"{root}/model.safetensors")
    json.dump({"model_type": "llama", "hidden_size": s["dim"], "num_hidden_layers": 2, "num_attention_heads":
               s["n_heads"], "num_key_value_heads": s["n_kv_heads"], "vocab_size": args.vocab_size,
               "intermediate_size": s["hidden_dim"], "rms_norm_eps": 1e-5, "rope_theta": s["rope_theta"],
               "max_position_embeddings": 2048, "tie_word_embeddings": s["tie"]}, open(f"{root}/config.json", "w"))
    tok.save(f"{root}/tokenizer.json")
    return root


@pytest.fixture(scope="module")
def tp1(checkpoint):
    """(options by name, TP 1's tokens and preemptions for each): every backend, in pools where requests wait."""
    _, tok = L.load_model(checkpoint)
    small = max(len(tok.chat(p)) for p in PROMPTS) + MAX_NEW + 24
    options = {"contiguous": dict(backend="contiguous", kv_tokens=2 * small),
               "paged-swap": dict(backend="paged", kv_tokens=small, block_size=8, preempt="swap", reserve=False),
               "token-recompute": dict(backend="token", kv_tokens=small, reserve=False)}  # admit what fits now
    return options, tp_tokens(checkpoint, options)


def tp_tokens(path, options, device="cpu"):
    """Every config's greedy tokens and preemptions: TP 1 here, or one rank of TP N under torch.distributed."""
    model, tok = L.load_model(path, device)
    if torch.distributed.is_initialized():  # a rank
        L.shard_model(model, torch.distributed.get_rank(), torch.distributed.get_world_size())
    out = {}
    for name, kw in options.items():
        e = L.FastEngine(model, tok, **kw)
        for p in PROMPTS:
            e.add(tok.chat(p), L.SamplingParams(max_new_tokens=MAX_NEW))
        out[name] = dict(tokens=list(e.run().values()), preemptions=e.stats["preemptions"],
                         kv_heads=e.kv.layer_pools(0)[0].shape[1])  # the heads this process's KV pool holds
    return out


def rank_main(rank, world, port, result, fn, args):
    """One rank, as torchrun starts it (its environment): fn(*args), its result saved for the test."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    json.dump(fn(*args), open(f"{result}.{rank}", "w"))


def run_ranks(world, fn, *args, tmp_path, device="cpu", timeout=240):
    """fn(*args) in `world` fresh processes; each rank's result. A rank that fails or hangs fails the test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # forked on Linux CPUs: the ranks start with torch and the model's code imported (CUDA does not survive a fork)
    ctx = multiprocessing.get_context("fork" if sys.platform == "linux" and device == "cpu" else "spawn")
    result = str(tmp_path / "rank")
    procs = [ctx.Process(target=rank_main, args=(r, world, port, result, fn, args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
    assert not hung and all(p.exitcode == 0 for p in procs), ("ranks failed or hung", [p.exitcode for p in procs])
    return [json.load(open(f"{result}.{r}")) for r in range(world)]


def tp_tokens_rank(path, options, device="cpu"):
    """tp_tokens() as one rank of a group joined by the command line's own tp_launch (gloo, or NCCL on GPUs)."""
    L.tp_launch(SimpleNamespace(tp=int(os.environ["WORLD_SIZE"]), device=device), [])
    return tp_tokens(path, options, device)


def cli_rank(*argv):
    """`torchrun --nproc-per-node N llama3_generate.py ARGV`, this rank's part: main(argv); (stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        L.main(list(argv))
    return out.getvalue(), err.getvalue()


GPUS = lambda n: [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} GPUs")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPUS(2))])
def test_two_ranks_give_tp1_tokens_on_every_backend(checkpoint, tp1, tmp_path, device):
    """Two ranks over gloo, or NCCL on 2 GPUs (04's kernels, CUDA graphs capturing the all-reduces): TP 1's tokens."""
    options, want = tp1
    want = want if device == "cpu" else tp_tokens(checkpoint, options, device)
    got, _ = run_ranks(2, tp_tokens_rank, checkpoint, options, device, tmp_path=tmp_path, device=device)
    for name in options:  # each rank's pool holds half the KV heads, of any backend
        assert got[name] == dict(want[name], kv_heads=want[name]["kv_heads"] // 2) and got[name]["kv_heads"], name
    assert device != "cpu" or want["paged-swap"]["preemptions"] > 0 and want["token-recompute"]["preemptions"] > 0


def test_cli_under_torchrun_prints_tp1_tokens_once(checkpoint, tp1, tmp_path):
    """The command line in 2 ranks: rank 0 tokenizes, sizes the pool, samples and prints; rank 1 says nothing."""
    options, want = tp1
    (out, err), quiet = run_ranks(2, cli_rank, "--model", checkpoint, "--json", "--max-new-tokens", str(MAX_NEW),
                                  "--kv-tokens", str(options["token-recompute"]["kv_tokens"]), *PROMPTS,
                                  tmp_path=tmp_path)
    outs = [json.loads(line) for line in out.splitlines()]
    assert tokens(outs) == want["token-recompute"]["tokens"] and "preemption" in err
    assert quiet == ["", ""]


def rank_model(seed, device):
    """A tiny random model, the same on every rank (no near ties), sharded under torchrun's variables."""
    if "WORLD_SIZE" in os.environ:
        device = L.tp_launch(SimpleNamespace(tp=int(os.environ["WORLD_SIZE"]), device=device), [])[2]
    args = L.ModelArgs(dim=128, n_layers=1, n_heads=8, n_kv_heads=4, vocab_size=384, hidden_dim=128, max_seq_len=64)
    model = L.Transformer(args).to(device).eval()
    for p in model.parameters():
        p.data.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel() + seed)) * 0.3)
    if torch.distributed.is_initialized():
        L.shard_model(model, torch.distributed.get_rank(), torch.distributed.get_world_size())
    return model


def fused_decode_tokens(seed, device="cpu"):
    """rank_model's batch-1 decode through 04's fused kernels: tokens, and the graphs' fused flag."""
    model = rank_model(seed, device)
    e = L.FastEngine(model, NOTOK, "token", kv_tokens=64, cuda_graphs=True, max_batch=1, multi_step=4)
    for t in (0.0, 1.0):
        e.add(list(range(5, 12)), L.SamplingParams(max_new_tokens=8, temperature=t, seed=seed))
    return list(e.run().values()), e.graphs.fused


def graph_decode_tokens(seed, device="cpu"):
    """rank_model's requests through the graphs of batches (no batch-1 kernels): greedy and sampled."""
    model = rank_model(seed, device)
    e = L.FastEngine(model, NOTOK, "token", kv_tokens=256, cuda_graphs=True, max_batch=4, multi_step=4, fused=False)
    for i, t in enumerate((0.0, 1.0, 0.0, 0.0)):
        e.add(list(range(5 + i, 12 + 2 * i)), L.SamplingParams(max_new_tokens=8 + 3 * i, temperature=t, seed=seed))
    return list(e.run().values())


@pytest.mark.parametrize("world", [2, 4])
def test_split_head_under_tp_gives_tp1_tokens(world, tmp_path):
    """TP 2 and 4 over gloo through the graphs of batches, each rank its rows of the logits: TP 1's tokens."""
    seed = int(torch.randint(0, 10**6, ()))
    want = graph_decode_tokens(seed)
    assert run_ranks(world, graph_decode_tokens, seed, tmp_path=tmp_path) == [want] * world


@pytest.mark.parametrize("device,world", [("cpu", 2), pytest.param("cuda", 2, marks=GPUS(2)),
                                          pytest.param("cuda", 4, marks=GPUS(4))])
def test_fused_batch1_kernels_under_tp_give_tp1_tokens(device, world, tmp_path):
    """TP over gloo or GPUs through 04's fused batch-1 kernels: TP 1's greedy and sampled tokens."""
    seed = int(torch.randint(0, 10**6, ()))
    want = fused_decode_tokens(seed, device)
    got = run_ranks(world, fused_decode_tokens, seed, device, tmp_path=tmp_path, device=device)
    assert want[1] and got == [[want[0], True]] * world, (want, got)


def test_lamport_sum_adds_every_ranks_push_in_rank_order():
    """04's Lamport all-reduce, 3 ranks simulated: fp64's sum within rounding, the same bits on all, slots emptied."""
    m04, world, dim, cap = L.lesson("04_triton_token_attn"), 3, 64, 96
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("a sum waited for a push that never landed"))
    signal.alarm(30)  # (the test takes a second)
    for dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
        slots = [torch.full((2, world * cap), -1, dtype=bits).view(dtype) for _ in range(world)]
        peers = [torch.tensor([s[use].data_ptr() for s in slots]) for use in (0, 1)]
        for use, n in ((1, dim), (0, dim), (1, dim), (0, 96), (1, 32)):
            x, w, res = torch.randn(world, 32), torch.randn(world, n, 32), torch.randn(n)
            part = [((res if r == 0 else 0) + w[r] @ x[r]).to(dtype) for r in range(world)]  # a batch's, per rank
            if n == 96:  # a NaN with an empty slot's bits (all ones) is pushed as another NaN, or the sum would wait
                part[2].view(bits)[5] = -1
            sets = [s[use, :world * n].view(bits).view(world, n) for s in slots]
            for r in range(world):
                if n == dim:
                    m04.gemv(x[r].to(dtype), w[r].to(dtype), sets[r][r].view(dtype), config=(4, 32, 4),
                             residual=res.to(dtype) if r == 0 else None, push=peers[use] + r * n * res.to(dtype)
                             .element_size())
                elif r:
                    m04.lamport_push(part[r], peers[use], r)
            poison = lambda: torch.full((n,), float("nan"), dtype=dtype)
            got = [m04.lamport_all_reduce(part[0], slots[0][use], peers[use], 0, out=poison())
                   if n != dim and r == 0 else m04.lamport_sum(sets[r], poison(), pdl=False) for r in range(world)]
            want = res.double() + torch.einsum("rnk,rk->n", w.double(), x.double())
            assert all(torch.equal(g.view(bits), got[0].view(bits)) for g in got)
            assert all((s.view(bits) == -1).all() for s in slots)
            nan = torch.isnan(got[0])
            assert nan.sum() == (n == 96) and (n != 96 or nan[5]), nan.nonzero()
            err = (got[0].double() - want)[~nan].norm() / want[~nan].norm()
            assert err < (1e-6 if dtype == torch.float32 else 2e-2)
    signal.alarm(0)


def tp_sum_rows(seed: int):
    """One rank: the batch sizes whose rows' TPSum bits moved, each way, and whether ordered sums in rank order."""
    L.tp_launch(SimpleNamespace(tp=int(os.environ["WORLD_SIZE"]), device="cpu"), [])
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    g = [torch.Generator().manual_seed(seed + r) for r in range(world)]
    xs = [torch.randn(64, 1024, generator=g[r]) * 10.0 ** torch.randint(-3, 4, (64, 1), generator=g[r])
          for r in range(world)]
    fake = SimpleNamespace(tok_embeddings=SimpleNamespace(weight=torch.zeros(8, 4)), args=SimpleNamespace(vocab_size=8))
    tp_sum, moved = L.TPSum(fake, rank, world), {}
    for ordered in (False, True):
        tp_sum.ordered = ordered
        whole = tp_sum(xs[rank].clone())
        moved[ordered] = [k for k in (1, 2, 3, 5, 17, 33) if not torch.equal(tp_sum(xs[rank][:k].clone()), whole[:k])]
    in_order = sum(xs[1:], xs[0])  # rank 0 + rank 1 + ..., in that order
    return dict(all_reduce=moved[False], ordered=moved[True], rank_order=torch.equal(whole, in_order))


@pytest.mark.parametrize("world", [3, 4])
def test_deterministic_tp_sums_a_row_in_rank_order_whatever_the_batch(world, tmp_path):
    """Deterministic TP sums a row in rank order, the same bits alone and in a batch; gloo's ring (3+ ranks) not."""
    got = run_ranks(world, tp_sum_rows, int(torch.randint(0, 10**6, ())), tmp_path=tmp_path)
    assert all(r["ordered"] == [] for r in got), f"ordered sums moved with the batch at sizes {got}"
    assert all(r["rank_order"] for r in got), "an ordered sum is not rank 0 + rank 1 + ... in that order"
    assert any(r["all_reduce"] for r in got), "gloo's all-reduce never moved a row: the test could not fail"


def tp_needle(seed: int, deterministic: bool):
    """One rank of TP 4 (gloo): test_deterministic's needle, alone and in random company: the trials it moved."""
    L.tp_launch(SimpleNamespace(tp=int(os.environ["WORLD_SIZE"]), device="cpu"), [])
    model = needle_model(n_kv_heads=4)  # 4 heads of each: one per rank
    L.shard_model(model, torch.distributed.get_rank(), torch.distributed.get_world_size())
    return [t for t, *_ in needle_trials(model, deterministic, trials=4, seed=seed)]


def test_deterministic_needle_under_tp_4(tmp_path):
    """At TP 4 in deterministic mode the needle's tokens and logprobs are the same bits in every company."""
    got = run_ranks(4, tp_needle, int(torch.randint(0, 10**6, ())), True, tmp_path=tmp_path)
    assert got == [[]] * 4, f"the trials whose needle moved, per rank: {got}"


def test_tp_flag_starts_ranks_and_one_speaks(capfd):
    """--tp 2 starts 2 ranks as torchrun would; both refuse a bad --device, rank 0 alone says so, status non-zero."""
    code, err = refuses(SystemExit, L.main, ["--tp", "2", "--device", "tpu", "Hi"]).code, capfd.readouterr().err
    assert code == 1 and err.strip() == "error: unknown device 'tpu' (try cpu or cuda)", err


def test_heads_that_do_not_split_are_refused():
    """SmolLM2's attention (9 query / 3 KV heads) over 2 ranks: one line naming the head counts, nothing changed."""
    model = random_model(L.ModelArgs(n_layers=1, vocab_size=64, max_seq_len=64), device="cpu", dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    refuses(L.UserError, L.shard_model, model, 0, 2, match=r"9 query and 3 KV heads do not split into 2")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

