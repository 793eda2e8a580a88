"""Issue 54, items 2, 5 and 14: ``kernels conform`` against implementations that misbehave.

An implementation gets copies of a case's inputs and is scored against the case's own, kept
aside: one that writes into its inputs (an in-place sort, zeroed lengths) can neither score itself
exact nor hand a changed case to the next implementation, and the write is a finding of its own.
Any exception from an implementation, ``SystemExit`` included, is that case's ERROR (exit 1), while
Ctrl-C still stops the run (exit 130, one line). ``--impl ours`` without Triton is one line naming
the missing GPU extra, exit 2.
"""

from __future__ import annotations

import json
import sys

import pytest

torch = pytest.importorskip("torch")

from needlescope.kernels import conformance as C  # noqa: E402
from needlescope.kernels.conform import REPORT_SCHEMA, conform  # noqa: E402
from needlescope.schema import check_schema  # noqa: E402

IMPLS = '''
import sys
import torch

def sort_in_place(scores, k, lengths):
    """Sorts each row in place, then answers 0..k-1: exact on the rows it rewrote."""
    scores.copy_(scores.sort(dim=1, descending=True).values)
    return torch.arange(k).expand(scores.shape[0], k).contiguous()

def zero_lengths(scores, k, lengths):
    """Empties every row, then answers nothing: every row of length 0 is trivially right."""
    lengths.zero_()
    return torch.full((scores.shape[0], k), -1, dtype=torch.int64)

def exits(scores, k, lengths):
    sys.exit(0)

def interrupted(scores, k, lengths):
    raise KeyboardInterrupt
'''
CASES = ["nan", "relu-zeros", "bin-4k-exact"]


@pytest.fixture
def impls(tmp_path):
    path = tmp_path / "hostile.py"
    path.write_text(IMPLS)
    return str(path)


def test_an_implementation_that_writes_into_its_inputs_is_flagged_and_never_scored_on_them(impls):
    from needlescope.kernels.conform import load_impl
    from needlescope.kernels.topk_impls import torch_topk

    for name in CASES:
        fresh = C.build_case(name, "small")
        handed = []

        def after(scores, k, lengths, fresh=fresh, handed=handed):
            """Runs after the writers: it must get the case as it was built."""
            handed.append(_same(scores, fresh.scores) and torch.equal(lengths, fresh.lengths))
            return torch_topk(scores, k, lengths)

        runs = [*load_impl(f"{impls}:sort_in_place"), *load_impl(f"{impls}:zero_lengths"), ("after", after)]
        report = conform(runs, shapes="small", names=[name])
        check_schema(report, REPORT_SCHEMA, "report")
        (sorter,), (zeroer,), (later,) = (r["cases"] for r in report["impls"])
        assert sorter["inputs_written"] == ["scores"] and not sorter["exact"], sorter
        assert zeroer["inputs_written"] == ["lengths"] and zeroer["missed"] > 0 and not zeroer["exact"], (
            zeroer
        )
        assert [r["wrote_inputs"] for r in report["impls"]] == [[name], [name], []]
        assert later["exact"] and later["inputs_written"] == [] and handed == [True]


def _same(a, b) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))  # bits: NaN equals itself


def test_cli_exits_1_when_an_implementation_wrote_into_its_inputs(run_cli, impls, tmp_path):
    out = tmp_path / "r.json"
    code, stdout, _ = run_cli("kernels", "conform", "--impl", f"{impls}:zero_lengths", "--case", "nan",
                              "--out", str(out))  # fmt: skip
    assert code == 1, stdout
    assert "WROTE INTO ITS INPUTS: lengths" in stdout and "wrote into its inputs in 1: nan" in stdout
    assert json.loads(out.read_text())["impls"][0]["wrote_inputs"] == ["nan"]


def test_sys_exit_inside_an_implementation_is_its_error_not_the_exit_code(run_cli, impls, tmp_path):
    out = tmp_path / "r.json"
    code, stdout, _ = run_cli("kernels", "conform", "--impl", f"{impls}:exits", "--impl", "torch",
                              "--case", "nan", "--case", "relu-zeros", "--out", str(out))  # fmt: skip
    assert code == 1, stdout
    exits, exact = json.loads(out.read_text())["impls"]
    assert [c["error"] for c in exits["cases"]] == ["SystemExit: 0", "SystemExit: 0"]
    assert exact["exact"] and "2 errors (no answer to score): relu-zeros, nan" in stdout


def test_ctrl_c_inside_an_implementation_still_stops_the_run(run_cli, impls):
    try:
        code, stdout, stderr = run_cli(
            "kernels", "conform", "--impl", f"{impls}:interrupted", "--case", "nan"
        )
    except KeyboardInterrupt:
        pytest.fail("the KeyboardInterrupt escaped the command (a traceback on the shell)")
    assert (
        code == 130
        and stderr.strip() == "interrupted: no report was written; rerun the command to run the cases again"
    )
    with pytest.raises(KeyboardInterrupt):
        C.run_case(lambda s, k, n: (_ for _ in ()).throw(KeyboardInterrupt()), C.build_case("nan", "small"))


def test_ours_without_triton_is_one_line_naming_the_gpu_extra(run_cli, monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ModuleNotFoundError
    for impl in ("ours", "ours:radix"):
        code, stdout, stderr = run_cli(
            "kernels", "conform", "--impl", impl, "--case", "nan", "--device", "cpu"
        )
        assert code == 2, stdout + stderr
        assert len(stderr.strip().splitlines()) == 1 and "pip install 'needlescope[gpu]'" in stderr, stderr
        assert "the GPU extra is missing" in stderr and "ModuleNotFoundError" not in stdout + stderr
    code, stdout, _ = run_cli(
        "kernels", "conform", "--impl", "ours:reference", "--case", "nan", "--device", "cpu"
    )
    assert code == 0, stdout  # the torch reference needs no Triton
