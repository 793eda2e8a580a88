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
from needlescope.kernels.conformance import ordered_keys
from needlescope.kernels.topk import topk, topk_method
from needlescope.kernels.topk_impls import GPU_ONLY, OURS, given_maxima
from needlescope.kernels.triton_decode import fuse_decode, groups_fit

GPU = cuda_topk.available()


def test_the_rule_takes_cuda_where_it_was_measured_faster_and_only_where_it_runs() -> None:
    for rows, width, k in ((32, 32768, 512), (64, 32768, 2048), (5, 8192, 64), (200, 32768, 512)):
        for cl in (False, True):
            assert topk_method(rows, width, k, cuda=True, clusters=cl) == "cuda"
            assert topk_method(rows, width, k, cuda=False, clusters=cl) != "cuda"
    for rows, width, k in ((1, 32768, 512), (4, 32768, 512), (64, 32769, 512), (8, 262144, 512)):
        assert topk_method(rows, width, k, cuda=True, clusters=False) != "cuda"  # radix, filter
    assert (
        topk_method(64, 32768, 2049, cuda=True) != "cuda"
        and topk_method(64, 4096, 512, cuda=True) == "bisect"
    )


def test_the_cluster_path_takes_the_shapes_runs_27_to_33_measured_it_fastest_at() -> None:
    """1-8 rows of 16K-32K entries (from 16 rows the block kernel is as fast or faster) and 4+
    rows of 32K-64K; not 1 x 64K (the radix select's 12.9 us against 13.2), longer rows, or k > 2048."""
    taken = [(1, 32768, 512), (4, 32768, 512), (8, 20000, 2048), (4, 65536, 512), (64, 40000, 512)]
    for rows, width, k in taken:
        assert cuda_topk.cluster_shape(rows, width, k)
        assert topk_method(rows, width, k, cuda=True, clusters=True) == "cuda"
    left = [(9, 32768, 512), (3, 65536, 512), (8, 65537, 512), (4, 32768, 2049), (4, 16384, 512)]
    for rows, width, k in left:
        assert not cuda_topk.cluster_shape(rows, width, k)
    assert topk_method(1, 65536, 512, cuda=True, clusters=True) == "radix"
    assert topk_method(9, 32768, 512, cuda=True, clusters=True) == "cuda"  # the block kernel's rows


def test_cpu_rows_never_default_to_cuda_and_asking_for_it_says_why(monkeypatch) -> None:
    """Even where the CUDA method could run, rows on the CPU take a Triton method (under the
    interpreter here; CI's Triton 3.9 runs it, the GPU machine's 3.6 cannot)."""
    monkeypatch.setattr(cuda_topk, "available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert topk_method(8, 5000, 4) == "cuda"  # eager: compiled at the call
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(cuda_topk, "loaded", lambda *shape: False)
    assert topk_method(8, 5000, 4) != "cuda"  # a capture never compiles: only what an eager call loaded
    monkeypatch.setattr(cuda_topk, "loaded", lambda *shape: True)
    assert topk_method(8, 5000, 4) == "cuda"  # while a graph is captured
    x = torch.randn(8, 5000)
    ends = torch.tensor([5000, 3, 4999, 100, 5000, 5000, 7, 4096], dtype=torch.int32)
    got = topk(x, 4, None, ends)
    assert set(got[0].tolist()) == set(x[0].topk(4).indices.tolist()) and got[1].tolist() == [0, 1, 2, -1]
    monkeypatch.undo()
    with pytest.raises((RuntimeError, ValueError), match="CUDA"):
        topk(x, 4, None, ends, method="cuda")


def test_ours_on_the_cpu_leaves_out_the_gpu_only_paths_and_names_them_on_request() -> None:
    names = {name for name, _ in load_impl("ours", "cpu")}
    assert names and not names & {f"ours:{n}" for n in GPU_ONLY}
    assert {f"ours:{n}" for n in GPU_ONLY} <= {name for name, _ in load_impl("ours", "cuda")}
    with pytest.raises(BadInput, match="CUDA rows only"):
        load_impl("ours:cuda-general", "cpu")


@pytest.mark.skipif(not GPU, reason="CUDA C++ kernel: needs a GPU")
@pytest.mark.parametrize("name", GPU_ONLY)
def test_every_small_case_is_exact_on_every_path(name: str) -> None:
    report = conform([(name, OURS[name])], shapes="small", device="cuda")
    bad = {
        c["name"]: c["error"] or (c["missed"], c["wrong"])
        for c in report["impls"][0]["cases"]
        if not c["exact"]
    }
    assert not bad


def _contract_order(x: torch.Tensor, k: int, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The front's output contract built in torch (no Triton: the GPU machine's Triton 3.6 cannot
    run the interpreter these tests set): each row's entries above the k-th key in index order,
    then its ties in index order, -1 padded; rows of at most k entries in order."""
    out = torch.full((x.shape[0], k), -1, dtype=torch.int32)
    for r, (st, en) in enumerate(zip(starts.tolist(), ends.tolist())):
        cols = torch.arange(st, en)
        if en - st <= k:
            out[r, : en - st] = cols
            continue
        key = ordered_keys(x[r : r + 1, st:en].cpu(), torch.tensor([en - st]))[0]
        kth = key.topk(k).values[-1]
        above, ties = cols[key > kth], cols[key == kth][: k - int((key > kth).sum())]
        out[r] = torch.cat([above, ties])
    return out.to(x.device)


@pytest.mark.skipif(not GPU, reason="CUDA C++ kernel: needs a GPU")
@pytest.mark.parametrize(
    ("rows", "width", "k"),
    [(4, 32768, 512), (3, 20000, 2048), (2, 70000, 512), (5, 900, 600), (10, 50000, 512)],
)
def test_output_is_the_contract_order_on_every_path(rows: int, width: int, k: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(width + k)
    x = torch.randn(rows, width, generator=g, device="cuda")
    x[0, ::7] = x[0, 5]  # ties at many places, some at the cut-off
    starts = torch.randint(0, width // 4, (rows,), generator=g, device="cuda", dtype=torch.int32)
    ends = torch.randint(width // 2, width + 1, (rows,), generator=g, device="cuda", dtype=torch.int32)
    ends[-1] = starts[-1] + k // 2  # a row shorter than k
    want = _contract_order(x, k, starts, ends)
    paths = ("block", "general", "cluster") if width <= cuda_topk.CLUSTER_WIDTH else ("block", "general")
    for path in paths:
        got = cuda_topk.cuda_topk(x, k, starts, ends, path=path)
        assert torch.equal(got, want), path


@pytest.mark.skipif(not GPU, reason="CUDA C++ kernel: needs a GPU")
@pytest.mark.parametrize(("launcher", "width"), [("cuda_topk", 32768), ("group_topk", 65536)])
def test_a_captured_graph_replays_the_same_selection(launcher: str, width: int) -> None:
    x = torch.randn(8, width, device="cuda")
    ends = torch.full((8,), width, dtype=torch.int32, device="cuda")
    gmax = given_maxima(x, ends)
    out = torch.full((8, 512), -7, dtype=torch.int32, device="cuda")

    def launch() -> None:
        if launcher == "cuda_topk":
            cuda_topk.cuda_topk(x, 512, None, ends, out=out)
        else:
            cuda_topk.group_topk(x, 512, ends, gmax, out=out)

    launch()  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    x.copy_(torch.randn_like(x))
    gmax.copy_(given_maxima(x, ends))
    out.fill_(-7)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, _contract_order(x, 512, torch.zeros_like(ends), ends))


@pytest.mark.skipif(not GPU, reason="CUDA C++ kernel: needs a GPU")
def test_an_eager_call_loads_the_kernel_and_a_captured_default_uses_it() -> None:
    x = torch.randn(8, 32768, device="cuda")
    ends = torch.full((8,), 32768, dtype=torch.int32, device="cuda")
    eager = topk(x, 512, None, ends)  # the CUDA method eager: compiles it for graphs too
    assert cuda_topk.loaded(x.device, 8, 32768, 512)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert topk_method(8, 32768, 512) == "cuda"
        out = topk(x, 512, None, ends)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.sort(1).values, eager.sort(1).values)
    assert torch.equal(out, _contract_order(x, 512, torch.zeros_like(ends), ends))


def test_the_fused_decode_path_takes_the_group_path_where_the_cuda_method_is_the_top_k(monkeypatch) -> None:
    """At the goal cells (32 / 64 rows of 32K / 64K entries, k = 512) the CUDA method is the top-k,
    so the fused decode path is logits with group maxima + ``group_topk``; not for k > 512, rows
    past ``GROUP_WIDTH``, small batches, or a capture that finds the kernel unloaded."""
    monkeypatch.setattr(cuda_topk, "available", lambda: True)
    monkeypatch.setattr(cuda_topk, "clusters", lambda device: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    for batch, width in ((32, 32768), (64, 32768), (32, 65536), (64, 65536)):
        assert groups_fit(batch, width, 512) and fuse_decode(batch, width, 512)
    assert not groups_fit(32, 32768, 513) and not fuse_decode(32, 32768, 513)
    assert groups_fit(8, 32768, 512) and not fuse_decode(8, 32768, 512)  # fused only from batch 32
    assert not groups_fit(64, 2 * cuda_topk.GROUP_WIDTH, 512)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(cuda_topk, "loaded", lambda *shape: True)  # the unfused top-k's kernel is
    monkeypatch.setattr(cuda_topk, "group_loaded", lambda device, width: False)
    assert not groups_fit(32, 32768, 512)
    monkeypatch.setattr(cuda_topk, "group_loaded", lambda device, width: True)
    assert groups_fit(32, 32768, 512)


@pytest.mark.skipif(not GPU, reason="CUDA C++ kernel: needs a GPU")
@pytest.mark.parametrize(
    ("rows", "width", "k"), [(6, 32768, 512), (3, 70000, 512), (5, 900, 600), (2, 262144, 512)]
)
def test_the_group_path_is_the_contract_order_and_falls_back_where_the_bound_does_not_filter(
    rows: int, width: int, k: int
) -> None:
    g = torch.Generator(device="cuda").manual_seed(width + k + 1)
    x = torch.randn(rows, width, generator=g, device="cuda")
    x[0, ::7] = x[0, 5]  # ties at many places, some at the cut-off
    x[1] = 0.25  # one value everywhere: every group reaches the bound (general path)
    if rows > 2:
        x[2, : width // 2] = float("-inf")  # half the groups' maxima at -inf's key
    if rows > 4:
        x[3, : width - 16 * (k // 2)] = float("-inf")  # fewer than k finite maxima: the bound is -inf's key
        x[4, : 16 * 1000] = 5.0  # 1,000 groups at the bound, 16,000 entries: more than the candidates' room
    ends = torch.randint(width // 2, width + 1, (rows,), generator=g, device="cuda", dtype=torch.int32)
    ends[-1] = k // 2  # a row shorter than k
    zeros = torch.zeros_like(ends)
    got = cuda_topk.group_topk(x, k, ends, given_maxima(x, ends))
    assert torch.equal(got, _contract_order(x, k, zeros, ends))


@pytest.mark.skipif(not GPU, reason="CUDA C++ kernel: needs a GPU")
def test_the_group_path_says_what_is_wrong_with_its_maxima() -> None:
    x = torch.randn(8, 65536, device="cuda")
    ends = torch.full((8,), 65536, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="gmax must be int32"):
        cuda_topk.group_topk(x, 512, ends, given_maxima(x, ends)[:, :10])
    with pytest.raises(ValueError, match="at most 262144 entries"):
        cuda_topk.group_topk(torch.zeros(1, 262145, device="cuda"), 512, ends[:1], given_maxima(x, ends)[:1])


@pytest.mark.skipif(not GPU, reason="CUDA C++ kernel: needs a GPU")
@pytest.mark.parametrize("claim", ["inf", "ulp"])
def test_maxima_that_claim_too_much_write_nothing_past_the_rows(claim: str) -> None:
    """Maxima above every entry of their groups break ``group_topk``'s contract; the kernel writes
    nothing past its rows, and the answer is exact all the same: where fewer than k entries
    reach the bound (every claim +inf: none) the general path gives it, and a claim one ulp high
    still admits every entry at or above the bound (the argument in ``group_topk``'s docstring)."""
    R, L, k = 4, 32768, 512
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(R, L, generator=g, device="cuda")
    ends = torch.full((R,), L, dtype=torch.int32, device="cuda")
    gmax = given_maxima(x, ends)
    fake = torch.randperm(L // 16, generator=g, device="cuda")[: k + 100]
    if claim == "inf":  # k + 100 groups claim +inf: the bound is +inf's bin, which no entry reaches
        gmax[:, fake] = 0xFF800000 - 2**32  # ordered_key(+inf) stored as int32
    else:  # k + 100 groups claim one ulp more than they hold
        gmax[:, fake] += 1
    buf = torch.full((R * k + 4096,), -7, dtype=torch.int32, device="cuda")
    out = buf[: R * k].view(R, k)
    cuda_topk.group_topk(x, k, ends, gmax, out=out)
    assert (buf[R * k :] == -7).all(), "written past the rows"
    assert torch.equal(out, _contract_order(x, k, torch.zeros_like(ends), ends))
