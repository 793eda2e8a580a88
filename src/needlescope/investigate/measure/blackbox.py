"""The black-box route: an endpoint without an indexer capture (vLLM), read from outside only.

A ledger with ``candidate = "blackbox"`` and an ``endpoint`` takes this route
(``investigate.run``); no model loads here. Through the OpenAI chat API (``targets.ChatTarget``,
greedy, one request at a time) it measures, each step resumable from ``measure/bb-*.jsonl``:

1. **architecture**: the compression ratio, ``index_topk``, page size and chunk size from
   ``/get_server_info`` where the server says them, else from the ledger's ``config``
   (a ``config.json``), else from the ledger model's ``config.json``;
2. **grid**: the symptom's length x depth cases; a case is lost when its answer is wrong;
3. when a case is lost, the discriminating experiments (``decide.blackbox`` decides), sized by
   the ledger's ``[blackbox]`` table (``investigate.ledger.blackbox.BlackboxPlan``): the **dense
   length** (``ratio x top-k - 1`` tokens: every entry selected; ``dense_cases``), the **residue
   scan** (lengths L + d around the shortest failing length L, one case at each of up to
   ``scan_depths`` of its failing depths), the first ``failing_cases`` failing cases **sent again
   alone**, and, where the server gives prompt logprobs (``targets.logprobs``: vLLM
   ``prompt_logprobs``, ``echo``, SGLang ``return_logprob``), the gold answer of each
   **teacher-forced** (where it gives none, the evidence says so and ``decode_only`` stays
   undecided, naming the missing logprobs).
4. with the ledger's ``topk_endpoint`` (the same deployment with a larger top-k), the **top-k
   pair**: the grid's cases and ``PAIR_CASES`` at each of ``blackbox_topk.pair_lengths`` sent to
   both endpoints, paired case by case (``decide.blackbox_topk`` reads them).

The chats name the ledger's ``served_model``, else the first model ``/v1/models`` lists; a server
that lists none (``transformers serve`` offline) with no ``served_model`` is BadInput.

Prompts are sized by the server's own ``/tokenize`` when it has one, else by the ledger model's
tokenizer (``LocalTokenCounter``), so the residue scan's lengths are the lengths the server saw.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

from needlescope.analysis.bisect import RATIO_KEYS, ints_in
from needlescope.cases.scoring import prompt_rivals, score_answer
from needlescope.errors import BadInput, ProbeError
from needlescope.investigate.decide.blackbox import (
    Arch,
    BlackboxContext,
    BlackboxEvidence,
    GridCell,
    residue_offsets,
)
from needlescope.investigate.decide.blackbox_topk import PairCell, TopkPair, pair_lengths
from needlescope.investigate.decide.measured import Measured

__all__ = ["measure", "STEP", "arch_from"]

STEP = "measured:blackbox"
PAIR_CASES = 12
"""Cases per length of the top-k pair's own lengths: a restore needs six gains more than losses
(exact McNemar, two-sided, p = 1/32)."""
TOP_LOGPROBS = 5

_CHUNK_KEYS = ("chunked_prefill_size", "prefill_chunk", "max_num_batched_tokens")


def _scopes(obj: dict) -> list[dict]:
    return [obj] + [obj[k] for k in ("args", "config", "server_args") if isinstance(obj.get(k), dict)]


def _first(obj: dict, keys: tuple[str, ...], pick=min) -> int | None:
    for scope in _scopes(obj):
        for k in keys:
            found = [x for x in ints_in(scope.get(k)) if x > 1]
            if found:
                return pick(found)
    return None


def arch_from(info: dict | None, config: dict | None, config_name: str = "config.json") -> Arch:
    """The architecture numbers: each from ``/get_server_info`` where it says it, else from the
    checkpoint's ``config`` (the CSA ratio is the smallest compression ratio above 1; the served
    ``index_topk`` wins over the checkpoint's)."""
    info, config = info or {}, config or {}
    said: dict[str, str] = {}

    def pick(name: str, keys: tuple[str, ...]) -> int | None:
        for src, obj in (("/get_server_info", info), (config_name, config)):
            v = _first(obj, keys)
            if v is not None:
                said[name] = src
                return v
        return None

    ratio, topk = pick("ratio", RATIO_KEYS), pick("index_topk", ("index_topk",))
    page, chunk = pick("page_size", ("page_size",)), pick("chunk_size", _CHUNK_KEYS)
    source = ", ".join(f"{k} from {v}" for k, v in said.items()) or "none said"
    return Arch(ratio=ratio, topk=topk, page_size=page, chunk_size=chunk, source=source)


class Blackbox:
    """The black-box measurements on a ``Session`` (module docstring); no decision."""

    def __init__(self, session, endpoint: str | None = None):
        from needlescope.targets import normalize_base_url

        self.session = session
        self.root, self.v1 = normalize_base_url(endpoint or session.ledger.target.endpoint)
        self.info: dict = {}
        self.model = "default"
        self.counter = None
        self.digits = None

    # -- the endpoint ---------------------------------------------------------------------
    def connect(self, record: bool = True) -> Arch:
        """The endpoint's model, tokenizer and architecture numbers; ``record``: keep its
        ``/get_server_info`` as the run's (the candidate's, not the top-k pair's second one)."""
        from needlescope.targets import collect_provenance, detect_server_tokenizer

        ss = self.session
        prov = collect_provenance(self.root, self.v1, api_key=ss.api_key)
        info = prov.get("/get_server_info")
        self.info = info if isinstance(info, dict) else {}
        if self.info and record:
            ss.state.set_server_info(self.info)
        self.model = self._served_model()
        self.counter = detect_server_tokenizer(self.root, self.model, api_key=ss.api_key)
        local = self._model_dir()
        if self.counter is None:
            if local is None:
                raise BadInput(
                    f"{self.root} has no /tokenize and the ledger's model {ss.ledger.target.model!r} is no "
                    "tokenizer directory: the black box cannot size its prompts; set [target] model"
                )
            from needlescope.targets import LocalTokenCounter

            self.counter = LocalTokenCounter(local)
        self.digits = self._value_digits(local)
        config, name = self._config(local)
        return arch_from(self.info, config, name)

    def _served_model(self) -> str:
        """The ledger's ``served_model`` (checked with ``preflight``: a one-token chat where
        ``/v1/models`` does not list it), else the first listed model, else the one
        ``/get_server_info`` names; BadInput when none of them says one."""
        from needlescope.targets import preflight, served_models

        ss = self.session
        named = ss.ledger.target.served_model
        if named is not None:
            preflight(
                self.root, named, ss.api_key, timeout=60, flag="[target] endpoint", model_flag="served_model"
            )
            return named
        listed = served_models(self.root, ss.api_key)
        said = listed[0] if listed else self.info.get("model")
        if not isinstance(said, str) or not said:
            raise BadInput(
                f"{self.v1}/models lists no model and the ledger names none: set [target] served_model "
                '= "ID" (the id the endpoint serves; investigate init --served-model ID writes it)'
            )
        return said

    def _model_dir(self) -> Path | None:
        from needlescope.dsa.checkpoint import resolve_model_dir

        try:
            return resolve_model_dir(self.session.ledger.target.model)
        except BadInput:
            return None

    def _config(self, local: Path | None) -> tuple[dict | None, str]:
        t = self.session.ledger.target
        path = t.config or (local / "config.json" if local is not None else None)
        if path is None or not Path(path).is_file():
            return None, "config.json"
        try:
            return json.loads(Path(path).read_text(encoding="utf-8")), Path(path).name
        except ValueError as exc:
            raise BadInput(f"config {path} is not JSON ({exc}); pass the checkpoint's config.json") from None

    def _value_digits(self, local: Path | None) -> int:
        from needlescope.cases.needles import VALUE_DIGITS
        from needlescope.dsa.checkpoint import trained_value_digits

        said = self.info.get("trained_value_digits")
        if isinstance(said, int) and not isinstance(said, bool):
            return said
        return trained_value_digits(local) if local is not None else VALUE_DIGITS

    # -- cases ----------------------------------------------------------------------------
    def cases(self, lengths: list[int], depths=None, trials: int | None = None) -> list:
        """The ledger symptom's cases at ``lengths`` (a length too short for a needle is left out)."""
        from needlescope.cases.assemble import CaseSpec, build_cases

        sy = self.session.ledger.symptom
        spec = CaseSpec(
            kind=sy.kind,
            lengths=tuple(lengths[:1]),
            depths=tuple(depths if depths is not None else sy.depths),
            trials=trials or sy.trials,
            seed=sy.seed,
            value_digits=self.digits,
        )
        out = []
        for length in lengths:
            try:
                out += build_cases(replace(spec, lengths=(length,)), self.counter)
            except BadInput:
                continue
        return out

    def send(self, name: str, cases: list) -> list[dict]:
        """Every case of ``cases`` answered (``measure/NAME.jsonl``; one with an error is sent
        again on resume)."""
        from needlescope.targets import ChatTarget

        ss = self.session
        done = {r["case_id"]: r for r in ss.state.records(name)}
        todo = [c for c in cases if c.case_id not in done or done[c.case_id].get("error")]
        ss.progress(f"black box {name}", len(cases) - len(todo), len(cases), self.root)

        async def go():
            async with ChatTarget(
                self.root, self.model, api_key=ss.api_key, timeout=600.0, concurrency=1
            ) as t:
                for c in todo:
                    base = {
                        "case_id": c.case_id,
                        "length": c.length,
                        "depth": float(c.depth),
                        "trial": c.trial,
                    }
                    try:
                        res = await t.chat(c.messages, max_tokens=ss.ledger.symptom.max_new_tokens)
                        rivals = prompt_rivals(c.messages, c.expected)
                        rec = {
                            **base,
                            "answer": res.text,
                            "correct": score_answer(res.text, c.expected, rivals),
                        }
                    except ProbeError as exc:
                        rec = {**base, "error": f"{type(exc).__name__}: {exc}"}
                    ss.state.append_record(name, rec)
                    done[c.case_id] = rec
                    ss.progress(f"black box {name}", len(done), len(cases), self.root)

        if todo:
            asyncio.run(go())
        return [done[c.case_id] for c in cases if c.case_id in done]

    def teacher_forced(self, cases: list) -> tuple[list[dict], str | None, str]:
        """Per case scored, its gold answer's ranks and margins per token teacher-forced (the
        server's prompt logprobs), the method and its note; [] when the server offers none."""
        from needlescope.targets import ChatTarget
        from needlescope.targets.logprobs import detect_method, score_gold

        ss = self.session
        done = {r["case_id"]: r for r in ss.state.records("bb-teacher")}

        async def go():
            async with ChatTarget(
                self.root, self.model, api_key=ss.api_key, timeout=600.0, concurrency=1
            ) as t:
                method = await detect_method(t, TOP_LOGPROBS)
                if method.method is None:
                    return None, method.note
                for c in cases:
                    if c.case_id in done:
                        continue
                    try:
                        s = await score_gold(t, method, c.messages, list(c.expected))
                        rec = {"case_id": c.case_id, "ranks": s["ranks"], "margins": s["margins"]}
                    except ProbeError as exc:
                        rec = {"case_id": c.case_id, "error": f"{type(exc).__name__}: {exc}"}
                    ss.state.append_record("bb-teacher", rec)
                    done[c.case_id] = rec
                return method.method, method.note

        method, note = asyncio.run(go())
        firsts = [
            {"ranks": done[c.case_id]["ranks"], "margins": done[c.case_id]["margins"]}
            for c in cases
            if c.case_id in done and not done[c.case_id].get("error")
        ]
        return (firsts if method else []), method, note


def _cells(records: list[dict]) -> tuple[GridCell, ...]:
    acc: dict[tuple[int, float], list[int]] = {}
    for r in records:
        if r.get("error"):
            continue
        a = acc.setdefault((r["length"], r["depth"]), [0, 0])
        a[0] += 1
        a[1] += not r["correct"]
    return tuple(GridCell(length, depth, n, lost) for (length, depth), (n, lost) in sorted(acc.items()))


def _prompt_file(session, case) -> str:
    from needlescope.paths import atomic_write_json

    folder = (session.out / "characterize").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(folder / "prompt.json", case.messages)
    return str(folder / "prompt.json")


def measure(session) -> Measured:
    """Every black-box measurement of the run (module docstring), resumable."""
    bb = Blackbox(session)
    arch = bb.connect()
    sy = session.ledger.symptom
    grid_cases = bb.cases(list(sy.lengths))
    grid = bb.send("bb-grid", grid_cases)
    scored = [r for r in grid if not r.get("error")]
    if not scored:
        why = grid[0]["error"] if grid else "no case was built"
        raise BadInput(
            f"the endpoint {bb.root} answered no case ({why}); nothing was decided: fix the endpoint and "
            "run again (measure/bb-grid.jsonl keeps what it answered)"
        )
    by_id = {c.case_id: c for c in grid_cases}
    failing = sorted(
        (r for r in scored if not r["correct"]), key=lambda r: (r["length"], r["depth"], r["trial"])
    )
    ev = BlackboxEvidence(arch=arch, grid=_cells(grid))
    ctx = BlackboxContext(
        base_url=bb.root,
        served_model=bb.model,
        tokenizer=session.ledger.target.model,
        lengths=tuple(sy.lengths),
    )
    if failing:
        ev, ctx = _experiments(session, bb, ev, ctx, failing, by_id)
    t = session.ledger.target
    return Measured(
        route="blackbox",
        target={"model": t.model, "device": t.device, "endpoint": t.endpoint},
        candidate_label=f"black-box endpoint {t.endpoint}",
        # the reference is the expected answer: every case the endpoint answered, scored right
        reference_records=[
            {**{k: r[k] for k in ("case_id", "length", "depth", "trial")}, "correct": True} for r in scored
        ],
        candidate_records=grid,
        configs={},
        suspects=[],
        evidence={},
        differences=[],
        candidate_topk=arch.topk,
        symptom_extra={
            "reference": "the expected answers (black box: no reference model runs)",
            "errors": sum(1 for r in grid if r.get("error")),
            "failing_cases": len(failing),
            "architecture": {**arch.__dict__},
            "served_model": bb.model,
            "plan": session.ledger.blackbox.to_json(),  # the [blackbox] sizes the experiments ran at
        },
        blackbox={"evidence": ev.to_json(), "context": ctx.to_json()},
    )


def _experiments(session, bb: Blackbox, ev, ctx, failing, by_id):
    """The discriminating experiments of a run that lost cases (module docstring)."""
    arch, plan = ev.arch, session.ledger.blackbox
    dense = []
    if arch.dense_length is not None:
        depths = session.ledger.symptom.depths
        trials = -(-plan.dense_cases // len(depths))
        dense = bb.send("bb-dense", bb.cases([arch.dense_length], trials=trials))
    L = failing[0]["length"]
    lost_depths = sorted({r["depth"] for r in failing if r["length"] == L})[: plan.scan_depths]
    scan_cases = bb.cases([L + d for d in residue_offsets(arch)], depths=lost_depths, trials=1)
    scan = bb.send("bb-scan", scan_cases)
    tally: dict[int, list[int]] = {}
    grid = [r for r in session.state.records("bb-grid") if r["length"] == L and r["depth"] in lost_depths]
    for r in [*grid, *scan]:
        if not r.get("error"):
            a = tally.setdefault(r["length"], [0, 0])
            a[0] += bool(r["correct"])
            a[1] += 1
    first = [by_id[r["case_id"]] for r in failing[: plan.failing_cases]]
    again = bb.send("bb-rerun", first)
    said = {r["case_id"]: r["answer"] for r in failing}
    answered = [r for r in again if not r.get("error")]
    teacher, method, note = bb.teacher_forced(first)
    ev = replace(
        ev,
        dense=_cells(dense),
        failing_length=L,
        scan=tally,
        rerun=len(answered),
        not_reproduced=sum(r["answer"] != said[r["case_id"]] for r in answered),
        teacher=tuple(teacher),
        method=method,
        method_note=note,
    )
    ctx = replace(ctx, prompt=_prompt_file(session, first[0]), needle=first[0].needle)
    if session.ledger.target.topk_endpoint is not None:
        grid_cases = [by_id[r["case_id"]] for r in session.state.records("bb-grid") if r["case_id"] in by_id]
        ev = replace(ev, topk_pair=_topk_pair(session, bb, arch, grid_cases))
    session.state.mark_done(STEP, {"evidence": ev.to_json(), "context": ctx.to_json()})
    return ev, ctx


def _topk_b(b: Blackbox, target) -> tuple[int, str]:
    """The second endpoint's top-k and where it came from: its ``/get_server_info``, else the
    ledger's ``topk_endpoint_topk``; BadInput when neither says it."""
    said = _first(b.info, ("index_topk",))
    if said is not None:
        return said, "/get_server_info"
    if target.topk_endpoint_topk is not None:
        return target.topk_endpoint_topk, "the ledger's topk_endpoint_topk"
    raise BadInput(
        f"the top-k endpoint {b.root} does not say its index_topk (no /get_server_info): set "
        "[target] topk_endpoint_topk = N, the --index-topk it was started with"
    )


def _topk_pair(session, bb: Blackbox, arch: Arch, grid_cases: list) -> TopkPair:
    """The same cases on both endpoints (``decide.blackbox_topk``): the grid's, and
    ``PAIR_CASES`` at each of ``pair_lengths`` (B dense; both selective)."""
    t = session.ledger.target
    b = Blackbox(session, t.topk_endpoint)
    b.connect(record=False)
    topk_b, source = _topk_b(b, t)
    if arch.ratio is None or arch.topk is None:
        raise BadInput(
            "the top-k pair needs the endpoint's compression ratio and index_topk: pass --config config.json "
            "(or set [target] config)"
        )
    if topk_b <= arch.topk:
        raise BadInput(
            f"topk_endpoint {b.root} serves index_topk {topk_b}, not more than the endpoint's {arch.topk}: "
            "start it with a larger --index-topk"
        )
    if b.model != bb.model:
        raise BadInput(
            f"topk_endpoint {b.root} serves {b.model!r}, the endpoint {bb.model!r}: the pair must differ "
            "only in index_topk"
        )
    depths = session.ledger.symptom.depths
    known = {c.case_id for c in grid_cases}
    extra = [
        c
        for c in bb.cases(pair_lengths(arch.ratio, arch.topk, topk_b), trials=-(-PAIR_CASES // len(depths)))
        if c.case_id not in known
    ]
    a = {r["case_id"]: r for r in [*session.state.records("bb-grid"), *bb.send("bb-topk-a", extra)]}
    b_said = b.send("bb-topk-b", [*grid_cases, *extra])
    acc: dict[int, list[int]] = {}
    errors = 0
    for r in b_said:
        ra = a.get(r["case_id"])
        if r.get("error") or ra is None or ra.get("error"):
            errors += 1  # unpaired: counted, left out of the cells
            continue
        cell = acc.setdefault(r["length"], [0, 0, 0, 0, 0])
        cell[0] += 1
        cell[1] += not ra["correct"]
        cell[2] += not r["correct"]
        cell[3] += (not ra["correct"]) and r["correct"]
        cell[4] += ra["correct"] and not r["correct"]
    return TopkPair(
        endpoint_b=b.root,
        topk_a=arch.topk,
        topk_b=topk_b,
        ratio=arch.ratio,
        source_b=source,
        cells=tuple(PairCell(length, *v) for length, v in sorted(acc.items())),
        errors=errors,
    )
