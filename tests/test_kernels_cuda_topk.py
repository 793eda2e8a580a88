"""The CUDA C++ top-k (``kernels/cuda_topk.cu``, method ``cuda``): its place in the front's rule and
the conformance suite's name resolution on any machine; its sets, order and graph capture on a GPU.

The kernel has no interpreter path: on CI's CPU only the launcher's checks and the rule run; the
GPU script (bench/indexer_gpu.sh, steps ``tests`` and ``conform``) runs the rest at full shapes."""

from __future__ import annotations

import pytest
import torch

from needlescope.errors import BadInput
from needlescope.kernels import cuda_topk
from needlescope.kernels.conform import conform, load_impl
from needlescope.kernels.topk import topk, topk_method
from needlescope.kernels.topk_impls import GPU_ONLY, OURS

GPU = cuda_topk.available()


def test_the_rule_takes_cuda_for_rows_the_register_path_holds_and_only_where_it_runs() -> None:
    for rows, width, k in ((1, 32768, 512), (64, 32768, 2048), (32, 2048, 512), (200, 8192, 64)):
        assert topk_method(rows, width, k, cuda=True) == "cuda"
        assert topk_method(rows, width, k, cuda=False) != "cuda"
    for rows, width, k in ((1, 32769, 512), (8, 262144, 512), (1, 32768, 2049)):
        assert topk_method(rows, width, k, cuda=True) != "cuda"


def test_cpu_rows_never_default_to_cuda_and_asking_for_it_says_why() -> None:
    x = torch.randn(2, 300)
    ends = torch.tensor([300, 10], dtype=torch.int32)
    assert topk(x, 4, None, ends).shape == (2, 4)  # the Triton default under the interpreter
    with pytest.raises((RuntimeError, ValueError), match="CUDA"):
        topk(x, 4, None, ends, method="cuda")


def test_ours_on_the_cpu_leaves_out_the_gpu_only_paths_and_names_them_on_request() -> None:
    names = {name for name, _ in load_impl("ours", "cpu")}
    assert names and not names & {f"ours:{n}" for n in GPU_ONLY}
    assert {f"ours:{n}" for n in GPU_ONLY} <= {name for name, _ in load_impl("ours", "cuda")}
    with pytest.raises(BadInput, match="CUDA rows only"):
        load_impl("ours:cuda-general", "cpu")


@pytest.mark.skipif(not GPU, reason="CUDA C++ kernel: needs a GPU")
@pytest.mark.parametrize("general", [False, True])
def test_every_small_case_is_exact_on_both_paths(general: bool) -> None:
    name = "cuda-general" if general else "cuda"
    report = conform([(name, OURS[name])], shapes="small", device="cuda")
    bad = {
        c["name"]: c["error"] or (c["missed"], c["wrong"])
        for c in report["impls"][0]["cases"]
        if not c["exact"]
    }
    assert not bad


@pytest.mark.skipif(not GPU, reason="CUDA C++ kernel: needs a GPU")
@pytest.mark.parametrize(
    ("rows", "width", "k"), [(4, 32768, 512), (3, 20000, 2048), (2, 70000, 512), (5, 900, 600)]
)
def test_output_equals_the_radix_select_order_and_all(rows: int, width: int, k: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(width + k)
    x = torch.randn(rows, width, generator=g, device="cuda")
    x[0, ::7] = x[0, 5]  # ties at many places, some at the cut-off
    starts = torch.randint(0, width // 4, (rows,), generator=g, device="cuda", dtype=torch.int32)
    ends = torch.randint(width // 2, width + 1, (rows,), generator=g, device="cuda", dtype=torch.int32)
    ends[-1] = starts[-1] + k // 2  # a row shorter than k
    want = topk(x, k, starts, ends, method="radix")
    for general in (False, True):
        got = cuda_topk.cuda_topk(x, k, starts, ends, general=general)
        assert torch.equal(got, want), general


@pytest.mark.skipif(not GPU, reason="CUDA C++ kernel: needs a GPU")
def test_a_captured_graph_replays_the_same_selection() -> None:
    x = torch.randn(8, 32768, device="cuda")
    ends = torch.full((8,), 32768, dtype=torch.int32, device="cuda")
    out = torch.full((8, 512), -7, dtype=torch.int32, device="cuda")
    cuda_topk.cuda_topk(x, 512, None, ends, out=out)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cuda_topk.cuda_topk(x, 512, None, ends, out=out)
    x.copy_(torch.randn_like(x))
    out.fill_(-7)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, topk(x, 512, None, ends, method="radix"))
