"""OpenAI-compatible server, end to end on loopback: the official client, streaming, usage, n
(parallel sampling), stop, logprobs, seeds, OpenAI-style errors, disconnects, metrics, a
200-stream load test and the serving benchmark client. One in-process server (tiny model with a
chat template), plus small ones for speculative decoding and prefix caching."""

import asyncio
import json
import os
import random
import re
import shutil
import socket
import time
from collections import defaultdict

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_llm.models.presets import default_model_dir
from paged_llm.serve.background import ServerThread
from paged_llm.serve.cli import build, make_parser
from paged_llm.serve.metrics import parse_metrics

MODEL = "tiny-chat"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
LABEL = f'{{model_name="{MODEL}"}}'
ABORTS = f'vllm:request_success_total{{finished_reason="abort",{LABEL[1:]}'


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    """The tiny default checkpoint plus a chat template in tokenizer_config.json."""
    src = default_model_dir()
    dst = tmp_path_factory.mktemp("tiny-chat")
    for f in src.iterdir():
        if f.name == "model.safetensors":
            os.symlink(f, dst / f.name)
        else:
            shutil.copy(f, dst / f.name)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


def start_server(model_dir, *extra):
    """An in-process server on the tiny checkpoint, with extra flags."""
    argv = [str(model_dir), "--served-model-name", MODEL, "--max-model-len", "256"]
    argv += ["--cpu-kv-cache-gib", "0.05", "--disable-log-stats", *extra]
    return ServerThread(build(make_parser().parse_args(argv))).start()


@pytest.fixture(scope="module")
def server(chat_model_dir):
    srv = start_server(chat_model_dir)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(chat_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(chat_model_dir), local_files_only=True)


def metrics(server) -> dict[str, float]:
    return parse_metrics(httpx.get(server.url + "/metrics").text)


def abort_count(server) -> float:
    return metrics(server)[ABORTS]


def by_index(choices):
    return [c.text for c in sorted(choices, key=lambda c: c.index)]


def streamed_choices(chunks):
    """Choice index -> its streamed chunk entries, in order."""
    per = defaultdict(list)
    for chunk in chunks:
        for choice in chunk.choices:
            per[choice.index].append(choice)
    return per


def wait_idle(server, timeout=10.0, aborts: float | None = None) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and no KV block is in use (bounded).

    With ``aborts``, also wait for the abort counter to reach it: a client that gives up early
    may disconnect before the server has even submitted its request, so "idle" alone can be
    seen before the request exists."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        idle = all(
            m[f"vllm:{name}{LABEL}"] == 0
            for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        )
        if aborts is not None:
            idle = idle and m[ABORTS] >= aborts
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def greedy(**kw):
    return dict(temperature=0, extra_body={"ignore_eos": True}, **kw)


# ---- basics -----------------------------------------------------------------------------------
def test_health_models_and_version(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == 256
    version = httpx.get(server.url + "/version").json()
    assert version["version"] and version["hardware"]["device"] == "cpu"


def test_completion_usage_and_length(client, tokenizer):
    prompt = "def fibonacci(n):"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, **greedy())
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    assert isinstance(r.choices[0].text, str) and r.id.startswith("cmpl-")


def test_streaming_completion_matches_whole(client):
    kw = dict(model=MODEL, prompt="import os\n", max_tokens=12, **greedy())
    whole = client.completions.create(**kw)
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) == 12  # one chunk per generated token
    assert "".join(texts) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_continuous_usage_stats_count_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far."""
    kw = dict(model=MODEL, prompt="import os\n", max_tokens=6, **greedy())
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(stream=True, stream_options=opts, **kw))
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == [1, 2, 3, 4, 5, 6, 6]  # six token chunks, then the usage chunk
    assert len({c.usage.prompt_tokens for c in chunks}) == 1
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, **greedy())
    chunks = list(client.chat.completions.create(stream=True, stream_options=opts, **chat))
    assert all(c.usage is not None for c in chunks) and chunks[-1].usage.completion_tokens == 3
    plain = list(client.completions.create(stream=True, **kw))
    assert all(c.usage is None for c in plain)  # only when asked


def test_chat_completion_stream_and_whole(client, tokenizer):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say something."},
    ]
    kw = dict(model=MODEL, messages=messages, max_tokens=9, **greedy())
    whole = client.chat.completions.create(**kw)
    msg = whole.choices[0].message
    assert whole.object == "chat.completion" and msg.role == "assistant"
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert whole.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    assert whole.usage.completion_tokens == 9
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == msg.content
    assert chunks[-1].usage.completion_tokens == 9


def test_n_choices_and_seed_determinism(client):
    kw = dict(model=MODEL, prompt="class Parser:", max_tokens=10, n=2, seed=1234)
    kw.update(temperature=1.0, extra_body={"ignore_eos": True})
    first = client.completions.create(**kw)
    again = client.completions.create(**kw)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert first.usage.completion_tokens == 2 * 10
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1]  # choices get derived seeds (seed + index)
    other = client.completions.create(**{**kw, "seed": 99})
    assert [c.text for c in sorted(other.choices, key=lambda c: c.index)] != texts


def test_best_of_returns_the_likeliest_of_its_samples(client):
    """best_of = 3, n = 1: the choice is the one of the three seeded samples (seed + i, as
    with n = 3) whose tokens have the highest summed logprob."""
    kw = dict(model=MODEL, prompt="class Parser:", max_tokens=6, seed=21, temperature=1.0,
              logprobs=0, extra_body={"ignore_eos": True})  # fmt: skip
    every = client.completions.create(n=3, **kw).choices
    best = client.completions.create(n=1, best_of=3, **kw).choices
    total = {c.text: sum(c.logprobs.token_logprobs) for c in every}
    assert len(total) == 3 and len(best) == 1 and best[0].index == 0
    assert best[0].text == max(total, key=total.get)


def test_parallel_sampling_n3_whole_and_streamed(server, client, tokenizer):
    prompt = "class Parser:"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=6, n=3, seed=7, temperature=1.0)
    kw["extra_body"] = {"ignore_eos": True}
    whole = client.completions.create(**kw)
    texts = by_index(whole.choices)
    assert len(texts) == 3 and len(set(texts)) == 3
    # one engine request: the prompt is counted once, not once per choice
    assert whole.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert whole.usage.completion_tokens == 3 * 6
    # choice i is sampled with seed + i, exactly like a single request with that seed
    singles = [client.completions.create(**{**kw, "n": 1, "seed": 7 + i}) for i in range(3)]
    assert texts == [r.choices[0].text for r in singles]
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    per = streamed_choices(chunks)
    assert sorted(per) == [0, 1, 2]
    for i, entries in per.items():
        assert len(entries) == 6  # one chunk per token of that choice, none for the others
        assert "".join(e.text for e in entries) == texts[i]
        assert [e.finish_reason for e in entries] == [None] * 5 + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    # chat: every choice starts with its role chunk
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=3,
        stream=True, **greedy(),
    )  # fmt: skip
    per = streamed_choices(chat)
    assert sorted(per) == [0, 1, 2]
    assert all(entries[0].delta.role == "assistant" for entries in per.values())
    assert all(entries[-1].finish_reason == "length" for entries in per.values())
    contents = {"".join(e.delta.content or "" for e in entries) for entries in per.values()}
    assert len(contents) == 1  # greedy samples of one prompt agree
    m = wait_idle(server)
    assert m[f"vllm:kv_cache_usage_perc{LABEL}"] == 0
    assert server.server.config.app.state.engine.engine.kv_usage() == 0


def test_prompt_batch_with_n_gives_n_choices_per_prompt(client):
    prompts = [[5, 6, 7], [8, 9]]  # token ids: two prompts, so two engine requests
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=3, n=2, **greedy())
    texts = by_index(r.choices)
    assert len(texts) == 4
    # choice i belongs to prompt i // n; greedy samples of one prompt agree
    assert texts[0] == texts[1] and texts[2] == texts[3]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 4 * 3


def test_stop_string_streaming_and_whole(client):
    kw = dict(model=MODEL, prompt="for i in range(", max_tokens=40, **greedy())
    ref = client.completions.create(**kw).choices[0].text
    # a stop string from the middle of the greedy output, at its first occurrence
    k = next(
        k
        for k in range(len(ref) // 3, len(ref) - 3)
        if ref[k : k + 3].isascii()
        and ref.find(ref[k : k + 3]) == k
        and "\ufffd" not in ref[: k + 3]
    )
    stop = ref[k : k + 3]
    whole = client.completions.create(stop=[stop], **kw).choices[0]
    assert whole.text == ref[:k] and whole.finish_reason == "stop"
    assert whole.model_extra["stop_reason"] == stop
    chunks = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == ref[:k]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_completion_and_chat(client):
    r = client.completions.create(model=MODEL, prompt="x = ", max_tokens=4, logprobs=2, **greedy())
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs)  # top-2 plus the sampled token
    assert lp.text_offset[0] == 0
    c = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        **greedy(),
    )
    content = c.choices[0].logprobs.content
    assert len(content) == 3
    for item in content:
        assert len(item.top_logprobs) == 2
        # greedy: the chosen token is the most likely one
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)


# ---- bad input --------------------------------------------------------------------------------
BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"max_tokens": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": "word " * 400}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 300}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [5, 999999]}, 400, None),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2, "stream": True}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0, "echo": False}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 1}}, 400, None),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "(open"}, 400, None),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "a", "guided_choice": ["b"]}, 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
     "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
     "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     400, "response_format"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     400, "top_logprobs"),
    ("/v1/nothing-here", {}, 404, None),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    json_body = {"content": body, "headers": {"Content-Type": "application/json"}}
    kw = json_body if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + path, **kw, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param


def test_errors_reach_the_official_client_and_others_are_unaffected(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi")
    r = client.completions.create(model=MODEL, prompt="still here", max_tokens=3, **greedy())
    assert r.usage.completion_tokens == 3


def test_penalties_and_logit_bias_reach_the_engine(client, chat_model_dir):
    """The OpenAI fields (and vLLM's repetition_penalty) give what the engine gives with the
    same SamplingParams, which differs from the output without them."""
    from paged_llm import LLM, SamplingParams

    prompt = [5, 6, 7, 8] * 3
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, frequency_penalty=1.5, presence_penalty=0.5,
        logit_bias={"7": 5.0}, temperature=0,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.3},
    )  # fmt: skip
    llm = LLM(str(chat_model_dir), max_model_len=256, cpu_kv_cache_gib=0.05)
    base = dict(temperature=0, max_tokens=12, ignore_eos=True)
    shaped = SamplingParams(**base, frequency_penalty=1.5, presence_penalty=0.5,
                            repetition_penalty=1.3, logit_bias={7: 5.0})  # fmt: skip
    want, plain = (llm.generate({"prompt_token_ids": prompt}, p, use_tqdm=False)[0].outputs[0]
                   for p in (shaped, SamplingParams(**base)))  # fmt: skip
    assert r.choices[0].text == want.text
    assert want.token_ids != plain.token_ids


def test_structured_outputs_response_format_and_guided_fields(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    messages = [{"role": "user", "content": "answer in JSON"}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=30, temperature=0.7, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )  # fmt: skip
    assert isinstance(json.loads(r.choices[0].message.content)["ok"], bool)
    r = client.completions.create(model=MODEL, prompt="pick:", max_tokens=10, n=4, seed=2,
                                  extra_body={"guided_choice": ["left", "right"]})  # fmt: skip
    assert {c.text for c in r.choices} <= {"left", "right"}
    stream = client.completions.create(model=MODEL, prompt="n =", max_tokens=10, stream=True,
                                       extra_body={"guided_regex": "[0-9]{4}"})  # fmt: skip
    assert re.fullmatch("[0-9]{4}", "".join(c.choices[0].text for c in stream if c.choices))
    # vLLM's current spelling (v0.12 removed guided_*): structured_outputs
    body = {"structured_outputs": {"choice": ["up", "down"]}}
    r = client.completions.create(model=MODEL, prompt="pick:", max_tokens=10, n=3, seed=3,
                                  extra_body=body)  # fmt: skip
    assert {c.text for c in r.choices} <= {"up", "down"}
    for body, message in [
        ({"structured_outputs": {"whitespace_pattern": " "}}, "unsupported field"),
        ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "both"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ]:
        with pytest.raises(openai.BadRequestError, match=message):
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body=body)


def test_tokenize_and_detokenize(server, tokenizer):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "def f(x):"}).json()
    assert r["tokens"] == tokenizer.encode("def f(x):") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256
    chat = httpx.post(server.url + "/tokenize", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).json()  # fmt: skip
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    assert chat["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": tokenizer.decode(r["tokens"])}
    for path, body, status in [
        ("/tokenize", {"prompt": "a", "messages": []}, 400),
        ("/tokenize", {"prompt": "a", "model": "nope"}, 404),
        ("/detokenize", {"tokens": [1, 10**7]}, 400),
        ("/detokenize", {"tokens": "abc"}, 400),
    ]:
        assert httpx.post(server.url + path, json=body).status_code == status


def test_echo_with_logprobs_scores_the_prompt_like_the_engine(client, chat_model_dir, tokenizer):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs=1, max_tokens 1 (or 0)."""
    from paged_llm import LLM, SamplingParams

    prompt = [5, 6, 7, 8, 9, 10]
    llm = LLM(str(chat_model_dir), max_model_len=256, cpu_kv_cache_gib=0.05)
    ref = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, logprobs=1),
    )[0]
    one = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True,
                                    logprobs=1, temperature=0)  # fmt: skip
    zero = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True,
                                     logprobs=1, temperature=0)  # fmt: skip
    text = tokenizer.decode(prompt)
    assert one.choices[0].text == text + ref.outputs[0].text and zero.choices[0].text == text
    assert (one.usage.completion_tokens, zero.usage.completion_tokens) == (1, 0)
    for r, n in ((one, len(prompt) + 1), (zero, len(prompt))):
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for i in range(1, len(prompt)):
            assert lp.token_logprobs[i] == pytest.approx(ref.prompt_logprobs[i][prompt[i]],
                                                         abs=1e-4)  # fmt: skip
            assert 1 <= len(lp.top_logprobs[i]) <= 2
        assert "".join(lp.tokens[: len(prompt)]) == text
    generated = ref.outputs[0].token_ids[0]
    assert one.choices[0].logprobs.token_logprobs[-1] == pytest.approx(
        ref.outputs[0].logprobs[0][generated], abs=1e-4
    )


def test_prompt_logprobs_field_like_vllm(server, chat_model_dir):
    """vLLM's prompt_logprobs: per choice (completions) or per response (chat), each entry
    token id -> logprob, rank and decoded text; refused with stream, as vLLM does."""
    from paged_llm import LLM, SamplingParams

    prompt = [5, 6, 7, 8, 9, 10]
    llm = LLM(str(chat_model_dir), max_model_len=256, cpu_kv_cache_gib=0.05)
    ref = llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=2)
    )[0].prompt_logprobs
    url = server.url + "/v1/completions"
    body = {"prompt": [prompt, prompt], "max_tokens": 2, "n": 2, "prompt_logprobs": 2}
    got = httpx.post(url, json=body).json()
    assert len(got["choices"]) == 4
    for choice in got["choices"]:
        lps = choice["prompt_logprobs"]
        assert len(lps) == len(prompt) and lps[0] is None
        for entry, ref_entry in zip(lps[1:], ref[1:]):
            assert set(entry) == {str(t) for t in ref_entry}
            for t, v in ref_entry.items():
                e = entry[str(t)]
                assert e["logprob"] == pytest.approx(v.logprob, abs=1e-4)
                assert (e["rank"], e["decoded_token"]) == (v.rank, v.decoded_token)
    plain = httpx.post(url, json={"prompt": prompt, "max_tokens": 1}).json()
    assert plain["choices"][0]["prompt_logprobs"] is None
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 1}
    got = httpx.post(server.url + "/v1/chat/completions", json=chat).json()
    assert got["prompt_logprobs"][0] is None and len(got["prompt_logprobs"]) > 1
    assert all(1 <= len(e) <= 2 for e in got["prompt_logprobs"][1:])
    for bad, match in [
        ({"prompt_logprobs": 1, "stream": True}, "not available when stream"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be in"),
        ({"prompt_logprobs": 10_000}, "prompt_logprobs must be in"),
    ]:
        r = httpx.post(url, json={"prompt": prompt, "max_tokens": 1, **bad})
        assert r.status_code == 400 and match in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "prompt_logprobs"
    streamed = {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0, "stream": True}
    assert httpx.post(url, json=streamed).status_code == 200  # 0 is accepted and dropped


def test_truncate_prompt_tokens(server):
    url = server.url + "/v1/completions"
    long = [5, 6, 7, 8] * 80  # 320 tokens, beyond the 256-token context
    body = {"prompt": long, "max_tokens": 2, "truncate_prompt_tokens": 10, "temperature": 0}
    got = httpx.post(url, json=body).json()
    assert got["usage"]["prompt_tokens"] == 10
    tail = httpx.post(url, json={**body, "prompt": long[-10:]}).json()
    assert got["choices"][0]["text"] == tail["choices"][0]["text"]
    r = httpx.post(url, json={"prompt": long, "max_tokens": 2})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]


def test_echo_text_prompt_streamed_and_whole(client):
    whole = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=5, echo=True,
                                      **greedy())  # fmt: skip
    assert whole.choices[0].text.startswith("def f(x):")
    assert whole.usage.completion_tokens == 5
    stream = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=5, echo=True,
                                       stream=True, **greedy())  # fmt: skip
    assert "".join(c.choices[0].text for c in stream if c.choices) == whole.choices[0].text


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    before = abort_count(server)
    body = {"prompt": "while True:", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    after = wait_idle(server, timeout=30.0, aborts=before + 1)
    assert after[f"vllm:kv_cache_usage_perc{LABEL}"] == 0 and after[ABORTS] == before + 1


def test_disconnect_aborts_every_sample_of_n(server):
    before = abort_count(server)
    body = {"prompt": "while True:", "max_tokens": 200, "n": 3, "stream": True}
    body["ignore_eos"] = True
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert next(line for line in r.iter_lines() if line.startswith("data:"))
    after = wait_idle(server, timeout=30.0, aborts=before + 3)
    # counted per choice, as vLLM counts sequences
    assert after[f"vllm:kv_cache_usage_perc{LABEL}"] == 0 and after[ABORTS] == before + 3


def test_disconnect_while_waiting_for_a_whole_response_aborts(server):
    """A client of a non-streamed request hangs up while it runs: every sample is aborted."""
    # Start from an idle server, so that "running" below means this request: with a request
    # of an earlier test still running, the client could hang up before the server had read
    # its request, which then never starts and is never aborted.
    before = wait_idle(server, timeout=30.0)[ABORTS]
    body = json.dumps({"prompt": "while True:", "max_tokens": 240, "n": 4, "ignore_eos": True})
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {server.host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall((head + body).encode())
        # Hang up once the request runs. A client that leaves before the server has even read
        # its request started nothing, and a fixed client timeout cannot tell the two apart.
        deadline = time.monotonic() + 30
        while metrics(server)[f"vllm:num_requests_running{LABEL}"] == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
    after = wait_idle(server, timeout=30.0, aborts=before + 4)  # a loaded machine is slow
    assert after[f"vllm:kv_cache_usage_perc{LABEL}"] == 0 and after[ABORTS] == before + 4


def test_metrics_count_tokens_and_latencies(server, client, tokenizer):
    before = wait_idle(server)
    prompts = ("a", "bb cc", "def f(x): return x")
    for prompt in prompts:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, **greedy())
    after = metrics(server)

    def delta(name):
        return after[name] - before[name]

    assert delta(f"vllm:generation_tokens_total{LABEL}") == 15
    assert delta(f"vllm:prompt_tokens_total{LABEL}") == sum(
        len(tokenizer.encode(p)) for p in prompts
    )
    for h in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert delta(f"vllm:{h}_seconds_count{LABEL}") == 3
        assert (
            after[f'vllm:{h}_seconds_bucket{{le="+Inf",{LABEL[1:]}']
            == after[f"vllm:{h}_seconds_count{LABEL}"]
        )
    assert delta(f"vllm:time_per_output_token_seconds_count{LABEL}") == 3 * 4


# ---- load -------------------------------------------------------------------------------------
async def _stream_one(http, url, i, rng, max_tokens):
    """One streaming request; a seeded fifth of them hang up after 0-3 events."""
    hang_up_after = rng.randint(0, 3) if rng.random() < 0.2 else None
    body = {
        "model": MODEL,
        "prompt": f"request {i}: " + "x" * rng.randint(1, 30),
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": i,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    tokens, usage, done = 0, None, False
    async with http.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            return r.status_code, None
        events = 0
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            if hang_up_after is not None and events >= hang_up_after:
                return 200, "aborted"  # leaving the block closes the connection
            events += 1
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if chunk["choices"]:
                tokens += 1
            else:
                usage = chunk["usage"]
    return 200, (tokens, usage, done)


def test_load_200_concurrent_streams_with_disconnects(server):
    rng = random.Random(0)
    url = server.url + "/v1/completions"
    max_tokens = 8

    async def run():
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=60) as http:
            return await asyncio.gather(
                *(_stream_one(http, url, i, rng, max_tokens) for i in range(200))
            )

    results = asyncio.run(run())
    statuses = [s for s, _ in results]
    assert all(s == 200 for s in statuses), sorted(set(statuses))
    finished = [r for _, r in results if r != "aborted"]
    aborted = len(results) - len(finished)
    assert 20 <= aborted <= 60  # about a fifth, seeded
    for tokens, usage, done in finished:
        assert done and tokens == max_tokens and usage["completion_tokens"] == max_tokens
    m = wait_idle(server)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert m[f"vllm:{name}{LABEL}"] == 0
    engine = server.server.config.app.state.engine.engine
    assert not engine.has_unfinished_requests() and engine.kv_usage() == 0


# ---- serving benchmark --------------------------------------------------------------------------
def test_bench_serve_reports_vllm_layout(server, tmp_path, chat_model_dir):
    from experiments import bench_serve

    argv = ["--base-url", server.url, "--model", MODEL, "--num-prompts", "6"]
    argv += ["--request-rate", "40", "--max-total-len", "64", "--seed", "1", "--quiet"]
    argv += ["--result-dir", str(tmp_path), "--result-filename", "r.json"]
    result = bench_serve.main(argv)
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["completed"] == 6 and saved["failed"] == 0
    for key in ("total_input_tokens", "total_output_tokens", "request_throughput",
                "output_throughput", "total_token_throughput", "duration", "request_rate",
                "burstiness", "max_concurrency", "max_output_tokens_per_s"):  # fmt: skip
        assert key in saved, key
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p99"):
            assert saved[f"{stat}_{metric}_ms"] >= 0, (stat, metric)
    assert result["total_output_tokens"] == saved["total_output_tokens"] > 0
    assert saved["mode"] == "real" and saved["server"]["hardware"]["device"] == "cpu"
    assert saved["client_hardware"]["cpu_count"] >= 1
    # chat backend, text prompts from the tokenizer, max concurrency instead of a rate
    argv = ["--base-url", server.url, "--model", MODEL, "--backend", "openai-chat"]
    argv += ["--tokenizer", str(chat_model_dir), "--num-prompts", "4", "--max-concurrency", "2"]
    argv += ["--max-total-len", "64", "--fit", "scale", "--quiet", "--save-detailed"]
    chat = bench_serve.main(argv)
    assert chat["completed"] == 4 and chat["max_concurrency"] == 2
    assert len(chat["ttfts"]) == 4 and all(e == "" for e in chat["errors"])


# ---- engine features: speculative decoding, prefix caching --------------------------------------
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
REPETITIVE = "def fib(n):\n    return fib(n-1) + fib(n-2)\n\ndef fib(n):"


@pytest.fixture(scope="module")
def spec_server(chat_model_dir):
    srv = start_server(chat_model_dir, "--speculative-config", SPEC)
    yield srv
    srv.stop()


def test_speculative_decoding_keeps_greedy_output_and_counts_drafts(server, client, spec_server):
    spec = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="-", max_retries=0, timeout=60)
    for prompt in (REPETITIVE, "import os\n"):
        kw = dict(model=MODEL, prompt=prompt, max_tokens=30, **greedy())
        want = client.completions.create(**kw).choices[0].text
        assert spec.completions.create(**kw).choices[0].text == want
        chunks = list(spec.completions.create(stream=True, **kw))
        assert "".join(c.choices[0].text for c in chunks) == want
    # logprobs under speculation: one entry per token, as the plain server gives them
    kw = dict(model=MODEL, prompt=REPETITIVE, max_tokens=20, logprobs=2, **greedy())
    want = client.completions.create(**kw).choices[0].logprobs
    accepted_before = metrics(spec_server)[f"vllm:spec_decode_num_accepted_tokens_total{LABEL}"]
    got = spec.completions.create(**kw).choices[0].logprobs
    assert metrics(spec_server)[f"vllm:spec_decode_num_accepted_tokens_total{LABEL}"] > (
        accepted_before
    )
    assert got.tokens == want.tokens
    assert got.token_logprobs == pytest.approx(want.token_logprobs, abs=1e-4)
    assert [d.keys() for d in got.top_logprobs] == [d.keys() for d in want.top_logprobs]
    m = metrics(spec_server)
    drafts = m[f"vllm:spec_decode_num_drafts_total{LABEL}"]
    draft_tokens = m[f"vllm:spec_decode_num_draft_tokens_total{LABEL}"]
    accepted = m[f"vllm:spec_decode_num_accepted_tokens_total{LABEL}"]
    assert 0 < drafts <= draft_tokens <= 3 * drafts and 0 < accepted <= draft_tokens
    name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    per_pos = [m[f'{name}{{{LABEL[1:-1]},position="{i}"}}'] for i in range(3)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    # a server without speculation (or prefix caching) exports no zero-valued placeholders
    text = httpx.get(server.url + "/metrics").text
    assert "spec_decode" not in text and "prefix_cache" not in text and "kv_offload" not in text


def test_prefix_cache_metrics_count_hits_of_a_repeated_prompt(chat_model_dir):
    srv = start_server(chat_model_dir, "--enable-prefix-caching", "--block-size", "16")
    try:
        prompt = list(range(10, 90))  # 80 tokens: 4 full blocks ahead of the last token
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
        queries = f"vllm:prefix_cache_queries_total{LABEL}"
        hits = f"vllm:prefix_cache_hits_total{LABEL}"
        counts = []
        for _ in range(2):
            assert httpx.post(srv.url + "/v1/completions", json=body).status_code == 200
            m = metrics(srv)
            counts.append((m[queries], m[hits]))
        assert counts[0] == (4, 0)  # cold cache: the blocks are looked up, none is found
        assert counts[1] == (8, 4)  # the repeat finds every block of its prefix
    finally:
        srv.stop()


def test_cpu_tier_metrics_count_blocks_copied_out_and_back(chat_model_dir):
    """--kv-offloading-size: a prompt whose blocks other prompts evicted from a 24-block pool
    comes back from the CPU tier (its 4 full blocks), as the counters show."""
    flags = ["--enable-prefix-caching", "--block-size", "16", "--num-gpu-blocks-override", "24",
             "--kv-offloading-size", "0.01"]  # fmt: skip
    srv = start_server(chat_model_dir, *flags)
    try:
        body = {"prompt": list(range(10, 90)), "max_tokens": 2, "temperature": 0}
        first = httpx.post(srv.url + "/v1/completions", json=body).json()
        for i in range(4):  # 4 x 200 tokens through a 384-token pool evict the first prompt
            other = {"prompt": [100 + 3 * i + j % 7 for j in range(200)], "max_tokens": 2}
            assert httpx.post(srv.url + "/v1/completions", json=other).status_code == 200
        again = httpx.post(srv.url + "/v1/completions", json=body).json()
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        m = metrics(srv)
        assert m[f"paged_llm:kv_offload_saved_blocks_total{LABEL}"] >= 4
        assert m[f"paged_llm:kv_offload_loaded_blocks_total{LABEL}"] == 4
    finally:
        srv.stop()


def test_conflicting_whitelists_are_a_400_not_a_dead_engine(server):
    """Found by the fuzz test below: a grammar none of whose first tokens is allowed made every
    probability NaN and stopped the engine for everyone."""
    for stream in (False, True):
        for allowed in ([0], [19]):
            body = {"prompt": "x", "guided_regex": "[ab]{2}", "allowed_token_ids": allowed,
                    "stream": stream}  # fmt: skip
            r = httpx.post(server.url + "/v1/completions", json=body)
            assert r.status_code == 400 and "no token to start with" in r.text
    assert httpx.get(server.url + "/health").status_code == 200


# ---- random request bodies: a 200 or a 4xx, never a failed engine ----------------------------
_odd_numbers = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.sampled_from([0, -1, 1e-30, 1e30, 2**64, 10**6]),
    st.integers(-3, 300),
)
_bodies = st.fixed_dictionaries(
    {"prompt": st.one_of(st.text(max_size=12), st.lists(st.integers(-2, 3000), max_size=6))},
    optional={
        name: _odd_numbers
        for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed",
                     "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
                     "min_tokens", "prompt_logprobs", "best_of")
    }
    | {
        "echo": st.booleans(),
        "stream": st.booleans(),
        "ignore_eos": st.booleans(),
        "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=2)),
        "logit_bias": st.dictionaries(st.sampled_from(["1", "x", "99999"]), _odd_numbers,
                                      max_size=2),
        "guided_choice": st.lists(st.text(max_size=4), max_size=3),
        "guided_regex": st.sampled_from(["[ab]{2}", "(", "a*"]),
        "bad_words": st.lists(st.text(max_size=4), max_size=2),
        "allowed_token_ids": st.lists(st.integers(-1, 3000), max_size=3),
    },
)  # fmt: skip


_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", "wizard"])},
        optional={"content": st.one_of(st.none(), st.text(max_size=8),
                                       st.lists(st.fixed_dictionaries(
                                           {"type": st.sampled_from(["text", "image_url"]),
                                            "text": st.text(max_size=4)}), max_size=2))},
    ),
    max_size=3,
)  # fmt: skip
_chat_bodies = st.fixed_dictionaries(
    {"messages": _messages},
    optional={
        name: _odd_numbers
        for name in ("max_tokens", "max_completion_tokens", "temperature", "top_logprobs", "n",
                     "seed", "min_tokens", "prompt_logprobs", "truncate_prompt_tokens")
    }
    | {
        "logprobs": st.booleans(),
        "stream": st.booleans(),
        "add_generation_prompt": st.booleans(),
        "continue_final_message": st.booleans(),
        "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"},
                                            {"type": "json_schema"}, {"type": "yaml"},
                                            {"type": "json_schema", "json_schema": {
                                                "schema": {"type": "integer"}}}]),
        "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=2)),
        "allowed_token_ids": st.lists(st.integers(-1, 3000), max_size=3),
    },
)  # fmt: skip


@pytest.mark.parametrize(
    "path,bodies", [("completions", _bodies), ("chat/completions", _chat_bodies)]
)
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_bodies_never_break_the_server(server, path, bodies, data):
    body = data.draw(bodies, label="body")
    r = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=60)
    assert r.status_code == 200 or 400 <= r.status_code < 500, r.text
    assert httpx.get(server.url + "/health").status_code == 200


def sse_json(server, route, body):
    """The JSON chunks of a streamed request ([DONE] left out)."""
    with httpx.stream("POST", server.url + route, json={**body, "stream": True}) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def test_return_token_ids_whole_and_streamed(server):
    """vLLM's ``return_token_ids``: the prompt's ids (per choice for completions, top-level for
    chat; a stream's first chunk) and each choice's generated ids (new ones per chunk)."""
    base = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    prompt_ids = httpx.post(server.url + "/tokenize", json={"prompt": "def f(x):"}).json()["tokens"]
    body = {**base, "prompt": "def f(x):", "n": 2, "seed": 1, "temperature": 1.0}
    whole = httpx.post(server.url + "/v1/completions", json=body).json()
    for choice in whole["choices"]:
        assert choice["prompt_token_ids"] == prompt_ids and len(choice["token_ids"]) == 6
        text = httpx.post(server.url + "/detokenize", json={"tokens": choice["token_ids"]}).json()
        assert text["prompt"] == choice["text"]
    chunks = sse_json(server, "/v1/completions", body)
    streamed: dict[int, list[int]] = {}
    for chunk in chunks:
        (c,) = chunk["choices"]
        assert ("prompt_token_ids" in c) == (c["index"] not in streamed)  # the first chunk's
        streamed.setdefault(c["index"], []).extend(c["token_ids"])
    assert [streamed[i] for i in (0, 1)] == [c["token_ids"] for c in whole["choices"]]
    echoed = httpx.post(server.url + "/v1/completions", json={**base, "prompt": prompt_ids,
                                                               "echo": True}).json()  # fmt: skip
    assert len(echoed["choices"][0]["token_ids"]) == 6  # the echoed prompt is not generated
    messages = [{"role": "user", "content": "hi"}]
    chat_prompt = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()
    chat = httpx.post(server.url + "/v1/chat/completions",
                      json={**base, "messages": messages}).json()  # fmt: skip
    assert chat["prompt_token_ids"] == chat_prompt["tokens"]
    assert len(chat["choices"][0]["token_ids"]) == 6
    chunks = sse_json(server, "/v1/chat/completions", {**base, "messages": messages})
    assert chunks[0]["prompt_token_ids"] == chat_prompt["tokens"]
    assert "prompt_token_ids" not in chunks[1]
    ids = [t for chunk in chunks for c in chunk["choices"] for t in c.get("token_ids", [])]
    assert ids == chat["choices"][0]["token_ids"]
    plain = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert "token_ids" not in plain.json()["choices"][0]  # only when asked for


def test_async_scheduling_server_streams_the_same_tokens_and_frees_aborted_blocks(
    chat_model_dir, client
):
    """``--async-scheduling``: streamed and whole completions equal the default server's, and
    a client hanging up mid-stream (a step of its request in flight) frees every block."""
    srv = start_server(chat_model_dir, "--async-scheduling")
    try:
        pipelined = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                                  timeout=60)  # fmt: skip
        kw = dict(model=MODEL, prompt="import os\n", max_tokens=12, **greedy())
        want = client.completions.create(**kw).choices[0].text
        assert pipelined.completions.create(**kw).choices[0].text == want
        chunks = list(pipelined.completions.create(stream=True, **kw))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        before = abort_count(srv)
        body = {"prompt": "while True:", "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
            assert next(line for line in r.iter_lines() if line.startswith("data:"))
        after = wait_idle(srv, timeout=30.0, aborts=before + 1)
        assert after[f"vllm:kv_cache_usage_perc{LABEL}"] == 0
    finally:
        srv.stop()
