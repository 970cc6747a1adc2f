"""lm-evaluation-harness tasks that read GSM8K from the package (no network): ``gsm8k_solo``, the
harness's own ``gsm8k`` (5-shot generation, strict and flexible match; the protocol of
solo.bench.gsm8k) on local files, and ``gsm8k_solo_loglikelihood``, the log-likelihood of each
reference answer (scoring through ``echo`` + ``logprobs``).

    python -m solo.bench.lm_eval_tasks DIR [--test-limit N]

writes DIR/{train,test}.jsonl and the two task YAMLs; pass ``--include_path DIR`` to ``lm_eval``
(README, "Serving", has the whole command).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from solo.assets import gsm8k_file, read_jsonl

TASKS = ("gsm8k_solo", "gsm8k_solo_loglikelihood")

GENERATION = """\
task: gsm8k_solo
dataset_path: json
dataset_kwargs:
  data_files:
    train: {train}
    test: {test}
output_type: generate_until
training_split: train
fewshot_split: train
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: false
    regexes_to_ignore: [",", "\\\\$", "(?s).*#### ", "\\\\.$"]
generation_kwargs:
  until: ["Question:"]
  do_sample: false
  temperature: 0.0
num_fewshot: 5
filter_list:
  - name: strict-match
    filter:
      - function: regex
        regex_pattern: "#### (\\\\-?[0-9\\\\.\\\\,]+)"
      - function: take_first
  - name: flexible-extract
    filter:
      - function: regex
        group_select: -1
        regex_pattern: "(-?[$0-9.,]{{2,}})|(-?[0-9]+)"
      - function: take_first
metadata:
  version: 3.0
"""

LOGLIKELIHOOD = """\
task: gsm8k_solo_loglikelihood
dataset_path: json
dataset_kwargs:
  data_files:
    test: {test}
output_type: loglikelihood
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: " {{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
num_fewshot: 0
metadata:
  version: 1.0
"""


def write_tasks(folder: str | Path, test_limit: int | None = None) -> Path:
    """Write the GSM8K splits (the test split cut to `test_limit` questions) as jsonl and the task
    YAMLs into `folder`; returns it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split in ("train", "test"):
        rows = read_jsonl(gsm8k_file(split))
        if split == "test" and test_limit is not None:
            rows = itertools.islice(rows, test_limit)
        paths[split] = folder / f"{split}.jsonl"
        with paths[split].open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({"question": row["question"], "answer": row["answer"]}) + "\n")
    quoted = {k: json.dumps(str(v.resolve())) for k, v in paths.items()}
    (folder / "gsm8k_solo.yaml").write_text(GENERATION.format(**quoted))
    (folder / "gsm8k_solo_loglikelihood.yaml").write_text(LOGLIKELIHOOD.format(**quoted))
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m solo.bench.lm_eval_tasks", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--test-limit", type=int, default=None, help="keep the first N test questions")
    args = parser.parse_args(argv)
    folder = write_tasks(args.folder, args.test_limit)
    print(f"wrote {', '.join(TASKS)} to {folder} (lm_eval --include_path {folder} --tasks {','.join(TASKS)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
