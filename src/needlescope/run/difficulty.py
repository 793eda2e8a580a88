"""Auto-difficulty: make the task hard enough that the reference no longer saturates.

When the reference recalls everything, an A/B can only show B getting worse, never by how much
B's headroom shrank. ``choose_difficulty`` probes the reference at a bounded ladder of levels,
each harder than the one before, and stops at the first whose pooled recall falls below the
target (``ProbeConfig.difficulty_target``, default 0.9); that level is then held for the whole
run (and for both sides of an A/B). Order of escalation (``ORDER``):

1. the requested task (its kind, distractors and value length);
2. near-duplicate keys (same noun, another adjective) added: +1, +2, +4, +8 distractors (a single
   needle with distractors is the multikey task; multiturn and multivalue prompts get them in
   their user turns and text);
3. values lengthened, with the +8 distractors kept: +2, then +4 digits (at most 12).

Each level is a probe of the configured grid with one trial per cell in ``OUT/difficulty/level-N``
(a durable, resumable run, so a killed search resumes and replays its decisions). When no level
brings the reference below the target, the hardest is held and the record says so.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from needlescope.cases.assemble import MAX_DISTRACTORS, default_distractors
from needlescope.progress import Event
from needlescope.run.config import ProbeConfig
from needlescope.run.probe import STORE_NAME, check_out, run_probe

__all__ = ["ORDER", "ladder", "choose_difficulty", "probe_with_difficulty"]

ORDER = "the requested task; +1, +2, +4, +8 near-duplicate-key distractors; then values +2, +4 digits"
_MAX_DIGITS = 12


def ladder(kind: str, distractors: int | None, value_digits: int) -> list[tuple[int, int]]:
    """(distractors, value digits) of each level, easiest first, without repeats."""
    d0 = default_distractors(kind) if distractors is None else distractors
    levels = [(d0, value_digits)]
    levels += [(min(d0 + k, MAX_DISTRACTORS), value_digits) for k in (1, 2, 4, 8)]
    d_max = min(d0 + 8, MAX_DISTRACTORS)
    levels += [(d_max, min(value_digits + k, _MAX_DIGITS)) for k in (2, 4)]
    return list(dict.fromkeys(levels))


def _pooled(summary: dict) -> tuple[float | None, int]:
    correct = sum(c["correct"] for c in summary["cells"])
    n = sum(c["n"] for c in summary["cells"])
    return (correct / n if n else None), n


def _probe_level(
    cfg: ProbeConfig, out: Path, distractors: int | None, digits: int | None, on_event: Event, flag: str
):
    level_cfg = replace(
        cfg,
        out=out,
        trials=1,
        distractors=distractors,
        value_digits=digits,
        graded=False,
        bundles=0,
        auto_difficulty=False,
        resume=(out / STORE_NAME).is_file(),
    )
    return run_probe(level_cfg, on_event, flag=flag)


def choose_difficulty(
    cfg: ProbeConfig, out: Path, on_event: Event, flag: str = "--base-url"
) -> tuple[ProbeConfig, dict]:
    """``cfg`` at the first level of ``ladder`` where its target (the reference) recalls below
    ``cfg.difficulty_target``, and the record of the search (report.probe.DIFFICULTY_SCHEMA).
    ``flag``: the option that named the target (``run_probe``)."""
    levels: list[dict] = []
    # Level 0 is the task as asked; its run also settles the value length when none was given.
    first = _probe_level(cfg, out / "level-0", cfg.distractors, cfg.value_digits, on_event, flag)
    plan = ladder(cfg.kind, cfg.distractors, first["value_digits"])
    reached = False
    for i, (distractors, digits) in enumerate(plan):
        summary = (
            first if i == 0 else _probe_level(cfg, out / f"level-{i}", distractors, digits, on_event, flag)
        )
        recall, n = _pooled(summary)
        levels.append(
            {
                "distractors": distractors,
                "value_digits": digits,
                "recall": recall,
                "n": n,
                "run": str(out / f"level-{i}"),
            }
        )
        on_event("difficulty_level", {"level": i, **levels[-1]})
        if recall is not None and recall < cfg.difficulty_target:
            reached = True
            break
    chosen = {"distractors": levels[-1]["distractors"], "value_digits": levels[-1]["value_digits"]}
    record = {
        "target": cfg.difficulty_target,
        "order": ORDER,
        "levels": levels,
        "chosen": chosen,
        "reached": reached,
    }
    return replace(cfg, distractors=chosen["distractors"], value_digits=chosen["value_digits"]), record


def probe_with_difficulty(cfg: ProbeConfig, on_event: Event) -> dict:
    """``run_probe`` of ``cfg``, first choosing its difficulty when ``cfg.auto_difficulty``."""
    if not cfg.auto_difficulty:
        return run_probe(cfg, on_event)
    search = cfg.out / "difficulty"
    if not cfg.resume or not search.is_dir():
        # Refuse an --out that holds a run (or a --resume with nothing to resume) before any request.
        check_out(cfg.out, cfg.resume)
    chosen, record = choose_difficulty(cfg, search, on_event)
    # A search killed before the main run began leaves no main store: the main run starts afresh.
    chosen = replace(chosen, resume=(cfg.out / STORE_NAME).is_file())
    return run_probe(chosen, on_event, difficulty=record)
