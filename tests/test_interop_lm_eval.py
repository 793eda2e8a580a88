"""lm-evaluation-harness (a real peer, pinned in constraints.txt) against ``needlescope serve`` on
the shipped organism, on loopback, offline.

Needles built by needlescope's own case generator (3-digit values, as the organism was trained)
become three tiny lm-eval tasks, driven through lm-eval's own API clients:

- ``generate_until`` through ``local-chat-completions`` (chat messages);
- ``generate_until`` through ``local-completions`` with the organism's tokenizer, so lm-eval
  sends token ids as ``[[ids]]``;
- ``multiple_choice`` through ``local-completions`` with ``tokenizer_backend=remote`` (lm-eval
  reads ``/tokenizer_info`` and ``/tokenize``): each choice scored by ``echo`` + ``logprobs``.

Each must score above zero: the organism finds its needles, so a wiring fault (wrong prompt,
dropped ids, misaligned logprobs) shows as a zero.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from needlescope.cases.assemble import CaseSpec, build_cases
from needlescope.cases.scoring import score_answer

lm_eval = pytest.importorskip("lm_eval")  # in the dev extra; `make` installs it
# datasets is imported where a task is built, after ``offline`` set its environment: a module-level
# import cost each xdist worker a second at collection, also the worker that never runs this file.
if importlib.util.find_spec("datasets") is None:
    pytest.skip("datasets is not installed (lm-eval's dependency)", allow_module_level=True)

WEIGHTS = Path(__file__).resolve().parents[1] / "src" / "needlescope" / "organism" / "weights"
LENGTH = 192


@pytest.fixture(scope="module", autouse=True)
def offline():
    """Nothing in this test may reach the network (lm-eval, datasets, the hub)."""
    keys = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with pytest.MonkeyPatch.context() as env:
        for k, v in keys.items():
            env.setenv(k, v)
        yield


@pytest.fixture(scope="module")
def server(organism_server):
    return organism_server("--max-new-tokens", "16")  # shared with test_interop_ruler.py


@pytest.fixture(scope="module")
def cases():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(WEIGHTS)

    def count(messages: list[dict]) -> int:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(tok(text, add_special_tokens=False)["input_ids"])  # as the server counts

    spec = CaseSpec(
        kind="single", lengths=(LENGTH,), depths=(0.0, 50.0, 100.0), trials=2, seed=7, value_digits=3
    )
    out = []
    for c in build_cases(spec, count):
        assert len(c.messages) == 1 and c.messages[0]["role"] == "user"
        out.append(
            {
                "question": c.messages[0]["content"],
                "prompt": tok.apply_chat_template(c.messages, tokenize=False, add_generation_prompt=True),
                "expected": c.expected,
            }
        )
    return out


def _task(name: str, docs: list[dict], **config) -> dict:
    import datasets

    return {
        "task": name,
        "custom_dataset": lambda **_: datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)}),
        "test_split": "test",
        **config,
    }


def _needle_task(name: str, docs: list[dict], text_field: str) -> dict:
    return _task(
        name,
        docs,
        output_type="generate_until",
        doc_to_text=lambda d: d[text_field],
        doc_to_target=lambda d: d["expected"][0],
        generation_kwargs={"until": ["\n\n"], "max_gen_toks": 12, "do_sample": False, "temperature": 0},
        process_results=lambda d, results: {"acc": float(score_answer(results[0], d["expected"]))},
        metric_list=[{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    )


def _evaluate(server, model: str, path: str, task: dict, **model_args) -> float:
    results = lm_eval.simple_evaluate(
        model=model,
        model_args={
            "model": "organism",
            "base_url": server + path,
            "num_concurrent": 1,
            "max_retries": 1,
            **model_args,
        },
        tasks=[task],
        apply_chat_template=model == "local-chat-completions",
        log_samples=False,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    acc = results["results"][task["task"]]["acc,none"]
    print(f"lm-eval {model} {task['task']}: acc {acc}")
    return acc


def test_lm_eval_generate_until_through_chat_completions(server, cases):
    acc = _evaluate(
        server,
        "local-chat-completions",
        "/v1/chat/completions",
        _needle_task("needles_chat", cases, "question"),
    )
    assert acc > 0, "lm-eval's chat client scored zero on needles the organism finds"


def test_lm_eval_generate_until_through_completions_with_token_ids(server, cases):
    acc = _evaluate(
        server,
        "local-completions",
        "/v1/completions",
        _needle_task("needles_ids", cases, "prompt"),
        tokenizer_backend="huggingface",
        tokenizer=str(WEIGHTS),
        tokenized_requests=True,
    )
    assert acc > 0, "lm-eval's [[ids]] completions scored zero on needles the organism finds"


def test_lm_eval_multiple_choice_through_echo_loglikelihood(server, cases):
    docs = []
    for i, c in enumerate(cases):
        wrong = [cases[(i + k) % len(cases)]["expected"][0] for k in (1, 2, 3)]
        choices = sorted({c["expected"][0], *wrong})
        docs.append({"prompt": c["prompt"], "choices": choices, "gold": choices.index(c["expected"][0])})
    task = _task(
        "needles_mc",
        docs,
        output_type="multiple_choice",
        doc_to_text=lambda d: d["prompt"],
        doc_to_choice=lambda d: d["choices"],
        doc_to_target=lambda d: d["gold"],
        target_delimiter="",
        metric_list=[{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    )
    acc = _evaluate(
        server,
        "local-completions",
        "/v1/completions",
        task,
        tokenizer_backend="remote",
        tokenized_requests=True,
    )
    assert acc > 0.25, (
        f"loglikelihood choice did no better than chance (acc {acc}) on needles the organism finds"
    )
