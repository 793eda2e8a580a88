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
   top-k rows are compared with the live capture per CSA layer (``compare_rows``), next to the
   *baseline*, the reference at the live ``index_topk`` with nothing added, on the same path.
5. **verdicts** by ``verdicts.live_verdict_paths`` (``live_verdict`` per path, thresholds there;
   a reproduction on the decode path only is "decode-path only"), ``verdicts.json`` (each
   suspect's ``live_paths``), ``investigation.json`` (``route = "live"``).

Comparison (per failing case, CSA layer and compared row): the Jaccard overlap of the selected
entry sets, emulation vs live and baseline vs live; and at the analysed row, the needle entries
each selected. A **selection failure** is a (case, layer) where the live selects fewer needle
entries than the baseline; the emulation **reproduces** it when it selects no more needle
entries than the live there.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from needlescope.errors import BadInput, ProbeError
from needlescope.investigate.decide.signature import NO_SIGNATURE
from needlescope.investigate.decide.verdicts import LIVE_THRESHOLDS, PATHS, evidence, live_verdict_paths
from needlescope.investigate.ledger.ledger import Suspect
from needlescope.investigate.measure.inprocess import (
    _Investigation,
    check_suspects,
    recall_by_length,
    suspect_record,
)
from needlescope.investigate.report.artifacts import relativize, write_verdicts
from needlescope.paths import atomic_write_json

__all__ = ["LiveInvestigation", "compare_rows", "jaccard"]


def jaccard(a: set[int], b: set[int]) -> float:
    """|a & b| / |a | b|; 1.0 for two empty sets."""
    return len(a & b) / len(a | b) if a | b else 1.0


def compare_rows(live: dict, emulated: dict, baseline: dict, needle: dict) -> dict:
    """Compare selections of one failing case. Each of ``live``, ``emulated``, ``baseline``
    maps a CSA layer (str) to its rows (lists of selected entries, the last one the analysed
    row); ``needle`` maps the layer to the needle entries visible at the analysed row.

    Returns {"jaccard_emulation": [float], "jaccard_baseline": [float], "points": [{"layer",
    "needle_visible", "live", "emulation", "baseline"}]} (needle entries selected per layer)."""
    out: dict = {"jaccard_emulation": [], "jaccard_baseline": [], "points": []}
    for layer, rows in live.items():
        for i, row in enumerate(rows):
            lv = set(row)
            out["jaccard_emulation"].append(jaccard(set(emulated[layer][i]), lv))
            out["jaccard_baseline"].append(jaccard(set(baseline[layer][i]), lv))
        ne = set(needle.get(layer, []))
        if ne:
            out["points"].append(
                {
                    "layer": int(layer),
                    "needle_visible": len(ne),
                    "live": len(ne & set(rows[-1])),
                    "emulation": len(ne & set(emulated[layer][-1])),
                    "baseline": len(ne & set(baseline[layer][-1])),
                }
            )
    return out


def summarise(comparisons: list[dict]) -> dict:
    """Pool ``compare_rows`` results over the failing cases into the numbers the verdict uses."""
    je = [x for c in comparisons for x in c["jaccard_emulation"]]
    jb = [x for c in comparisons for x in c["jaccard_baseline"]]
    pts = [p for c in comparisons for p in c["points"]]
    fails = [p for p in pts if p["live"] < p["baseline"]]
    return {
        "cases": len(comparisons),
        "rows": len(je),
        "jaccard_emulation": sum(je) / len(je) if je else float("nan"),
        "jaccard_baseline": sum(jb) / len(jb) if jb else float("nan"),
        "failures": len(fails),
        "reproduced": sum(1 for p in fails if p["emulation"] <= p["live"]),
        "needle_visible": sum(p["needle_visible"] for p in pts),
        "needle_live": sum(p["live"] for p in pts),
        "needle_emulation": sum(p["emulation"] for p in pts),
        "needle_baseline": sum(p["baseline"] for p in pts),
    }


async def _probe(url: str, todo: list, ids_of, max_new: int, on_record) -> None:
    """Send every case of ``todo`` to ``url``; ``on_record(case, result | error text, server
    info)`` after each. An unreachable server raises (TransportFailure) before the first case."""
    from needlescope.targets.sglang import SGLangTarget

    async with SGLangTarget(url, timeout=600.0) as target:
        info = await target.server_info()
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


class LiveInvestigation(_Investigation):
    """The live route (module docstring); shares questions, state and reporting with in-process."""

    def __init__(self, ledger, out: Path, progress):
        super().__init__(ledger, out, progress)
        self.live_k: int | None = None

    def _prompt(self, case):
        from needlescope.dsa.prompt import render_prompt

        return render_prompt(self.tokenizer, case.messages)

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
        a = analyse_answer(res.output_ids, self.tokenizer, case.expected)
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

    def probe_live(self) -> list[dict]:
        """The live endpoint on every case (resumed from ``measure/live.jsonl``; a case whose
        request failed is sent again on resume, and its later record supersedes the error)."""
        done = {r["case_id"]: r for r in self.state.records("live")}
        todo = [c for c in self.cases if c.case_id not in done or done[c.case_id].get("error")]
        self.progress("probe live", len(done), len(self.cases), self.ledger.target.endpoint)

        def on_record(case, res, info) -> None:
            if info and "server_info" not in self.state.data:
                self.state.data["server_info"] = info
                self.state.save()
            rec = self.live_record(case, res, info)
            self.state.append_record("live", rec)
            done[case.case_id] = rec
            self.progress("probe live", len(done), len(self.cases), self.ledger.target.endpoint)

        if todo:
            url, mx = self.ledger.target.endpoint, self.ledger.symptom.max_new_tokens
            try:
                asyncio.run(_probe(url, todo, lambda c: self._prompt(c).input_ids, mx, on_record))
            except ProbeError as exc:  # the endpoint is unreachable: every emulation is blocked
                self.blocked_reason = f"live endpoint unavailable: {type(exc).__name__}: {exc}"
        return [done[c.case_id] for c in self.cases if c.case_id in done]

    @property
    def csa_layers(self) -> list[int]:
        from needlescope.dsa.emulate import csa_indexers

        return [layer for layer, _ in csa_indexers(self.model)]

    def emulate_rows(self, config, failing: list[dict], path: str = "prefill") -> dict[str, dict]:
        """case id -> CSA layer (str) -> top-k rows of ``config`` at the live record's rows, on the
        live token ids (the prompt plus the live answer tokens before the analysed one), the
        config applied once. ``path``: ``prefill`` runs them teacher-forced (one pass, or the
        ledger's ``prefill_chunk`` chunks through the cache); ``decode`` the way the server did,
        the prompt prefilled into the cache and the answer tokens fed one per forward."""
        import torch

        from needlescope.dsa import passes
        from needlescope.dsa.emulate import IndexerCapture
        from needlescope.investigate.measure.records import applied

        by_id = {c.case_id: c for c in self.cases}
        capture = IndexerCapture()
        dev = next(self.model.parameters()).device
        out: dict[str, dict] = {}
        with applied(self.model, config, capture) as layers, torch.no_grad():
            for rec in failing:
                prompt = self._prompt(by_id[rec["case_id"]]).input_ids
                answer = rec["output_ids"][: rec["analysed_token"]]
                capture.clear()
                if path == "decode":
                    run = passes.prefill(
                        self.model, torch.tensor([prompt], device=dev), chunk=self.chunk, keep_cache=True
                    )
                    if answer:
                        passes.decode(self.model, torch.tensor([answer], device=dev), run.cache, logits_at=())
                else:
                    passes.prefill(self.model, torch.tensor([prompt + answer], device=dev), chunk=self.chunk)
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
        from needlescope.dsa.prompt import covering_entries, needle_token_span

        case = next(c for c in self.cases if c.case_id == rec["case_id"])
        from needlescope.dsa.emulate import csa_indexers

        ratio = int(csa_indexers(self.model)[0][1].compress_rate)
        entries = covering_entries(
            needle_token_span(self._prompt(case), case.needle), ratio=ratio, overlap=True
        )
        visible = (rec["prompt_tokens"] + rec["analysed_token"]) // ratio
        return {layer: [e for e in entries if e < visible] for layer in rec["rows"]}

    def at_live_k(self, config):
        return self.Config(config.setting.with_(index_topk=self.live_k), config.extra)

    def server_differences(self) -> None:
        """Add the live server's ``/get_server_info`` differences from the reference (and an
        automatic suspect for each one no ledger suspect covers)."""
        from needlescope.investigate.ledger.differences import auto_suspects, server_info_differences

        info = self.state.data.get("server_info")
        if not info or self._model is None:
            return
        topk = int(self.model.config.index_topk)
        found = server_info_differences(info, self.reference.setting, topk, self.ledger.suspects)
        self.diffs += found
        autos = auto_suspects(found, self.ledger)
        self.suspects += autos
        self.state.ensure_suspects([s.id for s in autos])

    def check_live(self, s: Suspect, failing: list[dict], baseline: dict) -> dict:
        absent_q = self.state.data.get("absent", {}).get(s.id)
        questions = self.question_summary(s.id) or "none asked"
        if s.id.startswith("auto:") and not s.checks:
            return suspect_record(
                s,
                "blocked",
                "not testable against a live endpoint: no emulation reproduces this difference",
                present=True,
            )
        if absent_q is not None:
            reason = f"not in the deployment: {absent_q} (cheap questions: {questions})"
            return suspect_record(s, "exonerated", reason, present=False)
        if "live_emulation" not in s.checks:
            reason = (
                "no live_emulation check asked for; a live endpoint cannot be ablated and the cheap "
                f"questions alone do not decide (cheap questions: {questions})"
            )
            return suspect_record(s, "inconclusive", reason, present=None)
        if self._model is None or self.live_k is None:
            return suspect_record(s, "blocked", f"live_emulation: {self.blocked_reason}", present=None)
        config = self.at_live_k(self.addition(s))
        self.configs[f"emulate-{s.id}"] = config.to_json()
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
        verdict, reason, decided_by = live_verdict_paths(cmps)
        cmp = cmps[decided_by]
        self.state.add_evidence(s.id, _live_evidence(config, cmps, decided_by))
        return suspect_record(
            s, verdict, reason, present=None, live=cmp, live_paths={**cmps, "decided_by": decided_by}
        )

    def run(self, loaded=None) -> Path:
        st = self.state
        if not st.is_done("questions"):
            self.questions()
            st.mark_done("questions")
        self.load(loaded)
        ref_records, live_records, failing, baseline = [], [], [], {}
        if self._model is not None:
            ref_records = self.measure("reference", self.reference)
            live_records = self.probe_live()
            ok = {r["case_id"] for r in ref_records if r["correct"]}
            scored = [r for r in live_records if not r.get("error")]
            failing = [r for r in scored if not r["correct"] and r["case_id"] in ok]
            if scored:
                self.live_k = scored[0]["index_topk"]
                base = self.at_live_k(self.reference)
                self.configs["baseline"] = base.to_json()
                baseline = {path: self.emulate_rows(base, failing, path) for path in PATHS}
            elif self.blocked_reason is None:
                self.blocked_reason = (
                    "the live endpoint answered no case (every request failed; see measure/live.jsonl)"
                )
        self.server_differences()
        suspects_out = check_suspects(self, self.suspects, lambda s: self.check_live(s, failing, baseline))
        implicated = sorted(
            (s for s in suspects_out if s["verdict"] == "implicated"), key=lambda s: -gap_closed(s["live"])
        )
        root = implicated[0]["id"] if implicated else None
        symptom = {
            **self.ledger.symptom.to_json(),
            "reference": self.reference.label(),
            "candidate": f"live endpoint {self.ledger.target.endpoint}",
            "recall_reference": recall_by_length(ref_records),
            "recall_candidate": recall_by_length(live_records),
            "cases": len(live_records),
            "errors": sum(1 for r in live_records if r.get("error")),
            "failing_cases": len(failing),
            "live_index_topk": self.live_k,
        }
        loc = (
            live_localization(failing, baseline.get("prefill", {}), self.needle_entries)
            if root is None
            else None
        )
        if loc is not None:
            loc["command"] = f"needlescope investigate run {self.ledger.path.name} --out {self.out.name}"
        verdicts = write_verdicts(self, symptom, root, NO_SIGNATURE, suspects_out, localization=loc)
        atomic_write_json(
            self.out / "investigation.json",
            relativize(
                {
                    "route": "live",
                    "ledger": self.ledger.path.name,
                    "target": {
                        "model": self.ledger.target.model,
                        "device": self.ledger.target.device,
                        "endpoint": self.ledger.target.endpoint,
                    },
                    "symptom": symptom,
                    "configs": self.configs,
                    "candidate_topk": self.live_k,
                    "suspects": suspects_out,
                    "fixes": [],
                    "explained": None,
                    "verdicts": verdicts,
                },
                self.path_map(),
            ),
        )
        self.progress("verdicts", 1, 1, "")
        return self.out / "verdicts.json"


DEPARTS = 0.99
"""A CSA layer's selection departs from the reference's when their mean Jaccard is below this."""


def live_localization(failing: list[dict], baseline: dict, needle_of) -> dict | None:
    """``localization`` of a live run: the live and the reference (at the live ``index_topk``)
    selections compared CSA layer by CSA layer over the failing cases; the first layer whose mean
    Jaccard falls below ``DEPARTS`` is where the selection departs. ``needle_of(record)`` gives
    the needle entries per layer at the analysed row."""
    if not failing:
        return None
    per: dict[int, dict] = {}
    for r in failing:
        needle = needle_of(r)
        for layer, rows in r["rows"].items():
            base = baseline[r["case_id"]][layer]
            a = per.setdefault(int(layer), {"j": [], "visible": 0, "live": 0, "ref": 0})
            a["j"] += [jaccard(set(x), set(y)) for x, y in zip(rows, base)]
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
    first = next(
        (ly["layer"] for ly in layers if ly["topk_overlap"] is not None and ly["topk_overlap"] < DEPARTS),
        None,
    )
    summary = (
        f"the live selection departs from the reference's first in CSA layer {first}"
        if first is not None
        else "the live selections match the reference's in every CSA layer"
    )
    path = {
        "path": "decode",
        "diverges": first is not None,
        "first_divergent_module": None,
        "module_type": "DeepseekV4Indexer" if first is not None else None,
        "layer": first,
        "own_err": None,
        "own_budget": None,
        "first_departing_layer": first,
        "layers": layers,
        "summary": summary,
    }
    r0 = failing[0]
    return {
        "case_id": r0["case_id"],
        "target": "the live endpoint",
        "config": "live endpoint",
        "analysed_token": r0["analysed_token"],
        "query_pos": r0["prompt_tokens"] - 1 + r0["analysed_token"],
        "paths": [path],
        "diverges_first": "decode" if first is not None else "neither",
        "summary": summary + f" (over {len(failing)} failing case(s), the server's own decode path)",
        "command": "",
    }


def _live_evidence(config, cmps: dict[str, dict], decided_by: str) -> list[dict]:
    """Evidence records of a suspect's live emulation: the deciding path's numbers, then both paths'."""
    cmp, t = cmps[decided_by], LIVE_THRESHOLDS
    return [
        evidence("live_emulation", f"emulated: `{config.label()}`; failing cases compared", cmp["cases"]),
        evidence(
            "live_emulation",
            "selection failures (live selects fewer needle entries than the baseline)",
            cmp["failures"],
            t["min_failures"],
        ),
        evidence(
            "live_emulation",
            "failures the emulation reproduces (fraction)",
            _frac(cmp),
            t["reproduce"],
        ),
        evidence("live_emulation", "Jaccard emulation vs live (mean over rows)", cmp["jaccard_emulation"]),
        evidence("live_emulation", "Jaccard baseline vs live (mean over rows)", cmp["jaccard_baseline"]),
        evidence(
            "live_emulation",
            "share of the baseline's Jaccard gap the emulation closes",
            gap_closed(cmp),
            t["gap_closed"],
        ),
        evidence(
            "live_emulation",
            f"needle entries selected at the analysed rows, of {cmp['needle_visible']} visible: live",
            cmp["needle_live"],
        ),
        evidence("live_emulation", "needle entries selected: emulation", cmp["needle_emulation"]),
        evidence("live_emulation", "needle entries selected: baseline", cmp["needle_baseline"]),
        evidence("live_emulation", "path whose comparison decides (prefill | decode)", decided_by),
        *(
            evidence(
                "live_emulation",
                f"{path} path: failures the emulation reproduces (fraction)",
                _frac(c),
            )
            for path, c in cmps.items()
        ),
        *(
            evidence("live_emulation", f"{path} path: Jaccard emulation vs live", c["jaccard_emulation"])
            for path, c in cmps.items()
        ),
    ]


def _frac(cmp: dict) -> float:
    return cmp["reproduced"] / cmp["failures"] if cmp["failures"] else float("nan")


def gap_closed(cmp: dict) -> float:
    """(J_emulation - J_baseline) / (1 - J_baseline): how much of the baseline's disagreement
    with the live selection the emulation explains (1 = identical to the live selection)."""
    je, jb = cmp["jaccard_emulation"], cmp["jaccard_baseline"]
    return (je - jb) / (1 - jb) if jb < 1 else float("nan")
