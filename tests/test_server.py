"""The server, `llama3_generate.py --serve`, through OpenAI's own Python client on loopback, on a small random Llama
in GGUF (fresh weights each run): greedy answers equal the command line's or the engine's alone, sampled ones are
reproducible under load, and the pool is counted after."""
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import jsonschema
import pytest
import torch

import llama3_generate as L

openai = pytest.importorskip("openai")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = "sea sky red cat dog tree code cache token batch paris river stone light night blue green fast slow".split()


def words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from helpers import write_checkpoints
    paths, _ = write_checkpoints(str(tmp_path_factory.mktemp("srv")), "smol", int(torch.randint(0, 10**6, ())))
    return paths["gguf"]


@contextlib.contextmanager
def running(*argv):
    """`llama3_generate.py --serve --port 0 ARGV` on a thread of this process: its URL, engine and thread."""
    got = {}

    def run_server():  # its exit status, if it exits with one
        try:
            L.serve(L.cli_args(["--serve", "--port", "0", "--quiet", *argv]), lambda p, w: got.update(port=p, w=w))
        except SystemExit as e:
            got["exit"] = e.code
    t = threading.Thread(target=run_server)
    t.start()
    for _ in range(1200):  # bounded: 120 s
        if "w" in got:
            break
        time.sleep(0.1)
    url = f"http://127.0.0.1:{got['port']}/v1"
    try:
        yield SimpleNamespace(url=url, engine=got["w"].engine, worker=got["w"], got=got,
                              model=os.path.basename(L.cli_args(argv).model),
                              held=got["w"].engine.kv.used(),  # before any request (a CUDA graph's padding slot)
                              client=openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120))
    finally:
        got["w"].close()
        t.join(30)
    assert not t.is_alive() and not got["w"].is_alive() and not got["w"].http.is_alive()


@pytest.fixture(scope="module")
def srv(ckpt):
    with running("--model", ckpt, "--kv-tokens", "4096") as s:
        yield s


def cli(ckpt, capsys, *argv):
    """The command line's completions (--json: text, token ids, finish reason), run in this process."""
    L.main(["--model", ckpt, "--json", "--quiet", *argv])
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def idle(srv, timeout=30.0):
    """Wait until the engine is idle; then the pool holds only the radix cache, unlocked (and the padding slot)."""
    e = srv.engine
    for _ in range(int(timeout / 0.05)):
        if not e.busy:
            break
        time.sleep(0.05)
    time.sleep(0.1)
    tree = e.sched.tree
    return not e.busy and tree.protected_size() == 0 and e.kv.used() - tree.evictable_size() == srv.held


def test_greedy_completions_and_chat_equal_the_cli(srv, ckpt, capsys):
    rng = random.Random()
    prompts, n = [words(rng, rng.randint(1, 12)) for _ in range(3)], rng.randint(8, 24)
    for chat in (False, True):
        ref = cli(ckpt, capsys, "--max-new-tokens", str(n), *([] if chat else ["--no-chat"]), *prompts)
        for p, r in zip(prompts, ref):
            kw = dict(model=srv.model, max_tokens=n, temperature=0)
            if chat:
                create, kw["messages"] = srv.client.chat.completions.create, [{"role": "user", "content": p}]
                text = lambda c: c.message.content
                delta = lambda c: c.delta.content or ""
            else:
                create, kw["prompt"] = srv.client.completions.create, p
                text = delta = lambda c: c.text
            out = create(**kw)
            assert text(out.choices[0]) == r["text"] and out.choices[0].finish_reason == r["finish_reason"]
            assert out.usage.completion_tokens == len(r["token_ids"])
            assert out.usage.prompt_tokens == len(srv.engine.tok.chat(p) if chat else srv.engine.tok.encode(p, True))
            chunks = list(create(**kw, stream=True, stream_options={"include_usage": True}))
            assert "".join(delta(c.choices[0]) for c in chunks if c.choices) == r["text"]
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r["finish_reason"]
            assert chunks[-1].usage.completion_tokens == len(r["token_ids"])
            if len(r["text"]) > 4:  # a stop string: the text before its first occurrence, finish "stop"
                stop = r["text"][len(r["text"]) // 2:][:3]
                cut = create(**kw, stop=[stop, "\x00never"])
                assert text(cut.choices[0]) == r["text"][:r["text"].index(stop)]
                assert cut.choices[0].finish_reason == "stop"
                streamed = create(**kw, stop=stop, stream=True)
                assert "".join(delta(c.choices[0]) for c in streamed) == r["text"][:r["text"].index(stop)]
    assert idle(srv)


@pytest.mark.parametrize("how", ["regex", "json_schema"])
def test_constrained_answers_equal_the_cli(srv, ckpt, capsys, tmp_path, how):
    rng = random.Random()
    prompt, n = words(rng, 5), 40
    if how == "regex":
        pattern = "(" + "|".join(rng.sample(WORDS, 4)) + r") [0-9]{1,3}"
        ref = cli(ckpt, capsys, "--max-new-tokens", str(n), "--regex", pattern, prompt)[0]
        kw = dict(extra_body={"regex": pattern})
    else:
        schema = {"type": "object", "properties": {"name": {"enum": rng.sample(WORDS, 3)}, "n": {"type": "integer"}},
                  "required": ["name", "n"]}
        (tmp_path / "s.json").write_text(json.dumps(schema))
        ref = cli(ckpt, capsys, "--max-new-tokens", str(n), "--json-schema", str(tmp_path / "s.json"), prompt)[0]
        kw = dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    out = srv.client.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": prompt}],
                                             max_tokens=n, temperature=0, **kw)
    text = out.choices[0].message.content
    assert text == ref["text"] and out.choices[0].finish_reason == ref["finish_reason"]
    if ref["finish_reason"] == "stop":  # complete: it matches, by Python's re and jsonschema
        if how == "regex":
            assert __import__("re").fullmatch(pattern, text)
            # a stop string in what jump-forward wrote (the space after the word): the text before it
            cut = srv.client.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": prompt}],
                                                     max_tokens=n, temperature=0, stop=[" "], **kw).choices[0]
            assert (cut.message.content, cut.finish_reason) == (text.split(" ")[0], "stop"), (cut, text)
        else:
            jsonschema.validate(json.loads(text), schema)


def test_seeded_samples_are_reproducible_under_load(srv):
    rng = random.Random()
    prompt, seed = words(rng, 6), rng.randint(0, 10**6)
    ask = lambda s: [c.text for c in srv.client.completions.create(model=srv.model, prompt=prompt, max_tokens=12,
                                                                     temperature=1.0, n=3, seed=s).choices]
    alone = ask(seed)
    busy = threading.Thread(target=lambda: [srv.client.completions.create(
        model=srv.model, prompt=words(rng, 4), max_tokens=12, temperature=1.0) for _ in range(3)])
    busy.start()  # other requests sample from the engine beside it: its own generators give the same draws
    again = ask(seed)
    busy.join()
    assert again == alone and len(alone) == 3
    assert ask(seed + 1) != alone  # another seed, other samples (12 tokens at temperature 1: equal by chance ~never)
    assert idle(srv)


def concurrent_streams(srv, n_clients):
    """n_clients greedy streams at once: each gets the text it gets alone; returns the widest decode step."""
    rng, e = random.Random(), srv.engine
    jobs = [(words(rng, rng.randint(1, 10)), rng.randint(4, 16)) for _ in range(n_clients)]
    first = e.n_seqs  # sequence ids of these requests start here

    async def one(client, prompt, n):
        text = ""
        async for c in await client.completions.create(model=srv.model, prompt=prompt, max_tokens=n, temperature=0,
                                                       stream=True):
            text += c.choices[0].text
        return text

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=120) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, p, n) for p, n in jobs)), 300)
    got = asyncio.run(all_at_once())
    assert idle(srv), "the pool holds nothing but the radix cache once every client is done"
    assert not srv.worker.live

    alone = L.FastEngine(e.model, e.tok, "token", kv_tokens=4096)  # each request alone, on an engine of its own
    for (p, n), text in zip(jobs, got):
        alone.add(e.tok.encode(p, bos=True), L.SamplingParams(max_new_tokens=n))
        out = alone.run()
        alone.sched.finished.clear()
        assert text == e.tok.decode([t for t in next(iter(out.values())) if t not in e.tok.stop_ids])
    per_step = {}  # decode steps (or multi-step chunks): the sequences of these requests each fed
    for ev in e.events:
        if ev.kind == "decode" and ev.rid is not None and ev.rid >= first:
            per_step.setdefault(ev.step, set()).add(ev.rid)
    return max(map(len, per_step.values()))


def test_concurrent_streams_batch_together_and_match_alone(srv):
    widest = concurrent_streams(srv, 64)
    print(f"64 clients: the widest decode step ran {widest} of them together")
    assert widest >= 8


@pytest.mark.gpu
def test_gpu_server_streams_and_aborts(ckpt):
    """On CUDA (graphs, multi-step decode): concurrent streams equal each alone, a disconnect frees its slots."""
    with running("--model", ckpt, "--kv-tokens", "4096", "--device", "cuda") as s:
        assert concurrent_streams(s, 64) >= 8
        disconnect(s, cut_by=2000)  # a GPU may write hundreds of tokens before the server hears of it


def pause(srv, seconds):
    """The HTTP process stops a while (SIGSTOP), its engine's process runs on."""
    os.kill(srv.worker.http.pid, signal.SIGSTOP)
    threading.Timer(seconds, os.kill, (srv.worker.http.pid, signal.SIGCONT)).start()


@pytest.mark.skipif(sys.platform == "win32", reason="SIGSTOP is POSIX")
def test_texts_that_queue_up_go_out_in_one_write_and_parse_one_by_one(srv):
    """Texts queued while the HTTP process is stopped go out in one write, each event still parsing on its own."""
    kw = dict(model=srv.model, prompt=words(random.Random(), 4), max_tokens=64, temperature=0,
              extra_body={"ignore_eos": True})
    whole = srv.client.completions.create(**kw).choices[0].text
    body = {**{k: v for k, v in kw.items() if k != "extra_body"}, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{srv.url}/completions", json=body, timeout=60) as r:
        pause(srv, 1.0)
        reads = [raw.decode() for raw in r.iter_raw()]
    assert max(read.count("data: ") for read in reads) >= 3 and "".join(reads).endswith("data: [DONE]\n\n")
    with srv.client.completions.create(**kw, stream=True, stream_options={"include_usage": True}) as stream:
        pause(srv, 1.0)
        chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole and len(chunks) >= 3
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 64
    assert idle(srv)


BAD = {  # request -> what its 400 (an unknown model: 404, as OpenAI's) must say, and the field it names
    "malformed JSON": ('{"model": "m", "prompt": ', "Invalid JSON", None),
    "unknown model": ({"model": "gpt-9", "prompt": "hi"}, "not served here", "model"),
    "negative max_tokens": ({"prompt": "hi", "max_tokens": -3}, "max_tokens", "max_tokens"),
    "temperature": ({"prompt": "hi", "temperature": -1}, "temperature", "temperature"),
    "temperature over 2": ({"prompt": "hi", "temperature": 2.01}, "temperature", "temperature"),
    "missing prompt": ({"max_tokens": 3}, "prompt: Field required", "prompt"),
    "invalid schema": ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, "response_format",
        "response_format"),
    "bad regex": ({"prompt": "hi", "regex": "(ab"}, "regex", "regex"),
    "over the context": ({"prompt": "sea " * 3000, "max_tokens": 4}, "exceeds", "prompt"),
    "chat over the context": ({"messages": [{"role": "user", "content": "sea " * 3000}]}, "exceeds", "messages"),
    "can never fit": ({"prompt": "hi", "max_tokens": 100000}, "exceeds", "max_tokens"),
    "empty chat": ({"messages": []}, "messages", "messages"),
    "echo": ({"prompt": "hi", "echo": True}, "echo", "echo"),
    "best_of": ({"prompt": "hi", "best_of": 2}, "best_of", "best_of"),
    "suffix": ({"prompt": "hi", "suffix": "end"}, "suffix", "suffix"),
    "frequency_penalty": ({"prompt": "hi", "frequency_penalty": 2.5}, "frequency_penalty", "frequency_penalty"),
    "presence_penalty": ({"prompt": "hi", "presence_penalty": -2.5}, "presence_penalty", "presence_penalty"),
    "logit_bias value": ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias", "logit_bias"),
    "logit_bias token": ({"prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias", "logit_bias"),
    "top_logprobs": ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
                     "top_logprobs", "top_logprobs"),
    "completions logprobs": ({"prompt": "hi", "logprobs": 6}, "logprobs", "logprobs"),
    "n": ({"prompt": "hi", "n": 0}, "n", "n"),
    "tool_choice auto": ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}], "tool_choice": "auto"}, "tool_choice", "tool_choice"),
    "unknown tool": ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}], "tool_choice": {"type": "function", "function": {
            "name": "g"}}}, "tool_choice", "tool_choice"),
    "content part": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "http://x"}}]}]}, "content.list[Part].0.type", "messages"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_requests_are_400_with_a_clear_message(srv, case):
    body, says, param = BAD[case]
    chat = isinstance(body, dict) and "messages" in body
    if isinstance(body, dict):
        body = json.dumps({"model": srv.model, **body} if case != "unknown model" else body)
    r = httpx.post(f"{srv.url}/{'chat/completions' if chat else 'completions'}", content=body,
                   headers={"content-type": "application/json"}, timeout=60)
    err = r.json()["error"]
    assert r.status_code == (404 if case == "unknown model" else 400) and says in err["message"], r.text
    assert err["type"] == "invalid_request_error", r.text
    assert err["param"] == param and "Traceback" not in r.text and "\n" not in err["message"], r.text
    assert srv.client.models.list().data[0].id == srv.model  # still serving


def plain(srv):  # a plain request still gets its answer
    out = srv.client.completions.create(model=srv.model, prompt="sea", max_tokens=3, temperature=0)
    return out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body", [dict(seed=2**64), dict(seed=2**64 - 1, n=2), dict(seed=-(2**70)),
                                  dict(temperature=1e-38), dict(temperature=2.2e-313, seed=3),
                                  dict(temperature=5e-324, n=2), dict(top_p=1e-300, temperature=1)])
def test_no_request_stops_the_engine(srv, body):
    """Issue 55: the probes that killed the engine are served (a tiny temperature: greedy), and it serves on."""
    kw = dict(model=srv.model, prompt=words(random.Random(), 4), max_tokens=6)
    out = srv.client.completions.create(**kw, **body)
    assert [c.finish_reason for c in out.choices] == [out.choices[0].finish_reason] * body.get("n", 1)
    assert out.choices[0].finish_reason in ("stop", "length")
    if body.get("temperature", 1) < 1e-30:  # the most likely token each step: greedy's text
        assert out.choices[0].text == srv.client.completions.create(**kw, temperature=0).choices[0].text
    assert plain(srv) and srv.worker.is_alive() and httpx.get(srv.url[:-3] + "/health").status_code == 200
    assert idle(srv)


def test_a_request_that_fails_ends_alone(srv, monkeypatch):
    """A failure serving one request ends it with OpenAI's error; a request beside it and later ones are served."""
    real = L.sample

    def sample(logits, temperature, *a, **k):
        if abs(temperature - 0.777) < 1e-9:
            raise RuntimeError("boom")
        return real(logits, temperature, *a, **k)
    monkeypatch.setattr(L, "sample", sample)
    kw = dict(model=srv.model, prompt=words(random.Random(), 4), max_tokens=24, extra_body={"ignore_eos": True})
    beside = srv.client.completions.create(**kw, temperature=0.5, stream=True)  # running when the other fails
    first = next(iter(beside))
    r = httpx.post(f"{srv.url}/completions", json={**kw.pop("extra_body"), **kw, "temperature": 0.777}, timeout=60)
    assert r.status_code == 500 and "boom" in r.json()["error"]["message"], r.text
    with pytest.raises(openai.APIError, match="boom"):
        list(srv.client.completions.create(**kw, temperature=0.777, stream=True))
    rest = list(beside)
    assert rest[-1].choices[0].finish_reason == "length" and len(rest) + 1 >= 2
    assert plain(srv) and srv.worker.is_alive() and idle(srv)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_if_the_engine_dies_the_server_says_so_and_exits(ckpt):
    class Fatal(BaseException):
        pass
    with running("--model", ckpt, "--kv-tokens", "2048") as s:
        def step(*a, **k):
            raise Fatal("the engine's thread ends")
        s.engine.step = step
        r = httpx.post(f"{s.url}/completions", json=dict(model=s.model, prompt="hi", max_tokens=4), timeout=60)
        assert r.status_code >= 500 and r.json()["error"]["message"], r.text
        for _ in range(300):  # bounded: 30 s
            if not s.worker.http.is_alive():
                break
            with contextlib.suppress(httpx.TransportError):  # it says so until its process stops
                for path in ("/health", "/v1/models"):
                    h = httpx.get(s.url[:-3] + path, timeout=5)
                    assert h.status_code == 503 and "engine" in h.json()["error"]["message"]
            time.sleep(0.1)
        assert not s.worker.http.is_alive()
    assert s.got["exit"] and "engine" in str(s.got["exit"])  # a message: exit status 1


def test_nulls_bounds_seeds_and_content_parts(srv):
    """OpenAI accepts null for its optional fields and any integer seed; content may be a list of text parts."""
    rng = random.Random()
    prompt = words(rng, 5)
    msgs, kw = [{"role": "user", "content": prompt}], dict(model=srv.model, max_tokens=8, temperature=0)
    want = srv.client.chat.completions.create(messages=msgs, **kw).choices[0].message.content
    body = {**kw, "messages": [{"role": "user", "content": [{"type": "text", "text": prompt[:5]},
                                                            {"type": "text", "text": prompt[5:]}]}],
            "temperature": None, "top_p": None, "n": None, "stream": None, "seed": None, "stop": None,
            "max_tokens": 8, "frequency_penalty": None, "presence_penalty": None, "logit_bias": None,
            "logprobs": None, "top_logprobs": None, "user": "u", "store": False, "metadata": {"k": "v"}}
    r = httpx.post(f"{srv.url}/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text  # temperature null: OpenAI's default 1, sampled
    r = httpx.post(f"{srv.url}/chat/completions", json={**body, "temperature": 0}, timeout=60)
    assert r.json()["choices"][0]["message"]["content"] == want
    seed = rng.randint(2**64, 2**80)  # a seed beyond the generator's range: reduced to it, reproducibly
    ask = lambda s: [c.text for c in srv.client.completions.create(model=srv.model, prompt=prompt, max_tokens=8,
                                                                     temperature=1.0, n=2, seed=s).choices]
    assert ask(seed) == ask(seed) and ask(seed) != ask(seed + 1)


def reference_step(srv, seq, out, frequency=0.0, presence=0.0, bias=None):
    """float64 logits after seq with OpenAI's penalties (counting the tokens of out) and logit_bias."""
    z = srv.engine.model(torch.tensor(seq), torch.arange(len(seq)), L.NoCache(),
                         logits_at=torch.tensor([len(seq) - 1]))[0].double()
    count = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=len(z))[:len(z)].double()
    z = z - frequency * count - presence * (count > 0).double()
    for t, b in (bias or {}).items():
        z[int(t)] += b
    return z


def reference(srv, ids, n, **penalties):
    """A float64 greedy loop with OpenAI's penalties and logit_bias (reference_step's): its tokens."""
    out = []
    while len(out) < n and (not out or out[-1] not in srv.engine.tok.stop_ids):
        out.append(int(reference_step(srv, ids + out, out, **penalties).argmax()))
    return out


def text_of(srv, ids):
    return srv.engine.tok.decode([t for t in ids if t not in srv.engine.tok.stop_ids])


def test_penalties_and_logit_bias_follow_openai_formulas(srv):
    rng = random.Random()
    prompt, n = words(rng, 4), 16
    ids = srv.engine.tok.encode(prompt, bos=True)
    plain_out = reference(srv, ids, n)
    frequency, presence = rng.uniform(0.5, 2), rng.uniform(0.5, 2)
    bias = {str(plain_out[0]): -100.0, str(rng.randrange(100, 700)): rng.uniform(1, 4)}
    want = reference(srv, ids, n, frequency=frequency, presence=presence, bias=bias)
    assert want != plain_out  # the formulas change this output: the test can tell
    got = srv.client.completions.create(model=srv.model, prompt=prompt, max_tokens=n, temperature=0,
                                        frequency_penalty=frequency, presence_penalty=presence, logit_bias=bias)
    assert got.choices[0].text == text_of(srv, want)
    t = rng.choice([i for i in range(100, 700) if i not in srv.engine.tok.stop_ids])  # +100: that token every step
    got = srv.client.completions.create(model=srv.model, prompt=prompt, max_tokens=5, temperature=0.8,
                                        logit_bias={str(t): 100})
    assert got.choices[0].text == srv.engine.tok.decode([t] * 5)
    assert idle(srv)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_are_those_of_the_distribution_sampled_from(srv, temperature):
    rng = random.Random()
    msgs, n, k = [{"role": "user", "content": words(rng, 4)}], 8, rng.randint(1, 5)
    tok = srv.engine.tok  # ignore_eos below: a random checkpoint's first greedy token may be EOS (no entries)
    out = srv.client.chat.completions.create(model=srv.model, messages=msgs, max_tokens=n, temperature=temperature,
                                             seed=rng.randint(0, 99), logprobs=True, top_logprobs=k,
                                             frequency_penalty=0.5, extra_body={"ignore_eos": True})
    entries, text = out.choices[0].logprobs.content, out.choices[0].message.content
    assert entries and b"".join(bytes(e.bytes) for e in entries).decode(errors="replace") == text
    by_bytes = {tok.token_bytes(i): i for i in range(tok.vocab_size)}  # a top k may hold EOS too
    assert len(by_bytes) == tok.vocab_size
    got = [by_bytes[bytes(e.bytes)] for e in entries]
    lps = [torch.log_softmax(reference_step(srv, tok.chat(msgs) + got[:j], got[:j], 0.5) / (temperature or 1.0), -1)
           for j in range(len(got))]  # the distribution sampled from (frequency_penalty 0.5)
    for e, t, lp in zip(entries, got, lps):
        assert abs(e.logprob - float(lp[t])) < 1e-3
        top = lp.topk(k)
        assert [by_bytes.get(bytes(x.bytes)) for x in e.top_logprobs] == top.indices.tolist()
        assert all(abs(x.logprob - float(v)) < 1e-3 for x, v in zip(e.top_logprobs, top.values))
        if temperature == 0:
            assert t == int(top.indices[0])
    c = srv.client.completions.create(model=srv.model, prompt=msgs[0]["content"], max_tokens=n, temperature=0,
                                      logprobs=2, extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) > 0
    assert all(len(d) <= 2 and max(d.values()) >= v - 1e-6 for d, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert idle(srv)


WEATHER = {"type": "object", "properties": {"city": {"enum": ["paris", "oslo", "rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 14}},
           "required": ["city", "days"], "additionalProperties": False}
ALARM = {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                          "label": {"type": "string", "maxLength": 8}}, "required": ["hour"],
         "additionalProperties": False}


@pytest.mark.parametrize("choice", ["named", "required", "none"])
def test_forced_tool_calls_are_constrained_by_their_schema(srv, choice):
    """A forced tool_choice answers a tool call whose arguments are valid for its parameters schema; "none": text."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
             {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM}}]
    tool_choice = {"named": {"type": "function", "function": {"name": "set_alarm"}}}.get(choice, choice)
    msgs = [{"role": "user", "content": words(random.Random(), 6)}]
    for stream in (False, True):
        kw = dict(model=srv.model, messages=msgs, max_tokens=120, tools=tools, tool_choice=tool_choice,
                  temperature=random.choice([0, 1.0]), stream=stream)
        if stream:
            chunks = list(srv.client.chat.completions.create(**kw))
            calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) or None
        else:
            out = srv.client.chat.completions.create(**kw).choices[0]
            calls, finish, content = out.message.tool_calls or [], out.finish_reason, out.message.content
        if choice == "none":
            assert not calls and finish in ("stop", "length") and content is not None
            continue
        assert finish == "tool_calls" and content is None and len(calls) == 1 and calls[0].id, (calls, finish)
        name = calls[0].function.name
        assert name == "set_alarm" if choice == "named" else name in ("get_weather", "set_alarm")
        jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER if name == "get_weather" else ALARM)
    assert idle(srv)


def test_json_object_mode_answers_a_json_object(srv):
    quote, close = (srv.engine.tok.encode(c)[0] for c in '"}')  # pushed: the object closes within max_tokens
    out = srv.client.chat.completions.create(
        model=srv.model, messages=[{"role": "user", "content": words(random.Random(), 5)}], max_tokens=64,
        temperature=random.choice([0, 1.0]), response_format={"type": "json_object"},
        logit_bias={str(quote): 30, str(close): 30})
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_the_api_describes_itself_and_errors_are_openais(srv):
    spec = httpx.get(srv.url[:-3] + "/openapi.json").json()
    for path, field in (("/v1/chat/completions", "messages"), ("/v1/completions", "prompt")):
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert field in spec["components"]["schemas"][ref.split("/")[-1]]["properties"]
    for method, path in (("GET", "/v1/nothing"), ("POST", "/v1/nothing"), ("GET", "/v1/completions")):
        r = httpx.request(method, srv.url[:-3] + path, timeout=10)
        assert r.status_code in (404, 405) and set(r.json()["error"]) >= {"message", "type", "param", "code"}, r.text


def disconnect(srv, max_tokens=2000, cut_by=1000, stream=True):
    """A client that goes away a few tokens in: its request stops well before max_tokens, its slots freed."""
    e = srv.engine
    first = e.n_seqs
    body = {"model": srv.model, "prompt": words(random.Random(), 5), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if not stream:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{srv.url}/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
    else:
        with httpx.stream("POST", f"{srv.url}/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]  # a few tokens in, then the client goes away
        assert sum(g.startswith("data: ") for g in got) >= 3
    assert idle(srv, timeout=20), "its slots are back (radix cache only, unlocked), nothing runs"
    done = [ev for ev in e.events if ev.kind == "finish" and ev.rid == first]
    assert done and done[0].tokens < cut_by, f"aborted after {done[0].tokens} of its {max_tokens} tokens"


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_slots(srv, stream):
    disconnect(srv, stream=stream)


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process is POSIX")
def test_ctrl_c_stops_the_server_process_cleanly(ckpt):
    """Ctrl-C with a stream open: the stream ends ("abort", [DONE]), the process says one line and exits 130."""
    from helpers import ctrl_c_reaches
    with socket.socket() as s:  # a free loopback port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "llama3_generate.py"), "--serve", "--model", ckpt,
                          "--port", str(port), "--kv-tokens", "2048"], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                         preexec_fn=ctrl_c_reaches)
    try:
        for _ in range(600):  # bounded: 60 s
            try:
                name = httpx.get(f"{url}/models", timeout=5).json()["data"][0]["id"]
                break
            except httpx.TransportError:
                time.sleep(0.1)
        body = dict(model=name, prompt="hi", max_tokens=2000, ignore_eos=True, stream=True)
        with httpx.stream("POST", f"{url}/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            p.send_signal(signal.SIGINT)
            rest = [line for line in lines if line]
        err = p.communicate(timeout=30)[1]
    finally:
        p.kill()
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "abort"
    assert p.returncode == 130 and "interrupted" in err and "Traceback" not in err, err[-2000:]
    assert err.index(f"at {url}") < err.index("startup complete") < err.index("interrupted"), err[-2000:]


def test_bench_serve_http_machinery_on_a_cpu():
    """`bench_engine.py serve-http` on a tiny model: in process and over HTTP, all served whole, percentiles ordered."""
    import bench_engine as B
    from helpers import tiny_model
    args = tiny_model(max_seq_len=256).args
    r = B.bench_http("cpu", rates=(50,), n_seqs=8, lengths=(4, 16), long=(40, 60), long_prompts=1, args=args)
    runs = r["rates"][50]
    assert list(runs) == ["in process", "HTTP"] and runs["HTTP"]["served_whole"]
    for x in runs.values():
        assert x["output_tok_s"] > 0 and x["ttft_p50_ms"] <= x["ttft_p99_ms"] and x["itl_p50_ms"] <= x["itl_p99_ms"]
    assert "every HTTP request got its max_tokens: True" in B.http_report(r)
