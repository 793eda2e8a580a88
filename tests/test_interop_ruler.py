"""lm-eval's RULER ``niah_single_1`` (lm-eval[ruler], in the dev extra) against ``needlescope
serve`` on the shipped organism, on loopback, offline (issue 29, item 11).

The task is lm-eval's own (its 'repeat' haystack, wonderwords keys, template, gen_prefix and
scoring) with the organism's 3-digit values (``tests/lm_eval_tasks``). It runs through
``local-completions`` with the organism's tokenizer: lm-eval renders the chat template with
``continue_final_message`` for the gen_prefix and sends token ids. Nothing is downloaded:
prepare_niah's import-time ``nltk.download("punkt_tab")`` is satisfied by an empty punkt_tab
folder (niah_single_1 never splits sentences), and a download attempt fails the test.

The organism finds some of its needles in this phrasing (0.40 at 512 tokens over 40 samples;
its first four samples, the ones run here, score 0.5), so 0 means broken wiring (a
wrong prompt, a closed assistant turn, dropped ids). docs/serve.md ("Real peers") records it beside
``needlescope probe``'s on the same lengths (``bench/ruler_vs_probe.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("wonderwords")  # lm-eval[ruler]
nltk = pytest.importorskip("nltk")

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "lm_eval_tasks"
WEIGHTS = ROOT / "src" / "needlescope" / "organism" / "weights"
LENGTH = 512
SAMPLES = 4


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    nltk_data = tmp_path_factory.mktemp("nltk")
    (nltk_data / "tokenizers" / "punkt_tab").mkdir(parents=True)
    keys = {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "NLTK_DATA": str(nltk_data),
    }
    with pytest.MonkeyPatch.context() as env:
        for k, v in keys.items():
            env.setenv(k, v)
        if str(nltk_data) not in nltk.data.path:
            nltk.data.path.insert(0, str(nltk_data))
        yield


@pytest.fixture(scope="module")
def server(organism_server):
    return organism_server("--max-new-tokens", "16")  # shared with test_interop_lm_eval.py


def test_ruler_niah_single_1_scores_the_organism(offline, server, monkeypatch):
    from lm_eval.tasks import TaskManager

    def no_download(*args, **kwargs):
        raise AssertionError(f"nltk tried to download {args or kwargs}")

    monkeypatch.setattr(nltk, "download", no_download)
    manager = TaskManager(
        include_path=str(TASKS),
        include_defaults=False,
        metadata={"max_seq_lengths": [LENGTH], "tokenizer": str(WEIGHTS)},
    )
    res = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(
            f"model=organism,base_url={server}/v1/completions,tokenizer={WEIGHTS},"
            "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1"
        ),
        tasks=["niah_single_1_organism"],
        task_manager=manager,
        limit=SAMPLES,
        apply_chat_template=True,
        log_samples=True,
    )
    samples = res["samples"]["niah_single_1_organism"]
    assert len(samples) == SAMPLES
    for s in samples:
        prompt = s["arguments"][0][0]
        value = s["target"][0] if isinstance(s["target"], list) else s["target"]
        assert len(value) == 3 and value in prompt  # the organism's value length, in the prompt
        assert prompt.rstrip().endswith("mentioned in the provided text is")  # the turn left open
    score = res["results"]["niah_single_1_organism"][f"{LENGTH},none"]
    assert 0 < score <= 1, samples
