"""Which reduced precision explains a module call's own error: the rounding the localizer judges it by.

A module's own error (``dsa.diff``) is explained by a rounding to ``p`` (bf16 or fp16) when one of
these holds; the first three are read from the recorded call, the last two are tested by
replaying the reference module on rounded values, so a match is exact, never a guess:

1. every value of a candidate output tensor round-trips through ``p`` while the replay's does not
   (an epilogue that stores the output in ``p``);
2. the inputs its forward saw were rounded to ``p`` by its own pre-hooks;
3. a declared ``--allow PATTERN=p``;
4. **its input was rounded inside its forward** (a projection reading an attention output that a
   kernel stored in bf16): the reference module replayed on the candidate's floating inputs
   rounded to ``p`` (all of them, else the first alone) reproduces the candidate's output and
   what it handed its callees, within the floor;
5. **its own code rounded what it handed a callee**: every callee input the candidate's code
   handed over equals the reference code's either as is or rounded to ``p``, and its output
   replays within the floor;
6. **its own code rounded values in between** (an attention output stored in bf16 and then
   de-rotated, rotary tables or a rotary application's input read in bf16): the reference
   module replayed with a few of its *sites* rounded to ``p`` (a site is one of its floating
   inputs or the floating result of one of its own tensor ops, numbered in call order by a
   ``TorchFunctionMode``; callees stay stubbed) reproduces the candidate within the floor.
   The sites are found greedily (the site whose rounding brings the replay closest to the
   candidate, at most ``MAX_SITES``), and only an exact reproduction counts.

Cases 2 and 4 are "inputs rounded": the budget then includes the module's calibrated move under
input noise of relative size ``u_p`` (``dsa.diff``). Case 6's budget includes ``rounding_move``:
how far the replay moves (its output and what it hands its callees) when those sites get noise
of relative size ``u_p`` instead.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection

import torch
from torch.overrides import TorchFunctionMode

from needlescope.dsa.module_replay import (
    Call,
    handed_err,
    output_err,
    perturbed,
    rel_err,
    replay_own,
    roundtrips,
    scalars,
    tensors,
)

__all__ = [
    "PRECISION_DTYPES",
    "MAX_SITES",
    "Rounding",
    "rounded",
    "reduced_precision",
    "rounding_move",
    "unit_roundoff",
]

MAX_SITES = 4
"""Most intermediate values (case 6) one module's rounding may be found at."""

PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""Reduced precisions a module may be detected at or declared with (``allow``), coarsest first."""

_UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
}


def unit_roundoff(dtype: torch.dtype) -> float:
    """Unit roundoff (half the machine epsilon) of a floating dtype; 0 for others."""
    return _UNIT_ROUNDOFF.get(dtype, 0.0)


def rounded(obj, dtype: torch.dtype, only: Collection[int] | None = None):
    """``obj`` with its floating tensors (``tensors`` order) rounded to ``dtype`` and cast back;
    ``only``: round the floating tensors of those indices alone."""
    return _changed(obj, only, lambda t, site: t.to(dtype).to(t.dtype))


def _recorded(cand: Call, replayed) -> list[tuple[str, bool]]:
    """(precision, inputs rounded?) of cases 1 and 2 (module docstring)."""
    found = []
    outs = [t for t in tensors(cand.output) if t.is_floating_point()]
    reps = [t for t in tensors(replayed) if t.is_floating_point()]
    for name, dt in PRECISION_DTYPES.items():
        if any(roundtrips(c, dt) and not roundtrips(r, dt) for c, r in zip(outs, reps)):
            found.append((name, False))
        if any(
            s.shape == c.shape and not torch.equal(s, c) and roundtrips(s, dt)
            for s, c in zip(cand.seen, cand.inputs)
        ):
            found.append((name, True))
    return found


def _input_rounded(reference, cand: Call, callees: list[Call], floor: float, selection: bool) -> str | None:
    """Case 4: the precision whose rounding of the candidate's inputs the reference reproduces it from."""
    n = len(cand.inputs)
    for name, dt in PRECISION_DTYPES.items():
        for only in [None, {0}] if n > 1 else [None]:
            args, kwargs = rounded((cand.args, cand.kwargs), dt, only)
            trial = dataclasses.replace(cand, args=args, kwargs=kwargs)
            out_err, in_err, _ = replay_own(reference, trial, list(callees), selection=selection)
            if max(out_err, in_err) <= floor:
                return name
    return None


def _handed_rounded(handed: list, out_err: float, floor: float) -> str | None:
    """Case 5: the precision every differing callee input is the reference code's rounding to."""
    if not handed or out_err > floor:
        return None
    for name, dt in PRECISION_DTYPES.items():
        if all(handed_err(c, r) <= floor or _all_equal_rounded(c, r, dt, floor) for c, r in handed):
            return name
    return None


def _all_equal_rounded(cand, ref, dtype: torch.dtype, floor: float) -> bool:
    """``cand`` is ``ref`` with its floating tensors rounded to ``dtype`` (plain arguments equal)."""
    if list(scalars(cand)) != list(scalars(ref)):
        return False
    a, b = list(tensors(cand)), list(tensors(rounded(ref, dtype)))
    return len(a) == len(b) and all(rel_err(x, y) <= floor for x, y in zip(a, b))


class _Sites(TorchFunctionMode):
    """Numbers the floating tensor results of the ops a replay runs (in-place results, which are
    their own input, excepted) and replaces the result of site ``i`` by ``change[i](result)``.
    ``exact`` (when counting, ``change`` None): per site, the precisions its result already
    round-trips through (rounding it there changes nothing)."""

    def __init__(self, change: dict[int, Callable[[torch.Tensor], torch.Tensor]] | None = None):
        super().__init__()
        self.n, self.change, self.exact = 0, change, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.is_floating_point() and not any(out is a for a in args):
            i, self.n = self.n, self.n + 1
            if self.change is None:
                self.exact.append({p for p, dt in PRECISION_DTYPES.items() if roundtrips(out, dt)})
            elif i in self.change:
                out = self.change[i](out)
        return out


Site = tuple[str, int]
"""("in", i): the call's i-th floating input; ("op", j): the floating result of its j-th op."""


def _replay_at(reference, cand: Call, callees: list[Call], sites, change, selection: bool, handed=None):
    """``replay_own`` with ``change(tensor, site)`` applied to the given sites."""
    inputs = {i for kind, i in sites if kind == "in"}
    if inputs:
        args, kwargs = _changed((cand.args, cand.kwargs), inputs, change)
        cand = dataclasses.replace(cand, args=args, kwargs=kwargs)
    ops = _Sites({j: (lambda t, j=j: change(t, ("op", j))) for kind, j in sites if kind == "op"})
    return replay_own(reference, cand, list(callees), selection=selection, handed=handed, ops=ops)


def _changed(obj, inputs: Collection[int] | None, change, depth: int = 0, seen: list | None = None):
    """``obj`` with its floating tensors of the given indices (``tensors`` order; None: all)
    replaced by ``change(tensor, ("in", index))``."""
    seen = [0] if seen is None else seen
    if isinstance(obj, torch.Tensor):
        if not obj.is_floating_point():
            return obj
        i, seen[0] = seen[0], seen[0] + 1
        return change(obj, ("in", i)) if inputs is None or i in inputs else obj
    if depth < 3 and isinstance(obj, (tuple, list)):
        vals = [_changed(x, inputs, change, depth + 1, seen) for x in obj]
        return tuple(vals) if isinstance(obj, tuple) else vals
    if depth < 3 and isinstance(obj, dict) and type(obj) is dict:
        return {k: _changed(obj[k], inputs, change, depth + 1, seen) for k in sorted(obj, key=str)}
    return obj


def _sites_rounded(reference, cand: Call, callees: list[Call], own_err: float, floor: float, selection: bool):
    """Case 6: (precision, sites) whose rounding the reference replay reproduces the candidate from.
    Costs one replay of the module's own code per site tried (callees stay stubbed)."""
    if not math.isfinite(own_err):  # a changed plain argument or structure: no rounding explains it
        return None
    counter = _Sites()
    replay_own(reference, cand, list(callees), selection=selection, ops=counter)
    for name, dt in PRECISION_DTYPES.items():

        def to_p(t, site, dt=dt):
            return t.to(dt).to(t.dtype)

        # A site whose value already round-trips through ``dt`` cannot be where it was rounded.
        # Latest first: a value is most often rounded where a kernel stores its result.
        every = [("op", j) for j, exact in reversed(list(enumerate(counter.exact))) if name not in exact]
        every += [("in", i) for i, t in enumerate(cand.inputs) if not roundtrips(t, dt)]
        chosen: tuple[Site, ...] = ()
        best = own_err
        for _ in range(MAX_SITES):
            trials = []
            for site in (s for s in every if s not in chosen):
                out_err, in_err, _ = _replay_at(reference, cand, callees, chosen + (site,), to_p, selection)
                if max(out_err, in_err) <= floor:
                    return name, chosen + (site,)
                trials.append((max(out_err, in_err), site))
            if not trials:
                break
            err, site = min(trials)
            if not err < 0.99 * best:  # no site brings the replay closer: not a rounding
                break
            chosen, best = chosen + (site,), err
    return None


def rounding_move(
    reference, cand: Call, callees: list[Call], sites: tuple[Site, ...], size: float, *, draws: int,
    selection: bool, seed: int = 0,
) -> float:  # fmt: skip
    """How far the replay of ``cand`` (its output, and what it hands its callees) moves when the
    given sites get Gaussian noise of relative size ``size``: the largest over ``draws`` seeded
    draws. Costs ``draws + 1`` replays of the module's own code."""
    clean_handed: list = []
    _, _, clean = replay_own(reference, cand, list(callees), selection=selection, handed=clean_handed)
    gen = torch.Generator().manual_seed(seed)

    def noise(t, site):
        return perturbed(t, [size], gen)

    moved = 0.0
    for _ in range(draws):
        handed: list = []
        _, _, out = _replay_at(reference, cand, callees, sites, noise, selection, handed)
        errs = [handed_err(n[1], c[1]) for n, c in zip(handed, clean_handed)]
        moved = max(moved, output_err(out, clean, selection=selection), *errs)
    return moved


@dataclasses.dataclass(frozen=True)
class Rounding:
    """What explains a call's own error: ``precision`` (bf16 or fp16); ``inputs``: its inputs
    were rounded (cases 2, 4 and a declaration); ``sites``: the intermediate values its own code
    rounded (case 6), else empty."""

    precision: str
    inputs: bool = False
    sites: tuple[Site, ...] = ()


def reduced_precision(
    reference, cand: Call, callees: list[Call], replay: tuple, declared: str | None, floor: float,
    selection: bool,
) -> Rounding | None:  # fmt: skip
    """The coarsest rounding that explains the call's own error, or None. ``replay``: (output
    error, replayed output, handed pairs) of ``replay_own``, and the own error."""
    out_err, replayed, handed, own_err = replay
    found = [Rounding(declared, True)] if declared is not None else []
    found += [Rounding(p, inputs) for p, inputs in _recorded(cand, replayed)]
    if not found and (p := _handed_rounded(handed, out_err, floor)) is not None:
        found.append(Rounding(p))
    if not found and (p := _input_rounded(reference, cand, callees, floor, selection)) is not None:
        found.append(Rounding(p, True))
    if not found and (hit := _sites_rounded(reference, cand, callees, own_err, floor, selection)) is not None:
        found.append(Rounding(hit[0], sites=hit[1]))
    if not found:
        return None
    coarsest = max(found, key=lambda f: unit_roundoff(PRECISION_DTYPES[f.precision]))
    inputs = any(f.inputs for f in found if f.precision == coarsest.precision) or declared is not None
    return dataclasses.replace(coarsest, inputs=inputs)
