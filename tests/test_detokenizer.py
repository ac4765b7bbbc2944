"""Incremental detokenization equals decoding the whole output, after every step, on a byte-level
BPE (the project's tokenizers, GPT-2 / Llama-3 style) and a SentencePiece-style tokenizer with
byte fallback (Llama-2 / Mistral style), with special tokens skipped or kept, for any ids fed
in any chunks (speculative decoding appends several tokens per step)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_llm.engine.output_processor import IncrementalDetokenizer
from paged_llm.engine.token_texts import tokenizer_facts


def sentencepiece_style_tokenizer():
    """Llama-2's decoder chain over a small vocabulary: byte tokens <0xNN>, pieces with and
    without the '▁' word marker, multi-byte characters, special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{i:02X}>": 3 + i for i in range(256)})
    for piece in ["▁", "▁the", "▁a", "b", "é", "▁é", "lo", "▁hel", "!", ".", "▁▁", "€", "x"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="module", params=["byte-level", "sentencepiece"])
def tokenizer(request):
    if request.param == "byte-level":
        from transformers import AutoTokenizer

        from paged_llm.models.presets import default_model_dir

        return AutoTokenizer.from_pretrained(str(default_model_dir()))
    return sentencepiece_style_tokenizer()


def _ids(tokenizer):
    """Ids biased towards what breaks naive decoding: specials, lone bytes, word markers."""
    n = len(tokenizer)
    bytes_ = list(range(3, 259)) if n < 300 else []  # the SentencePiece vocabulary's <0xNN>
    hard = [0, 1, 2, *tokenizer.encode("é€ ✓ 世界", add_special_tokens=False), *bytes_[128:]]
    return st.lists(st.one_of(st.integers(0, n - 1), st.sampled_from(hard)), max_size=40)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_incremental_text_equals_the_full_decode_after_every_step(tokenizer, data):
    ids = data.draw(_ids(tokenizer))
    skip = data.draw(st.booleans())
    detok = IncrementalDetokenizer(tokenizer, skip, True, tokenizer_facts(tokenizer))
    n = 0
    while n < len(ids):
        n = min(len(ids), n + data.draw(st.integers(1, 4)))
        assert detok.update(ids[:n]) == tokenizer.decode(ids[:n], skip_special_tokens=skip)
    assert detok.incremental  # never fell back to decoding everything


def test_decodes_each_token_a_bounded_number_of_times(tokenizer):
    """The point of it: the work per step does not grow with the output."""
    calls = []
    facts = tokenizer_facts(tokenizer)

    def counting_decode(ids, **kw):
        calls.append(len(ids))
        return facts.decode(ids, **kw)

    ids = tokenizer.encode("b é x! " * 40)  # no byte-fallback runs in either vocabulary
    detok = IncrementalDetokenizer(tokenizer, True, True, replace(facts, decode=counting_decode))
    for n in range(1, len(ids) + 1):
        text = detok.update(ids[:n])
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert max(calls) <= 4 and sum(calls) <= 6 * len(ids)


def test_tokenizers_that_clean_up_spaces_decode_everything():
    """clean_up_tokenization_spaces rewrites ' .' across token boundaries after decoding, which
    a window cannot see: such tokenizers (and slow ones) decode the whole output instead."""
    tok = sentencepiece_style_tokenizer()
    tok.clean_up_tokenization_spaces = True
    assert tokenizer_facts(tok) is None
    detok = IncrementalDetokenizer(tok, True, True, None)
    ids = tok.encode("a . b !", add_special_tokens=False)
    assert detok.update(ids) == tok.decode(ids, skip_special_tokens=True)
    assert not detok.incremental


def test_detokenize_experiment_compares_the_ways_on_the_same_texts(tmp_path):
    from experiments import detokenize
    from paper_repro.common import compose

    cfg = compose("detokenize", ["requests=3", "tokens=20", "repeats=1"])
    doc = detokenize.write(cfg, tmp_path)
    assert doc["mode"] == "real" and doc["same_texts"]
    assert set(doc["seconds"]) == set(detokenize.WAYS)
    assert (tmp_path / "detokenize.json").is_file()
