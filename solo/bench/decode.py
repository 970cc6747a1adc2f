"""`solo bench decode`: the whole decode step at full shape, inside CUDA graphs, against the roofline.

For each configuration (MoE backend x LM head x decode step), in a process of its own (a captured
graph keeps its memory pool alive, and a full-size model fills most of the GPU), at each context:
  - the decode step (1 token), the verification of a window (NEXTN's 4 tokens, with the KDA
    history), one NEXTN draft step (layer + head) and the whole NEXTN round (verify, accept, roll
    back, draft), each replayed from a CUDA graph;
  - the bytes a decode step reads (solo.engine.traffic) and the device's copy bandwidth measured in
    the same process: the roofline time, and the fraction of it the step reaches;
  - kernels per decode step and time by component, from the profiler over one graph replay (each
    kernel's own duration, and its share of the critical path, which stays meaningful under PDL), and
    per component of the decode step the bytes it must read over that share: the bandwidth each part
    reaches, against the copy bandwidth (`component_bandwidth`);
  - prefill times for the prompt lengths asked for;
  - the engine's real loop (greedy `generate` with the tokens streamed) against the graph timing at
    the same positions;
  - the ratios verify/decode and round/decode, and the NEXTN tok/s they imply at given accept lengths.
The model is a checkpoint folder (`--model`) or random weights in the fp4 format at a published
shape (`--random-weights ling-3.0-flash`), generated on the GPU and fed through the real loader.
Results: JSON (`--json`), and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ACCEPT_LENGTHS = (2.68, 3.90)  # the seed's GSM8K and synthetic accept lengths
# the seed's GSM8K workload samples (its accept length 2.68 was measured so); the synthetic one is greedy
GSM8K_SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 29}
COMPONENTS = (  # kernel name patterns -> component (first match wins)
    ("experts", r"moe_decode|gemv_gate_up|gemv_down|grouped|humming|expert"),
    ("router", r"_router|router_decode|topk|sort|radix"),
    ("kda front", r"kda_front"),  # one launch: the KDA layer's input projections and its recurrence
    ("kda", r"_kda|kda_"),
    ("mla", r"_mla"),
    ("norms", r"rmsnorm|_norm"),
    ("projections", r"_fused_gemv|fp8_linear|gemm|gemv|sm90|cutlass|cublas|nvjet"),
    ("sampling", r"argmax|exponential|softmax|reduce|_top_k_kernel|_greedy_kernel"),  # (solo.kernels.topk, .greedy)
    ("elementwise", r"elementwise|vectorized|unrolled|copy|fill|cat|index|where|mul|add"),
)


# what each component of a profiled step must read: StepTraffic's fields (solo.engine.traffic); the routers'
# bytes count with the experts where no router kernel ran (the router inside the MoE kernel), the KDA layers' input
# projections with the KDA front where it ran as one launch (with the states), else with the projections
COMPONENT_BYTES = {
    "projections": ("dense_weights", "lm_head"),
    "experts": ("experts",),
    "router": ("routers",),
    "kda": ("kda_states",),
    "mla": ("mla_cache",),
}


def component_bandwidth(
    traffic: dict[str, int], by_component: dict[str, dict[str, float]], copy_gbs: float
) -> dict[str, dict[str, float]]:
    """Per component of a profiled step: the bytes it must read, its share of the critical path, the
    bandwidth those imply and its fraction of the copy bandwidth: where the step falls short of the
    roofline. Under PDL a kernel's wait overlaps its predecessor, so the critical share, not the
    kernel's own duration, is the time its bytes cost the step."""
    groups = {name: list(fields) for name, fields in COMPONENT_BYTES.items()}
    if "router" not in by_component:
        groups["experts"] += groups.pop("router")
    if "kda front" in by_component:
        groups["kda front"] = ["kda_inputs", *groups.pop("kda")]
    else:
        groups["projections"].append("kda_inputs")
    out: dict[str, dict[str, float]] = {}
    for name, fields in groups.items():
        nbytes = sum(traffic.get(f, 0) for f in fields)
        us = by_component.get(name, {}).get("critical_us", 0.0)
        if nbytes and us > 0:
            gbs = nbytes / us / 1e3
            out[name] = {"bytes": nbytes, "critical_us": us, "gbs": round(gbs, 1), "of_copy": round(gbs / copy_gbs, 4)}
    return out


STEPS = ("fused", "reference", "auto")
# modifiers of the fused step, joined with '+': pdl (its kernels under PDL: one-token calls, and verification's
# where the CUDA kernels serve it), pdlall (verification's always), triton / cuda / cuda1 (the step kernels;
# cuda1: CUDA for one-token calls only, verification on Triton), seprouter (one token's MoE router in its own
# kernel, not inside the persistent MoE kernel), inshared (the shared expert inside the persistent MoE kernel
# too, --moe-shared fused; measured slower, for A/B runs), handoff and latewait (the lab switches
# FusedDecodeStep.handoff and .shared_late_wait, for A/B runs until measured), beside (the lab switch
# FusedDecodeStep.shared_beside_router: verification's shared gate_up on a side stream beside its router, the product's
# on the cards of SHARED_BESIDE_CARDS; nobeside turns it off), downbeside / nodownbeside (FusedDecodeStep.
# shared_down_beside, with beside: the shared down beside the router too, the routed experts' down kernel adding both
# onto x; the product's on the cards of SHARED_DOWN_BESIDE_CARDS), bulk (the
# lab switch FusedDecodeStep.ring_big_projections: the big projections' weights through bulk rings, 2 blocks of 8
# warps an SM), kdafront / nokdafront (FusedDecodeStep.fuse_kda_front: one token's KDA norm, projection and recurrence
# in one launch, the product's build KDA_FRONT_BUILD, on or off whatever the card's product: it is on the cards of
# KDA_FRONT_CARDS)
STEP_MODIFIERS = (
    "pdl",
    "pdlall",
    "triton",
    "cuda",
    "cuda1",
    "seprouter",
    "inshared",
    "handoff",
    "latewait",
    "beside",
    "nobeside",
    "downbeside",
    "nodownbeside",
    "bulk",
    "kdafront",
    "nokdafront",
)
# modifier -> (FusedDecodeStep attribute, the value it sets)
LAB_SWITCHES = {
    "handoff": ("handoff", True),
    "latewait": ("shared_late_wait", True),
    "beside": ("shared_beside_router", True),
    "nobeside": ("shared_beside_router", False),
    "downbeside": ("shared_down_beside", True),
    "nodownbeside": ("shared_down_beside", False),
}


@dataclass
class Config:
    moe_backend: str
    lm_head: str
    decode_step: str  # one of STEPS, the fused one optionally with modifiers: fused+cuda+pdl

    @property
    def name(self) -> str:
        return f"{self.moe_backend}/{self.lm_head}/{self.decode_step}"

    @property
    def step(self) -> str:
        """The FastPathOptions decode step (without the modifiers)."""
        return self.decode_step.split("+")[0]

    @property
    def modifiers(self) -> list[str]:
        return self.decode_step.split("+")[1:]

    @property
    def pdl(self) -> bool:
        return "pdl" in self.modifiers or "pdlall" in self.modifiers

    @property
    def step_kernels(self) -> str:
        kernels = [m for m in self.modifiers if m in ("triton", "cuda", "cuda1")]
        return {"cuda1": "cuda"}.get(kernels[0], kernels[0]) if kernels else "auto"

    @property
    def step_kernel_tokens(self) -> int:
        return 1 if "cuda1" in self.modifiers else 8

    @property
    def moe_router(self) -> bool | None:
        return False if "seprouter" in self.modifiers else None

    @property
    def moe_shared(self) -> bool | None:
        return True if "inshared" in self.modifiers else None


def parse_configs(text: str) -> list[Config]:
    """'cuda:fp8:fused,cuda:fp8:fused+pdl,cuda:fp8:fused+triton,triton:fp8:reference' -> configurations."""
    configs = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) != 3:
            raise ValueError(f"--configs item '{item}': expected MOE_BACKEND:LM_HEAD:DECODE_STEP, e.g. cuda:fp8:fused")
        config = Config(*parts)
        mods = config.modifiers
        if config.step not in STEPS:
            raise ValueError(f"--configs item '{item}': the decode step is one of {', '.join(STEPS)}")
        if mods and config.step != "fused" or any(m not in STEP_MODIFIERS for m in mods) or len(set(mods)) < len(mods):
            raise ValueError(
                f"--configs item '{item}': only the fused step takes modifiers, each once, joined by '+': "
                f"{', '.join(STEP_MODIFIERS)} (e.g. fused+cuda+pdl)"
            )
        if sum(m in ("triton", "cuda", "cuda1") for m in mods) > 1:
            raise ValueError(f"--configs item '{item}': the step kernels are one of triton, cuda, cuda1")
        if "pdl" in mods and "pdlall" in mods:
            raise ValueError(f"--configs item '{item}': pdlall includes pdl; give one")
        if "kdafront" in mods and "nokdafront" in mods:
            raise ValueError(f"--configs item '{item}': kdafront turns the KDA front on, nokdafront off; give one")
        if "beside" in mods and "nobeside" in mods:
            raise ValueError(
                f"--configs item '{item}': beside turns the shared gate_up beside the router on, nobeside off; give one"
            )
        if "downbeside" in mods and "nodownbeside" in mods:
            raise ValueError(
                f"--configs item '{item}': downbeside turns the shared down beside the router on, nodownbeside off; "
                "give one"
            )
        configs.append(config)
    return configs


# --------------------------------------------------------------------------------------------- timing
def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read plus bytes written)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / repeats
    del src, dst
    return nbytes / seconds


def time_graph(graph: torch.cuda.CUDAGraph, replays: int = 50, rounds: int = 5) -> float:
    """Median over `rounds` of the mean time of `replays` back-to-back replays, in seconds."""
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / replays)
    return sorted(times)[len(times) // 2]


def profile_graph(graph: torch.cuda.CUDAGraph) -> dict[str, Any]:
    """Kernels launched by one replay and their time by component, from the profiler's kernel events:
    `us` sums each kernel's own duration (under PDL a kernel starts early and waits, so these overlap),
    `critical_us` what each kernel adds to the replay's end (see `critical_path`), which sums to the
    replay's span whatever the launch mode."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.time_range.start)
    timed = [(e.name, float(e.time_range.start), float(e.time_range.start) + _device_us(e)) for e in kernels]
    return summarize_kernels(timed)


def critical_path(kernels: list[tuple[str, float, float]]) -> list[float]:
    """What each kernel (name, start us, end us; in launch order) adds to the end of the work: the
    time by which its end passes the latest end before it (0 when it ends earlier). An idle gap before
    a kernel counts as its own (its launch). The values sum to the span from the first start to the
    last end, so under programmatic dependent launch, where each kernel starts while its predecessor
    runs and its own duration includes the wait, they still split the step's time without overlap."""
    added, frontier = [], kernels[0][1] if kernels else 0.0
    for _, _, end in kernels:
        added.append(max(0.0, end - frontier))
        frontier = max(frontier, end)
    return added


def summarize_kernels(kernels: list[tuple[str, float, float]]) -> dict[str, Any]:
    """Kernel count, time by component (own durations and critical-path shares), and every kernel's
    (name, own us, added us) in launch order, from (name, start us, end us) in launch order."""
    added = critical_path(kernels)
    by_component: dict[str, dict[str, float]] = {}
    for (name, start, end), extra in zip(kernels, added, strict=True):
        entry = by_component.setdefault(component_of(name), {"kernels": 0, "us": 0.0, "critical_us": 0.0})
        entry["kernels"] += 1
        entry["us"] += end - start
        entry["critical_us"] += extra
    return {
        "first_kernels": [(name[:40], round(end - start, 1)) for name, start, end in kernels[:40]],
        "kernels": len(kernels),
        "kernel_us": round(sum(v["us"] for v in by_component.values()), 1),
        "span_us": round(kernels[-1][2] - kernels[0][1], 1) if kernels else 0.0,
        "by_component": {
            k: {"kernels": int(v["kernels"]), "us": round(v["us"], 1), "critical_us": round(v["critical_us"], 1)}
            for k, v in by_component.items()
        },
        "timeline": [
            (name[:40], round(end - start, 2), round(extra, 2))
            for (name, start, end), extra in zip(kernels, added, strict=True)
        ],
    }


def _device_us(event) -> float:
    return event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total


def component_of(kernel_name: str) -> str:
    name = kernel_name.lower()
    for component, pattern in COMPONENTS:
        if re.search(pattern, name):
            return component
    return "other"


# --------------------------------------------------------------------------------------------- one config
def load(args: argparse.Namespace, config: Config):
    from solo.fastpath import FastPathOptions, accelerate

    device = torch.device(args.device)
    options = FastPathOptions(
        moe_backend=config.moe_backend,
        lm_head=config.lm_head,
        block_fp8=args.block_fp8,
        decode_step=config.step,
        pdl=config.pdl,
        step_kernels=config.step_kernels,
        step_kernel_tokens=config.step_kernel_tokens,
        pdl_verify=True if "pdlall" in config.modifiers else None,
        moe_router=config.moe_router,
        moe_shared=config.moe_shared,
        verify_tokens=args.verify_tokens,
    )
    t0 = time.perf_counter()
    if args.random_weights:
        from solo.checkpoint.synthetic import load_random_model, synthetic_config

        model_config = synthetic_config(args.random_weights, args.num_layers, args.num_experts, args.vocab_size)
        model = load_random_model(model_config, device, torch.bfloat16, seed=args.seed)
    else:
        from solo.checkpoint.loader import LoadOptions, load_model

        model = load_model(args.model, LoadOptions(device, torch.bfloat16))
    loaded = time.perf_counter() - t0
    accelerate(model, options)
    switches = [LAB_SWITCHES[m] for m in config.modifiers if m in LAB_SWITCHES]
    step = model.decode_step
    lab = switches or {"bulk", "kdafront", "nokdafront"} & set(config.modifiers)
    if lab and step is not None:  # (modifiers come with the fused step only)
        for switch, value in switches:
            setattr(step, switch, value)
        if "bulk" in config.modifiers and not step.ring_big_projections():
            raise ValueError(f"{config.name}: bulk rings the CUDA step kernels' projections; this step has none")
        if "kdafront" in config.modifiers:
            from solo.fastpath.decode_step import KDA_FRONT_BUILD

            step.fuse_kda_front(True, **KDA_FRONT_BUILD)  # (all KDA layers or a StepKernelsUnavailable naming why not)
        if "nokdafront" in config.modifiers:
            step.fuse_kda_front(False)
        step.warmup()  # (their kernels compiled before any capture)
    return model, {"load_s": round(loaded, 1), "accelerate_s": round(time.perf_counter() - t0 - loaded, 1)}


def measure_config(args: argparse.Namespace, config: Config, config_index: int = 0) -> dict[str, Any]:
    from solo.engine.graphs import EagerStep, GraphCapture, graph_safe_generators
    from solo.engine.sampling import SamplingParams
    from solo.engine.traffic import decode_traffic
    from solo.model.cache import HybridCache
    from solo.speculative.nextn import NextNDecoder, SpeculativeConfig

    model, times = load(args, config)
    device = model.device
    contexts = sorted(args.context)
    max_len = max(contexts) + 2 * args.verify_tokens + 8
    result: dict[str, Any] = {"config": config.name, **times, "contexts": {}}
    result["decode_step"] = "fused" if model.decode_step is not None else "reference"
    if model.decode_step is not None:
        result["step_kernels"] = model.decode_step.kernels
        if model.decode_step.kernels_note:
            result["step_kernels_note"] = model.decode_step.kernels_note
        result["routers_in_experts"] = len(model.decode_step.routers_in_experts())
        result["window_rings"] = model.decode_step.window_rings()
        result["l2_next"] = dict(model.decode_step.l2_next)  # what each MoE kernel asks the L2 for (this card's)
        result["mla_early_chunks"] = model.decode_step.mla_early_chunks()  # (this card's)
        result["mla_gluon"] = model.decode_step.mla_gluon()  # (this card's)
        result["mla_gluon_window"] = model.decode_step.mla_gluon_window()  # (verification's; this card's)
        result["gate_up_window"] = model.decode_step.gate_up_window()  # the MoE kernels' window (this card's)
        result["shared_beside_router"] = model.decode_step.shared_beside_router  # (verification's; this card's)
        result["shared_down_beside"] = model.decode_step.shared_expert_beside_router()  # (... its down too)
    if model.decode_step is None and getattr(model, "decode_step_note", ""):
        result["decode_step_note"] = model.decode_step_note
    result["copy_bandwidth_gbs"] = round(copy_bandwidth(device) / 1e9, 1)
    window = args.verify_tokens
    # the product's caches: plain decoding's, and speculation's with its own verification history
    # (rolled back lazily by the fused step's rounds, whose KDA kernel then follows kda_source)
    plain_cache = HybridCache(model.config, max_len, device, model.dtype, with_nextn=True)
    cache = HybridCache(model.config, max_len, device, model.dtype, with_nextn=True, verify_window=window)
    graphs = GraphCapture()
    step = EagerStep(model)
    history = cache.verification
    ids1 = torch.randint(0, model.config.vocab_size, (1,), device=device)
    idsw = torch.randint(0, model.config.vocab_size, (window,), device=device)
    pos1 = torch.zeros(1, dtype=torch.long, device=device)
    posw = torch.zeros(window, dtype=torch.long, device=device)
    decode_graph, _ = graphs.capture(lambda: step(ids1, pos1, plain_cache))
    verify_graph, _ = graphs.capture(lambda: step(idsw, posw, cache, history))
    hidden1 = torch.randn(1, model.config.hidden_size, device=device, dtype=model.dtype)
    draft_graph = round_graph = sampled_graph = None
    spec = None
    if model.nextn is not None:
        draft_graph, _ = graphs.capture(lambda: model.logits(model.draft_forward(ids1, hidden1, pos1 + 1, cache)))
        spec = NextNDecoder(model, SpeculativeConfig(num_steps=window - 1, num_draft_tokens=window))
        state = spec.state_for(cache)
        greedy = SamplingParams()
        state.drafts.random_(0, model.config.vocab_size)

        def one_round() -> None:  # every replay starts at the same position (a round advances it)
            state.position.copy_(pos1)
            spec.round(state, cache, greedy, None)

        round_graph, _ = graphs.capture(one_round)
        if graph_safe_generators():  # the round at the GSM8K workload's sampling setting
            sampled = SamplingParams(**GSM8K_SAMPLING)
            generator = torch.Generator(device=device)
            generator.manual_seed(int(torch.randint(0, 2**31 - 1, ())))

            def sampled_round() -> None:
                state.position.copy_(pos1)
                spec.round(state, cache, sampled, generator)

            sampled_graph, _ = graphs.capture(sampled_round, generator)
    for context in contexts:
        position = context - window - 1  # the window's last token sits at context - 2: the cache is full
        pos1.fill_(position)
        posw.copy_(torch.arange(position, position + window, device=device))
        entry: dict[str, Any] = {}
        traffic = decode_traffic(model, context)
        entry["bytes_per_token"] = traffic.to_dict()
        entry["decode_ms"] = time_graph(decode_graph) * 1e3
        entry["verify_ms"] = time_graph(verify_graph) * 1e3
        if draft_graph is not None and round_graph is not None and spec is not None:
            entry["draft_step_ms"] = time_graph(draft_graph) * 1e3
            entry["round_ms"] = time_graph(round_graph) * 1e3
        if sampled_graph is not None:
            entry["round_sampled_ms"] = time_graph(sampled_graph) * 1e3
        roofline_ms = traffic.total / (result["copy_bandwidth_gbs"] * 1e9) * 1e3
        entry["roofline_ms"] = roofline_ms
        entry["roofline_fraction"] = roofline_ms / entry["decode_ms"]
        entry["decode_tok_s"] = 1e3 / entry["decode_ms"]
        entry["verify_over_decode"] = entry["verify_ms"] / entry["decode_ms"]
        if "round_ms" in entry:
            entry["round_over_decode"] = entry["round_ms"] / entry["decode_ms"]
            entry["nextn_tok_s"] = {str(a): a * 1e3 / entry["round_ms"] for a in args.accept_lengths}
        if "round_sampled_ms" in entry:
            entry["round_sampled_over_decode"] = entry["round_sampled_ms"] / entry["decode_ms"]
            entry["nextn_tok_s_sampled"] = {str(a): a * 1e3 / entry["round_sampled_ms"] for a in args.accept_lengths}
        entry["profile"] = profile_graph(decode_graph)
        entry["component_bandwidth"] = component_bandwidth(
            entry["bytes_per_token"], entry["profile"]["by_component"], result["copy_bandwidth_gbs"]
        )
        entry["profile_verify"] = profile_graph(verify_graph)
        if round_graph is not None:
            entry["profile_round"] = profile_graph(round_graph)
        if sampled_graph is not None:
            entry["profile_round_sampled"] = profile_graph(sampled_graph)
        result["contexts"][str(context)] = entry
    cache.reset()
    plain_cache.reset()
    if args.prefill and config_index == 0:  # the prefill runs the same reference layers in every configuration
        result["prefill_s"] = measure_prefill(model, args.prefill)
    if args.loop_tokens:
        result["loop"] = measure_loop(model, args, window)
    if model.decode_step is not None:
        result["fused_launches"] = model.decode_step.launches()
        if config.pdl:  # what the compiled kernels say, per family: asked for is not launched with
            result["pdl_families"] = model.decode_step.launch.families_with_pdl()
    return result


def measure_prefill(model, lengths: list[int]) -> dict[str, float]:
    """Seconds to prefill a prompt of each length (the model's own prefill, in chunks of PREFILL_CHUNK)."""
    from solo.model.cache import HybridCache
    from solo.model.ling import PREFILL_CHUNK

    out = {}
    for n in lengths:
        cache = HybridCache(model.config, n + 1, model.device, model.dtype, with_nextn=True)
        ids = torch.randint(0, model.config.vocab_size, (n,), device=model.device)
        with torch.inference_mode():
            # warm at the size of the timed chunks (kernels built per token count, allocations): a warm-up of
            # 64 tokens left the first length's time with the first calls of its chunk size in it
            model.prefill(ids[: min(n, PREFILL_CHUNK)], cache)
            cache.reset()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.prefill(ids, cache)
            torch.cuda.synchronize()
        out[str(n)] = round(time.perf_counter() - t0, 4)
        del cache
    return out


def measure_loop(model, args: argparse.Namespace, window: int) -> dict[str, Any]:
    """The engine's real generation loop (plain greedy, graphs on) against its own graph timing."""
    from solo.engine.engine import Engine, GenerationParams
    from solo.engine.graphs import EagerStep, GraphCapture
    from solo.model.cache import HybridCache
    from solo.tokenizer import Tokenizer, synthetic_tokenizer

    prompt_len, tokens = 64, args.loop_tokens
    engine = Engine(model, Tokenizer(synthetic_tokenizer(model.config.vocab_size)))
    engine.enable_cuda_graphs(prompt_len + tokens + 8)
    prompt = torch.randint(0, model.config.vocab_size, (prompt_len,)).tolist()
    params = GenerationParams(max_tokens=tokens, ignore_eos=True)
    engine.generate(prompt, params)  # warm
    result = engine.generate(prompt, params)
    # the same step at the loop's average position, from a graph of its own
    cache = HybridCache(model.config, prompt_len + tokens + 8, model.device, model.dtype, with_nextn=True)
    step = EagerStep(model)
    ids = torch.randint(0, model.config.vocab_size, (1,), device=model.device)
    pos = torch.full((1,), prompt_len + tokens // 2, dtype=torch.long, device=model.device)
    graph, _ = GraphCapture().capture(lambda: step(ids, pos, cache))
    graph_ms = time_graph(graph) * 1e3
    tpot_ms = (result.stats.tpot_s or 0.0) * 1e3
    return {
        "prompt_tokens": prompt_len,
        "tokens": tokens,
        "tpot_ms": tpot_ms,
        "graph_step_ms": graph_ms,
        "loop_over_graph": tpot_ms / graph_ms if graph_ms else None,
    }


# --------------------------------------------------------------------------------------------- report
def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| config | context | decode ms | roofline ms | of roofline | verify ms | draft step ms | round ms |"
        " round/decode | NEXTN tok/s @" + "/".join(str(a) for a in ACCEPT_LENGTHS) + " | sampled round ms |"
        " sampled round/decode | sampled NEXTN tok/s | kernels/step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---:|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['config']} | - | failed: {r['error'][:80]} |||||||||")
            continue
        for context, e in r["contexts"].items():
            nextn = "/".join(f"{v:.0f}" for v in e.get("nextn_tok_s", {}).values()) or "-"
            sampled = "/".join(f"{v:.0f}" for v in e.get("nextn_tok_s_sampled", {}).values()) or "-"
            lines.append(
                f"| {r['config']} ({r['decode_step']}) | {context} | {e['decode_ms']:.3f} | {e['roofline_ms']:.3f} |"
                f" {100 * e['roofline_fraction']:.1f}% | {e['verify_ms']:.3f} | {e.get('draft_step_ms', 0):.3f} |"
                f" {e.get('round_ms', 0):.3f} | {e.get('round_over_decode', 0):.2f} | {nextn} |"
                f" {e.get('round_sampled_ms', 0):.3f} | {e.get('round_sampled_over_decode', 0):.2f} | {sampled} |"
                f" {e['profile']['kernels']} |"
            )

    def section(title: str, key: str, describe: Callable[[dict[str, Any]], str]) -> None:
        """A line per configuration and context that has `key`, and the title above them, if any has."""
        found = [(r["config"], context, e.get(key)) for r in results for context, e in r.get("contexts", {}).items()]
        found = [(config, context, value) for config, context, value in found if value]
        if found:
            lines.extend(["", title, ""] + [f"- {c} @ {context}: {describe(v)}" for c, context, v in found])

    def bandwidth(parts: dict[str, dict[str, float]]) -> str:
        return ", ".join(
            f"{k} {v['bytes'] / 1e9:.2f} GB in {v['critical_us']:.0f} us = {v['gbs']:.0f} GB/s"
            f" ({100 * v['of_copy']:.0f}%)"
            for k, v in sorted(parts.items(), key=lambda kv: -kv[1]["critical_us"])
        )

    def components(profile: dict[str, Any]) -> str:
        parts = sorted(profile["by_component"].items(), key=lambda kv: -kv[1].get("critical_us", 0.0))
        shares = ", ".join(f"{k} {v.get('critical_us', 0.0):.0f} ({v['us']:.0f})" for k, v in parts)
        return f"{profile['kernels']} kernels; {shares}"

    prefills = [(r["config"], r["prefill_s"]) for r in results if r.get("prefill_s")]
    if prefills:
        lines.extend(["", "Prefill (the model's prefill in chunks; seconds, prompt tokens a second):", ""])
        for config, times in prefills:
            each = ", ".join(f"{int(n):,} tokens {s:.2f} s ({int(n) / s:,.0f} tok/s)" for n, s in times.items())
            lines.append(f"- {config}: {each}")
    loops = [(r["config"], r["loop"]) for r in results if r.get("loop")]
    if loops:
        lines.extend(["", "The engine's generation loop (greedy, graphs) against the decode step's graph:", ""])
        for config, loop in loops:
            ratio = loop.get("loop_over_graph")
            lines.append(
                f"- {config}: {loop['tokens']} tokens after a {loop['prompt_tokens']}-token prompt, TPOT"
                f" {loop['tpot_ms']:.3f} ms against {loop['graph_step_ms']:.3f} ms"
                + (f" ({ratio:.3f}x)" if ratio else " (no graph time)")
            )
    section(
        "Decode step, each component's bytes over its critical-path time (of the copy bandwidth):",
        "component_bandwidth",
        bandwidth,
    )
    for key, title in (
        ("profile", "Decode step"),
        ("profile_verify", "Verification"),
        ("profile_round", "NEXTN round (greedy)"),
        ("profile_round_sampled", "NEXTN round (sampled as GSM8K)"),
    ):
        section(f"{title} by component, us on the critical path (own kernel time in brackets):", key, components)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available() or not str(args.device).startswith("cuda"):
        raise ValueError("solo bench decode measures CUDA graphs: it needs an NVIDIA GPU (--device cuda).")
    if not args.random_weights and not args.model:
        raise ValueError("solo bench decode: pass --model PATH or --random-weights ling-3.0-flash.")
    configs = parse_configs(args.configs)
    if args.one is not None:  # the child process: one configuration
        print(json.dumps(measure_config(args, configs[args.one], args.one), default=float))
        return 0
    results = []
    for i, config in enumerate(configs):
        cmd = [sys.executable, "-m", "solo.cli", *sys.argv[1:], "--one", str(i)]
        print(f"[bench decode] {config.name} ...", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            reason = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
            results.append({"config": config.name, "error": reason})
            print(proc.stderr[-4000:], file=sys.stderr)
            continue
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    report = {"environment": environment(), "args": settings, "results": results}
    table = markdown(results)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=float))
    return 0 if all("error" not in r for r in results) else 1


def environment() -> dict[str, Any]:
    import platform

    import triton

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
    try:
        info["commit"] = subprocess.run(
            ["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except OSError:
        info["commit"] = ""
    info["source_sha256"] = source_digest()  # the code that ran, whatever the checkout's git state
    return info


def source_digest() -> str:
    """sha256 over solo's Python and CUDA sources (names and contents), first 16 hex digits."""
    import hashlib

    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cu", ".cuh")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint folder (or --random-weights)")
    p.add_argument(
        "--random-weights", default=None, metavar="PRESET", help="random fp4-format weights at a shape: ling-3.0-flash"
    )
    p.add_argument("--num-layers", type=int, default=None, help="with --random-weights: fewer layers")
    p.add_argument("--num-experts", type=int, default=None, help="with --random-weights: fewer experts")
    p.add_argument("--vocab-size", type=int, default=None, help="with --random-weights: a smaller vocabulary")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--configs", default="cuda:fp8:fused", help="MOE:HEAD:STEP,... e.g. cuda:fp8:fused,cuda:fp8:reference"
    )
    p.add_argument("--block-fp8", default="on", choices=("auto", "on", "off"))
    p.add_argument("--context", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 32768])
    p.add_argument("--verify-tokens", type=int, default=4)
    p.add_argument("--prefill", type=lambda s: [int(x) for x in s.split(",") if x], default=[1024, 8192, 32768])
    p.add_argument("--loop-tokens", type=int, default=128, help="tokens of the real-loop measurement (0: skip)")
    p.add_argument("--accept-lengths", type=lambda s: [float(x) for x in s.split(",")], default=list(ACCEPT_LENGTHS))
    p.add_argument("--json", default=None, help="write the full report here")
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
