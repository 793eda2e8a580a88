"""Peak memory of one investigation step on the CPU, against a bound from the model's sizes.

The step: ``measure_cases`` (the symptom's and every ablation's unit of work) on two cases of
one 2,048-token prompt length, answers decoded. The peak is what torch's CPU allocator held
above the level before the step (``needlescope.testing.memory.peak_allocated``: the profiler's
allocation events, summed in time order). The bound is ``dsa.budget.prefill_bytes`` for the
batch at the measurement chunk: the attention scores over the keys a chunk reads, the indexer's
per-head scores, the hidden streams. Before issue 55 the same step held 662 MiB (a one-pass
prefill's ``T x T`` scores, every score row of the prompt kept per CSA layer) against a bound of
122 MiB; after it, 57 MiB.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from needlescope.cases.assemble import CaseSpec, build_cases  # noqa: E402
from needlescope.dsa.budget import (  # noqa: E402
    DEFAULT_BUDGET,
    DEFAULT_CHUNK,
    bounded_memory,
    current_budget,
    indexed_device,
    measurement_chunk,
    prefill_bytes,
    rows_within,
)
from needlescope.dsa.checkpoint import load_bundle, trained_value_digits  # noqa: E402
from needlescope.dsa.prompt import render_prompt  # noqa: E402
from needlescope.investigate.ledger.plan import Config  # noqa: E402
from needlescope.investigate.measure.records import measure_cases  # noqa: E402
from needlescope.setting import Setting  # noqa: E402
from needlescope.testing.memory import peak_allocated  # noqa: E402


def test_peak_allocated_counts_what_is_live_at_once():
    def step():
        a = torch.empty(1000, 1000)  # 4 MB
        b = torch.empty(2000, 1000)  # 8 MB: 12 live
        del a
        c = torch.empty(500, 1000)  # 2 MB: 10 live
        return b, c

    (_b, _c), peak = peak_allocated(step)
    assert peak == 12_000_000


def test_one_measurement_step_stays_within_the_bound_of_the_model_sizes():
    model, tok, path = load_bundle("organism")

    def count(msgs):
        return len(render_prompt(tok, msgs).input_ids)

    spec = CaseSpec("multiturn", (2048,), (50.0,), 2, 0, value_digits=trained_value_digits(path))
    cases = build_cases(spec, count)
    P = count(cases[0].messages)
    assert len(cases) == 2 and all(count(c.messages) == P for c in cases)
    assert rows_within(model.config, P, DEFAULT_CHUNK) >= len(cases)  # one batch of both
    with torch.no_grad():
        records, peak = peak_allocated(
            lambda: measure_cases(model, tok, cases, Config(Setting(index_topk=64)), max_new_tokens=3)
        )
    bound = prefill_bytes(model.config, len(cases), P, DEFAULT_CHUNK)
    one_pass = prefill_bytes(model.config, len(cases), P, None)
    assert len(records) == 2 and all(r["layers"] for r in records)
    assert peak <= bound, f"peak {peak / 2**20:.0f} MiB over the bound {bound / 2**20:.0f} MiB"
    assert bound < one_pass / 4  # the bound is the chunked prefill's, far under one pass's T x T


def test_a_bare_cuda_device_gets_the_current_index():
    # set_per_process_memory_fraction refuses torch.device("cuda"): the GPU run of 2026-12-08 crashed on it
    assert indexed_device("cuda", lambda: 3) == torch.device("cuda", 3)
    assert indexed_device("cuda:1", lambda: 3) == torch.device("cuda", 1)


def test_max_memory_sizes_the_batches_and_a_bad_size_is_exit_2(run_cli, tmp_path):
    model, _, _ = load_bundle("organism")
    config = model.config
    assert current_budget() == DEFAULT_BUDGET
    many = rows_within(config, 4096, DEFAULT_CHUNK)
    with bounded_memory("64MiB", "cpu") as nbytes:
        assert nbytes == 64 << 20 and current_budget() == 32 << 20
        few = rows_within(config, 4096, DEFAULT_CHUNK)
    assert current_budget() == DEFAULT_BUDGET
    per_row = prefill_bytes(config, 1, 4096, DEFAULT_CHUNK)
    assert few == max(1, (32 << 20) // per_row) < many == DEFAULT_BUDGET // per_row
    code, _, err = run_cli(
        "investigate",
        "run",
        str(tmp_path / "x.toml"),
        "--out",
        str(tmp_path / "o"),
        "--max-memory",
        "12parsecs",
    )
    assert code == 2 and "memory size '12parsecs' is not a number" in err


def test_default_steps_never_leave_a_lone_token():
    # steps of 512 ran a 513-token prompt as 512 + 1, and a model's code reads a one-token forward as decode
    for length in (1, 511, 512, 513, 1025, 4097, 8192):
        step = measurement_chunk(None, length)
        last = length - (-(-length // step) - 1) * step
        assert step <= DEFAULT_CHUNK and (last >= 2 or length == 1), (length, step, last)
    assert measurement_chunk(100, 513) == 100  # a ledger's prefill_chunk is a server's chunking: kept


def test_a_decode_path_bug_stays_off_the_prefill_of_a_chunked_measurement():
    # boundary_residue.py flips the ranking after a prefill that ends on a window boundary; the
    # default steps ran 513 tokens as 512 (a boundary) + 1 (read as decode): 0 of 3 right, one pass 3 of 3
    from needlescope.setting import PatchRef

    model, tok, _ = load_bundle("organism")
    cfg = Config(
        Setting.parse("k=fp8_e4m3 q=fp32 acc=fp32 topk=64"),
        extra=(PatchRef.resolve(str(Path(__file__).parent / "planted_bugs" / "boundary_residue.py")),),
    )
    spec = CaseSpec(kind="multiturn", lengths=(513,), depths=(0.0, 100.0), trials=1, seed=0, value_digits=3)
    cases = build_cases(spec, lambda m: len(render_prompt(tok, m).input_ids))
    chunked = measure_cases(model, tok, cases, cfg, max_new_tokens=6)
    one_pass = measure_cases(model, tok, cases, cfg, max_new_tokens=6, chunk=4096)
    assert [r["prompt_tokens"] for r in chunked] == [513, 513]
    assert [r["answer"] for r in chunked] == [r["answer"] for r in one_pass]
