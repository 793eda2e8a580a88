"""The rank-dump workflow: the needle's rank in every CSA layer, over several prompts, with stability.

``run(RankDumpConfig(...)) -> RankDumpResult`` checks every input first (needle, positions,
prompt files, the checkpoint, the needle in every prompt and its length against each
checkpoint's context, with the tokenizer alone), then loads
the model(s) and runs ``needlescope.dsa.rankdump.rank_dump`` per prompt under the setting, plus
``needlescope.dsa.stability.selection_stability`` against the reference numerics (on the same
checkpoint, or on ``compare_model``). The setting's patch executes when the setting is first
applied, after all of that. ``write(result, out)`` checks ``rankdump.json`` (``RANKDUMP_SCHEMA``)
and ``stability.json`` (``STABILITY_SCHEMA``) and writes them with ``rankdump.md`` and the plots.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from needlescope.errors import BadInput
from needlescope.progress import Progress, no_progress
from needlescope.setting import REFERENCE, Setting

__all__ = ["RankDumpConfig", "RankDumpResult", "run", "write"]


@dataclass(frozen=True)
class RankDumpConfig:
    """One rank-dump run; ``needle`` (text) or ``needle_span`` (token range) names the needle."""

    model: str
    prompts: tuple[Path, ...]
    setting: Setting = REFERENCE
    needle: str | None = None
    needle_span: tuple[int, int] | None = None
    positions: tuple[int, ...] | None = None
    """Query positions (default: the answer positions of a greedy generation)."""
    max_new_tokens: int | None = None
    """Greedy answer length; None: ``needlescope.dsa.rankdump.DEFAULT_MAX_NEW_TOKENS``."""
    compare_to_reference: bool = False
    compare_model: str | None = None
    device: str = "cpu"
    """cpu | cuda | cuda:N | auto | a comma-separated list (``dsa.checkpoint.load_bundle``)."""
    max_memory: str | None = None
    """Weight bytes per device when placing (``70GiB`` or one per device)."""
    chunk: int | None = None
    """Prefill in chunks of this many tokens through the KV cache (``dsa.passes``); None: one pass."""
    stream_layers: bool = False
    """Keep the layers on disk and read one at a time per pass (``dsa.streaming``)."""

    def __post_init__(self) -> None:
        from needlescope.setting import check_chunk

        check_chunk(self.chunk)
        if not self.prompts:
            raise BadInput("give at least one --prompt file")
        if self.needle_span is None and not self.needle:
            raise BadInput(
                "give the needle: --needle TEXT (as it appears in the prompt) or --needle-span START:END"
            )
        if self.needle_span is not None and not 0 <= self.needle_span[0] < self.needle_span[1]:
            raise BadInput(
                f"--needle-span {self.needle_span[0]}:{self.needle_span[1]} must satisfy 0 <= START < END"
            )
        if self.compare_to_reference and self.compare_model:
            raise BadInput("give either --compare-to-reference or --compare-model, not both")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise BadInput(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def compares(self) -> bool:
        return self.compare_to_reference or self.compare_model is not None


@dataclass(frozen=True)
class RankDumpResult:
    """``rankdump`` (one or several prompts, RANKDUMP_SCHEMA), its per-prompt ``dumps``, and
    ``stability`` (STABILITY_SCHEMA) when a comparison was asked for."""

    rankdump: dict
    dumps: list[dict]
    stability: dict | None


def _check_inputs(cfg: RankDumpConfig) -> tuple[list[list[dict]], Path, Path | None]:
    """(messages per prompt, checkpoint path, compare checkpoint path): every input checked, no model loaded."""
    from needlescope.dsa.checkpoint import load_tokenizer, require_deepseek_v4, resolve_model_dir
    from needlescope.dsa.prompt import read_prompt_file, render_prompt, resolve_needle_span

    messages = [read_prompt_file(p) for p in cfg.prompts]
    path = resolve_model_dir(cfg.model)
    require_deepseek_v4(path)
    other = None
    if cfg.compare_model is not None:
        other = resolve_model_dir(cfg.compare_model)
        require_deepseek_v4(other)
    tokenizer = load_tokenizer(path)
    if other is not None and load_tokenizer(other).get_vocab() != tokenizer.get_vocab():
        raise BadInput(
            f"{cfg.compare_model!r} has a different tokenizer; stability compares the same prompt tokens"
        )
    for p, msgs in zip(cfg.prompts, messages, strict=True):
        prompt = render_prompt(tokenizer, msgs, warn_long=False)  # checked against the context below
        try:
            resolve_needle_span(prompt, cfg.needle, cfg.needle_span)
            _check_context(cfg, len(prompt.input_ids), [(cfg.model, path), (cfg.compare_model, other)])
        except BadInput as exc:
            raise BadInput(f"{p}: {exc}") from None
    return messages, path, other


def _load(cfg: RankDumpConfig, path):
    from needlescope.dsa.checkpoint import load_bundle

    return load_bundle(
        path,
        device=cfg.device,
        max_memory=cfg.max_memory,
        stream_layers=cfg.stream_layers,
        stream_if_needed=True,  # every pass of a rank dump runs through dsa.passes
    )


def _check_context(
    cfg: RankDumpConfig, prompt_tokens: int, models: list[tuple[str | None, Path | None]]
) -> None:
    """BadInput when the prompt (with the greedy answer, unless ``positions`` are given) exceeds a
    checkpoint's context: the model would run past what it was built for, for minutes, and
    report ranks at lengths it never handles (issue 38, item 10)."""
    from needlescope.dsa.checkpoint import context_tokens
    from needlescope.dsa.rankdump import DEFAULT_MAX_NEW_TOKENS

    answer = 0 if cfg.positions is not None else cfg.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    for name, path in models:
        context = context_tokens(path) if path is not None else None
        if context is not None and prompt_tokens + answer > context:
            with_answer = f" and its answer up to {answer} more" if answer else ""
            raise BadInput(
                f"the prompt is {prompt_tokens} tokens{with_answer}; the model's context is {context} tokens "
                f"({Path(name).name}'s config.json max_position_embeddings): shorten the prompt to at most "
                f"{context - answer} tokens"
            )


def run(cfg: RankDumpConfig, progress: Progress = no_progress) -> RankDumpResult:
    """Rank-dump every prompt (and compare its selection with the reference when asked);
    ``progress("rank dump", done, total, prompt)`` after each prompt."""
    from needlescope.dsa.emulate import patched_for_good
    from needlescope.dsa.rankdump import DEFAULT_MAX_NEW_TOKENS, combine_dumps, rank_dump
    from needlescope.dsa.stability import selection_stability

    messages, path, other_path = _check_inputs(cfg)
    model, tokenizer, _ = _load(cfg, path)
    other = _load(cfg, other_path)[0] if other_path is not None else None
    kw = dict(needle=cfg.needle, needle_span=cfg.needle_span)

    def usable(m, m_path):
        # A patch that returned no undo changed ``m`` for good: the next run needs a fresh model.
        return _load(cfg, m_path)[0] if patched_for_good(m) else m

    dumps, stabs = [], []
    progress("rank dump", 0, len(cfg.prompts), "")
    for n, (p, msgs) in enumerate(zip(cfg.prompts, messages, strict=True)):
        model = usable(model, path)
        dumps.append(
            rank_dump(
                model,
                tokenizer,
                msgs,
                **kw,
                setting=cfg.setting,
                query_positions=cfg.positions,
                max_new_tokens=cfg.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
                label=p.stem,
                chunk=cfg.chunk,
            )
        )
        if cfg.compares:
            # Reference side: fp32 numerics on --compare-model (or on --model itself).
            model = usable(model, path)
            ref_model, ref_path = (other, other_path) if other is not None else (usable(model, path), path)
            if ref_model is model and cfg.setting.patch is not None:
                # The candidate patch may give no undo; the reference must never see it.
                ref_model = _load(cfg, path)[0]
            stabs.append(
                selection_stability(
                    ref_model,
                    tokenizer,
                    msgs,
                    **kw,
                    reference=Setting(index_topk=cfg.setting.index_topk),
                    candidate=cfg.setting,
                    candidate_model=model,
                    chunk=cfg.chunk,
                    reference_label=str(ref_path),
                    candidate_label=str(path),
                )
            )
        progress("rank dump", n + 1, len(cfg.prompts), p.name)
    obj = combine_dumps(dumps)
    obj["model"] = str(path)
    stability = None
    if stabs:
        stability = stabs[0] if len(stabs) == 1 else {**stabs[0], "prompts": stabs}
    return RankDumpResult(obj, dumps, stability)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def write(result: RankDumpResult, out: Path) -> Sequence[str]:
    """Check and write every artifact into ``out``; returns the file names written."""
    from needlescope.dsa.rankdump import (
        plot_margin_vs_length,
        plot_rank_vs_layer,
        render_rankdump_md,
        validate_rankdump,
    )
    from needlescope.dsa.stability import validate_stability

    validate_rankdump(result.rankdump)
    if result.stability is not None:
        validate_stability(result.stability)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "rankdump.json", result.rankdump)
    written = ["rankdump.json", "rankdump.md", "rank_vs_layer.png"]
    if result.stability is not None:
        _write_json(out / "stability.json", result.stability)
        written.append("stability.json")
    md = render_rankdump_md(result.rankdump, stability=result.stability)
    (out / "rankdump.md").write_text(md, encoding="utf-8")
    plot_rank_vs_layer(result.rankdump, out / "rank_vs_layer.png")
    if len(result.dumps) > 1:
        plot_margin_vs_length(result.rankdump, out / "margin_vs_length.png")
        written.append("margin_vs_length.png")
    return written
