"""vLLM's ``use_beam_search`` through the server: the beams equal the offline
``LLM.beam_search``'s (completions with several prompts, chat, with and without the prefix
cache, whose hits show the beams sharing blocks; streamed too), the ranking rule alone, and the
refusals."""

import httpx
import openai
import pytest

from paged_llm import LLM
from paged_llm.beam_search import BeamSearchParams, rank_extensions
from paged_llm.models.presets import default_model_dir
from paged_llm.serve.background import ServerThread
from paged_llm.serve.cli import build, make_parser
from paged_llm.serve.metrics import parse_metrics

MODEL = "tiny-beams"
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
PROMPTS = ["def fib(n):", "import os"]
WIDTH, LENGTH = 3, 10


def start(*extra):
    argv = [str(default_model_dir()), "--served-model-name", MODEL, "--max-model-len", "256",
            "--cpu-kv-cache-gib", "0.05", "--disable-log-stats", "--chat-template", TEMPLATE,
            *extra]  # fmt: skip
    return ServerThread(build(make_parser().parse_args(argv))).start()


@pytest.fixture(scope="module")
def servers():
    plain, cached = start(), start("--enable-prefix-caching", "--block-size", "4")
    yield plain, cached
    plain.stop()
    cached.stop()


@pytest.fixture(scope="module")
def offline():
    """The offline search's texts per prompt (best first), and the tokenizer."""
    llm = LLM(str(default_model_dir()), cpu_kv_cache_gib=0.05, max_model_len=256)
    tok = llm.get_tokenizer()
    chat_ids = tok.encode(f"<|user|>\n{PROMPTS[0]}\n<|assistant|>\n", add_special_tokens=False)
    prompts = [tok.encode(p) for p in PROMPTS] + [chat_ids]
    out = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                          BeamSearchParams(beam_width=WIDTH, max_tokens=LENGTH))  # fmt: skip
    texts = [[tok.decode(s.tokens[len(p):], skip_special_tokens=True) for s in o.sequences]
             for p, o in zip(prompts, out)]  # fmt: skip
    llm.shutdown()
    return texts


def client_of(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_beams_through_the_server_equal_the_offline_search(servers, offline):
    for server in servers:
        client = client_of(server)
        r = client.completions.create(model=MODEL, prompt=PROMPTS, n=WIDTH, max_tokens=LENGTH,
                                      extra_body={"use_beam_search": True})  # fmt: skip
        texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
        assert texts == offline[0] + offline[1]  # choice i belongs to prompt i // n
        assert all(c.finish_reason == "length" for c in r.choices)
        single = [client.completions.create(model=MODEL, prompt=p, max_tokens=1) for p in PROMPTS]
        assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in single)
        assert r.usage.completion_tokens == 2 * WIDTH * LENGTH
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], n=WIDTH,
            max_tokens=LENGTH, extra_body={"use_beam_search": True},
        )  # fmt: skip
        assert [c.message.content for c in chat.choices] == offline[2]
    # the prefix cache lets each step's beams reuse their earlier blocks
    metrics = parse_metrics(httpx.get(servers[1].url + "/metrics").text)
    assert metrics[f'vllm:prefix_cache_hits_total{{model_name="{MODEL}"}}'] > 0


def test_streamed_beams_are_the_whole_beams_then_usage(servers, offline):
    """A streaming client gets each beam's text in full once the search ends, its finish
    reason, the usage chunk when asked, and the same beams as unstreamed."""
    client = client_of(servers[0])
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS, n=WIDTH, max_tokens=LENGTH, stream=True,
        stream_options={"include_usage": True}, extra_body={"use_beam_search": True},
    )  # fmt: skip
    texts, reasons, usage = [""] * (2 * WIDTH), [None] * (2 * WIDTH), None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == offline[0] + offline[1] and reasons == ["length"] * (2 * WIDTH)
    assert usage is not None and usage.completion_tokens == 2 * WIDTH * LENGTH
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], n=WIDTH,
        max_tokens=LENGTH, stream=True, extra_body={"use_beam_search": True},
    )  # fmt: skip
    contents = [""] * WIDTH
    for chunk in chat:
        for c in chunk.choices:
            contents[c.index] += c.delta.content or ""
    assert contents == offline[2]


def test_ranking_keeps_the_best_extensions_and_ends_beams_at_eos():
    eos = 0
    tops = [[(-0.1, eos), (-1.0, 5)], [(-0.2, 7), (-0.3, 8)]]  # per beam: (logprob, token)
    step = rank_extensions([-1.0, -1.0], tops, width=2, eos=eos, ignore_eos=False)
    assert step.ended == [(0, eos, -0.1, -1.1)]  # EOS ranked first: a finished hypothesis
    assert step.kept == [(1, 7, -0.2, -1.2), (1, 8, -0.3, -1.3)]
    # ranked below the width, an EOS extension is dropped, not finished
    late = rank_extensions([-1.0, -1.0], [[(-5.0, eos)], [(-0.2, 7), (-0.3, 8)]], 2, eos, False)
    assert late.ended == [] and [k[1] for k in late.kept] == [7, 8]
    kept = rank_extensions([-1.0, -1.0], tops, width=2, eos=eos, ignore_eos=True)
    assert [k[1] for k in kept.kept] == [eos, 7] and kept.ended == []


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"stream": True, "max_tokens": 300}, "maximum context length"),  # before streaming
        ({"logprobs": 2}, "'logprobs' is not supported"),
        ({"stop": ["x"]}, "'stop' is not supported"),
        ({"temperature": 0.7}, "temperature must be 0"),
        ({"max_tokens": 300}, "maximum context length"),
        ({"n": 500}, "beam width) must be between 1 and 128"),
    ],
)
def test_what_beam_search_cannot_honour_is_a_400(servers, extra, words):
    body = {"prompt": "hi", "n": 2, "max_tokens": 4, "use_beam_search": True, **extra}
    r = httpx.post(servers[0].url + "/v1/completions", json=body)
    assert r.status_code == 400 and words in r.json()["error"]["message"]
    ok = httpx.post(servers[0].url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200  # the server keeps serving
