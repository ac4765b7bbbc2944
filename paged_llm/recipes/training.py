"""Train a small Llama with transformers on a token stream: AdamW or Muon, warmup + cosine
schedule, random windows drawn from a seeded generator, held-out perplexity at the end."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from paged_llm.models.tokenizer_builder import MODEL_MAX_LENGTH
from paged_llm.utils.cpu import native_bf16


@dataclass(frozen=True)
class ModelShape:
    """Llama hyper-parameters of one built-in model."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    tie_word_embeddings: bool = False


@dataclass(frozen=True)
class TrainSpec:
    """How long and how to train; everything random derives from ``seed``."""

    steps: int
    batch_size: int
    seq_len: int
    lr: float = 2e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    eval_windows: int = 64  # held-out windows of seq_len tokens for the final perplexity
    # "bf16": bfloat16 autocast (weights and optimizer stay float32), 1.6-2x faster on CPUs
    # with native bf16 (AVX512-BF16 / AMX); "auto" uses it only there; "fp32" never.
    precision: str = "fp32"
    # "adamw" for every parameter, or "muon": Muon (orthogonalised momentum) for the decoder's
    # weight matrices and AdamW for embeddings, LM head and norms. Muon reaches a given loss on
    # about a third of AdamW's tokens here, which brings the target to about ten minutes.
    optimizer: str = "adamw"
    # Weight of the distillation term when a teacher model is given: loss = (1 - w) * next-token
    # cross-entropy + w * KL(teacher || student) per position. A draft that imitates its target
    # agrees with it more often than one trained on the data alone (DistillSpec, Zhou et al.).
    distill: float = 0.0


def resolve_precision(precision: str) -> str:
    """ "fp32" or "bf16" for a TrainSpec.precision ("auto" asks oneDNN about this CPU)."""
    if precision == "auto":
        return "bf16" if native_bf16() else "fp32"
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be auto, fp32 or bf16, got '{precision}'")
    return precision


def llama_config(shape: ModelShape, vocab_size: int) -> Any:
    """The HF LlamaConfig of a built-in model (token ids as in tokenizer_builder)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        tie_word_embeddings=shape.tie_word_embeddings,
        max_position_embeddings=MODEL_MAX_LENGTH,
        rms_norm_eps=1e-5,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        architectures=["LlamaForCausalLM"],
    )


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` intra-op threads, then restore the caller's setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def lr_at(step: int, spec: TrainSpec) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``lr * min_lr_ratio``."""
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    frac = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return spec.lr * (spec.min_lr_ratio + (1 - spec.min_lr_ratio) * cosine)


def random_windows(
    tokens: np.ndarray, batch: int, length: int, gen: torch.Generator
) -> torch.Tensor:  # [batch, length] int64
    """``batch`` windows of ``length`` tokens starting at random offsets of the stream."""
    if tokens.size < length + 1:
        raise ValueError(f"token stream of {tokens.size} tokens is shorter than {length + 1}")
    starts = torch.randint(0, tokens.size - length, (batch,), generator=gen).tolist()
    return torch.from_numpy(np.stack([tokens[s : s + length] for s in starts]).astype(np.int64))


def eval_windows(tokens: np.ndarray, length: int, count: int) -> torch.Tensor:
    """Up to ``count`` consecutive non-overlapping windows: [N, length] int64 (deterministic)."""
    n = min(count, tokens.size // length)
    if n == 0:
        raise ValueError(f"held-out stream of {tokens.size} tokens has no {length}-token window")
    return torch.from_numpy(tokens[: n * length].astype(np.int64)).view(n, length)


@torch.no_grad()
def hf_perplexity(model: Any, windows: torch.Tensor, batch_size: int = 8) -> float:
    """exp(mean next-token NLL) of a transformers causal LM over [N, L] windows."""
    model.eval()
    total, count = 0.0, 0
    for chunk in windows.split(batch_size):
        logits = model(input_ids=chunk).logits.float()  # [B, L, V]
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum"
        )
        total += nll.item()
        count += chunk[:, 1:].numel()
    return math.exp(total / count)


def param_groups(params: Iterable[torch.Tensor], weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices only; norms (and biases) are not decayed, as in most LLM recipes."""
    params = list(params)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def orthogonalize(
    update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:  # [A, B] -> [A, B]
    """Muon's quintic Newton-Schulz iteration towards U V^T of ``update`` = U S V^T, in float32."""
    a, b, c = coefficients
    x = update.float()
    tall = x.shape[0] > x.shape[1]
    if tall:  # iterate on the smaller Gram matrix
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).to(update.dtype)


class Float32Muon(torch.optim.Muon):
    """``torch.optim.Muon`` with its Newton-Schulz iterations in float32 instead of bfloat16.

    A CPU without native bfloat16 emulates bf16 matmuls about 60x slower than float32 ones
    (0.8 against 49 GFLOP/s on a 2-core AMD EPYC without AVX512-BF16): torch's Muon made a step
    of the built-in target take 75 s instead of about 2 s there. Same algorithm and settings.
    """

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One Muon update of every parameter with a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = orthogonalize(update, group["ns_coefficients"], group["ns_steps"],
                                       group["eps"])  # fmt: skip
                a, b = p.shape[:2]
                ratio = {"match_rms_adamw": 0.2 * math.sqrt(max(a, b)),
                         None: math.sqrt(max(1, a / b)), "original": math.sqrt(max(1, a / b))
                         }.get(group["adjust_lr_fn"], 1.0)  # fmt: skip
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-lr * ratio)
        return loss


def make_optimizers(model: torch.nn.Module, spec: TrainSpec) -> list[torch.optim.Optimizer]:
    """The optimizers of ``spec.optimizer`` over the model's parameters (each parameter once)."""
    adamw = dict(lr=spec.lr, betas=(0.9, 0.95), eps=1e-8)
    if spec.optimizer == "adamw":
        return [torch.optim.AdamW(param_groups(model.parameters(), spec.weight_decay), **adamw)]
    if spec.optimizer != "muon":
        raise ValueError(f"optimizer must be adamw or muon, got '{spec.optimizer}'")
    # Muon is defined for hidden weight matrices; embeddings and the LM head are lookups and a
    # classifier, whose rows should move independently, so they stay with AdamW (as in Muon's
    # reference recipe). Tied embeddings appear once in named_parameters, as embed_tokens.
    hidden, other = [], []
    for name, p in model.named_parameters():
        is_matrix = p.dim() == 2 and "embed_tokens" not in name and "lm_head" not in name
        (hidden if is_matrix else other).append(p)
    # match_rms_adamw scales Muon's update to AdamW's RMS, so one lr (and schedule) serves both.
    muon_cls = torch.optim.Muon if native_bf16() else Float32Muon
    muon = muon_cls(
        hidden, lr=spec.lr, weight_decay=spec.weight_decay, adjust_lr_fn="match_rms_adamw"
    )
    return [muon, torch.optim.AdamW(param_groups(other, spec.weight_decay), **adamw)]


def train_threads(default: int) -> int:
    """Threads for training: $PAGED_LLM_TRAIN_THREADS, else ``default``.

    On a machine shared with other busy processes, 1 is often faster: oversubscribed OpenMP
    threads spin at every barrier.
    """
    return int(os.environ.get("PAGED_LLM_TRAIN_THREADS") or default)


def distill_loss(
    student: torch.Tensor,  # [B, L, V] logits
    teacher: torch.Tensor,  # [B, L, V] logits of the same windows
) -> torch.Tensor:
    """Mean KL(teacher || student) over the B * L next-token distributions."""
    vocab = student.shape[-1]
    log_q = torch.log_softmax(student.float().reshape(-1, vocab), dim=-1)
    log_p = torch.log_softmax(teacher.float().reshape(-1, vocab), dim=-1)
    return torch.nn.functional.kl_div(log_q, log_p, log_target=True, reduction="batchmean")


@torch.no_grad()
def top1_agreement(model: Any, teacher: Any, windows: torch.Tensor, batch_size: int = 8) -> float:
    """Fraction of positions where the greedy next tokens of ``model`` and ``teacher`` agree
    (what a greedy draft's acceptance rate measures)."""
    same, count = 0, 0
    for chunk in windows.split(batch_size):
        a = model(input_ids=chunk).logits.argmax(-1)
        b = teacher(input_ids=chunk).logits.argmax(-1)
        same += int((a == b).sum())
        count += a.numel()
    return same / count


def optimise(
    model: torch.nn.Module,
    spec: TrainSpec,
    tokens: np.ndarray,
    gen: torch.Generator,
    loss_of: Any,  # [batch, seq_len] windows -> scalar loss
    desc: str,
) -> tuple[list[float], float]:
    """``spec.steps`` optimizer steps on random windows of ``tokens`` (learning-rate schedule,
    gradient clipping, a progress bar); return the losses and the seconds it took."""
    from tqdm.auto import tqdm

    optimizers = make_optimizers(model, spec)
    losses: list[float] = []
    start = time.perf_counter()
    bar = tqdm(range(spec.steps), desc=desc, mininterval=2.0)
    for step in bar:
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = lr_at(step, spec)
        loss = loss_of(random_windows(tokens, spec.batch_size, spec.seq_len, gen))
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        for opt in optimizers:
            opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    bar.close()
    return losses, time.perf_counter() - start


def train_llama(
    config: Any,
    train_tokens: np.ndarray,
    heldout_tokens: np.ndarray,
    spec: TrainSpec,
    desc: str = "train",
    threads: int = 2,
    teacher: Any = None,
) -> tuple[Any, dict[str, Any]]:
    """Train a transformers LlamaForCausalLM from scratch (imitating ``teacher``, a causal LM
    on the same tokenizer, with weight ``spec.distill``); return (model, training log)."""
    from transformers import LlamaForCausalLM

    threads = train_threads(threads)
    bf16 = resolve_precision(spec.precision) == "bf16"
    with torch_threads(threads), torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config).train()
        gen = torch.Generator().manual_seed(spec.seed + 1)

        def loss_of(batch: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = model(input_ids=batch, labels=batch)  # HF shifts the labels itself
                loss = out.loss
                if teacher is not None and spec.distill > 0:
                    with torch.no_grad():
                        target_logits = teacher(input_ids=batch).logits
                    kl = distill_loss(out.logits, target_logits)
                    loss = (1 - spec.distill) * loss + spec.distill * kl
            return loss

        losses, train_s = optimise(model, spec, train_tokens, gen, loss_of, desc)
        heldout = eval_windows(heldout_tokens, spec.seq_len, spec.eval_windows)
        ppl = hf_perplexity(model, heldout)
        agreement = None if teacher is None else top1_agreement(model, teacher, heldout)
    model.eval()
    log = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_seconds": round(train_s, 1),
        "train_threads": threads,
        "precision": "bf16" if bf16 else "fp32",
        "optimizer": spec.optimizer,
        "tokens_seen": spec.steps * spec.batch_size * spec.seq_len,
        "final_train_loss": float(np.mean(losses[-10:])),
        "loss_curve": [round(x, 4) for x in losses[:: max(1, len(losses) // 50)]],
        "heldout_perplexity": ppl,
    }
    if agreement is not None:
        log["distill"] = spec.distill
        log["heldout_teacher_top1_agreement"] = agreement
    return model, log
