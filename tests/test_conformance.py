"""The adversarial top-k suite (``needlescope.kernels.conformance``) and ``needlescope kernels conform``.

Our Triton top-k runs under Triton's interpreter at the small shapes (tests/conftest.py sets
TRITON_INTERPRET=1); ``needlescope kernels conform --impl ours --shapes full`` runs them on a GPU.
The truncating fixture (tests/truncating_topk.py) must fail exactly the cases, with exactly the
counts, that an independent numpy model of it predicts from the rows.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from needlescope.kernels import conformance as C
from needlescope.kernels.conform import REPORT_SCHEMA, conform
from needlescope.kernels.topk_impls import GPU_ONLY, OURS, torch_topk
from needlescope.schema import check_schema
from truncating_topk import BUFFER, truncating

FIXTURE = Path(__file__).resolve().parent / "truncating_topk.py"
SMALL_BUFFER = BUFFER // C.SHAPES["small"]
METHODS = ("radix", "filter", "bisect", "default")  # every case, under the interpreter
PATH_CASES = ["bin-16k-ulp", "nan", "ties-at-cutoff"]  # the other code paths of ours: these cases


def _np_keys(row: np.ndarray) -> np.ndarray:
    """The float order as integers, written apart from the suite's (numpy, not torch)."""
    u = row.astype(np.float32).view(np.uint32).astype(np.int64)
    u[u == 0x80000000] = 0
    return np.where(u >= 2**31, u ^ 0xFFFFFFFF, u ^ 0x80000000)


def _fixture_model(case: C.Case, buffer: int) -> tuple[int, int, int]:
    """(rows wrong, entries missed, entries wrongly kept) of the truncating fixture on ``case``:
    the k-th key's 8-bit bin, everything above it, the top of its first ``buffer`` entries."""
    rows = missed = wrong = 0
    x = case.scores.cpu().numpy()
    for r, n in enumerate(case.lengths.tolist()):
        if n <= case.k:
            continue
        key = _np_keys(x[r, :n])
        true = Counter(np.sort(key)[-case.k :].tolist())
        cut = min(true) >> 24
        above = key[(key >> 24) > cut]
        kept = key[(key >> 24) == cut][:buffer]
        chosen = np.concatenate([above, np.sort(kept)[::-1][: case.k - above.size]])
        hit = sum((Counter(chosen.tolist()) & true).values())
        rows += hit < case.k
        missed += case.k - hit
        wrong += chosen.size - hit
    return rows, missed, wrong


def test_the_reference_agrees_with_a_float64_sort() -> None:
    """The integer-key reference against float64 comparisons (NaN has no float order: skipped)."""
    for case in C.cases("small"):
        if case.name == "nan":
            continue
        exp = C.expected(case)
        x = case.scores.double().numpy()
        for r, n in enumerate(case.lengths.tolist()):
            v = x[r, :n]
            if n <= case.k:
                assert (int(exp.above[r]), int(exp.take[r])) == (n, 0), case.name
                continue
            kth = np.sort(v)[::-1][case.k - 1]
            assert int(exp.above[r]) == (v > kth).sum(), (case.name, r)
            assert int(exp.tied[r]) == (v == kth).sum(), (case.name, r)
            assert int(exp.take[r]) == case.k - (v > kth).sum(), (case.name, r)


def test_score_counts_misses_wrong_entries_repeats_and_ties() -> None:
    scores = torch.tensor([[5.0, 4.0, 3.0, 3.0, 3.0, 1.0, 9.0]])
    case = C.Case("hand", "", scores, torch.tensor([6], dtype=torch.int32), 3, {})  # 9.0 past the length
    want = {  # selection -> (exact, missed, wrong, lower-index ties)
        (0, 1, 2): (True, 0, 0, True),
        (4, 1, 0): (True, 0, 0, False),
        (0, 2, 3): (False, 1, 1, False),
        (0, 0, 1): (False, 1, 1, True),
        (0, 1, 6): (False, 1, 1, True),
        (0, 1, -1): (False, 1, 0, True),
        (0, 1, 5): (False, 1, 1, True),
    }
    for sel, (exact, missed, wrong, lowest) in want.items():
        res = C.score(case, torch.tensor([sel]))
        assert (res.exact, res.missed, res.wrong, res.lower_index_ties) == (exact, missed, wrong, lowest), sel
        assert res.recall_min == pytest.approx((3 - missed) / 3)


@pytest.mark.parametrize("impl", ["torch", "reference"])
def test_torch_topk_and_the_reference_pass_every_case(impl: str) -> None:
    fn = torch_topk if impl == "torch" else OURS["reference"]
    report = conform([(impl, fn)], shapes="small")
    bad = [c["name"] for c in report["impls"][0]["cases"] if not c["exact"]]
    assert not bad
    assert len(report["impls"][0]["cases"]) == len(C.CASES)
    check_schema(report, REPORT_SCHEMA, "report")


@pytest.mark.parametrize("method", METHODS)
def test_our_methods_pass_every_case_under_the_interpreter(method: str) -> None:
    report = conform([(method, OURS[method])], shapes="small")
    bad = {
        c["name"]: c["error"] or (c["missed"], c["wrong"])
        for c in report["impls"][0]["cases"]
        if not c["exact"]
    }
    assert not bad


@pytest.mark.parametrize("path", [name for name in OURS if name not in (*METHODS, *GPU_ONLY, "reference")])
def test_our_other_paths_pass_under_the_interpreter(path: str) -> None:
    report = conform([(path, OURS[path])], shapes="small", names=PATH_CASES)
    bad = {
        c["name"]: c["error"] or (c["missed"], c["wrong"])
        for c in report["impls"][0]["cases"]
        if not c["exact"]
    }
    assert not bad


def test_the_truncating_fixture_fails_the_right_cases_with_the_right_counts() -> None:
    results = conform([("trunc", lambda s, k, n: truncating(s, k, n, SMALL_BUFFER))], shapes="small")
    got = {c["name"]: c for c in results["impls"][0]["cases"]}
    for case in C.cases("small"):
        rows, missed, wrong = _fixture_model(case, SMALL_BUFFER)
        res = got[case.name]
        assert (res["rows_inexact"], res["missed"], res["wrong"]) == (rows, missed, wrong), case.name
        assert res["exact"] == (rows == 0)
        p = case.params
        if case.name.startswith("bin-") and p["higher_last"]:  # the higher entries arrive last
            assert missed == case.scores.shape[0] * min(p["higher"], max(p["members"] - SMALL_BUFFER, 0))
        if case.name.startswith("monotonic-ascending"):  # the largest arrive last
            assert missed == 2 * min(case.k, p["length"] - SMALL_BUFFER)
    failing = {name for name, c in got.items() if not c["exact"]}
    assert {n for n in C.CASES if n.startswith(("bin-", "monotonic-ascending", "low-contrast"))} <= failing
    assert not failing & {"monotonic-descending-16448", "shorter-than-k", "k-equals-length", "relu-zeros"}


def test_the_fixture_at_full_size_drops_what_a_4096_buffer_drops() -> None:
    """Full-size rows (CPU torch; no kernel): one entry a row past a 4,097-entry bin, all 500
    higher entries past a 16,385-entry one, every top entry of an ascending 16,448-entry row."""
    names = ["bin-4k-exact", "bin-16k-exact", "monotonic-ascending-16448", "monotonic-descending-16448"]
    report = conform([("trunc", lambda s, k, n: truncating(s, k, n, BUFFER))], shapes="full", names=names)
    got = {c["name"]: c["missed"] for c in report["impls"][0]["cases"]}
    want = {n: _fixture_model(C.build_case(n, "full"), BUFFER)[1] for n in names}
    assert got == want
    assert want == {
        "bin-4k-exact": 4 * 1,
        "bin-16k-exact": 4 * 500,
        "monotonic-ascending-16448": 2 * 2048,
        "monotonic-descending-16448": 0,
    }


def test_cli_writes_the_report_and_exits_1_on_an_inexact_case(run_cli, tmp_path: Path) -> None:
    out = tmp_path / "conform.json"
    names = ["--case", "bin-4k-exact", "--case", "monotonic-descending-16448"]
    code, stdout, _ = run_cli(
        "kernels", "conform", "--impl", f"{FIXTURE}:truncating_topk_small", "--impl", "torch", *names,
        "--out", str(out),
    )  # fmt: skip
    assert code == 1, stdout
    report = json.loads(out.read_text())
    check_schema(report, REPORT_SCHEMA, "report")
    fixture, torch_impl = report["impls"]
    assert torch_impl["exact"] and not fixture["exact"]
    bin_case = fixture["cases"][0]
    assert bin_case["missed"] == _fixture_model(C.build_case("bin-4k-exact", "small"), SMALL_BUFFER)[1]
    assert "INEXACT" in stdout and "1 inexact: bin-4k-exact" in stdout
    code, stdout, _ = run_cli("kernels", "conform", "--impl", "torch", *names)
    assert code == 0, stdout


@pytest.mark.parametrize(
    ("impl", "message"),
    [
        ("no_such_module_xyz:topk", "cannot import no_such_module_xyz"),
        ("justaname", "MODULE:FUNCTION"),
        (f"{FIXTURE}:no_function", "no callable 'no_function'"),
        ("missing_file.py:f", "no file missing_file.py"),
        ("ours:nope", "ours has default"),
        ("ours:cuda", "runs on CUDA rows only"),
    ],
)
def test_cli_bad_impl_is_one_line_and_exit_2(run_cli, impl: str, message: str) -> None:
    code, stdout, stderr = run_cli("kernels", "conform", "--impl", impl)
    assert code == 2
    assert message in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert "Traceback" not in stderr + stdout


def test_cli_bad_case_or_shapes_is_exit_2(run_cli) -> None:
    for args in (["--case", "nope"], ["--shapes", "huge"]):
        code, _, stderr = run_cli("kernels", "conform", "--impl", "torch", *args)
        assert code == 2 and "error:" in stderr and len(stderr.strip().splitlines()) == 1, stderr


def test_an_implementation_that_fails_is_an_error_never_a_recall_of_zero(run_cli, tmp_path) -> None:
    """A kernel that raised (or answered floats) was printed and written as 'INEXACT recall
    0.0000 ... 0 missed, 0 wrong': a failure to answer scored as a miss of everything."""
    (tmp_path / "bad.py").write_text(
        "import torch\n"
        "def raises(scores, k, lengths):\n    raise RuntimeError('kernel exploded')\n"
        "def floats(scores, k, lengths):\n    return torch.topk(scores, k).indices.float()\n"
    )
    out = tmp_path / "r.json"
    argv = ["kernels", "conform", "--case", "nan", "--case", "relu-zeros", "--out", str(out)]
    impls = [f"{tmp_path / 'bad.py'}:raises", f"{tmp_path / 'bad.py'}:floats", "torch"]
    code, stdout, _ = run_cli(*argv, *[a for i in impls for a in ("--impl", i)])
    assert code == 1
    report = json.loads(out.read_text())
    check_schema(report, REPORT_SCHEMA, "report")
    raises, floats, exact = report["impls"]
    for case in raises["cases"] + floats["cases"]:
        assert not case["exact"] and case["recall_min"] is None and case["missed"] is None, case
    assert raises["cases"][0]["error"] == "RuntimeError: kernel exploded"
    assert "got a float32 tensor of shape" in floats["cases"][0]["error"]
    assert exact["exact"] and all(c["recall_min"] == 1.0 for c in exact["cases"])
    assert "recall 0.0000" not in stdout and "ERROR" in stdout
    assert "2 errors (no answer to score): relu-zeros, nan" in stdout
