"""06: regex -> byte DFA against Python's `re`; the token index against the `regex` module's partial matching;
constrained decoding (random logits and the real model) always fullmatches; jump-forward re-tokenizes losslessly."""
import importlib
import json
import random
import re

import numpy as np
import pytest
import regex
import torch

m = importlib.import_module("06_jump_forward_fsm")

SMALL_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "house": {"enum": ["Gryffindor", "Slytherin", "日本"]},
    "age": {"type": "integer"}, "ok": {"type": "boolean"}, "score": {"type": "number"},
    "wand": {"type": "object", "properties": {"wood": {"type": "string", "minLength": 1, "maxLength": 3}}},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 2}, "maxItems": 2},
    "pair": {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"type": "null"}]}, "minItems": 1, "maxItems": 2}}}
REGEXES = [
    r"abc", r"a|bc|", r"(ab)*c+", r"[a-c]{2,3}x?", r"[^a\n]+b", r".{0,3}z", r"\d+\.\d{0,2}", r"\w+@\w+\.(com|org)",
    r"\s*\S\W?\D", r"(?:é|ê|日本)+", r"[α-ω]{1,3}[^α-ω]?", r"\x41\u00e9\U0001F600*", r"x{,2}y{2,}", r"a{}", r"[]a-]+",
    r"[\d\-.]{2}", r"((a|b)*c){1,2}", r"[^\x00-\x7f]+", r"😀|[\u4e00-\u9fff]{2}", r"a*?b+?c??d{1,2}?", r"[\\\]^-]x{",
    r"(|a)(b|)", r"[^\W\d]\t\n", m.CHARACTER_REGEX, m.schema_to_regex(SMALL_SCHEMA), m.schema_to_regex(m.DEMO_SCHEMA)]
EDGE_CHARS = [0x7F, 0x80, 0x7FF, 0x800, 0xD7FF, 0xE000, 0xFFFF, 0x10000, 0x10FFFF, 0x3B1, 0x3C9, 0x4E00, 0x9FFF]


def distances(dfa):
    """Bytes from each state to the nearest accepting state (breadth-first over reversed edges)."""
    src, byte = np.nonzero(dfa.table >= 0)
    preds = {}
    for d, s in set(zip(dfa.table[src, byte].tolist(), src.tolist())):
        preds.setdefault(d, []).append(s)
    dist = np.where(dfa.accept, 0, 10**9)
    frontier = list(np.flatnonzero(dfa.accept))
    while frontier:
        nxt = []
        for d in frontier:
            for s in preds.get(d, []):
                if dist[s] > dist[d] + 1:
                    dist[s] = dist[d] + 1
                    nxt.append(s)
        frontier = nxt
    return dist


def sample_dfa(dfa, rng, dist, max_bytes=2000):
    """A random string the DFA accepts (walks toward acceptance half the time), or None."""
    s, out = 0, bytearray()
    while len(out) < max_bytes:
        if dfa.accept[s] and rng.random() < 0.3:
            return out.decode()
        live = np.flatnonzero(dfa.table[s] >= 0)
        if not len(live):
            return out.decode() if dfa.accept[s] else None
        if rng.random() < 0.5:
            live = live[dist[dfa.table[s, live]] == dist[dfa.table[s, live]].min()]
        out.append(int(rng.choice(live)))
        s = dfa.table[s, out[-1]]
    return None


def random_string(pattern, rng):
    chars = [c for c in pattern if c not in "\\"] + list("ab\n \"é日😀") + [chr(c) for c in EDGE_CHARS]
    chars += [chr(rng.choice([rng.randrange(0x80), rng.randrange(0xD800), rng.randrange(0xE000, 0x110000)]))]
    return "".join(rng.choice(chars) for _ in range(rng.randrange(9)))


@pytest.mark.parametrize("pattern", REGEXES)
def test_dfa_equals_python_re(pattern):
    rng = random.Random(hash(pattern) % 1000)
    dfa = m.compile_regex(pattern)
    dist, strings = distances(dfa), [random_string(pattern, rng) for _ in range(300)]
    for _ in range(60):
        s = sample_dfa(dfa, rng, dist)
        if s is not None:
            i = rng.randrange(len(s) + 1)
            edit = random_string(pattern, rng)[:1]
            strings += [s, s[:i] + edit + s[i:], s[:i] + s[i + 1:], s[:i] + edit + s[i + 1:]]  # and near misses
    truth = [re.fullmatch(pattern, s, re.ASCII) is not None for s in strings]
    assert [dfa.fullmatch(s) for s in strings] == truth
    assert any(truth) and not all(truth)  # positives and negatives both exercised


def test_utf8_ranges_cover_exactly_the_encodings():
    rng = random.Random(0)
    for _ in range(200):
        lo = rng.choice([rng.randrange(0x110000), rng.choice(EDGE_CHARS)])
        hi = min(0x10FFFF, lo + rng.choice([0, 1, 63, 64, 2000, 70000, 0x10FFFF]))
        seqs = m.utf8_ranges(lo, hi)
        for c in [lo, hi, lo - 1, hi + 1, rng.randrange(lo, hi + 1), *EDGE_CHARS]:
            if not 0 <= c <= 0x10FFFF or 0xD800 <= c <= 0xDFFF:
                continue
            b = chr(c).encode()
            hit = any(len(q) == len(b) and all(x <= y <= z for (x, z), y in zip(q, b)) for q in seqs)
            assert hit == (lo <= c <= hi and not 0xD800 <= c <= 0xDFFF), (lo, hi, c)


def check_schema_value(schema, value):
    if "enum" in schema:
        return value in schema["enum"]
    if "anyOf" in schema:
        return any(check_schema_value(s, value) for s in schema["anyOf"])
    t = schema["type"]
    if t == "object":
        return list(value) == list(schema["properties"]) and all(
            check_schema_value(s, value[k]) for k, s in schema["properties"].items())
    if t == "array":
        return schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 99) and all(
            check_schema_value(schema["items"], v) for v in value)
    kinds = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "null": type(None)}
    return isinstance(value, kinds[t]) and (t == "boolean" or not isinstance(value, bool)) and (
        t != "string" or schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 99))


def test_schema_regex_produces_valid_json():
    rng = random.Random(1)
    for schema in (SMALL_SCHEMA, m.DEMO_SCHEMA):
        dfa = m.compile_regex(m.schema_to_regex(schema))
        dist = distances(dfa)
        samples = [s for s in (sample_dfa(dfa, rng, dist) for _ in range(40)) if s is not None]
        assert len(samples) > 20
        for s in samples:
            assert check_schema_value(schema, json.loads(s)), s
        assert not dfa.fullmatch(json.dumps({"name": "x"}))


@pytest.mark.parametrize("pattern, problem", [
    ("(ab", "missing )"), ("((a)", "missing )"), ("[^^", "unterminated"), ("ab)", "unbalanced parenthesis"),
    ("*a", "nothing to repeat"), ("a**", "multiple repeat"),
    ("a{3,2}", "min repeat greater than max"), ("[z-a]", "bad character range"), ("[abc", "unterminated character set"),
    ("ab\\", "trailing backslash"), ("\\1", "unsupported escape"), ("(?=a)", "unsupported group"), ("^a", "anchor"),
    ("\\x4", "incomplete escape"), ("a{2000}", "repeat count"), ("[\\d-z]", "bad character range")])
def test_invalid_regex_names_the_problem(pattern, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        m.compile_regex(pattern)
    if problem not in ("unsupported escape", "unsupported group", "anchor", "repeat count"):
        with pytest.raises(re.error):  # a real syntax error, not just something we do not support
            re.compile(pattern)


@pytest.mark.parametrize("schema, problem", [
    ([], "schema must be an object"), ({"type": "strin"}, "unsupported schema type 'strin'"),
    ({"type": "array"}, "needs 'items'"), ({"type": "object", "properties": []}, "properties must be an object"),
    ({"enum": []}, "enum must be a non-empty list"), ({"type": "string", "maxLength": -1}, "maxLength must be"),
    ({"type": "string", "minLength": 3, "maxLength": 2}, "above maximum"),
    ({"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "int"}}}}}, "$.a.b")])
def test_invalid_schema_names_the_problem(schema, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        m.schema_to_regex(schema)


@pytest.mark.parametrize("keyword, value", [
    ("multipleOf", 2), ("uniqueItems", True), ("minProperties", 1), ("maxProperties", 3), ("not", {"type": "null"}),
    ("prefixItems", [{"type": "integer"}]), ("oneOf", [{"type": "integer"}]), ("allOf", [{"type": "integer"}]),
    ("patternProperties", {}), ("contains", {"type": "integer"}), ("if", {}), ("$ref", "#/x"), ("minimum", 3)])
def test_every_keyword_that_changes_validity_is_implemented_or_named(keyword, value):
    """Issue 22.4: an ignored keyword lets invalid output pass for valid; refused by name instead."""
    kind = {"multipleOf": "number", "uniqueItems": "array", "prefixItems": "array", "contains": "array",
            "minimum": "number", "minProperties": "object", "maxProperties": "object", "patternProperties": "object"}
    schema = {"type": kind.get(keyword, "string"), keyword: value}
    if schema["type"] == "array":
        schema["items"] = {"type": "integer"}
    with pytest.raises(ValueError, match=re.escape(repr(keyword))):
        m.schema_to_regex(schema)
    for schema, problem in (({"type": "string", "format": "email"}, "format 'email'"),
                            ({"type": "string", "pattern": "[a-z]+"}, "anchored"),
                            ({"type": "string", "pattern": "^.+$"}, "quote, backslash or control"),
                            ({"type": "object", "properties": {}, "required": ["x"]}, "'x' is not in properties"),
                            ({"type": "integer", "minimum": 5, "maximum": 4}, "no integer")):
        with pytest.raises(ValueError, match=re.escape(problem)):
            m.schema_to_regex(schema)
    text = m.schema_to_regex({"type": "object", "title": "t", "description": "annotations change nothing",
                              "additionalProperties": False, "properties": {"a": {"type": "null"}}})
    assert m.compile_regex(text).fullmatch('{"a": null}')


def test_integer_ranges_are_exact():
    """minimum / maximum / exclusive bounds against Python's comparison, on random ranges and their edges."""
    rng = random.Random()
    cases = [(100, 120, {"minimum": 100, "maximum": 120}), (-5, 5, {"minimum": -5, "maximum": 5}),
             (1, m.INT_LIMIT, {"exclusiveMinimum": 0}), (-m.INT_LIMIT, -1, {"exclusiveMaximum": 0})]
    for _ in range(12):
        a, b = sorted(rng.randrange(-10 ** rng.randrange(1, 8), 10 ** rng.randrange(1, 8)) for _ in range(2))
        cases.append((a, b, {"minimum": a - rng.random() * 0.9 if rng.random() < 0.5 else a, "maximum": b}))
    for lo, hi, bounds in cases:
        dfa = m.compile_regex(m.schema_to_regex({"type": "integer", **bounds}))
        probes = {lo - 1, lo, lo + 1, hi - 1, hi, hi + 1, 0, -1, 1, 7, -7, 10 ** 16, -(10 ** 16)}
        probes |= {rng.randrange(lo - 50, hi + 50) for _ in range(300)}
        probes |= {rng.randrange(-10 ** 9, 10 ** 9) for _ in range(100)}
        for x in probes:
            assert dfa.fullmatch(json.dumps(x)) == (lo <= x <= hi), (bounds, x)
        assert not dfa.fullmatch("-0") and not dfa.fullmatch("01") and not dfa.fullmatch("1.0")
    assert not m.compile_regex(m.schema_to_regex(
        {"type": "object", "properties": {"legs": {"type": "integer", "minimum": 100, "maximum": 120}}})).fullmatch(
        '{"legs": 8}')


def test_string_lengths_count_characters_not_escapes():
    """A surrogate pair is one character, a newline is one, é is one: lengths as json.loads and len() count them."""
    rng = random.Random()
    chars = ["a", "é", "日", "😀", "\n", '"', "\\", "\x01", "\u2028", "\U0010FFFF"]
    for lo, hi in ((2, 2), (0, 3), (1, 5)):
        dfa = m.compile_regex(m.schema_to_regex({"type": "string", "minLength": lo, "maxLength": hi}))
        for _ in range(300):
            value = "".join(rng.choice(chars) for _ in range(rng.randrange(7)))
            for text in (json.dumps(value), json.dumps(value, ensure_ascii=False)):
                assert dfa.fullmatch(text) == (lo <= len(value) <= hi), (lo, hi, text)
    two = m.compile_regex(m.schema_to_regex({"type": "string", "minLength": 2, "maxLength": 2}))
    assert json.dumps("😀") == '"\\ud83d\\ude00"' and not two.fullmatch(json.dumps("😀"))
    assert two.fullmatch(json.dumps("😀a"))


def test_pattern_and_formats_match_python():
    rng = random.Random()
    pattern = "^[A-Z][a-z]{1,5}( [A-Z][a-z]{1,5})?$"
    dfa = m.compile_regex(m.schema_to_regex({"type": "string", "pattern": pattern}))
    import ipaddress
    uuid_re = re.compile(r"[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}")
    uuid_dfa = m.compile_regex(m.schema_to_regex({"type": "string", "format": "uuid"}))
    ip_dfa = m.compile_regex(m.schema_to_regex({"type": "string", "format": "ipv4"}))
    for _ in range(400):
        word = "".join(rng.choice("AaBbz é") for _ in range(rng.randrange(12)))
        assert dfa.fullmatch(json.dumps(word)) == bool(re.fullmatch(pattern[1:-1], word)), word
        u = "".join(rng.choice("0123456789abcdefABCDEFg-") for _ in range(36))
        if rng.random() < 0.5:
            u = str(__import__("uuid").uuid4())
        assert uuid_dfa.fullmatch(json.dumps(u)) == bool(uuid_re.fullmatch(u)), u
        ip = ".".join(rng.choice(["0", "9", "10", "99", "100", "199", "200", "249", "250", "255", "256", "300", "01",
                                  str(rng.randrange(300))]) for _ in range(rng.choice([3, 4, 4, 4, 5])))
        try:
            ok = str(ipaddress.IPv4Address(ip)) == ip
        except ValueError:
            ok = False
        assert ip_dfa.fullmatch(json.dumps(ip)) == ok, ip


def test_hostile_regex_is_refused_within_seconds():
    """Issue 22.5: (?:.é|😀+){100} took 31 s and built 122,600 states; the state budget refuses it quickly."""
    import time
    for pattern in ("(?:.é|😀+){100}", "(?:[^a]|.é|😀+){200}", "(?:.é|😀+){1000}"):
        t0 = time.perf_counter()
        with pytest.raises(ValueError, match="too complex"):
            m.compile_regex(pattern)
        assert time.perf_counter() - t0 < 30  # generous: a loaded 2-core machine; ~1 s when quiet


def test_compressed_edges_are_the_forced_chains():
    class Tok:  # a byte-level toy tokenizer: every byte a token, and "日本", "ab" as merges
        special, eos_id = {"<eos>": 0}, 0
        vocab = [b"<eos>"] + [bytes([b]) for b in range(256)] + ["日本".encode(), b"ab"]
        vocab_size = len(vocab)
        token_bytes = vocab.__getitem__
    index = m.TokenIndex(r"日本(x|yz)w", Tok())
    edges = index.compressed_edges()
    assert sorted(edges.values()) == sorted(["日本".encode(), b"w", b"zw"])
    assert index.jump(0) == "日本".encode()
    assert index.allowed(0).nonzero()[:, 0].tolist() == [1 + 0xE6, 257]  # first byte of 日, or 日本 whole
    assert index.allowed(index.dfa.walk(0, "日本xw".encode()))[0]  # EOS only when accepting
    assert not index.allowed(0)[0]


def random_logits_fn(vocab, seed, favour=()):
    gen = torch.Generator().manual_seed(seed)
    bonus = torch.zeros(vocab)
    bonus[list(favour)] = 4.0  # make partial-UTF-8 tokens likely wherever they are allowed
    return lambda ids, keep: torch.randn(vocab, generator=gen) * 3 + bonus


FUZZ = [r"(?:é|ê|日本)+x", r"[^\"]{0,8}\"", r'"名前": "[^"]{1,6}", "n": [0-9]{1,3}', r"(ab|cd){1,3}e?",
        r"[😀-😇]{2}|\d{1,3}(\.\d)?", r"a\x04?b"]


@pytest.mark.parametrize("pattern", FUZZ + [m.schema_to_regex(SMALL_SCHEMA)])
def test_fuzz_random_logits_always_match(smollm, pattern):
    _, tok = smollm
    index = m.TokenIndex(pattern, tok)
    partial = [i for i, b in enumerate(m.token_trie(tok).token_bytes) if b and not _is_utf8(b)]
    prompt = tok.chat("Answer.")
    for seed in range(6):
        for jump in (False, True):
            r = m.constrained_decode(index, tok, prompt, random_logits_fn(tok.vocab_size, seed, partial), 400,
                                     jump_forward=jump, temperature=1.0, seed=seed)
            assert r["finished"] and re.fullmatch(pattern, r["text"], re.ASCII), r
            assert tok.decode(r["ids"]) == r["text"]  # re-tokenized ids are the same text
            assert "\x04" not in r["text"] and all(t not in tok.special.values() for t in r["ids"])
            assert r["forward_passes"] <= len(r["ids"]) + 1


def _is_utf8(b):
    try:
        b.decode()
        return True
    except UnicodeDecodeError:
        return False


def test_index_against_partial_matching(smollm):
    """Token t is allowed after prefix p iff p + t can still become a full match (regex's partial=True)."""
    _, tok = smollm
    rng = random.Random(2)
    vocab = m.token_trie(tok).token_bytes
    texts = {i: b.decode() for i, b in enumerate(vocab) if b and _is_utf8(b)}
    for pattern in (r'"名前": "[^"]{1,6}", "n": [0-9]{1,3}', m.CHARACTER_REGEX, m.schema_to_regex(SMALL_SCHEMA)):
        index, state, prefix = m.TokenIndex(pattern, tok), 0, b""
        for step in range(12):
            allowed = index.allowed(state)
            text = prefix.decode()
            ids = rng.sample(sorted(texts), 1500) + rng.sample(allowed.nonzero()[:, 0].tolist(), min(300, int(allowed.sum())))
            for t in ids:
                if t in texts:
                    ok = regex.fullmatch(pattern, text + texts[t], partial=True, flags=regex.ASCII) is not None
                    assert bool(allowed[t]) == ok, (pattern, text, texts[t])
            assert bool(allowed[tok.eos_id]) == (re.fullmatch(pattern, text, re.ASCII) is not None)
            assert not any(allowed[i] for i in tok.special.values() if i != tok.eos_id)
            assert allowed.any()  # never a dead end
            choices = [t for t in allowed.nonzero()[:, 0].tolist() if t in texts]
            if not choices:
                break
            t = rng.choice(choices)
            prefix, state = prefix + vocab[t], index.step(state, t)


def test_every_reachable_state_has_a_way_on(smollm):
    _, tok = smollm
    for pattern in (r"(ab|cd){1,3}e?", r"\d{1,3}(\.\d)?", r"(?:é|ê|日本)+x", r"a\x04?b"):
        index = m.TokenIndex(pattern, tok)
        seen, todo = {0}, [0]
        while todo:
            s = todo.pop()
            allowed = index.allowed(s)
            assert allowed.any() and (index.dfa.accept[s] or not allowed[tok.eos_id])
            for t in allowed.nonzero()[:, 0].tolist():
                if t != tok.eos_id:
                    nxt = index.step(s, t)
                    assert nxt >= 0
                    if nxt not in seen:
                        seen.add(nxt)
                        todo.append(nxt)
    with pytest.raises(ValueError, match="nothing this tokenizer can produce"):
        m.TokenIndex(r"\x04", tok)


def test_real_model_masking_and_jump_forward(smollm, monkeypatch, capsys):
    import llama3_generate as L
    model, tok = smollm
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "house": {"enum": ["Gryffindor", "Slytherin"]}, "age": {"type": "integer"}}}
    pattern = m.schema_to_regex(schema)
    index, prompt = m.TokenIndex(pattern, tok), tok.chat("Describe Harry Potter in JSON.")
    checked = []

    def checking_logits_fn(fn):
        state = {"cached": 0}

        def wrapped(ids, keep):
            out = fn(ids, keep)
            if keep < state["cached"] and not checked:  # first call after a re-tokenization rolled the cache back
                ref = model(torch.tensor(ids), torch.arange(len(ids)), L.NoCache(), logits_at=torch.tensor([len(ids) - 1]))[0]
                torch.testing.assert_close(out, ref, atol=2e-3, rtol=1e-3)
                checked.append(len(ids) - keep)
            state["cached"] = len(ids)
            return out
        return wrapped

    runs = {jf: m.constrained_decode(index, tok, prompt, m.model_logits_fn(model), 64, jump_forward=jf) for jf in (False, True)}
    for r in runs.values():
        assert r["finished"] and re.fullmatch(pattern, r["text"]) and tok.decode(r["ids"]) == r["text"]
        assert check_schema_value(schema, json.loads(r["text"]))
    assert len(runs[False]["ids"]) <= runs[False]["forward_passes"] <= len(runs[False]["ids"]) + 1
    assert runs[True]["jumps"] > 0 and runs[True]["forward_passes"] < runs[False]["forward_passes"]
    # a jump ending in a space: the next jump re-tokenizes it with the word after it, rolling the cache back
    yes_no = r"(yes|no), because [a-z]{1,12}\. So, (yes|no)\."
    r = m.constrained_decode(m.TokenIndex(yes_no, tok), tok, tok.chat("Is the sky blue?"),
                             checking_logits_fn(m.model_logits_fn(model)), 24)
    assert checked, "no re-tokenization rolled the cache back"
    assert re.fullmatch(yes_no, r["text"]) and tok.decode(r["ids"]) == r["text"]
    # the CLI on the same model: --json carries completion and forward passes for both modes
    monkeypatch.setattr(L, "load_model", lambda path=None: (model, tok))
    m.main(["--regex", yes_no, "--prompt", "Is the sky blue?", "--json", "--max-new-tokens", "40"])
    out = json.loads(capsys.readouterr().out)
    for mode in ("masking_only", "jump_forward"):
        assert out["matches"][mode] and re.fullmatch(yes_no, out["completion"][mode])
        assert out["forward_passes"][mode] >= 1


def test_cli_rejects_bad_input(tmp_path):
    for argv, problem in ((["--regex", "(ab"], "missing )"), (["--json-schema", str(tmp_path / "nope.json")], "nope.json")):
        with pytest.raises(SystemExit, match=re.escape(problem)):
            m.main(argv)
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "object", "properties": {"x": {"type": "strin"}}}')
    with pytest.raises(SystemExit, match="unsupported schema type"):
        m.main(["--json-schema", str(bad)])
