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

A request that fails is recorded as an error (``correct`` None), never as a miss, and its pair is
left out of the statistics and counted.

Resume: every send is committed to the run's ``results.sqlite`` (``run.store``, table ``sends``,
one row per factor, arm and case) as it finishes, with the cases and the run's ``run_id``; a
``--resume`` run sends only what has no ``ok`` row. The cache factor's pairing survives it this
way: each case's nonce is stored *before* its cold send, and a new attempt at the pair draws a
new one, so no nonce is ever sent cold twice (a cold send in flight at the kill may have been
cached). A pair whose cold send finished in an earlier process gets its warm send now only if the
server still holds the prefix: the warm answer's ``cached_tokens`` must exceed the cold one's;
otherwise (a restarted server, an evicted prefix, a server without a cache) the pair is sent again,
cold and warm, under a fresh nonce. The warm-up of the other factors is sent again on resume.
"""

from __future__ import annotations

import dataclasses
import hashlib
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path

from needlescope.analysis.engine_state import ArmRow, answer_difference, answer_margin, factor_effect
from needlescope.cases import Case, CaseSpec, build_cases, score_answer
from needlescope.cases.needles import VALUE_DIGITS
from needlescope.cases.scoring import prompt_rivals
from needlescope.errors import BadInput, ProbeError
from needlescope.progress import Progress, no_progress
from needlescope.run.probe import STORE_NAME, check_out
from needlescope.run.store import ResultStore, create_store
from needlescope.targets.client import served_models
from needlescope.targets.completions import CompletionsTarget
from needlescope.targets.limits import choose_value_digits, fit_lengths, read_limits
from needlescope.targets.provenance import collect_provenance
from needlescope.targets.tokenize import detect_server_tokenizer

__all__ = ["FACTORS", "EngineStateConfig", "planned_sends", "run_engine_state"]

FACTORS = ("cache", "concurrency", "repeat")
NONCE_TOKENS = 8
COMMAND = "engine-state"  # marks the store's fingerprint, so a probe's store is told apart


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
    value_digits: int | None = None
    """None: the target's advertised ``trained_value_digits``, else 7 (``targets.limits``)."""
    concurrency: int = 4
    repeats: int = 3
    top_logprobs: int = 5
    max_tokens: int = 16
    timeout_s: float = 300.0
    skip_long_lengths: bool = False
    """Drop (with a warning) lengths beyond the target's context instead of refusing the run."""
    api_key: str | None = field(default=None, repr=False)
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    """Seeds the nonces; fresh for a new run, the stored one on ``--resume`` (see ``_nonce``)."""

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
        return case_spec(self)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("api_key")
        return d

    def fingerprint(self) -> dict:
        """What must match for ``--resume`` to continue a run rather than mix two experiments
        (not the URL: a restarted server may listen elsewhere; not the timeout)."""
        d = self.to_dict()
        for key in ("base_url", "timeout_s", "run_id", "skip_long_lengths"):
            d.pop(key)
        return {"command": COMMAND, **{k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}}


def case_spec(cfg) -> CaseSpec:
    """The probe's case grid of a needle-sending config (its kind, lengths, depths, trials, seed,
    value_digits and max_tokens: ``EngineStateConfig``, ``run.serving_factors.FactorConfig``)."""
    return CaseSpec(
        kind=cfg.kind,
        lengths=cfg.lengths,
        depths=cfg.depths,
        trials=cfg.trials,
        seed=cfg.seed,
        value_digits=cfg.value_digits or VALUE_DIGITS,
        max_answer_tokens=cfg.max_tokens,
    )


def planned_sends(fingerprint: dict, cases: int) -> int:
    """The scored sends a run with this store fingerprint makes over ``cases`` cases: a case is
    sent once in each arm of each factor (``repeats`` arms for repeat; warm-ups not counted)."""
    arms = {"cache": 2, "concurrency": 2, "repeat": int(fingerprint.get("repeats", 0))}
    return cases * sum(arms.get(f, 0) for f in fingerprint.get("factors", ()))


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


def _send(target: CompletionsTarget, cfg: EngineStateConfig, case: Case, nonce: str) -> dict:
    """One scored send as its stored row; ``error`` set (and ``correct`` None) when the request
    failed, which is not a miss."""
    row = {"case_id": case.case_id, "length": case.length, "depth": case.depth, "nonce": nonce}
    try:
        done = target.chat(_with_nonce(case, nonce), cfg.max_tokens, top=cfg.top_logprobs)
    except ProbeError as e:
        return {
            **row,
            "correct": None,
            "margin": None,
            "cached_tokens": None,
            "tokens": [],
            "text": None,
            "error": f"{e.kind}: {e}",
        }
    steps = [(s.token, s.logprob, s.top) for s in done.steps]
    # a hedge over the distractors is a miss, as in the probe (cases.scoring)
    correct = score_answer(done.text, case.expected, prompt_rivals(case.messages, case.expected))
    return {
        **row,
        "correct": correct,
        "margin": answer_margin(steps, correct),
        "cached_tokens": done.cached_tokens,
        "tokens": [s.token for s in done.steps] or done.text.split(),
        "text": done.text,
        "error": None,
    }


def _unsent(case: Case, why: str) -> dict:
    row = {"case_id": case.case_id, "length": case.length, "depth": case.depth, "nonce": None}
    empty = {"correct": None, "margin": None, "cached_tokens": None, "tokens": [], "text": None}
    return {**row, **empty, "error": why}


def _arm_row(row: dict) -> ArmRow:
    return ArmRow(
        row["case_id"], row["length"], row["depth"], row["correct"], row["margin"], row["cached_tokens"],
        tuple(row["tokens"]), row.get("text"),
    )  # fmt: skip


@dataclass
class _Run:
    cfg: EngineStateConfig
    target: CompletionsTarget
    store: ResultStore
    cases: list[Case]
    progress: Progress = no_progress
    _task: list = field(default_factory=lambda: ["", 0, 0])
    """The factor being sent, sends finished, sends planned in this process."""

    def begin(self, factor: str, planned: int) -> None:
        self._task[:] = [factor, 0, planned]
        self.progress(factor, 0, planned, "")

    def sent(self, row: dict, arm: str) -> dict:
        """Count a finished send (a warm-up one too) towards the factor's progress."""
        factor, done, planned = self._task
        self._task[1] = done = done + 1
        self.progress(factor, done, max(done, planned), arm)
        return row

    def send(self, factor: str, arm: str, case: Case, nonce: str) -> dict:
        return self.record(factor, arm, _send(self.target, self.cfg, case, nonce))

    def record(self, factor: str, arm: str, row: dict) -> dict:
        """Commit one send at once, so a kill loses at most the sends in flight."""
        self.store.record_send(factor, arm, row["case_id"], ok=row["error"] is None, data=row)
        return self.sent(row, arm)

    def fixed_nonce(self, factor: str, case: Case) -> str:
        return _nonce(self.cfg.run_id, factor, "all", case.case_id)

    def pending(self, factor: str, arms: list[str]) -> dict[str, list[Case]]:
        """Per arm, the cases (in order) without an ``ok`` send."""
        rows = self.store.sends(factor)
        return {
            a: [c for c in self.cases if rows.get((a, c.case_id), {}).get("status") != "ok"] for a in arms
        }


def _ok(row: dict | None, nonce: str) -> bool:
    return row is not None and row["status"] == "ok" and row["nonce"] == nonce


def _cache(run: _Run) -> None:
    rows = run.store.sends("cache")
    nonces = {
        c.case_id: (run.store.get_meta(f"nonce/cache/{c.case_id}") or {}).get("nonce") for c in run.cases
    }
    # Two sends a pair not yet complete (a kept cold send may need only its warm one: close enough).
    run.begin("cache", 2 * sum(not _ok(rows.get(("warm", i)), n) for i, n in nonces.items()))
    tally = run.store.get_meta("cache_resume") or {"warm_kept": 0, "pairs_resent": 0}
    for c in run.cases:
        key = f"nonce/cache/{c.case_id}"
        state = run.store.get_meta(key)
        if state is not None and _ok(rows.get(("cold", c.case_id)), state["nonce"]):
            if _ok(rows.get(("warm", c.case_id)), state["nonce"]):
                continue
            # The cold send finished in an earlier process: is its prefix still in the cache?
            cold = rows[("cold", c.case_id)]
            warm = run.sent(_send(run.target, run.cfg, c, state["nonce"]), "warm")
            if warm["error"] is not None or (warm["cached_tokens"] or 0) > (cold["cached_tokens"] or 0):
                run.record("cache", "warm", warm)
                tally["warm_kept"] += warm["error"] is None
                run.store.put_meta("cache_resume", tally)
                continue
            tally["pairs_resent"] += 1
            run.store.put_meta("cache_resume", tally)
        attempt = 0 if state is None else state["attempt"] + 1
        nonce = _nonce(run.cfg.run_id, "cache", f"attempt{attempt}", c.case_id)
        run.store.put_meta(key, {"nonce": nonce, "attempt": attempt})  # before the cold send
        if run.send("cache", "cold", c, nonce)["error"] is None:
            run.send("cache", "warm", c, nonce)


def _warm_up(run: _Run, factor: str) -> None:
    """Send every case once (not scored), so both arms that follow meet the same cache state:
    warm. Sent again on resume, where the server may have been restarted since. A failed warm-up
    send is counted (the arms may then meet that case cold), not retried."""
    failed = sum(
        run.sent(_send(run.target, run.cfg, c, run.fixed_nonce(factor, c)), "warm-up")["error"] is not None
        for c in run.cases
    )
    run.store.put_meta(f"warm_up/{factor}", {"failed": _warm_up_errors(run, factor) + failed})


def _warm_up_errors(run: _Run, factor: str) -> int:
    """Failed warm-up sends of ``factor`` over every process of the run."""
    return (run.store.get_meta(f"warm_up/{factor}") or {}).get("failed", 0)


def _concurrency_arms(cfg: EngineStateConfig) -> list[str]:
    return ["c1", f"c{cfg.concurrency}"]


def _concurrency(run: _Run) -> None:
    one, many = _concurrency_arms(run.cfg)
    todo = run.pending("concurrency", [one, many])
    if not any(todo.values()):
        return
    run.begin("concurrency", len(run.cases) + sum(map(len, todo.values())))
    _warm_up(run, "concurrency")
    for c in todo[one]:
        run.send("concurrency", one, c, run.fixed_nonce("concurrency", c))
    pool = ThreadPoolExecutor(run.cfg.concurrency)
    try:
        futures = [
            pool.submit(_send, run.target, run.cfg, c, run.fixed_nonce("concurrency", c)) for c in todo[many]
        ]
        for f in as_completed(futures):  # recorded here, on one thread, as each finishes
            run.record("concurrency", many, f.result())
    finally:
        # On Ctrl-C (or a failed commit) the sends not yet started are dropped: a plain `with`
        # waited for every queued one, sending the rest of the arm unrecorded before it exited.
        pool.shutdown(wait=True, cancel_futures=True)


def _repeat_arms(cfg: EngineStateConfig) -> list[str]:
    return [f"send {k + 1}" for k in range(cfg.repeats)]


def _repeat(run: _Run) -> None:
    arms = _repeat_arms(run.cfg)
    todo = run.pending("repeat", arms)
    if not any(todo.values()):
        return
    run.begin("repeat", len(run.cases) + sum(map(len, todo.values())))
    _warm_up(run, "repeat")
    todo_ids = {arm: {c.case_id for c in cases} for arm, cases in todo.items()}
    for c in run.cases:  # a case's R sends in a row, as in a fresh run
        for arm in arms:
            if c.case_id in todo_ids[arm]:
                run.send("repeat", arm, c, run.fixed_nonce("repeat", c))


_RUNNERS = {"cache": _cache, "concurrency": _concurrency, "repeat": _repeat}


def _arm(run: _Run, factor: str, arm: str, why_missing: str) -> list[dict]:
    """One arm's stored rows in case order (the cache factor's of each case's current nonce)."""
    rows = run.store.sends(factor)
    out = []
    for c in run.cases:
        row = rows.get((arm, c.case_id))
        if factor == "cache" and row is not None:
            state = run.store.get_meta(f"nonce/cache/{c.case_id}")
            row = row if state is not None and row["nonce"] == state["nonce"] else None
        out.append(
            _unsent(c, why_missing) if row is None else {k: v for k, v in row.items() if k != "status"}
        )
    return out


def _factor_body(run: _Run, name: str) -> dict:
    seed = run.cfg.seed
    if name == "cache":
        cold = _arm(run, "cache", "cold", "not sent")
        warm = _arm(run, "cache", "warm", "not sent: the cold send failed")
        effect = factor_effect([_arm_row(r) for r in cold], [_arm_row(r) for r in warm], seed=seed)
        resume = run.store.get_meta("cache_resume") or {"warm_kept": 0, "pairs_resent": 0}
        # A scored pair whose warm send reused no more of the prompt than its cold one compares
        # two cold sends (no prefix cache, or a router that sent them to different replicas): the
        # factor did not change what it names, and the report must say so (resume's rule, counted).
        not_reused = sum(
            c["error"] is None
            and w["error"] is None
            and (w["cached_tokens"] or 0) <= (c["cached_tokens"] or 0)
            for c, w in zip(cold, warm, strict=True)
        )
        return {
            "arms": ["cold", "warm"],
            "effect": effect,
            "rows": [cold, warm],
            "resume": resume,
            "warm_not_reused": not_reused,
        }
    if name == "concurrency":
        arms = _concurrency_arms(run.cfg)
        a, b = (_arm(run, name, arm, "not sent") for arm in arms)
        return {
            "arms": arms,
            "effect": factor_effect([_arm_row(r) for r in a], [_arm_row(r) for r in b], seed=seed),
            "rows": [a, b],
            "warm_up_errors": _warm_up_errors(run, "concurrency"),
        }
    sends = [[_arm_row(r) for r in _arm(run, name, arm, "not sent")] for arm in _repeat_arms(run.cfg)]
    deterministic, firsts, n = 0, [], 0
    for rows in zip(*sends, strict=True):
        if any(r.correct is None for r in rows):
            continue
        n += 1
        diffs = [answer_difference(rows[0], r) for r in rows[1:]]
        diffs = [d for d in diffs if d is not None]
        deterministic += not diffs
        if diffs:
            firsts.append(min(diffs))
    effect = factor_effect(sends[0], sends[-1], seed=seed)
    effect["determinism_rate"] = deterministic / n if n else None
    effect["first_differing_tokens"] = sorted(firsts)
    first, last = (
        _arm(run, name, "send 1", "not sent"),
        _arm(run, name, f"send {run.cfg.repeats}", "not sent"),
    )
    return {
        "arms": ["send 1", f"send {run.cfg.repeats}"],
        "effect": effect,
        "rows": [first, last],
        "warm_up_errors": _warm_up_errors(run, "repeat"),
    }


def _new_store(
    cfg: EngineStateConfig, target: CompletionsTarget, out: Path, progress: Progress
) -> tuple[ResultStore, list[Case]]:
    """Build the cases (sized by the server's /tokenize) before anything is written, then store
    them with the run's identity."""
    counter = detect_server_tokenizer(target.root, cfg.model, api_key=cfg.api_key)
    if counter is None:
        raise BadInput(f"{target.root} exposes no /tokenize endpoint; engine-state sizes its cases with it")
    try:
        cases = build_cases(cfg.spec(), counter, progress)
    finally:
        counter.close()
    out.mkdir(parents=True, exist_ok=True)
    meta = {"run_id": cfg.run_id, "fingerprint": cfg.fingerprint()}
    return create_store(out / STORE_NAME, meta, [c.to_dict() for c in cases]), cases


def _resume_store(cfg: EngineStateConfig, out: Path) -> tuple[ResultStore, list[Case], EngineStateConfig]:
    store = ResultStore(out / STORE_NAME)
    previous = store.get_meta("fingerprint")
    problem = None
    if previous is None or not store.cases():
        problem = f"{out / STORE_NAME} holds no cases; delete it and start the run again"
    elif previous.get("command") != COMMAND:
        problem = f"{out} holds a probe run, not an engine-state run; use another --out"
    elif previous != cfg.fingerprint():
        now = cfg.fingerprint()
        diff = ", ".join(
            f"{k}={previous.get(k)!r}, not {now.get(k)!r}" for k in now if previous.get(k) != now.get(k)
        )
        problem = f"the run in {out} was made with {diff}; pass the same flags or use another --out"
    if problem is not None:
        store.close()
        raise BadInput(f"--resume: {problem}")
    cases = [Case(**d) for d in store.cases()]
    return store, cases, dataclasses.replace(cfg, run_id=store.get_meta("run_id"))


def fit_to_target(
    cfg: EngineStateConfig, target: CompletionsTarget, note: Callable[[str], None]
) -> EngineStateConfig:
    """``cfg`` with the value length and the lengths the target can hold (``targets.limits``):
    BadInput before any send when a length does not fit, unless ``skip_long_lengths``."""
    prov = collect_provenance(target.root, target.v1, api_key=cfg.api_key, timeout=min(cfg.timeout_s, 5.0))
    limits = read_limits(prov, cfg.model)
    # The nonce (six digits, a period, a space) is added to each prompt after it is sized.
    kept, dropped = fit_lengths(
        cfg.lengths, limits, answer_tokens=cfg.max_tokens + NONCE_TOKENS, skip=cfg.skip_long_lengths
    )
    if dropped:
        note(
            f"WARNING: skipping lengths {', '.join(map(str, dropped))}: beyond the target's context of "
            f"{limits.context} tokens ({limits.context_from})"
        )
    digits, source = choose_value_digits(cfg.value_digits, limits)
    note(f"needle values: {digits} digits, from {source}")
    return dataclasses.replace(cfg, lengths=kept, value_digits=digits)


def run_engine_state(
    cfg: EngineStateConfig,
    out: Path,
    *,
    resume: bool = False,
    progress: Progress = no_progress,
    note: Callable[[str], None] = lambda _line: None,
) -> dict:
    """Run (or, with ``resume``, continue) each factor into ``out``'s store; return
    engine_state.json's body, built from the store (so a resumed run reports every send).
    ``progress`` hears of each send (a task per factor), ``note`` of what was taken from the target."""
    out = Path(out)
    check_out(out, resume)
    # A server nothing answers at is named first, before anything is read from it or noted.
    served_models(cfg.base_url, cfg.api_key, min(cfg.timeout_s, 5.0), flag="--base-url")
    with CompletionsTarget(cfg.base_url, cfg.model, api_key=cfg.api_key, timeout=cfg.timeout_s) as target:
        cfg = fit_to_target(cfg, target, note)
        if resume:
            store, cases, cfg = _resume_store(cfg, out)
        else:
            store, cases = _new_store(cfg, target, out, progress)
        try:
            run = _Run(cfg, target, store, cases, progress)
            for name in cfg.factors:
                _RUNNERS[name](run)
            factors = {name: _factor_body(run, name) for name in cfg.factors}
        finally:
            store.close()
    return {
        "kind": "needlescope-engine-state",
        "base_url": target.v1,
        "config": cfg.to_dict(),
        "factors": factors,
    }
