"""The live-endpoint route: when the candidate is a running server, nothing can be ablated, so a
suspect is judged by whether its emulation in the reference reproduces the live selection failure.

A ledger with ``candidate = "live"`` and an ``endpoint`` takes this route
(``investigate.run.run_investigation``). Steps, each resumable from the run directory:

1. **questions**, as in-process.
2. **symptom**: every case is sent to the live endpoint as ``input_ids`` (rendered with the
   reference checkpoint's tokenizer) on ``/generate`` with ``return_indexer_topk``, greedy; its
   answer is scored and its indexer top-k kept at the rows that produced the answer up to the
   first wrong answer token (``measure/live.jsonl``). A failure of the endpoint is recorded as
   an error, never scored as a miss. The reference runs in-process on the same cases.
3. **failing cases**: wrong live, right under the reference.
4. **per suspect** with ``live_emulation`` (tier order): the reference at the live
   ``index_topk`` with the suspect added alone is run on the *same token ids* (the prompt plus
   the live answer tokens up to the analysed one) on both paths: teacher-forced (``prefill``:
   one pass, or the ledger's ``prefill_chunk`` chunks) and the way the server ran them
   (``decode``: the prompt prefilled into the cache, the answer tokens one per forward); its
   top-k rows are compared with the live capture per CSA layer (``decide.live.compare_rows``), next to the
   *baseline*, the reference at the live ``index_topk`` with nothing added, on the same path.
5. **verdicts** by ``decide.live.decide_live`` (``verdicts.live_verdict_paths`` (``live_verdict`` per path, thresholds there;
   a reproduction on the decode path only is "decode-path only")), ``verdicts.json`` (each
   suspect's ``live_paths``), ``investigation.json`` (``route = "live"``).

The comparisons and the verdicts are ``decide.live``'s; this module measures (``LiveRoute``
holds a ``session.Session``, as the in-process route does).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass

from needlescope.analysis.stats import jaccard
from needlescope.cases.scoring import prompt_rivals
from needlescope.errors import BadInput, ProbeError
from needlescope.investigate.decide.decision import characterization_needed
from needlescope.investigate.decide.live import compare_rows, decide_live, live_root_cause, summarise
from needlescope.investigate.decide.measured import Measured
from needlescope.investigate.decide.verdicts import PATHS
from needlescope.investigate.ledger.differences import AUTO_PREFIX, auto_suspects, server_info_differences
from needlescope.investigate.ledger.ledger import Suspect
from needlescope.investigate.ledger.plan import Config, at_topk
from needlescope.investigate.measure.server_identity import check_same_server
from needlescope.investigate.measure.session import Session, measure_suspects, suspect_identity

__all__ = ["measure", "LiveRoute", "LiveSymptom", "live_localization"]


async def _probe(url: str, api_key: str | None, todo: list, ids_of, max_new: int, on_record, on_info) -> None:
    """Send every case of ``todo`` to ``url``; ``on_info(server info)`` first (it may refuse the
    server), ``on_record(case, result | error text, server info)`` after each. An unreachable
    server raises (TransportFailure) before the first case."""
    from needlescope.targets.sglang import SGLangTarget

    async with SGLangTarget(url, timeout=600.0, api_key=api_key) as target:
        info = await target.server_info()
        on_info(info)
        for case in todo:
            try:
                res = await target.generate(input_ids=ids_of(case), max_new_tokens=max_new)
                if res.output_ids is None:
                    raise ProbeError(
                        f"{url}/generate returned no output_ids: the live tokens cannot be replayed"
                    )
            except ProbeError as exc:
                res = f"{type(exc).__name__}: {exc}"
            on_record(case, res, info)


@dataclass(frozen=True)
class LiveSymptom:
    """The live route's symptom: ``reference`` (the reference's case records, in-process),
    ``live`` (the endpoint's, errors included), ``failing`` (wrong live, right under the
    reference) and ``baseline``: path -> case id -> CSA layer -> the rows of the reference at the
    live ``index_topk`` on the failing cases' live token ids."""

    reference: list[dict]
    live: list[dict]
    failing: list[dict]
    baseline: dict


class LiveRoute:
    """The live route's measurements on a ``Session`` (module docstring); no verdicts."""

    def __init__(self, session: Session):
        self.session = session
        self.live_k: int | None = None

    def _prompt(self, case):
        from needlescope.dsa.prompt import render_prompt

        return render_prompt(self.session.tokenizer, case.messages)

    def live_record(self, case, res, info: dict | None) -> dict:
        """One ``live.jsonl`` record: the scored answer and the live top-k rows to compare."""
        from needlescope.dsa.capture import decode_capture
        from needlescope.investigate.measure.records import analyse_answer
        from needlescope.targets.sglang import find_key

        base = {
            "case_id": case.case_id,
            "length": case.length,
            "depth": float(case.depth),
            "trial": case.trial,
        }
        if isinstance(res, str):
            return {**base, "error": res}
        rivals = prompt_rivals(case.messages, case.expected)
        a = analyse_answer(res.output_ids, self.session.tokenizer, case.expected, rivals)
        rows = res.prompt_tokens + res.completion_tokens - 1
        layers = self.csa_layers
        try:
            topk = decode_capture(
                res.indexer_topk, rows, num_layers=len(layers), index_topk=find_key(info or {}, "index_topk")
            )
        except (ProbeError, BadInput) as exc:
            return {**base, "error": f"{type(exc).__name__}: {exc}"}
        first = res.prompt_tokens - 1
        keep = range(first, min(first + a["analysed_token"] + 1, rows))
        return {
            **base,
            "prompt_tokens": res.prompt_tokens,
            "expected": list(case.expected),
            "answer": a["answer"],
            "correct": a["correct"],
            "output_ids": a["generated"],
            "analysed_token": a["analysed_token"],
            "analysed_source": a["analysed_source"],
            "index_topk": int(topk.shape[2]),
            "rows": {
                str(layer): [[int(e) for e in topk[t, j] if e >= 0] for t in keep]
                for j, layer in enumerate(layers)
            },
        }

    def probe_live(self, name: str = "live", cases=None) -> list[dict]:
        """The live endpoint on every case (of the ledger, or ``cases``; resumed from
        ``measure/NAME.jsonl``; a case whose request failed is sent again on resume, and its later
        record supersedes the error)."""
        ss = self.session
        cases = ss.cases if cases is None else cases
        done = {r["case_id"]: r for r in ss.state.records(name)}
        todo = [c for c in cases if c.case_id not in done or done[c.case_id].get("error")]
        ss.progress("probe live", len(done), len(cases), ss.ledger.target.endpoint)

        def on_info(info) -> None:  # a resumed run: the same server, whatever its port
            if info:
                check_same_server(ss.state.server_info or None, info, ss.ledger.target.endpoint)

        def on_record(case, res, info) -> None:
            if info:
                ss.state.set_server_info(info)
            rec = self.live_record(case, res, info)
            ss.state.append_record(name, rec)
            done[case.case_id] = rec
            ss.progress("probe live", len(done), len(cases), ss.ledger.target.endpoint)

        if todo:
            url, mx = ss.ledger.target.endpoint, ss.ledger.symptom.max_new_tokens
            try:
                asyncio.run(
                    _probe(
                        url,
                        self.session.api_key,
                        todo,
                        lambda c: self._prompt(c).input_ids,
                        mx,
                        on_record,
                        on_info,
                    )
                )
            except ProbeError as exc:  # the endpoint is unreachable: every emulation is blocked
                ss.blocked_reason = f"live endpoint unavailable: {type(exc).__name__}: {exc}"
        return [done[c.case_id] for c in cases if c.case_id in done]

    @property
    def csa_layers(self) -> list[int]:
        from needlescope.dsa.emulate import csa_indexers

        return [layer for layer, _ in csa_indexers(self.session.model)]

    def emulate_rows(self, config: Config, failing: list[dict], path: str = "prefill") -> dict[str, dict]:
        """case id -> CSA layer (str) -> top-k rows of ``config`` at the live record's rows, on the
        live token ids (the prompt plus the live answer tokens before the analysed one), the
        config applied once. ``path``: ``prefill`` runs them teacher-forced (one pass, or the
        ledger's ``prefill_chunk`` chunks through the cache); ``decode`` the way the server did,
        the prompt prefilled into the cache and the answer tokens fed one per forward."""
        import torch

        from needlescope.dsa import passes
        from needlescope.dsa.emulate import IndexerCapture
        from needlescope.investigate.measure.records import applied

        ss = self.session
        model, chunk = ss.model, ss.chunk
        by_id = {c.case_id: c for c in ss.cases}
        capture = IndexerCapture()
        dev = next(model.parameters()).device
        out: dict[str, dict] = {}
        with applied(model, config, capture) as layers, torch.no_grad():
            for rec in failing:
                prompt = self._prompt(by_id[rec["case_id"]]).input_ids
                answer = rec["output_ids"][: rec["analysed_token"]]
                capture.clear()
                if path == "decode":
                    run = passes.prefill(
                        model, torch.tensor([prompt], device=dev), chunk=chunk, keep_cache=True
                    )
                    if answer:
                        passes.decode(model, torch.tensor([answer], device=dev), run.cache, logits_at=())
                else:
                    passes.prefill(model, torch.tensor([prompt + answer], device=dev), chunk=chunk)
                first = rec["prompt_tokens"] - 1
                n = len(next(iter(rec["rows"].values())))
                out[rec["case_id"]] = {
                    str(layer): [
                        [int(e) for e in row if e >= 0]
                        for row in capture.rows(layer, width=rec["index_topk"])[1][first : first + n].tolist()
                    ]
                    for layer in layers
                }
        return out

    def needle_entries(self, rec: dict) -> dict[str, list[int]]:
        """CSA layer (str) -> needle entries visible at the analysed row of ``rec``."""
        from needlescope.dsa.emulate import csa_indexers
        from needlescope.dsa.prompt import covering_entries, needle_token_span
        from needlescope.dsa.reference import visible_entries

        case = next(c for c in self.session.cases if c.case_id == rec["case_id"])
        ratio = int(csa_indexers(self.session.model)[0][1].compress_rate)
        entries = covering_entries(
            needle_token_span(self._prompt(case), case.needle), ratio=ratio, overlap=True
        )
        visible = visible_entries(rec["prompt_tokens"] - 1 + rec["analysed_token"], ratio)
        return {layer: [e for e in entries if e < visible] for layer in rec["rows"]}

    def server_differences(self) -> None:
        """Add the live server's ``/get_server_info`` differences from the reference (and an
        automatic suspect for each one no ledger suspect covers)."""
        ss = self.session
        info = ss.state.server_info
        if not info or not ss.loaded:
            return
        topk = int(ss.model.config.index_topk)
        found = server_info_differences(info, ss.reference.setting, topk, ss.ledger.suspects)
        ss.diffs += found
        autos = auto_suspects(found, ss.ledger)
        ss.suspects += autos
        ss.state.ensure_suspects([s.id for s in autos])

    def measure_symptom(self) -> LiveSymptom:
        """The reference in-process and the live endpoint on every case; the failing cases (wrong
        live, right under the reference); the reference at the live ``index_topk`` on them."""
        ss = self.session
        ref_records, live_records, failing, baseline = [], [], [], {}
        if ss.loaded:
            live_records = self.probe_live()  # first: an endpoint that answers nothing stops the run
            scored = [r for r in live_records if not r.get("error")]
            if not scored:
                raise BadInput(self._nothing_answered(live_records))
            ref_records = ss.measure("reference", ss.reference)
            ok = {r["case_id"] for r in ref_records if r["correct"]}
            failing = [r for r in scored if not r["correct"] and r["case_id"] in ok]
            self.live_k = scored[0]["index_topk"]
            base = at_topk(ss.reference, self.live_k)
            ss.note_config("baseline", base)
            baseline = {path: self.emulate_rows(base, failing, path) for path in PATHS}
        self.server_differences()
        return LiveSymptom(ref_records, live_records, failing, baseline)

    def _nothing_answered(self, live_records: list[dict]) -> str:
        """What stops a run whose endpoint scored no case: why, and what to do."""
        why = self.session.blocked_reason or (
            f"every request failed, the first with {live_records[0]['error']}"
            if live_records
            else "no case was sent"
        )
        return (
            f"the live endpoint {self.session.ledger.target.endpoint} answered no case ({why}); nothing "
            "was decided: fix the endpoint and run again (measure/live.jsonl keeps what it answered)"
        )

    def measure_suspect(self, s: Suspect, failing: list[dict], baseline: dict) -> dict:
        """The measured record of ``s``: why it was not emulated, or its emulation (the reference
        at the live ``index_topk`` with ``s`` added alone) compared with the live capture on both
        paths (``cmps``). ``decide.live.decide_live`` decides its verdict."""
        ss = self.session
        absent_q = ss.absent_by_question(s.id)
        m = {
            **suspect_identity(s),
            "untestable": s.id.startswith(AUTO_PREFIX) and not s.checks,
            "absent_by_question": absent_q,
            "questions": ss.question_summary(s.id),
            "asked": "live_emulation" in s.checks,
            "blocked": ss.blocked_reason,
            "emulated": None,
            "cmps": None,
        }
        if m["untestable"] or absent_q is not None or not m["asked"] or not ss.loaded or self.live_k is None:
            return m
        config = at_topk(ss.addition(s), self.live_k)
        ss.note_config(f"emulate-{s.id}", config)
        cmps = {}
        for path in PATHS:
            rows = self.emulate_rows(config, failing, path)
            cmps[path] = summarise(
                [
                    compare_rows(
                        r["rows"], rows[r["case_id"]], baseline[path][r["case_id"]], self.needle_entries(r)
                    )
                    for r in failing
                ]
            )
        return {**m, "emulated": config.label(), "cmps": cmps}


def live_localization(failing: list[dict], baseline: dict, needle_of, command: str) -> dict | None:
    """The measured localization of a live run: the live and the reference (at the live
    ``index_topk``) selections compared CSA layer by CSA layer over the failing cases (mean
    Jaccard, needle entries kept); ``decide.localization`` says where the selection departs.
    ``needle_of(record)`` gives the needle entries per layer at the analysed row."""
    if not failing:
        return None
    per: dict[int, dict] = {}
    for r in failing:
        needle = needle_of(r)
        for layer, rows in r["rows"].items():
            base = baseline[r["case_id"]][layer]
            a = per.setdefault(int(layer), {"j": [], "visible": 0, "live": 0, "ref": 0})
            a["j"] += [jaccard(x, y) for x, y in zip(rows, base)]
            ne = set(needle.get(layer, []))
            a["visible"] += len(ne)
            a["live"] += len(ne & set(rows[-1]))
            a["ref"] += len(ne & set(base[-1]))
    layers = [
        {
            "layer": layer,
            "topk_overlap": sum(a["j"]) / len(a["j"]) if a["j"] else None,
            "needle_visible": a["visible"],
            "needle_kept_reference": a["ref"] > 0 if a["visible"] else None,
            "needle_kept_candidate": a["live"] > 0 if a["visible"] else None,
        }
        for layer, a in sorted(per.items())
    ]
    r0 = failing[0]
    return {
        "route": "live",
        "case_id": r0["case_id"],
        "analysed_token": r0["analysed_token"],
        "query_pos": r0["prompt_tokens"] - 1 + r0["analysed_token"],
        "failing_cases": len(failing),
        "layers": layers,
        "command": command,
    }


def measure(session: Session) -> Measured:
    """Every live-route measurement of the run (module docstring), resumable."""
    from needlescope.investigate.measure.characterize import measure_characterization_live
    from needlescope.investigate.measure.serving_factors import measure_live_serving_factor

    route = LiveRoute(session)
    sy = route.measure_symptom()
    # the failing cases' answers and captures: a rerun that got more answers measures again
    basis = hashlib.sha256(json.dumps([route.live_k, sy.failing], sort_keys=True).encode()).hexdigest()
    measured = measure_suspects(session, lambda s: route.measure_suspect(s, sy.failing, sy.baseline), basis)
    # whether to characterize follows from the decisions: ``decide`` states the rule
    decided = [decide_live(m) for m in measured]
    root = live_root_cause(decided)
    char = None
    if route.live_k is not None and characterization_needed("live", sy.reference, sy.live, decided, root):
        char = measure_characterization_live(session, route, sy.reference, sy.live, sy.failing, sy.baseline)
    factor = None
    if root is None and route.live_k is not None:  # --serving-factors: the serving state of a loss
        lengths = sorted({r["length"] for r in sy.failing}) or sorted({r["length"] for r in sy.live})
        served = str(session.state.server_info.get("model") or "organism")
        factor = measure_live_serving_factor(session, served, lengths)
    t = session.ledger.target
    command = f"needlescope investigate run {session.ledger.path.name} --out {session.out.name}"
    return session.measured(
        measured,
        route="live",
        target={"model": t.model, "device": t.device, "endpoint": t.endpoint},
        candidate_label=f"live endpoint {t.endpoint}",
        reference_records=sy.reference,
        candidate_records=sy.live,
        candidate_topk=route.live_k,
        symptom_extra={
            "errors": sum(1 for r in sy.live if r.get("error")),
            "failing_cases": len(sy.failing),
            "live_index_topk": route.live_k,
        },
        localization=live_localization(
            sy.failing, sy.baseline.get("prefill", {}), route.needle_entries, command
        ),
        characterization=char,
        serving_factor=factor,
    )
