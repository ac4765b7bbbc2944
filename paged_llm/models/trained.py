"""Built-in trained models: a small Llama target and a much smaller draft, trained on the
Python standard library's own source with one shared BPE tokenizer (nothing is downloaded).

    python -m paged_llm.models.trained              # target + draft: 15-45 minutes on 2 cores
    python -m paged_llm.models.trained test-target  # the fast variants the tests use
    python -m paged_llm.models.trained eagle        # the target's EAGLE head (models/eagle.py)
    python -m paged_llm.models.trained code-small   # the main job's default: about a minute

:func:`trained_model_dir` returns an ordinary Hugging Face checkpoint directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json, plus training.json with the recipe,
the loss curve and the held-out perplexity) that ``transformers`` and ``paged_llm`` both load.
Each model is trained once per machine into $PAGED_LLM_CACHE (default ~/.cache/paged_llm),
keyed by a hash of its recipe and of the stdlib it read; concurrent first uses wait for one
build. Training is seeded; the held-out split (5% of the files) never reaches training.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from paged_llm.models.tokenizer_builder import CHAT_TEMPLATE
from paged_llm.recipes.cache import cache_root, cached_dir
from paged_llm.recipes.corpus import CorpusSpec, build_corpus
from paged_llm.recipes.training import (
    ModelShape,
    TrainSpec,
    llama_config,
    resolve_precision,
    train_llama,
)

# Bump when code changes what a recipe produces, so stale cache entries are not reused.
RECIPE_VERSION = "v1"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class Recipe:
    """Everything that determines a built-in model: corpus + tokenizer, shape, training."""

    corpus: CorpusSpec
    shape: ModelShape
    train: TrainSpec
    threads: int = 2  # CPU threads to train with (not part of the key: results are the same)
    # A built-in model (same corpus) whose predictions this one learns to imitate, with weight
    # ``train.distill``: drafts imitate their target.
    teacher: str | None = None
    # Written into the checkpoint's tokenizer_config.json, so chat works without flags.
    chat_template: str | None = None

    def key(self) -> str:
        """Hash of the recipe, the code version, the corpus it reads and its teacher's key."""
        fields = {k: v for k, v in asdict(self).items() if k != "threads"}
        # "auto" precision trains differently on different CPUs, so key the resolved one.
        fields["train"]["precision"] = resolve_precision(self.train.precision)
        # Distillation came later: recipes without it keep the keys (and caches) they had.
        if not fields["train"]["distill"]:
            del fields["train"]["distill"]
        if fields["chat_template"] is None:  # likewise for recipes without a chat template
            del fields["chat_template"]
        del fields["teacher"]
        if self.teacher is not None:
            fields["teacher"] = [self.teacher, recipe(self.teacher).key()]
        blob = json.dumps([RECIPE_VERSION, fields, self.corpus.key()], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


# Hidden and intermediate sizes are multiples of 128 so int4 with group size 128 divides every
# linear layer of the target. Targets and drafts of a pair share one corpus, hence one tokenizer.
_FULL = CorpusSpec(vocab_size=4096)
_TEST = CorpusSpec(vocab_size=1024, max_files=60)
# The pair trains alike (same tokens, schedule and optimizer); only the shapes differ.
_PAIR_TRAINING = TrainSpec(
    steps=600,
    batch_size=4,
    seq_len=256,
    lr=3e-3,
    warmup_steps=50,
    precision="auto",
    optimizer="muon",
)
RECIPES: dict[str, Recipe] = {
    "target": Recipe(_FULL, ModelShape(384, 1024, 10, 6, 2), _PAIR_TRAINING),
    "draft": Recipe(
        _FULL,
        ModelShape(256, 512, 2, 4, 2, tie_word_embeddings=True),
        replace(_PAIR_TRAINING, distill=1.0),
        teacher="target",
    ),
    # Tiny matmuls gain nothing from a second thread, and one thread is robust on busy machines.
    "test-target": Recipe(
        _TEST,
        ModelShape(128, 256, 2, 4, 2),
        TrainSpec(steps=300, batch_size=8, seq_len=64, lr=3e-3, eval_windows=32),
        threads=1,
    ),
    "test-draft": Recipe(
        _TEST,
        ModelShape(64, 128, 1, 2, 1, tie_word_embeddings=True),
        TrainSpec(steps=200, batch_size=8, seq_len=64, lr=3e-3, eval_windows=32),
        threads=1,
    ),
}
# The main job's default model (configs/model/code_small.yaml): readable Python-shaped text after
# about a minute of training on 2 CPU cores. Tuned on a busy 2-core machine (2026-12-05, fp32, one
# thread): 0.66M parameters, 600 Muon steps on 614k tokens in 44 s, held-out perplexity 33.5
# (vocabulary 1024). A 1.18M-parameter (192-wide) model in 450 steps took longer and reached
# 36.9; a 2M-parameter one (vocabulary 2048) needed 400 steps for 56. Small and many steps wins.
RECIPES["code-small"] = Recipe(
    CorpusSpec(vocab_size=1024, max_files=300),
    ModelShape(128, 384, 2, 4, 2),
    TrainSpec(
        steps=600,
        batch_size=8,
        seq_len=128,
        lr=4e-3,
        warmup_steps=30,
        optimizer="muon",
        eval_windows=64,
    ),
    threads=1,  # two threads of these small matmuls were 14x slower on a busy 2-core machine
    chat_template=CHAT_TEMPLATE,  # the server's chat route works with no --chat-template
)
DEFAULT_MODEL = "code-small"
# What a first use costs on a 2-core CPU, for the line that announces a build.
BUILD_TIME = {"code-small": "about a minute", "test-target": "about 15 s",
              "test-draft": "about 10 s", "target": "15-45 minutes"}  # fmt: skip
# The draft model that shares each target's tokenizer (for speculative decoding).
DRAFT_FOR = {"target": "draft", "test-target": "test-draft"}


@dataclass(frozen=True)
class EagleRecipe:
    """An EAGLE head (paged_llm/recipes/eagle.py) trained on a built-in target's features."""

    teacher: str
    train: TrainSpec
    noise: float = 0.1  # uniform noise on the input features, as EAGLE
    threads: int = 2

    @property
    def corpus(self) -> CorpusSpec:
        """The teacher's corpus (and tokenizer)."""
        return recipe(self.teacher).corpus

    def key(self) -> str:
        """Hash of the recipe, the code version and the teacher's key."""
        fields = {k: v for k, v in asdict(self).items() if k != "threads"}
        blob = json.dumps([RECIPE_VERSION, "eagle", fields, recipe(self.teacher).key()],
                          sort_keys=True)  # fmt: skip
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


# EAGLE heads of the targets: one decoder layer of the target's shape (distilled, KL weight 1).
EAGLE_RECIPES: dict[str, EagleRecipe] = {
    "eagle": EagleRecipe(
        "target",
        TrainSpec(
            # 400 steps agreed with the target's next token at 65.8% of held-out positions,
            # 1200 at 77.0% (EAGLE's acceptance at k = 5: 0.75 -> 0.86); 2026-12-04
            steps=1200,
            batch_size=4,
            seq_len=256,
            lr=3e-3,
            warmup_steps=90,
            optimizer="muon",
            distill=1.0,
        ),
    ),  # fmt: skip
    "test-eagle": EagleRecipe(
        "test-target",
        TrainSpec(steps=200, batch_size=8, seq_len=64, lr=3e-3, eval_windows=32, distill=1.0),
        threads=1,
    ),
}
EAGLE_FOR = {"target": "eagle", "test-target": "test-eagle"}


def recipe(name: str) -> Recipe | EagleRecipe:
    """The recipe of built-in model ``name``."""
    try:
        return RECIPES[name] if name in RECIPES else EAGLE_RECIPES[name]
    except KeyError:
        raise ValueError(
            f"unknown built-in model '{name}'; choose one of {[*RECIPES, *EAGLE_RECIPES]}"
        ) from None


def corpus_dir(spec: CorpusSpec) -> Path:
    """Cached directory with the tokenizer and the train / held-out token streams."""
    final = cache_root() / "corpus" / f"stdlib-bpe{spec.vocab_size}-{spec.key()}"
    return cached_dir(final, lambda tmp: build_corpus(spec, tmp))


def corpus_tokens(name: str, split: str = "heldout") -> np.ndarray:
    """Token stream of a built-in model's corpus split ("train" or "heldout"): [N] uint16."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got '{split}'")
    return np.load(corpus_dir(recipe(name).corpus) / f"{split}.npy")


def _build_model(name: str, r: Recipe, out_dir: Path) -> None:
    """Train model ``name`` and save it with its tokenizer as an HF checkpoint in out_dir."""
    data = corpus_dir(r.corpus)
    train, heldout = np.load(data / "train.npy"), np.load(data / "heldout.npy")
    config = llama_config(r.shape, r.corpus.vocab_size)
    teacher = None
    if r.teacher is not None:
        from transformers import LlamaForCausalLM

        teacher = LlamaForCausalLM.from_pretrained(str(trained_model_dir(r.teacher))).eval()
    model, log = train_llama(
        config, train, heldout, r.train, f"training {name}", r.threads, teacher
    )
    model.save_pretrained(str(out_dir))
    _add_tokenizer_and_log(out_dir, data, name, r, log)


def _add_tokenizer_and_log(
    out_dir: Path, data: Path, name: str, r: Recipe | EagleRecipe, log: dict
) -> None:
    """Copy the corpus's tokenizer files next to a saved model and write its training.json."""
    for f in TOKENIZER_FILES:
        if (data / f).is_file():
            shutil.copy(data / f, out_dir / f)
    if getattr(r, "chat_template", None):
        add_chat_template(out_dir, r.chat_template)
    info = {"name": name, "recipe_key": r.key(), "recipe": asdict(r), **log}
    (out_dir / "training.json").write_text(json.dumps(info, indent=1) + "\n")


def add_chat_template(out_dir: Path, template: str) -> None:
    """Put ``template`` into ``out_dir``'s tokenizer_config.json (where transformers and vLLM
    read a checkpoint's chat template)."""
    path = out_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _build_eagle(name: str, r: EagleRecipe, out_dir: Path) -> None:
    """Train EAGLE head ``name`` on its target's features; save it with the tokenizer."""
    from transformers import LlamaForCausalLM

    from paged_llm.models.eagle import head_config, save_eagle_head
    from paged_llm.recipes.eagle import train_eagle_head

    data = corpus_dir(r.corpus)
    train, heldout = np.load(data / "train.npy"), np.load(data / "heldout.npy")
    target = LlamaForCausalLM.from_pretrained(str(trained_model_dir(r.teacher)))
    config = head_config(target.config)
    head, log = train_eagle_head(
        config, target, train, heldout, r.train, r.noise, f"training {name}", r.threads
    )
    save_eagle_head(dict(head.named_parameters()), config, out_dir)
    _add_tokenizer_and_log(out_dir, data, name, r, log)


def trained_model_dir(name: str = "target") -> Path:
    """Checkpoint directory of built-in model ``name`` ("target", "draft", "eagle" and their
    "test-" variants), trained on first use and cached."""
    r = recipe(name)
    build = _build_eagle if isinstance(r, EagleRecipe) else _build_model
    return cached_dir(model_cache_path(name), lambda tmp: build(name, r, tmp))


def model_cache_path(name: str) -> Path:
    """Where built-in model ``name`` is (or will be) cached; nothing is built."""
    return cache_root() / "trained" / f"{name}-{recipe(name).key()}"


def is_built(name: str) -> bool:
    """Whether built-in model ``name`` is already in the cache (so using it trains nothing)."""
    return model_cache_path(name).is_dir()


def training_info(name: str) -> dict:
    """The training log (recipe, losses, held-out perplexity) of a built-in model."""
    return json.loads((trained_model_dir(name) / "training.json").read_text())


def cli_names(argv: list[str] | None = None) -> list[str]:
    """The model names the CLI builds: those given, else target and draft."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Names are checked here, not with `choices`: argparse (3.11) checks an empty or default
    # list against `choices` as one value and rejects running with no names.
    known = [*RECIPES, *EAGLE_RECIPES]
    parser.add_argument("names", nargs="*", help=f"any of {', '.join(known)}")
    names = parser.parse_args(argv).names or ["target", "draft"]
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown built-in model(s) {unknown}; choose from {known}")
    return names


def main(argv: list[str] | None = None) -> None:
    """CLI: build the named built-in models (default: target and draft); print where they are."""
    for name in cli_names(argv):
        path = trained_model_dir(name)
        info = training_info(name)
        if "heldout_perplexity" in info:
            quality = f"held-out perplexity {info['heldout_perplexity']:.2f}"
        else:  # an EAGLE head
            agree = info["heldout_teacher_top1_agreement"]
            quality = f"agrees with the target's next token at {agree:.1%}"
        print(
            f"{name}: {path}\n  {info['parameters'] / 1e6:.2f}M parameters, {quality}, "
            f"trained in {info['train_seconds']:.0f} s on {info['tokens_seen']} tokens"
        )


if __name__ == "__main__":
    main()
