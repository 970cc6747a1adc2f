"""Registers, stack and blocks per SM of the decode step's CUDA GEMVs as the device builds them, without a GPU.

    pip download --no-deps "nvidia-cuda-nvrtc==13.0.*" -d /tmp/nvrtc && (cd /tmp/nvrtc && python3 -m zipfile -e *.whl .)
    python3 dev/nvrtc_resources.py --nvrtc /tmp/nvrtc/nvidia/cu13/lib [--defines '{"L2_FETCH": 256}' ...]

The product compiles `gemv_decode.cu` with NVRTC at run time (solo/kernels/cuda_runtime.py), and NVRTC's
front end does not emit the PTX that nvcc does for the same source (it addresses shared memory through
64-bit generic pointers where nvcc uses 32 bits), so ptxas allocates registers differently: nvcc 13.0
gives the KDA projections' kernel 72 registers and no stack, the device's NVRTC 13.0 80 registers and 16
bytes of spills, so 6 blocks an SM instead of 7. Register counts read from `nvcc --resource-usage` are
therefore not the device's. This compiles each of the step's one-token GEMV launches (Ling-3.0-flash
shapes, the product's warps and loads in flight as `dev/decode_launch_ab.py` prints them) with the same
NVRTC options as the product, reads the registers and the stack frame from the cubin's attributes, and
gives the blocks an SM the registers allow. `--defines` adds lab switches (one JSON object a column);
`--moe` also builds the persistent MoE kernel with its router (registers an SM left beside it: what a
successor under PDL would need to become resident while it runs).

`--sass FOLDER` also writes each column's MoE kernel (with `--moe`) as SASS, disassembled by `--nvdisasm` (an
nvidia-cuda-nvdisasm wheel's `bin/nvdisasm`: `pip download --no-deps "nvidia-cuda-nvdisasm==13.*"`), to read what the
device runs without a device: which barriers a path waits on, where a timer is read, how long a dependent chain is.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from solo.kernels import cuda_moe, cuda_runtime  # noqa: E402
from solo.kernels.cuda_moe_plan import DecodeKernelConfig, decode_schedule  # noqa: E402
from solo.kernels.cuda_step import GEMV_SOURCE  # noqa: E402

# name -> (rows, K, warps, NORM, GROUP, EPI, ADD, HAS_LIMIT): the step's one-token calls (decode_step.py)
LAUNCHES = {
    "qkvfgb": (20512, 2560, 4, 1, 0, 0, 0, 0),
    "o_proj": (2560, 4096, 16, 2, 128, 1, 0, 0),
    "q|kv_a|g": (6816, 2560, 4, 1, 0, 0, 0, 0),
    "dense": (2560, 4096, 16, 0, 0, 1, 0, 0),
    "shared gate_up": (768, 2560, 10, 0, 0, 2, 0, 1),
    "shared down": (2560, 768, 12, 0, 0, 1, 1, 0),
    "MLP gate_up": (6144, 2560, 4, 1, 0, 2, 0, 1),
    "MLP down": (2560, 6144, 16, 0, 0, 1, 0, 0),
}
REGISTERS_PER_SM, REGISTER_UNIT, MAX_WARPS = 65536, 256, 64
EIATTR_REGCOUNT, EIATTR_FRAME_SIZE = 0x2F, 0x11


def defines_for(name: str, extra: dict) -> dict:
    from solo.kernels.cuda_step import in_flight

    rows, k, warps, norm, group, epi, add, limit = LAUNCHES[name]
    base = dict(NTOK=1, K=k, ROWS=rows, NORM=norm, GROUP=group, SCALE=1, EPI=epi, ADD=add, HAS_LIMIT=limit)
    base.update(OUT_F32=0, WRITE_XN=0, WARPS=warps, PF=in_flight(k // 64 // warps, 8), ROTATE=0, SIGNAL=0)
    return {**base, "LATE_WAIT": 0, **extra}


def load_nvrtc(folder: str) -> None:
    """Point solo's NVRTC loader at a wheel's libraries (its builtins first: libnvrtc opens them by name)."""
    for lib in sorted(os.listdir(folder)):
        if lib.startswith("libnvrtc-builtins.so"):
            ctypes.CDLL(os.path.join(folder, lib), mode=ctypes.RTLD_GLOBAL)
            break
    main = next(lib for lib in sorted(os.listdir(folder)) if lib.startswith("libnvrtc.so"))
    cuda_runtime._nvrtc = ctypes.CDLL(os.path.join(folder, main))
    cuda_runtime._nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p


def attributes(cubin: bytes) -> dict[int, list[bytes]]:
    """The cubin's global .nv.info attributes of the size-prefixed format: code -> payloads."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    size, count, names = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * size) for i in range(count)]
    strings = sections[names][4]
    out: dict[int, list[bytes]] = {}
    for sec in sections:
        name = cubin[strings + sec[0] : cubin.index(b"\0", strings + sec[0])]
        if name != b".nv.info":
            continue
        at, end = sec[4], sec[4] + sec[5]
        while at < end:
            fmt, code = cubin[at], cubin[at + 1]
            if fmt == 4:  # EIFMT_SVAL: a 16-bit size, then the payload
                length = struct.unpack_from("<H", cubin, at + 2)[0]
                out.setdefault(code, []).append(cubin[at + 4 : at + 4 + length])
                at += 4 + length
            else:
                at += 4 if fmt == 3 else 2
    return out


def built(source: Path, name: str, defines: dict) -> tuple[int, int, int]:
    """(registers a thread, stack frame bytes, registers a warp as allocated) of kernel `name` for sm_90,
    its includes inlined as the product does."""
    cubin = cuda_runtime.compile_cubin(cuda_runtime.expand_includes(source), name, defines, "sm_90")
    attrs = attributes(cubin)
    regs = struct.unpack_from("<I", attrs[EIATTR_REGCOUNT][0], 4)[0]
    frame = max((struct.unpack_from("<I", p, 4)[0] for p in attrs.get(EIATTR_FRAME_SIZE, [])), default=0)
    return regs, frame, -(-regs * 32 // REGISTER_UNIT) * REGISTER_UNIT


def resources(defines: dict) -> tuple[int, int, int]:
    """(registers, stack frame bytes, blocks an SM the registers allow) of gemv_decode for sm_90."""
    regs, frame, per_warp = built(GEMV_SOURCE, "gemv_decode", defines)
    return regs, frame, min(REGISTERS_PER_SM // per_warp, MAX_WARPS) // defines["WARPS"]


def moe_defines(extra: dict, blocks: int = 132) -> dict:
    """The persistent MoE kernel with its router at Ling-3.0-flash shapes (cuda_moe.PersistentDecodeMoE's
    defines for the product's DecodeKernelConfig; 512 experts in 8 groups keep 4, top-8, clamped SwiGLU)."""
    kc = DecodeKernelConfig()
    sched = decode_schedule(blocks, 2560, 768, 8, kc.order)
    base = dict(H=2560, I=768, TOPK=8, NBLOCKS=blocks, MAX_GU=sched.max_gate_up, MAX_DN=sched.max_down, HAS_LIMIT=1)
    router = cuda_moe.RouterSpec(experts=512, groups=8, keep=4, renormalize=True, blocks=blocks)
    return {**base, "ID64": 0, **kc.defines(), **router.defines(), **extra}


def moe_sass(defines: dict, nvdisasm: str, out: Path) -> None:
    """The MoE kernel built with `defines`, disassembled into `out` (nvdisasm -c: code only)."""
    import subprocess
    import tempfile

    cubin = cuda_runtime.compile_cubin(cuda_runtime.expand_includes(cuda_moe.SOURCE), "moe_decode", defines, "sm_90")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out.write_text(subprocess.run([nvdisasm, "-c", f.name], check=True, capture_output=True, text=True).stdout)


def moe_resources(defines: dict) -> tuple[int, int, int]:
    """(registers, stack frame bytes, registers an SM left beside one block) of moe_decode for sm_90."""
    regs, frame, per_warp = built(cuda_moe.SOURCE, "moe_decode", defines)
    warps = defines["H"] // 128 + defines["I"] // 128 + 2 + defines["TRACE"]  # moe_decode.cu NWARPS
    return regs, frame, REGISTERS_PER_SM - warps * per_warp


def sweep(name: str) -> int:
    """Registers, stack and blocks an SM of one launch over warps x loads in flight x MIN_BLOCKS, with the bytes
    in flight an SM that gives (blocks x warps x PF x 512: one 16-byte load a lane, gate rows only): where the
    register path's stream could hold more than the product's without spilling (twenty-second session: nowhere)."""
    from solo.kernels.cuda_step import in_flight

    k = LAUNCHES[name][1]
    print(f"NVRTC {'.'.join(map(str, cuda_runtime.nvrtc_version()))}, sm_90, {name}: warps x PF x MIN_BLOCKS")
    seen = set()
    for warps in (4, 5, 8, 10):
        for most in (2, 4, 5, 8, 10):
            pf = in_flight(k // 64 // warps, most)
            if (warps, pf) in seen:
                continue
            seen.add((warps, pf))
            for min_blocks in (0, 5, 6, 7, 8):
                extra = {"WARPS": warps, "PF": pf, **({"MIN_BLOCKS": min_blocks} if min_blocks else {})}
                regs, frame, blocks = resources(defines_for(name, extra))
                kb = blocks * warps * pf * 512 / 1024
                print(
                    f"warps {warps:2d} PF {pf:2d} MIN_BLOCKS {min_blocks}: registers {regs} stack {frame} "
                    f"blocks {blocks} in flight {kb:.0f} KB an SM",
                    flush=True,
                )
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nvrtc", required=True, help="folder holding libnvrtc.so.* (an nvidia-cuda-nvrtc wheel's lib)")
    p.add_argument("--defines", nargs="*", default=[], help="JSON objects of extra defines, one column each")
    p.add_argument("--launches", default=",".join(LAUNCHES))
    p.add_argument("--moe", action="store_true", help="also the persistent MoE kernel (moe_decode.cu) with its router")
    p.add_argument("--sweep", metavar="LAUNCH", help="instead: LAUNCH's warps x loads in flight x MIN_BLOCKS grid")
    p.add_argument("--sass", metavar="FOLDER", help="with --moe: also each column's MoE kernel as SASS, moe_<n>.sass")
    p.add_argument("--nvdisasm", default="nvdisasm", help="the nvdisasm to disassemble with (--sass)")
    args = p.parse_args()
    load_nvrtc(args.nvrtc)
    if args.sweep:
        return sweep(args.sweep)
    columns = [{}] + [json.loads(d) for d in args.defines]
    print(f"NVRTC {'.'.join(map(str, cuda_runtime.nvrtc_version()))}, sm_90: registers / stack bytes / blocks an SM")
    if args.moe:
        print("the MoE kernel with its router (registers / stack bytes / registers an SM left beside it):")
        for n, extra in enumerate(columns):
            regs, frame, left = moe_resources(moe_defines(extra))
            print(f"  {json.dumps(extra) if extra else 'product':>30s}  {regs} / {frame} / {left}")
            if args.sass:
                Path(args.sass).mkdir(parents=True, exist_ok=True)
                moe_sass(moe_defines(extra), args.nvdisasm, Path(args.sass) / f"moe_{n}.sass")
                print(f"  {'':>30s}  SASS in {Path(args.sass) / f'moe_{n}.sass'}")
    print(f"{'launch':16s}" + "".join(f"  {json.dumps(c) if c else 'product':>30s}" for c in columns))
    for name in args.launches.split(","):
        cells = []
        for extra in columns:
            try:
                regs, frame, blocks = resources(defines_for(name, extra))
                cells.append(f"{regs} / {frame} / {blocks}")
            except RuntimeError as exc:  # a define the source refuses (its #error) is reported, not fatal
                cells.append(str(exc).splitlines()[-1][:30])
        print(f"{name:16s}" + "".join(f"  {c:>30s}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
