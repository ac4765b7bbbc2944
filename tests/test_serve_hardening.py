"""Server hardening (issue 53) on loopback: deep nesting, strict types, int64 seeds, JSON-only
bodies (415), the body limit (413), count limits, huge prompts refused before tokenization,
tokenization off the engine thread, /health failing on a stalled engine loop, and chat on the
default model with no flags. The 50 MB measurement itself is experiments/serve_big_prompt.py
(its JSON quotes times and memory); ``test_big_prompt_benchmark`` runs it at a smaller size."""

import json
import threading
import time
from dataclasses import replace

import httpx
import openai
import pytest
from transformers import PreTrainedTokenizerFast

from paged_llm.engine.loading import load_tokenizer
from paged_llm.models import trained
from paged_llm.models.presets import default_model_dir
from paged_llm.models.tokenizer_builder import CHAT_TEMPLATE
from paged_llm.serve.background import ServerThread
from paged_llm.serve.cli import build, make_parser
from paged_llm.serve.errors import BadRequest
from paged_llm.serve.tokenization import LengthGuardedTokenizer, max_chars_per_token

LIMIT = 4 * 2**20  # this module's --max-request-body-bytes
COMPLETIONS = "/v1/completions"


def _serve(*extra):
    argv = ["--model", "tiny", "--max-model-len", "256", "--cpu-kv-cache-gib", "0.02",
            "--disable-log-stats", *extra]  # fmt: skip
    return ServerThread(build(make_parser().parse_args(argv))).start()


@pytest.fixture(scope="module")
def server():
    srv = _serve("--max-request-body-bytes", str(LIMIT), "--max-stop-strings", "4",
                 "--max-logit-bias", "3", "--max-stop-string-chars", "16")  # fmt: skip
    yield srv
    srv.stop()


def _post(server, path, body, content_type="application/json", timeout=60):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {} if content_type is None else {"Content-Type": content_type}
    return httpx.post(server.url + path, content=raw, headers=headers, timeout=timeout)


def _assert_error(r, status, param=None, match=None):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if match is not None:
        assert match in error["message"], error


@pytest.mark.parametrize("path", [COMPLETIONS, "/v1/chat/completions", "/v1/responses",
                                  "/tokenize", "/detokenize"])  # fmt: skip
def test_nan_infinity_and_overflowing_numbers_are_a_400(server, path):
    """Python's json reads them, but they are not JSON, and a route that echoes a field (the
    Responses API's ``text``) could not send them back: the fuzz test found a 500 there."""
    for value in ("NaN", "Infinity", "-Infinity", "1e999"):
        body = f'{{"input": "def f", "prompt": "x", "max_tokens": 1, "text": {{"a": [{value}]}}}}'
        _assert_error(_post(server, path, body.encode()), 400, match="malformed JSON body")


@pytest.mark.parametrize("path", [COMPLETIONS, "/v1/chat/completions", "/v1/responses",
                                  "/tokenize", "/detokenize"])  # fmt: skip
def test_a_100000_deep_body_is_a_400(server, path):
    for body in ("[" * 100_000 + "]" * 100_000, '{"a":' * 100_000 + "1" + "}" * 100_000):
        _assert_error(_post(server, path, body.encode()), 400, match="nested deeper")
    # deep inside a field: beyond --max-json-depth (64) refused, a shallow nest served
    deep = {"prompt": "x", "max_tokens": 1, "user_data": json.loads("[" * 70 + "]" * 70)}
    _assert_error(_post(server, COMPLETIONS, deep), 400, match="nested deeper than 64")
    shallow = {**deep, "user_data": json.loads("[" * 10 + "]" * 10)}
    assert _post(server, COMPLETIONS, shallow).status_code == 200


@pytest.mark.parametrize(
    ("field", "value"),
    [("stream", "yes"), ("stream", 1), ("echo", "true"), ("ignore_eos", 0),
     ("max_tokens", 2.0), ("max_tokens", "5"), ("n", True), ("seed", "1"), ("logprobs", 1.5),
     ("temperature", "0.5"), ("stop", 7), ("stream_options", {"include_usage": "yes"}),
     ("prompt", 5), ("top_k", 3.0)],
)  # fmt: skip
def test_types_are_strict(server, field, value):
    body = {"prompt": "x", "max_tokens": 1, field: value}
    _assert_error(_post(server, COMPLETIONS, body), 400, param=field)


def test_strict_types_still_take_what_json_means(server):
    # an integer where a number is expected is a number, as in JSON (and vLLM)
    body = {"prompt": "x", "max_tokens": 1, "temperature": 1, "top_p": 1, "stream": False}
    assert _post(server, COMPLETIONS, body).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "tool_choice": "sometimes", "tools": []}  # fmt: skip
    assert _post(server, "/v1/chat/completions", chat).status_code == 400
    embed = {"input": "x", "encoding_format": "hex"}  # an enum outside its values
    _assert_error(_post(server, "/v1/embeddings", embed), 400, param="encoding_format")


def test_seed_is_within_int64_and_never_aliases(server):
    for seed in (2**63, 2**64, -(2**63) - 1, 10**30):
        body = {"prompt": "x", "max_tokens": 1, "seed": seed}
        _assert_error(_post(server, COMPLETIONS, body), 400, param="seed")

    # choice i samples with seed + i, which must stay within int64 too
    body = {"prompt": "x", "max_tokens": 1, "seed": 2**63 - 1, "n": 2}
    _assert_error(_post(server, COMPLETIONS, body), 400, param="seed")

    def text(seed):
        body = {"prompt": "x", "max_tokens": 12, "seed": seed, "ignore_eos": True}
        r = _post(server, COMPLETIONS, body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    # the edges are accepted and reproducible (2**64 was once wrapped onto 0; it is a 400 now)
    assert text(2**63 - 1) == text(2**63 - 1) and text(-(2**63)) == text(-(2**63))
    assert text(0) != text(1)


def test_only_json_bodies_are_accepted(server):
    body = {"prompt": "x", "max_tokens": 1}
    for content_type in ("text/plain", None, "application/x-www-form-urlencoded", "json"):
        r = _post(server, COMPLETIONS, body, content_type=content_type)
        _assert_error(r, 415, match="application/json")
    for content_type in ("application/json; charset=utf-8", "Application/JSON"):
        assert _post(server, COMPLETIONS, body, content_type=content_type).status_code == 200


def test_bodies_over_the_limit_are_a_413_while_reading(server):
    big = b'{"prompt": "' + b"a" * (LIMIT + 1) + b'"}'
    _assert_error(_post(server, COMPLETIONS, big), 413, match="--max-request-body-bytes")

    def chunks():  # no Content-Length: the limit is counted while reading
        for i in range(0, len(big), 2**20):
            yield big[i : i + 2**20]

    r = httpx.post(server.url + COMPLETIONS, content=chunks(), timeout=60,
                   headers={"Content-Type": "application/json"})  # fmt: skip
    _assert_error(r, 413)
    assert _post(server, COMPLETIONS, {"prompt": "x", "max_tokens": 1}).status_code == 200


def test_count_limits_are_configurable(server):
    ok = {"prompt": "x", "max_tokens": 1}
    assert _post(server, COMPLETIONS, {**ok, "stop": ["a", "b", "c", "d"]}).status_code == 200
    cases = [("stop", ["a", "b", "c", "d", "e"], "--max-stop-strings"),
             ("bad_words", ["a", "b", "c", "d", "e"], "--max-stop-strings"),
             ("stop", "s" * 17, "--max-stop-string-chars"),
             ("logit_bias", {"5": 1, "6": 1, "7": 1, "8": 1}, "--max-logit-bias")]  # fmt: skip
    for field, value, flag in cases:
        _assert_error(_post(server, COMPLETIONS, {**ok, field: value}), 400, field, flag)
    assert _post(server, COMPLETIONS, {**ok, "logit_bias": {"5": 1}}).status_code == 200


@pytest.fixture
def encode_calls(monkeypatch):
    """Every tokenizer ``encode`` call in the process: (thread name, text length)."""
    calls = []
    original = PreTrainedTokenizerFast.encode

    def spy(self, text, *args, **kwargs):
        calls.append((threading.current_thread().name, len(text) if isinstance(text, str) else 0))
        return original(self, text, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerFast, "encode", spy)
    return calls


def test_too_long_prompt_is_refused_before_tokenization(server, encode_calls):
    # 2 MiB of text is under the body limit; its length alone proves it cannot fit 256 tokens
    prompt = "def f(x):\n    return x\n" * (2**21 // 24)
    r = _post(server, COMPLETIONS, {"prompt": prompt, "max_tokens": 1})
    _assert_error(r, 400, "prompt", match="at least")
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
    _assert_error(_post(server, "/v1/chat/completions", chat), 400, "prompt", match="at least")
    assert all(length < 100_000 for _, length in encode_calls)  # never tokenized
    # a prompt that fits is tokenized, on the tokenizer thread and never the engine's
    assert _post(server, COMPLETIONS, {"prompt": "x = 1", "max_tokens": 1}).status_code == 200
    assert encode_calls and all(name.startswith("tokenizer") for name, _ in encode_calls)


def test_tokenizer_bound_comes_from_the_vocabulary(server):
    tokenizer = load_tokenizer(default_model_dir())
    bound = max_chars_per_token(tokenizer)
    assert server.server.config.app.state.engine.tokenizers.chars_per_token == bound
    vocab = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True)
    assert bound == max(map(len, vocab))
    text = "    " * 500 + "def f(x):\n        return x  # " + "#" * 300
    assert len(tokenizer.encode(text, add_special_tokens=False)) >= len(text) / bound


def test_the_guard_checks_every_way_in():
    tokenizer = load_tokenizer(default_model_dir())
    guarded = LengthGuardedTokenizer(tokenizer, 8, max_chars_per_token(tokenizer))
    long = "a" * (8 * 80 + 1)  # at least 9 tokens by its length
    for call in (lambda: guarded.encode(long), lambda: guarded(long),
                 lambda: guarded(text="x", text_pair=long)):  # fmt: skip
        with pytest.raises(BadRequest, match="at least 9 tokens"):
            call()
    assert guarded.encode("a b") == tokenizer.encode("a b")
    assert guarded(text="a", text_pair="b")["input_ids"] == tokenizer("a", "b")["input_ids"]
    assert guarded.decode([5, 6]) == tokenizer.decode([5, 6])  # the rest passes through


def test_the_bound_is_given_only_where_it_holds():
    from tokenizers import Tokenizer, models, normalizers

    vocab = {"<unk>": 0, "\u2581": 1, "a": 2, "\u2581a": 3, "<0x61>": 4, "aaaaaaa": 5}

    def bpe(normalizer=None, **kw):
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[("\u2581", "a")], unk_token="<unk>", **kw))
        if normalizer is not None:
            tok.normalizer = normalizer
        return PreTrainedTokenizerFast(tokenizer_object=tok)

    llama2_normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    # SentencePiece-style byte fallback (Llama-2): its longest piece
    assert max_chars_per_token(bpe(llama2_normalizer, byte_fallback=True, fuse_unk=True)) == 7
    # a fused unknown token can swallow any run of text; NFKC can shorten it; WordPiece has
    # [UNK] for whole words: no bound, nothing refused early
    assert max_chars_per_token(bpe(fuse_unk=True)) is None
    assert max_chars_per_token(bpe(normalizers.NFKC(), byte_fallback=True)) is None
    wordpiece = Tokenizer(models.WordPiece(vocab={"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert max_chars_per_token(PreTrainedTokenizerFast(tokenizer_object=wordpiece)) is None


def test_slow_tokenization_does_not_stall_running_streams(server, monkeypatch):
    """A request held in tokenization (as a huge one would be) while a stream runs: the stream
    gets every token and ends; the held request then completes normally."""
    release, entered = threading.Event(), threading.Event()
    original = PreTrainedTokenizerFast.encode

    def slow(self, text, *args, **kwargs):
        if isinstance(text, str) and "HOLD-ME" in text:
            entered.set()
            release.wait(60)
        return original(self, text, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerFast, "encode", slow)
    held: dict = {}
    worker = threading.Thread(target=lambda: held.update(
        r=_post(server, COMPLETIONS, {"prompt": "HOLD-ME", "max_tokens": 2})))  # fmt: skip
    try:
        worker.start()
        assert entered.wait(60)  # the held request is inside encode now
        body = {"prompt": [5, 6, 7], "max_tokens": 20, "ignore_eos": True, "stream": True}
        tokens = 0
        with httpx.stream("POST", server.url + COMPLETIONS, json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    tokens += bool(json.loads(line[5:])["choices"])
        assert tokens == 20
        # a small text request sent meanwhile completes normally too
        assert _post(server, COMPLETIONS, {"prompt": "x = 1", "max_tokens": 2}).status_code == 200
        assert worker.is_alive() and "r" not in held  # still held all along
    finally:
        release.set()
        worker.join(60)
    assert held["r"].status_code == 200, held["r"].text


def test_health_fails_while_the_engine_loop_stalls():
    srv = _serve("--engine-stall-timeout", "0.5")
    engine = srv.server.config.app.state.engine
    release, entered = threading.Event(), threading.Event()
    step = engine.engine.step

    def stalled_step():
        entered.set()
        release.wait(60)  # a hung step, on purpose
        return step()

    done: dict = {}
    worker = threading.Thread(target=lambda: done.update(
        r=_post(srv, COMPLETIONS, {"prompt": "x", "max_tokens": 2})))  # fmt: skip
    try:
        assert httpx.get(srv.url + "/health").status_code == 200
        engine.engine.step = stalled_step
        worker.start()
        assert entered.wait(60)
        deadline = time.monotonic() + 60
        while (r := httpx.get(srv.url + "/health")).status_code == 200:
            assert time.monotonic() < deadline, "/health never reported the stall"
            time.sleep(0.05)
        _assert_error(r, 503, match="--engine-stall-timeout")
    finally:
        engine.engine.step = step
        release.set()
        worker.join(60)
    assert done["r"].status_code == 200
    deadline = time.monotonic() + 60
    while httpx.get(srv.url + "/health").status_code != 200:  # idle again: healthy
        assert time.monotonic() < deadline
        time.sleep(0.05)
    srv.stop()


def test_chat_works_on_the_default_model_with_no_flags():
    with ServerThread(build(make_parser().parse_args([]))) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Write a function."}]
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
        assert r.choices[0].message.role == "assistant"
        assert isinstance(r.choices[0].message.content, str) and r.usage.completion_tokens == 4
        # the template's rendering, as /tokenize shows it
        t = httpx.post(srv.url + "/tokenize", json={"messages": messages}).json()
        assert t["count"] == r.usage.prompt_tokens


def test_code_small_recipe_ships_the_chat_template(tmp_path):
    recipe = trained.recipe("code-small")
    assert recipe.chat_template == CHAT_TEMPLATE
    # part of the cache key: a cached model without the template is not reused
    assert replace(recipe, chat_template=None).key() != recipe.key()
    for name in trained.TOKENIZER_FILES:
        source = default_model_dir() / name
        if source.is_file():
            (tmp_path / name).write_bytes(source.read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    trained.add_chat_template(tmp_path, recipe.chat_template)
    tokenizer = load_tokenizer(tmp_path)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    assert text == "<s># user:\nhi\n# assistant:\n"


def test_big_prompt_benchmark(tmp_path):
    """experiments/serve_big_prompt.py against live server processes: a 20 MiB prompt over a
    16 MiB body limit (413) and under a 32 MiB one (400 from its length alone), and a 6 MiB one
    under both (400 from its length alone). The small request sent at the same time completes,
    and the server's memory grows by less than 200 MB."""
    from experiments import serve_big_prompt
    from paper_repro.common import compose

    cfg = compose("serve_big_prompt", ["prompt_mb=20", "under_limit_mb=6",
                                       "body_limit_mb=[16,32]", "max_model_len=512"])  # fmt: skip
    doc = serve_big_prompt.write(cfg, tmp_path)
    assert doc["mode"] == "real" and (tmp_path / "serve_big_prompt.json").is_file()
    over_limit, under_limit = doc["runs"]
    assert over_limit["huge_prompt"]["huge"]["status"] == 413
    assert under_limit["huge_prompt"]["huge"]["status"] == 400
    for run in doc["runs"]:
        assert run["under_body_limit_too_long"]["huge"]["status"] == 400
        for case in (run["huge_prompt"], run["under_body_limit_too_long"]):
            assert case["small"]["status"] == 200
            assert case["rss_growth_mib"] < 200 and case.get("peak_growth_mib", 0) < 200
            assert case["huge"]["status"] == 413 or "at least" in case["huge"]["error"]
        assert run["health_after"] == 200
