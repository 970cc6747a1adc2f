"""Write the PTX (and SASS, where nvdisasm/cuobjdump exist) of the MoE kernels at Ling-3.0-flash shapes.

    python dev/kernel_asm.py OUT_DIR

For reading what Triton generated (instruction mix of the unpacking, vector widths of the loads).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from solo.bench.kernels import Shapes, random_experts, routing_sets
from solo.kernels.triton_moe import TritonMoE


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    s = Shapes()
    moe = TritonMoE(random_experts(s, torch.device("cuda")))
    x, ids, w = routing_sets(s, 1, 1, torch.device("cuda"))[0]
    moe.forward(x, ids, w)
    torch.cuda.synchronize()
    from solo.kernels import triton_mxfp4_gemv as g

    for kern in (g._gemv_gate_up_act, g._gemv_down_combine):
        for compiled in _compiled(kern):
            name = kern.fn.__name__
            (out / f"{name}.ptx").write_text(compiled.asm["ptx"])
            cubin = Path(tempfile.mkdtemp()) / f"{name}.cubin"
            cubin.write_bytes(compiled.asm["cubin"])
            tool = shutil.which("nvdisasm") or shutil.which("cuobjdump")
            if tool:
                args = [tool, "-c", str(cubin)] if tool.endswith("nvdisasm") else [tool, "-sass", str(cubin)]
                sass = subprocess.run(args, capture_output=True, text=True).stdout
                (out / f"{name}.sass").write_text(sass)
            print(name, "regs", getattr(compiled, "n_regs", "?"), "spills", getattr(compiled, "n_spills", "?"))


def _compiled(kern):
    cache = getattr(kern, "device_caches", None)
    if cache:
        for entry in cache.values():
            yield from entry[0].values()
    else:
        for entry in kern.cache.values():
            yield from entry.values()


if __name__ == "__main__":
    main(sys.argv[1])
