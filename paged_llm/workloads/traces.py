"""Length traces in every format the paper's experiments use, and synthetic fallbacks.

* CSV ``input_len,output_len``, via :mod:`lengths`. The paper's ShareGPT trace ships with the
  package (``data/``, provenance in ``data/README.md``): the path ``shipped:NAME`` names a file
  there, wherever the package is installed and whatever the working directory.
* The artifact's pickle: a plain list of (input_len, output_len) int pairs, read by an
  unpickler that refuses every global, so a crafted file cannot run code.
* ShareGPT JSON conversations: first user turn and first reply, tokenized with a given
  tokenizer.
* Synthetic log-normal lengths fitted to the paper's means (ShareGPT, Alpaca), labelled
  ``synthetic`` wherever they are used.

Plain Python (no torch).
"""

from __future__ import annotations

import io
import json
import math
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paged_llm.workloads.lengths import (
    PAPER_MAX_TOTAL,
    SHAREGPT,
    LengthPair,
    LogNormalLengths,
    filter_total_below,
    load_length_csv,
    synthetic_lengths,
)

# The paper's Fig. 11 gives only Alpaca's means (OPT tokenizer): 19.31 in, 58.45 out. The
# log-space sigmas are assumptions (no trace is published): instructions are short and
# uniform (sigma 0.6 puts the median near 16), answers vary more (sigma 0.9, median near 39).
ALPACA = LogNormalLengths(
    name="alpaca", input_mean=19.31, output_mean=58.45, input_sigma=0.6, output_sigma=0.9
)

# The paper's Fig. 16 translates WMT16 English -> German with LLaMA-13B but publishes no
# lengths. An assumption, labelled synthetic wherever used: a news sentence of ~23 words is ~32
# LLaMA tokens in English and ~40 in German (German splits into more sub-words), with narrow
# spreads (sentences, not documents).
WMT16 = LogNormalLengths(
    name="wmt16", input_mean=32.0, output_mean=40.0, input_sigma=0.5, output_sigma=0.5
)

SYNTHETIC: dict[str, LogNormalLengths] = {"sharegpt": SHAREGPT, "alpaca": ALPACA, "wmt16": WMT16}

# Traces shipped inside the package; "shipped:sharegpt_opt_lengths.csv" names one in a config.
DATA_DIR = Path(__file__).resolve().parent / "data"
SHIPPED = "shipped:"
SHAREGPT_TRACE = f"{SHIPPED}sharegpt_opt_lengths.csv"


def resolve_trace_path(path: str | Path) -> Path:
    """The file a trace path names: ``shipped:NAME`` is NAME in the package's data directory,
    anything else a path (``~`` expanded)."""
    text = str(path)
    if not text.startswith(SHIPPED):
        return Path(text).expanduser()
    name = text[len(SHIPPED) :]
    found = DATA_DIR / name
    if not name or Path(name).name != name or not found.is_file():
        shipped = sorted(f"{SHIPPED}{q.name}" for q in DATA_DIR.glob("*.csv"))
        raise FileNotFoundError(f"no shipped trace '{text}'; shipped traces: {shipped}")
    return found


@dataclass(frozen=True)
class LengthSource:
    """Length pairs plus a label saying where they came from."""

    pairs: list[LengthPair]
    label: str  # "trace:<path>" or "synthetic:<name> (log-normal fit to the paper's means)"
    synthetic: bool


# ---- the artifact's pickle ------------------------------------------------------------------
class _NoGlobalsUnpickler(pickle.Unpickler):
    """Unpickler for plain data: any global (class, function) is refused, so no code runs."""

    def find_class(self, module: str, name: str) -> Any:
        """Refuse every global: plain lists, tuples and ints never need one."""
        raise pickle.UnpicklingError(
            f"refusing to load global '{module}.{name}': a length trace holds only lists, "
            "tuples and ints"
        )

    def persistent_load(self, pid: Any) -> Any:
        """Refuse persistent ids (they would resolve to objects outside the file)."""
        raise pickle.UnpicklingError("refusing persistent ids in a length trace")


def load_artifact_pickle(path: str | Path) -> list[LengthPair]:
    """Read the artifact's pickled list of (input_len, output_len) pairs without running code."""
    data = _NoGlobalsUnpickler(io.BytesIO(Path(path).read_bytes())).load()
    if not isinstance(data, list | tuple):
        raise ValueError(f"{path}: expected a list of (input_len, output_len) pairs")
    pairs = []
    for i, item in enumerate(data):
        ok = isinstance(item, list | tuple) and len(item) == 2
        if not ok or not all(isinstance(x, int) and not isinstance(x, bool) for x in item):
            raise ValueError(f"{path}: item {i} is not an (int, int) pair: {item!r}")
        pairs.append(LengthPair(int(item[0]), int(item[1])))
    return pairs


# ---- ShareGPT JSON conversations --------------------------------------------------------------
def _encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    if hasattr(tokenizer, "encode"):
        return tokenizer.encode
    if callable(tokenizer):
        return lambda text: tokenizer(text)["input_ids"]
    raise TypeError("tokenizer must have .encode(text) or be callable like a HF tokenizer")


def load_sharegpt_json(path: str | Path, tokenizer: Any) -> list[LengthPair]:
    """(prompt, reply) token lengths of each conversation's first two turns, as vLLM's
    benchmarks take them; conversations with fewer than two turns are skipped."""
    encode = _encoder(tokenizer)
    with open(path) as f:
        data = json.load(f)
    pairs = []
    for conv in data:
        turns = conv.get("conversations") or conv.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, reply = turns[0].get("value", ""), turns[1].get("value", "")
        pairs.append(LengthPair(len(encode(prompt)), len(encode(reply))))
    return pairs


def _load_tokenizer(name_or_path: str) -> Any:
    from transformers import AutoTokenizer  # only for JSON traces

    return AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)


# One table, so a new format is one line here and nowhere else.
_LOADERS: dict[str, Callable[[Path, Any], list[LengthPair]]] = {
    ".csv": lambda p, tok: load_length_csv(p),
    ".pkl": lambda p, tok: load_artifact_pickle(p),
    ".pickle": lambda p, tok: load_artifact_pickle(p),
    ".json": lambda p, tok: load_sharegpt_json(p, tok),
}


def load_trace(path: str | Path, tokenizer: Any = None) -> list[LengthPair]:
    """Load length pairs from a CSV, artifact pickle or ShareGPT JSON file (or a shipped trace,
    ``shipped:NAME``)."""
    p = resolve_trace_path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"trace file '{path}' not found (cwd {Path.cwd()}); give an existing CSV/pickle/JSON "
            "or set workload.path=null to use the synthetic length distribution"
        )
    loader = _LOADERS.get(p.suffix.lower())
    if loader is None:
        raise ValueError(f"unknown trace format '{p.suffix}'; expected one of {sorted(_LOADERS)}")
    if p.suffix.lower() == ".json" and tokenizer is None:
        raise ValueError("a ShareGPT JSON trace needs workload.tokenizer to count tokens")
    tok = _load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    return loader(p, tok)


# ---- filters and synthetic draws --------------------------------------------------------------
def filter_pairs(
    pairs: list[LengthPair],
    max_total_len: int = PAPER_MAX_TOTAL,
    min_input_len: int = 1,
    min_output_len: int = 1,
) -> list[LengthPair]:
    """The paper's filter (input + output < max_total_len) plus optional minimum lengths."""
    kept = filter_total_below(pairs, max_total_len)
    return [p for p in kept if p.input_len >= min_input_len and p.output_len >= min_output_len]


def scale_lengths(pairs: list[LengthPair], factor: float) -> list[LengthPair]:
    """Multiply both lengths by ``factor`` (rounded, at least 1): a small-model stand-in for a
    trace, keeping its shape; factor 1 returns the pairs unchanged."""
    if factor <= 0:
        raise ValueError(f"length scale must be > 0, got {factor}")
    if factor == 1:
        return list(pairs)
    return [
        LengthPair(max(1, round(p.input_len * factor)), max(1, round(p.output_len * factor)))
        for p in pairs
    ]


def synthetic_filtered(
    dist: LogNormalLengths, n: int, seed: int, keep: Callable[[list[LengthPair]], list[LengthPair]]
) -> list[LengthPair]:
    """n synthetic pairs that pass ``keep`` (rejected draws are replaced by fresh ones)."""
    out: list[LengthPair] = []
    round_ = 0
    while len(out) < n:
        need = n - len(out)
        draw = synthetic_lengths(math.ceil(need * 1.2) + 8, seed + 7919 * round_, dist)
        out.extend(keep(draw))
        round_ += 1
        if round_ > 100:
            raise ValueError(f"the filter rejects almost every draw of '{dist.name}'")
    return out[:n]


def length_source(
    path: str | None,
    synthetic: str = "sharegpt",
    tokenizer: Any = None,
    max_total_len: int = PAPER_MAX_TOTAL,
    min_input_len: int = 1,
    min_output_len: int = 1,
    length_scale: float = 1.0,
    pool_size: int = 20000,
    seed: int = 0,
) -> LengthSource:
    """Filtered length pairs from a trace file, or a labelled synthetic pool without one.

    ``length_scale`` shrinks lengths for small-model runs and is applied before the filter,
    so ``max_total_len`` is checked against the lengths actually run.
    """

    def keep(pairs: list[LengthPair]) -> list[LengthPair]:
        scaled = scale_lengths(pairs, length_scale)
        return filter_pairs(scaled, max_total_len, min_input_len, min_output_len)

    scale_note = f", lengths x{length_scale:g}" if length_scale != 1 else ""
    if path:
        pairs = keep(load_trace(path, tokenizer))
        if not pairs:
            raise ValueError(f"no request of trace '{path}' passes the length filter")
        return LengthSource(pairs, f"trace:{path}{scale_note}", synthetic=False)
    if synthetic not in SYNTHETIC:
        raise ValueError(
            f"unknown synthetic workload '{synthetic}'; choose one of {list(SYNTHETIC)}"
        )
    dist = SYNTHETIC[synthetic]
    pairs = synthetic_filtered(dist, pool_size, seed, keep)
    label = f"synthetic:{synthetic} (log-normal fit to the paper's means{scale_note})"
    return LengthSource(pairs, label, synthetic=True)
