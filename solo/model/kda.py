"""Kimi Delta Attention (KDA): gated delta-rule linear attention with per-channel decay.

Per head, with state S [d_k, d_v], for each token t:
    S <- diag(exp(g_t)) S                      (per-channel forget gate, g_t <= 0)
    u_t = beta_t (v_t - S^T k_t)               (delta rule on the decayed state)
    S <- S + k_t u_t^T
    o_t = S^T q_t
`kda_recurrent` runs this token by token (decode, verification); `kda_chunked` computes the same
thing a chunk at a time (prefill), solving the intra-chunk dependency of the u_t as one
unit-lower-triangular system.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from solo.config import LingConfig
from solo.model.cache import KDAHistory, KDAState
from solo.model.layers import GatedRMSNorm, Linear, l2_normalize

RECURRENT_MAX_TOKENS = 16  # up to this many tokens per call run the token-by-token form


def prefill_chunk_size(device: torch.device) -> int:
    """The chunk of `kda_chunked` for a prefill on `device`. A chunk costs C^2 d_k multiply-adds per
    token in its [C, C, d_k] decay tensor and one pass of the chunk loop: a CPU is bound by the former
    (16: 2.8x faster than 64 on a 1,236-token GSM8K prompt at the bundled model's shape, and closer to
    the token-by-token form), a GPU by the launches of the latter."""
    return 16 if device.type == "cpu" else 64


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_history: torch.Tensor | None = None,
) -> torch.Tensor:
    """q, k, g [T, H, d_k]; v [T, H, d_v]; beta [T, H]; state [H, d_k, d_v] updated in place.

    If `state_history` [T, H, d_k, d_v] is given, the state after each token is stored in it
    (speculative verification keeps them to roll back to the last accepted token).
    Returns o [T, H, d_v] in fp32.
    """
    s = state
    outputs = []
    for t in range(q.shape[0]):
        s = s * g[t].exp()[..., None]
        kv = torch.einsum("hkv,hk->hv", s, k[t])
        u = beta[t][:, None] * (v[t] - kv)
        s = s + k[t][..., None] * u[:, None, :]
        outputs.append(torch.einsum("hkv,hk->hv", s, q[t]))
        if state_history is not None:
            state_history[t].copy_(s)
    state.copy_(s)
    return torch.stack(outputs)


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> torch.Tensor:
    """Same contract as `kda_recurrent` (without history), computed chunk by chunk.

    Within a chunk with cumulative log-decay G_t = sum_{s<=t} g_s and chunk-initial state S0:
        (I + L) U = beta * (V - (K * e^G) S0),  L_ts = beta_t sum_c k_tc k_sc e^(G_tc - G_sc), s < t
        O = (Q * e^G) S0 + P U,                 P_ts = sum_c q_tc k_sc e^(G_tc - G_sc), s <= t
        S <- e^(G_C) * S0 + (K * e^(G_C - G))^T U
    Decays enter only as differences G_t - G_s <= 0, so nothing overflows.
    """
    num_tokens = q.shape[0]
    pad = (-num_tokens) % chunk_size
    if pad:  # zero k, g and beta leave the state untouched
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    # [H, N, C, d]
    q, k, v, g = (x.transpose(0, 1).unflatten(1, (-1, chunk_size)) for x in (q, k, v, g))
    beta = beta.transpose(0, 1).unflatten(1, (-1, chunk_size))
    cum = g.cumsum(dim=2)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    strict = causal.tril(-1)
    eye = torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    s = state
    outputs = []
    for n in range(q.shape[1]):
        qn, kn, vn, bn, cn = q[:, n], k[:, n], v[:, n], beta[:, n], cum[:, n]
        diff = (cn[:, :, None, :] - cn[:, None, :, :]).masked_fill(~causal[None, :, :, None], float("-inf"))
        decay = diff.exp()  # [H, C, C, d_k]; zero above the diagonal
        lower = torch.einsum("htc,hsc,htsc->hts", kn, kn, decay) * bn[..., None] * strict
        rhs = bn[..., None] * (vn - (kn * cn.exp()) @ s)
        u = torch.linalg.solve_triangular(eye + lower, rhs, upper=False, unitriangular=True)
        scores = torch.einsum("htc,hsc,htsc->hts", qn, kn, decay)
        outputs.append((qn * cn.exp()) @ s + scores @ u)
        last = cn[:, -1:, :]  # [H, 1, d_k]
        s = last.transpose(1, 2).exp() * s + (kn * (last - cn).exp()).transpose(1, 2) @ u
    state.copy_(s)
    out = torch.cat(outputs, dim=1)  # [H, T_padded, d_v]
    return out.transpose(0, 1)[:num_tokens]


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: LingConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.linear_num_heads
        self.head_dim = config.linear_head_dim
        dim = self.num_heads * self.head_dim
        self.kernel_size = config.conv_kernel_size
        self.safe_gate = config.kda_safe_gate
        self.lower_bound = config.kda_lower_bound
        self.q_proj = Linear(hidden, dim)
        self.k_proj = Linear(hidden, dim)
        self.v_proj = Linear(hidden, dim)
        self.q_conv1d = _DepthwiseConvWeight(dim, self.kernel_size)
        self.k_conv1d = _DepthwiseConvWeight(dim, self.kernel_size)
        self.v_conv1d = _DepthwiseConvWeight(dim, self.kernel_size)
        self.A_log = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.f_proj = Linear(hidden, dim)
        self.b_proj = Linear(hidden, self.num_heads)
        self.g_proj = Linear(hidden, dim)
        self.o_norm = GatedRMSNorm(self.head_dim, config.rms_norm_eps)
        self.dense = Linear(dim, hidden)
        self.register_buffer("conv_weight", torch.empty(0), persistent=False)

    def finalize(self) -> None:
        """After loading: fuse the three conv weights into one [3D, K] fp32 matrix."""
        self.conv_weight = torch.cat(
            [c.weight.reshape(-1, self.kernel_size) for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)]
        ).float()

    def forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        """Per-channel log decay g [T, H, d] in fp32."""
        gate_in = self.f_proj(x).float().view(-1, self.num_heads, self.head_dim) + self.dt_bias.float().view(
            self.num_heads, self.head_dim
        )
        rate = self.A_log.float().exp()[:, None]
        if self.safe_gate:
            return self.lower_bound * torch.sigmoid(rate * gate_in)
        return -rate * F.softplus(gate_in)

    def short_conv(
        self, qkv: torch.Tensor, conv_state: torch.Tensor, history: KDAHistory | None = None
    ) -> torch.Tensor:
        """Causal depthwise conv + SiLU over [T, 3D], continuing from the state's last K-1 inputs."""
        window = torch.cat([conv_state, qkv.float().t()], dim=1)  # [3D, K-1+T]
        if history is not None:
            history.window.copy_(window)
        conv_state.copy_(window[:, window.shape[1] - conv_state.shape[1] :])
        out = F.conv1d(window[None], self.conv_weight[:, None, :], groups=window.shape[0])[0]
        return F.silu(out).t()  # [T, 3D] fp32

    def forward(self, x: torch.Tensor, state: KDAState, history: KDAHistory | None = None) -> torch.Tensor:
        num_tokens = x.shape[0]
        shape = (num_tokens, self.num_heads, self.head_dim)
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        q, k, v = self.short_conv(qkv, state.conv, history).chunk(3, dim=-1)
        q = l2_normalize(q.reshape(shape)) * self.head_dim**-0.5
        k = l2_normalize(k.reshape(shape))
        v = v.reshape(shape)
        g = self.forget_gate(x)
        beta = torch.sigmoid(self.b_proj(x).float())
        if history is not None or num_tokens <= RECURRENT_MAX_TOKENS:
            states = None if history is None else history.states
            o = kda_recurrent(q, k, v, g, beta, state.recurrent, states)
        else:
            o = kda_chunked(q, k, v, g, beta, state.recurrent, prefill_chunk_size(q.device))
        gate = self.g_proj(x).view(shape)
        o = self.o_norm(o.to(x.dtype), gate).reshape(num_tokens, -1)
        return self.dense(o)


class _DepthwiseConvWeight(nn.Module):
    """Holds a depthwise conv weight [D, 1, K] under the checkpoint's `*_conv1d.weight` name."""

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size), requires_grad=False)
