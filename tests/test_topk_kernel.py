"""The sampling top-k cut in one launch (solo.kernels.topk) against torch: the values of torch.topk and,
among equal logits, the lower column first (a stable descending sort's order). Fresh random logits with
ties within and across chunks and -inf. Under Triton's CPU interpreter here (CI, with small chunks: its
sort is slow there); on a GPU the same tests run the compiled kernel at the vocabulary's real width.
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

from solo.kernels import topk  # noqa: E402

if not topk.AVAILABLE:
    pytest.skip("this Triton has no tl.topk", allow_module_level=True)

VOCAB = 5 * 512 + 77 if INTERPRET else 157184  # several chunks, the last one partial


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    if INTERPRET:
        monkeypatch.setattr(topk, "CHUNK", 512)


def stable_top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, columns = torch.sort(logits, dim=-1, descending=True, stable=True)
    return values[..., :k], columns[..., :k]


@pytest.mark.parametrize(("k", "group"), [(1, None), (29, None), (64, None), (29, 0), (29, 2), (64, 4)])
@pytest.mark.parametrize("rows", [1, 4])
def test_the_top_k_equals_torch(rows, k, group, monkeypatch):
    """The product's chunking (group None: topk.GROUP), each row merged by its own last program (group 0), or in
    two levels with other groups (6 chunks under the interpreter: groups of 2, of 4 with a partial last group, and
    the product's 8 as one partial group; on a GPU 154 chunks of 1,024, the last of 20 groups partial)."""
    if group is not None:
        monkeypatch.setattr(topk, "GROUP", group)
    logits = torch.randn(rows, VOCAB, device=DEVICE) * 2
    values, columns = topk.top_k_rows(logits, k)
    want = stable_top(logits, k)
    assert torch.equal(values, want[0]) and torch.equal(values, logits.topk(k).values)
    assert torch.equal(columns, want[1]) and columns.dtype == torch.int64
    # ties: a value inside the top k repeated in other chunks and in the same one, and the whole row of
    # one row at -inf but for a few columns
    for r in range(rows):
        tied = values[r, k // 2]
        spots = torch.randint(0, VOCAB, (4,))
        logits[r, spots] = tied
        column = int(columns[r, k // 2])
        logits[r, column + 1 if column + 1 < VOCAB else column - 1] = tied  # a neighbour (the odd vocabulary's last)
    logits[0, :] = -float("inf")
    logits[0, torch.randint(0, VOCAB, (3,))] = torch.randn(3, device=DEVICE)
    values, columns = topk.top_k_rows(logits, k)
    want = stable_top(logits, k)
    assert torch.equal(values, want[0]) and torch.equal(columns, want[1])
    assert all(int(t.sum()) == 0 for key, t in topk._SCRATCH.items() if key[1] == "count")  # left at zero


def test_the_launch_shapes():
    """CPU: the chunks, groups and merge widths the kernel is compiled for, and the refused chunkings."""
    c = topk.kernel_constexprs(4, 157184, 29, 4096, 8)
    assert (c["CHUNKS"], c["GROUPS"], c["K_POW2"], c["GROUP_POW2"], c["MERGE_POW2"]) == (39, 5, 32, 256, 256)
    c = topk.kernel_constexprs(1, 157184, 29, 2048, 0)
    assert (c["CHUNKS"], c["GROUPS"], c["MERGE_POW2"]) == (77, 1, 4096)
    for chunk, group in ((3000, 0), (4096, 3), (4096, -2), (1, 0)):
        with pytest.raises(ValueError, match="power of two"):
            topk.kernel_constexprs(1, 157184, 29, chunk, group)


def test_the_dispatch_and_the_refusals():
    logits = torch.randn(2, 3, VOCAB, device=DEVICE)
    values, columns = topk.top_k(logits, 8)  # any leading shape
    assert values.shape == (2, 3, 8) and torch.equal(values, logits.topk(8).values)
    with pytest.raises(ValueError, match="1 <= k <= 64"):
        topk.top_k_rows(logits[0], 65)
    with pytest.raises(ValueError, match="fp32"):
        topk.top_k_rows(logits[0].bfloat16(), 4)


def test_the_custom_op_under_torch_library_checks():
    """The op's registration (schema, fake tensors for torch.compile) holds: torch.library.opcheck."""
    logits = torch.randn(3, VOCAB, device=DEVICE)
    torch.library.opcheck(topk.top_k_rows, (logits, 5), test_utils=("test_schema", "test_faketensor"))
