"""The direct kernel launch (``needlescope.kernels.launch``): its key against Triton's own
specialization, the bound-argument tail, and on a GPU the direct path against the JIT's."""

from __future__ import annotations

import itertools

import pytest
import torch

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from needlescope.kernels import launch as launch_mod  # noqa: E402
from needlescope.kernels import topk, triton_bisect, triton_logits  # noqa: E402

CUDA = torch.cuda.is_available() and not launch_mod.INTERPRET


def _values() -> list:
    """Arguments of every kind a launch meets: tensors of several dtypes, 16-byte aligned or not
    (a view one element in), and integers around each of Triton's integer specializations."""
    base = torch.zeros(64)
    tensors = [
        base,
        base[1:],
        base[4:],
        base.to(torch.float16),
        base.to(torch.float16)[8:],
        base.to(torch.float16)[1:],
        base.to(torch.int32),
        base.to(torch.uint8)[3:],
    ]
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 16, 2**31, 2**31 + 1, 2**63 - 16, 2**63, 2**64 - 16]
    return tensors + ints + [0.5, 3.0, True, False]


def _triton(a) -> tuple:
    return native_specialize_impl(BaseBackend, a, False, True, True)


def test_equal_keys_mean_equal_triton_specializations() -> None:
    """Two arguments with one key must compile to one kernel; a key coarser than Triton's would
    launch a kernel compiled for another alignment or integer width."""
    values = _values()
    for a, b in itertools.combinations(values, 2):
        if launch_mod.specialization_key((a,)) == launch_mod.specialization_key((b,)):
            assert _triton(a) == _triton(b), (a, b)


def test_key_refuses_argument_types_it_does_not_cover() -> None:
    assert launch_mod.specialization_key((torch.zeros(2), 3, object())) is None
    assert launch_mod.specialization_key((torch.zeros(2), 3)) is not None


def _toy(x_ptr, n, A: tl.constexpr, B: tl.constexpr = 3, C: tl.constexpr = 5):
    pass


def test_tail_binds_keywords_then_defaults_in_signature_order() -> None:
    kernel = JITFunction(_toy)  # a JITFunction even under the interpreter, which wraps kernels otherwise
    assert launch_mod._tail(kernel, 2, {"C": 9, "A": 1, "num_warps": 4}) == (1, 3, 9)
    assert launch_mod._tail(kernel, 3, {"C": 9}) == (3, 9)
    with pytest.raises(TypeError, match="'A'"):
        launch_mod._tail(kernel, 2, {"B": 1})


def test_the_interpreter_always_launches_through_the_jit() -> None:
    if not launch_mod.INTERPRET:
        pytest.skip("compiled launches on this machine")
    previous = launch_mod.use_direct_launch(True)
    try:
        assert launch_mod._DIRECT[0] is False
    finally:
        launch_mod.use_direct_launch(previous)


@pytest.mark.skipif(not CUDA, reason="the direct path launches compiled kernels on a GPU")
@pytest.mark.parametrize("offset", [0, 1])
def test_direct_launches_equal_jit_launches(offset: int) -> None:
    """The second and later calls of a specialization take the direct path; ``offset`` 1 gives the
    logits rows a 4-byte misalignment, a second specialization of the same kernels."""
    g = torch.Generator(device="cuda").manual_seed(offset)
    rows, width, k = 4, 20_000, 512
    buf = torch.randn(rows * width + offset, generator=g, device="cuda")
    logits = buf[offset:].view(rows, width)
    lens = torch.tensor([width, width - 3, 700, 100], dtype=torch.int32, device="cuda")
    results = {}
    for direct in (False, True):
        previous = launch_mod.use_direct_launch(direct)
        try:
            got = [topk.topk(logits, k, None, lens, method=m) for m in ("bisect", "radix", "filter")]
            got += [topk.topk(logits, k, None, lens, method=m) for m in ("bisect", "radix", "filter")]
        finally:
            launch_mod.use_direct_launch(previous)
        results[direct] = got
    for a, b in zip(results[False], results[True]):
        assert torch.equal(a, b)
    assert any(key[0] is triton_bisect._topk_kernel for key in launch_mod._COMPILED)


@pytest.mark.skipif(not CUDA, reason="the direct path launches compiled kernels on a GPU")
def test_direct_paged_logits_equal_jit_paged_logits() -> None:
    from needlescope.kernels import page_keys, quantize_keys, quantize_queries

    g = torch.Generator(device="cuda").manual_seed(3)
    B, H, D, pages = 3, 64, 128, 40
    q = torch.randn(B, H, D, generator=g, device="cuda")
    w = torch.rand(B, H, generator=g, device="cuda")
    keys = quantize_keys(torch.randn(pages * 64 * B, D, generator=g, device="cuda"), "fp8_e4m3")
    qc, wf = quantize_queries(q, w, "fp8_e4m3")
    bt = torch.arange(B * pages, device="cuda", dtype=torch.int32).view(B, pages)
    entry_of = torch.arange(B * pages * 64, device="cuda").view(B, -1)
    lens = torch.tensor([pages * 64, 1000, 65], dtype=torch.int32, device="cuda")
    paged = page_keys(keys, bt, B * pages, entry_of)
    outs = {}
    for direct in (False, True):
        previous = launch_mod.use_direct_launch(direct)
        try:
            outs[direct] = [
                triton_logits.paged_logits(qc, wf, paged, lens, persistent=p) for p in (True, False, True)
            ]
        finally:
            launch_mod.use_direct_launch(previous)
    for a, b in zip(outs[False], outs[True]):
        assert torch.equal(a, b)


def test_an_empty_hook_chain_is_no_hook() -> None:
    """Triton 3.4+ keeps an empty ``HookChain`` as its launch hook; only one with calls (a profiler
    attached) sends launches through the JIT, which calls it."""
    from triton.knobs import HookChain

    chain = HookChain()
    assert not launch_mod._hooked(None)
    assert not launch_mod._hooked(chain)
    chain.add(print)
    assert launch_mod._hooked(chain)
    assert launch_mod._hooked(print)
