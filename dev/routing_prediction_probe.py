"""How well a MoE layer's experts can be named before its attention has run (a lab probe, not the product).

The decode step's MoE kernel spends about 6 us a layer routing before its first expert copy and streams its
gate_up at about half the copy bandwidth (docs/kernels.md, Open problems), while the DRAM idles through the
routing and the KDA recurrence. If the layer's experts could be guessed a few kernels early, their weights could be
asked of the L2 then (tried in the twenty-ninth session: it lost in the step even with the exact experts,
docs/kernels-history.md). This probe measures the guesses against the real routing, token by token, on the reference
model (greedy decode after a random prompt):

- `layer input`: the layer's own router on post_attention_layernorm(the layer's input), i.e. the residual before
  the attention adds to it;
- `previous token`: the experts the same layer chose for the token before.

It prints, per MoE layer and overall, the mean fraction of the chosen experts each guess names (chance is
k / experts), and the same for the experts' union of two guesses. Runs on the CPU with a narrow config or on a GPU
at full width (random weights, as the bench: `--random-weights ling-3.0-flash`), or on a checkpoint (`--model`).

    python3 dev/routing_prediction_probe.py --num-layers 8 --tokens 32          # full width, 8 layers (a GPU)
    python3 dev/routing_prediction_probe.py --model solo/assets/models/ling-gsm8k-tiny --tokens 64  # trained
"""

from __future__ import annotations

import argparse
import sys

import torch

from solo.model.cache import HybridCache
from solo.model.moe import SparseMoE


def overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """The fraction of b's ids (one token's) that a names."""
    return len(set(a.tolist()) & set(b.tolist())) / b.numel()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a checkpoint folder (else random weights)")
    p.add_argument("--random-weights", default="ling-3.0-flash")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--num-experts", type=int, default=None)
    p.add_argument("--prompt", type=int, default=16, help="random prompt tokens")
    p.add_argument("--tokens", type=int, default=32, help="decoded tokens measured")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    device = torch.device(args.device)
    if args.model:
        from solo.checkpoint.loader import LoadOptions, load_model

        model = load_model(args.model, LoadOptions(device, torch.bfloat16, progress=False))
        source = args.model
    else:
        from solo.checkpoint.synthetic import load_random_model, synthetic_config

        config = synthetic_config(args.random_weights, num_layers=args.num_layers, num_experts=args.num_experts)
        model = load_random_model(config, device, torch.bfloat16, seed=args.seed)
        source = f"random {args.random_weights}, {config.num_hidden_layers} layers"
    config = model.config
    layers = model.model.layers[: config.num_hidden_layers]

    inputs: dict[int, torch.Tensor] = {}  # layer -> its input (the residual before attention), this token
    previous: dict[int, torch.Tensor] = {}  # layer -> the experts it chose for the token before
    scores: dict[str, dict[int, list[float]]] = {"layer input": {}, "previous token": {}, "either": {}}
    measuring = [False]

    def keep_input(index: int):
        def hook(module, args_):
            inputs[index] = args_[0].detach()

        return hook

    def judge(index: int, layer: torch.nn.Module):
        def hook(module: SparseMoE, args_):
            x = args_[0]
            with torch.no_grad():
                _, chosen = module.gate(x)
                _, guessed = module.gate(layer.post_attention_layernorm(inputs[index]))
            chosen, guessed = chosen[-1], guessed[-1]
            if measuring[0]:
                scores["layer input"].setdefault(index, []).append(overlap(guessed, chosen))
                if index in previous:
                    before = previous[index]
                    scores["previous token"].setdefault(index, []).append(overlap(before, chosen))
                    scores["either"].setdefault(index, []).append(overlap(torch.cat([guessed, before]), chosen))
            previous[index] = chosen

        return hook

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(keep_input(i))
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp.register_forward_pre_hook(judge(i, layer))

    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, config.vocab_size, (args.prompt,), generator=g).to(device)
    cache = HybridCache(config, args.prompt + args.tokens + 1, device, model.dtype)
    with torch.no_grad():
        hidden = model.prefill(prompt, cache)
        token = model.logits(hidden[-1:]).argmax(-1)
        measuring[0] = True
        for t in range(args.tokens):
            position = torch.tensor([args.prompt + t], device=device)
            hidden = model(token, position, cache)
            token = model.logits(hidden).argmax(-1)

    k, experts = config.num_experts_per_tok, config.num_experts
    print(f"{source}: {args.tokens} decoded tokens, top-{k} of {experts} experts (chance {k / experts:.3f})")
    for name, per_layer in scores.items():
        means = {i: sum(v) / len(v) for i, v in per_layer.items() if v}
        overall = sum(means.values()) / max(len(means), 1)
        row = " ".join(f"{i}:{m:.2f}" for i, m in sorted(means.items()))
        print(f"{name:>15}: {overall:.3f} of the chosen experts named | per layer {row}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
