"""Train an EAGLE head (``models/eagle.py``) on a trained target's features.

Each step draws windows of the corpus, runs the frozen target once for its final hidden states
f and logits, and trains the head to predict f_j from (x_j, f_{j-1}) at every position: a
smooth-L1 regression onto f_j plus, weighted by ``distill``, KL(target || head) of the
distributions that the target's LM head gives f_j and the prediction. EAGLE's recipe (Li et
al., 2024) with the forward KL of DistillSpec in place of the cross-entropy. The input features
get uniform noise (EAGLE's ``U(-noise, noise)``), so the head tolerates its own imperfect
predictions when it drafts several tokens from them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from paged_llm.recipes.training import (
    TrainSpec,
    eval_windows,
    optimise,
    torch_threads,
    train_threads,
)


class EagleHeadReference(nn.Module):
    """The head in transformers' own Llama modules over whole [B, L] windows: what training
    optimises, and the reference the paged head is tested against. Parameter names are the
    checkpoint's (``fc``, ``layers.0.*``, ``norm``)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaRMSNorm,
            LlamaRotaryEmbedding,
        )

        config._attn_implementation = "sdpa"  # a causal mask without building one
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, 0)])
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def forward(
        self,
        embeds: torch.Tensor,  # [B, L, H] target embeddings of x_0..x_{L-1}
        features: torch.Tensor,  # [B, L, H] f_{-1} = 0, f_0, .., f_{L-2}
    ) -> torch.Tensor:  # [B, L, H] predicted f_0..f_{L-1}
        """Predicted features at every position, each seeing only earlier ones (causal)."""
        x = self.fc(torch.cat([embeds, features], dim=-1))
        positions = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
        rope = self.rotary_emb(x, positions)
        for layer in self.layers:
            x = layer(x, attention_mask=None, position_ids=positions, position_embeddings=rope)
        return self.norm(x)


def shifted_features(features: torch.Tensor) -> torch.Tensor:  # [B, L, H] -> [B, L, H]
    """The head's feature inputs for target features f_0..f_{L-1}: zeros, f_0, .., f_{L-2}."""
    return torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], dim=1)


@torch.no_grad()
def target_features(target: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A transformers causal LM's final (normed) hidden states [B, L, H] and logits [B, L, V]."""
    hidden = target.model(input_ids=ids).last_hidden_state
    return hidden, target.lm_head(hidden)


def head_loss(
    head: EagleHeadReference, target: Any, ids: torch.Tensor, distill: float, noise: float,
    gen: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
    """The training loss on windows ``ids`` [B, L], and its parts."""
    feats, logits = target_features(target, ids)
    inputs = shifted_features(feats)
    if noise:
        inputs = inputs + (torch.rand(inputs.shape, generator=gen) * 2 - 1) * noise
    with torch.no_grad():
        embeds = target.get_input_embeddings()(ids)
    pred = head(embeds, inputs)
    reg = nn.functional.smooth_l1_loss(pred, feats)
    vocab = logits.shape[-1]
    log_q = torch.log_softmax(target.lm_head(pred).float().reshape(-1, vocab), -1)
    log_p = torch.log_softmax(logits.float().reshape(-1, vocab), -1)
    kl = nn.functional.kl_div(log_q, log_p, log_target=True, reduction="batchmean")
    return reg + distill * kl, {"regression": reg.item(), "kl": kl.item()}


def train_eagle_head(
    config: Any,
    target: Any,
    train_tokens: np.ndarray,
    heldout_tokens: np.ndarray,
    spec: TrainSpec,
    noise: float,
    desc: str = "training eagle",
    threads: int = 2,
) -> tuple[EagleHeadReference, dict[str, Any]]:
    """Train a head on frozen ``target``'s features; return (head, training log)."""
    threads = train_threads(threads)
    target.eval().requires_grad_(False)
    with torch_threads(threads), torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        head = EagleHeadReference(config).train()
        gen = torch.Generator().manual_seed(spec.seed + 1)
        loss_of = lambda batch: head_loss(head, target, batch, spec.distill, noise, gen)[0]
        losses, train_s = optimise(head, spec, train_tokens, gen, loss_of, desc)
        head.eval()
        heldout = eval_windows(heldout_tokens, spec.seq_len, spec.eval_windows)
        with torch.no_grad():
            _, parts = head_loss(head, target, heldout, spec.distill, 0.0)
            agreement = teacher_forced_agreement(head, target, heldout)
    log = {
        "parameters": sum(p.numel() for p in head.parameters()),
        "train_seconds": round(train_s, 1),
        "train_threads": threads,
        "optimizer": spec.optimizer,
        "tokens_seen": spec.steps * spec.batch_size * spec.seq_len,
        "final_train_loss": float(np.mean(losses[-10:])),
        "loss_curve": [round(x, 4) for x in losses[:: max(1, len(losses) // 50)]],
        "heldout_regression": parts["regression"],
        "heldout_kl": parts["kl"],
        "heldout_teacher_top1_agreement": agreement,
        "feature_noise": noise,
        "distill": spec.distill,
    }
    return head, log


@torch.no_grad()
def teacher_forced_agreement(
    head: EagleHeadReference, target: Any, windows: torch.Tensor, batch_size: int = 8
) -> float:
    """Fraction of positions where the head's greedy next token, given the target's true
    features, equals the target's (the first draft's acceptance rate, greedy)."""
    same, count = 0, 0
    embed = target.get_input_embeddings()
    for chunk in windows.split(batch_size):
        feats, logits = target_features(target, chunk)
        pred = head(embed(chunk), shifted_features(feats))
        same += int((target.lm_head(pred).argmax(-1) == logits.argmax(-1)).sum())
        count += chunk.numel()
    return same / count
