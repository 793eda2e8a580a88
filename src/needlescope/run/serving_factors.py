"""The live factor experiment: which serving factor moves recall (docs/serving_factors.md).

The probe's cases are sent in a **baseline** arm (alone, cold prefix cache, no per-request knob,
the first endpoint) and in arms that each change one factor to one level, or two factors at their
last levels (an interaction cell). ``analysis.factors`` tests every arm against the baseline on
the same cases and names the factor.

How each arm makes its one difference:

- every arm sends each case under a nonce of its own (``run.engine_state``'s six digits before the
  first message), so no send finds another's prefix in the cache: each is cold, except
- ``cache=warm``: the baseline send's identical bytes again, after the whole baseline pass (other
  prompts went through the cache in between, as in a deployment). A hit is verified
  from ``usage.prompt_tokens_details.cached_tokens``: the warm send must report more cached tokens
  than its cold one; a pair without a verified hit is left out of the test and counted
  (``unverified_hits``). A cell with the cache primes its own nonce first (a cold send alone,
  not scored, counted in ``primes``);
- ``batch=besideK``: the cases in groups of K+1 sent at once (a barrier lines the threads up),
  so each scored case has K batch mates; a short last group is filled with unscored mates
  (``fillers``). The batch the server reports (``usage.batch.size``) is kept per send;
- ``draft=D`` / ``chunk=C``: a request field (``--draft-field`` / ``--chunk-field``) set to the
  level, for servers that take the knob per request; what the server reports it applied
  (``usage.speculative.num_draft_tokens``) is kept;
- the endpoint factor: the same sends at the second ``--base-url``, a server that differs from the
  first in one launch flag (named by ``--endpoint-factor``, e.g. ``draft`` for
  ``--speculative-num-draft-tokens 8`` against none);
- ``repeat``: the baseline's own condition again (alone, cold, under another nonce): a server that
  answers it differently carries state across requests that no other factor names.

The **echo probe** (``--echo N``): N exact-copy tasks (``cases.echo``) at each draft level (the
per-request depths, or each endpoint), each cold under its own nonce; corruption rate and its 95%
Clopper-Pearson upper bound per level (``analysis.factors.echo_summary``).

**Output identity**: greedy decoding is token-identical across serving features on a correct
engine, so every arm's outputs are compared with the baseline's on the same case, against the
repeat arm's (``analysis.factors.decide_identity``), and the factor that makes output depart is
named apart from recall. ``--continuation N`` asks N greedy tokens with ``ignore_eos`` per send
(bugs that corrupt later tokens, such as a verify pass that keeps too few rows, show there); the
recall score then reads the answer up to the turn's end token (``_answer``).

A request that fails is a row with ``error`` set and ``correct`` None, never a miss; its pair is
left out. The run is bounded (``planned_requests``) and not resumable: a killed run is run again.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from needlescope.analysis.factors import (
    decide,
    decide_identity,
    departures,
    echo_summary,
    identity_counts,
    paired_counts,
)
from needlescope.analysis.stats import mean_present
from needlescope.cases import Case, build_cases, score_answer
from needlescope.cases.echo import EchoTask, echo_tasks, exact_copy
from needlescope.cases.scoring import prompt_rivals
from needlescope.errors import BadInput, ProbeError
from needlescope.progress import Progress, no_progress
from needlescope.run.engine_state import _nonce, _with_nonce, fit_to_target
from needlescope.run.factor_plan import FACTORS, Arm, FactorConfig, plan_arms, planned_requests
from needlescope.targets.client import served_models
from needlescope.targets.completions import Completion, CompletionsTarget
from needlescope.targets.serving_usage import read_serving_usage
from needlescope.targets.tokenize import detect_server_tokenizer

__all__ = ["FACTORS", "Arm", "FactorConfig", "plan_arms", "planned_requests", "run_serving_factors"]


@dataclass
class _Run:
    cfg: FactorConfig
    targets: list[CompletionsTarget]
    cases: list[Case]
    progress: Progress = no_progress
    sent: int = 0
    primes: int = 0
    fillers: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, arm: Arm, case: Case, nonce: str, label: str) -> dict:
        row = _send(self.targets[arm.endpoint], self.cfg, case, nonce, dict(arm.fields))
        with self.lock:
            self.sent += 1
            self.progress("serving factors", self.sent, None, label)
        return row


_END_TOKEN = re.compile(r"^<[|｜][^<>]*[|｜]>$|^</s>$|^<eos>$|^<end_of_turn>$")
"""A special token that ends a turn, as servers spell one in logprobs (``<|end|>``, ``<|im_end|>``,
DeepSeek's ``<｜end▁of▁sentence｜>``, ``</s>``, Gemma's ``<end_of_turn>``)."""


def _answer(done: Completion) -> str:
    """The answer of a continuation (``--continuation``, sent with ``ignore_eos``): its tokens
    before the first special token (the turn's end); the whole text when the server gave no
    logprob tokens or no special token."""
    for i, step in enumerate(done.steps):
        if _END_TOKEN.match(step.token.strip()):
            return "".join(s.token for s in done.steps[:i])
    return done.text


def _send(target: CompletionsTarget, cfg: FactorConfig, case: Case, nonce: str, fields: dict) -> dict:
    """One scored send as its row (``error`` set and ``correct`` None when the request failed).
    With ``cfg.continuation``: ``continuation`` greedy tokens with ``ignore_eos``; recall scores
    the answer (``_answer``), output identity the whole text."""
    row: dict = {"case_id": case.case_id, "length": case.length, "depth": case.depth, "nonce": nonce}
    tokens, extra = cfg.max_tokens, fields
    if cfg.continuation:
        tokens, extra = cfg.continuation, {**fields, "ignore_eos": True}
    try:
        done = target.chat(_with_nonce(case, nonce), tokens, top=1, extra=extra)
    except ProbeError as e:
        empty = {"correct": None, "cached_tokens": None, "text": None, "answer": None, "hit": None}
        return {**row, **empty, **read_serving_usage(None).to_dict(), "error": f"{e.kind}: {e}"}
    answer = _answer(done) if cfg.continuation else done.text
    correct = score_answer(answer, case.expected, prompt_rivals(case.messages, case.expected))
    return {
        **row,
        "correct": correct,
        "cached_tokens": done.cached_tokens,
        "text": done.text,
        "answer": answer,
        "hit": None,
        **read_serving_usage(done.usage).to_dict(),
        "error": None,
    }


def _verify_hit(cold: dict, warm: dict) -> None:
    """Mark ``warm``'s cache hit: more cached tokens than its cold send (None: unknown)."""
    if cold["cached_tokens"] is not None and warm["cached_tokens"] is not None:
        warm["hit"] = warm["cached_tokens"] > cold["cached_tokens"]


def _at_once(jobs: list[Callable[[], dict]]) -> list[dict]:
    """Run ``jobs`` on as many threads, released together by a barrier (a broken barrier, after
    30 s, releases them anyway: the send still counts, its reported batch says what it met)."""
    barrier = threading.Barrier(len(jobs))

    def go(job: Callable[[], dict]) -> dict:
        try:
            barrier.wait(timeout=30)
        except threading.BrokenBarrierError:
            pass
        return job()

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(go, jobs))


def _arm_rows(run: _Run, arm: Arm) -> list[dict]:
    """Send every case in ``arm`` (primed first when warm, in groups of mates+1 when batched)."""
    nonces = [_nonce(run.cfg.run_id, "factors", arm.name, c.case_id) for c in run.cases]
    if arm.warm:
        cold = Arm("prime", (), endpoint=arm.endpoint)
        primes = [run.send(cold, c, n, f"{arm.name} (prime)") for c, n in zip(run.cases, nonces, strict=True)]
        run.primes += len(primes)
    width = arm.mates + 1
    rows: list[dict] = []
    for start in range(0, len(run.cases), width):
        group = list(zip(run.cases, nonces, strict=True))[start : start + width]
        jobs = [lambda c=c, n=n: run.send(arm, c, n, arm.name) for c, n in group]
        fill = width - len(group) if width > 1 else 0
        for i in range(fill):  # unscored batch mates: other cases under filler nonces
            c = run.cases[i % len(run.cases)]
            jobs.append(
                lambda c=c, i=i: run.send(
                    arm, c, _nonce(run.cfg.run_id, "filler", arm.name, f"{c.case_id}/{i}"), "filler"
                )
            )
        run.fillers += fill
        rows += (_at_once(jobs) if len(jobs) > 1 else [jobs[0]()])[: len(group)]
    if arm.warm:
        for p, w in zip(primes, rows, strict=True):
            _verify_hit(p, w)
    return rows


def _baseline_and_cache(run: _Run, arms: list[Arm]) -> dict[str, list[dict]]:
    """The baseline, then ``cache=warm`` (when planned): each case's identical bytes again after
    the whole baseline pass, so other prompts went through the cache between a case's cold send
    and its warm one, as in a deployment (state a hit restores from the wrong request, e.g. a
    per-slot sliding-window ring, shows only then; an evicted prefix is an unverified hit)."""
    warm = next((a for a in arms if a.name == "cache=warm"), None)
    nonces = [_nonce(run.cfg.run_id, "factors", "baseline", c.case_id) for c in run.cases]
    base = [run.send(arms[0], c, n, "baseline") for c, n in zip(run.cases, nonces, strict=True)]
    if warm is None:
        return {"baseline": base}
    hot = [run.send(warm, c, n, warm.name) for c, n in zip(run.cases, nonces, strict=True)]
    for cold, w in zip(base, hot, strict=True):
        _verify_hit(cold, w)
    return {"baseline": base, warm.name: hot}


def _scored(arm: Arm, rows: list[dict]) -> list[bool | None]:
    """What the test reads: a warm arm's pair without a verified hit is left out (None)."""
    return [r["correct"] if not arm.warm or r["hit"] else None for r in rows]


def _arm_body(arm: Arm, rows: list[dict]) -> dict:
    drafts = sorted({r["draft_tokens"] for r in rows if r["draft_tokens"] is not None})
    return {
        "name": arm.name,
        "factors": list(arm.factors),
        "endpoint": arm.endpoint,
        "warm": arm.warm,
        "mates": arm.mates,
        "fields": dict(arm.fields),
        "recall": mean_present([r["correct"] for r in rows]),
        "errors": sum(r["error"] is not None for r in rows),
        "unverified_hits": sum(r["error"] is None and not r["hit"] for r in rows) if arm.warm else None,
        "cached_tokens_mean": mean_present([r["cached_tokens"] for r in rows]),
        "batch_size_mean": mean_present([r["batch_size"] for r in rows]),
        "draft_tokens_reported": drafts,
        "acceptance_rate_mean": mean_present([r["acceptance_rate"] for r in rows]),
        "rows": rows,
    }


def _echo(run: _Run, tasks: list[EchoTask]) -> dict:
    """Each echo task at each draft level, cold under its own nonce; exact-copy outcomes."""
    cfg = run.cfg
    if cfg.draft_depths:
        levels = [("none", Arm("echo", ()))] + [
            (str(d), Arm("echo", (), fields=((cfg.draft_field, d),))) for d in cfg.draft_depths
        ]
    else:
        levels = [(label, Arm("echo", (), endpoint=i)) for i, label in enumerate(cfg.endpoint_labels)]
    budget = cfg.echo_items * (cfg.echo_digits + 1) + 8  # a token a digit and a separator, at worst
    outcomes: dict[str, list[bool | None]] = {}
    rows: dict[str, list[dict]] = {}
    for label, arm in levels:
        outcomes[label], rows[label] = [], []
        for t in tasks:
            nonce = _nonce(cfg.run_id, "echo", label, t.task_id)
            case = Case(t.task_id, "echo", 0, 0.0, 0, list(t.messages), list(t.items), "", "", "echo", 0)
            tuned = dataclasses.replace(cfg, max_tokens=budget, continuation=0)
            row = _send(run.targets[arm.endpoint], tuned, case, nonce, dict(arm.fields))
            run.sent += 1
            run.progress("serving factors", run.sent, None, f"echo {label}")
            ok = None if row["error"] is not None else exact_copy(row["text"], t.items)
            outcomes[label].append(ok)
            rows[label].append(
                {
                    "task_id": t.task_id,
                    "copied": ok,
                    **{k: row[k] for k in ("text", "draft_tokens", "acceptance_rate", "error")},
                }
            )
    baseline = levels[0][0]
    return {"baseline": baseline, "levels": echo_summary(outcomes, baseline, alpha=cfg.alpha), "rows": rows}


def _sentence(verdict: dict, tests: list[dict]) -> str:
    """The verdict in one line, with its numbers."""
    if verdict["named"] is not None:
        t = next(t for t in tests if t["arm"] == verdict["arm"])
        what = "moves recall" if verdict["kind"] == "factor" else "moves recall together (neither alone does)"
        also = f"; also significant: {', '.join(verdict['also'])}" if verdict["also"] else ""
        return (
            f"{verdict['named']} {what}: {t['arm']} recall {t['recall_arm']:.2f} vs baseline "
            f"{t['recall_base']:.2f} on {t['pairs']} paired cases ({t['lost']} lost, {t['gained']} gained), "
            f"exact McNemar p = {t['p']:.2g}, Holm p = {t['p_holm']:.2g}{also}"
        )
    if not tests:
        return "no factor: no arm was tested"
    weakest = min(tests, key=lambda t: t["power"])
    need = weakest["pairs_needed"]
    return (
        f"no factor: none of {len(tests)} arms moves recall (Holm, alpha {verdict['alpha']:g}); power to "
        f"detect a loss of {verdict['min_loss']:.0%}: {weakest['power']:.2f} at the weakest arm "
        f"({weakest['arm']}, {weakest['pairs']} pairs; {need if need is not None else 'over 1000'} pairs "
        "give 0.80)"
    )


def _outputs(arm: Arm, rows: list[dict]) -> list[str | None]:
    """What output identity compares: each send's whole text (a warm send without a verified hit,
    or a failed one: None)."""
    return [r["text"] if r["error"] is None and (not arm.warm or r["hit"]) else None for r in rows]


def _identity(cfg: FactorConfig, arms: list[Arm], rows: dict[str, list[dict]]) -> dict | None:
    """Output identity (``analysis.factors.decide_identity``): each arm's greedy outputs against the
    baseline's, paired with the repeat arm's departures. None without a repeat arm."""
    if "repeat" not in rows:
        return None
    base = _outputs(arms[0], rows["baseline"])
    repeat = departures(base, _outputs(Arm("repeat", ("repeat",)), rows["repeat"]))
    tests = [
        {
            **identity_counts(departures(base, _outputs(a, rows[a.name])), repeat),
            "arm": a.name,
            "factors": list(a.factors),
        }
        for a in arms[1:]
        if a.name != "repeat"
    ]
    decision = decide_identity(tests, alpha=cfg.alpha, min_share=cfg.min_loss)
    verdict = {k: v for k, v in decision.items() if k != "tests"}
    known = [x for x in repeat if x is not None]
    verdict["sentence"] = _identity_sentence(verdict, decision["tests"], sum(known), len(known))
    return {
        "reference": "repeat",
        "continuation": cfg.continuation,
        "repeat_departs": sum(known),
        "repeat_pairs": len(known),
        "tests": decision["tests"],
        "verdict": verdict,
    }


def _identity_sentence(verdict: dict, tests: list[dict], repeat_departs: int, repeat_pairs: int) -> str:
    """The output-identity verdict in one line, with its numbers (never a recall loss)."""
    repeat = f"repeat departs in {repeat_departs} of {repeat_pairs} (the engine's own nondeterminism)"
    if verdict["named"] is not None:
        t = next(t for t in tests if t["arm"] == verdict["arm"])
        what = "changes greedy output" if verdict["kind"] == "factor" else "changes greedy output together"
        also = f"; also significant: {', '.join(verdict['also'])}" if verdict["also"] else ""
        return (
            f"{verdict['named']} {what}: {t['arm']} departs from the baseline's output in {t['departs']} of "
            f"{t['pairs']} cases, {repeat} ({t['only_arm']} depart only in the arm, {t['only_repeat']} only "
            f"in repeat), one-sided exact p = {t['p']:.2g}, Holm p = {t['p_holm']:.2g}{also}"
        )
    if not tests:
        return "no factor changes greedy output: no arm was compared"
    most = max(tests, key=lambda t: t["departs"])
    return (
        f"no factor changes greedy output beyond repeat (Holm, alpha {verdict['alpha']:g}): at most "
        f"{most['departs']} of {most['pairs']} cases depart ({most['arm']}), {repeat}"
    )


def run_serving_factors(
    cfg: FactorConfig,
    *,
    progress: Progress = no_progress,
    note: Callable[[str], None] = lambda _line: None,
) -> dict:
    """Run the experiment; return serving_factors.json's body (``report.serving_factors``)."""
    for url in cfg.base_urls:
        served_models(url, cfg.api_key, min(cfg.timeout_s, 5.0), flag="--base-url")
    targets = [
        CompletionsTarget(u, cfg.model, api_key=cfg.api_key, timeout=cfg.timeout_s) for u in cfg.base_urls
    ]
    try:
        longest = dataclasses.replace(cfg, max_tokens=max(cfg.max_tokens, cfg.continuation))
        cfg = dataclasses.replace(fit_to_target(longest, targets[0], note), max_tokens=cfg.max_tokens)
        counter = detect_server_tokenizer(targets[0].root, cfg.model, api_key=cfg.api_key)
        if counter is None:
            raise BadInput(
                f"{targets[0].root} exposes no /tokenize endpoint; serving-factors sizes its cases with it"
            )
        try:
            cases = build_cases(cfg.spec(), counter, progress)
        finally:
            counter.close()
        arms = plan_arms(cfg)
        note(f"{len(cases)} cases, {len(arms)} arms: {planned_requests(cfg, len(cases))} requests planned")
        run = _Run(cfg, targets, cases, progress)
        rows = _baseline_and_cache(run, arms)
        for arm in arms:
            if arm.name not in rows:
                rows[arm.name] = _arm_rows(run, arm)
        tasks = echo_tasks(cfg.echo, cfg.echo_items, cfg.echo_digits, cfg.seed) if cfg.echo else []
        echo = _echo(run, tasks) if tasks else None
    finally:
        for t in targets:
            t.close()
    base = [r["correct"] for r in rows["baseline"]]
    tests = [
        {**paired_counts(base, _scored(a, rows[a.name])), "arm": a.name, "factors": list(a.factors)}
        for a in arms[1:]
    ]
    decision = decide(tests, alpha=cfg.alpha, min_loss=cfg.min_loss)
    verdict = {k: v for k, v in decision.items() if k != "tests"}
    verdict["sentence"] = _sentence(verdict, decision["tests"])
    return {
        "kind": "needlescope-serving-factors",
        "base_urls": [t.v1 for t in targets],
        "config": cfg.to_dict(),
        "cases": len(cases),
        "requests": {"sent": run.sent, "primes": run.primes, "fillers": run.fillers},
        "arms": [_arm_body(a, rows[a.name]) for a in arms],
        "tests": decision["tests"],
        "verdict": verdict,
        "identity": _identity(cfg, arms, rows),
        "echo": echo,
    }
