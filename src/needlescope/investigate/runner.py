"""``run_investigation(ledger, out)``: cheap questions, then the symptom, then checks in tier
order, then the fixes, the signature and the verdicts, all resumable from ``out``.

Steps (each recorded in ``state.json`` as it finishes; see ``state.RunState``):

1. **questions**: every suspect's cheap questions, tier order; answers are evidence.
2. **symptom**: the reference and the candidate on the ledger's probe cases, in-process on the
   reference checkpoint (``measure.measure_case``); recall per length.
3. **checks**, tier order, per suspect: its audit checks (``needlescope.audit``) and its
   ablation (remove it from the candidate when present, else add it alone to the reference;
   paired on the same cases) plus the divergence of the final logits when added alone to the
   reference; then its verdict (``verdicts.suspect_verdict``).
4. **fixes**: each present suspect's removal, and the candidate at twice its ``index_topk``;
   each paired with the candidate.
5. **verdicts**: signature (``signature.signature``), root cause, fix labels;
   ``verdicts.json`` (``verdicts.VERDICTS_SCHEMA``) and ``investigation.json`` (everything
   the report needs, ``INVESTIGATION_KEYS``).

A missing checkpoint blocks every model check (with the reason); questions still run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from needlescope.errors import BadInput
from needlescope.investigate.ledger import Ledger, Suspect, load_ledger
from needlescope.investigate.questions import QuestionContext, answer
from needlescope.investigate.signature import signature
from needlescope.investigate.state import RunState, atomic_write_json
from needlescope.investigate.verdicts import (
    classify_fix,
    evidence,
    paired,
    resolve_root_cause,
    suspect_verdict,
    validate_verdicts,
)
from needlescope.setting import Setting

__all__ = ["run_investigation", "INVESTIGATION_KEYS", "PHASES"]

BATCH = 8
"""Cases of one prompt length decoded together (unpadded batches; same answers as one at a time)."""
PHASES = ("questions", "symptom", "checks", "fixes", "verdicts")
INVESTIGATION_KEYS = ("ledger", "target", "symptom", "configs", "suspects", "fixes", "explained", "verdicts")
Progress = Callable[[str, int, int, str], None]


def _present(s: Suspect, cand: Setting, extra, ref: Setting) -> bool:
    if s.patch is not None:
        specs = {p.path for p in extra} | ({cand.patch.path} if cand.patch else set())
        return s.patch.path in specs
    return all(getattr(cand, f) == v for f, v in s.setting_fields) and any(
        getattr(ref, f) != v for f, v in s.setting_fields
    )


def _recall_by_length(records: list[dict]) -> dict[str, float]:
    agg: dict[int, list[int]] = {}
    for r in records:
        a = agg.setdefault(r["length"], [0, 0])
        a[0] += r["correct"]
        a[1] += 1
    return {str(n): a[0] / a[1] for n, a in sorted(agg.items())}


class _Investigation:
    def __init__(self, ledger: Ledger, out: Path, progress: Progress):
        from needlescope.investigate.measure import Config

        self.ledger, self.out, self.progress = ledger, Path(out), progress
        self.state = RunState(
            self.out, ledger.path.read_text(encoding="utf-8"), [s.id for s in ledger.suspects]
        )
        t = ledger.target
        self.Config = Config
        self.reference = Config(t.reference)
        self.candidate = Config(t.candidate, t.extra_patches)
        self.configs: dict[str, dict] = {
            "reference": self.reference.to_json(),
            "candidate": self.candidate.to_json(),
        }
        self.model = self.tokenizer = self.cases = None
        self.blocked_reason: str | None = None

    # -- model and cases -------------------------------------------------------------
    def load(self, loaded=None) -> None:
        import torch

        from needlescope.cases.assemble import CaseSpec, build_cases
        from needlescope.dsa.checkpoint import load_bundle, resolve_model_dir, trained_value_digits
        from needlescope.dsa.prompt import render_prompt

        t, sy = self.ledger.target, self.ledger.symptom
        try:
            path = resolve_model_dir(t.model)
        except BadInput as exc:
            self.blocked_reason = f"reference checkpoint unavailable: {exc}"
            return
        torch.set_num_threads(t.threads)
        self.model, self.tokenizer = loaded if loaded is not None else load_bundle(path, device=t.device)[:2]
        spec = CaseSpec(
            kind=sy.kind,
            lengths=sy.lengths,
            depths=sy.depths,
            trials=sy.trials,
            seed=sy.seed,
            value_digits=trained_value_digits(path),
        )
        self.cases = build_cases(spec, lambda m: len(render_prompt(self.tokenizer, m).input_ids))
        self.prompt_len = {
            c.case_id: len(render_prompt(self.tokenizer, c.messages).input_ids) for c in self.cases
        }

    def measure(self, name: str, config) -> list[dict]:
        from needlescope.investigate.measure import measure_cases

        self.configs[name] = config.to_json()
        # A configuration already measured under another name (a removal that equals the
        # reference, say) is not measured twice: its records are copied.
        same = [n for n, c in self.configs.items() if n != name and c["label"] == config.label()]
        done = {r["case_id"]: r for r in self.state.records(name)}
        if same and not done:
            for r in self.state.records(same[0]):
                self.state.append_record(name, r)
            done = {r["case_id"]: r for r in self.state.records(name)}
        todo: dict[int, list] = {}
        for case in self.cases:
            if case.case_id not in done:
                todo.setdefault(self.prompt_len[case.case_id], []).append(case)
        self.progress(f"measure {name}", len(done), len(self.cases), config.label())
        for _, group in sorted(todo.items()):
            for i in range(0, len(group), BATCH):
                recs = measure_cases(
                    self.model,
                    self.tokenizer,
                    group[i : i + BATCH],
                    config,
                    max_new_tokens=self.ledger.symptom.max_new_tokens,
                )
                for rec in recs:
                    self.state.append_record(name, rec)
                    done[rec["case_id"]] = rec
                self.progress(f"measure {name}", len(done), len(self.cases), config.label())
        return [done[c.case_id] for c in self.cases]

    @staticmethod
    def correct(records: list[dict]) -> dict[str, bool]:
        return {r["case_id"]: r["correct"] for r in records}

    # -- suspects ----------------------------------------------------------------------
    def removal(self, s: Suspect):
        c, ref = self.candidate, self.ledger.target.reference
        if s.patch is not None:
            if c.setting.patch is not None and c.setting.patch.path == s.patch.path:
                return self.Config(c.setting.with_(patch=None), c.extra)
            return self.Config(c.setting, tuple(p for p in c.extra if p.path != s.patch.path))
        return self.Config(c.setting.with_(**{f: getattr(ref, f) for f, _ in s.setting_fields}), c.extra)

    def addition(self, s: Suspect):
        r = self.reference
        if s.patch is not None:
            indexer_patch = s.patch.is_fault or (
                self.candidate.setting.patch is not None and self.candidate.setting.patch.path == s.patch.path
            )
            if indexer_patch and r.setting.patch is None:
                return self.Config(r.setting.with_(patch=s.patch), r.extra)
            return self.Config(r.setting, (*r.extra, s.patch))
        return self.Config(r.setting.with_(**dict(s.setting_fields)), r.extra)

    def questions(self) -> None:
        t = self.ledger.target
        ctx = QuestionContext(
            base=self.ledger.path.parent,
            checkpoint=self._checkpoint_dir(),
            endpoint=t.endpoint,
            env_file=t.env_file,
        )
        suspects = self.ledger.ordered_suspects()
        for n, s in enumerate(suspects):
            for q in s.questions:
                a = answer(q, ctx)
                what = f"{q.type} {' '.join(f'{k}={v}' for k, v in q.params.items())}"
                if a.ok:
                    ev = evidence(f"question:{q.type}", f"{what} ({a.detail})", a.value)
                    if q.expect is not None:
                        ev["metric"] += f"; expected {q.expect}: {'yes' if a.value == q.expect else 'no'}"
                    if q.means_absent is not None and a.value == q.means_absent:
                        self.state.data.setdefault("absent", {})[s.id] = f"{what} answered {a.value!r}"
                else:
                    ev = evidence(f"question:{q.type}", what, f"blocked: {a.blocked}")
                self.state.add_evidence(s.id, [ev])
            self.progress("questions", n + 1, len(suspects), s.id)

    def _checkpoint_dir(self) -> Path | None:
        from needlescope.dsa.checkpoint import resolve_model_dir

        try:
            return resolve_model_dir(self.ledger.target.model)
        except BadInput:
            return None

    def check_suspect(self, s: Suspect, ref_records, cand_records, probe_case) -> dict:
        from needlescope.audit.checks import run_check
        from needlescope.dsa.prompt import render_prompt
        from needlescope.investigate.measure import applied, final_logits

        present = _present(s, self.candidate.setting, self.candidate.extra, self.reference.setting)
        blocked, ran = [], 0
        absent_q = self.state.data.get("absent", {}).get(s.id)
        pair = divergence = None
        if absent_q is None:
            for check in s.checks:
                if self.model is None:
                    blocked.append(f"{check}: {self.blocked_reason}")
                    continue
                if check.startswith("audit:"):
                    name = check.split(":", 1)[1]
                    import torch

                    ids = torch.tensor([render_prompt(self.tokenizer, probe_case.messages).input_ids])

                    def apply_candidate(model):
                        cm = applied(model, self.candidate)
                        cm.__enter__()
                        return lambda: cm.__exit__(None, None, None)

                    res = run_check(
                        name,
                        self.model,
                        ids,
                        {
                            "candidate_topk": cand_records[0]["index_topk"],
                            "reference_records": ref_records,
                            "apply_candidate": apply_candidate,
                        },
                    )
                    self.state.add_evidence(
                        s.id,
                        [evidence(check, m["metric"], m["value"], m["threshold"]) for m in res["metrics"]]
                        + [evidence(check, f"flagged ({res['why']})", "yes" if res["flagged"] else "no")],
                    )
                    ran += 1
                elif check == "ablation":
                    if present:
                        cfg = self.removal(s)
                        recs = self.measure(f"remove-{s.id}", cfg)
                        pair = paired(self.correct(cand_records), self.correct(recs))
                    else:
                        cfg = self.addition(s)
                        recs = self.measure(f"add-{s.id}", cfg)
                        pair = paired(self.correct(recs), self.correct(ref_records))
                    add = self.addition(s)
                    a = final_logits(self.model, self.tokenizer, probe_case.messages, self.reference)
                    b = final_logits(self.model, self.tokenizer, probe_case.messages, add)
                    divergence = float((b - a).norm() / a.norm())
                    how = "removed from the candidate" if present else "added alone to the reference"
                    self.state.add_evidence(
                        s.id,
                        [
                            evidence("ablation", f"recall with {s.id} ({how}; paired)", pair["recall_with"]),
                            evidence("ablation", f"recall without {s.id}", pair["recall_without"]),
                            evidence("ablation", "discordant b (wrong with, right without)", pair["b"]),
                            evidence("ablation", "discordant c (right with, wrong without)", pair["c"]),
                            evidence("ablation", "exact McNemar p", pair["p"], 0.05),
                            evidence(
                                "divergence",
                                f"final-logit relative error, {s.id} added alone to the reference ({probe_case.case_id})",
                                divergence,
                                1e-5,
                            ),
                        ],
                    )
                    ran += 1
        verdict, reason = suspect_verdict(
            present=present,
            pair=pair,
            divergence=divergence,
            absent_by_question=absent_q,
            blocked=blocked,
            ran_checks=ran,
        )
        return {
            "id": s.id,
            "tier": s.tier,
            "hypothesis": s.hypothesis,
            "maps_to": s.patch.spec
            if s.patch is not None
            else " ".join(f"{f}={v}" for f, v in s.setting_fields),
            "present": present,
            "changes_topk": any(f == "index_topk" for f, _ in s.setting_fields),
            "verdict": verdict,
            "reason": reason,
            "pair": pair,
            "divergence": divergence,
        }


def _explained_case(ref_records, cand_records) -> tuple[str | None, str]:
    ref_ok = {r["case_id"] for r in ref_records if r["correct"]}
    misses = sorted(
        (r for r in cand_records if not r["correct"]), key=lambda r: (-r["length"], r["depth"], r["trial"])
    )
    for r in misses:
        if r["case_id"] in ref_ok:
            return r["case_id"], "right under the reference, wrong under the candidate"
    if misses:
        return misses[0]["case_id"], "wrong under both (no candidate-only failure)"
    return None, "the candidate answered every case correctly"


def run_investigation(
    ledger_path: str | Path, out: str | Path, progress: Progress = lambda *a: None, *, loaded=None
) -> Path:
    """Run (or resume) the investigation of ``ledger_path`` into ``out``; returns verdicts.json's path.

    ``loaded``: an already loaded (model, tokenizer) of the ledger's checkpoint, to reuse it."""
    ledger = load_ledger(ledger_path)
    inv = _Investigation(ledger, Path(out), progress)
    st = inv.state
    if not st.is_done("questions"):
        inv.questions()
        st.mark_done("questions")
    inv.load(loaded)
    suspects_out: list[dict] = []
    ref_records = cand_records = []
    fixes: list[dict] = []
    explained = probe_case = None
    if inv.model is not None:
        ref_records = inv.measure("reference", inv.reference)
        cand_records = inv.measure("candidate", inv.candidate)
        case_id, why = _explained_case(ref_records, cand_records)
        probe_case = next(
            (c for c in inv.cases if c.case_id == case_id), max(inv.cases, key=lambda c: c.length)
        )
        explained = {"case_id": case_id, "why": why}
    ordered = ledger.ordered_suspects()
    for n, s in enumerate(ordered):
        done = st.step_value(f"suspect:{s.id}")
        if done is None:
            st.set_status(s.id, "running")
            res = inv.check_suspect(s, ref_records, cand_records, probe_case)
            st.set_status(s.id, res["verdict"], res["reason"])
            st.mark_done(f"suspect:{s.id}", res)
            done = res
        suspects_out.append(done)
        progress("checks", n + 1, len(ordered), s.id)
    topk_runs = []
    if inv.model is not None:
        cand = inv.candidate
        fix_cfgs = [
            (f"remove-{s['id']}", inv.removal(next(x for x in ordered if x.id == s["id"])), s["id"])
            for s in suspects_out
            if s["present"]
        ]
        k = cand_records[0]["index_topk"]
        if 2 * k < int(inv.model.config.index_topk):  # else doubling is the checkpoint's own top-k
            fix_cfgs.append(
                (f"topk-{2 * k}", inv.Config(cand.setting.with_(index_topk=2 * k), cand.extra), None)
            )
        for name, cfg, removes in fix_cfgs:
            recs = inv.measure(name, cfg)
            fixes.append(
                {
                    "name": name,
                    "label": cfg.label(),
                    "removes": removes,
                    "index_topk": recs[0]["index_topk"],
                    "keeps_topk": recs[0]["index_topk"] == k,
                    "changes": "kernel"
                    if cfg.setting.patch != cand.setting.patch or cfg.extra != cand.extra
                    else "config",
                    "pair": paired(inv.correct(cand_records), inv.correct(recs)),
                    "recall_by_length": _recall_by_length(recs),
                    "case": next((r for r in recs if r["case_id"] == (explained or {}).get("case_id")), None),
                }
            )
            only_topk = (
                cfg.setting.with_(index_topk=cand.setting.index_topk) == cand.setting
                and cfg.extra == cand.extra
            )
            if only_topk:
                topk_runs.append(
                    {
                        "index_topk": recs[0]["index_topk"],
                        "compress_ratio": recs[0]["compress_ratio"],
                        "recall": _recall_by_length(recs),
                    }
                )
        topk_runs.append(
            {
                "index_topk": k,
                "compress_ratio": cand_records[0]["compress_ratio"],
                "recall": _recall_by_length(cand_records),
            }
        )
    sig = (
        signature(cand_records, topk_runs)
        if cand_records
        else {"uninformative_ranking": False, "layers": [], "collapse_vs_topk": []}
    )
    root = resolve_root_cause(suspects_out, sig["uninformative_ranking"])
    for f in fixes:
        f["label_kind"] = classify_fix(
            f["pair"], removes=f["removes"], root_cause=root, keeps_topk=f["keeps_topk"]
        )
    symptom = {
        **ledger.symptom.to_json(),
        "reference": inv.reference.label(),
        "candidate": inv.candidate.label(),
        "recall_reference": _recall_by_length(ref_records),
        "recall_candidate": _recall_by_length(cand_records),
        "cases": len(cand_records),
    }
    verdicts = {
        "symptom": symptom,
        "root_cause": root,
        "signature": sig,
        "suspects": [
            {
                "id": s["id"],
                "tier": s["tier"],
                "verdict": s["verdict"],
                "reason": s["reason"],
                "evidence": st.evidence(s["id"]),
            }
            for s in suspects_out
        ],
    }
    validate_verdicts(verdicts)
    for s in suspects_out:
        st.set_status(s["id"], s["verdict"], s["reason"])
    atomic_write_json(inv.out / "verdicts.json", verdicts)
    explained_rec = None
    if explained and explained["case_id"]:
        explained_rec = {
            **explained,
            "candidate": next(r for r in cand_records if r["case_id"] == explained["case_id"]),
            "reference": next(r for r in ref_records if r["case_id"] == explained["case_id"]),
        }
    atomic_write_json(
        inv.out / "investigation.json",
        {
            "ledger": str(ledger.path),
            "target": {"model": ledger.target.model, "device": ledger.target.device},
            "symptom": symptom,
            "configs": inv.configs,
            "candidate_topk": cand_records[0]["index_topk"] if cand_records else None,
            "suspects": [{k: v for k, v in s.items()} for s in suspects_out],
            "fixes": fixes,
            "explained": explained_rec,
            "verdicts": verdicts,
        },
    )
    progress("verdicts", 1, 1, "")
    return inv.out / "verdicts.json"


def read_investigation(out: Path) -> dict:
    return json.loads((Path(out) / "investigation.json").read_text(encoding="utf-8"))
