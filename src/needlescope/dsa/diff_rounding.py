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
   replays within the floor.

Cases 2 and 4 are "inputs rounded": the budget then includes the module's calibrated move under
input noise of relative size ``u_p`` (``dsa.diff``).
"""

from __future__ import annotations

import dataclasses

import torch

from needlescope.dsa.module_replay import Call, handed_err, rel_err, replay_own, roundtrips, scalars, tensors

__all__ = ["PRECISION_DTYPES", "rounded", "reduced_precision", "unit_roundoff"]

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


def rounded(obj, dtype: torch.dtype, only: int | None = None, depth: int = 0, seen: list | None = None):
    """``obj`` with its floating tensors (``tensors`` order) rounded to ``dtype`` and cast back;
    ``only``: round the floating tensor of that index alone."""
    seen = [0] if seen is None else seen
    if isinstance(obj, torch.Tensor):
        if not obj.is_floating_point():
            return obj
        i, seen[0] = seen[0], seen[0] + 1
        return obj.to(dtype).to(obj.dtype) if only is None or i == only else obj
    if depth < 3 and isinstance(obj, (tuple, list)):
        vals = [rounded(x, dtype, only, depth + 1, seen) for x in obj]
        return tuple(vals) if isinstance(obj, tuple) else vals
    if depth < 3 and isinstance(obj, dict) and type(obj) is dict:
        return {k: rounded(obj[k], dtype, only, depth + 1, seen) for k in sorted(obj, key=str)}
    return obj


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
        for only in [None, 0] if n > 1 else [None]:
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


def reduced_precision(
    reference, cand: Call, callees: list[Call], replay: tuple, declared: str | None, floor: float,
    selection: bool,
) -> tuple[str | None, bool]:  # fmt: skip
    """(the coarsest precision that explains the call's own error, were its inputs rounded?), or
    (None, False). ``replay``: (output error, replayed output, handed pairs) of ``replay_own``."""
    out_err, replayed, handed = replay
    found = [(declared, True)] if declared is not None else []
    found += _recorded(cand, replayed)
    if not found and (p := _handed_rounded(handed, out_err, floor)) is not None:
        found.append((p, False))
    if not found and (p := _input_rounded(reference, cand, callees, floor, selection)) is not None:
        found.append((p, True))
    if not found:
        return None, False
    coarsest = max(found, key=lambda f: unit_roundoff(PRECISION_DTYPES[f[0]]))[0]
    return coarsest, any(inputs for name, inputs in found if name == coarsest) or declared is not None
