"""Compile every kernel variant of the fused decode step (Triton, Gluon) for sm_90 on a machine without a GPU.

    python dev/compile_fused_sm90.py [OUT_DIR]

Triton's compiler front end checks what its CPU interpreter does not (matching types across runtime
branches, shared memory per block, dot shapes), and its wheel carries ptxas, so compile errors and
resource use at Ling-3.0-flash shapes are found here instead of on the lent GPU. Prints one line per
variant: registers, spills, shared memory. The local Triton (3.9) may be newer than the device's (3.6).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from solo.kernels import fused_gemv as g
from solo.kernels import fused_kda as kda
from solo.kernels import fused_mla as mla
from solo.kernels import fused_router as router
from solo.kernels import greedy, topk

FLOATS = {"eps", "limit", "scale", "amplitude", "lower_bound", "scaling"}
SMEM_LIMIT = 232448  # per block on the H100/H200


def jit_of(fn):
    """The JITFunction under a (possibly wrapped) Triton kernel."""
    return fn.fn if hasattr(fn, "fn") and not hasattr(fn, "arg_names") else fn


def takes_pdl(fn) -> bool:
    return any(param.name == "PDL" for param in jit_of(fn).params)


def compile_variant(
    fn, pointers: dict[str, str], constexprs: dict, num_warps: int = 4, num_stages: int = 3, pdl: bool = False
):
    """Compile `fn` with pointer element types `pointers` (name -> 'bf16', 'fp32', ...) and the given
    constexprs; other scalar arguments are i32, or fp32 for the names in FLOATS. `pdl`: the kernel's
    PDL constexpr and Triton's launch_pdl option (solo.kernels.pdl)."""
    jit = jit_of(fn)
    if takes_pdl(fn):
        constexprs = {**constexprs, "PDL": pdl}
    if any(param.name == "PREFETCH" for param in jit.params):  # the weight prefetch comes with PDL in the step
        constexprs["PREFETCH"] = 32 * num_warps if pdl else 0  # (the router's; solo.kernels.prefetch)
    sig: dict[str, str] = {}
    for param in jit.params:
        name = param.name
        if param.is_constexpr:
            if name not in constexprs and param.default is not param.default.__class__:  # declared defaults
                constexprs[name] = param.default
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = "*" + pointers[name]
        elif name.endswith("_ptr"):
            raise KeyError(f"{jit.__name__}: no element type for pointer {name}")
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, ty in enumerate(sig.values()) if ty.startswith("*")}
    src = ASTSource(jit, sig, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages, **({"launch_pdl": True} if pdl else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


GEMV_PTRS = dict(
    x_ptr="bf16",
    nw_ptr="bf16",
    gate_ptr="bf16",
    w_ptr="fp8e4nv",
    s_ptr="fp32",
    o_ptr="bf16",
    r_ptr="bf16",
    a_ptr="bf16",
    xn_ptr="bf16",
    part_ptr="fp32",
    cnt_ptr="i32",
    count_ptr="i32",
)


def gemv_variants():
    """(name, kernel, pointer types, constexprs, warps): every projection of a Ling-3.0-flash layer."""
    h, kda_dim, inter, shared, vocab = 2560, 4096, 6144, 768, 157184
    shapes = [  # name, N, K, HALF, NORM, EPI, ADD, HAS_LIMIT, weight dtype, scale mode, out dtype
        ("kda_qkvfgb", 5 * kda_dim + 32, h, 0, 1, 0, False, False, "fp8e4nv", 1, "bf16"),
        ("kda_o_proj", h, kda_dim, 0, 2, 1, False, False, "fp8e4nv", 1, "bf16"),
        ("mla_q_kva_g", 6144 + 640 + 32, h, 0, 1, 0, False, False, "fp8e4nv", 1, "bf16"),
        ("mla_dense", h, kda_dim, 0, 0, 1, False, False, "fp8e4nv", 1, "bf16"),
        ("mlp_gate_up", 2 * inter, h, inter, 1, 2, False, False, "fp8e4nv", 1, "bf16"),
        ("mlp_down", h, inter, 0, 0, 1, False, False, "fp8e4nv", 1, "bf16"),
        ("shared_gate_up", 2 * shared, h, shared, 0, 2, False, True, "fp8e4nv", 1, "bf16"),
        ("shared_down_fp8", h, shared, 0, 0, 1, True, False, "fp8e4nv", 1, "bf16"),
        ("shared_down_bf16", h, shared, 0, 0, 1, True, False, "bf16", 0, "bf16"),
        ("eh_proj", h, 2 * h, 0, 0, 0, False, False, "fp8e4nv", 1, "bf16"),
    ]
    for tokens in (1, 4):
        for name, n, k, half, norm, epi, add, limit, wdt, scale, odt in shapes:
            rows = half or n
            cfg = g.choose_config(rows, k, tokens, fp8=bool(scale))  # the rule (the tuned table needs the GPU)
            dot = cfg.dot
            block_k = 128 if norm == g.NORM_GATED else cfg.block_k
            ptrs = dict(GEMV_PTRS, w_ptr=wdt, o_ptr=odt)
            constexprs = dict(
                T=tokens,
                N=n,
                K=k,
                HALF=half,
                BLOCK_T=16 if dot else triton.next_power_of_2(tokens),
                BLOCK_N=cfg.block_n,
                BLOCK_K=block_k,
                SPLIT_K=cfg.split_k,
                NORM=norm,
                SCALE=scale,
                EPI=epi,
                ADD=add,
                HAS_LIMIT=limit,
                WRITE_XN=False,
                K_POW2=triton.next_power_of_2(k),
                DOT=dot,
            )
            yield f"gemv {name} T={tokens} {cfg}", g._fused_gemv, ptrs, constexprs, cfg.num_warps, cfg.num_stages

    ptrs = dict(GEMV_PTRS, w_ptr="fp8e4nv", s_ptr="fp32", o_ptr="fp32")
    cfg = g.choose_config(vocab, h, 1)
    yield (
        f"gemv lm_head rowwise {cfg}",
        g._fused_gemv,
        ptrs,
        dict(
            T=1,
            N=vocab,
            K=h,
            HALF=0,
            BLOCK_T=1,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            SPLIT_K=cfg.split_k,
            NORM=0,
            SCALE=2,
            EPI=0,
            ADD=False,
            HAS_LIMIT=False,
            WRITE_XN=False,
            K_POW2=4096,
            DOT=False,
        ),
        cfg.num_warps,
        cfg.num_stages,
    )


def other_variants():
    kda_ptrs = dict(
        proj_ptr="bf16",
        convw_ptr="fp32",
        conv_ptr="fp32",
        state_ptr="fp32",
        hist_state_ptr="fp32",
        hist_win_ptr="fp32",
        alog_ptr="fp32",
        dtb_ptr="fp32",
        o_ptr="bf16",
        count_ptr="i32",
        sync_ptr="i32",
        source_ptr="i32",
        handoff_ptr="i32",
        l2_ptr="fp8e4nv",
    )
    kda_cases = (
        (1, False, False, False),
        (4, True, False, False),
        (1, True, False, False),
        (1, False, True, False),
        (4, True, True, False),
        (1, False, False, True),
        (1, False, True, True),
        (4, True, True, True),
    )
    for tokens, history, lazy, handoff in kda_cases:
        constexprs = dict(
            T=tokens, H=32, DK=128, NV=kda.VALUE_SPLITS, SAFE_GATE=True, HISTORY=history, LAZY=lazy, HANDOFF=handoff
        )
        for l2_share in (0, 81920) if tokens == 1 and not history else (0,):  # (kda_decode's l2_ahead: o_proj)
            name = f"kda T={tokens} history={history} lazy={lazy} handoff={handoff}" + (" l2" if l2_share else "")
            yield name, kda._kda_decode, kda_ptrs, {**constexprs, "L2_SHARE": l2_share}, kda.value_warps(tokens), 3
    for tokens, history in ((1, False), (4, True)):  # (lab: programs of one or two warps, VALUE_WARPS / WINDOW_WARPS)
        for splits, warps in ((16, 1), (8, 1), (8, 2)):
            constexprs = dict(T=tokens, H=32, DK=128, NV=splits, SAFE_GATE=True, HISTORY=history, LAZY=True)
            name = f"kda T={tokens} lazy, {splits} splits of {warps} warps"
            yield name, kda._kda_decode, kda_ptrs, {**constexprs, "HANDOFF": False, "L2_SHARE": 0}, warps, 3
    vocab_chunks = triton.cdiv(157184, greedy.CHUNK)
    greedy_ptrs = dict(
        logits_ptr="fp32",
        value_ptr="fp32",
        index_ptr="i32",
        count_ptr="i32",
        out_ptr="i64",
        drafts_ptr="i64",
        accepted_ptr="i64",
        next_ptr="i64",
    )
    for rows, accept in ((1, False), (4, True)):
        constexprs = dict(
            ROWS=rows,
            CHUNKS=vocab_chunks,
            CHUNK_SIZE=greedy.CHUNK,
            CHUNKS_POW2=triton.next_power_of_2(vocab_chunks),
            ROWS_POW2=triton.next_power_of_2(rows),
            ACCEPT=accept,
        )
        yield f"greedy rows={rows} accept={accept}", greedy._greedy_kernel, greedy_ptrs, constexprs, 8, 3
    topk_ptrs = dict(x_ptr="fp32", key_ptr="i64", count_ptr="i32", value_ptr="fp32", index_ptr="i64")
    for rows, k in ((1, 29), (4, 29), (4, 64)):
        constexprs = topk.kernel_constexprs(rows, 157184, k, topk.CHUNK, topk.GROUP)
        yield f"top_k rows={rows} k={k}", topk._top_k_kernel, topk_ptrs, constexprs, 8, 3
    prep_ptrs = dict(
        proj_ptr="bf16",
        pos_ptr="i64",
        wuk_ptr="bf16",
        kvnorm_ptr="bf16",
        invf_ptr="fp32",
        latent_ptr="bf16",
        rope_ptr="bf16",
        q_ptr="bf16",
        count_ptr="i32",
        handoff_ptr="i32",
    )
    attend_ptrs = dict(
        q_ptr="bf16", pos_ptr="i64", latent_ptr="bf16", rope_ptr="bf16", part_ptr="fp32", ml_ptr="fp32", count_ptr="i32"
    )
    combine_ptrs = dict(
        part_ptr="fp32", ml_ptr="fp32", pos_ptr="i64", wuv_ptr="bf16", gate_ptr="bf16", o_ptr="bf16", count_ptr="i32"
    )
    for tokens in (1, 4):
        config = mla.FusedMLA.ONE_TOKEN if tokens == 1 else mla.FusedMLA.WINDOW
        splits = config.splits
        block_m = triton.next_power_of_2(max(config.min_rows, tokens * 32))
        row_block = max(16, min(block_m, config.rows_per_program))  # as FusedMLA at rank 512
        d_parts = 1
        for handoff, early in ((False, False), (True, False), (False, True), (True, True)):
            yield (
                f"mla_prep T={tokens} handoff={handoff} weights_early={early}",
                mla._mla_prep,
                prep_ptrs,
                dict(
                    KV_OFF=6144,
                    T=tokens,
                    BLOCK_T=16,
                    HEADS=32,
                    NOPE=128,
                    ROPE=64,
                    RANK=512,
                    RANK_BLOCK=128,
                    HANDOFF=handoff,
                    WEIGHTS_EARLY=early,
                ),
                4,
                3,
            )
        attend_shape = dict(
            T=tokens,
            HEADS=32,
            RANK=512,
            ROPE=64,
            SPLITS=splits,
            BLOCK_M=block_m,
            ROW_BLOCK=row_block,
            BLOCK_L=config.block_l,
            MIN_CHUNK=config.min_chunk,
            BF16_DOTS=config.bf16_dots,
        )
        yield (
            f"mla_attend T={tokens} rows={row_block} d_parts={d_parts}",
            mla._mla_attend,
            attend_ptrs,
            dict(attend_shape, D_PARTS=d_parts, ROWS_ADJACENT=config.rows_adjacent and block_m > row_block),
            config.warps,
            config.stages,
        )
        if config.transposed:  # (and its L2 asks: AttendLaunch.early_chunks, ahead_steps)
            for early, ahead in ((0, 0), (1, 0), (1, 2)):
                asks = dict(EARLY=early, AHEAD=ahead, THREADS=32 * config.warps) if early or ahead else {}
                yield (
                    f"mla_attend_t T={tokens} rows={row_block} early={early} ahead={ahead}",
                    mla._mla_attend_t,
                    attend_ptrs,
                    dict(attend_shape, **asks),
                    config.warps,
                    config.stages,
                )
        yield (
            f"mla_combine T={tokens}",
            mla._mla_combine,
            combine_ptrs,
            dict(
                T=tokens,
                HEADS=32,
                RANK=512,
                V=128,
                SPLITS=splits,
                BLOCK_M=block_m,
                V_PER=min(config.v_per_program, 128),
                MIN_CHUNK=config.min_chunk,
                T_POW2=triton.next_power_of_2(tokens),
                TOKEN_PROGRAMS=config.combine_token_programs and tokens > 1,
                CH=min(config.combine_chunk, splits),
            ),
            config.combine_warps,
            3,
        )
        router_ptrs = dict(
            x_ptr="bf16",
            nw_ptr="bf16",
            w_ptr="bf16",
            bias_ptr="fp32",
            xn_ptr="bf16",
            scores_ptr="fp32",
            cnt_ptr="i32",
            ids_ptr="i32",
            wts_ptr="fp32",
            count_ptr="i32",
        )
        yield (
            f"router T={tokens}",
            router._router,
            router_ptrs,
            dict(
                T=tokens,
                BLOCK_T=triton.next_power_of_2(tokens),
                HID=2560,
                E=512,
                GROUPS=8,
                KEEP_GROUPS=4,
                TOPK=8,
                RENORM=True,
                BLOCK_E=router.FusedRouter.BLOCK_E,
                BLOCK_K=512,
                HID_POW2=4096,
                SELECT=tokens == 1,
                UNROLL=False,
            ),
            1,
            3,
        )
        if tokens > 1:
            select_ptrs = dict(scores_ptr="fp32", bias_ptr="fp32", ids_ptr="i32", wts_ptr="fp32", count_ptr="i32")
            consts = dict(E=512, GROUPS=8, KEEP_GROUPS=4, TOPK=8, RENORM=True)
            yield f"router_select T={tokens}", router._router_select, select_ptrs, consts, 1, 3
    norm_ptrs = dict(x_ptr="bf16", w_ptr="bf16", o_ptr="bf16", count_ptr="i32")
    yield "rmsnorm", router._rmsnorm, norm_ptrs, dict(K=2560, BLOCK=4096), 4, 3


def gluon_ring_variants():
    """(name, tokens, rows, warps, buffers, early): the Gluon MLA attention (solo.kernels.gluon_mla) at Ling-3.0-flash
    width, one token's launches and verification's (4 tokens in programs of 64 or 32 rows, 3 with a padded one)."""
    yield "gluon ring T=1", 1, 0, 4, 2, 1
    yield "gluon ring T=1 8 warps, 4 early", 1, 0, 8, 2, 4
    yield "gluon ring T=4 rows 64", 4, 64, 8, 2, 0
    yield "gluon ring T=4 rows 32", 4, 32, 8, 2, 2
    yield "gluon ring T=3 rows 64", 3, 64, 8, 2, 2


def compile_gluon_ring(tokens: int, rows: int, warps: int, buffers: int, early: int, pdl: bool):
    """Compile gluon_mla._mla_attend_ring for sm_90: 32 heads, rank 512, rope 64, steps of 64 positions (the cache's
    TMA descriptors as tensordesc types). Triton after 3.6 renamed the TMA copy the kernel calls; the local name is
    pointed at the new one."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from solo.kernels import gluon_mla

    if hasattr(gluon_mla.tma, "async_load"):  # (Triton 3.7+: async_copy_global_to_shared became async_load)
        gluon_mla.tma.async_copy_global_to_shared = gluon_mla.tma.async_load
    fn = gluon_mla._mla_attend_ring
    window = {"T": tokens, "T_POW2": triton.next_power_of_2(tokens), "ROWS": rows} if tokens > 1 else {}
    constexprs = dict(
        HEADS=32, RANK=512, ROPE=64, SPLITS=64 if tokens > 1 else 128, BLOCK_M=128 if tokens > 1 else 32, BLOCK_L=64,
        MIN_CHUNK=128 if tokens > 1 else 64, BUFFERS=buffers, EARLY=early, PDL=pdl, AHEAD=0, WARPS=warps, **window,
    )  # fmt: skip
    sig = {}
    for param in fn.params:
        if param.is_constexpr:
            constexprs.setdefault(param.name, param.default)
            sig[param.name] = "constexpr"
        elif param.name.endswith("_desc"):
            width = 512 if param.name == "latent_desc" else 64
            layout = gl.NVMMASharedLayout.get_default_for([64, width], gl.bfloat16)
            sig[param.name] = f"tensordesc<bf16[64,{width}],{layout!r}>"
        else:
            sig[param.name] = {"part_ptr": "*fp32", "ml_ptr": "*fp32", "pos_ptr": "*i64", "count_ptr": "*i32"}.get(
                param.name, "fp32" if param.name == "scale" else "*bf16"
            )
    options = {"num_warps": warps, **({"launch_pdl": True} if pdl else {})}
    return triton.compile(GluonASTSource(fn, sig, constexprs), target=GPUTarget("cuda", 90, 32), options=options)


def resource_usage(cubin: bytes) -> tuple[str, str]:
    """(registers, spill stores) of a cubin, read by the cuobjdump in Triton's wheel."""
    import re
    import subprocess
    import tempfile

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", text)
    stack = re.search(r"STACK:(\d+)", text)
    return (regs.group(1) if regs else "?"), (stack.group(1) if stack else "?")


def report(name: str, kernel, notes: list[str], ptx_path: Path | None) -> bool:
    """Print a compiled variant's registers, stack bytes and shared memory with `notes` (its problems, to which
    shared memory over the limit is added); write its PTX to `ptx_path`. Returns whether it has a problem."""
    if kernel.metadata.shared > SMEM_LIMIT:
        notes.append("shared memory over the limit")
    regs, spills = resource_usage(kernel.asm["cubin"])
    note = f"  ({'; '.join(notes)})" if notes else ""
    print(f"ok      {name}: {regs} regs, {spills} B stack, {kernel.metadata.shared} B shared{note}")
    if ptx_path is not None:
        ptx_path.parent.mkdir(parents=True, exist_ok=True)
        ptx_path.write_text(kernel.asm["ptx"])
    return bool(notes)


def failed(name: str, e: Exception) -> int:
    print(f"FAILED  {name}: {type(e).__name__}: {str(e).splitlines()[-1][:300]}")
    return 1


def main(out_dir: str | None = None) -> int:
    failures = 0
    for base, fn, ptrs, constexprs, warps, stages in [*gemv_variants(), *other_variants()]:
        for pdl in (False, True) if takes_pdl(fn) else (False,):
            name = base + (" +pdl" if pdl else "")
            try:
                kernel = compile_variant(fn, ptrs, dict(constexprs), warps, stages, pdl)
            except Exception as e:  # noqa: BLE001 (report every variant, then fail)
                failures += failed(name, e)
                continue
            notes = []
            # under PDL the kernel must wait for its predecessor (and let its successor launch); without, neither
            griddep = kernel.asm["ptx"].count("griddepcontrol.")
            if pdl != (griddep == 2 and bool(getattr(kernel.metadata, "launch_pdl", False))):
                notes.append(f"PDL {pdl} but {griddep} griddepcontrol instructions")
            prefetches = kernel.asm["ptx"].count("cp.async.bulk.prefetch.L2")
            if fn is router._router and pdl != (prefetches > 0):
                notes.append(f"prefetch {pdl} but {prefetches} bulk prefetches")
            tag = "_pdl" if pdl else ""
            ptx_path = Path(out_dir) / f"{'_'.join(base.split()[:2])}{tag}.ptx" if out_dir else None
            failures += report(name, kernel, notes, ptx_path)
    for base, *launch in gluon_ring_variants():
        name = base + " +pdl"
        try:
            kernel = compile_gluon_ring(*launch, pdl=True)
        except Exception as e:  # noqa: BLE001 (report every variant, then fail)
            failures += failed(name, e)
            continue
        failures += report(name, kernel, [], None)
    return 1 if failures else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", nargs="?", help="also write each variant's PTX here")
    sys.exit(main(parser.parse_args().out_dir))
