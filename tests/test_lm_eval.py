"""lm-evaluation-harness drives `solo serve` through its `local-completions` model (the remote
tokenizer: /tokenize, /tokenizer_info; batches of 2 prompts): GSM8K generation on a slice of the
packaged data, read from local files, and GSM8K answer log-likelihoods (echo + logprobs scoring).
What the harness recorded is then recomputed with the engine directly."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from serve_helpers import ThreadServer

from solo.assets import bundled_model
from solo.bench.gsm8k import build_fewshot_prompt, load_split
from solo.bench.lm_eval_tasks import write_tasks
from solo.engine.engine import Engine, GenerationParams
from solo.serving.server import ServeOptions

pytestmark = pytest.mark.slow


def test_lm_eval_local_completions_generation_and_loglikelihood(tmp_path):
    pytest.importorskip("lm_eval")  # the test extra installs lm_eval[api]
    tasks = write_tasks(tmp_path / "tasks", test_limit=3)
    engine = Engine.from_pretrained(bundled_model())
    server = ThreadServer(engine, ServeOptions(model_name="ling"))
    out = tmp_path / "out"
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "OMP_NUM_THREADS": "1",
    }
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "lm_eval",
                "--model",
                "local-completions",
                "--model_args",
                f"model=ling,base_url={server.base}/v1/completions,num_concurrent=1,max_retries=1",
                "--tasks",
                "gsm8k_solo,gsm8k_solo_loglikelihood",
                "--include_path",
                str(tasks),
                "--batch_size",
                "2",
                "--output_path",
                str(out),
                "--log_samples",
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
            cwd=tmp_path,
        )
    finally:
        server.close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Auto-detected remote tokenizer support" in proc.stderr
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    assert 0 <= results["gsm8k_solo"]["exact_match,strict-match"] <= 1
    assert 0 <= results["gsm8k_solo_loglikelihood"]["acc,none"] <= 1

    def samples(task: str) -> list[dict]:
        prefix = f"samples_{task}_"  # then the timestamp (gsm8k_solo_... is another task's)
        path = next(p for p in out.rglob(f"{prefix}*.jsonl") if p.name[len(prefix)].isdigit())
        return [json.loads(line) for line in path.read_text().splitlines()]

    # generation: lm-eval's 5-shot prompts are solo's GSM8K protocol, and its answers the engine's
    generated = [s for s in samples("gsm8k_solo") if s["filter"] == "strict-match"]
    train, test = load_split("train"), load_split("test")
    assert len(generated) == 3
    for s in generated:
        prompt = s["arguments"]["gen_args_0"]["arg_0"]
        assert prompt == build_fewshot_prompt(test[s["doc_id"]].question, train, index=s["doc_id"])
        want = engine.generate(prompt, GenerationParams(max_tokens=256, stop=("Question:",)))
        assert s["resps"][0][0] == want.text
    # log-likelihood: the harness's sums are the engine's prompt scores over the answer tokens
    scored = samples("gsm8k_solo_loglikelihood")
    assert len(scored) == 3
    tok = engine.tokenizer
    for s in scored:
        context, continuation = s["arguments"]["gen_args_0"]["arg_0"], s["arguments"]["gen_args_0"]["arg_1"]
        whole, ctx = tok.encode(context + continuation), tok.encode(context)
        scores = engine.score(whole, top=1)[len(ctx) :]
        loglikelihood, greedy = s["resps"][0][0]
        assert float(loglikelihood) == pytest.approx(sum(p.logprob for p in scores), abs=1e-3)
        assert (greedy == "True") == all(p.top_logprobs[0][0] == p.token_id for p in scores)
