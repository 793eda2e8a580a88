"""Every difference between the candidate and the reference, and the suspects that cover them.

An investigation is only as good as what it does when the cause is not on the ledger. Before
any check, ``differences(ledger)`` lists the complete difference between the candidate and the
reference:

* each ``Setting`` field (``index_k``, ``index_q``, ``score_dtype``, ``index_topk``,
  ``hadamard``) whose candidate value differs from the reference's;
* each patch the candidate carries that the reference does not (its ``patch=`` and every
  ``extra_patches`` entry), and a reference patch the candidate lacks;
* each variable of the deployment's env file (``env_file``) whose value differs from the
  reference's env file (``reference_env_file``; without one the reference environment is
  empty, so every variable of the deployment's file is a difference);
* for a live candidate, each ``/get_server_info`` field that names a ``Setting`` field
  (``server_info_differences``) and differs from what the reference would report.

A difference is **covered** by a ledger suspect that names it: a ``setting`` suspect naming the
field with the candidate's value, a ``patch`` suspect naming the same file, an ``env`` question
naming the variable, a ``server_info`` question naming the field. An uncovered difference becomes
an **automatic suspect** ``auto:<field or file>`` in its own tier (after the ledger's), checked
by ablation in both directions (removed from the candidate; added alone to the reference). An
environment variable or a server field cannot be applied to the in-process reference, so its
automatic suspect is ``blocked`` with that reason (``testable`` false), never dropped.

``verdicts.json`` lists the uncovered ones under ``unaccounted_differences`` (schema in
``verdicts.VERDICTS_SCHEMA``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from needlescope.investigate.ledger.ledger import Ledger, Suspect
from needlescope.setting import PatchRef, Setting

__all__ = [
    "SETTING_FIELDS",
    "AUTO_PREFIX",
    "Difference",
    "differences",
    "server_info_differences",
    "auto_suspects",
    "read_env_file",
    "file_slug",
    "present_in",
    "presence_check",
]

SETTING_FIELDS = ("index_k", "index_q", "score_dtype", "index_topk", "hadamard")
AUTO_PREFIX = "auto:"


@dataclass(frozen=True)
class Difference:
    """One difference; ``reference`` / ``candidate`` are the values as text (None: absent)."""

    kind: str
    """"setting" | "patch" | "env" | "server_info"."""
    name: str
    """The field, the patch (relative to the ledger), the variable or the server field."""
    reference: str | None
    candidate: str | None
    covered_by: tuple[str, ...]
    patch: PatchRef | None = None
    value: object = None
    """The candidate's Setting value of a ``setting`` difference (for the automatic suspect)."""

    @property
    def suspect(self) -> str:
        return AUTO_PREFIX + self.name

    @property
    def testable(self) -> bool:
        """Whether a causal check can test it: an ablation (settings and candidate patches) or, on a
        live endpoint, an emulation (a server field that is a Setting value or a built-in fault)."""
        if self.kind == "server_info":
            return self.value is not None or self.patch is not None
        return self.kind == "setting" or (self.kind == "patch" and self.candidate is not None)

    def to_record(self) -> dict:
        """Every field as JSON (``from_record`` reads it back; a golden ``Measured`` holds it):
        the patch by its spec, the value as it is (a field's text, number or flag)."""
        return {
            "kind": self.kind,
            "name": self.name,
            "reference": self.reference,
            "candidate": self.candidate,
            "covered_by": list(self.covered_by),
            "patch": None if self.patch is None else self.patch.spec,
            "value": self.value,
        }

    @classmethod
    def from_record(cls, obj: dict) -> Difference:
        patch = None if obj["patch"] is None else PatchRef(obj["patch"], Path(obj["patch"]))
        fields = {k: obj[k] for k in ("kind", "name", "reference", "candidate", "value")}
        return cls(**fields, covered_by=tuple(obj["covered_by"]), patch=patch)

    def to_json(self, verdict: str | None = None) -> dict:
        return {
            "kind": self.kind,
            "name": self.name,
            "reference": self.reference,
            "candidate": self.candidate,
            "covered_by": list(self.covered_by),
            "suspect": None if self.covered_by else self.suspect,
            "testable": self.testable,
            "verdict": verdict,
        }


def _text(v) -> str:
    if v is None:
        return "cfg"
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(v)


def shown(spec: str, base: Path) -> str:
    """A patch spec relative to the ledger's directory when the file lies under it."""
    p = Path(spec)
    return str(p.relative_to(base)) if p.is_absolute() and p.is_relative_to(base) else spec


def env_lines(text: str, sep: str) -> dict[str, str]:
    """``KEY=value`` items of an env file (``sep="\n"``) or of /proc/PID/environ (``sep="\0"``);
    ``export`` prefixes, comments and quotes dropped."""
    out = {}
    for item in text.split(sep):
        item = item.strip()
        if item.startswith("export "):
            item = item[len("export ") :]
        if not item or item.startswith("#") or "=" not in item:
            continue
        k, _, v = item.partition("=")
        out[k.strip()] = v.strip().strip('"').strip("'")
    return out


def read_env_file(path: Path | None) -> dict[str, str]:
    """The variables of env file ``path`` as the ``env`` questions read them; {} for None."""
    # bytes that are not UTF-8 are read as U+FFFD, as a process environment is (``questions._env``)
    return {} if path is None else env_lines(Path(path).read_bytes().decode("utf-8", "replace"), "\n")


def _question_names(s: Suspect, qtype: str, key: str) -> set[str]:
    return {str(q.params.get(key)) for q in s.questions if q.type == qtype}


def _setting_differences(ref: Setting, cand: Setting, suspects) -> list[Difference]:
    out = []
    for f in SETTING_FIELDS:
        rv, cv = getattr(ref, f), getattr(cand, f)
        if rv == cv:
            continue
        cover = tuple(s.id for s in suspects if (f, cv) in s.setting_fields)
        out.append(Difference("setting", f, _text(rv), _text(cv), cover, value=cv))
    return out


def _patch_differences(ledger: Ledger, suspects) -> list[Difference]:
    t, base = ledger.target, ledger.path.parent
    cand = [p for p in ((t.candidate.patch,) if t.candidate.patch else ()) + t.extra_patches]
    ref = [t.reference.patch] if t.reference.patch is not None else []
    ref_paths, cand_paths = {p.path for p in ref}, {p.path for p in cand}
    out = []
    for p in cand:
        if p.path in ref_paths:
            continue
        cover = tuple(s.id for s in suspects if s.patch is not None and s.patch.path == p.path)
        out.append(Difference("patch", shown(p.spec, base), None, shown(p.spec, base), cover, patch=p))
    for p in ref:
        if p.path not in cand_paths:
            out.append(Difference("patch", shown(p.spec, base), shown(p.spec, base), None, (), patch=p))
    return out


def _env_differences(ledger: Ledger, suspects) -> list[Difference]:
    t = ledger.target
    cand, ref = read_env_file(t.env_file), read_env_file(t.reference_env_file)
    out = []
    for name in sorted(set(cand) | set(ref)):
        if cand.get(name) == ref.get(name):
            continue
        cover = tuple(s.id for s in suspects if name in _question_names(s, "env", "name"))
        out.append(Difference("env", name, ref.get(name), cand.get(name), cover))
    return out


def differences(ledger: Ledger) -> list[Difference]:
    """Every difference of an in-process candidate from the reference (module docstring).

    Env files that cannot be read give no env differences here (the env questions report why)."""
    suspects = ledger.suspects
    t = ledger.target
    out = _setting_differences(t.reference, t.candidate, suspects) if t.candidate else []
    if t.candidate is not None:
        out += _patch_differences(ledger, suspects)
    try:
        out += _env_differences(ledger, suspects)
    except OSError:
        pass
    return out


def _setting_value(field: str, got):
    """A server field's value as a ``Setting`` value (None when it is not one)."""
    from needlescope.errors import BadInput

    try:
        return getattr(Setting(**{field: int(got) if field == "index_topk" else str(got)}), field)
    except (BadInput, TypeError, ValueError):
        return None


def server_info_differences(
    info: dict, reference: Setting, checkpoint_topk: int, suspects
) -> list[Difference]:
    """Differences between a live server's ``/get_server_info`` and what the reference would
    report: every ``Setting`` field the server names (``index_topk`` of the reference is the
    checkpoint's when it keeps ``cfg``), and ``patch`` (a built-in ``fault:NAME`` resolves, so
    its automatic suspect can be emulated; any other patch is only reported)."""
    from needlescope.errors import BadInput
    from needlescope.targets.sglang import find_key

    want = {f: getattr(reference, f) for f in SETTING_FIELDS if f != "hadamard"}
    want["index_topk"] = reference.index_topk or checkpoint_topk
    want["patch"] = reference.patch.spec if reference.patch else None
    out = []
    for f, rv in want.items():
        got = find_key(info or {}, f)
        if got is None or got == "none" or str(got) == str(rv):
            continue
        cover = tuple(
            s.id
            for s in suspects
            if f in _question_names(s, "server_info", "field")
            or any(name == f and str(v) == str(got) for name, v in s.setting_fields)
            or (f == "patch" and s.patch is not None and s.patch.spec == str(got))
        )
        patch = value = None
        if f == "patch":
            try:
                patch = PatchRef.resolve(str(got)) if str(got).startswith("fault:") else None
            except BadInput:
                patch = None
        else:
            value = _setting_value(f, got)
        rtext = None if rv is None else str(rv)
        out.append(Difference("server_info", f, rtext, str(got), cover, patch=patch, value=value))
    return out


def file_slug(sid: str) -> str:
    """A suspect id as a file-name part (automatic ids hold ':' and '/')."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", sid)


def auto_suspects(diffs: list[Difference], ledger: Ledger) -> list[Suspect]:
    """One automatic suspect per uncovered difference, in a tier after the ledger's."""
    tier = max((s.tier for s in ledger.suspects), default=0) + 1
    out = []
    for d in diffs:
        if d.covered_by:
            continue
        check = "live_emulation" if ledger.target.live else "ablation"
        why = {
            "setting": f"the candidate's {d.name}={d.candidate} (reference {d.reference}) changes recall",
            "patch": f"the patch {d.name} the candidate carries changes recall",
            "env": f"the environment variable {d.name}={d.candidate} (reference {d.reference}) changes recall",
            "server_info": f"the server's {d.name}={d.candidate} (reference {d.reference}) changes recall",
        }[d.kind]
        out.append(
            Suspect(
                id=d.suspect,
                tier=tier,
                hypothesis=f"not named by the ledger: {why}",
                checks=(check,) if d.testable else (),
                patch=d.patch if d.patch is not None and d.candidate is not None else None,
                setting_fields=((d.name, d.value),) if d.kind == "setting" or d.value is not None else (),
            )
        )
    return out


def present_in(s: Suspect, cand: Setting, extra, ref: Setting) -> bool:
    if s.id.startswith(AUTO_PREFIX) and s.patch is None and not s.setting_fields:
        return True  # an environment or server difference: present by construction
    """Whether suspect ``s`` is in the candidate (its patch carried, or its field values set and
    differing from the reference's); an automatic environment or server suspect always is."""
    if s.patch is not None:
        specs = {p.path for p in extra} | ({cand.patch.path} if cand.patch else set())
        return s.patch.path in specs
    return all(getattr(cand, f) == v for f, v in s.setting_fields) and any(
        getattr(ref, f) != v for f, v in s.setting_fields
    )


def _shown(spec: str, base: Path | None) -> str:
    """A patch spec as the ledger wrote it: file paths relative to the ledger's directory."""
    return spec if base is None else shown(spec, base)


def presence_check(s: Suspect, cand: Setting, extra, ref: Setting, base: Path | None = None) -> str:
    """What the configuration check found: why ``s`` is (or is not) in the candidate, in words
    (``base``: the ledger's directory, to show patch files as the ledger names them)."""
    if s.patch is not None:
        carried = [_shown(p.spec, base) for p in extra] + (
            [_shown(cand.patch.spec, base)] if cand.patch else []
        )
        where = ", ".join(carried) if carried else "none"
        verb = "is" if present_in(s, cand, extra, ref) else "is not"
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
