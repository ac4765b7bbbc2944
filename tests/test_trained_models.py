"""Built-in trained models: HF checkpoints that transformers loads, matching our loader, cached
once per recipe (also under concurrent first use), with a shared tokenizer and a held-out split.

Uses the fast test variants (trained once per test session into the session's cache)."""

import json
import multiprocessing as mp
import time

import numpy as np
import pytest
import torch

from paged_llm.models import trained
from paged_llm.models.loader import load_model
from paged_llm.quant.evaluation import perplexity
from paged_llm.recipes.cache import cached_dir
from paged_llm.recipes.corpus import split_files
from paged_llm.recipes.training import eval_windows, hf_perplexity

HF_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def target_dir():
    return trained.trained_model_dir("test-target")


@pytest.fixture(scope="module")
def draft_dir():
    return trained.trained_model_dir("test-draft")


def test_checkpoints_are_plain_hf_and_share_a_tokenizer(target_dir, draft_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for d in (target_dir, draft_dir):
        assert all((d / f).is_file() for f in HF_FILES), sorted(p.name for p in d.iterdir())
    assert (target_dir / "tokenizer.json").read_bytes() == (
        draft_dir / "tokenizer.json"
    ).read_bytes()
    tok = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
    ids = tok("def f(x):\n    return x")["input_ids"]
    assert ids[0] == tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert tok.decode(ids, skip_special_tokens=True) == "def f(x):\n    return x"
    hf = AutoModelForCausalLM.from_pretrained(str(draft_dir), local_files_only=True)
    t_cfg = json.loads((target_dir / "config.json").read_text())
    assert hf.config.vocab_size == t_cfg["vocab_size"]
    assert (
        sum(p.numel() for p in hf.parameters())
        < 0.5 * trained.training_info("test-target")["parameters"]
    )


def test_training_learned_and_is_recorded(target_dir):
    info = trained.training_info("test-target")
    vocab = trained.recipe("test-target").corpus.vocab_size
    assert info["recipe_key"] == trained.recipe("test-target").key()
    assert info["loss_curve"][-1] < info["loss_curve"][0] - 1.0  # the loss came down
    assert info["heldout_perplexity"] < vocab / 4  # far better than uniform over the vocab


def test_our_model_matches_transformers_on_heldout_text(target_dir):
    from transformers import AutoModelForCausalLM

    windows = eval_windows(trained.corpus_tokens("test-target", "heldout"), 48, 4)
    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), local_files_only=True).eval()
    ours, _ = load_model(target_dir, torch.float32)
    ref = hf_perplexity(hf, windows)
    assert perplexity(ours, windows) == pytest.approx(ref, rel=1e-4)


def test_heldout_files_never_reach_training():
    spec = trained.recipe("test-target").corpus
    train, heldout = split_files(spec)
    assert heldout and not set(train) & set(heldout)
    streams = {s: trained.corpus_tokens("test-target", s) for s in ("train", "heldout")}
    assert streams["train"].dtype == np.uint16 and streams["heldout"].size > 1000


def test_cache_is_reused_and_keyed_by_recipe(target_dir):
    start = time.perf_counter()
    assert trained.trained_model_dir("test-target") == target_dir
    assert time.perf_counter() - start < 5  # no retraining
    a, b = trained.recipe("target"), trained.recipe("draft")
    assert a.key() != b.key() and a.corpus == b.corpus  # one shared tokenizer for the pair
    assert trained.DRAFT_FOR["test-target"] == "test-draft"


def test_unknown_model_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown built-in model 'huge'"):
        trained.trained_model_dir("huge")


def _build_once(args):
    """Child process: ask for the same cache entry; the build appends to a log file."""
    root, log = args

    def build(tmp):
        with open(log, "a") as f:
            f.write("built\n")
        time.sleep(0.5)  # the other process arrives while this one is building
        (tmp / "done").write_text("x")

    return str(cached_dir(root / "entry", build))


def test_concurrent_first_use_builds_once(tmp_path):
    log = tmp_path / "log.txt"
    with mp.get_context("fork").Pool(2) as pool:
        dirs = pool.map(_build_once, [(tmp_path, log)] * 2)
    assert dirs[0] == dirs[1] and (tmp_path / "entry" / "done").is_file()
    assert log.read_text().count("built") == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".entry-")]  # no temp left


def test_cli_defaults_to_the_pair_and_rejects_unknown_names():
    assert trained.cli_names([]) == ["target", "draft"]
    assert trained.cli_names(["test-draft"]) == ["test-draft"]
    with pytest.raises(SystemExit):
        trained.cli_names(["huge"])


def test_cli_prints_the_models(capsys, draft_dir):
    trained.main(["test-draft"])
    out = capsys.readouterr().out
    assert str(draft_dir) in out and "held-out perplexity" in out


def test_muon_covers_every_parameter_once_and_trains():
    from transformers import LlamaForCausalLM

    from paged_llm.recipes.training import (
        ModelShape,
        TrainSpec,
        llama_config,
        make_optimizers,
        train_llama,
    )

    shape = ModelShape(64, 128, 2, 2, 1, tie_word_embeddings=True)
    config = llama_config(shape, vocab_size=1024)
    spec = TrainSpec(steps=40, batch_size=4, seq_len=32, lr=3e-3, optimizer="muon")
    model = LlamaForCausalLM(config)
    muon, adamw = make_optimizers(model, spec)
    names = {id(p): n for n, p in model.named_parameters()}
    in_muon = [names[id(p)] for g in muon.param_groups for p in g["params"]]
    in_adamw = [names[id(p)] for g in adamw.param_groups for p in g["params"]]
    assert sorted(in_muon + in_adamw) == sorted(names.values())  # each parameter exactly once
    assert in_muon and all(n.endswith("proj.weight") for n in in_muon)  # decoder matrices only
    assert any("embed_tokens" in n for n in in_adamw)
    with pytest.raises(ValueError, match="optimizer must be adamw or muon"):
        make_optimizers(model, TrainSpec(steps=1, batch_size=1, seq_len=8, optimizer="sgd"))

    tokens = trained.corpus_tokens("test-target", "train")
    heldout = trained.corpus_tokens("test-target", "heldout")
    _, log = train_llama(config, tokens, heldout, spec, threads=1)
    assert log["optimizer"] == "muon"
    assert log["loss_curve"][-1] < log["loss_curve"][0] - 1.0


@pytest.mark.parametrize("shape", [(48, 24), (24, 48)])
def test_float32_muon_is_torchs_muon_without_bfloat16(shape):
    """The same updates as torch.optim.Muon, up to its bfloat16 rounding (tall and wide)."""
    from paged_llm.recipes.training import Float32Muon

    torch.manual_seed(0)
    ours = torch.nn.Parameter(torch.randn(shape))
    theirs = torch.nn.Parameter(ours.detach().clone())
    kw = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    opts = [Float32Muon([ours], **kw), torch.optim.Muon([theirs], **kw)]
    start = ours.detach().clone()
    for _ in range(3):
        grad = torch.randn(shape)
        for p, opt in zip((ours, theirs), opts):
            p.grad = grad.clone()
            opt.step()
    moved = (theirs.detach() - start).abs().max()
    assert moved > 0.02
    torch.testing.assert_close(ours.detach(), theirs.detach(), atol=0.02 * float(moved), rtol=0)


@pytest.mark.parametrize("native", [True, False])
def test_muon_is_torchs_where_bfloat16_is_native(monkeypatch, native):
    from paged_llm.recipes import training

    monkeypatch.setattr(training, "native_bf16", lambda: native)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    spec = training.TrainSpec(steps=1, batch_size=1, seq_len=8, optimizer="muon")
    muon, _ = training.make_optimizers(model, spec)
    assert type(muon) is (torch.optim.Muon if native else training.Float32Muon)


def test_distill_loss_is_the_kl_from_teacher_to_student():
    from paged_llm.recipes.training import distill_loss

    torch.manual_seed(0)
    teacher, student = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    assert distill_loss(teacher, teacher).abs() < 1e-6
    p = teacher.softmax(-1)
    expected = (p * (p.log() - student.log_softmax(-1))).sum(-1).mean()
    torch.testing.assert_close(distill_loss(student, teacher), expected)


def test_distilled_student_agrees_with_its_teacher_more(target_dir):
    """Same student, seed and steps: imitating the teacher (distill=1) raises how often the
    student's greedy token is the teacher's, which is what a draft's acceptance rate measures."""
    from transformers import LlamaForCausalLM

    from paged_llm.recipes.training import ModelShape, TrainSpec, llama_config, train_llama

    teacher = LlamaForCausalLM.from_pretrained(str(target_dir)).eval()
    config = llama_config(ModelShape(64, 128, 1, 2, 1, tie_word_embeddings=True), 1024)
    tokens = trained.corpus_tokens("test-target", "train")
    heldout = trained.corpus_tokens("test-target", "heldout")
    agreement = {}
    for w in (0.0, 1.0):
        spec = TrainSpec(steps=80, batch_size=8, seq_len=64, lr=3e-3, eval_windows=16, distill=w)
        _, log = train_llama(config, tokens, heldout, spec, threads=1, teacher=teacher)
        agreement[w] = log["heldout_teacher_top1_agreement"]
    assert agreement[1.0] > agreement[0.0] + 0.02


def test_a_students_key_follows_its_teachers_recipe(monkeypatch):
    from dataclasses import replace

    draft_key = trained.recipe("draft").key()
    assert trained.recipe("draft").teacher == "target" and trained.recipe("draft").train.distill
    changed = replace(
        trained.RECIPES["target"], train=replace(trained.RECIPES["target"].train, steps=1)
    )
    monkeypatch.setitem(trained.RECIPES, "target", changed)
    assert trained.recipe("draft").key() != draft_key  # a retrained target retrains its draft
