"""Record every module call of a model, replay one module's own code, and calibrate its amplification.

The three measurements ``needlescope.dsa.diff`` judges a module by:

* ``Recorder``: forward hooks on every named sub-module. Each call keeps what its caller
  passed in (a pre-hook that runs before any other pre-hook, so a patch's own pre-hooks count
  as the module's doing), the floating inputs its forward actually saw, its whole output, and
  the key of the module call it ran inside (``parent``).
* ``replay_own``: run the *reference* module on the *candidate's* inputs, with every module it
  calls replaced by a stub that returns the candidate's recorded output of that call and
  records what the reference code passed in. What then differs, the output or the inputs
  handed to a callee, was produced by the module's own code (its plain tensor code, its
  parameters, its hooks), never by its inputs or callees.
* ``calibrate``: run the reference module (callees included) on its reference inputs plus
  Gaussian noise of given relative sizes, and measure how far its output moves: an empirical
  condition number at the scale of the error that actually arrives.

Calls that run through a KV cache (a chunk of a chunked or streamed run): the recorder keeps,
in place of the live ``Cache`` the call was given, a copy of the cache entry of the call's layer
as it stood before the call (``frozen``), and every replay and calibration runs on a fresh copy
of that (``thawed``), so a replayed attention, compressor or indexer sees the sliding window,
compressor buffers and indexer keys of the chunks before its own, as the recorded run did.

All error measures are ``output_err``: the largest norm-wise relative error over the tensors
of two outputs of one structure, with selections (integer top-k outputs of an indexer)
compared as sets (``selection_error``).
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

__all__ = [
    "Call",
    "Recorder",
    "tensors",
    "first_tensor",
    "rel_err",
    "membership",
    "selection_error",
    "output_err",
    "roundtrips",
    "scalars",
    "handed_err",
    "replay_own",
    "perturbed",
    "calibrate",
]

INDEXER = "DeepseekV4Indexer"
DECODER = "DeepseekV4DecoderLayer"


def rel_err(cand: torch.Tensor, ref: torch.Tensor) -> float:
    """||cand - ref|| / ||ref|| in float64 over whole tensors of one shape.

    Equal entries (also equal infinities) contribute zero difference; a finite/non-finite
    mismatch or a shape mismatch gives inf. Non-finite reference entries are left out of
    ||ref||. Integer tensors: the fraction of differing elements.
    """
    if cand.shape != ref.shape:
        return math.inf
    if ref.numel() == 0:
        return 0.0
    if cand.device == ref.device and cand.dtype == ref.dtype and torch.equal(cand, ref):
        return 0.0
    if not (ref.is_floating_point() or ref.is_complex()):
        return float((cand.to(ref.device) != ref).double().mean())
    a, b = cand.detach().to(ref.device).double(), ref.detach().double()
    same = a == b
    if bool((~same & ~(torch.isfinite(a) & torch.isfinite(b))).any()):
        return math.inf
    diff = torch.where(same, torch.zeros_like(a), a - b)
    num = float(diff.norm())
    den = float(torch.where(torch.isfinite(b), b, torch.zeros_like(b)).norm())
    if num == 0.0:
        return 0.0
    return num / den if den > 0 else math.inf


def membership(idx: torch.Tensor, L: int) -> torch.Tensor:
    """Bool [N, L]: entry l is among row n's indices (-1 ignored). idx: [N, k]."""
    out = torch.zeros(idx.shape[0], L + 1, dtype=torch.bool, device=idx.device)
    out.scatter_(1, torch.where(idx >= 0, idx, torch.full_like(idx, L)), True)
    return out[:, :L]


def selection_error(cand: torch.Tensor, ref: torch.Tensor) -> tuple[float, int, int]:
    """Set difference of two top-k selections: (mean |A Δ B| / |A ∪ B|, rows changed, rows counted).

    cand, ref: [..., k] entry indices (flattened to rows; the widths may differ), -1 = no
    entry. Additions and drops both count: a row that keeps all k reference entries and adds
    one more has error 1/(k+1). Rows where both sets are empty are skipped.
    """
    r = ref.reshape(-1, ref.shape[-1]).long()
    c = cand.reshape(-1, cand.shape[-1]).long().to(r.device)
    if r.shape[0] != c.shape[0]:
        return math.inf, r.shape[0], r.shape[0]
    L = int(max(int(r.max()) if r.numel() else -1, int(c.max()) if c.numel() else -1)) + 1
    mr, mc = membership(r, L), membership(c, L)  # [N, L]
    union = (mr | mc).sum(-1)
    rows = union > 0
    if not bool(rows.any()):
        return 0.0, 0, 0
    sym = (mr ^ mc).sum(-1)
    err = sym[rows].double() / union[rows].double()
    return float(err.mean()), int((sym > 0).sum()), int(rows.sum())


def tensors(obj, depth: int = 0) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj``, looking three levels into tuples, lists and mappings (keys sorted)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 3 and isinstance(obj, (tuple, list)):
        for x in obj:
            yield from tensors(x, depth + 1)
    elif depth < 3 and isinstance(obj, Mapping):
        for key in sorted(obj, key=str):
            yield from tensors(obj[key], depth + 1)


def first_tensor(out) -> torch.Tensor | None:
    """The output itself, or the first tensor of a tuple/list or of a ``ModelOutput``-style mapping."""
    if isinstance(out, torch.Tensor):
        return out
    items = out.values() if isinstance(out, Mapping) else out if isinstance(out, (tuple, list)) else ()
    return next((x for x in items if isinstance(x, torch.Tensor)), None)


def output_err(cand, ref, *, selection: bool = False) -> float:
    """Largest relative error over the paired tensors of two outputs (inf when the structures differ).

    ``selection``: integer tensors are top-k selections, compared with ``selection_error``.
    """
    a, b = list(tensors(cand)), list(tensors(ref))
    if len(a) != len(b):
        return math.inf
    errs = [
        selection_error(x, y)[0] if selection and not y.is_floating_point() else rel_err(x, y)
        for x, y in zip(a, b)
    ]
    return max(errs, default=0.0)


def roundtrips(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Every finite value of a floating ``x`` survives a cast to ``dtype`` and back unchanged."""
    if not x.is_floating_point() or x.numel() == 0:
        return False
    finite = x[torch.isfinite(x)]
    return bool((finite.to(dtype).to(finite.dtype) == finite).all())


@dataclass
class Call:
    """One recorded module call."""

    key: str  # name, or "name[call n]" for the n-th call (n >= 2), numbered in call order
    name: str
    type: str
    kind: str  # "module" | "indexer_selection" | "hc_streams_in" | "hc_streams_out"
    parent: str | None  # key of the module call this one ran inside
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    seen: list[torch.Tensor] = field(default_factory=list)  # floating inputs as forward saw them
    output: object = None

    @property
    def out(self) -> torch.Tensor | None:
        return first_tensor(self.output)

    @property
    def inputs(self) -> list[torch.Tensor]:
        """Floating tensors among the caller's arguments."""
        return [t for t in tensors((self.args, self.kwargs)) if t.is_floating_point()]


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def _is_cache(obj) -> bool:
    from transformers.cache_utils import Cache

    return isinstance(obj, Cache)


def copy_cache(cache, layer: int | None):
    """A copy of ``cache`` whose entry of ``layer`` (every entry when None) is independent of the
    original; the other entries are shared (a module of one layer touches only its own)."""
    new = copy.copy(cache)
    new.layers = list(cache.layers)
    for i in range(len(new.layers)) if layer is None else [layer]:
        new.layers[i] = copy.deepcopy(cache.layers[i])
    return new


@dataclass(frozen=True)
class FrozenCache:
    """A cache as it stood before a recorded call: ``cache`` (never run again) and the layer it is for."""

    cache: object
    layer: int | None


def frozen(args: tuple, kwargs: dict, name: str) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with every ``Cache`` replaced by a ``FrozenCache`` of module ``name``'s layer."""
    m = _LAYER.search(name)
    layer = int(m.group(1)) if m else None

    def freeze(x):
        return FrozenCache(copy_cache(x, layer), layer) if _is_cache(x) else x

    return tuple(freeze(a) for a in args), {k: freeze(v) for k, v in kwargs.items()}


def thawed(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with every ``FrozenCache`` replaced by a fresh copy a replay may run on."""

    def thaw(x):
        return copy_cache(x.cache, x.layer) if isinstance(x, FrozenCache) else x

    return tuple(thaw(a) for a in args), {k: thaw(v) for k, v in kwargs.items()}


class Recorder:
    """Forward hooks on every named sub-module; ``rows`` in the order the calls return.

    A module returns after every module that produced its inputs and after its own callees,
    so children come before their parent. Each decoder layer adds a ``NAME.hc_streams_in``
    probe of the streams entering it (recorded when it starts).
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.rows: list[Call] = []
        self._calls: dict[str, int] = {}
        self._stack: list[Call] = []
        self._handles: list = []
        self._paused = False

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Record nothing inside the block (replays of the recorded model's own modules)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def _key(self, name: str) -> str:
        n = self._calls.get(name, 0) + 1
        self._calls[name] = n
        return name if n == 1 else f"{name}[call {n}]"

    def _pre(self, name: str, tname: str):
        def hook(module, args, kwargs):
            if self._paused:
                return
            parent = self._stack[-1].key if self._stack else None
            if tname == DECODER:
                hs = args[0] if args else kwargs["hidden_states"]
                probe = self._key(f"{name}.hc_streams_in")
                self.rows.append(Call(probe, probe, "streams", "hc_streams_in", parent, output=hs.detach()))
            kind = (
                "indexer_selection"
                if tname == INDEXER
                else "hc_streams_out"
                if tname == DECODER
                else "module"
            )
            args_in, kwargs_in = frozen(tuple(args), dict(kwargs), name)
            self._stack.append(Call(self._key(name), name, tname, kind, parent, args_in, kwargs_in))

        return hook

    def _post(self, module, args, kwargs, output):
        if self._paused:
            return
        call = self._stack.pop()
        call.seen = [t.detach() for t in tensors((args, kwargs)) if t.is_floating_point()]
        call.output = output
        if output is not None:
            self.rows.append(call)

    def __enter__(self) -> Recorder:
        for name, mod in self.model.named_modules():
            if not name:
                continue
            tname = type(mod).__name__
            self._handles.append(
                mod.register_forward_pre_hook(self._pre(name, tname), with_kwargs=True, prepend=True)
            )
            self._handles.append(mod.register_forward_hook(self._post, with_kwargs=True, always_call=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _clone(obj):
    """A copy of an output whose tensors the replayed code may modify in place."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_clone(x) for x in obj)
    if isinstance(obj, list):
        return [_clone(x) for x in obj]
    return obj


def scalars(obj, depth: int = 0) -> Iterator[object]:
    """Every plain value (str, int, float, bool, None) in ``obj``, in ``tensors``' order: the
    arguments that pick a code path (a RoPE table's ``layer_type``, a layer index)."""
    if obj is None or isinstance(obj, (str, int, float, bool)):
        yield obj
    elif depth < 3 and isinstance(obj, (tuple, list)):
        for x in obj:
            yield from scalars(x, depth + 1)
    elif depth < 3 and isinstance(obj, Mapping):
        for key in sorted(obj, key=str):
            yield key
            yield from scalars(obj[key], depth + 1)


def handed_err(cand, ref) -> float:
    """``output_err`` of what two codes handed a callee, inf when a plain argument differs: a
    callee asked for another RoPE table (``layer_type="main"``) computes faithfully what it was
    asked, so only the caller's code can answer for the change."""
    if list(scalars(cand)) != list(scalars(ref)):
        return math.inf
    return output_err(cand, ref)


def replay_own(
    reference: torch.nn.Module,
    call: Call,
    callees: list[Call],
    *,
    selection: bool = False,
    handed: list | None = None,
    ops=None,
) -> tuple[float, float, object]:
    """Replay ``call`` on the reference module with the candidate's inputs and callee outputs.

    ``callees``: the candidate's recorded calls made inside ``call`` (``parent == call.key``),
    in call order. Each callee module of the reference is stubbed for the replay: its n-th call
    returns the candidate's n-th recorded output of that module (a call with no recorded
    counterpart runs the reference callee for real). Returns (output error, callee-input
    error, replayed output): the candidate's output against the replay's, and the largest
    error between what the candidate's code and the reference code handed to a callee
    (``handed_err``: tensors and plain arguments). ``handed``, when given, receives one
    ((candidate args, kwargs), (replay args, kwargs)) pair per stubbed callee call. ``ops``,
    when given, is a ``TorchFunctionMode`` the replay runs under (``dsa.diff_rounding`` rounds
    or perturbs the module's own intermediate values through it).
    """
    module = reference.get_submodule(call.name)
    queues: dict[str, list[Call]] = {}
    for c in callees:
        queues.setdefault(c.name, []).append(c)
    pairs: list[tuple[tuple, tuple]] = []  # compared after the replay, outside ``ops``
    saved: list[tuple[torch.nn.Module, object]] = []

    def stub(mod: torch.nn.Module, queue: list[Call], real):
        def forward(*args, **kwargs):
            if not queue:
                return real(*args, **kwargs)
            rec = queue.pop(0)
            pairs.append(((rec.args, rec.kwargs), (args, kwargs)))
            return _clone(rec.output)

        return forward

    try:
        for name, queue in queues.items():
            try:
                mod = reference.get_submodule(name)
            except AttributeError:
                continue
            saved.append((mod, mod.__dict__.get("forward")))
            mod.forward = stub(mod, queue, mod.forward)
        try:
            args, kwargs = thawed(call.args, call.kwargs)
            with ops if ops is not None else nullcontext():
                replayed = module(*args, **kwargs)
        except Exception:  # the candidate's inputs do not fit the reference code: its own doing
            return math.inf, 0.0, None
    finally:
        for mod, own in reversed(saved):
            if own is None:
                mod.__dict__.pop("forward", None)
            else:
                mod.forward = own
    if handed is not None:
        handed.extend(pairs)
    out_err = output_err(call.output, replayed, selection=selection)
    return out_err, max((handed_err(c, r) for c, r in pairs), default=0.0), replayed


def perturbed(obj, sizes: list[float], gen: torch.Generator, depth: int = 0):
    """``obj`` with each floating tensor t (in ``tensors`` order) + noise of norm sizes[i] * ||t||."""
    if isinstance(obj, torch.Tensor):
        if not obj.is_floating_point():
            return obj
        size = sizes.pop(0) if sizes else 0.0
        finite = torch.isfinite(obj)
        base = torch.where(finite, obj, torch.zeros_like(obj)).double()
        if size <= 0 or not math.isfinite(size) or float(base.norm()) == 0.0:
            return obj
        noise = torch.randn(obj.shape, generator=gen, dtype=torch.float64).to(obj.device)
        noise = noise * (size * float(base.norm()) / float(noise.norm()))
        return torch.where(finite, (base + noise).to(obj.dtype), obj)
    if depth < 3 and isinstance(obj, (tuple, list)):
        vals = [perturbed(x, sizes, gen, depth + 1) for x in obj]
        return tuple(vals) if isinstance(obj, tuple) else vals
    if depth < 3 and isinstance(obj, Mapping) and type(obj) is dict:
        return {k: perturbed(obj[k], sizes, gen, depth + 1) for k in sorted(obj, key=str)}
    return obj


def calibrate(
    reference: torch.nn.Module,
    call: Call,
    sizes: list[float],
    *,
    draws: int = 2,
    seed: int = 0,
    selection: bool = False,
) -> float:
    """How far the reference module's output moves under input noise of the given relative sizes.

    ``call``: the reference's recorded call; ``sizes``: one relative noise size per floating
    input (``Call.inputs`` order). Each draw runs the module (its callees included) on
    perturbed inputs; returns the largest ``output_err`` against the recorded output over
    ``draws`` seeded draws. Costs ``draws`` forwards of the module.
    """
    module = reference.get_submodule(call.name)
    gen = torch.Generator().manual_seed(seed)
    moved = 0.0
    for _ in range(draws):
        args, kwargs = thawed(*perturbed((call.args, call.kwargs), list(sizes), gen))
        moved = max(moved, output_err(module(*args, **kwargs), call.output, selection=selection))
    return moved
