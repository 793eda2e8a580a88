"""Engine state as a factor: the probe's cases sent in two arms that differ in one thing, scored
the same way (token-exact recall, and the answer's margin from its token logprobs), paired.

Factors (``analysis.engine_state`` has the statistics):

- ``cache``: each case twice in a row, ``cold`` then ``warm``. The first message starts with a
  nonce unique to the case, so no earlier request shares a prefix with it and the cold send finds
  nothing cached; the warm send repeats the identical bytes, so a server with a prefix cache reuses
  the cold send's state. ``cached_tokens`` from each answer's usage says what the server did.
- ``concurrency``: every case sent one at a time (``c1``), then every case with N requests in
  flight (``cN``), identical bytes in both arms. A warm-up send of every case comes first (not
  scored), so both arms meet the same cache state and only the concurrency differs.
- ``repeat``: after the same warm-up, each case sent R times in a row, identical bytes; the
  determinism rate is the share of cases whose R answers are token-for-token equal, and where
  they differ, the first differing token. Its paired effect is the first send against the last.

A request that fails is recorded as an error (``correct`` None), never as a miss. The run is
short and its arms depend on the server's state, so it is not resumable: a killed run is rerun.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from needlescope.analysis.engine_state import ArmRow, answer_margin, factor_effect
from needlescope.analysis.oracle import first_difference
from needlescope.cases import Case, CaseSpec, build_cases, score_answer
from needlescope.errors import BadInput, ProbeError
from needlescope.targets.completions import CompletionsTarget
from needlescope.targets.tokenize import detect_server_tokenizer

__all__ = ["FACTORS", "EngineStateConfig", "run_engine_state"]

FACTORS = ("cache", "concurrency", "repeat")


@dataclass(frozen=True)
class EngineStateConfig:
    base_url: str
    model: str
    factors: tuple[str, ...] = FACTORS
    kind: str = "single"
    lengths: tuple[int, ...] = (512,)
    depths: tuple[float, ...] = (0.0, 50.0, 100.0)
    trials: int = 2
    seed: int = 0
    value_digits: int = 3
    concurrency: int = 4
    repeats: int = 3
    top_logprobs: int = 5
    max_tokens: int = 16
    timeout_s: float = 300.0
    api_key: str | None = field(default=None, repr=False)
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    """Seeds the nonces; fresh by default (see ``_nonce``)."""

    def __post_init__(self) -> None:
        bad = [f for f in self.factors if f not in FACTORS]
        if bad or not self.factors:
            raise BadInput(
                f"--engine-state factors must be among {', '.join(FACTORS)}; got {list(self.factors)}"
            )
        if self.concurrency < 2:
            raise BadInput(
                f"--concurrency must be at least 2 (it is compared with 1); got {self.concurrency}"
            )
        if self.repeats < 2:
            raise BadInput(f"--repeats must be at least 2; got {self.repeats}")
        if not 1 <= self.top_logprobs <= 20:
            raise BadInput(f"--top-logprobs must be in 1..20; got {self.top_logprobs}")
        self.spec()  # the case grid is checked before any request

    def spec(self) -> CaseSpec:
        return CaseSpec(
            kind=self.kind,
            lengths=self.lengths,
            depths=self.depths,
            trials=self.trials,
            seed=self.seed,
            value_digits=self.value_digits,
            max_answer_tokens=self.max_tokens,
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("api_key")
        return d


def _nonce(run: str, factor: str, arm: str, case_id: str) -> str:
    """Six digits unique to (run, factor, arm, case); digits are in every tokenizer's vocabulary.
    ``run`` is fresh for every run, so a server that kept an earlier run's prefixes cannot serve
    this run's cold sends from its cache."""
    h = hashlib.sha256(f"{run}/{factor}/{arm}/{case_id}".encode()).hexdigest()
    return str(int(h[:12], 16) % 900_000 + 100_000)


def _with_nonce(case: Case, nonce: str) -> list[dict]:
    msgs = [dict(m) for m in case.messages]
    first = next(i for i, m in enumerate(msgs) if m["role"] == "user")
    msgs[first]["content"] = f"{nonce}. {msgs[first]['content']}"
    return msgs


def _send(target: CompletionsTarget, cfg: EngineStateConfig, case: Case, nonce: str) -> ArmRow:
    try:
        done = target.chat(_with_nonce(case, nonce), cfg.max_tokens, top=cfg.top_logprobs)
    except ProbeError:
        return ArmRow(case.case_id, case.length, case.depth, None, None, None, ())
    steps = [(s.token, s.logprob, s.top) for s in done.steps]
    correct = score_answer(done.text, case.expected)
    return ArmRow(
        case_id=case.case_id,
        length=case.length,
        depth=case.depth,
        correct=correct,
        margin=answer_margin(steps, correct),
        cached_tokens=done.cached_tokens,
        tokens=tuple(s.token for s in done.steps) or tuple(done.text.split()),
    )


def _arm(cases: list[Case], send: Callable[[Case], ArmRow], workers: int = 1) -> list[ArmRow]:
    if workers == 1:
        return [send(c) for c in cases]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(send, cases))


def _cache(target, cfg, cases) -> dict:
    cold, warm = [], []
    for c in cases:
        nonce = _nonce(cfg.run_id, "cache", "both", c.case_id)
        cold.append(_send(target, cfg, c, nonce))
        warm.append(_send(target, cfg, c, nonce))
    return {
        "arms": ["cold", "warm"],
        "effect": factor_effect(cold, warm, seed=cfg.seed),
        "rows": [cold, warm],
    }


def _warm_up(target, cfg, cases, factor: str) -> Callable[[Case], ArmRow]:
    """Send every case once (not scored) and return the sender of the same bytes, so both arms
    that follow meet the same cache state: warm."""
    send = lambda c: _send(target, cfg, c, _nonce(cfg.run_id, factor, "all", c.case_id))  # noqa: E731
    for c in cases:
        send(c)
    return send


def _concurrency(target, cfg, cases) -> dict:
    send = _warm_up(target, cfg, cases, "concurrency")
    one = _arm(cases, send)
    many = _arm(cases, send, cfg.concurrency)
    arms = ["c1", f"c{cfg.concurrency}"]
    return {"arms": arms, "effect": factor_effect(one, many, seed=cfg.seed), "rows": [one, many]}


def _repeat(target, cfg, cases) -> dict:
    send = _warm_up(target, cfg, cases, "repeat")
    sends = [[] for _ in range(cfg.repeats)]
    for c in cases:
        for k in range(cfg.repeats):
            sends[k].append(send(c))
    deterministic, firsts = 0, []
    for rows in zip(*sends, strict=True):
        if any(r.correct is None for r in rows):
            continue
        diffs = [first_difference(rows[0].tokens, r.tokens) for r in rows[1:]]
        diffs = [d for d in diffs if d is not None]
        deterministic += not diffs
        if diffs:
            firsts.append(min(diffs))
    n = sum(all(r.correct is not None for r in rows) for rows in zip(*sends, strict=True))
    effect = factor_effect(sends[0], sends[-1], seed=cfg.seed)
    effect["determinism_rate"] = deterministic / n if n else None
    effect["first_differing_tokens"] = sorted(firsts)
    return {"arms": ["send 1", f"send {cfg.repeats}"], "effect": effect, "rows": [sends[0], sends[-1]]}


_RUNNERS = {"cache": _cache, "concurrency": _concurrency, "repeat": _repeat}


def run_engine_state(cfg: EngineStateConfig) -> dict:
    """Build the cases (sized by the server's /tokenize), run each factor, return engine_state.json's body."""
    target = CompletionsTarget(cfg.base_url, cfg.model, api_key=cfg.api_key, timeout=cfg.timeout_s)
    with target:
        counter = detect_server_tokenizer(target.root, cfg.model, api_key=cfg.api_key)
        if counter is None:
            raise BadInput(
                f"{target.root} exposes no /tokenize endpoint; engine-state sizes its cases with it"
            )
        try:
            cases = build_cases(cfg.spec(), counter)
        finally:
            counter.close()
        factors = {}
        for name in cfg.factors:
            out = _RUNNERS[name](target, cfg, cases)
            out["rows"] = [[{**asdict(r), "tokens": list(r.tokens)} for r in arm] for arm in out["rows"]]
            factors[name] = out
    return {
        "kind": "needlescope-engine-state",
        "base_url": target.v1,
        "config": cfg.to_dict(),
        "factors": factors,
    }
