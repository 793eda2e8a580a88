"""Live paired A/B: probe A, send B exactly A's prompts, compare the two runs.

A's case set (rendered and counted with A's tokenizer) is copied into B's store, which is then
resumed against B, so B is sent A's prompts byte for byte and B's tokenizer is never consulted;
a killed comparison resumes like any probe.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from needlescope.progress import Event, no_event
from needlescope.run.compare import compare_runs
from needlescope.run.config import ProbeConfig
from needlescope.run.difficulty import choose_difficulty
from needlescope.run.probe import STORE_NAME, fit_to_target, run_probe
from needlescope.run.store import ResultStore, create_store
from needlescope.targets import collect_provenance, normalize_base_url, preflight
from needlescope.targets.limits import read_limits

__all__ = ["compare_live"]


def compare_live(
    cfg_a: ProbeConfig,
    cfg_b: ProbeConfig,
    out: Path,
    *,
    alpha: float = 0.05,
    power_drop: float = 0.10,
    bucket_edges: tuple[int, ...] | None = None,
    on_event: Event = no_event,
) -> dict:
    """Probe A (``out/a``), send B (``out/b``) A's exact case set, then compare the two runs."""
    out = Path(out)
    # Both sides are checked before either is probed, so a typo in --b costs no run of A.
    for cfg, flag in ((cfg_a, "--a"), (cfg_b, "--b")):
        for url in cfg.base_urls:
            preflight(normalize_base_url(url)[0], cfg.model, api_key=cfg.api_key, flag=flag)
    # B is sent A's prompts, so every length must fit both sides' contexts.
    for side in (cfg_a, cfg_b):
        provenance = collect_provenance(*normalize_base_url(side.base_urls[0]), api_key=side.api_key)
        cfg_a = fit_to_target(cfg_a, read_limits(provenance, side.model), on_event)
    cfg_b = replace(cfg_b, lengths=cfg_a.lengths)
    difficulty = None
    if cfg_a.auto_difficulty:
        # A is the reference: its difficulty is chosen once and held for both sides.
        cfg_a, difficulty = choose_difficulty(cfg_a, out / "difficulty", on_event, "--a")
        cfg_a = replace(cfg_a, resume=(out / "a" / STORE_NAME).is_file())
        cfg_b = replace(cfg_b, distractors=cfg_a.distractors, value_digits=cfg_a.value_digits)
    cfg_a = replace(cfg_a, out=out / "a")
    cfg_b = replace(cfg_b, out=out / "b")
    on_event("side", {"side": "A", "base_urls": list(cfg_a.base_urls)})
    run_probe(cfg_a, on_event, difficulty=difficulty, flag="--a")
    b_store = cfg_b.out / STORE_NAME
    if not b_store.exists():
        cfg_b.out.mkdir(parents=True, exist_ok=True)
        with ResultStore(cfg_a.out / STORE_NAME) as store_a:
            cases_a = store_a.cases()
            digits = store_a.get_meta("fingerprint")["value_digits"]
        root, v1 = normalize_base_url(cfg_b.base_urls[0])
        meta = {
            "fingerprint": cfg_b.fingerprint(digits),
            "provenance": collect_provenance(root, v1, api_key=cfg_b.api_key),
            "run_notes": {"value_digits_source": "side A's case set (compare)", "assumed": []},
        }
        create_store(b_store, meta, cases_a).close()
    on_event("side", {"side": "B", "base_urls": list(cfg_b.base_urls)})
    run_probe(replace(cfg_b, resume=True), on_event, flag="--b")
    return compare_runs(
        cfg_a.out, cfg_b.out, out, alpha=alpha, power_drop=power_drop, bucket_edges=bucket_edges
    )
