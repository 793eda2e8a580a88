"""One writer for the live-route ledgers the tests plant: the organism reference against
``candidate = "live"`` at a server's URL, a multiturn symptom, and the given suspects."""

from __future__ import annotations

from pathlib import Path


def live_suspect(
    sid: str, hypothesis: str, mapping: str, *, tier: int = 1, checks: str = '["live_emulation"]'
) -> list[str]:
    """One suspect's lines after ``[[suspects]]``; ``mapping`` its ``patch = ...`` or ``setting = ...`` line."""
    return [f'id = "{sid}"', f"tier = {tier}", f'hypothesis = "{hypothesis}"', mapping, f"checks = {checks}"]


def write_live_ledger(
    directory: Path,
    url: str,
    *,
    lengths: str,
    depths: str,
    trials: int,
    max_new_tokens: int,
    suspects: list[list[str]],
) -> Path:
    """``directory``/investigation.toml; ``suspects``: each suspect's lines after ``[[suspects]]``."""
    lines = [
        "[target]",
        'model = "organism"',
        "threads = 1",
        'reference = "k=fp32 q=fp32 acc=fp32 topk=cfg"',
        'candidate = "live"',
        f'endpoint = "{url}"',
        "",
        "[symptom]",
        'kind = "multiturn"',
        f"lengths = {lengths}",
        f"depths = {depths}",
        f"trials = {trials}",
        f"max_new_tokens = {max_new_tokens}",
        "",
    ]
    for suspect in suspects:
        lines += ["[[suspects]]", *suspect, ""]
    path = directory / "investigation.toml"
    path.write_text("\n".join(lines))
    return path
