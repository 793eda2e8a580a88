"""lm-eval's RULER niah_single_1 (3-digit values) and ``needlescope probe`` on the same lengths,
against one ``needlescope serve`` of the shipped organism on CPU, offline.

    PYTHONPATH=src HF_HUB_OFFLINE=1 .venv/bin/python bench/ruler_vs_probe.py --lengths 256,512 --samples 40

Prints a markdown table and writes ``OUT/ruler_vs_probe.json``. RULER places its needle at a
random sentence of its 'repeat' haystack and scores the share of expected values in the answer;
the probe spreads needles over five depths and scores an exact value match.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "lm_eval_tasks"
WEIGHTS = ROOT / "src" / "needlescope" / "organism" / "weights"


def offline_nltk() -> str:
    """An NLTK_DATA folder whose empty punkt_tab satisfies prepare_niah's import-time check
    (niah_single_1 never splits sentences), so nothing is downloaded."""
    root = Path(tempfile.mkdtemp(prefix="nltk-"))
    (root / "tokenizers" / "punkt_tab").mkdir(parents=True)
    return str(root)


def run_ruler(url: str, lengths: list[int], samples: int) -> dict:
    """One lm-eval run per length (its samples are ordered by length, so one ``limit`` over
    several lengths would take them all from the first)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    args = (
        f"model=organism,base_url={url}/v1/completions,tokenizer={WEIGHTS},tokenizer_backend=huggingface,"
        "tokenized_requests=True,num_concurrent=1,max_retries=1"
    )
    scores, examples, start = {}, {}, time.monotonic()
    for n in lengths:
        manager = TaskManager(
            include_path=str(TASKS),
            include_defaults=False,
            metadata={"max_seq_lengths": [n], "tokenizer": str(WEIGHTS)},
        )
        res = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=args,
            tasks=["niah_single_1_organism"],
            task_manager=manager,
            limit=samples,
            apply_chat_template=True,
            log_samples=True,
        )
        scores[n] = res["results"]["niah_single_1_organism"][f"{n},none"]
        examples[n] = [
            {"expected": s["target"], "answer": s["resps"][0][0]}
            for s in res["samples"]["niah_single_1_organism"][:5]
        ]
    return {
        "scores": scores,
        "samples_per_length": samples,
        "examples": examples,
        "wall_s": round(time.monotonic() - start, 1),
    }


def run_needlescope(url: str, lengths: list[int], samples: int, out: Path) -> dict:
    from needlescope.run.config import ProbeConfig
    from needlescope.run.probe import run_probe

    depths = (0.0, 25.0, 50.0, 75.0, 100.0)
    cfg = ProbeConfig(
        base_urls=(url,),
        model="organism",
        lengths=tuple(lengths),
        depths=depths,
        trials=max(1, samples // len(depths)),
        kind="single",
        value_digits=3,
        out=out,
        concurrency=1,
        max_tokens=16,  # as lm-eval's max_gen_toks here; the server caps at 16
    )
    start = time.monotonic()
    summary = run_probe(cfg)
    recall = {}
    for n in lengths:
        cells = [c for c in summary["cells"] if c["length"] == n]
        hits, scored = sum(c["correct"] for c in cells), sum(c["n"] for c in cells)
        recall[n] = round(hits / scored, 3) if scored else None
    return {
        "recall": recall,
        "cases_per_length": cfg.trials * len(depths),
        "wall_s": round(time.monotonic() - start, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="256,512")
    p.add_argument("--samples", type=int, default=40, help="RULER samples (and probe cases) per length")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    os.environ["NLTK_DATA"] = offline_nltk()
    out = Path(a.out or tempfile.mkdtemp(prefix="ruler-vs-probe-"))
    from needlescope.serve.launch import ServerProcess

    with ServerProcess(["--model", "organism", "--port", "0", "--max-new-tokens", "16"], timeout=300) as srv:
        ruler = run_ruler(srv.url, lengths, a.samples)
        probe = run_needlescope(srv.url, lengths, a.samples, out / "probe")
    result = {"lengths": lengths, "lm_eval_ruler_niah_single_1": ruler, "needlescope_probe": probe}
    (out / "ruler_vs_probe.json").write_text(json.dumps(result, indent=1))
    print("| length | lm-eval RULER niah_single_1 (3-digit) | needlescope probe (single, 3-digit) |")
    print("|---|---|---|")
    for n in lengths:
        print(f"| {n} | {ruler['scores'][n]:.3f} | {probe['recall'][n]} |")
    print(json.dumps(result), file=sys.stderr)


if __name__ == "__main__":
    main()
