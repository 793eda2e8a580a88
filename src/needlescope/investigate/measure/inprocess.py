"""The in-process route of an investigation: the candidate and every ablation run in this
process on the reference checkpoint (``run.run_investigation`` picks it; the steps are in
``investigate.run``'s docstring).

A missing checkpoint blocks every model check (with the reason); questions still run. A
configuration is applied once for all its batches; a patch that returns no undo marks the model,
which is then reloaded fresh before the next configuration (never reused as if clean).
Suspects absent from the candidate with no causal check are exonerated on the configuration
check (``presence_check``) and the cheap questions, and the reason says so.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from needlescope.errors import BadInput
from needlescope.investigate.decide.verdicts import (
    DIVERGE_REL,
    evidence,
    paired,
    root_causes,
    suspect_verdict,
)
from needlescope.investigate.ledger.differences import (
    AUTO_PREFIX,
    auto_suspects,
    differences,
    file_slug,
    presence_check,
    present_in,
)
from needlescope.investigate.ledger.ledger import Ledger, Suspect
from needlescope.investigate.measure.causal import residual, sufficiency
from needlescope.investigate.measure.localize import localize_residual
from needlescope.investigate.measure.questions import QuestionContext, answer
from needlescope.investigate.measure.state import RunState
from needlescope.investigate.report.artifacts import nonfinite_summary

__all__ = ["INVESTIGATION_KEYS", "PHASES"]

BATCH = 8
"""Cases of one prompt length decoded together (unpadded batches; same answers as one at a time)."""
PHASES = ("questions", "symptom", "checks", "fixes", "verdicts")
INVESTIGATION_KEYS = ("ledger", "target", "symptom", "configs", "suspects", "fixes", "explained", "verdicts")
Progress = Callable[[str, int, int, str], None]


def recall_by_length(records: list[dict]) -> dict[str, float]:
    """Recall per prompt length (as text keys, ascending) over ``records`` (errors left out)."""
    agg: dict[int, list[int]] = {}
    for r in records:
        if r.get("error"):
            continue
        a = agg.setdefault(r["length"], [0, 0])
        a[0] += r["correct"]
        a[1] += 1
    return {str(n): a[0] / a[1] for n, a in sorted(agg.items())}


class _Investigation:
    def __init__(self, ledger: Ledger, out: Path, progress: Progress):
        from needlescope.investigate.ledger.plan import Config

        self.ledger, self.out, self.progress = ledger, Path(out), progress
        self.diffs = differences(ledger)
        self.suspects = ledger.ordered_suspects() + auto_suspects(self.diffs, ledger)
        self.state = RunState(
            self.out, ledger.path.read_text(encoding="utf-8"), [s.id for s in ledger.suspects]
        )
        self.state.ensure_suspects([s.id for s in self.suspects])
        t = ledger.target
        self.Config = Config
        self.reference = Config(t.reference)
        self.candidate = None if t.candidate is None else Config(t.candidate, t.extra_patches)
        self.configs: dict[str, dict] = {"reference": self.reference.to_json()}
        if self.candidate is not None:
            self.configs["candidate"] = self.candidate.to_json()
        self._model = self.tokenizer = self.cases = None
        self.model_dir: Path | None = None
        self.blocked_reason: str | None = None

    @property
    def chunk(self) -> int | None:
        """The ledger's ``prefill_chunk``: every in-process pass runs its prompt in chunks of it."""
        return self.ledger.target.prefill_chunk

    # -- model and cases -------------------------------------------------------------
    def load(self, loaded=None) -> None:
        import torch

        from needlescope.cases.assemble import CaseSpec, build_cases
        from needlescope.dsa.checkpoint import load_bundle, resolve_model_dir, trained_value_digits
        from needlescope.dsa.prompt import render_prompt

        t, sy = self.ledger.target, self.ledger.symptom
        try:
            self.model_dir = resolve_model_dir(t.model)
        except BadInput as exc:
            self.blocked_reason = f"reference checkpoint unavailable: {exc}"
            return
        torch.set_num_threads(t.threads)
        self._model, self.tokenizer = (
            loaded if loaded is not None else load_bundle(self.model_dir, device=t.device)[:2]
        )
        spec = CaseSpec(
            kind=sy.kind,
            lengths=sy.lengths,
            depths=sy.depths,
            trials=sy.trials,
            seed=sy.seed,
            value_digits=trained_value_digits(self.model_dir),
        )
        self.cases = build_cases(spec, lambda m: len(render_prompt(self.tokenizer, m).input_ids))
        self.prompt_len = {
            c.case_id: len(render_prompt(self.tokenizer, c.messages).input_ids) for c in self.cases
        }

    def path_map(self) -> dict[str, str]:
        """Absolute prefixes of this machine -> what artifacts say instead (``artifacts.relativize``)."""
        m = {str(self.ledger.path.parent) + "/": ""}
        if self.model_dir is not None:
            t = self.ledger.target.model
            m[str(self.model_dir)] = t if t == "organism" else Path(self.model_dir).name
        return m

    @property
    def model(self):
        """The loaded model, reloaded fresh when a patch without an undo changed it for good
        (``measure.applied`` marks such a model and refuses to reuse it)."""
        from needlescope.dsa.checkpoint import load_bundle
        from needlescope.dsa.emulate import patched_for_good

        if self._model is not None and patched_for_good(self._model) is not None:
            self._model = load_bundle(self.model_dir, device=self.ledger.target.device)[0]
        return self._model

    def measure(self, name: str, config) -> list[dict]:
        """Records of every case under ``config`` (resumed from ``measure/NAME.jsonl``)."""
        from needlescope.investigate.measure.records import measuring

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
        if todo:  # the configuration is applied once for all its batches
            mx = self.ledger.symptom.max_new_tokens
            with measuring(self.model, self.tokenizer, config, max_new_tokens=mx, chunk=self.chunk) as run:
                for _, group in sorted(todo.items()):
                    for i in range(0, len(group), BATCH):
                        for rec in run(group[i : i + BATCH]):
                            self.state.append_record(name, rec)
                            done[rec["case_id"]] = rec
                        self.progress(f"measure {name}", len(done), len(self.cases), config.label())
        return [done[c.case_id] for c in self.cases]

    @staticmethod
    def correct(records: list[dict]) -> dict[str, bool]:
        return {r["case_id"]: r["correct"] for r in records}

    # -- suspects ----------------------------------------------------------------------
    def removal(self, s: Suspect, base=None):
        """``base`` (default: the candidate) with ``s`` taken out."""
        c, ref = base or self.candidate, self.ledger.target.reference
        if s.patch is not None:
            if c.setting.patch is not None and c.setting.patch.path == s.patch.path:
                return self.Config(c.setting.with_(patch=None), c.extra)
            return self.Config(c.setting, tuple(p for p in c.extra if p.path != s.patch.path))
        return self.Config(c.setting.with_(**{f: getattr(ref, f) for f, _ in s.setting_fields}), c.extra)

    def addition(self, s: Suspect, base=None):
        """``base`` (default: the reference) with ``s`` added alone."""
        r = base or self.reference
        if s.patch is not None:
            cand_patch = self.candidate.setting.patch if self.candidate is not None else None
            indexer_patch = s.patch.is_fault or (cand_patch is not None and cand_patch.path == s.patch.path)
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

    def question_summary(self, sid: str) -> str:
        """The cheap questions' answers for ``sid``, in one line ("" when it has none)."""
        return "; ".join(
            f"{e['metric'].split(' (')[0]} -> {e['value']}"
            for e in self.state.evidence(sid)
            if e["check"].startswith("question:")
        )

    def _checkpoint_dir(self) -> Path | None:
        from needlescope.dsa.checkpoint import resolve_model_dir

        try:
            return resolve_model_dir(self.ledger.target.model)
        except BadInput:
            return None

    def audit(self, s: Suspect, check: str, ref_records, cand_records, probe_case) -> None:
        """Run ``audit:NAME`` on the probe case's prompt; its metrics become evidence."""
        import torch

        from needlescope.audit.checks import run_check
        from needlescope.dsa.prompt import render_prompt
        from needlescope.investigate.measure.records import applied

        def apply_candidate(model):
            cm = applied(model, self.candidate)
            cm.__enter__()
            return lambda: cm.__exit__(None, None, None)

        ids = torch.tensor(
            [render_prompt(self.tokenizer, probe_case.messages).input_ids],
            device=next(self.model.parameters()).device,
        )
        ctx = {
            "candidate_topk": cand_records[0]["index_topk"],
            "reference_records": ref_records,
            "apply_candidate": apply_candidate,
            "chunk": self.chunk,
        }
        res = run_check(check.split(":", 1)[1], self.model, ids, ctx)
        self.state.add_evidence(
            s.id,
            [evidence(check, m["metric"], m["value"], m["threshold"]) for m in res["metrics"]]
            + [evidence(check, f"flagged ({res['why']})", "yes" if res["flagged"] else "no")],
        )

    def ablation(self, s: Suspect, present: bool, ref_records, cand_records, probe_case):
        """(pair, divergence): the paired ablation and the final-logit divergence of ``s`` added
        alone to the reference; both recorded as evidence."""
        from needlescope.investigate.measure.records import final_logits

        if present:
            recs = self.measure(f"remove-{file_slug(s.id)}", self.removal(s))
            pair = paired(self.correct(cand_records), self.correct(recs))
        else:
            recs = self.measure(f"add-{file_slug(s.id)}", self.addition(s))
            pair = paired(self.correct(recs), self.correct(ref_records))
        a = final_logits(self.model, self.tokenizer, probe_case.messages, self.reference, chunk=self.chunk)
        b = final_logits(self.model, self.tokenizer, probe_case.messages, self.addition(s), chunk=self.chunk)
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
                    DIVERGE_REL,
                ),
            ],
        )
        return pair, divergence

    def check_suspect(self, s: Suspect, ref_records, cand_records, probe_case) -> dict:
        cand, ref = self.candidate, self.reference
        present = present_in(s, cand.setting, cand.extra, ref.setting)
        presence = presence_check(s, cand.setting, cand.extra, ref.setting, self.ledger.path.parent)
        self.state.add_evidence(s.id, [evidence("presence", presence, "present" if present else "absent")])
        blocked, ran = [], 0
        absent_q = self.state.data.get("absent", {}).get(s.id)
        pair = divergence = suff = None
        if s.id.startswith(AUTO_PREFIX) and not s.checks:
            blocked.append(
                "ablation: an environment variable, a server field or a patch only the reference carries "
                "cannot be removed from or added to the in-process model; map it to a patch or setting suspect"
            )
        for check in s.checks if absent_q is None else ():
            if self._model is None:
                blocked.append(f"{check}: {self.blocked_reason}")
            elif check.startswith("audit:"):
                self.audit(s, check, ref_records, cand_records, probe_case)
                ran += 1
            elif check == "ablation":
                pair, divergence = self.ablation(s, present, ref_records, cand_records, probe_case)
                if present:
                    suff = sufficiency(self, s, ref_records)
                ran += 1
        inputs = {
            "absent_by_question": absent_q,
            "blocked": blocked,
            "ran_checks": ran,
            "presence": presence,
            "questions": self.question_summary(s.id),
        }
        verdict, reason = suspect_verdict(present=present, pair=pair, divergence=divergence, **inputs)
        return suspect_record(
            s,
            verdict,
            reason,
            present=present,
            pair=pair,
            divergence=divergence,
            sufficiency=suff,
            inputs=inputs,
        )


def suspect_record(s: Suspect, verdict: str, reason: str, **measured) -> dict:
    """The per-suspect record ``investigation.json`` keeps (``measured``: present, pair, ...)."""
    return {
        "id": s.id,
        "tier": s.tier,
        "hypothesis": s.hypothesis,
        "maps_to": s.patch.spec if s.patch is not None else " ".join(f"{f}={v}" for f, v in s.setting_fields),
        "changes_topk": any(f == "index_topk" for f, _ in s.setting_fields),
        "verdict": verdict,
        "reason": reason,
        "pair": None,
        "divergence": None,
        "sufficiency": None,
        "auto": s.id.startswith(AUTO_PREFIX),
        **measured,
    }


CANDIDATE_ONLY = "right under the reference, wrong under the candidate"


def _explained_case(ref_records, cand_records) -> tuple[str | None, str]:
    ref_ok = {r["case_id"] for r in ref_records if r["correct"]}
    misses = sorted(
        (r for r in cand_records if not r["correct"]), key=lambda r: (-r["length"], r["depth"], r["trial"])
    )
    for r in misses:
        if r["case_id"] in ref_ok:
            return r["case_id"], CANDIDATE_ONLY
    if misses:
        return misses[0]["case_id"], "wrong under both (no candidate-only failure)"
    return None, "the candidate answered every case correctly"


def check_suspects(inv, ordered: list[Suspect], check) -> list[dict]:
    """Run ``check(suspect) -> record`` in tier order, each once (resumed from ``state.json``)."""
    st, out = inv.state, []
    for n, s in enumerate(ordered):
        done = st.step_value(f"suspect:{s.id}")
        if done is None:
            st.set_status(s.id, "running")
            done = check(s)
            st.set_status(s.id, done["verdict"], done["reason"])
            st.mark_done(f"suspect:{s.id}", done)
        out.append(done)
        inv.progress("checks", n + 1, len(ordered), s.id)
    return out


def _fix_configs(inv: _Investigation, ordered: list[Suspect], suspects_out: list[dict], k: int) -> list:
    """(name, config, removed suspect id) of every fix to replay: each present suspect's removal,
    and the candidate at twice its ``index_topk`` (unless that is the checkpoint's own top-k)."""
    by_id = {s.id: s for s in ordered}
    cfgs = [
        (f"remove-{file_slug(s['id'])}", inv.removal(by_id[s["id"]]), s["id"])
        for s in suspects_out
        if s["present"] and s["id"] in by_id and (by_id[s["id"]].patch or by_id[s["id"]].setting_fields)
    ]
    cand = inv.candidate
    if 2 * k < int(inv.model.config.index_topk):
        cfgs.append((f"topk-{2 * k}", inv.Config(cand.setting.with_(index_topk=2 * k), cand.extra), None))
    return cfgs


def replay_fixes(inv: _Investigation, ordered, suspects_out, cand_records, explained) -> tuple[list, list]:
    """(fixes, topk_runs): every fix paired with the candidate, and the runs that differ from
    the candidate only in ``index_topk`` (the candidate included) for the collapse test."""
    cand = inv.candidate
    k = cand_records[0]["index_topk"]
    fixes, topk_runs = [], []
    for name, cfg, removes in _fix_configs(inv, ordered, suspects_out, k):
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
                "recall_by_length": recall_by_length(recs),
                "case": next((r for r in recs if r["case_id"] == (explained or {}).get("case_id")), None),
            }
        )
        if cfg.setting.with_(index_topk=cand.setting.index_topk) == cand.setting and cfg.extra == cand.extra:
            topk_runs.append(_topk_run(recs))
    topk_runs.append(_topk_run(cand_records))
    return fixes, topk_runs


def _topk_run(recs: list[dict]) -> dict:
    return {
        "index_topk": recs[0]["index_topk"],
        "compress_ratio": recs[0]["compress_ratio"],
        "cases": [{"case_id": r["case_id"], "length": r["length"], "correct": r["correct"]} for r in recs],
    }


def _symptom(inv: _Investigation, ref_records, cand_records) -> dict:
    return {
        **inv.ledger.symptom.to_json(),
        "reference": inv.reference.label(),
        "candidate": inv.candidate.label(),
        "recall_reference": recall_by_length(ref_records),
        "recall_candidate": recall_by_length(cand_records),
        "cases": len(cand_records),
    }


def _explained_record(explained, ref_records, cand_records) -> dict | None:
    if not explained or not explained["case_id"]:
        return None
    return {
        **explained,
        "candidate": next(r for r in cand_records if r["case_id"] == explained["case_id"]),
        "reference": next(r for r in ref_records if r["case_id"] == explained["case_id"]),
    }


def _unexplained(inv: _Investigation, suspects_out, ref_records, cand_records) -> dict:
    """The residual, the localizer step when something is left unexplained (or a root cause is
    an automatic suspect), and the non-finite score counts: ``verdicts.json`` keys."""
    out: dict = {}
    if inv.model is not None:
        out["residual"], res_cfg, res_recs = residual(inv, suspects_out, ref_records, cand_records)
        if out["residual"]["loses"]:
            out["localization"] = localize_residual(inv, res_cfg, res_recs, ref_records)
        elif any(r.startswith(AUTO_PREFIX) for r in root_causes(suspects_out)):
            # nobody named the root cause: show where in the model it acts (the candidate itself)
            out["localization"] = localize_residual(
                inv,
                inv.candidate,
                cand_records,
                ref_records,
                "the candidate (its root cause is not named by the ledger)",
            )
    out["nonfinite_scores"] = nonfinite_summary(inv)
    return out


def read_investigation(out: Path) -> dict:
    return json.loads((Path(out) / "investigation.json").read_text(encoding="utf-8"))
