"""A small byte-level BPE tokenizer trained on the Python standard library's own source code.

No tokenizer has to be downloaded: training on a few stdlib files takes about a second and is
deterministic for a given Python version. It is saved in HF's format (tokenizer.json +
tokenizer_config.json) so ``AutoTokenizer.from_pretrained(dir, local_files_only=True)`` loads it.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

DEFAULT_VOCAB_SIZE = 2048
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD, BOS, EOS)  # ids 0, 1, 2 (trainer adds them first, in this order)
# Long-lived stdlib modules with plenty of prose (docstrings) and code; present in 3.10-3.13.
CORPUS_FILES = ("argparse.py", "difflib.py", "textwrap.py", "functools.py", "string.py")
MODEL_MAX_LENGTH = 2048
# The built-in models' chat template (tiny, code-small): each message as a Python comment
# header and its text, then the assistant's header, so /v1/chat/completions and LLM.chat work
# out of the box. These models were never tuned on conversations: the reply is code-shaped text.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}# {{ message['role'] }}:\n"
    "{{ message['content'] or '' }}\n{% endfor %}"
    "{% if add_generation_prompt %}# assistant:\n{% endif %}"
)


def corpus_files() -> list[Path]:
    """Paths of the stdlib source files used as training text."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / name for name in CORPUS_FILES if (stdlib / name).is_file()]
    if not files:
        raise FileNotFoundError(f"none of {CORPUS_FILES} found in the stdlib at {stdlib}")
    return files


def train_bpe(texts: list[str], vocab_size: int):  # -> tokenizers.Tokenizer
    """A byte-level BPE (ids 0, 1, 2 = <pad>, <s>, </s>); encodings start with <s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols up front, so any text (not just the corpus) can be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def train_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE):  # -> tokenizers.Tokenizer
    """Train a byte-level BPE on :func:`corpus_files`; encodings start with the BOS token."""
    return train_bpe([p.read_text(encoding="utf-8") for p in corpus_files()], vocab_size)


def save_hf_tokenizer(
    tok, out_dir: str | Path, chat_template: str | None = None
) -> None:  # tok: tokenizers.Tokenizer
    """Save a trained BPE in HF format (tokenizer.json and configs) with this project's special
    tokens (and ``chat_template`` in tokenizer_config.json, if given), so AutoTokenizer loads
    it."""
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        chat_template=chat_template,
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.save_pretrained(str(out_dir))


def build_tokenizer(
    out_dir: str | Path, vocab_size: int = DEFAULT_VOCAB_SIZE, chat_template: str | None = None
) -> Path:
    """Train the tokenizer and save it in HF format (with ``chat_template``, if given) into
    ``out_dir``; return ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_hf_tokenizer(train_tokenizer(vocab_size), out_dir, chat_template)
    return out_dir
