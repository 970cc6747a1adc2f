"""The decode step's fused GEMV (solo.kernels.fused_gemv) against the reference modules it replaces.

Every prologue (none, RMSNorm, gated norm), weight format (block-FP8, row-scaled FP8, BF16) and
epilogue (store, residual + addend, SwiGLU with clamp), for one token and for several, on the
CUDA-core path and the tensor-core path (`GemvConfig(dot=True)`), with and without split K. Under
Triton's CPU interpreter here (CI); on a GPU the same tests run the compiled kernels.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from solo.testing.interpreter import interpret_without_gpu

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton)", allow_module_level=True)
INTERPRET = interpret_without_gpu()
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="needs a GPU or Triton's CPU interpreter"
)

from solo.kernels.fused_gemv import FusedGemv, GemvConfig  # noqa: E402
from solo.kernels.moe import swiglu  # noqa: E402
from solo.model.layers import GatedRMSNorm, RMSNorm  # noqa: E402
from solo.quantization import formats  # noqa: E402

N, K, GROUP = 256, 384, 128
CONFIGS = {
    "cuda-cores": GemvConfig(block_n=32, block_k=128, split_k=1),
    "cuda-cores split-k": GemvConfig(block_n=16, block_k=64, split_k=2),
    "tensor-cores": GemvConfig(block_n=32, block_k=64, split_k=1, dot=True),
    "tensor-cores split-k": GemvConfig(block_n=64, block_k=128, split_k=2, dot=True),
}


def cases(token_counts: list[int], scale_kinds: tuple[str, ...] = ("block",)) -> list[tuple[str, int, str]]:
    """(configuration, tokens, weight format) combinations each path serves: the tensor-core path runs
    several tokens of FP8 weights (its refusal of BF16 is tested below)."""
    return [
        (name, t, kind)
        for name, cfg in CONFIGS.items()
        for t in token_counts
        for kind in scale_kinds
        if not cfg.dot or (t > 1 and kind != "none")
    ]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def weights(kind: str, rows: int):
    """(FusedGemv weight, its scales, the dequantized fp32 weight the reference multiplies by)."""
    w = torch.randn(rows, K) * 0.05
    if kind == "block":
        w8, scale = formats.quantize_fp8_block(w)
        return w8, scale, formats.dequantize_fp8_block(w8, scale)
    if kind == "row":
        w8, scale = formats.quantize_fp8_rowwise(w)
        return w8, scale, w8.float() * scale.float()[:, None]
    wb = w.to(torch.bfloat16)
    return wb, None, wb.float()


def project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.float() @ w.T).to(torch.bfloat16)


@pytest.mark.parametrize(("config", "tokens", "scale_kind"), cases([1, 3, 4], ("block", "row", "none")))
def test_norm_projection_and_residual(config, tokens, scale_kind):
    """RMSNorm -> projection -> residual + addend, as the reference layers compute it."""
    cfg = CONFIGS[config]
    w, scale, wf = weights(scale_kind, N)
    gemv = FusedGemv(w.to(DEVICE), None if scale is None else scale.to(DEVICE), scale_kind, name="test")
    gemv.set_config(tokens, cfg)
    x = (torch.randn(tokens, K) * 3).to(torch.bfloat16)
    norm = RMSNorm(K, 1e-6)
    norm.weight.data = (1 + 0.2 * torch.randn(K)).to(torch.bfloat16)
    residual = torch.randn(tokens, N).to(torch.bfloat16)
    addend = torch.randn(tokens, N).to(torch.bfloat16)
    want = residual + project(norm(x), wf) + addend
    xn = torch.empty(tokens, K, dtype=torch.bfloat16, device=DEVICE)
    got = gemv(
        x.to(DEVICE),
        norm_weight=norm.weight.data.to(DEVICE),
        eps=1e-6,
        residual=residual.to(DEVICE),
        addend=addend.to(DEVICE),
        xn_out=xn,
    ).cpu()
    assert rel(got - residual, want - residual) < 1e-2
    assert torch.equal(xn.cpu(), norm(x))  # the normalised x the router and experts read


@pytest.mark.parametrize(("config", "tokens", "_"), cases([1, 4]))
def test_gated_norm_projection(config, tokens, _):
    """The KDA output: per-head gated RMSNorm -> o_proj (the norm's group is the K chunk)."""
    cfg = CONFIGS[config]
    w, scale, wf = weights("block", N)
    gemv = FusedGemv(w.to(DEVICE), scale.to(DEVICE), "block", name="test")
    gemv.set_config(tokens, cfg)
    o = torch.randn(tokens, K).to(torch.bfloat16)
    gate = torch.randn(tokens, K).to(torch.bfloat16)
    norm = GatedRMSNorm(GROUP, 1e-6)
    norm.weight.data = (1 + 0.2 * torch.randn(GROUP)).to(torch.bfloat16)
    heads = K // GROUP
    normed = norm(o.view(tokens, heads, GROUP), gate.view(tokens, heads, GROUP)).view(tokens, K)
    want = project(normed, wf)
    got = gemv(o.to(DEVICE), norm_weight=norm.weight.data.to(DEVICE), gate=gate.to(DEVICE), eps=1e-6).cpu()
    assert rel(got, want) < 1e-2


@pytest.mark.parametrize(("config", "tokens", "_"), cases([1, 4]))
def test_swiglu_pair(config, tokens, _):
    """[gate; up] in one weight -> silu(gate) * up with the clamp (the shared expert, dense MLPs)."""
    cfg = CONFIGS[config]
    w, scale, wf = weights("block", 2 * N)
    gemv = FusedGemv(w.to(DEVICE), scale.to(DEVICE), "block", swiglu_half=N, swiglu_limit=0.3, name="test")
    gemv.set_config(tokens, cfg)
    x = (torch.randn(tokens, K) * 2).to(torch.bfloat16)
    want = swiglu(project(x, wf[:N]), project(x, wf[N:]), 0.3)
    got = gemv(x.to(DEVICE)).cpu()
    assert rel(got, want) < 2e-2


def test_tensor_core_and_cuda_core_paths_agree():
    """Both paths on the same several-token input: they differ only in summation order."""
    w, scale, _ = weights("block", N)
    x = torch.randn(4, K).to(torch.bfloat16).to(DEVICE)
    outs = []
    for name in ("cuda-cores", "tensor-cores"):
        gemv = FusedGemv(w.to(DEVICE), scale.to(DEVICE), "block", name="test")
        gemv.set_config(4, CONFIGS[name])
        outs.append(gemv(x).cpu())
    assert rel(outs[1], outs[0]) < 5e-3


def test_the_tensor_core_path_refuses_what_it_cannot_run():
    """Tiles across 128-wide scale blocks, and BF16 weights (fp16 operands would round them)."""
    x = torch.randn(4, K).to(torch.bfloat16).to(DEVICE)
    w, scale, _ = weights("block", N)
    gemv = FusedGemv(w.to(DEVICE), scale.to(DEVICE), "block", name="test")
    gemv.set_config(4, GemvConfig(block_n=32, block_k=256, dot=True))
    with pytest.raises(ValueError, match="tensor-core"):
        gemv(x)
    wb, _, _ = weights("none", N)
    dense = FusedGemv(wb.to(DEVICE), None, name="test")
    dense.set_config(4, GemvConfig(block_n=32, block_k=64, dot=True))
    with pytest.raises(ValueError, match="FP8 weights"):
        dense(x)
