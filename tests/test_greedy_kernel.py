"""Greedy decoding's one-launch picks (solo.kernels.greedy) against torch.argmax and the reference
greedy acceptance (solo.speculative.acceptance.accept_greedy): fresh random logits at the vocabulary's
real width, with ties across and within chunks, all -inf rows and NaNs. Under Triton's CPU interpreter
here (CI); on a GPU the same tests run the compiled kernel.
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

from solo.kernels import greedy  # noqa: E402
from solo.speculative.acceptance import accept_greedy  # noqa: E402

VOCAB = 157184  # Ling-3.0-flash's: 39 chunks, the last one partial


def fresh_logits(rows: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(rows, VOCAB, device=DEVICE) * 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4])
def test_argmax_rows_equals_torch(rows, dtype):
    logits = fresh_logits(rows, dtype)
    assert torch.equal(greedy.argmax_rows(logits), logits.argmax(-1))
    # ties: the top value again at a later and at an earlier position, in other chunks and in the same one
    top = logits.max(-1).values
    for r in range(rows):
        first = int(torch.randint(greedy.CHUNK, VOCAB - greedy.CHUNK, ()))
        logits[r, first + int(torch.randint(1, greedy.CHUNK, ()))] = top[r]
        logits[r, first] = top[r]
        logits[r, int(torch.randint(VOCAB - 100, VOCAB, ()))] = top[r]
    want = logits.argmax(-1)
    assert torch.equal(greedy.argmax_rows(logits), want)
    logits[0] = -float("inf")  # a row of -inf: index 0, as torch.argmax says
    logits[-1, int(torch.randint(0, VOCAB, ()))] = float("nan")  # a NaN beats every number
    assert torch.equal(greedy.argmax_rows(logits), logits.argmax(-1))
    if rows > 1:
        nan_at = sorted(int(i) for i in torch.randint(0, VOCAB, (3,)))
        logits[1, nan_at] = float("nan")  # several NaNs: the lowest index
        assert int(greedy.argmax_rows(logits)[1]) == nan_at[0] == int(logits.argmax(-1)[1])


def test_the_counter_is_left_at_zero_for_the_next_launch():
    for _ in range(3):  # (a graph replay needs no memset)
        logits = fresh_logits(2)
        assert torch.equal(greedy.argmax_rows(logits), logits.argmax(-1))
    assert all(int(t.sum()) == 0 for key, t in greedy._SCRATCH.items() if key[1] == "count")


@pytest.mark.parametrize("matches", [0, 1, 2, 3])
def test_greedy_accept_equals_the_reference(matches):
    """Drafts that match the target's argmax for a leading run of `matches`, then one that does not
    (when any are left): the same accepted count and next token as accept_greedy's torch ops."""
    logits = fresh_logits(4)
    target = logits.argmax(-1)
    drafts = target[:3].clone()
    if matches < 3:
        drafts[matches] = (target[matches] + 1 + torch.randint(0, VOCAB - 1, ())) % VOCAB
        drafts[matches + 1 :] = target[matches + 1 : 3]  # later matches do not count after a miss
    accepted, following = greedy.greedy_accept(logits, drafts)
    want = accept_greedy(logits.cpu(), drafts.cpu())  # torch's ops (on a GPU it would call the kernel)
    assert int(accepted) == matches == int(want[0]) and int(following) == int(want[1]) == int(target[matches])
    assert accepted.shape == want[0].shape and following.shape == want[1].shape
    with pytest.raises(ValueError, match=r"drafts must be int64 \[3\]"):
        greedy.greedy_accept(logits, drafts[:2])
