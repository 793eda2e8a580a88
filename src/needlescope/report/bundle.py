"""Reproducer bundles: one directory per failing case that a colleague can re-send as it was.

BUNDLE/request.json      the exact chat-completions body that was sent
BUNDLE/response.json     what came back (answer, reasoning, finish_reason, usage, endpoint)
BUNDLE/case.json         how the case was made (kind, length, depth, trial, seed, value digits)
BUNDLE/server_info.json  the server's own description (provenance, secrets stripped)
BUNDLE/manifest.json     needlescope version, expected values, failure class (MANIFEST_SCHEMA)
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from .. import __version__
from ..errors import BadInput
from ..schema import check_schema

__all__ = ["MANIFEST_SCHEMA", "write_bundle", "read_bundle"]

MANIFEST_SCHEMA: dict = {
    "type": "object",
    "required": ["needlescope_version", "created", "case_id", "expected", "failure", "base_url"],
    "properties": {
        "needlescope_version": {"type": "string"},
        "created": {"type": "number"},
        "case_id": {"type": "string"},
        # An empty list would score every answer correct: a bundle names what it expects.
        "expected": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
        "failure": {"type": ["object", "null"]},
        "base_url": {"type": ["string", "null"]},
    },
}

_RESPONSE_KEYS = (
    "status",
    "answer",
    "reasoning",
    "finish_reason",
    "prompt_tokens",
    "base_url",
    "replica",
    "latency_s",
)
_CASE_KEYS = ("case_id", "kind", "length", "depth", "trial", "counted_length", "expected")


def _dump(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_bundle(
    out_dir: Path, *, request: dict, result: dict, case: dict, generation: dict, provenance: dict
) -> Path:
    """Write one bundle into ``out_dir`` (created); ``generation`` holds seed and value digits."""
    manifest = {
        "needlescope_version": __version__,
        "created": time.time(),
        "case_id": case["case_id"],
        "expected": [str(v) for v in case["expected"]],
        "failure": result.get("failure"),
        "base_url": result.get("base_url"),
    }
    check_schema(manifest, MANIFEST_SCHEMA, "manifest")
    out_dir.mkdir(parents=True, exist_ok=True)
    _dump(out_dir / "request.json", request)
    _dump(out_dir / "response.json", {k: result.get(k) for k in _RESPONSE_KEYS})
    _dump(out_dir / "case.json", {**{k: case.get(k) for k in _CASE_KEYS}, **generation})
    _dump(out_dir / "server_info.json", provenance)
    _dump(out_dir / "manifest.json", manifest)
    return out_dir


def read_bundle(path: Path) -> tuple[dict, dict]:
    """(request, manifest) of a bundle directory; BadInput naming what is missing or broken."""
    path = Path(path)
    if not path.is_dir():
        raise BadInput(f"{path} is not a bundle directory; pass one written under a probe's bundles/")
    out = []
    for name in ("request.json", "manifest.json"):
        f = path / name
        if not f.is_file():
            raise BadInput(f"{path} has no {name}; it is not a needlescope reproducer bundle")
        try:
            out.append(json.loads(f.read_text(encoding="utf-8")))
        except json.JSONDecodeError as e:
            raise BadInput(f"{f} is not valid JSON ({e.msg} at char {e.pos})") from None
        except UnicodeDecodeError as e:  # bytes that are not UTF-8 are no JSON either
            raise BadInput(
                f"{f} is not UTF-8 text ({e.reason} at byte {e.start}); it is not valid JSON"
            ) from None
    request, manifest = out
    try:
        check_schema(manifest, MANIFEST_SCHEMA, "manifest")
    except ValueError as e:
        raise BadInput(f"{path}/manifest.json is malformed: {e}") from None
    # Each message an object with a string role, the model a name: a body the server must refuse
    # would be read as the target failing ("none of N requests was answered; check --base-url").
    if (
        not isinstance(request, dict)
        or not isinstance(request.get("messages"), list)
        or not request["messages"]
        or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in request["messages"])
        or not isinstance(request.get("model"), str)
        or not request["model"]
    ):
        raise BadInput(
            f"{path}/request.json is not a chat-completions body (needs a model name and messages, "
            "each an object with a role); pass a bundle written under a probe's bundles/"
        )
    return request, manifest
