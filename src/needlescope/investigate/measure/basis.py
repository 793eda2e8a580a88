"""What a measured case record rests on, as a digest: its ``basis``.

A record in ``measure/NAME.jsonl`` is reused on a later run only when its ``basis`` is what the
run would measure now: the configuration (``Config.to_json()``) with the bytes of each patch file
it applies, the case's messages, and the measurement's parameters (the checkpoint's identity,
``max_new_tokens``, ``prefill_chunk``, the device). Before, records were reused by configuration
name: a user who edited a patch file, or moved ``state.json`` away to rerun a changed ledger,
got the old measurements back as the new configuration's, and a wrong recall, silently.

The run directory's own fingerprint (``state.json`` ``ledger_sha256``) covers the ledger's text
and, through ``ledger_inputs``, the bytes of every patch file the ledger names: editing a patch
is a different run, as editing the ledger is.

Known limit: the checkpoint's identity is its ``config.json`` and the names and sizes of its
files, not a hash of its weights (reading hundreds of gigabytes at every start would cost more
than the measurement); weights rewritten in place at the same size are not seen.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from needlescope.setting import FAULT_PREFIX, PatchRef

__all__ = ["ledger_inputs", "config_basis", "case_digest", "model_identity", "record_basis"]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_digest(path: Path) -> str:
    """sha256 of the file's bytes, or ``missing`` (a patch file gone since the ledger was read:
    its configuration cannot be measured, and nothing measured before may stand for it)."""
    try:
        return _sha256(Path(path).read_bytes())
    except OSError:
        return "missing"


def ledger_inputs(patches: list[PatchRef]) -> str:
    """Text that follows the ledger's own in the run's fingerprint: the digest of each patch file
    the ledger names, sorted, each once (the ledger's text already says which file is which; a
    folder moved elsewhere is the same run)."""
    return "".join(f"\n# input {d}" for d in sorted({_file_digest(p.path) for p in patches}))


def _spec_file(spec: str, base: Path) -> Path:
    """The file a patch spec names: a built-in fault's module, or the path (a relative one is
    the ledger folder's: ``state.json`` keeps specs relative, ``paths.relativize``)."""
    if spec.startswith(FAULT_PREFIX):
        return PatchRef.resolve(spec).path
    return Path(base) / spec


def config_basis(config: dict, base: Path) -> str:
    """Digest of one configuration (``Config.to_json()``) with each patch named by the digest of
    its file's bytes, not by its spec: the same files under an absolute or a relative spec (a
    resumed run reads its configurations back relative) are the same configuration."""
    setting = dict(config["setting"])
    if setting.get("patch"):
        setting["patch"] = _file_digest(_spec_file(setting["patch"], base))
    extra = [_file_digest(_spec_file(p, base)) for p in config.get("extra_patches", [])]
    return _sha256(json.dumps([setting, extra], sort_keys=True).encode())


def case_digest(messages: list[dict]) -> str:
    """Digest of a case's messages: two cases of one ``case_id`` built from other seeds or
    filler differ here."""
    return _sha256(json.dumps(messages, sort_keys=True).encode())


def model_identity(model_dir: Path | None) -> dict:
    """The checkpoint as far as is cheap to read: its ``config.json`` digest and its files'
    names and sizes (the module docstring's known limit)."""
    if model_dir is None:
        return {}
    d = Path(model_dir)
    files = sorted((p.name, p.stat().st_size) for p in d.iterdir() if p.is_file())
    config = d / "config.json"
    return {"config": _file_digest(config) if config.exists() else None, "files": files}


def record_basis(config: str, case: str, params: dict) -> str:
    """The basis of one record: ``config_basis``, ``case_digest`` and the measurement's
    parameters (``params``: JSON-able)."""
    return _sha256(json.dumps([config, case, params], sort_keys=True, default=str).encode())
