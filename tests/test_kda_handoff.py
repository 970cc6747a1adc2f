"""The KDA kernel's hand-off wait (solo.kernels.fused_kda, `handoff`): with the projection's signals
counted, it computes what it computes after a plain wait, bit for bit, and leaves both counters zero for
the next layer's hand-off. Fresh random inputs; under Triton's CPU interpreter here (CI), compiled on a
GPU (where the head's value splits run as programs of their own and the last of all zeroes the counters).
The GEMV side (gemv_decode.cu SIGNAL) is tested on the GPU (tests/test_gpu_cuda_step.py), its task order
on the CPU (tests/test_cuda_step_plan.py)."""

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

from solo.kernels.fused_kda import kda_decode  # noqa: E402

H, DK = 4, 32
D = H * DK


def fresh_inputs(tokens: int, history: bool) -> dict:
    g = torch.Generator().manual_seed(torch.seed() % 2**31)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE)

    inputs = dict(
        proj=rand(tokens, 5 * D + H).to(torch.bfloat16),
        conv_weight=rand(3 * D, 4, scale=0.5),
        conv_state=rand(3 * D, 3),
        state=rand(H, DK, DK, scale=0.1),
        a_log=rand(H, scale=0.5),
        dt_bias=rand(D, scale=0.5),
    )
    if history:
        inputs["history_states"] = torch.zeros(tokens, H, DK, DK, device=DEVICE)
        inputs["history_window"] = torch.zeros(3 * D, 3 + tokens, device=DEVICE)
    return inputs


def run(inputs: dict, handoff=None) -> dict:
    mine = {k: v.clone() for k, v in inputs.items()}
    out = torch.empty(mine["proj"].shape[0], D, dtype=torch.bfloat16, device=DEVICE)
    kda_decode(
        mine["proj"],
        mine["conv_weight"],
        mine["conv_state"],
        mine["state"],
        mine["a_log"],
        mine["dt_bias"],
        out,
        torch.zeros(1, dtype=torch.int32, device=DEVICE),
        -5.0,
        True,
        mine.get("history_states"),
        mine.get("history_window"),
        torch.zeros(H, dtype=torch.int32, device=DEVICE),
        handoff=handoff,
    )
    return {"out": out, **mine}


@pytest.mark.parametrize(("tokens", "history"), [(1, False), (4, True)])
@pytest.mark.parametrize("signals", [1, 792])
def test_after_the_handoff_the_kernel_computes_what_it_computes_after_a_plain_wait(tokens, history, signals):
    inputs = fresh_inputs(tokens, history)
    plain = run(inputs)
    counters = torch.tensor([signals, 0], dtype=torch.int32, device=DEVICE)  # every block has signalled
    handed = run(inputs, handoff=(counters, signals))
    for name, want in plain.items():
        assert torch.equal(handed[name], want), name
    assert counters.tolist() == [0, 0], "the last program past the wait zeroes both counters"
    assert plain["out"].float().abs().sum() > 0


@pytest.mark.parametrize(
    ("counters", "signals"),
    [
        (torch.zeros(2, dtype=torch.int64), 3),
        (torch.zeros(1, dtype=torch.int32), 3),
        (torch.zeros(2, dtype=torch.int32), 0),
    ],
)
def test_a_handoff_without_counters_or_signals_is_refused(counters, signals):
    with pytest.raises(ValueError, match="hand-off needs two zeroed int32 counters"):
        run(fresh_inputs(1, False), handoff=(counters.to(DEVICE), signals))
