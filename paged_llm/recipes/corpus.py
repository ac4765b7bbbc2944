"""The training corpus every machine has: the Python standard library's own ``.py`` files.

Files are split into train and held-out sets by a hash of their path (stable when files are
added or removed), a byte-level BPE is trained with the ``tokenizers`` library on the train
files, and each split is stored as one stream of token ids: ``<s> file tokens </s>`` per file.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from paged_llm.models.tokenizer_builder import EOS, save_hf_tokenizer, train_bpe

# Directories left out: tests (huge, repetitive), third-party code, generated tables and data.
EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "encodings", "pydoc_data", "__pycache__"}
)


@dataclass(frozen=True)
class CorpusSpec:
    """Which stdlib files form the corpus, how they split, and the tokenizer trained on them."""

    vocab_size: int = 4096
    max_files: int | None = None  # None: every file; else the first N in hashed-path order
    heldout_percent: int = 5  # share of files (by path hash) kept out of training

    def key(self) -> str:
        """Short hash of this spec and of the stdlib it reads (name, version and file list)."""
        files = [(str(p.relative_to(stdlib_dir())), p.stat().st_size) for p in select_files(self)]
        blob = json.dumps([asdict(self), sys.version_info[:3], files], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def stdlib_dir() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def _path_hash(path: Path) -> int:
    rel = path.relative_to(stdlib_dir()).as_posix()
    return int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16)


@functools.lru_cache(maxsize=8)  # walking the stdlib takes a moment; it does not change
def select_files(spec: CorpusSpec) -> list[Path]:
    """Corpus files in hashed-path order (a fixed pseudo-random order), capped at max_files."""
    root = stdlib_dir()
    files = [
        p
        for p in root.rglob("*.py")
        if not EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])
    ]
    files.sort(key=lambda p: (_path_hash(p), p.as_posix()))
    files = files[: spec.max_files] if spec.max_files else files
    if len(files) < 2:
        raise FileNotFoundError(f"found {len(files)} source files under {root}; need at least 2")
    return files


def split_files(spec: CorpusSpec) -> tuple[list[Path], list[Path]]:
    """(train files, held-out files); at least one file lands on each side."""
    files = select_files(spec)
    heldout = [p for p in files if _path_hash(p) % 100 < spec.heldout_percent]
    if not heldout:
        heldout = files[-1:]
    held = set(heldout)
    return [p for p in files if p not in held], heldout


def read_texts(files: list[Path]) -> list[str]:
    """File contents; undecodable bytes are replaced (a few stdlib files are not UTF-8)."""
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def token_stream(tok, texts: list[str]) -> np.ndarray:
    """``<s> tokens </s>`` of every text, concatenated: [N] uint16."""
    eos_id = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos_id)
    if tok.get_vocab_size() > np.iinfo(np.uint16).max:
        raise ValueError(f"vocab_size {tok.get_vocab_size()} does not fit uint16 token streams")
    return np.asarray(ids, dtype=np.uint16)


def build_corpus(spec: CorpusSpec, out_dir: Path) -> None:
    """Write the tokenizer (HF format), ``train.npy``, ``heldout.npy`` and ``corpus.json``."""
    train_files, heldout_files = split_files(spec)
    train_texts, heldout_texts = read_texts(train_files), read_texts(heldout_files)
    tok = train_bpe(train_texts, spec.vocab_size)
    save_hf_tokenizer(tok, out_dir)
    train, heldout = token_stream(tok, train_texts), token_stream(tok, heldout_texts)
    np.save(out_dir / "train.npy", train)
    np.save(out_dir / "heldout.npy", heldout)
    root = stdlib_dir()
    info = {
        "spec": asdict(spec),
        "python": sys.version.split()[0],
        "stdlib": str(root),
        "train_files": len(train_files),
        "heldout_files": [p.relative_to(root).as_posix() for p in heldout_files],
        "train_bytes": sum(len(t.encode()) for t in train_texts),
        "train_tokens": int(train.size),
        "heldout_tokens": int(heldout.size),
    }
    (out_dir / "corpus.json").write_text(json.dumps(info, indent=1) + "\n")
