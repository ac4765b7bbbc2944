"""generation_config.json read as vLLM reads it: its extra EOS ids end requests (as stop token
ids, unless ignore_eos, held back until min_tokens), and its sampling settings are the defaults
of ``LLM.generate`` without SamplingParams and of server requests that leave fields unset."""

import json
import os
import shutil

import httpx
import pytest

from paged_llm import LLM, SamplingParams
from paged_llm.engine.generation_config import GenerationDefaults, load_generation_defaults
from paged_llm.models.presets import default_model_dir
from paged_llm.serve.background import ServerThread
from paged_llm.serve.cli import build, make_parser

EXTRA_EOS = 100  # an ordinary token of the tiny model, named an EOS by the generation config
FORCE = {EXTRA_EOS: 100.0}  # logit_bias that makes greedy decoding pick it first


class _Cfg:
    eos_token_id = 2


def _write(path, **fields):
    path.mkdir(parents=True, exist_ok=True)
    (path / "generation_config.json").write_text(json.dumps(fields))
    return path


def test_sampling_fields_become_defaults_with_vllm_names(tmp_path):
    d = _write(tmp_path, eos_token_id=[2, 7], temperature=0.6, top_p=0.9, top_k=20,
               max_new_tokens=5, do_sample=True, bos_token_id=1)  # fmt: skip
    defaults = load_generation_defaults(d, _Cfg(), vocab_size=256)
    assert defaults.eos_token_ids == (2, 7)
    assert dict(defaults.sampling) == dict(temperature=0.6, top_p=0.9, top_k=20, max_tokens=5)
    p = defaults.default_sampling_params()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.min_p) == (0.6, 0.9, 20, 5, 0.0)


def test_vllm_source_keeps_own_defaults_but_reads_eos_and_overrides(tmp_path):
    d = _write(tmp_path, eos_token_id=[2, 7], temperature=0.6)
    defaults = load_generation_defaults(d, _Cfg(), "vllm", {"top_p": 0.5})
    assert defaults.eos_token_ids == (2, 7) and dict(defaults.sampling) == {"top_p": 0.5}
    over = load_generation_defaults(d, _Cfg(), "auto", {"temperature": 0.1, "max_new_tokens": 3})
    assert dict(over.sampling) == {"temperature": 0.1, "max_tokens": 3}


def test_unread_override_keys_are_reported(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="paged_llm.engine.generation_config"):
        defaults = load_generation_defaults(None, _Cfg(), overrides={"temprature": 0.5})
    assert dict(defaults.sampling) == {} and "['temprature'] ignored" in caplog.text


def test_another_directory_and_fallbacks(tmp_path):
    other = _write(tmp_path / "other", temperature=0.2)
    model = _write(tmp_path / "model", temperature=0.9)
    assert dict(load_generation_defaults(model, _Cfg(), str(other)).sampling) == {
        "temperature": 0.2
    }
    with pytest.raises(ValueError, match="no generation_config.json in"):
        load_generation_defaults(model, _Cfg(), str(tmp_path / "missing"))
    # no file (or a preset with no directory): config.json's eos_token_id, no sampling defaults
    bare = load_generation_defaults(tmp_path / "none", _Cfg())
    assert bare == GenerationDefaults((2,), {})
    assert load_generation_defaults(None, _Cfg()) == GenerationDefaults((2,), {})


def test_bad_files_are_refused_naming_the_problem(tmp_path):
    with pytest.raises(ValueError, match="top_p"):
        load_generation_defaults(_write(tmp_path / "a", top_p=0.0), _Cfg())
    with pytest.raises(ValueError, match="temperature"):
        load_generation_defaults(tmp_path / "b", _Cfg(), overrides={"temperature": -1})
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_generation_defaults(tmp_path / "c", _Cfg())
    # ids the model cannot produce are dropped, not stop ids that never match
    assert load_generation_defaults(_write(tmp_path / "d", eos_token_id=[2, 999]), _Cfg(),
                                    vocab_size=256).eos_token_ids == (2,)  # fmt: skip


def test_extra_eos_ids_join_stop_token_ids():
    defaults = GenerationDefaults((2, 7, 9))
    params = SamplingParams(stop_token_ids=[9, 11])
    assert defaults.add_eos_stops(params, model_eos=2).stop_token_ids == [9, 11, 7]
    assert params.stop_token_ids == [9, 11]  # the caller's object is not changed
    ignoring = SamplingParams(ignore_eos=True)
    assert defaults.add_eos_stops(ignoring, model_eos=2) is ignoring
    assert GenerationDefaults((2,)).add_eos_stops(params, model_eos=2) is params


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny default checkpoint whose generation config names a second EOS and recommends
    greedy decoding and at most 300 new tokens (more than its 256-token context here)."""
    src, dst = default_model_dir(), tmp_path_factory.mktemp("tiny-genconfig")
    for f in src.iterdir():
        if f.name == "model.safetensors":
            os.symlink(f, dst / f.name)
        else:
            shutil.copy(f, dst / f.name)
    _write(dst, bos_token_id=1, eos_token_id=[2, EXTRA_EOS], temperature=0.0, max_new_tokens=300)
    return dst


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), max_model_len=256, cpu_kv_cache_gib=0.02)


def test_a_second_eos_ends_a_request_unless_ignored(llm):
    out = llm.generate("def f(x):", SamplingParams(temperature=0, logit_bias=FORCE),
                       use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([EXTRA_EOS], "stop", EXTRA_EOS)
    assert out.text == ""  # a stop token's text is left out, as the model's own EOS
    ignored = SamplingParams(temperature=0, logit_bias=FORCE, ignore_eos=True, max_tokens=3)
    out = llm.generate("def f(x):", ignored, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [EXTRA_EOS] * 3 and out.finish_reason == "length"
    held = SamplingParams(temperature=0, logit_bias=FORCE, min_tokens=2, max_tokens=8)
    out = llm.generate("def f(x):", held, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3 and out.token_ids[-1] == EXTRA_EOS
    assert EXTRA_EOS not in out.token_ids[:2] and out.finish_reason == "stop"


def test_generate_without_params_uses_the_recommended_defaults(llm):
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.max_tokens) == (0.0, 300)
    short = LLM(llm.llm_engine.config.model.model, max_model_len=256, cpu_kv_cache_gib=0.02,
                override_generation_config={"max_new_tokens": 4})  # fmt: skip
    outs = short.generate(["import os", "import os"], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids  # greedy, as recommended
    own = LLM(llm.llm_engine.config.model.model, max_model_len=256, cpu_kv_cache_gib=0.02,
              generation_config="vllm")  # fmt: skip
    assert own.get_default_sampling_params() == SamplingParams()
    forced = own.generate("x", SamplingParams(temperature=0, logit_bias=FORCE), use_tqdm=False)
    assert forced[0].outputs[0].stop_reason == EXTRA_EOS  # the EOS ids are read all the same


@pytest.fixture(scope="module")
def server(model_dir):
    argv = [str(model_dir), "--served-model-name", "m", "--max-model-len", "256",
            "--cpu-kv-cache-gib", "0.02", "--disable-log-stats"]  # fmt: skip
    srv = ServerThread(build(make_parser().parse_args(argv))).start()
    yield srv
    srv.stop()


def _complete(server, **body):
    r = httpx.post(server.url + "/v1/completions", json={"model": "m", **body}, timeout=60)
    return r.status_code, r.json()


def test_server_fills_unset_fields_from_the_generation_config(server):
    # temperature unset: greedy, as recommended, so two unseeded requests agree
    texts = [_complete(server, prompt="def f(x):", max_tokens=8)[1]["choices"][0]["text"]
             for _ in range(2)]  # fmt: skip
    assert texts[0] == texts[1]
    status, body = _complete(server, prompt="def f(x):", max_tokens=8, logit_bias=FORCE)
    choice = body["choices"][0]
    assert status == 200 and (choice["finish_reason"], choice["stop_reason"]) == ("stop", 100)


def test_server_caps_a_recommended_max_tokens_but_refuses_an_asked_one(server):
    prompt = [5] * 250  # 6 tokens of room in the 256-token context
    status, body = _complete(server, prompt=prompt, max_tokens=None)
    assert status == 200, body
    assert (
        body["usage"]["completion_tokens"] == 6 and body["choices"][0]["finish_reason"] == "length"
    )
    status, body = _complete(server, prompt=prompt, max_tokens=300)
    assert status == 400 and "maximum context length" in body["error"]["message"]
