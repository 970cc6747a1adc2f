"""Sampling: greedy, temperature, top-k, top-p, seeded; presence/frequency penalties and a logit
bias; the log-probabilities of what was sampled. Shapes are static and there is no host
synchronisation, so sampling can live inside a captured decode step.

Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks index i with
probability p_i, without a cumulative-sum search.

Penalties and the bias are applied to the logits before temperature, top-k and top-p, with the
OpenAI formula ``logit - frequency_penalty * count - presence_penalty * (count > 0) + bias``, where
``count`` is how often the token occurs among the tokens generated so far (not the prompt). They live
in `LogitAdjuster`'s fixed device buffers, so a captured graph reads each request's values.
"""

from __future__ import annotations

import logging
import math
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

LOGPROB_TOP = 20  # the most alternatives a caller may ask for; decoders always compute this many

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2 <= value <= 2):
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        for token, bias in self.logit_bias:
            if token < 0 or not (math.isfinite(bias) and -100 <= bias <= 100):
                raise ValueError(f"logit_bias: token {token} -> {bias}: ids are >= 0 and biases in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def adjusted(self) -> bool:
        """Whether the logits are changed before sampling (penalties or a bias)."""
        return self.penalized or bool(self.logit_bias)


class LogitAdjuster:
    """Penalties and the logit bias of the request in flight, in fixed device buffers: `counts` [V]
    (occurrences of each token among the generated ones, updated on the device), `bias` [V] and the
    two penalties. `start` loads a request's values in place, so graphs captured once serve every
    request."""

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.bias = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.penalties = torch.zeros(2, dtype=torch.float32, device=device)  # presence, frequency

    @property
    def vocab_size(self) -> int:
        return self.counts.numel()

    def start(self, params: SamplingParams) -> None:
        bad = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias names token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size}).")
        self.counts.zero_()
        bias = torch.zeros(self.vocab_size, dtype=torch.float32)
        for token, value in params.logit_bias:
            bias[token] = value
        self.bias.copy_(bias)
        self.penalties.copy_(torch.tensor([params.presence_penalty, params.frequency_penalty]))

    def apply(self, logits: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
        """logits [..., V] -> adjusted fp32 logits; `counts` [..., V] overrides the request's counts
        (positions of a draft chain or a verification window, which count the tokens before them)."""
        counts = self.counts if counts is None else counts
        presence, frequency = self.penalties[0], self.penalties[1]
        return logits.float() - frequency * counts - presence * (counts > 0).float() + self.bias

    def observe(self, tokens: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Count generated `tokens` [N] (each with its weight: 0 for positions that were not kept)."""
        tokens = tokens.reshape(-1)
        weights = torch.ones_like(tokens, dtype=torch.float32) if weights is None else weights.float()
        self.counts.index_add_(0, tokens, weights)

    def window_counts(self, tokens: torch.Tensor) -> torch.Tensor:
        """Counts at each position of a window that continues with `tokens` [S]: position i counts
        the request's tokens plus tokens[:i]. Returns [S + 1, V]."""
        steps = tokens.numel()
        onehot = torch.zeros(steps + 1, self.vocab_size, dtype=torch.float32, device=self.counts.device)
        onehot[1:].scatter_(1, tokens.reshape(-1, 1), 1.0)
        return self.counts + onehot.cumsum(0)


TOP_K_WITHOUT_SORT = 1024  # top-k up to this: the top-p cut walks the top-k list, not a sort of the vocabulary
_GPU_TOP_K: Callable | None = None  # solo.kernels.topk.top_k, once a GPU distribution is made (gpu_top_k)


def gpu_top_k() -> Callable:
    """The GPU's top-k cut (one launch for k up to 64: solo.kernels.topk), imported once; called before
    torch.compile traces `probabilities`, which then sees a plain global."""
    global _GPU_TOP_K
    if _GPU_TOP_K is None:
        from solo.kernels.topk import top_k

        _GPU_TOP_K = top_k
    return _GPU_TOP_K


def top_k_cut(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits.topk(k) (values descending, their columns): on a GPU through `gpu_top_k` (the same values;
    among equal logits the lower column first, where torch leaves the order unspecified)."""
    if logits.is_cuda:
        return gpu_top_k()(logits, k)
    return logits.topk(k, dim=-1)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from: softmax(logits / T) restricted to the top-k tokens and
    to the smallest set whose mass reaches top_p (always keeping the most likely token), renormalised.
    Greedy is the one-hot of the argmax. logits [..., V] -> probs [..., V] fp32.

    Decoding has a few rows of a long vocabulary, where torch's row-wise kernels (softmax, scans) run
    one block per row (on the H200 66 us for a softmax of 157K, 240 us for a scan of 4 x 157K): so the
    softmax is taken as elementwise ops and reductions, after a top-k cut from the top-k values."""
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    top = None
    if 0 < params.top_k < logits.shape[-1]:
        values, top = top_k_cut(logits, params.top_k)
        kept = logits >= values[..., -1:]
        weights = torch.exp(values - values[..., :1])
        # tokens tied with the k-th logit beyond the list are kept too: each weighs as the k-th
        ties = kept.sum(-1, keepdim=True) - params.top_k
        total = weights.sum(-1, keepdim=True) + ties * weights[..., -1:]
        probs = torch.where(kept, torch.exp(logits - values[..., :1]) / total, 0.0)
    else:
        weights = torch.exp(logits - logits.amax(-1, keepdim=True))
        probs = weights / weights.sum(-1, keepdim=True)
    if params.top_p < 1.0:
        if top is not None and params.top_k <= TOP_K_WITHOUT_SORT:
            drop = top_p_drop_within_top_k(probs, logits, top, params.top_p)
        else:
            drop = top_p_drop_by_sort(probs, params.top_p)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _own_copy(fn: Callable) -> Callable:
    """fn with a code object of its own: torch.compile caches and limits compilations per code object,
    so a CompiledDistribution's count of settings is exact whatever else compiled `probabilities`."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_compiled")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


class CompiledDistribution:
    """`probabilities` through torch.compile, for the NEXTN round on a GPU: Inductor fuses its ops over
    the vocabulary (scale, exp, compare, where, sums over 157K columns, for every draft step and the
    verification window) into a few kernels. On the H200 at full shape: the sampled round at the GSM8K
    setting 6.262 -> 5.909 ms at 32K (dev/round_ab.py). The results equal the eager function's to fp32
    rounding; the round draws its drafts and its targets from the same function, so acceptance stays
    lossless.

    The sampling setting (temperature, top-k, top-p) is specialised as constants, as the CUDA graph that
    captures the round specialises it too, so every setting (and logits shape) is a compilation of its
    own; compiled in the graph's warm-up runs, before capture. torch.compile keeps at most
    `torch._dynamo.config.recompile_limit` of them (per code object: this class compiles a copy of its
    own); settings past what that holds run the eager function (`eager_settings` counts them; the
    decoder's graph report shows it). Greedy rounds need no distribution and never come here."""

    SHAPES = 2  # logits shapes per setting: a draft step's [1, V] and the verification window's [S + 1, V]

    def __init__(self) -> None:
        import torch._dynamo

        if torch.cuda.is_available():  # imported before tracing: the compiled function calls an opaque op
            gpu_top_k()
        self._compiled = torch.compile(_own_copy(probabilities), dynamic=False)
        limit = getattr(torch._dynamo.config, "recompile_limit", None) or torch._dynamo.config.cache_size_limit
        self.most = max(1, int(limit) // self.SHAPES)
        self.settings: set[tuple[float, int, float]] = set()
        self.eager_settings: set[tuple[float, int, float]] = set()

    def __call__(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        key = (params.temperature, params.top_k, params.top_p)
        if params.greedy or key in self.eager_settings:
            return probabilities(logits, params)
        if key not in self.settings:
            if len(self.settings) >= self.most:
                log.warning(
                    "sampling setting %s: %d settings are compiled already (torch.compile's limit); its "
                    "NEXTN rounds run the eager distribution",
                    key,
                    len(self.settings),
                )
                self.eager_settings.add(key)
                return probabilities(logits, params)
            self.settings.add(key)
        return self._compiled(logits, params)


_GPU_DISTRIBUTION: CompiledDistribution | None = None


def distribution_for(device: torch.device | str) -> Callable[[torch.Tensor, SamplingParams], torch.Tensor]:
    """The distribution function the NEXTN round uses on `device`: compiled on a GPU, else `probabilities`
    (the CPU reference, where the tests check it against the oracles). One CompiledDistribution per
    process: every decoder shares it, so a sampling setting compiles once, not once per decoder."""
    global _GPU_DISTRIBUTION
    if torch.device(device).type != "cuda":
        return probabilities
    if _GPU_DISTRIBUTION is None:
        _GPU_DISTRIBUTION = CompiledDistribution()
    return _GPU_DISTRIBUTION


def top_p_drop_by_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Tokens outside the smallest set, in descending probability, whose mass reaches top_p: the mass
    before a token is at least top_p."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    return torch.zeros_like(mass_before, dtype=torch.bool).scatter_(-1, order, mass_before >= top_p)


def top_p_drop_within_top_k(probs: torch.Tensor, logits: torch.Tensor, top: torch.Tensor, top_p: float) -> torch.Tensor:
    """`top_p_drop_by_sort` after a top-k cut, without sorting the vocabulary: every token left has
    a logit at least the k-th, so the descending order is the top-k list `top` (logits.topk's
    indices, descending), then any tokens tied with the k-th logit that the list left out (kept by
    the cut, ranked here by index: among equal probabilities the sort's order is arbitrary too).
    Tokens the top-k cut removed (probability 0) are not marked."""
    ranked = probs.gather(-1, top)  # descending: the softmax keeps the logits' order
    drop = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, top, ranked.cumsum(-1) - ranked >= top_p)
    extra = logits == logits.gather(-1, top[..., -1:])
    extra.scatter_(-1, top, False)
    mass_before = ranked.sum(-1, keepdim=True) + exclusive_count(extra) * ranked[..., -1:]
    return drop | (extra & (mass_before >= top_p))


def exclusive_count(mask: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """For each position of mask [..., V] (bool), how many earlier positions of its row are set, as
    two short scans (within chunks of `chunk`, then over the chunks' totals) instead of one scan
    along each long row. Exact (integers)."""
    shape, width = mask.shape, mask.shape[-1]
    m = torch.nn.functional.pad(mask.reshape(-1, width).to(torch.int32), (0, -width % chunk))
    m = m.view(m.shape[0], -1, chunk)
    totals = m.sum(-1)
    before = (m.cumsum(-1) - m) + (totals.cumsum(-1) - totals)[..., None]
    return before.view(m.shape[0], -1)[:, :width].reshape(shape)


def argmax_last(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1), the same picks (ties to the lowest index, NaN first); on a GPU in one launch
    (solo.kernels.greedy) instead of torch's memset and reduction over the vocabulary."""
    if x.is_cuda and x.ndim >= 1 and x.numel() > 0:
        from solo.kernels.greedy import argmax_rows

        return argmax_rows(x.reshape(-1, x.shape[-1]).contiguous()).reshape(x.shape[:-1])
    return x.argmax(-1)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw from each row of probs [..., V] -> ids [...] (int64)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return argmax_last(probs / noise)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    if params.greedy:
        return argmax_last(logits)
    return sample_from(probabilities(logits, params), generator)


def logprob_distribution(logits: torch.Tensor, probs: torch.Tensor | None, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities reported for sampled tokens: those of the distribution sampled from (after
    penalties, bias, temperature, top-k and top-p; excluded tokens are -inf). Greedy decoding has no
    such distribution (it is one-hot), so it reports the adjusted logits' softmax at temperature 1."""
    if params.greedy or probs is None:
        return torch.log_softmax(logits.float(), dim=-1)
    return torch.log(probs)


def pack_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logprobs [N, V], chosen tokens [N] -> [N, 1 + 2 * LOGPROB_TOP] fp32: the chosen token's
    log-probability, then the LOGPROB_TOP largest values and their ids (as floats: exact below 2**24)."""
    chosen = logprobs.gather(-1, tokens.reshape(-1, 1))
    top = logprobs.topk(min(LOGPROB_TOP, logprobs.shape[-1]), dim=-1)
    return torch.cat([chosen, top.values, top.indices.float()], dim=-1)


def unpack_logprobs(row: list[float]) -> tuple[float, list[tuple[int, float]]]:
    """One packed row -> (the token's log-probability, [(id, log-probability)] most likely first;
    tokens the distribution excludes are left out)."""
    k = (len(row) - 1) // 2
    top = [(int(i), v) for v, i in zip(row[1 : 1 + k], row[1 + k :], strict=True) if math.isfinite(v)]
    return row[0], top


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return gen
