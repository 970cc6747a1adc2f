"""Kimi Delta Attention (KDA): gated delta-rule linear attention with per-channel decay.

Per head, with state S [d_k, d_v], for each token t:
    S <- diag(exp(g_t)) S                      (per-channel forget gate, g_t <= 0)
    u_t = beta_t (v_t - S^T k_t)               (delta rule on the decayed state)
    S <- S + k_t u_t^T
    o_t = S^T q_t
`kda_recurrent` runs this token by token (decode, verification); `kda_chunked` computes the same
thing a chunk at a time (prefill), solving the intra-chunk dependency of the u_t as one
unit-lower-triangular system. `kda_chunked_scan` is the batched, differentiable form from a zero
state that solo.training trains with (the chunks' states by a parallel scan, matmuls only).
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


def unit_lower_inverse(lower: torch.Tensor) -> torch.Tensor:
    """(I + L)^-1 for strictly lower-triangular L [..., C, C] (C a power of two), by doubling the
    inverted diagonal blocks: inv([[A, 0], [X, D]]) = [[A^-1, 0], [-D^-1 X A^-1, D^-1]]. Batched
    matmuls only (fast on both CPU and GPU, unlike batched triangular solves of tiny matrices)."""
    size = lower.shape[-1]
    inv = torch.eye(size, dtype=lower.dtype, device=lower.device).expand_as(lower)
    block = 1
    while block < size:
        n = size // block
        shape = (*lower.shape[:-2], n, block, n, block)
        lb = lower.reshape(shape).transpose(-3, -2)  # [..., n, n, b, b]
        ib = inv.reshape(shape).transpose(-3, -2).clone()
        even = torch.arange(0, n, 2, device=lower.device)
        ib[..., even + 1, even, :, :] = (
            -ib[..., even + 1, even + 1, :, :] @ lb[..., even + 1, even, :, :] @ ib[..., even, even, :, :]
        )
        inv = ib.transpose(-3, -2).reshape(lower.shape)
        block *= 2
    return inv


def kda_chunked_scan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunk: int = 16
) -> torch.Tensor:
    """Batched, differentiable KDA from a zero state: q, k, g [B, T, H, d_k], v [B, T, H, d_v],
    beta [B, T, H] (fp32) -> o [B, T, H, d_v]. Needs the safe gate (g >= lower_bound).

    Inside a chunk (cumulative log decay G, G >= chunk * lower_bound, so e^{+-G} stays finite in fp32)
    the intra-chunk terms are plain matmuls of (x e^{G}) and (k e^{-G}); the WY form U = U0 - W S
    leaves a linear recurrence S_{n+1} = A_n S_n + B_n across chunks, solved by a parallel scan.
    """
    bsz, length, heads, dk = k.shape
    dv = v.shape[-1]
    pad = (-length) % chunk
    if pad:  # zero k and beta, zero log-decay: padded tokens change nothing before them
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    n = (length + pad) // chunk

    def split(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, d] -> [B, H, N, C, d]
        return x.reshape(bsz, n, chunk, heads, -1).permute(0, 3, 1, 2, 4)

    q, k, v, g = split(q), split(k), split(v), split(g)
    beta = beta.reshape(bsz, n, chunk, heads).permute(0, 3, 1, 2)[..., None]  # [B, H, N, C, 1]
    cum = g.cumsum(3)
    last = cum[:, :, :, -1:]  # [B, H, N, 1, dk]
    qg, kg, kinv = q * cum.exp(), k * cum.exp(), k * (-cum).exp()
    kend = k * (last - cum).exp()
    ones = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device)
    strict, incl = ones.tril(-1), ones.tril()
    lower = (kg @ kinv.transpose(-1, -2)) * beta * strict
    scores = (qg @ kinv.transpose(-1, -2)) * incl
    solved = unit_lower_inverse(lower) @ torch.cat([beta * v, beta * kg], -1)
    u0, w = solved.split([dv, dk], dim=-1)
    # S_{n+1} = A_n S_n + B_n with A_n = diag(e^{G_last}) - kend^T W, B_n = kend^T U0
    a = torch.diag_embed(last.squeeze(-2).exp()) - kend.transpose(-1, -2) @ w  # [B, H, N, dk, dk]
    b = kend.transpose(-1, -2) @ u0  # [B, H, N, dk, dv]
    offset = 1
    while offset < n:  # inclusive scan: b[n] becomes the state after chunk n
        b = torch.cat([b[:, :, :offset], a[:, :, offset:] @ b[:, :, :-offset] + b[:, :, offset:]], 2)
        a = torch.cat([a[:, :, :offset], a[:, :, offset:] @ a[:, :, :-offset]], 2)
        offset *= 2
    states = torch.cat([torch.zeros_like(b[:, :, :1]), b[:, :, :-1]], 2)  # state before each chunk
    u = u0 - w @ states
    o = qg @ states + scores @ u  # [B, H, N, C, dv]
    return o.permute(0, 2, 3, 1, 4).reshape(bsz, n * chunk, heads, dv)[:, :length]


class KimiDeltaAttention(nn.Module):
    """`num_heads`: the heads this module computes (a tensor-parallel rank's share; default all)."""

    def __init__(self, config: LingConfig, num_heads: int | None = None) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = num_heads or config.linear_num_heads
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
        """Per-channel log decay g [..., T, H, d] in fp32 (x [..., T, hidden])."""
        gate_in = self.f_proj(x).float().unflatten(-1, (self.num_heads, self.head_dim)) + self.dt_bias.float().view(
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

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        """The q, k, v projections side by side [..., T, 3D] (what the short conv reads)."""
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)

    def delta_inputs(
        self, conv_out: torch.Tensor, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The short conv's output [..., T, 3D] and the layer input x [..., T, hidden] -> the
        delta rule's q (L2-normalised, times d^-1/2), k (L2-normalised), v [..., T, H, d], the log
        decay g [..., T, H, d] and beta [..., T, H]."""
        shape = (*x.shape[:-1], self.num_heads, self.head_dim)
        q, k, v = conv_out.chunk(3, dim=-1)
        q = l2_normalize(q.reshape(shape)) * self.head_dim**-0.5
        k = l2_normalize(k.reshape(shape))
        return q, k, v.reshape(shape), self.forget_gate(x), torch.sigmoid(self.b_proj(x).float())

    def gated_norm(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o [..., T, H, d] -> o_norm(o, g_proj(x)) flattened to [..., T, H*d] (what `dense` reads)."""
        return self.o_norm(o, self.g_proj(x).unflatten(-1, (self.num_heads, self.head_dim))).flatten(-2)

    def forward(self, x: torch.Tensor, state: KDAState, history: KDAHistory | None = None) -> torch.Tensor:
        conv_out = self.short_conv(self.qkv(x), state.conv, history)
        q, k, v, g, beta = self.delta_inputs(conv_out, x)
        if history is not None or x.shape[0] <= RECURRENT_MAX_TOKENS:
            states = None if history is None else history.states
            o = kda_recurrent(q, k, v, g, beta, state.recurrent, states)
        else:
            o = kda_chunked(q, k, v, g, beta, state.recurrent, prefill_chunk_size(q.device))
        return self.dense(self.gated_norm(o.to(x.dtype), x))


class _DepthwiseConvWeight(nn.Module):
    """Holds a depthwise conv weight [D, 1, K] under the checkpoint's `*_conv1d.weight` name."""

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size), requires_grad=False)
