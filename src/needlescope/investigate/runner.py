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

A missing checkpoint blocks every model check (with the reason); questions still run. A
configuration is applied once for all its batches; a patch that returns no undo marks the model,
which is then reloaded fresh before the next configuration (never reused as if clean).
Suspects absent from the candidate with no causal check are exonerated on the configuration
check (``presence_check``) and the cheap questions, and the reason says so.

A ledger with ``candidate = "live"`` takes the live-endpoint route instead
(``investigate.live``): no ablation is possible, each suspect's emulation in the reference is
compared with the live indexer capture.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from needlescope.errors import BadInput
from needlescope.investigate.ledger import Ledger, Suspect, load_ledger
from needlescope.investigate.questions import QuestionContext, answer
from needlescope.investigate.signature import NO_SIGNATURE, signature
from needlescope.investigate.state import RunState
from needlescope.investigate.verdicts import (
    DIVERGE_REL,
    classify_fix,
    evidence,
    paired,
    resolve_root_cause,
    suspect_verdict,
    validate_verdicts,
)
from needlescope.paths import atomic_write_json
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


def _shown(spec: str, base: Path | None) -> str:
    """A patch spec as the ledger wrote it: file paths relative to the ledger's directory."""
    p = Path(spec)
    return (
        str(p.relative_to(base)) if base is not None and p.is_absolute() and p.is_relative_to(base) else spec
    )


def presence_check(s: Suspect, cand: Setting, extra, ref: Setting, base: Path | None = None) -> str:
    """What the configuration check found: why ``s`` is (or is not) in the candidate, in words
    (``base``: the ledger's directory, to show patch files as the ledger names them)."""
    if s.patch is not None:
        carried = [_shown(p.spec, base) for p in extra] + (
            [_shown(cand.patch.spec, base)] if cand.patch else []
        )
        where = ", ".join(carried) if carried else "none"
        verb = "is" if _present(s, cand, extra, ref) else "is not"
        return (
            f"source check: patch {_shown(s.patch.spec, base)} {verb} among the candidate's patches ({where})"
        )
    parts = []
    for f, v in s.setting_fields:
        if getattr(cand, f) != v:
            parts.append(f"candidate {f}={getattr(cand, f)}, the suspect is {f}={v}")
        elif getattr(ref, f) == v:
            parts.append(f"the reference already has {f}={v}")
        else:
            parts.append(f"candidate {f}={v}, reference {f}={getattr(ref, f)}")
    return "config check: " + "; ".join(parts)


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
        self.candidate = None if t.live else Config(t.candidate, t.extra_patches)
        self.configs: dict[str, dict] = {"reference": self.reference.to_json()}
        if self.candidate is not None:
            self.configs["candidate"] = self.candidate.to_json()
        self._model = self.tokenizer = self.cases = None
        self.model_dir: Path | None = None
        self.blocked_reason: str | None = None

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
        from needlescope.investigate.measure import measuring

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
            with measuring(self.model, self.tokenizer, config, max_new_tokens=mx) as run:
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
    def removal(self, s: Suspect):
        c, ref = self.candidate, self.ledger.target.reference
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
        from needlescope.investigate.measure import applied

        def apply_candidate(model):
            cm = applied(model, self.candidate)
            cm.__enter__()
            return lambda: cm.__exit__(None, None, None)

        ids = torch.tensor([render_prompt(self.tokenizer, probe_case.messages).input_ids])
        ctx = {
            "candidate_topk": cand_records[0]["index_topk"],
            "reference_records": ref_records,
            "apply_candidate": apply_candidate,
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
        from needlescope.investigate.measure import final_logits

        if present:
            recs = self.measure(f"remove-{s.id}", self.removal(s))
            pair = paired(self.correct(cand_records), self.correct(recs))
        else:
            recs = self.measure(f"add-{s.id}", self.addition(s))
            pair = paired(self.correct(recs), self.correct(ref_records))
        a = final_logits(self.model, self.tokenizer, probe_case.messages, self.reference)
        b = final_logits(self.model, self.tokenizer, probe_case.messages, self.addition(s))
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
        present = _present(s, cand.setting, cand.extra, ref.setting)
        presence = presence_check(s, cand.setting, cand.extra, ref.setting, self.ledger.path.parent)
        self.state.add_evidence(s.id, [evidence("presence", presence, "present" if present else "absent")])
        blocked, ran = [], 0
        absent_q = self.state.data.get("absent", {}).get(s.id)
        pair = divergence = None
        for check in s.checks if absent_q is None else ():
            if self._model is None:
                blocked.append(f"{check}: {self.blocked_reason}")
            elif check.startswith("audit:"):
                self.audit(s, check, ref_records, cand_records, probe_case)
                ran += 1
            elif check == "ablation":
                pair, divergence = self.ablation(s, present, ref_records, cand_records, probe_case)
                ran += 1
        verdict, reason = suspect_verdict(
            present=present,
            pair=pair,
            divergence=divergence,
            absent_by_question=absent_q,
            blocked=blocked,
            ran_checks=ran,
            presence=presence,
            questions=self.question_summary(s.id),
        )
        return suspect_record(s, verdict, reason, present=present, pair=pair, divergence=divergence)


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
        **measured,
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
    cfgs = [(f"remove-{s['id']}", inv.removal(by_id[s["id"]]), s["id"]) for s in suspects_out if s["present"]]
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


def write_verdicts(inv, symptom: dict, root, sig: dict, suspects_out: list[dict]) -> dict:
    """Build, validate and write ``verdicts.json``; returns it."""
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
                "evidence": inv.state.evidence(s["id"]),
            }
            for s in suspects_out
        ],
    }
    validate_verdicts(verdicts)
    for s in suspects_out:
        inv.state.set_status(s["id"], s["verdict"], s["reason"])
    atomic_write_json(inv.out / "verdicts.json", verdicts)
    return verdicts


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


def run_investigation(
    ledger_path: str | Path,
    out: str | Path,
    progress: Progress = lambda *a: None,
    *,
    loaded=None,
    allow_outside: bool = False,
) -> Path:
    """Run (or resume) the investigation of ``ledger_path`` into ``out``; returns verdicts.json's path.

    ``loaded``: an already loaded (model, tokenizer) of the ledger's checkpoint, to reuse it.
    A ledger whose candidate is ``live`` takes the live-endpoint route (``investigate.live``).
    ``allow_outside``: accept ledger paths outside its folder (``--allow-outside``)."""
    ledger = load_ledger(ledger_path, allow_outside=allow_outside)
    if ledger.target.live:
        from needlescope.investigate.live import LiveInvestigation

        return LiveInvestigation(ledger, Path(out), progress).run(loaded)
    inv = _Investigation(ledger, Path(out), progress)
    if not inv.state.is_done("questions"):
        inv.questions()
        inv.state.mark_done("questions")
    inv.load(loaded)
    ref_records = cand_records = fixes = topk_runs = []
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
    suspects_out = check_suspects(
        inv, ordered, lambda s: inv.check_suspect(s, ref_records, cand_records, probe_case)
    )
    if inv.model is not None:
        fixes, topk_runs = replay_fixes(inv, ordered, suspects_out, cand_records, explained)
    sig = signature(cand_records, topk_runs) if cand_records else NO_SIGNATURE
    root = resolve_root_cause(suspects_out, sig["uninformative_ranking"])
    for f in fixes:
        f["label_kind"] = classify_fix(
            f["pair"], removes=f["removes"], root_cause=root, keeps_topk=f["keeps_topk"]
        )
    symptom = _symptom(inv, ref_records, cand_records)
    verdicts = write_verdicts(inv, symptom, root, sig, suspects_out)
    atomic_write_json(
        inv.out / "investigation.json",
        {
            "route": "in-process",
            "ledger": str(ledger.path),
            "target": {"model": ledger.target.model, "device": ledger.target.device},
            "symptom": symptom,
            "configs": inv.configs,
            "candidate_topk": cand_records[0]["index_topk"] if cand_records else None,
            "suspects": suspects_out,
            "fixes": fixes,
            "explained": _explained_record(explained, ref_records, cand_records),
            "verdicts": verdicts,
        },
    )
    progress("verdicts", 1, 1, "")
    return inv.out / "verdicts.json"


def read_investigation(out: Path) -> dict:
    return json.loads((Path(out) / "investigation.json").read_text(encoding="utf-8"))
