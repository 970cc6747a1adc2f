"""Lossless verification of a draft chain (speculative sampling).

For draft tokens d_1..d_S drawn from draft distributions q_1..q_S, and target distributions
p_1..p_{S+1} computed in one verification pass: d_i is accepted with probability
min(1, p_i(d_i) / q_i(d_i)), left to right, until the first rejection; at the first rejected
position a replacement is drawn from normalise(max(0, p - q)); if every draft is accepted, a bonus
token is drawn from p_{S+1}. The emitted tokens then follow the target distribution exactly.
Greedy decoding is the special case of one-hot p and q: accept while the draft equals the target's
argmax, then emit the target's argmax.

Everything is batched and shape-static (no host synchronisation), so it can run inside a graph;
the batch dimension is used by the statistical tests.
"""

from __future__ import annotations

import torch

from solo.engine.sampling import sample_from


def accept_drafts(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    drafts: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """target_probs [B, S+1, V], draft_probs [B, S, V], drafts [B, S] ->
    (accepted count [B] in 0..S, next token [B]: the replacement or bonus token)."""
    batch, steps = drafts.shape
    p_draft = target_probs[:, :steps].gather(-1, drafts[..., None])[..., 0]
    q_draft = draft_probs.gather(-1, drafts[..., None])[..., 0]
    uniform = torch.rand(p_draft.shape, generator=generator, device=drafts.device, dtype=p_draft.dtype)
    accepted_each = uniform * q_draft < p_draft  # u < p/q without dividing by q
    accepted = accepted_each.long().cumprod(-1).sum(-1)  # leading run of acceptances
    # residual distributions per position; position S (all accepted) has q = 0: the bonus from p
    q_padded = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)
    residual = (target_probs - q_padded).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), target_probs)
    chosen = residual.gather(1, accepted[:, None, None].expand(-1, 1, residual.shape[-1]))[:, 0]
    return accepted, sample_from(chosen, generator)
