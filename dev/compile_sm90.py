"""Compile the MoE kernels (GEMV and grouped) for the H200 (sm_90) on a machine without a GPU.

    python dev/compile_sm90.py OUT_DIR

Triton's wheel carries ptxas and cuobjdump, so the PTX and SASS of the kernels at Ling-3.0-flash
shapes can be read (and compile errors found) before spending device time. The local Triton may be
newer than the device's (3.9 vs 3.6), so instruction counts are indicative, timings need the GPU.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from solo.kernels import triton_moe_grouped as grouped
from solo.kernels import triton_mxfp4_gemv as gemv
from solo.kernels.triton_moe import MoEConfig

H, I, TOPK = 2560, 768, 8


def _compile(fn, sig: dict[str, str], constexprs: dict, num_warps: int):
    # pointers 16-byte aligned, as Triton's JIT specializes them at launch (this enables 128-bit loads)
    attrs = {(i,): [["tt.divisibility", 16]] for i, ty in enumerate(sig.values()) if ty.startswith("*")}
    sig = {**sig, **{k: "constexpr" for k in constexprs}}
    src = ASTSource(fn, sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = MoEConfig()
    grouped_shape = dict(H=H, I=I, BLOCK_T=cfg.pf_block_t, BLOCK_K=cfg.pf_block_k, F16=cfg.pf_f16)
    kernels = {
        "gemv_gate_up_act": _compile(
            gemv._gemv_gate_up_act,
            {"xq_ptr": "*i32", "ids_ptr": "*i64", "w_ptr": "*i32", "s_ptr": "*u8", "act_ptr": "*bf16"}
            | {"stride_xq": "i32", "limit": "fp32"},
            dict(H=H, I=I, TOPK=TOPK, HAS_LIMIT=False, BLOCK_N=cfg.gv_gu_block_n, BLOCK_W=cfg.gv_gu_block_w, PDL=True),
            cfg.gv_gu_warps,
        ),
        **{
            f"gemv_down_combine{'_onto' if onto else ''}": _compile(
                gemv._gemv_down_combine,
                {"aq_ptr": "*i32", "ids_ptr": "*i64", "wt_ptr": "*fp32", "w_ptr": "*i32", "s_ptr": "*u8"}
                | {"o_ptr": "*bf16", "part_ptr": "*fp32", "cnt_ptr": "*i32", "stride_ot": "i32", "sh_ptr": "*bf16"},
                dict(
                    H=H,
                    I=I,
                    TOPK=TOPK,
                    BLOCK_N=cfg.gv_dn_block_n,
                    BLOCK_W=cfg.gv_dn_block_w,
                    SPLIT_E=cfg.gv_dn_split_e,
                    PDL=True,
                    EARLY_WEIGHTS=True,
                    ONTO=onto,  # (onto the residual stream with the shared expert's output: add_onto_residual)
                ),
                cfg.gv_dn_warps,
            )
            for onto in (False, True)
        },
        "grouped_gate_up_act": _compile(
            grouped._grouped_gate_up_act,
            {"x_ptr": "*bf16", "sorted_ptr": "*i32", "expert_ptr": "*i32", "npad_ptr": "*i32", "w_ptr": "*i32"}
            | {"s_ptr": "*u8", "act_ptr": "*bf16", "n_assign": "i32", "stride_xt": "i32", "limit": "fp32"},
            dict(**grouped_shape, TOPK=TOPK, HAS_LIMIT=False, BLOCK_I=cfg.pf_block_i),
            cfg.pf_warps,
        ),
        "grouped_down": _compile(
            grouped._grouped_down,
            {"act_ptr": "*bf16", "sorted_ptr": "*i32", "expert_ptr": "*i32", "npad_ptr": "*i32", "wt_ptr": "*fp32"}
            | {"w_ptr": "*i32", "s_ptr": "*u8", "y_ptr": "*fp32", "n_assign": "i32"},
            dict(**grouped_shape, BLOCK_H=cfg.pf_block_h),
            cfg.pf_warps,
        ),
    }
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    for name, kernel in kernels.items():
        (out / f"{name}.ptx").write_text(kernel.asm["ptx"])
        cubin = out / f"{name}.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True).stdout
        (out / f"{name}.sass").write_text(sass)
        print(f"{name}: {sass.count(chr(10))} SASS lines -> {out}/{name}.sass")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "asm_sm90")
