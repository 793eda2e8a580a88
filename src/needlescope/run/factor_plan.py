"""The arms of the live factor experiment (``run.serving_factors``): its config, each factor's
levels and the interaction cells, and how many requests they make. Pure: no server.

The baseline is alone, cold, without a request knob, at the first endpoint; every other arm
changes one factor to one level, or two factors at their last levels (a cell).
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import asdict, dataclass, field

from needlescope.cases import CaseSpec
from needlescope.errors import BadInput
from needlescope.run.engine_state import case_spec

__all__ = ["ENDPOINT_FACTORS", "FACTORS", "Arm", "FactorConfig", "plan_arms", "planned_requests"]

FACTORS = ("cache", "batch", "draft", "chunk", "endpoint", "repeat")
ENDPOINT_FACTORS = ("cache", "batch", "draft", "chunk", "endpoint")
"""What ``--endpoint-factor`` may call the launch flag two endpoints differ in."""


@dataclass(frozen=True)
class Arm:
    """One arm: the conditions its sends differ from the baseline's in."""

    name: str
    factors: tuple[str, ...]
    """The factors it changes: () for the baseline, one for a level, two for a cell."""
    endpoint: int = 0
    warm: bool = False
    mates: int = 0
    fields: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class FactorConfig:
    base_urls: tuple[str, ...]
    model: str
    factors: tuple[str, ...] | None = None
    """None: cache, batch and repeat, plus draft / chunk where levels are given and the endpoint
    factor with two base URLs."""
    endpoint_factor: str = "endpoint"
    endpoint_labels: tuple[str, str] = ("A", "B")
    kind: str = "single"
    lengths: tuple[int, ...] = (512,)
    depths: tuple[float, ...] = (0.0, 50.0, 100.0)
    trials: int = 4
    seed: int = 0
    value_digits: int | None = None
    batch_mates: tuple[int, ...] = (1, 7, 31)
    draft_depths: tuple[int, ...] = ()
    draft_field: str = "speculative_num_draft_tokens"
    chunk_sizes: tuple[int, ...] = ()
    chunk_field: str = "prefill_chunk"
    interactions: bool = True
    echo: int = 0
    echo_items: int = 8
    echo_digits: int = 4
    alpha: float = 0.05
    min_loss: float = 0.1
    max_tokens: int = 16
    continuation: int = 0
    """0: each send asks ``max_tokens`` and stops at the end of its answer; N: N greedy tokens with
    ``ignore_eos`` (output identity over a long continuation; recall reads the answer's part)."""
    timeout_s: float = 300.0
    skip_long_lengths: bool = False
    api_key: str | None = field(default=None, repr=False)
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    def __post_init__(self) -> None:
        if not 1 <= len(self.base_urls) <= 2:
            raise BadInput(
                f"give one --base-url, or two that differ in one launch flag; got {len(self.base_urls)}"
            )
        if self.factors is None:
            auto = ["cache", "batch"]
            auto += ["draft"] * bool(self.draft_depths) + ["chunk"] * bool(self.chunk_sizes)
            auto += ["endpoint"] * (len(self.base_urls) == 2)
            object.__setattr__(self, "factors", (*auto, "repeat"))
        bad = [f for f in self.factors if f not in FACTORS]
        if bad or not self.factors:
            raise BadInput(f"--factors must be among {', '.join(FACTORS)}; got {list(self.factors)}")
        needs = {
            "draft": (self.draft_depths, "--draft-depths"),
            "chunk": (self.chunk_sizes, "--chunk-sizes"),
            "batch": (self.batch_mates, "--batch-mates"),
        }
        for name, (levels, flag) in needs.items():
            if name in self.factors and not levels:
                raise BadInput(f"the {name} factor needs levels: pass {flag}")
            if any(x < 1 for x in levels):
                raise BadInput(f"{flag} must be positive integers; got {list(levels)}")
        if ("endpoint" in self.factors) != (len(self.base_urls) == 2):
            raise BadInput("the endpoint factor needs exactly two --base-url (and two --base-url need it)")
        if self.endpoint_factor not in ENDPOINT_FACTORS:
            raise BadInput(
                f"--endpoint-factor must be one of {', '.join(ENDPOINT_FACTORS)}; got {self.endpoint_factor!r}"
            )
        if self.endpoint_factor != "endpoint" and self.endpoint_factor in self.factors:
            raise BadInput(
                f"--endpoint-factor {self.endpoint_factor}: that factor is varied per request too; "
                "vary it one way (drop it from --factors, or its per-request levels)"
            )
        if len(self.endpoint_labels) != 2 or len(set(self.endpoint_labels)) != 2:
            raise BadInput(f"--endpoint-labels takes two different names; got {list(self.endpoint_labels)}")
        if self.echo < 0 or self.echo_items < 1 or not 2 <= self.echo_digits <= 12:
            raise BadInput("--echo must be >= 0, --echo-items >= 1 and --echo-digits in 2..12")
        if self.echo and not (self.draft_depths or len(self.base_urls) == 2):
            raise BadInput("--echo compares draft depths: pass --draft-depths, or two --base-url")
        if not 0 <= self.continuation <= 4096:
            raise BadInput(
                f"--continuation must be 0 (off) or a token count up to 4096; got {self.continuation}"
            )
        if not 0 < self.alpha < 1 or not 0 < self.min_loss <= 1:
            raise BadInput(
                f"--alpha must be in (0, 1) and --min-loss in (0, 1]; got {self.alpha}, {self.min_loss}"
            )
        self.spec()

    def spec(self) -> CaseSpec:
        return case_spec(self)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("api_key")
        return d


def _levels(cfg: FactorConfig, factor: str) -> list[Arm]:
    """The single-factor arms of ``factor``, in the order its levels were given."""
    if factor == "cache":
        return [Arm("cache=warm", ("cache",), warm=True)]
    if factor == "batch":
        return [Arm(f"batch=beside{k}", ("batch",), mates=k) for k in cfg.batch_mates]
    if factor == "draft":
        return [Arm(f"draft={d}", ("draft",), fields=((cfg.draft_field, d),)) for d in cfg.draft_depths]
    if factor == "chunk":
        return [Arm(f"chunk={c}", ("chunk",), fields=((cfg.chunk_field, c),)) for c in cfg.chunk_sizes]
    if factor == "endpoint":
        return [Arm(f"{cfg.endpoint_factor}={cfg.endpoint_labels[1]}", (cfg.endpoint_factor,), endpoint=1)]
    return [Arm("repeat", ("repeat",))]


def _cell(a: Arm, b: Arm) -> Arm:
    return Arm(
        f"{a.name} + {b.name}",
        (*a.factors, *b.factors),
        endpoint=max(a.endpoint, b.endpoint),
        warm=a.warm or b.warm,
        mates=max(a.mates, b.mates),
        fields=a.fields + b.fields,
    )


def plan_arms(cfg: FactorConfig) -> list[Arm]:
    """The baseline, every single-factor level, then (``interactions``) a cell for every pair of
    factors other than repeat, each at its last level."""
    arms = [Arm("baseline", ())]
    last = {}
    for f in cfg.factors:
        levels = _levels(cfg, f)
        arms += levels
        if f != "repeat":
            last[f] = levels[-1]
    if cfg.interactions:
        arms += [_cell(last[a], last[b]) for a, b in itertools.combinations(last, 2)]
    return arms


def planned_requests(cfg: FactorConfig, cases: int) -> int:
    """Every request the run sends over ``cases`` cases: scored sends, primes, fillers, echo."""
    total = 0
    for arm in plan_arms(cfg):
        total += cases
        if arm.warm and arm.name != "cache=warm":
            total += cases  # its primes (cache=warm's prime is the baseline send)
        if arm.mates and cases % (arm.mates + 1):
            total += arm.mates + 1 - cases % (arm.mates + 1)
    levels = 1 + (len(cfg.draft_depths) if cfg.draft_depths else 1)
    return total + cfg.echo * levels
