"""The requests of each `solo bench` workload.

* ``gsm8k``: GSM8K test questions in the lm-eval 5-shot format (solo.bench.gsm8k), stop at
  "Question:", graded strict and flexible; all 1,319 by default.
* ``synthetic``: random token ids, fixed input and output lengths, eos ignored (the seed's 32K/2K shape).
* ``repeat``: one random digit repeated ``input_len`` times, fixed output length, eos ignored: the most
  predictable continuation there is, an upper bound for acceptance.
* ``jsonl FILE``: one request per line, ``{"prompt": str | [ids], "max_tokens"?, "temperature"?,
  "top_p"?, "top_k"?, "seed"?, "stop"?, "ignore_eos"?, "answer"?}``; missing fields take the command
  line's values; ``answer`` (a number) makes the line graded like GSM8K.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from solo.bench import gsm8k
from solo.bench.targets import Request
from solo.engine.request import GenerationParams
from solo.engine.sampling import SamplingParams

SEED_TABLE4 = {"temperature": 0.6, "top_p": 0.95, "top_k": 29}
"""The seed's Table 4 sampling (all 1,319 GSM8K questions, 5-shot): ``--preset seed-table4``."""
PRESETS: dict[str, dict[str, float]] = {"seed-table4": SEED_TABLE4, "greedy": {"temperature": 0.0, "top_p": 1.0}}


def gsm8k_requests(
    count: int | None, sampling: SamplingParams, max_tokens: int, data_dir: str | Path | None = None
) -> list[Request]:
    """The first ``count`` GSM8K test questions (all when None), 5-shot prompts."""
    test = gsm8k.load_split("test", data_dir)
    test = test if count is None else test[:count]
    train = gsm8k.load_split("train", data_dir)
    prompts = gsm8k.build_prompts(test, train)
    params = GenerationParams(max_tokens=max_tokens, sampling=sampling, stop=gsm8k.STOP_SEQUENCES)
    return [Request(p, params, ex.target) for p, ex in zip(prompts, test, strict=True)]


def synthetic_requests(
    vocab: int, count: int, input_len: int, output_len: int, sampling: SamplingParams, seed: int = 0
) -> list[Request]:
    """``count`` prompts of ``input_len`` random ids in [10, vocab), ``output_len`` tokens each, eos ignored."""
    if vocab <= 10:
        raise ValueError(f"vocabulary size {vocab} is too small for random prompts (ids are drawn from [10, vocab)).")
    rnd = random.Random(seed)
    params = GenerationParams(max_tokens=output_len, sampling=sampling, ignore_eos=True)
    return [Request([rnd.randrange(10, vocab) for _ in range(input_len)], params) for _ in range(count)]


def repeat_requests(count: int, length: int, output_len: int, sampling: SamplingParams, seed: int = 0) -> list[Request]:
    """``count`` prompts of one random digit repeated ``length`` times."""
    rnd = random.Random(seed)
    params = GenerationParams(max_tokens=output_len, sampling=sampling, ignore_eos=True)
    return [Request(str(rnd.randrange(10)) * length, params) for _ in range(count)]


_JSONL_FIELDS = {"prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "answer"}


def jsonl_requests(path: str | Path, count: int | None, sampling: SamplingParams, max_tokens: int) -> list[Request]:
    """A user's own prompts, one JSON object per line (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file (jsonl FILE wants one JSON object per line with a 'prompt').")
    requests = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            item: Any = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg}).") from None
        if not isinstance(item, dict) or "prompt" not in item:
            raise ValueError(f"{where}: each line must be an object with a 'prompt' (text or token ids).")
        unknown = set(item) - _JSONL_FIELDS
        if unknown:
            raise ValueError(f"{where}: unknown fields {sorted(unknown)}; known: {sorted(_JSONL_FIELDS)}.")
        prompt = item["prompt"]
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(i, int) for i in prompt))):
            raise ValueError(f"{where}: 'prompt' must be a string or a list of token ids.")
        stop = item.get("stop", ())
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        try:
            line_sampling = SamplingParams(
                float(item.get("temperature", sampling.temperature)),
                int(item.get("top_k", sampling.top_k)),
                float(item.get("top_p", sampling.top_p)),
                item.get("seed", sampling.seed),
            )
            params = GenerationParams(
                int(item.get("max_tokens", max_tokens)), line_sampling, stop, bool(item.get("ignore_eos", False))
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None
        answer = item.get("answer")
        requests.append(Request(prompt, params, None if answer is None else gsm8k.normalize_number(str(answer))))
        if count is not None and len(requests) >= count:
            break
    if not requests:
        raise ValueError(f"{path}: no requests in the file.")
    return requests
