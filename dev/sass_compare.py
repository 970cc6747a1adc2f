"""The decode step's CUDA kernels as SASS, written to a folder and compared with an earlier run's, without a GPU.

    python3 dev/sass_compare.py --nvrtc /tmp/nvrtc/nvidia/cu13/lib --nvdisasm /tmp/nvdis/nvidia/cu13/bin/nvdisasm \
        --out /tmp/sass_after --against /tmp/sass_before

(the wheels as `dev/nvrtc_resources.py` says: nvidia-cuda-nvrtc 13.0 and nvidia-cuda-nvdisasm). For a change to the
CUDA sources that should not change what runs (a clean-up: a helper in step_common.cuh for code two kernels repeated),
run it once on the tree before the change and once after: each variant's SASS is the same, the same but for register
numbers (instructions, operands and order equal once every R<n> is read as one register), or different, with the
count of differing lines. Built with the product's NVRTC options for sm_90 at Ling-3.0-flash shapes: the persistent MoE
kernel with its router (dev/nvrtc_resources.moe_defines: the product's DecodeKernelConfig, fast_select and lean_select
off, traced), the verification router (router_decode.cu at 1 and 4 tokens, the same switches), the step's one-token
GEMV launches (dev/nvrtc_resources.LAUNCHES) and the fused KDA front (the H100's build, with and without a lazy state).
`--only PREFIX` builds the names that start with it (e.g. `moe`, `router`, `gemv`, `kda_front`).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import nvrtc_resources  # noqa: E402

from solo.kernels import cuda_moe, cuda_runtime  # noqa: E402
from solo.kernels.cuda_kda import KDA_FRONT_SOURCE, SPLIT  # noqa: E402
from solo.kernels.cuda_step import GEMV_SOURCE, ROUTER_SOURCE  # noqa: E402

MOE_VARIANTS = {
    "product": {},
    "no_fast_select": {"FAST_SELECT": 0},
    "no_lean_select": {"LEAN_SELECT": 0},
    "trace": {"TRACE": 1},
}
ROUTER_VARIANTS = {"product": {}, "no_fast_select": {"FAST_SELECT": 0}, "no_lean_select": {"LEAN_SELECT": 0}}
ROUTER = dict(H=2560, E=512, GROUPS=8, KEEP=4, TOPK=8, RENORM=1, WARPS=16, EPW=1, FAST_SELECT=1, LEAN_SELECT=1)
# the fused KDA front as the H100's product builds it (decode_step.KDA_FRONT_BUILD: 1 task ahead, global exchange, a
# ring of 3 task slots, the g rows last; cuda_kda.CudaKdaFront._kernel's defines)
KDA_FRONT = dict(
    K=2560, H=32, DK=128, SPLIT=SPLIT, WARPS=10, TA=1, SAFE_GATE=1, MIN_BLOCKS=1, L2A=0, XCHG=1, RING=3, GLAST=1, L2O=0
)
REGISTER = re.compile(r"\bR\d+\b")


def disassemble(source: Path, name: str, defines: dict, nvdisasm: str) -> str:
    cubin = cuda_runtime.compile_cubin(cuda_runtime.expand_includes(source), name, defines, "sm_90")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], check=True, capture_output=True, text=True).stdout


def builds() -> dict[str, tuple[Path, str, dict]]:
    out = {f"moe_{n}": (cuda_moe.SOURCE, "moe_decode", nvrtc_resources.moe_defines(e)) for n, e in MOE_VARIANTS.items()}
    for tokens in (1, 4):
        for n, extra in ROUTER_VARIANTS.items():
            out[f"router{tokens}_{n}"] = (ROUTER_SOURCE, "router_decode", {**ROUTER, "NTOK": tokens, **extra})
    for launch in nvrtc_resources.LAUNCHES:
        name = "gemv_" + re.sub(r"\W+", "_", launch)
        out[name] = (GEMV_SOURCE, "gemv_decode", nvrtc_resources.defines_for(launch, {}))
    for lazy in (0, 1):
        out[f"kda_front{'_lazy' if lazy else ''}"] = (KDA_FRONT_SOURCE, "kda_front", {**KDA_FRONT, "LAZY": lazy})
    return out


def compare(before: str, after: str) -> str:
    if before == after:
        return "same"
    a, b = before.splitlines(), after.splitlines()
    if len(a) == len(b) and all(REGISTER.sub("R", x) == REGISTER.sub("R", y) for x, y in zip(a, b, strict=True)):
        return "same but for register numbers"
    return f"DIFFERENT ({sum(x != y for x, y in zip(a, b, strict=True)) + abs(len(a) - len(b))} of {len(a)} lines)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nvrtc", required=True, help="folder holding libnvrtc.so.* (an nvidia-cuda-nvrtc wheel's lib)")
    p.add_argument("--nvdisasm", default="nvdisasm", help="an nvidia-cuda-nvdisasm wheel's bin/nvdisasm")
    p.add_argument("--out", required=True, help="folder for <build>.sass")
    p.add_argument("--against", help="a folder of an earlier run: compare each build with it")
    p.add_argument("--only", default="", help="build only the names that start with this")
    args = p.parse_args()
    nvrtc_resources.load_nvrtc(args.nvrtc)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    different = 0
    for name, (source, kernel, defines) in builds().items():
        if not name.startswith(args.only):
            continue
        sass = disassemble(source, kernel, defines, args.nvdisasm)
        (out / f"{name}.sass").write_text(sass)
        verdict = ""
        if args.against:
            earlier = Path(args.against) / f"{name}.sass"
            verdict = compare(earlier.read_text(), sass) if earlier.exists() else "(not in --against)"
            different += verdict.startswith("DIFFERENT")
        print(f"{name:26s} {len(sass.splitlines()):6d} lines  {verdict}", flush=True)
    return 1 if different else 0


if __name__ == "__main__":
    sys.exit(main())
