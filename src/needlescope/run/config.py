"""Typed, validated configuration of one probe run.

The library's defaults live on ``ProbeConfig``; the case kinds are ``cases.assemble.KINDS``."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from needlescope.cases.assemble import KINDS, MAX_DISTRACTORS
from needlescope.errors import BadInput


@dataclass(frozen=True)
class ProbeConfig:
    base_urls: tuple[str, ...]
    model: str
    kind: str = "single"
    lengths: tuple[int, ...] = (1000, 2000, 4000, 8000)
    depths: tuple[float, ...] = (0, 10, 25, 50, 75, 90, 100)
    trials: int = 5
    seed: int = 0
    out: Path = Path("out")
    concurrency: int = 8
    tokenizer: str = "server"
    chat_template: Path | None = None
    extra_body: dict = field(default_factory=dict)
    resume: bool = False
    threshold: float = 0.85
    max_tokens: int = 32
    timeout_s: float = 120.0
    retries: int = 4
    retry_budget_s: float = 60.0
    haystack_file: Path | None = None
    # None: the target's advertised trained value length (/get_server_info), else DEFAULT_VALUE_DIGITS.
    value_digits: int | None = None
    bundles: int = 5
    """Reproducer bundles to write for failing cases (one per failure class first)."""
    api_key: str | None = field(default=None, repr=False)
    distractors: int | None = None
    """Near-duplicate keys per prompt; None: the kind's default (multikey 4, others 0)."""
    auto_difficulty: bool = False
    """Raise the difficulty until the target scores below ``difficulty_target`` (run.difficulty)."""
    difficulty_target: float = 0.9
    graded: bool = False
    """Also score each case's gold answer teacher-forced (one more request a case; docs/graded.md)."""
    top_logprobs: int = 5
    """Alternatives asked for at each gold token (the margin needs at least 2)."""
    margin_threshold: float = 1.0
    """Answers whose weakest token wins by less than this many nats are counted as thin."""
    skip_long_lengths: bool = False
    """Drop (with a warning) lengths beyond the target's context instead of refusing the run."""

    def __post_init__(self) -> None:
        if not self.base_urls:
            raise BadInput(
                "no --base-url given; pass the server's URL, e.g. --base-url http://127.0.0.1:8000/v1"
            )
        if self.kind not in KINDS:
            raise BadInput(f"--kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if not self.lengths or any(n <= 0 for n in self.lengths):
            raise BadInput(f"--lengths must be positive token counts; got {list(self.lengths)}")
        bad = [d for d in self.depths if not 0 <= d <= 100]
        if not self.depths or bad:
            raise BadInput(f"--depths must be percentages in 0..100; got {bad or 'none'}")
        if self.trials < 1:
            raise BadInput(f"--trials must be at least 1; got {self.trials}")
        if self.concurrency < 1:
            raise BadInput(f"--concurrency must be at least 1; got {self.concurrency}")
        if not 0 < self.threshold <= 1:
            raise BadInput(f"--threshold must lie in (0, 1]; got {self.threshold}")
        if self.value_digits is not None and not 1 <= self.value_digits <= 12:
            raise BadInput(f"--value-digits must be in 1..12; got {self.value_digits}")
        if self.bundles < 0:
            raise BadInput(f"--bundles must be 0 or more; got {self.bundles}")
        if self.max_tokens < 1:
            raise BadInput(
                f"--max-tokens must be at least 1 (the answer needs tokens); got {self.max_tokens}"
            )
        # Finite: an infinite (or NaN) deadline or budget would let one request hang or retry forever.
        if not 0 < self.timeout_s < math.inf:
            raise BadInput(f"--timeout must be a positive number of seconds; got {self.timeout_s:g}")
        if not 0 <= self.retry_budget_s < math.inf:
            raise BadInput(f"--retry-budget must be zero or more seconds; got {self.retry_budget_s:g}")
        if self.distractors is not None and not 0 <= self.distractors <= MAX_DISTRACTORS:
            raise BadInput(f"--distractors must be in 0..{MAX_DISTRACTORS}; got {self.distractors}")
        if not 0 < self.difficulty_target <= 1:
            raise BadInput(f"--difficulty-target must lie in (0, 1]; got {self.difficulty_target}")
        if not 2 <= self.top_logprobs <= 20:
            raise BadInput(
                f"--top-logprobs must be in 2..20 (the margin needs a rival); got {self.top_logprobs}"
            )
        if not self.margin_threshold >= 0:
            raise BadInput(f"--margin-threshold must be zero or more nats; got {self.margin_threshold:g}")
        if self.tokenizer == "server" and self.chat_template is not None:
            raise BadInput("--chat-template goes with --tokenizer PATH; the server applies its own template")
        if self.haystack_file is not None and not Path(self.haystack_file).is_file():
            what = "is not a regular file" if Path(self.haystack_file).exists() else "does not exist"
            raise BadInput(f"--haystack-file {self.haystack_file} {what}; pass a UTF-8 text file")

    def fingerprint(self, value_digits: int) -> dict:
        """What must match for --resume to continue a run rather than mix two grids."""
        return {
            "model": self.model,
            "kind": self.kind,
            "lengths": list(self.lengths),
            "depths": list(self.depths),
            "trials": self.trials,
            "seed": self.seed,
            "value_digits": value_digits,
            # Only when set, so runs made before the flag existed still resume.
            **({"distractors": self.distractors} if self.distractors is not None else {}),
        }


def parse_int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise BadInput(f"{flag} takes comma-separated integers such as 1000,2000; got {text!r}") from None


def parse_float_list(text: str, flag: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise BadInput(f"{flag} takes comma-separated numbers such as 0,50,100; got {text!r}") from None


def parse_extra_body(text: str | None) -> dict:
    if not text:
        return {}
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadInput(
            f"--extra-body is not valid JSON ({exc.msg} at char {exc.pos}); pass an object such as '{{\"top_k\": 1}}'"
        ) from None
    if not isinstance(body, dict):
        raise BadInput(f"--extra-body must be a JSON object; got {type(body).__name__}")
    return body
