"""Read a top-k capture (logits and the engine's selections) for ``needlescope indexer topk-audit``.

Three layouts (``docs/topk_audit.md`` shows how each is produced):

* **A safetensors file** (an engine's top-k op dumped at its call site, e.g. vLLM's
  ``top_k_per_row_*`` / ``persistent_topk`` arguments): ``logits`` float32/fp16/bf16
  ``[R, L]`` or ``[R, layers, L]`` (``-inf`` = padding / masked), ``indices`` (or
  ``topk_indices``) int ``[R, k]`` or ``[R, layers, k]`` (negative = empty slot), optional
  ``lengths`` (or ``seq_lens``) int ``[R]`` (columns in use per row) and ``positions`` int
  ``[R]`` (the query position of each row).
* **The same file with ``[R, layers, L]`` logits and no indices, plus an engine's response**
  (``indices_json``): SGLang's ``/generate`` ``meta_info["indexer_topk"]``, base64 int32
  ``[tokens - 1, layers, k]`` (``dsa.capture``), or vLLM PR #49555's (open)
  ``choices[0]["indexer_topk"]``, base64 of ``.npy`` int32 ``[tokens, layers, k]``; the file's
  ``positions`` pick the response rows that match its logits rows (default: the first R).
* **A ``needlescope serve`` ``/generate`` response** (JSON) of a request with
  ``return_indexer_topk`` and ``return_indexer_logits``: ``meta_info["indexer_topk"]`` /
  ``indexer_topk_shape`` and ``indexer_logits`` (base64 little-endian float32) /
  ``indexer_logits_shape`` ``[rows, layers, W]``, ``indexer_topk_positions`` when rows were chosen.

Every loader returns an ``AuditInput`` with one audit row per (row, layer); BadInput (one line)
for anything malformed.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from needlescope.dsa.capture import decode_capture
from needlescope.errors import BadInput, ProtocolViolation

__all__ = ["AuditInput", "load_capture", "from_serve_response", "flatten_layers"]


@dataclass(frozen=True)
class AuditInput:
    """Rows to audit: logits [N, L], selected [N, k], per-row lengths / labels (None when unknown)."""

    logits: np.ndarray
    selected: np.ndarray
    lengths: np.ndarray | None
    row: np.ndarray  # [N] index of each audit row along the capture's first axis
    layer: np.ndarray | None  # [N] capture layer of each row
    position: np.ndarray | None  # [N] query position of each row
    format: str


def flatten_layers(
    logits: np.ndarray,
    selected: np.ndarray,
    *,
    lengths: np.ndarray | None = None,
    positions: np.ndarray | None = None,
    layer: int | None = None,
    fmt: str,
) -> AuditInput:
    """One audit row per (row, layer) of [R, L] / [R, layers, L] inputs; ``layer`` keeps one layer."""
    if logits.ndim != selected.ndim or logits.ndim not in (2, 3):
        raise BadInput(
            f"logits {list(logits.shape)} and indices {list(selected.shape)} must both be [R, L] / [R, k] "
            "or both [R, layers, L] / [R, layers, k]"
        )
    if logits.shape[:-1] != selected.shape[:-1]:
        raise BadInput(
            f"logits {list(logits.shape)} and indices {list(selected.shape)} disagree on rows/layers"
        )
    R = logits.shape[0]
    if R == 0 or logits.shape[-1] == 0:
        raise BadInput(
            f"the capture holds no rows to audit (logits {list(logits.shape)}); save the rows the top-k was given"
        )
    for name, arr in (("lengths", lengths), ("positions", positions)):
        if arr is not None and arr.shape != (R,):
            raise BadInput(f"{name} must be [R] = [{R}], got {list(arr.shape)}")
    if positions is not None:
        _check_positions(positions, "positions")
    if lengths is not None:
        if not np.issubdtype(lengths.dtype, np.integer):
            raise BadInput(f"lengths must be an integer tensor, got {lengths.dtype}")
        L = logits.shape[-1]
        bad = [(r, int(n)) for r, n in enumerate(lengths.tolist()) if not 0 <= n <= L]
        if bad:
            r, n = bad[0]
            raise BadInput(
                f"lengths must lie in 0..{L} (the logits' columns); row {r} has {n} "
                f"({len(bad)} row(s) outside); save the lengths the top-k was called with"
            )
    if logits.ndim == 2:
        if layer is not None:
            raise BadInput("--layer needs [R, layers, L] logits; these are [R, L]")
        return AuditInput(logits, selected, lengths, np.arange(R), None, positions, fmt)
    n_layers = logits.shape[1]
    layers = range(n_layers) if layer is None else [layer]
    if layer is not None and not 0 <= layer < n_layers:
        raise BadInput(f"--layer {layer} is outside the capture's layers 0..{n_layers - 1}")
    pick = list(layers)
    return AuditInput(
        logits=logits[:, pick].reshape(R * len(pick), -1),
        selected=selected[:, pick].reshape(R * len(pick), -1),
        lengths=None if lengths is None else np.repeat(lengths, len(pick)),
        row=np.repeat(np.arange(R), len(pick)),
        layer=np.tile(np.array(pick), R),
        position=None if positions is None else np.repeat(positions, len(pick)),
        format=fmt,
    )


MAX_POSITION = 2**31 - 1
"""The largest query position read (an engine's int32 positions): a larger one is no position."""


def _check_positions(positions: np.ndarray, what: str) -> None:
    """BadInput unless ``positions`` are integers in 0..MAX_POSITION."""
    if not np.issubdtype(positions.dtype, np.integer):
        raise BadInput(f"{what} must be integers, got {positions.dtype}; save the query positions as int")
    if positions.size and (positions.min() < 0 or positions.max() > MAX_POSITION):
        bad = positions.min() if positions.min() < 0 else positions.max()
        raise BadInput(f"{what} holds {int(bad)}, outside 0..{MAX_POSITION}: not a query position")


def _position_list(value: object, what: str) -> np.ndarray:
    """int64 [N] from a JSON list of integer positions; BadInput for anything else (a float such as
    1e30, a bool, a nested list), never an OverflowError."""
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise BadInput(f"{what} must be a list of integer positions; save the positions the rows stand for")
    if any(not 0 <= v <= MAX_POSITION for v in value):
        bad = next(v for v in value if not 0 <= v <= MAX_POSITION)
        raise BadInput(f"{what} holds {bad}, outside 0..{MAX_POSITION}: not a query position")
    return np.asarray(value, dtype=np.int64)


def _b64(meta: dict, key: str, dtype: str, shape_key: str) -> np.ndarray:
    payload, shape = meta.get(key), meta.get(shape_key)
    if not isinstance(payload, str) or not isinstance(shape, list):
        raise BadInput(
            f"meta_info lacks {key!r} and {shape_key!r}; send return_indexer_topk and return_indexer_logits"
        )
    try:
        return np.frombuffer(base64.b64decode(payload, validate=True), dtype=dtype).reshape(shape)
    except (binascii.Error, ValueError, TypeError) as exc:
        raise BadInput(f"meta_info[{key!r}] does not decode to shape {shape}: {exc}") from None


def from_serve_response(obj: dict, *, layer: int | None = None) -> AuditInput:
    """An ``AuditInput`` from a ``needlescope serve`` /generate response carrying logits and top-k."""
    meta = obj.get("meta_info") if isinstance(obj, dict) else None
    if not isinstance(meta, dict):
        raise BadInput("the JSON is not a /generate response: it has no 'meta_info' object")
    if "indexer_logits" not in meta:
        raise BadInput(
            "the /generate response has no 'indexer_logits': an SGLang response carries only the selections; "
            "pass the logits as CAPTURE (a safetensors file) and this response as --indices"
        )
    topk = _b64(meta, "indexer_topk", "<i4", "indexer_topk_shape")
    logits = _b64(meta, "indexer_logits", "<f4", "indexer_logits_shape")
    positions = meta.get("indexer_topk_positions")
    what = "meta_info['indexer_topk_positions']"
    pos = np.arange(topk.shape[0]) if positions is None else _position_list(positions, what)
    return flatten_layers(logits, topk, positions=pos, layer=layer, fmt="needlescope-serve")


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise BadInput(f"{str(path)!r} is not a readable safetensors file: {exc}") from None
    out = {}
    for name, t in tensors.items():
        if t.is_floating_point():  # float64 stays float64; fp16 / bf16 widen exactly to float32
            out[name] = t.numpy() if t.dtype == torch.float64 else t.float().numpy()
        else:
            out[name] = t.long().numpy()
    return out


def _pick(tensors: dict, names: tuple[str, ...], path: Path, *, required: bool) -> np.ndarray | None:
    found = [n for n in names if n in tensors]
    if len(found) > 1:
        raise BadInput(f"{str(path)!r} holds both {found[0]!r} and {found[1]!r}; keep one")
    if not found:
        if required:
            raise BadInput(
                f"{str(path)!r} has no tensor {' or '.join(repr(n) for n in names)} (it has {sorted(tensors)})"
            )
        return None
    return tensors[found[0]]


def _vllm_npy(b64: object) -> np.ndarray:
    """The .npy array of vLLM PR #49555's ``choices[0]["indexer_topk"]`` (no pickles loaded)."""
    if not isinstance(b64, str):
        raise ValueError("choices[0]['indexer_topk'] is not a base64 string")
    return np.load(io.BytesIO(base64.b64decode(b64, validate=True)), allow_pickle=False)


def _response_indices(path: Path, logits: np.ndarray, positions: np.ndarray | None) -> tuple[np.ndarray, str]:
    """(selections [R, layers, k] for the logits rows, format) from an engine's response JSON."""
    if logits.ndim != 3:
        raise BadInput("an engine response holds every indexer layer: save the logits as [R, layers, L]")
    obj = _read_json(path)
    meta = obj.get("meta_info") if isinstance(obj, dict) else None
    choices = obj.get("choices") if isinstance(obj, dict) else None
    try:
        if isinstance(meta, dict) and "indexer_topk" in meta:
            counts = [meta.get("prompt_tokens"), meta.get("completion_tokens")]
            if not all(
                isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_POSITION for n in counts
            ):
                raise BadInput(
                    f"--indices {str(path)!r}: meta_info's prompt_tokens and completion_tokens must be token "
                    f"counts in 0..{MAX_POSITION}, got {counts[0]!r} and {counts[1]!r}"
                )
            rows = counts[0] + counts[1] - 1
            topk, fmt = decode_capture(meta["indexer_topk"], rows, num_layers=logits.shape[1]), "sglang"
        elif (
            isinstance(choices, list)
            and choices
            and isinstance(choices[0], dict)
            and "indexer_topk" in choices[0]
        ):
            topk, fmt = _vllm_npy(choices[0]["indexer_topk"]), "vllm"
        else:
            raise BadInput(
                f"--indices {str(path)!r} is neither an SGLang /generate response (meta_info.indexer_topk) nor "
                "a vLLM response with choices[0].indexer_topk"
            )
    except (KeyError, TypeError, ValueError, binascii.Error, ProtocolViolation) as exc:
        raise BadInput(f"--indices {str(path)!r}: {exc}") from None
    if topk.ndim != 3 or topk.shape[1] != logits.shape[1] or not np.issubdtype(topk.dtype, np.integer):
        raise BadInput(
            f"--indices holds {topk.dtype} {list(topk.shape)}; expected int [rows, {logits.shape[1]} layers, k]"
        )
    pick = np.arange(logits.shape[0]) if positions is None else positions
    if pick.size and (pick.min() < 0 or pick.max() >= topk.shape[0]):
        raise BadInput(
            f"the logits' rows reach position {int(pick.max())}, but --indices has rows 0..{topk.shape[0] - 1}"
        )
    return topk[pick].astype(np.int64), f"safetensors+{fmt}"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise BadInput(f"{str(path)!r} is not readable JSON: {exc}") from None
    except RecursionError:  # arrays or objects nested thousands deep: no response is
        raise BadInput(f"{str(path)!r} is nested too deeply to be an engine's JSON response") from None


def load_capture(path: Path, *, indices_json: Path | None = None, layer: int | None = None) -> AuditInput:
    """The ``AuditInput`` of CAPTURE ``path`` (.json: a serve response; else safetensors)."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"capture {str(path)!r} does not exist or is not a file")
    if path.suffix.lower() == ".json":
        if indices_json is not None:
            raise BadInput("--indices goes with a safetensors CAPTURE of logits, not a JSON response")
        return from_serve_response(_read_json(path), layer=layer)
    tensors = _read_safetensors(path)
    logits = _pick(tensors, ("logits",), path, required=True)
    lengths = _pick(tensors, ("lengths", "seq_lens"), path, required=False)
    positions = _pick(tensors, ("positions",), path, required=False)
    selected = _pick(tensors, ("indices", "topk_indices"), path, required=indices_json is None)
    fmt = "safetensors"
    if indices_json is not None:
        if selected is not None:
            raise BadInput(f"{str(path)!r} already holds indices; drop --indices or the tensor")
        selected, fmt = _response_indices(Path(indices_json), logits, positions)
    for name, arr in (("logits", logits),):
        if not np.issubdtype(arr.dtype, np.floating):
            raise BadInput(f"{name} must be a float tensor, got {arr.dtype}")
    if np.issubdtype(selected.dtype, np.floating):
        raise BadInput(f"indices must be an integer tensor, got {selected.dtype}")
    return flatten_layers(logits, selected, lengths=lengths, positions=positions, layer=layer, fmt=fmt)
