"""Start-up verification: every requested optimization is proven live, with evidence.

The seed system's worst failure was silent: with the FP8 LM head and MTP both on, the draft read
the head's FP8 bytes as BF16, accepted 1.00 tokens per round and ran slower than no optimization
at all, without an error. These checks look at what is really running (counted backend calls, the
head's dtype and scales, object identity of the draft's head, a measured accept length) and make
start-up fail when a requested optimization is not active.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from solo.engine.engine import Engine, GenerationParams
from solo.engine.sampling import SamplingParams
from solo.model.layers import Linear, block_fp8_linears
from solo.model.moe import SparseMoE
from solo.speculative.acceptance import AcceptanceCounter

ACTIVE, FAILED, OFF = "ACTIVE", "FAILED", "OFF"
KNOWN_ENV = {
    "SOLO_CACHE_DIR": "folder for compiled kernels (default ~/.cache/solo)",
    "SOLO_API_KEY": "solo serve's API key (like --api-key)",
}
HEAD_DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp8": "float8_e4m3fn"}
CALIBRATION_PROMPT = (
    "Question: Janet has 3 boxes with 12 pencils in each box. She gives away 10 pencils. "
    "How many pencils does she have left?\nAnswer: Janet has 3 * 12 = <<3*12=36>>36 pencils. "
    "She has 36 - 10 = <<36-10=26>>26 pencils left.\n#### 26\n\n"
    "Question: Janet has 3 boxes with 12 pencils in each box. She gives away 10 pencils. "
    "How many pencils does she have left?\nAnswer:"
)


class PreflightFailed(RuntimeError):
    """A requested optimization is not active; the message names it and why."""


class UnknownEnvironment(ValueError):
    pass


@dataclass
class Check:
    name: str
    requested: str
    status: str
    evidence: dict[str, Any] = field(default_factory=dict)
    reason: str = ""

    def line(self) -> str:
        text = f"{self.status:<7} {self.name:<12} {self.requested:<10}"
        detail = self.reason if self.status == FAILED else _short(self.evidence)
        return f"{text} {detail}".rstrip()


@dataclass
class PreflightReport:
    checks: list[Check]
    seconds: float

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAILED]

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": not self.failed,
            "seconds": round(self.seconds, 3),
            "checks": [asdict(c) for c in self.checks],
        }

    def text(self) -> str:
        lines = [c.line() for c in self.checks]
        lines.append(
            f"preflight: {'all requested optimizations active' if not self.failed else 'FAILED'} ({self.seconds:.2f} s)"
        )
        return "\n".join(lines)


def _short(evidence: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in evidence.items() if not isinstance(v, (dict, list)))


def check_environment(environ: dict[str, str] | None = None) -> None:
    """Unknown SOLO_* variables are errors: a misspelled setting must not be silently ignored."""
    environ = dict(os.environ if environ is None else environ)
    unknown = sorted(k for k in environ if k.startswith("SOLO_") and k not in KNOWN_ENV)
    if unknown:
        known = ", ".join(f"{k} ({v})" for k, v in KNOWN_ENV.items())
        raise UnknownEnvironment(f"unknown environment variable(s) {', '.join(unknown)}; solo knows {known}.")


# --------------------------------------------------------------------------- the checks
def _trunk_moes(engine: Engine) -> list[SparseMoE]:
    trunk = engine.model.model.layers[: engine.model.config.num_hidden_layers]
    return [m for m in trunk.modules() if isinstance(m, SparseMoE) and m.experts is not None]


def _family_calls(moes: list[SparseMoE]) -> dict[str, int]:
    total: dict[str, int] = {}
    for m in moes:
        for family, n in m.experts.path_calls.items():
            total[family] = total.get(family, 0) + n
    return total


def check_moe_backend(engine: Engine, requested: str) -> Check:
    moes = _trunk_moes(engine)
    if not moes:
        return Check("moe_backend", requested, OFF, {"reason": "model has no MoE layers"})
    before = [m.experts.calls for m in moes]
    families_before = _family_calls(moes)
    # A prompt just long enough for every backend's prefill kernels, then a one-token decode step:
    # each family of kernels the backend has must run in every layer.
    length = max([8] + [m.experts.probe_prompt_tokens() for m in moes])
    text = engine.tokenizer.encode("1 + 1 = 2") or [0]
    ids = torch.tensor((text * (length // len(text) + 1))[:length], device=engine.model.device)
    dev = engine.model.device
    with torch.inference_mode():
        cache = engine.cache_for(len(ids) + 1)
        engine.model(ids, torch.arange(len(ids), device=dev), cache)  # a prefill ...
        engine.model(ids[-1:], torch.tensor([len(ids)], device=dev), cache)  # ... and a decode step
    names = sorted({m.experts.name for m in moes})
    calls = sum(m.experts.calls - b for m, b in zip(moes, before, strict=True))
    evidence: dict[str, Any] = {
        "executed_by": ",".join(names),
        "calls": calls,
        "layers": len(moes),
        "tokens": len(ids) + 1,
    }
    ran = {k: v - families_before.get(k, 0) for k, v in _family_calls(moes).items()}
    evidence.update({f"{family}_calls": n for family, n in ran.items()})
    for m in moes[:1]:
        evidence.update(m.experts.kernel_evidence())
    if names != [requested]:
        return Check(
            "moe_backend", requested, FAILED, evidence, f"experts ran on {names}, not on the requested '{requested}'"
        )
    for what, tokens in (("prefill", len(ids)), ("decode step", 1)):
        for family in {m.experts.family_for(tokens) for m in moes} - {None}:
            if ran.get(family, 0) < len(moes):
                return Check(
                    "moe_backend",
                    requested,
                    FAILED,
                    evidence,
                    f"the {what} did not run the {family} kernels in every layer",
                )
    idle = [i for i, (m, b) in enumerate(zip(moes, before, strict=True)) if m.experts.calls == b]
    if idle or calls < len(moes):
        return Check("moe_backend", requested, FAILED, evidence, f"{len(idle)} MoE layers executed no expert call")
    return Check("moe_backend", requested, ACTIVE, evidence)


def check_lm_head(engine: Engine, requested: str) -> Check:
    head = engine.model.lm_head
    info = head.describe() if hasattr(head, "describe") else {"mode": "unknown"}
    evidence = {
        "mode": info.get("mode"),
        "weight_dtype": info.get("weight_dtype"),
        "bytes": info.get("bytes"),
    }
    if info.get("scales"):
        evidence["scales"] = info["scales"]
    if info.get("weight_dtype") != HEAD_DTYPES[requested]:
        return Check(
            "lm_head",
            requested,
            FAILED,
            evidence,
            f"head weights are {info.get('weight_dtype')}, expected {HEAD_DTYPES[requested]}",
        )
    if requested == "fp8":
        scales = info.get("scales") or {}
        shard = info.get("vocab_shard")  # a tensor-parallel rank's head holds its vocabulary rows
        rows = shard[1] - shard[0] if shard else engine.model.config.vocab_size
        if scales.get("shape") != [rows] or not scales.get("min", 0) > 0:
            return Check("lm_head", requested, FAILED, evidence, "FP8 head has no valid per-row scales")
    return Check("lm_head", requested, ACTIVE, evidence)


def check_block_fp8(engine: Engine, requested: str) -> Check:
    """Block-FP8 layers kept in FP8 really run their kernel in a forward pass.

    ``on`` fails when nothing could be kept (no block-FP8 layers in the checkpoint); ``auto`` keeps
    only large layers on a GPU and reports OFF when none qualified."""
    linears = [m for m in engine.model.modules() if isinstance(m, Linear)]
    fp8 = block_fp8_linears(engine.model)
    if requested == "off":
        return Check("block_fp8", requested, OFF, {"fp8_layers": len(fp8)})
    evidence: dict[str, Any] = {
        "fp8_layers": len(fp8),
        "dense_layers": len(linears) - len(fp8),
        "fp8_bytes": sum(m.nbytes for m in fp8),
    }
    cut = getattr(engine.model, "split_dequantized", [])
    if cut:
        evidence["dequantized_by_split"] = len(cut)
    if requested == "on" and cut:
        return Check(
            "block_fp8",
            requested,
            FAILED,
            evidence,
            f"the tensor-parallel split cuts the 128x128 FP8 blocks of {len(cut)} layers (e.g. {cut[0]}), so they "
            "were dequantized at load; the FP8 kernel needs whole blocks. Use --block-fp8 auto, or a "
            "--tensor-parallel whose shards hold whole blocks",
        )
    if not fp8:
        if requested == "auto":
            evidence["reason"] = "no block-FP8 layer large enough on this device (auto: GPU, K >= 1536)"
            return Check("block_fp8", requested, OFF, evidence)
        return Check(
            "block_fp8",
            requested,
            FAILED,
            evidence,
            "the checkpoint has no block-FP8 layers (not an fp4/fp8 checkpoint); drop --block-fp8 on",
        )
    trunk = engine.model.model.layers[: engine.model.config.num_hidden_layers]
    # (a weight folded into another layer's at load, like MLA's kv_b_proj, is never called itself)
    in_trunk = [m for m in block_fp8_linears(trunk) if not m.folded]
    before = [m.fp8_calls for m in in_trunk]
    dev = engine.model.device
    ids = torch.tensor((engine.tokenizer.encode("1 + 1 = 2") or [0])[:4], device=dev)
    step = engine.model.decode_step
    if step is not None:  # a token count the fused step does not serve: the reference layers run
        ids = torch.arange(max(step.token_counts) + 1, device=dev) % engine.model.config.vocab_size
    with torch.inference_mode():
        engine.model(ids, torch.arange(len(ids), device=dev), engine.cache_for(len(ids)))
    ran = sum(m.fp8_calls > b for m, b in zip(in_trunk, before, strict=True))
    evidence["kernel"] = getattr(fp8[0].kernel, "__name__", type(fp8[0].kernel).__name__)
    evidence["ran"] = f"{ran}/{len(in_trunk)}"
    if ran < len(in_trunk):
        return Check("block_fp8", requested, FAILED, evidence, f"{len(in_trunk) - ran} FP8 layers did not run")
    return Check("block_fp8", requested, ACTIVE, evidence)


def check_speculation(engine: Engine, min_accept_length: float, tokens: int = 48) -> list[Check]:
    decoder = engine.decoder
    draft_head = getattr(decoder, "draft_head", None)
    same = draft_head is engine.model.lm_head
    head_check = Check(
        "draft_head",
        "shared",
        ACTIVE if same else FAILED,
        {
            "draft_head": type(draft_head).__name__,
            "target_head": type(engine.model.lm_head).__name__,
            "same_object": same,
        },
        ""
        if same
        else "the draft computes logits with a different head object than the target "
        "(a copy or a bare weight tensor): share the target's LM head module",
    )
    steps = decoder.num_draft_positions
    result = engine.generate(CALIBRATION_PROMPT, GenerationParams(max_tokens=tokens, ignore_eos=True))
    counted = result.stats
    # the calibration run is not user traffic: keep it out of the process statistics
    engine.acceptance = engine.acceptance.since(_as_counter(counted, steps))
    if engine.watchdog is not None:
        engine.watchdog.reset()
    rounds = counted.verify_rounds or 0
    length = counted.accept_length or 0.0
    evidence = {
        "accept_length": round(length, 3),
        "rounds": rounds,
        "tokens": len(result.token_ids),
        "threshold": min_accept_length,
        "num_steps": steps,
    }
    ok = length >= min_accept_length
    mtp = Check(
        "mtp",
        f"NEXTN/{steps}",
        ACTIVE if ok else FAILED,
        evidence,
        ""
        if ok
        else f"calibration accept length {length:.2f} < {min_accept_length}: drafts are "
        "rejected, so speculation would run slower than plain decoding",
    )
    return [head_check, mtp]


def _as_counter(stats, positions: int) -> AcceptanceCounter:
    return AcceptanceCounter(
        positions,
        stats.verify_rounds or 0,
        stats.drafted_tokens or 0,
        stats.accepted_tokens or 0,
        list(stats.accepted_per_position or [0] * positions),
    )


def check_kernels(engine: Engine, backend: str) -> Check:
    """The compiled kernels the routed experts run from, and the FP8 kernels' warm-ups, with paths."""
    if backend == "torch":
        return Check("kernels", "torch", OFF, {"reason": "reference backend, nothing compiled"})
    moes = _trunk_moes(engine)
    compiled = moes[0].experts.compile_evidence() if moes else None
    if compiled is None:
        return Check("kernels", backend, FAILED, {}, f"the '{backend}' experts report no compiled kernels")
    evidence: dict[str, Any] = {"moe": compiled.summary()}
    if compiled.tool != "triton-interpreter" and not compiled.artifacts:
        return Check(
            "kernels",
            backend,
            FAILED,
            evidence,
            f"no compiled {compiled.tool} kernel found in {compiled.cache_dir or 'its cache'}: nothing proves "
            "the backend's kernels were built",
        )
    if backend in ("triton", "cuda"):
        from solo.kernels.triton_fp8 import kernel_cache_report

        report = kernel_cache_report()
        evidence.update({k: report[k] for k in ("cache_dir", "compile_seconds", "new_cache_entries", "all_cached")})
        evidence["warmups"] = len(report["warmups"])
    return Check("kernels", backend, ACTIVE, evidence)


def check_decode_step(engine: Engine, requested: str) -> Check:
    """The fused decode step really runs: its kernels' own device-side launch counters must move over
    a short generation (graph replays included), every family of them."""
    step = engine.model.decode_step
    if step is None:
        note = getattr(engine.model, "decode_step_note", "")
        if requested == "fused":
            return Check("decode_step", requested, FAILED, {}, note or "the fused decode step is not installed")
        return Check("decode_step", requested, OFF, {"reason": note or "reference decode step"})
    before = step.launches()
    result = engine.generate([1, 2, 3], GenerationParams(max_tokens=8, ignore_eos=True))
    after = step.launches()
    ran = {family: after[family] - before[family] for family in after}
    expected = step.families_per_step()
    evidence: dict[str, Any] = {"tokens": len(result.token_ids), **{f"{k}_launches": v for k, v in ran.items()}}
    evidence["token_counts"] = sorted(step.token_counts)
    evidence["step_kernels"] = step.kernels  # the projections' and routers' kernels (CUDA or Triton)
    if step.kernels_note:
        evidence["step_kernels_note"] = step.kernels_note
    if rings := step.window_rings():  # verification's big projections through bulk rings (this card's choice)
        evidence["window_rings"] = rings
    if step.l2_next["layers"]:  # the MoE kernels ask the L2 for later weights (this card's choice)
        evidence["l2_next"] = dict(step.l2_next)
    if early := step.mla_early_chunks():  # the MLA's early asks for old rows (this card's choice)
        evidence["mla_early_chunks"] = early
    if step.mla_gluon():  # one token's MLA attention as the Gluon ring (this card's choice)
        evidence["mla_gluon"] = True
    if step.mla_gluon_window():  # verification's too (this card's choice)
        evidence["mla_gluon_window"] = True
    if step.shared_beside_router:  # verification's shared gate_up on the side stream beside its router (this card's)
        evidence["shared_beside_router"] = True
    if step.shared_expert_beside_router():  # ... and its shared down, the routed down adding both (this card's)
        evidence["shared_down_beside"] = True
    if window := step.gate_up_window():  # the MoE kernels' gate_up tiles in a window (this card's choice)
        evidence["gate_up_window"] = window
    if step.kda_front_build is not None:  # one token's KDA front as one launch (this card's choice, or asked for)
        evidence["kda_front"] = step.kda_front_build
    if step.kda_front_note:  # this card's choice, which could not run here: the two kernels, and why
        evidence["kda_front_note"] = step.kda_front_note
    idle = [family for family in expected if ran.get(family, 0) == 0]
    if idle:
        return Check(
            "decode_step", requested, FAILED, evidence, f"the fused kernels {idle} did not run during a generation"
        )
    if step.launch.pdl:  # asked for is not launched with: the compiled kernels' own flags say
        with_pdl = step.launch.families_with_pdl()
        evidence["pdl"] = with_pdl
        without = sorted(family for family in expected if not with_pdl.get(family, False))
        if without:
            return Check("decode_step", requested, FAILED, evidence, f"--pdl on, but {without} launched without PDL")
    return Check("decode_step", requested, ACTIVE, evidence)


def check_cuda_graphs(engine: Engine) -> Check:
    """The decoder must really replay graphs: a short generation must count replays."""
    report = engine.decoder.graph_report()
    if report is None:
        return Check("cuda_graphs", "on", FAILED, {}, "no graph was captured")
    before = report["replays"]
    engine.generate([0, 1, 2], GenerationParams(max_tokens=8, ignore_eos=True))
    report = engine.decoder.graph_report() or {}
    evidence = {**report, "replays": report.get("replays", 0) - before, "max_context": engine.graphs_max_len}
    if evidence["replays"] == 0:
        return Check("cuda_graphs", "on", FAILED, evidence, "a generation ran without replaying a graph")
    return Check("cuda_graphs", "on", ACTIVE, evidence)


def _measured_shard(engine: Engine) -> dict[str, int]:
    """This rank's shard as its modules hold it (not as the plan says): heads, experts, widths, vocabulary rows."""
    from solo.model.kda import KimiDeltaAttention
    from solo.model.mla import MultiLatentAttention

    model, config = engine.model, engine.model.config
    out: dict[str, int] = {}
    for layer in model.model.layers:
        attention = layer.attention
        if isinstance(attention, KimiDeltaAttention) and "kda_heads" not in out:
            out["kda_heads"] = attention.q_proj.weight.shape[0] // config.linear_head_dim
            out["kda_state_heads"] = attention.A_log.numel()
        if isinstance(attention, MultiLatentAttention) and "mla_heads" not in out:
            out["mla_heads"] = attention.w_uk.shape[0]
            out["mla_dense_columns"] = attention.dense.weight.shape[1]
        moe = layer.mlp
        if isinstance(moe, SparseMoE) and moe.experts is not None and "experts" not in out:
            source = getattr(moe.experts, "source", None)
            if source is not None:
                out["experts"] = source.num_experts
                out["expert_width"] = source.intermediate_size
    info = model.lm_head.describe() if hasattr(model.lm_head, "describe") else {}
    out["vocab_rows"] = (info.get("shape") or [0])[0]
    return out


def _claimed_shard(engine: Engine) -> dict[str, int]:
    config, plan = engine.model.config, engine.model.shard
    claimed = {
        "kda_heads": plan.kda_heads(config),
        "kda_state_heads": plan.kda_heads(config),
        "mla_heads": plan.mla_heads(config),
        "mla_dense_columns": plan.mla_heads(config) * config.v_head_dim,
        "experts": plan.expert_span(config)[1],
        "expert_width": plan.expert_intermediate(config),
        "vocab_rows": plan.part(config.vocab_size),
    }
    return {k: v for k, v in claimed.items() if k in _measured_shard(engine)}


def check_tensor_parallel(engine: Engine, requested: int, steps: int = 8) -> Check:
    """Tensor parallelism is live: the world size and backend are those asked for, an all-reduce of a
    rank-dependent tensor over the model's group gives the expected sum, every rank's modules hold
    the shard the plan claims and the shards tile the model, a decode step runs two all-reduces per
    layer (timed: what they cost in the step), and a greedy and a sampled generation give the same
    tokens on every rank."""
    tp = engine.tp
    if requested <= 1 and not tp.enabled:
        return Check("tensor_parallel", "off", OFF)
    wanted = f"TP{requested}"
    evidence: dict[str, Any] = {
        "world_size": tp.world,
        "backend": tp.backend,
        "transport": tp.transport,
        "moe_split": engine.model.shard.experts,
    }
    if tp.transport_us:  # what the start-up timing of both transports found (the faster one runs)
        evidence.update({f"{name}_all_reduce_us_at_start": us for name, us in tp.transport_us.items()})
    if tp.world != requested:
        from solo.distributed.parallel import launch_hint

        return Check(
            "tensor_parallel",
            wanted,
            FAILED,
            evidence,
            f"the engine runs on {tp.world} rank(s), not the {requested} requested: {launch_hint(requested)}",
        )
    model, config, dev = engine.model, engine.model.config, engine.model.device
    # 1. a live all-reduce over the model's group (NCCL or gloo), rank-dependent
    x = torch.full((4,), float(tp.rank + 1), device=dev, dtype=torch.float32)
    tp.all_reduce(x)
    want_sum = tp.world * (tp.world + 1) / 2
    summed = bool(torch.all(x == want_sum).item())
    # 2. the shard each rank's modules hold against the plan's claim
    measured, claimed = _measured_shard(engine), _claimed_shard(engine)
    # 3. a decode step: all-reduces counted and timed as they run in it
    ids = torch.tensor((engine.tokenizer.encode("1 + 1 = 2") or [0])[:4], device=dev)
    cache = engine.cache_for(len(ids) + steps + 1)  # (outside inference mode: generations reuse it)
    with torch.inference_mode():
        model(ids, torch.arange(len(ids), device=dev), cache)
        tp.cuda_timing = dev.type == "cuda"  # GPU: CUDA events around each collective (eager steps here)
        before, began = tp.stats.copy(), time.perf_counter()
        for i in range(steps):
            position = torch.tensor([len(ids) + i], device=dev)
            model.logits(model(ids[-1:], position, cache))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        step_s = (time.perf_counter() - began) / steps
    tp.resolve_timings()
    tp.cuda_timing = False
    ran = tp.stats.since(before)
    # 4. lockstep: the same tokens on every rank, greedy and sampled (the seed rank 0 draws)
    greedy = engine.generate([1, 2, 3], GenerationParams(max_tokens=6, ignore_eos=True)).token_ids
    sampled_params = GenerationParams(max_tokens=6, ignore_eos=True, sampling=SamplingParams(temperature=1.0))
    sampled = engine.generate([1, 2, 3], sampled_params).token_ids
    plan = model.shard
    mine = {
        "rank": tp.rank,
        "sum": summed,
        "measured": measured,
        "claimed": claimed,
        "spans": {
            "kda_heads": plan.span(config.linear_num_heads),
            "mla_heads": plan.span(config.num_attention_heads),
            "experts": (plan.expert_span(config)[0], sum(plan.expert_span(config))),
            "vocab": plan.vocab_span(config),
        },
        "shard": plan.describe(config),
        "tokens": (greedy, sampled),
    }
    ranks = tp.gather_objects(mine)
    per_step = ran.all_reduces / steps
    evidence.update(
        {
            "all_reduce_sum": f"{want_sum:g} on {sum(r['sum'] for r in ranks)}/{tp.world} ranks",
            "all_reduces_per_step": per_step,
            "all_reduce_us": round(1e6 * ran.all_reduce_s / max(ran.all_reduces, 1), 1),
            "all_gather_us": round(1e6 * ran.all_gather_s / max(ran.all_gathers, 1), 1),
            "collectives_share_of_step": round(ran.seconds / steps / step_s, 3) if step_s > 0 else None,
            "step_ms": round(1e3 * step_s, 3),
            "shards": "; ".join(
                " ".join(f"{k}={v}" for k, v in r["shard"].items() if k != "rank") + f" (rank {r['rank']})"
                for r in ranks
            ),
            "ranks": [r["shard"] for r in ranks],
        }
    )

    def failed(reason: str) -> Check:
        return Check("tensor_parallel", wanted, FAILED, evidence, reason)

    bad_sum = [r["rank"] for r in ranks if not r["sum"]]
    if bad_sum:
        return failed(f"an all-reduce of rank + 1 did not sum to {want_sum:g} on ranks {bad_sum}")
    for r in ranks:
        wrong = {k: (r["measured"].get(k), v) for k, v in r["claimed"].items() if r["measured"].get(k) != v}
        if wrong:
            return failed(f"rank {r['rank']} holds a different shard than claimed (held, claimed): {wrong}")
    totals = {
        "kda_heads": config.linear_num_heads,
        "mla_heads": config.num_attention_heads,
        "experts": config.num_experts,
        "vocab": config.vocab_size,
    }
    for key, total in totals.items():
        spans = sorted(tuple(r["spans"][key]) for r in ranks)
        if key == "experts" and plan.experts == "width":
            tiles = all(span == (0, total) for span in spans)
        else:
            joined = all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
            tiles = spans[0][0] == 0 and spans[-1][1] == total and joined
        if not tiles:
            return failed(f"the ranks' {key} shards {spans} do not cover [0, {total}) exactly once")
    if per_step != 2 * config.num_hidden_layers:
        return failed(
            f"a decode step ran {per_step:g} all-reduces, expected 2 per layer ({2 * config.num_hidden_layers})"
        )
    differing = [r["rank"] for r in ranks if r["tokens"] != ranks[0]["tokens"]]
    if differing:
        return failed(f"ranks {differing} generated other tokens than rank 0 (greedy and sampled)")
    evidence["tokens_agree"] = f"{len(greedy) + len(sampled)} tokens on {tp.world} ranks"
    return Check("tensor_parallel", wanted, ACTIVE, evidence)


def _agree_across_ranks(engine: Engine, checks: list[Check]) -> list[Check]:
    """A check that failed on any rank fails on every rank (all stop together, rank 0 reports it)."""
    if not engine.tp.enabled:
        return checks
    failures = engine.tp.gather_objects([(c.name, c.reason) for c in checks if c.status == FAILED])
    for rank, failed_here in enumerate(failures):
        if rank == engine.tp.rank:
            continue
        for name, reason in failed_here:
            for c in checks:
                if c.name == name and c.status != FAILED:
                    c.status, c.reason = FAILED, f"on rank {rank}: {reason}"
    return checks


def run_preflight(
    engine: Engine,
    moe_backend: str,
    lm_head: str,
    speculative: bool,
    min_accept_length: float = 1.2,
    cuda_graphs: bool = False,
    block_fp8: str = "auto",
    decode_step: str = "auto",
    tensor_parallel: int = 1,
) -> PreflightReport:
    """Every requested optimization's check. Under tensor parallelism every rank runs them (the same
    collectives in the same order) and a check failed on any rank fails on all."""
    start = time.perf_counter()
    checks = [check_tensor_parallel(engine, tensor_parallel)]
    checks += [check_moe_backend(engine, moe_backend), check_lm_head(engine, lm_head)]
    checks.append(check_block_fp8(engine, block_fp8))
    checks.append(check_decode_step(engine, decode_step))
    if speculative:
        checks.extend(check_speculation(engine, min_accept_length))
    else:
        checks.append(Check("mtp", "off", OFF))
    checks.append(check_kernels(engine, moe_backend))
    checks.append(check_cuda_graphs(engine) if cuda_graphs else Check("cuda_graphs", "off", OFF))
    return PreflightReport(_agree_across_ranks(engine, checks), time.perf_counter() - start)
