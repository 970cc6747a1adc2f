"""Where the GEMV MoE's time goes: timing-only variants and the PDL A/B (lent H200).

    python dev/gemv_variants.py variants [NAME,...]   # unpack / memory-only variants
    python dev/gemv_variants.py pdl                   # PDL on vs off, outputs bit-compared
    python dev/gemv_variants.py prof NAME             # run one variant at T=1 (for ncu)

A variant is the module solo.kernels.triton_mxfp4_gemv with one function body replaced, loaded as a
separate module and swapped into solo.kernels.triton_moe for the timing. Only ``base`` computes the
right values: the others measure what the kernel would cost with a cheaper unpack (``lop4``: one
mask per pair, a lower bound for any bit trick; ``*_nocvt``: no fp16 -> fp32 widening; ``old17``:
the 17-operation unpack of the checkpoint's nibble order used before the codes were repacked at
load, as a reference) or with no arithmetic at all
(``memonly``: loads of the codes, scales and activations, one multiply per word, the same group
reduction; ``memonly_flat``: without the group reduction). Numbers: docs/kernels-history.md.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import tempfile
from pathlib import Path

import torch

import solo.kernels.triton_moe as tm
from solo.bench.kernels import Shapes, Timer, random_experts, routing_sets

_SRC = Path(tm.__file__).with_name("triton_mxfp4_gemv.py").read_text()

_CVT = """
    lo = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (bits >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi
"""
_NOCVT = """
    f = bits.to(tl.float32, bitcast=True)
    return f, f
"""
_OLD17 = """
    if J == 3:
        bits = ((w >> 3) & 0x0E000E00) | (w & 0x80008000)
    else:
        bits = ((w << (9 - 4 * J)) & 0x0E000E00) | ((w << (12 - 4 * J)) & 0x80008000)
"""
_LOP4 = """
    bits = w & (0x8E008E00 >> J)
"""
PAIR_BODIES = {
    "old17": _OLD17 + _CVT,
    "lop4": _LOP4 + _CVT,
    "lop4_nocvt": _LOP4 + _NOCVT,
}

_MEM = """
    if MASKED:
        xq0 = tl.load(xq_ptrs, mask=x_mask, other=0).to(tl.uint32, bitcast=True)
    else:
        xq0 = tl.load(xq_ptrs).to(tl.uint32, bitcast=True)
    x0 = (xq0 << 16).to(tl.float32, bitcast=True)
    part = (w & 0x3F000000).to(tl.float32, bitcast=True) * x0[None, :]
"""
DOT_BODIES = {
    "memonly": _MEM + "    return tl.sum(tl.reshape(part, (BLOCK_N, BLOCK_W // 4, 4)), axis=2)\n",
    "memonly_flat": _MEM + "    return tl.sum(part, axis=1, keep_dims=True)\n",
}
NAMES = ("base", *PAIR_BODIES, *DOT_BODIES)


def _replace_body(src: str, func: str, body: str) -> str:
    pat = re.compile(rf'(def {func}\(.*?"""\n)(.*?)(\n\n@triton.jit)', re.S)
    out, n = pat.subn(lambda m: m.group(1) + body.strip("\n") + "\n" + m.group(3), src)
    if n != 1:
        raise RuntimeError(f"could not find the body of {func}")
    return out


def variant(name: str):
    """The GEMV kernel module with the named change (``base``: unchanged)."""
    src = _SRC
    if name in PAIR_BODIES:
        src = _replace_body(src, "_e2m1_pair", PAIR_BODIES[name])
    elif name in DOT_BODIES:
        src = _replace_body(src, "_words_dot", DOT_BODIES[name])
    elif name != "base":
        raise SystemExit(f"unknown variant {name}; choose from {', '.join(NAMES)}")
    path = Path(tempfile.mkdtemp()) / f"gemv_{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"gemv_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _use(mod) -> None:
    tm._gemv_gate_up_act = mod._gemv_gate_up_act
    tm._gemv_down_combine = mod._gemv_down_combine


def run_variants(names: list[str], dev: torch.device) -> None:
    s = Shapes()
    timer = Timer(dev, replays=30)
    moe = tm.TritonMoE(random_experts(s, dev), config=tm.MoEConfig(gv_pdl=False))
    moe.reserve(4, s.top_k)
    mods = {n: variant(n) for n in names}
    k = s.top_k
    for t in (1, 4):
        data = routing_sets(s, t, 24, dev)
        flat = [(x, ids.reshape(-1).contiguous(), w.reshape(-1).contiguous()) for x, ids, w in data]
        acts = [torch.empty((t * k, s.inter), dtype=torch.bfloat16, device=dev) for _ in data]
        outs = [torch.empty((t, s.hidden), dtype=torch.bfloat16, device=dev) for _ in data]
        for rep in range(2):
            for name, mod in mods.items():
                _use(mod)
                full = timer([lambda d=d: moe.forward(*d) for d in data])
                gu = timer(
                    [
                        lambda f=f, a=a: moe.launch_gemv_gate_up(f[0], f[1], a, k)
                        for f, a in zip(flat, acts, strict=True)
                    ]
                )
                dn = timer(
                    [
                        lambda f=f, a=a, o=o: moe.launch_gemv_down(a, f[1], f[2], o, k)
                        for f, a, o in zip(flat, acts, outs, strict=True)
                    ]
                )
                print(f"T={t} rep{rep} {name:12s} full {full:6.2f} us  gate_up {gu:6.2f}  down {dn:6.2f}", flush=True)


def run_pdl(dev: torch.device) -> None:
    s = Shapes()
    experts = random_experts(s, dev)
    timer = Timer(dev, replays=30)
    moes = {"pdl off": tm.TritonMoE(experts, config=tm.MoEConfig(gv_pdl=False)), "pdl on": tm.TritonMoE(experts)}
    for m in moes.values():
        m.reserve(4, s.top_k)
    for t in (1, 4):
        data = routing_sets(s, t, 24, dev)
        ref = None
        for rep in range(2):
            for name, m in moes.items():
                out = m.forward(*data[-1])
                ref = out.clone() if ref is None else ref
                us = timer([lambda d=d, m=m: m.forward(*d) for d in data])
                print(f"T={t} rep{rep} {name:8s} {us:6.2f} us  bit-identical {torch.equal(out, ref)}", flush=True)


def main(argv: list[str]) -> None:
    dev = torch.device("cuda")
    mode = argv[0] if argv else "variants"
    if mode == "variants":
        run_variants(argv[1].split(",") if len(argv) > 1 else list(NAMES), dev)
    elif mode == "pdl":
        run_pdl(dev)
    elif mode == "prof":
        s = Shapes()
        _use(variant(argv[1]))
        moe = tm.TritonMoE(random_experts(s, dev), config=tm.MoEConfig(gv_pdl=False))
        for x, ids, w in routing_sets(s, 1, 6, dev):
            moe.forward(x, ids, w)
        torch.cuda.synchronize()
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
