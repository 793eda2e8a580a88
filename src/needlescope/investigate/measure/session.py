"""``Session``: what both routes of an investigation share, and no verdict.

A session holds the ledger, the run directory's resumable state (``state.RunState``), the
differences and suspects (the ledger's and the automatic ones), the reference and candidate
configurations, and, once ``load`` ran, the reference checkpoint's model and tokenizer and the
probe cases. ``measure(name, config)`` measures every case under a configuration (resumed from
``measure/NAME.jsonl``); ``questions()`` asks every suspect's cheap questions and records the
answers as evidence. The in-process route (``inprocess``) and the live route (``live``) each take
a session; neither knows the other.

A missing checkpoint leaves ``model`` None and says why in ``blocked_reason``; every model
check is then blocked with that reason, and the questions still run. A configuration is applied
once for all its batches; a patch that returns no undo marks the model, which is then reloaded
fresh before the next configuration (never reused as if clean).
"""

from __future__ import annotations

import json
from pathlib import Path

from needlescope.errors import BadInput
from needlescope.investigate.decide.measured import Measured
from needlescope.investigate.decide.verdicts import evidence
from needlescope.investigate.ledger.differences import AUTO_PREFIX, auto_suspects, differences
from needlescope.investigate.ledger.ledger import Ledger, Suspect
from needlescope.investigate.ledger.plan import Config, addition, removal
from needlescope.investigate.measure import basis
from needlescope.investigate.measure.questions import QuestionContext, answer
from needlescope.investigate.measure.server_identity import resume_text
from needlescope.investigate.measure.state import RunState
from needlescope.progress import Progress

__all__ = ["Session", "BATCH", "outcomes", "measure_suspects", "suspect_identity", "nonfinite_summary"]

BATCH = 8
"""Cases of one prompt length decoded together (unpadded batches; same answers as one at a time)."""


def outcomes(records: list[dict]) -> dict[str, bool]:
    """case id -> answered correctly, over measured case records."""
    return {r["case_id"]: r["correct"] for r in records}


class Session:
    """The shared state of one investigation run (module docstring)."""

    def __init__(
        self,
        ledger: Ledger,
        out: Path,
        progress: Progress,
        api_key: str | None = None,
        serving_factors: bool = False,
    ):
        self.ledger, self.out, self.progress = ledger, Path(out), progress
        self.api_key = api_key  # the live endpoint's bearer key: sent, never written
        self.serving_factors = serving_factors  # --serving-factors: measure the serving factor of a live loss
        self.diffs = differences(ledger)
        self.suspects: list[Suspect] = ledger.ordered_suspects() + auto_suspects(self.diffs, ledger)
        text = ledger.path.read_text(encoding="utf-8")
        live = ledger.target.candidate is None  # a live run resumes against the same server, any port
        # the run's fingerprint: the ledger's text and the bytes of every patch file it names
        text = (resume_text(text) if live else text) + basis.ledger_inputs(_ledger_patches(ledger))
        self.state = RunState(self.out, text, [s.id for s in ledger.suspects])
        self.state.ensure_suspects([s.id for s in self.suspects])
        t = ledger.target
        self.reference = Config(t.reference)
        self.candidate: Config | None = None if t.candidate is None else Config(t.candidate, t.extra_patches)
        # every configuration measured, this run or an earlier one of this directory
        self.configs: dict[str, dict] = {"reference": self.reference.to_json()}
        if self.candidate is not None:
            self.configs["candidate"] = self.candidate.to_json()
        self.configs.update(self.state.configs())
        self._model = self.tokenizer = self.cases = None
        self.prompt_len: dict[str, int] = {}
        self._case_digest: dict[str, str] = {}  # case id -> basis.case_digest of its messages
        self._params: dict = {}  # what else a record's basis covers (``load``)
        self._config_bases: dict[str, str] = {}  # configuration JSON -> its basis (``_config_basis``)
        self.model_dir: Path | None = None
        self.blocked_reason: str | None = None

    @property
    def chunk(self) -> int | None:
        """The ledger's ``prefill_chunk``: every in-process pass runs its prompt in chunks of it."""
        return self.ledger.target.prefill_chunk

    @property
    def loaded(self) -> bool:
        """Whether the reference checkpoint is loaded (False: every model check is blocked)."""
        return self._model is not None

    # -- model and cases -------------------------------------------------------------
    def load(self, loaded=None) -> None:
        """Load the reference checkpoint (or take ``loaded``: (model, tokenizer)) and build the
        ledger's probe cases; a missing checkpoint sets ``blocked_reason`` instead."""
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
        self._case_digest = {c.case_id: basis.case_digest(c.messages) for c in self.cases}
        self._params = {
            "model": basis.model_identity(self.model_dir),
            "max_new_tokens": sy.max_new_tokens,
            "prefill_chunk": t.prefill_chunk,
            "device": t.device,
        }

    def path_map(self) -> dict[str, str]:
        """Absolute prefixes of this machine -> what artifacts say instead (``paths.relativize``)."""
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

    def measure(self, name: str, config: Config, cases=None) -> list[dict]:
        """Records of every case (of the ledger, or ``cases`` whose prompt lengths are in
        ``prompt_len``) under ``config`` (resumed from ``measure/NAME.jsonl``)."""
        from needlescope.investigate.measure.records import measuring

        self.note_config(name, config)
        cases = self.cases if cases is None else cases
        # the characterization's cases are not the ledger's: their messages are a basis too
        self._case_digest.update((c.case_id, basis.case_digest(c.messages)) for c in cases)
        mine, others = self._stored(name)
        if others:  # measured for something else: set aside, so that the file holds this run's
            self.state.supersede(name, mine, others)
        # A configuration already measured under another name (a removal that equals the
        # reference, say) is not measured twice: its records are copied.
        same = [n for n, c in self.configs.items() if n != name and c["label"] == config.label()]
        done = {r["case_id"]: r for r in self.records(name)}
        if same and not done:
            for r in self.records(same[0]):
                self._append(name, r)
            done = {r["case_id"]: r for r in self.records(name)}
        todo: dict[int, list] = {}
        for case in cases:
            if case.case_id not in done:
                todo.setdefault(self.prompt_len[case.case_id], []).append(case)
        self.progress(f"measure {name}", len(done), len(cases), config.label())
        if todo:  # the configuration is applied once for all its batches
            mx = self.ledger.symptom.max_new_tokens
            with measuring(self.model, self.tokenizer, config, max_new_tokens=mx, chunk=self.chunk) as run:
                for _, group in sorted(todo.items()):
                    for i in range(0, len(group), BATCH):
                        for rec in run(group[i : i + BATCH]):
                            self._append(name, rec)
                            done[rec["case_id"]] = rec
                        self.progress(f"measure {name}", len(done), len(cases), config.label())
        return [done[c.case_id] for c in cases]

    def records(self, name: str) -> list[dict]:
        """The records of ``measure/NAME.jsonl`` that this run would measure the same: of a case
        of the ledger, with the ``basis`` of the configuration noted as ``name`` (``note_config``)
        and of that case now. Others (a patch file edited since, a case built from another seed,
        another checkpoint) are measured again; they stay in the file, never read as this run's.
        Without the probe cases (no checkpoint), none."""
        return [{k: v for k, v in r.items() if k != "basis"} for r in self._stored(name)[0]]

    def _stored(self, name: str) -> tuple[list[dict], list[dict]]:
        """(records of this run's basis, the others) in ``measure/NAME.jsonl``, as stored."""
        if name not in self.configs or not self._case_digest:
            return [], []
        config = self._config_basis(name)
        mine, others = [], []
        for r in self.state.records(name):
            case = self._case_digest.get(r.get("case_id"))
            ok = case is not None and r.get("basis") == basis.record_basis(config, case, self._params)
            (mine if ok else others).append(r)
        return mine, others

    def _append(self, name: str, record: dict) -> None:
        config = self._config_basis(name)
        b = basis.record_basis(config, self._case_digest[record["case_id"]], self._params)
        self.state.append_record(name, {**record, "basis": b})

    def _config_basis(self, name: str) -> str:
        """``basis.config_basis`` of the configuration noted as ``name``, read once a run: its
        patch files' bytes are fixed for the run (the run's fingerprint covers them), and every
        record appended or read would otherwise read them again."""
        key = json.dumps(self.configs[name], sort_keys=True)
        if key not in self._config_bases:
            self._config_bases[key] = basis.config_basis(self.configs[name], self.ledger.path.parent)
        return self._config_bases[key]

    def note_config(self, name: str, config: Config) -> None:
        """Record ``config`` under ``name`` (kept in ``state.json``: a resumed run lists it too)."""
        self.configs[name] = config.to_json()
        self.state.note_config(name, self.configs[name])

    # -- the plan ----------------------------------------------------------------------
    def removal(self, s: Suspect, base: Config | None = None) -> Config:
        """``base`` (default: the candidate) with ``s`` taken out (``plan.removal``)."""
        return removal(s, base or self.candidate, self.ledger.target.reference)

    def addition(self, s: Suspect, base: Config | None = None) -> Config:
        """``base`` (default: the reference) with ``s`` added alone (``plan.addition``)."""
        return addition(s, base or self.reference, self.candidate)

    # -- cheap questions -----------------------------------------------------------------
    def questions(self) -> None:
        """Every ledger suspect's cheap questions, tier order, once (resumed): each answer is
        evidence; an answer equal to a question's ``means_absent`` marks the suspect absent."""
        if self.state.is_done("questions"):
            return
        t = self.ledger.target
        ctx = QuestionContext(
            base=self.ledger.path.parent,
            checkpoint=self._checkpoint_dir(),
            endpoint=t.endpoint,
            env_file=t.env_file,
            api_key=self.api_key,
        )
        suspects = self.ledger.ordered_suspects()
        for s in suspects:  # a run killed while asking left some answers: ask them all again
            self.state.keep_evidence(s.id, lambda e: not e["check"].startswith("question:"))
        for n, s in enumerate(suspects):
            for q in s.questions:
                a = answer(q, ctx)
                what = f"{q.type} {' '.join(f'{k}={v}' for k, v in q.params.items())}"
                if a.ok:
                    ev = evidence(f"question:{q.type}", f"{what} ({a.detail})", a.value)
                    if q.expect is not None:
                        ev["metric"] += f"; expected {q.expect}: {'yes' if a.value == q.expect else 'no'}"
                    if q.means_absent is not None and a.value == q.means_absent:
                        self.state.mark_absent(s.id, f"{what} answered {a.value!r}")
                else:
                    ev = evidence(f"question:{q.type}", what, f"blocked: {a.blocked}")
                self.state.add_evidence(s.id, [ev])
            self.progress("questions", n + 1, len(suspects), s.id)
        self.state.mark_done("questions")

    def absent_by_question(self, sid: str) -> str | None:
        """What a cheap question answered that means ``sid`` is not deployed (None: nothing)."""
        return self.state.absent(sid)

    def question_summary(self, sid: str) -> str:
        """The cheap questions' answers for ``sid``, in one line ("" when it has none)."""
        return "; ".join(
            f"{e['metric'].split(' (')[0]} -> {e['value']}"
            for e in self.state.evidence(sid)
            if e["check"].startswith("question:")
        )

    def measured(self, suspects: list[dict], **fields) -> Measured:
        """A route's ``Measured`` (``fields``: its own) with what every route takes from the
        session: the configurations measured, each suspect's evidence, the differences."""
        evidence = {s["id"]: self.state.evidence(s["id"]) for s in suspects}
        return Measured(
            configs=self.configs, suspects=suspects, evidence=evidence, differences=self.diffs, **fields
        )

    def _checkpoint_dir(self) -> Path | None:
        from needlescope.dsa.checkpoint import resolve_model_dir

        try:
            return resolve_model_dir(self.ledger.target.model)
        except BadInput:
            return None


def measure_suspects(session: Session, measure_one, basis: str = "") -> list[dict]:
    """``measure_one(suspect) -> measured record`` for every suspect in tier order, each once
    (resumed from ``state.json``'s ``measured:ID`` steps). A measured record holds evidence
    and pairs, never a verdict: ``decide`` turns the records into verdicts.

    ``basis`` names what the records were measured on (the live route: a digest of the failing
    cases): a stored record of another basis, from a run whose requests partly failed, is
    measured again, so a rerun decides from all the data. A suspect measured again (that, or a
    run killed in the middle of it) first drops the evidence its unfinished measurement left."""
    st, out = session.state, []
    for n, s in enumerate(session.suspects):
        done = st.step_value(f"measured:{s.id}")
        if done is None or done.get("basis", "") != basis:
            st.set_status(s.id, "running")
            st.keep_evidence(s.id, lambda e: e["check"].startswith("question:"))
            done = {**measure_one(s), "basis": basis}
            st.set_status(s.id, "measured")
            st.mark_done(f"measured:{s.id}", done)
        out.append({k: v for k, v in done.items() if k != "basis"})
        session.progress("checks", n + 1, len(session.suspects), s.id)
    return out


def suspect_identity(s: Suspect) -> dict:
    """What every measured suspect record starts with: who it is, from the ledger."""
    return {
        "id": s.id,
        "tier": s.tier,
        "hypothesis": s.hypothesis,
        "maps_to": s.patch.spec if s.patch is not None else " ".join(f"{f}={v}" for f, v in s.setting_fields),
        "changes_topk": any(f == "index_topk" for f, _ in s.setting_fields),
        "auto": s.id.startswith(AUTO_PREFIX),
    }


NONFINITE_KEYS = ("neg_inf", "nan", "pos_inf")


def nonfinite_summary(session: Session) -> dict:
    """``verdicts.json`` ``nonfinite_scores``: the non-finite indexer scores of every measured
    configuration (``records`` count them per CSA layer over the visible entries of every query
    row: ``-inf`` is a legitimate masked score and ranks last; NaN and ``+inf`` are findings):
    ``{"counts": {config: {layer: {"neg_inf", "nan", "pos_inf"}}}, "findings": [{"config",
    "case_id", "layer", "position", "nan", "pos_inf"}]}``."""
    counts: dict[str, dict] = {}
    findings = []
    for name in session.configs:
        for r in session.records(name):
            for layer, c in (r.get("nonfinite") or {}).items():
                agg = counts.setdefault(name, {}).setdefault(layer, dict.fromkeys(NONFINITE_KEYS, 0))
                for k in NONFINITE_KEYS:
                    agg[k] += c[k]
                if c["nan"] or c["pos_inf"]:
                    findings.append(
                        {
                            "config": name,
                            "case_id": r["case_id"],
                            "layer": int(layer),
                            "position": c.get("first_position"),
                            "nan": c["nan"],
                            "pos_inf": c["pos_inf"],
                        }
                    )
    return {"counts": counts, "findings": findings}


def _ledger_patches(ledger: Ledger) -> list:
    """Every patch file the ledger names: the settings', the extra patches, the suspects'."""
    t = ledger.target
    settings = [t.reference] + ([t.candidate] if t.candidate is not None else [])
    return [
        *(st.patch for st in settings if st.patch is not None),
        *t.extra_patches,
        *(s.patch for s in ledger.suspects if s.patch is not None),
    ]
