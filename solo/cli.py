"""The `solo` command line: generate, quantize, make-tiny."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from solo.assets import bundled_model_path
from solo.kernels.registry import MOE_BACKENDS
from solo.quantization.lm_head import LM_HEAD_MODES

DEFAULT_MODEL = bundled_model_path()
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit code 2."""


def default_model() -> str | None:
    return str(DEFAULT_MODEL) if (DEFAULT_MODEL / "config.json").is_file() else None


class OnceOnly(argparse.Action):
    """An option that may be given once: a second, different value is an error, not silently the last."""

    def __call__(self, parser, namespace, values, option_string=None):
        seen = f"_{self.dest}_given"
        if getattr(namespace, seen, False) and getattr(namespace, self.dest) != values:
            first = getattr(namespace, self.dest)
            hint = CONFLICT_HINTS.get(frozenset((first, values)), "choose one")
            parser.error(f"{option_string} given twice ({first} and {values}): {hint}.")
        setattr(namespace, self.dest, values)
        setattr(namespace, seen, True)


CONFLICT_HINTS = {
    frozenset(("fp8", "fp32")): "fp8 quantizes the LM head to FP8 while fp32 computes it in FP32; "
    "they cannot be combined, choose one",
}


def add_model_options(p: argparse.ArgumentParser) -> None:
    """Options shared by every command that loads a model (generate, check, serve, bench)."""
    p.add_argument("--model", default=default_model(), help="checkpoint folder (default: the bundled model)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="compute dtype (default: bfloat16 on GPU, float32 on CPU)",
    )
    p.add_argument(
        "--moe-backend",
        choices=MOE_BACKENDS,
        default="torch",
        action=OnceOnly,
        help="routed-expert kernels (default: torch reference)",
    )
    p.add_argument(
        "--lm-head",
        choices=LM_HEAD_MODES,
        default="bf16",
        action=OnceOnly,
        help="LM head precision: bf16 (default), fp32, or fp8 quantized online at load",
    )
    p.add_argument(
        "--block-fp8",
        choices=("auto", "off", "on"),
        default="auto",
        action=OnceOnly,
        help="block-FP8 checkpoints' attention, shared-expert and dense layers: on keeps their FP8 weights "
        "and runs the Triton block-FP8 GEMV (half the bytes of BF16); auto (default) does so on a GPU for "
        "layers with K >= 1536, where it is faster than BF16; off dequantizes them all at load",
    )

    p.add_argument(
        "--decode-step",
        choices=("auto", "fused", "reference"),
        default="auto",
        action=OnceOnly,
        help="decode and verification forwards: fused (a few fused GPU kernels per layer; GPU, bf16), reference "
        "(the model's modules), auto (default: fused where it can run, else reference, with the reason)",
    )
    p.add_argument(
        "--pdl",
        choices=("auto", "off", "on"),
        default="auto",
        action=OnceOnly,
        help="programmatic dependent launch between the fused decode step's kernels (Hopper or later): each "
        "kernel is launched while the previous one finishes and loads its weights before waiting for it; "
        "one-token calls, and NEXTN verification where the CUDA GEMV serves it; on needs the fused step; "
        "auto (default): on with the CUDA step kernels on Hopper "
        "(compare with `solo bench decode --configs cuda:fp8:fused+cuda,cuda:fp8:fused+cuda+pdl`)",
    )
    p.add_argument(
        "--step-kernels",
        choices=("auto", "triton", "cuda"),
        default="auto",
        action=OnceOnly,
        help="the fused decode step's projections (decode and NEXTN verification) and one-token routers: cuda "
        "(CUDA kernels compiled by NVRTC for the exact shapes; Hopper), triton, or auto (default: cuda where "
        "every one can run, else triton)",
    )
    p.add_argument(
        "--moe-router",
        choices=("auto", "fused", "separate"),
        default="auto",
        action=OnceOnly,
        help="one token's MoE router in the fused decode step: fused (inside the persistent MoE kernel of "
        "--moe-backend cuda, with the CUDA step kernels: no router launch), separate (its own kernel), or auto "
        "(default: fused where it can run)",
    )
    p.add_argument(
        "--moe-shared",
        choices=("auto", "fused", "separate"),
        default="auto",
        action=OnceOnly,
        help="one token's shared expert in the fused decode step: fused (inside the persistent MoE kernel, "
        "with the router there: no shared gate_up and down launches; measured slower on the H200, for A/B "
        "runs), separate (its own two kernels), or auto (default: separate)",
    )
    add_graph_options(p)
    p.add_argument(
        "--speculative-algorithm",
        default=None,
        metavar="NEXTN",
        help="speculative decoding with the checkpoint's NEXTN (MTP) layer",
    )
    p.add_argument("--speculative-num-steps", type=int, default=3, help="draft steps per round (default 3)")
    p.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=4,
        help="tokens verified per round: num-steps + 1 (default 4)",
    )
    p.add_argument("--speculative-eagle-topk", type=int, default=1, help="draft tree width; only 1 (a chain)")
    p.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="N",
        help="split the model over N processes (attention heads, MLPs, experts, LM head), launched with "
        "torchrun --nproc-per-node N -m solo.cli ... (NCCL on GPUs, gloo on CPUs; default 1)",
    )
    p.add_argument(
        "--moe-split",
        choices=("auto", "expert", "width"),
        default="auto",
        help="with --tensor-parallel: routed experts split by expert (expert parallel) or by width (each "
        "expert's intermediate slice); auto (default): width where the shapes allow it, else by expert",
    )


def add_graph_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cuda-graphs",
        choices=("auto", "on", "off"),
        default="auto",
        help="replay decode/verify steps from CUDA graphs (auto: on for CUDA devices)",
    )
    p.add_argument("--max-context", type=int, default=4096, help="positions of the pinned cache with CUDA graphs")


def add_preflight_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allow-fallback",
        action="store_true",
        help="start even if a requested optimization is not active (loud warning instead of exit)",
    )
    p.add_argument(
        "--min-accept-length",
        type=float,
        default=1.2,
        help="MTP calibration: the accept length below which speculation counts as not working",
    )


def run_checks(engine, args: argparse.Namespace):
    """The start-up checks for the optimizations the command line asked for."""
    from solo.preflight.checks import run_preflight

    return run_preflight(
        engine,
        args.moe_backend,
        args.lm_head,
        args.speculative_algorithm is not None,
        args.min_accept_length,
        cuda_graphs=engine.graphs_max_len is not None,
        block_fp8=args.block_fp8,
        decode_step=args.decode_step,
        tensor_parallel=args.tensor_parallel,
    )


def leader(args: argparse.Namespace) -> bool:
    """Whether this process speaks (prints, serves, writes reports): always, but for tensor-parallel
    ranks > 0, which run the same model quietly."""
    tp = getattr(args, "tp", None)
    return tp is None or tp.leader


def preflight(engine, args: argparse.Namespace, quiet: bool = False):
    """Run the start-up checks; a requested optimization that is not active ends the program,
    unless --allow-fallback turns that into a loud warning."""
    from solo.preflight.checks import PreflightFailed

    report = run_checks(engine, args)
    if not quiet and leader(args):
        print(report.text(), file=sys.stderr)
    if report.failed:
        names = ", ".join(f"{c.name} ({c.reason})" for c in report.failed)
        if not args.allow_fallback:
            raise PreflightFailed(
                f"requested optimization not active: {names}. Fix it, or pass --allow-fallback to run anyway."
            )
        if leader(args):
            print(f"solo: WARNING: running with inactive optimizations: {names}", file=sys.stderr)
    return report


def speculative_config(args: argparse.Namespace):
    if args.speculative_algorithm is None:
        return None
    from solo.speculative.nextn import SpeculativeConfig

    return SpeculativeConfig(
        algorithm=args.speculative_algorithm,
        num_steps=args.speculative_num_steps,
        num_draft_tokens=args.speculative_num_draft_tokens,
        topk=args.speculative_eagle_topk,
    )


def load_options(args: argparse.Namespace) -> dict:
    if args.model is None:
        raise UsageError("no model: pass --model PATH (a Ling-3.0 checkpoint folder).")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: no CUDA GPU is visible. Use --device cpu.")
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    graphs = args.cuda_graphs == "on" or (args.cuda_graphs == "auto" and device.startswith("cuda"))
    if graphs and not device.startswith("cuda"):
        raise UsageError("--cuda-graphs on needs --device cuda.")
    from solo.distributed.parallel import init_tensor_parallel

    # before the model loads: a wrong launch fails at once; under torchrun "cuda" is this rank's GPU
    args.tp = init_tensor_parallel(args.tensor_parallel, device, args.moe_split)
    if args.tp.enabled:
        device = str(args.tp.device)
    return dict(
        tensor_parallel=args.tp,
        cuda_graphs=graphs,
        max_context=args.max_context,
        device=device,
        dtype=dtype,
        moe_backend=args.moe_backend,
        lm_head=args.lm_head,
        block_fp8=args.block_fp8,
        decode_step=args.decode_step,
        pdl={"on": True, "off": False}.get(args.pdl),
        step_kernels=args.step_kernels,
        moe_router={"fused": True, "separate": False}.get(args.moe_router),
        moe_shared={"fused": True, "separate": False}.get(args.moe_shared),
        verify_tokens=args.speculative_num_draft_tokens,
        speculative=speculative_config(args),
    )


# --------------------------------------------------------------------------- generate
def cmd_generate(args: argparse.Namespace) -> int:
    from solo.engine.engine import Engine, GenerationParams
    from solo.engine.sampling import SamplingParams

    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    params = GenerationParams(max_tokens=args.max_tokens, sampling=sampling, stop=tuple(args.stop or ()))
    engine = Engine.from_pretrained(args.model, **load_options(args))
    preflight(engine, args, quiet=args.json)
    prompt = args.prompt if args.prompt != "-" else sys.stdin.read()
    if args.json:
        result = engine.generate(prompt, params, chat=args.chat)
        report = {
            "text": result.text,
            "token_ids": result.token_ids,
            "finish_reason": result.finish_reason,
            "stats": result.stats.to_dict(),
            "engine": engine.describe(),
        }
        print(json.dumps(report))
        return 0
    generation = engine.stream(prompt, params, chat=args.chat)
    for event in generation:
        sys.stdout.write(event.text)
        sys.stdout.flush()
    result = generation.result
    assert result is not None
    s = result.stats
    rate = f"{s.decode_tok_per_s:.1f} tok/s" if s.decode_tok_per_s else "n/a"
    if s.decode_gb_per_s:
        rate += f" ({s.decode_gb_per_s:.2f} GB/s)"
    line = f"\n[{s.completion_tokens} tokens, TTFT {s.ttft_s * 1e3:.1f} ms, decode {rate}"
    if s.accept_length is not None:
        line += f", accept length {s.accept_length:.2f}"
    used = engine.describe()
    line += f", finish: {result.finish_reason}; lm head {used['lm_head']['mode']}"
    if s.tensor_parallel:
        t = s.tensor_parallel
        line += (
            f"; TP{engine.tp.world} {engine.tp.transport}: {t['all_reduces_per_token']:g} all-reduces/token, "
            f"{t['all_reduce_us_mean']} us each, collectives {100 * (t['share_of_time'] or 0):.0f}% of the time"
        )
    if leader(args):
        print(line + f", moe {used['moe_backend']}]", file=sys.stderr)
    return 0


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt, streaming")
    add_model_options(p)
    add_preflight_options(p)
    p.add_argument("prompt", help="prompt text ('-' reads stdin)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the Ling chat format")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.set_defaults(func=cmd_generate)


# --------------------------------------------------------------------------- check
def cmd_check(args: argparse.Namespace) -> int:
    from solo.engine.engine import Engine
    from solo.preflight.checks import PreflightFailed

    engine = Engine.from_pretrained(args.model, **load_options(args))
    report = run_checks(engine, args)
    if not leader(args):
        pass
    elif args.json:
        print(json.dumps({"model": args.model, "engine": engine.describe(), **report.to_dict()}, indent=2))
    else:
        print(report.text())
    if report.failed and not args.allow_fallback:
        raise PreflightFailed("requested optimization not active: " + ", ".join(c.name for c in report.failed))
    return 0


def add_check(sub) -> None:
    p = sub.add_parser("check", help="prove every requested optimization is live (ACTIVE/FAILED with evidence)")
    add_model_options(p)
    add_preflight_options(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_check)


# --------------------------------------------------------------------------- bench
def cmd_bench(args: argparse.Namespace) -> int:
    from solo.bench import harness

    if args.url and args.tensor_parallel > 1:
        raise UsageError(
            "--tensor-parallel splits the model loaded here; against --url give it to the server "
            "(torchrun ... -m solo.cli serve --tensor-parallel N) and run one bench client."
        )
    if args.url:  # a server: nothing is loaded here
        target = harness.url_target(args)
        try:
            harness.run_bench(args, [target])
        finally:
            target.close()
        return 0
    from solo.engine.engine import Engine

    if args.baseline and args.speculative_algorithm is None:
        raise UsageError("--baseline compares plain decoding with NEXTN: add --speculative-algorithm NEXTN.")
    engine = Engine.from_pretrained(args.model, **load_options(args))
    preflight(engine, args)
    targets = harness.engine_targets(engine, args.baseline)
    if engine.tp.enabled and not engine.tp.leader:  # rank 0 runs the workload; this rank runs its requests
        from solo.distributed.lockstep import follow

        follow([t.engine for t in targets])
        return 0
    before = engine.tp.stats.copy()
    try:
        harness.run_bench(args, targets, engine.model.config.vocab_size)
    finally:
        from solo.distributed.lockstep import release_followers

        release_followers(engine.tp)
    if engine.tp.enabled:
        print(_collectives_line(engine, before), file=sys.stderr)
    return 0


def _collectives_line(engine, before) -> str:
    """The bench's tensor-parallel breakdown: the collectives as they ran during the workload (rank 0)."""
    engine.tp.resolve_timings()
    ran = engine.tp.stats.since(before)
    d = ran.to_dict()
    return (
        f"solo bench: tensor parallel {engine.tp.world} ({engine.tp.backend}, all-reduce by {engine.tp.transport}, "
        f"experts by {engine.model.shard.experts}): {ran.all_reduces} all-reduces ({d['all_reduce_us_mean']} us each, "
        f"{ran.all_reduce_s:.3f} s), {ran.all_gathers} logit all-gathers ({d['all_gather_us_mean']} us each), "
        f"{ran.controls} lockstep broadcasts ({d['control_us_mean']} us each) on rank 0"
    )


def cmd_bench_compare(args: argparse.Namespace) -> int:
    from solo.bench.harness import main_compare

    return main_compare(args)


def cmd_bench_decode(args: argparse.Namespace) -> int:
    from solo.bench.decode import run

    return run(args)


def add_bench(sub) -> None:
    from solo.bench import decode
    from solo.bench.harness import WORKLOADS, add_arguments, add_compare_arguments

    p = sub.add_parser(
        "bench",
        help="benchmark a workload (gsm8k, synthetic, repeat, jsonl) against the engine or any OpenAI-compatible "
        "server (--url), compare two reports (compare), or time the decode step itself (decode)",
    )
    workloads = p.add_subparsers(dest="workload", required=True)
    for name, summary in WORKLOADS.items():
        w = workloads.add_parser(name, help=summary)
        add_model_options(w)
        add_preflight_options(w)
        add_arguments(w, name)
        w.set_defaults(func=cmd_bench)
    c = workloads.add_parser("compare", help="the Table-4 comparison (and McNemar) of two saved reports")
    add_compare_arguments(c)
    c.set_defaults(func=cmd_bench_compare)
    d = workloads.add_parser("decode", help="the whole decode step at full shape in CUDA graphs, against the roofline")
    decode.add_arguments(d)
    d.set_defaults(func=cmd_bench_decode)


# --------------------------------------------------------------------------- serve
def cmd_serve(args: argparse.Namespace) -> int:
    from solo.engine.engine import Engine
    from solo.serving.guard import Limits
    from solo.serving.server import ServeOptions, bind, serve

    if args.max_queue is not None and args.max_queue < 0:
        raise UsageError(f"--max-queue must be >= 0, got {args.max_queue}.")
    if args.request_timeout is not None and not args.request_timeout > 0:
        raise UsageError(f"--request-timeout must be > 0 seconds, got {args.request_timeout}.")
    if args.default_max_tokens < 1:
        raise UsageError(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}.")
    api_key = args.api_key or os.environ.get("SOLO_API_KEY") or None
    from solo.distributed.lockstep import follow, release_followers

    if int(os.environ.get("RANK", "0")) > 0 and args.tensor_parallel > 1:  # rank 0 serves; this rank follows
        engine = Engine.from_pretrained(args.model, **load_options(args))
        preflight(engine, args)
        follow([engine])
        return 0
    sock = bind(args.host, args.port)  # before the model loads: a port in use fails at once
    engine = None
    try:
        engine = Engine.from_pretrained(args.model, **load_options(args))
        preflight(engine, args)
        options = ServeOptions(
            model_name=args.served_model_name or Path(args.model).name,
            default_max_tokens=args.default_max_tokens,
            max_queue=args.max_queue,
            request_timeout_s=args.request_timeout,
            api_key=api_key,
            limits=Limits(args.max_body_bytes, args.body_timeout, args.max_header_bytes),
        )
        if engine.tp.enabled:
            # uvicorn re-raises the signal that stopped it once it has shut down: here it must not end the
            # process before the other ranks are released (below), so it is only noted
            import signal

            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: None)
        serve(engine, sock, options)  # returns once the engine worker has stopped
    finally:
        if engine is not None:
            release_followers(engine.tp)
        sock.close()
    return 0


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (completions, chat, streaming)")
    add_model_options(p)
    add_preflight_options(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: folder name)")
    p.add_argument("--default-max-tokens", type=int, default=256, help="when a request sets none (default 256)")
    p.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help="requests that may wait for the engine; more get 429 with Retry-After (default: unbounded)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds from arrival to the last token (queue wait included); past it: 504 (default: none)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every endpoint but /health and /metrics (or SOLO_API_KEY)",
    )
    p.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024, help="request body limit (default 8 MiB)")
    p.add_argument(
        "--body-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds to receive a request's headers, and again its body (default 10)",
    )
    p.add_argument("--max-header-bytes", type=int, default=16 * 1024, help="request header limit (default 16 KiB)")
    p.set_defaults(func=cmd_serve)


# --------------------------------------------------------------------------- make-tiny
def cmd_make_tiny(args: argparse.Namespace) -> int:
    try:
        from solo.testing.tiny import write_tiny_checkpoint
    except ImportError as e:  # transformers is a test dependency
        raise UsageError(f"make-tiny needs transformers 5.23 (pip install 'transformers==5.23.0'): {e}") from e
    write_tiny_checkpoint(args.out, preset=args.preset, seed=args.seed, with_nextn=not args.no_nextn)
    print(f"wrote a tiny random Ling-3.0 checkpoint (preset {args.preset}) to {args.out}")
    return 0


def add_make_tiny(sub) -> None:
    p = sub.add_parser("make-tiny", help="write a tiny random Ling-3.0 checkpoint through transformers (tests)")
    p.add_argument("out")
    p.add_argument("--preset", choices=("a", "b", "c"), default="a")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-nextn", action="store_true", help="omit the NEXTN layer")
    p.set_defaults(func=cmd_make_tiny)


# --------------------------------------------------------------------------- quantize
def cmd_quantize(args: argparse.Namespace) -> int:
    from solo.quantization.convert import quantize_checkpoint

    errors = quantize_checkpoint(args.in_dir, args.out_dir, verbose=not args.quiet)
    print(f"wrote {len(errors)} quantized tensors to {args.out_dir}")
    return 0


def add_quantize(sub) -> None:
    p = sub.add_parser("quantize", help="convert a BF16 checkpoint to the fp4 format (MXFP4 experts, block FP8)")
    p.add_argument("in_dir")
    p.add_argument("out_dir")
    p.add_argument("--quiet", action="store_true", help="only the summary, not every tensor's error")
    p.set_defaults(func=cmd_quantize)


COMMANDS = [add_generate, add_check, add_bench, add_serve, add_quantize, add_make_tiny]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="solo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from solo.checkpoint.reader import CheckpointError
    from solo.config import ConfigError
    from solo.distributed.lockstep import LockstepError
    from solo.fastpath.availability import DecodeStepUnavailable
    from solo.kernels.registry import BackendUnavailable
    from solo.preflight.checks import PreflightFailed, UnknownEnvironment, check_environment

    args = build_parser().parse_args(argv)
    quiet_rank = int(os.environ.get("RANK", "0")) > 0 and getattr(args, "tensor_parallel", 1) > 1
    stdout = sys.stdout
    if quiet_rank:  # a tensor-parallel rank > 0: rank 0 prints the text and the reports
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115
    try:
        check_environment()
        return args.func(args)
    except UsageError as e:
        print(f"solo: error: {e}", file=sys.stderr)
        return 2
    except (
        CheckpointError,
        ConfigError,
        BackendUnavailable,
        DecodeStepUnavailable,
        PreflightFailed,
        UnknownEnvironment,
        LockstepError,
        ValueError,
    ) as e:
        rank = f" (rank {os.environ['RANK']})" if quiet_rank else ""
        print(f"solo {args.command}{rank}: error: {e}", file=sys.stderr)
        return 1
    finally:
        if quiet_rank:
            sys.stdout.close()
            sys.stdout = stdout
        tp = getattr(args, "tp", None)
        if tp is not None:
            tp.close()


if __name__ == "__main__":
    sys.exit(main())
