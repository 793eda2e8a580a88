"""The investigation ledger (``investigation.toml``): target, symptom and suspects, validated.

A ledger is written by the user (``needlescope investigate init`` writes a commented example,
``EXAMPLE_LEDGER``). ``load_ledger(path)`` parses and validates it; every error is a
``BadInput`` naming the file, the line, what was found and what was expected. Unknown question
and check types are refused up front, before anything runs.

Structure (paths are relative to the ledger's directory)::

    [target]
    model = "organism"                  # reference checkpoint: 'organism' or a DeepSeek-V4 dir
    device = "cpu"
    threads = 2                         # torch threads for the in-process measurements
    # prefill_chunk = 1024              # run prompts through the KV cache in chunks (docs/scale.md)
    reference = "k=fp32 q=fp32 acc=fp32 topk=cfg"        # a Setting (needlescope.setting)
    candidate = "k=fp8_e4m3 q=fp32 acc=fp32 topk=64 patch=fault:indexer_page_table"
    # candidate = "live"                # or: the endpoint below IS the candidate (live route)
    # candidate = "dump"                # or: an engine's tensor dump is the candidate (dump route):
    # dump = "dumps/run1"               #   SGLang dumper layout (docs/dsa_dump.md); dump_mapping = FILE.toml
    extra_patches = []                  # more candidate patch files (not indexer-scorer patches)
    endpoint = ""                       # a live server (server_info questions); "" = none
    env_file = ""                       # the deployment's env file (env questions)
    reference_env_file = ""             # the reference's env file ("" = an empty environment)

    [symptom]
    kind = "multiturn"                  # probe spec, measured in-process on the reference checkpoint
    lengths = [256, 512, 1024]
    depths = [0, 50, 100]
    trials = 2
    seed = 0

    [[suspects]]
    id = "index_keys_fp8"
    tier = 2
    hypothesis = "fp8 index keys flip near-margin entries out of the top-k"
    setting = "k=fp8_e4m3"              # the suspect is these Setting fields ...
    # patch = "patches/x.py"            # ... or this patch file (or fault:NAME)
    checks = ["audit:index_keys_fp8", "ablation"]   # live route: ["live_emulation"]
    [[suspects.questions]]
    type = "env"                        # env | server_info | checkpoint_dtype | config | source
    name = "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH"

A suspect is *present* in the candidate when the candidate carries its patch, or when the
candidate's value of every field its ``setting`` names equals the suspect's value (and differs
from the reference's). Its **removal** from the candidate puts those fields back to the
reference's values (or drops the patch); its **addition** to the reference sets them (or
applies the patch).

With ``candidate = "live"`` (an ``endpoint`` is then required) nothing can be ablated: a
suspect's causal check is ``live_emulation``; ``ablation`` there (or ``live_emulation`` with an
in-process candidate), and ``extra_patches`` with a live candidate, are refused up front.

With ``candidate = "dump"`` (``dump`` then names the dump directory) the candidate is an engine's
tensor dump of one request (``dsa.compare_dump``): nothing runs it, so a suspect has no checks
(only questions); the localization comes from comparing the dump with the reference.

With ``candidate = "blackbox"`` (an endpoint without a capture) the ledger has no checks; it may
name ``config`` (the served ``config.json``) and ``served_model`` (the id its chats send) and
carry a ``[blackbox]`` table sizing the experiments (``investigate.ledger.blackbox``).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from needlescope.cases import KINDS
from needlescope.errors import BadInput
from needlescope.investigate.ledger.blackbox import BlackboxPlan, parse_blackbox, parse_topk_pair
from needlescope.investigate.ledger.checks import Tracked, Where, expect, read_utf8, suggestion
from needlescope.setting import PatchRef, Setting, check_chunk

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "QUESTION_TYPES",
    "CHECK_TYPES",
    "AUDIT_CHECKS",
    "SETTING_KEYS",
    "Question",
    "Suspect",
    "Target",
    "Symptom",
    "Ledger",
    "load_ledger",
    "parse_ledger",
    "partial_setting",
]

QUESTION_TYPES: dict[str, tuple[str, ...]] = {
    # type -> required keys (besides "type"); optional for all: "expect", "means_absent"
    "env": ("name",),
    "server_info": ("field",),
    "checkpoint_dtype": ("pattern",),
    "config": ("key",),
    "source": ("path", "pattern"),
}
"""Cheap question types and the keys each needs: exactly the types ``measure.questions.ASKERS``
answers (tests/test_name_lists.py)."""

AUDIT_CHECKS = (
    "hc_mix_bf16",
    "routed_scale",
    "decode_splitk_bf16",
    "indexer_scores_bf16",
    "index_keys_fp8",
    "index_topk",
)
"""Built-in numerics checks: exactly the names of ``audit.checks.CHECKS`` (tests/test_name_lists.py),
spelled here because the ledger is read without torch, which ``audit`` loads."""

CHECK_TYPES = ("ablation", "live_emulation", *(f"audit:{name}" for name in AUDIT_CHECKS))
"""Check types a suspect may list: the causal ablation (in-process candidate), the live
emulation (``candidate = "live"``: the suspect emulated in the reference, compared with the live
endpoint's indexer capture) and each audit check."""

LIVE = "live"
BLACKBOX = "blackbox"
"""``candidate = "blackbox"``: the candidate is an endpoint without an indexer capture (vLLM): only
its answers and, where it offers them, its prompt logprobs are read (``measure.blackbox``)."""
DUMP = "dump"
"""``candidate = "dump"``: the candidate is an engine's tensor dump (``dump = "DIR"``)."""
"""``candidate = "live"``: the candidate is the live endpoint itself (nothing to ablate)."""

SETTING_KEYS = {
    "k": "index_k",
    "q": "index_q",
    "acc": "score_dtype",
    "topk": "index_topk",
    "hadamard": "hadamard",
}
"""Keys of the Setting text form a suspect's ``setting`` may name."""

_ID = re.compile(r"^[a-z0-9][a-z0-9_]*$")


@dataclass(frozen=True)
class Question:
    """A cheap question: one value read without running the model."""

    type: str
    params: dict
    expect: str | None = None
    means_absent: str | None = None
    """When the answer (as text) equals this, the suspect is not in the deployment."""


@dataclass(frozen=True)
class Suspect:
    id: str
    tier: int
    hypothesis: str
    checks: tuple[str, ...]
    questions: tuple[Question, ...] = ()
    patch: PatchRef | None = None
    setting_fields: tuple[tuple[str, object], ...] = ()
    """(Setting field name, value) pairs, e.g. (("index_k", "fp8_e4m3"),)."""
    line: int = 0

    def kind(self) -> str:
        return "patch" if self.patch is not None else "setting"


@dataclass(frozen=True)
class Target:
    model: str
    reference: Setting
    candidate: Setting | None
    """None when the candidate is the live endpoint (``candidate = "live"``)."""
    extra_patches: tuple[PatchRef, ...] = ()
    device: str = "cpu"
    threads: int = 2
    endpoint: str | None = None
    env_file: Path | None = None
    reference_env_file: Path | None = None
    """The reference's env file (``investigate.ledger.differences``); None: an empty environment."""
    prefill_chunk: int | None = None
    """Every in-process pass runs its prompt through the model's KV cache in chunks of this many
    tokens (``dsa.passes``: peak memory bounded by the chunk); None: one forward per prompt."""
    dump: Path | None = None
    """The engine dump that is the candidate (``candidate = "dump"``); None otherwise."""
    dump_mapping: Path | None = None
    """Its mapping file (``dsa.dump_mapping``); None: the shipped SGLang DeepSeek-V4 one."""
    blackbox: bool = False
    """``candidate = "blackbox"``: the endpoint answers without an indexer capture."""
    config: Path | None = None
    """The served checkpoint's ``config.json`` (black box: its compression ratio and
    ``index_topk`` when ``/get_server_info`` does not say them)."""
    topk_endpoint: str | None = None
    """Black box: a second endpoint serving the same deployment with a larger ``index_topk``
    (``decide.blackbox_topk``); None: no top-k pair."""
    topk_endpoint_topk: int | None = None
    """That endpoint's ``index_topk`` when its ``/get_server_info`` does not say it (vLLM)."""
    served_model: str | None = None
    """The model id the black box sends with every chat; None: the first ``/v1/models`` lists
    (a server that lists none, such as ``transformers serve`` offline, needs it)."""

    @property
    def live(self) -> bool:
        return self.candidate is None and self.dump is None and not self.blackbox


@dataclass(frozen=True)
class Symptom:
    kind: str = "multiturn"
    lengths: tuple[int, ...] = (256, 512, 1024)
    depths: tuple[float, ...] = (0.0, 50.0, 100.0)
    trials: int = 2
    seed: int = 0
    max_new_tokens: int = 8

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "lengths": list(self.lengths),
            "depths": list(self.depths),
            "trials": self.trials,
            "seed": self.seed,
        }


@dataclass(frozen=True)
class Ledger:
    path: Path
    target: Target
    symptom: Symptom
    suspects: tuple[Suspect, ...] = field(default=())
    blackbox: BlackboxPlan = field(default=BlackboxPlan())
    """The ``[blackbox]`` table (``candidate = "blackbox"`` only; its defaults otherwise)."""

    def ordered_suspects(self) -> list[Suspect]:
        """Suspects in tier order (stable within a tier)."""
        return sorted(self.suspects, key=lambda s: s.tier)


def partial_setting(text: str) -> tuple[tuple[str, object], ...]:
    """The (field, value) pairs of a partial Setting text such as ``"k=fp8_e4m3 topk=64"``."""
    names = []
    for token in text.split():
        key = token.partition("=")[0]
        if key not in SETTING_KEYS:
            raise BadInput(f"setting key {key!r} is not one of {', '.join(SETTING_KEYS)} (e.g. 'k=fp8_e4m3')")
        names.append(SETTING_KEYS[key])
    if not names:
        raise BadInput("empty setting; name at least one field, e.g. 'k=fp8_e4m3'")
    full = Setting.parse(text)  # validates every value
    return tuple((n, getattr(full, n)) for n in names)


def _device(where: Where, line: int, target: dict) -> str:
    """``device``: cpu, cuda or cuda:N (whether this machine has it is checked when the run starts)."""
    device = expect(where, line, target, "device", str, "cpu | cuda | cuda:N", "cpu")
    kind, _, index = device.partition(":")
    if device != "cpu" and (kind != "cuda" or (index and not index.isdigit())):
        raise where.error(
            where.key_line("device", line), f"device = {device!r}; expected cpu | cuda | cuda:N"
        )
    return device


def _patch(where: Where, line: int, spec: str, base: Path) -> PatchRef:
    if not spec.startswith("fault:"):
        spec = str(where.path_inside(spec, base, line, "patch file"))
    try:
        return PatchRef.resolve(spec)
    except BadInput as exc:
        raise where.error(line, str(exc)) from None


def _setting(where: Where, line: int, text: str, base: Path) -> Setting:
    try:
        parsed = Setting.parse(" ".join(t for t in text.split() if not t.startswith("patch=")))
    except BadInput as exc:
        raise where.error(line, str(exc)) from None
    patches = [t.partition("=")[2] for t in text.split() if t.startswith("patch=")]
    return parsed.with_(patch=_patch(where, line, patches[0], base)) if patches else parsed


def _question(where: Where, line: int, q: dict) -> Question:
    if not isinstance(q, dict):
        raise where.error(line, "a question must be a table ([[suspects.questions]])")
    qtype = q.get("type")
    if qtype not in QUESTION_TYPES:
        raise where.error(
            where.key_line("type", line),
            f"unknown question type {qtype!r}; expected one of {', '.join(QUESTION_TYPES)}",
        )
    for key in QUESTION_TYPES[qtype]:
        expect(
            where, line, q, key, str, f"a string ({qtype} questions need {', '.join(QUESTION_TYPES[qtype])})"
        )
    allowed = ("type", "expect", "means_absent", *QUESTION_TYPES[qtype])
    for key in q:
        if key not in allowed:
            raise where.error(
                where.key_line(key, line),
                f"unknown key {key!r} in a {qtype} question{suggestion(key, allowed)}; expected {', '.join(allowed)}",
            )
    if qtype == "source":
        # The folder part of the glob (up to its first wildcard) must stay in the ledger's folder.
        parts = Path(q["path"]).parts
        fixed = Path(
            *parts[: next((i for i, p in enumerate(parts) if any(c in p for c in "*?[")), len(parts))] or "."
        )
        where.path_inside(str(fixed), where.path.parent, where.key_line("path", line), "source path")
    params = {k: v for k, v in q.items() if k not in ("type", "expect", "means_absent")}
    return Question(
        type=qtype,
        params=params,
        expect=None if q.get("expect") is None else str(q["expect"]),
        means_absent=None if q.get("means_absent") is None else str(q["means_absent"]),
    )


def _suspect(where: Where, index: int, s: dict, base: Path) -> Suspect:
    line = where.suspect_line(index)
    sid = expect(where, line, s, "id", str, "a lower-case identifier such as 'index_keys_fp8'")
    if not _ID.match(sid):
        raise where.error(
            where.key_line("id", line), f"id = {sid!r}; expected lower-case letters, digits, '_'"
        )
    tier = where.in_range(
        "tier", expect(where, line, s, "tier", int, "an integer risk tier (1 = most likely)"), line
    )
    hyp = expect(where, line, s, "hypothesis", str, "a sentence saying what the suspect would do")
    checks = s.get("checks", [])
    if not isinstance(checks, list) or not all(isinstance(c, str) for c in checks):
        raise where.error(where.key_line("checks", line), "checks must be a list of strings")
    for c in checks:
        if c not in CHECK_TYPES:
            raise where.error(
                where.key_line("checks", line),
                f"unknown check type {c!r}; expected one of {', '.join(CHECK_TYPES)}",
            )
    if len(set(checks)) != len(checks):  # one check's evidence recorded twice would count twice
        twice = sorted({c for c in checks if checks.count(c) > 1})
        raise where.error(where.key_line("checks", line), f"checks name {', '.join(twice)} more than once")
    has_patch, has_setting = "patch" in s, "setting" in s
    if has_patch == has_setting:
        raise where.error(line, f'suspect {sid!r} needs exactly one of patch = "FILE" or setting = "k=..."')
    patch = setting_fields = None
    if has_patch:
        patch = _patch(
            where,
            where.key_line("patch", line),
            expect(where, line, s, "patch", str, "a file or fault:NAME"),
            base,
        )
    else:
        text = expect(where, line, s, "setting", str, "Setting fields such as 'k=fp8_e4m3'")
        try:
            setting_fields = partial_setting(text)
        except BadInput as exc:
            raise where.error(where.key_line("setting", line), str(exc)) from None
    questions = s.get("questions", [])
    if not isinstance(questions, list):
        raise where.error(line, "questions must be an array of tables ([[suspects.questions]])")
    known = ("id", "tier", "hypothesis", "checks", "patch", "setting", "questions")
    unknown = sorted(set(s) - set(known))
    if unknown:
        raise where.error(
            where.key_line(unknown[0], line),
            f"unknown key(s) {', '.join(unknown)} in suspect {sid!r}{suggestion(unknown[0], known)}",
        )
    return Suspect(
        id=sid,
        tier=tier,
        hypothesis=hyp,
        checks=tuple(checks),
        questions=tuple(_question(where, line, q) for q in questions),
        patch=patch,
        setting_fields=setting_fields or (),
        line=line,
    )


def _target(where: Where, t: dict, base: Path) -> Target:
    tl = where.table_line("target")
    env_file = t.get("env_file") or None
    ref_env = t.get("reference_env_file") or None
    cand_text = expect(where, tl, t, "candidate", str, "a Setting such as 'k=fp8_e4m3 topk=64', or 'live'")
    endpoint = t.get("endpoint") or None
    dump = _dump_paths(where, t, tl, base, cand_text.strip() == DUMP)
    if cand_text.strip() in (LIVE, BLACKBOX) and not endpoint:
        raise where.error(
            where.key_line("candidate", tl),
            f'candidate = "{cand_text.strip()}" needs endpoint = "http://HOST:PORT" (the live server)',
        )
    config = t.get("config") or None
    served = (
        expect(where, tl, t, "served_model", str, "a model id such as 'my-model'")
        if "served_model" in t
        else None
    )
    for key, value in (("config", config), ("served_model", served)):
        if value is not None and cand_text.strip() != BLACKBOX:
            raise where.error(where.key_line(key, tl), f'{key} is used only with candidate = "blackbox"')
    if served is not None and not served.strip():
        raise where.error(
            where.key_line("served_model", tl), "served_model is empty; expected the endpoint's model id"
        )
    topk_endpoint, topk_endpoint_topk = parse_topk_pair(where, t, tl, endpoint, cand_text.strip() == BLACKBOX)
    target = Target(
        model=expect(where, tl, t, "model", str, "'organism' or a checkpoint directory"),
        reference=_setting(
            where,
            where.key_line("reference", tl),
            expect(where, tl, t, "reference", str, "a Setting", "k=fp32"),
            base,
        ),
        candidate=None
        if cand_text.strip() in (LIVE, DUMP, BLACKBOX)
        else _setting(where, where.key_line("candidate", tl), cand_text, base),
        blackbox=cand_text.strip() == BLACKBOX,
        topk_endpoint=topk_endpoint,
        topk_endpoint_topk=topk_endpoint_topk,
        config=None
        if config is None
        else where.path_inside(config, base, where.key_line("config", tl), "config"),
        served_model=served,
        dump=dump[0],
        dump_mapping=dump[1],
        extra_patches=tuple(
            _patch(where, where.key_line("extra_patches", tl), p, base) for p in t.get("extra_patches", [])
        ),
        device=_device(where, tl, t),
        threads=expect(where, tl, t, "threads", int, "a positive integer", 2),
        prefill_chunk=expect(
            where, tl, t, "prefill_chunk", int, "a positive number of tokens (leave it out for one pass)"
        )
        if "prefill_chunk" in t
        else None,
        endpoint=endpoint,
        env_file=None
        if env_file is None
        else where.path_inside(env_file, base, where.key_line("env_file", tl), "env_file"),
        reference_env_file=None
        if ref_env is None
        else where.path_inside(ref_env, base, where.key_line("reference_env_file", tl), "reference_env_file"),
    )
    where.in_range("threads", target.threads, tl)
    if target.prefill_chunk is not None:
        where.in_range("prefill_chunk", target.prefill_chunk, tl)
    if target.candidate is None and target.extra_patches:
        raise where.error(
            where.key_line("extra_patches", tl),
            'extra_patches describe an in-process candidate; with candidate = "live" or "dump" leave them out',
        )
    return target


def _dump_paths(where: Where, t: dict, tl: int, base: Path, wanted: bool) -> tuple[Path | None, Path | None]:
    """(dump directory, mapping file) of ``candidate = "dump"``; both None for other candidates."""
    if not wanted:
        for key in ("dump", "dump_mapping"):
            if t.get(key):
                raise where.error(where.key_line(key, tl), f'{key} is used only with candidate = "dump"')
        return None, None
    spec = t.get("dump")
    if not isinstance(spec, str) or not spec:
        raise where.error(
            where.key_line("candidate", tl),
            'candidate = "dump" needs dump = "DIR" (the engine\'s tensor dump)',
        )
    path = where.path_inside(spec, base, where.key_line("dump", tl), "dump")
    if not path.is_dir():
        raise where.error(where.key_line("dump", tl), f"dump {spec!r} is not a directory")
    mapping = t.get("dump_mapping") or None
    if mapping is not None:
        mapping = where.path_inside(mapping, base, where.key_line("dump_mapping", tl), "dump_mapping")
    return path, mapping


def with_chunk(ledger: Ledger, prefill_chunk: int | None) -> Ledger:
    """``ledger`` with its ``prefill_chunk`` replaced (``investigate run --prefill-chunk``);
    unchanged when None. BadInput for a chunk that is not a positive token count."""
    if prefill_chunk is None:
        return ledger
    return replace(ledger, target=replace(ledger.target, prefill_chunk=check_chunk(prefill_chunk)))


def _check_routes(where: Where, target: Target, suspects: tuple[Suspect, ...]) -> None:
    """Refuse a check the target's route cannot run: ablation needs an in-process candidate,
    live_emulation a live one."""
    wrong = "ablation" if target.live else "live_emulation"
    for s in suspects:
        if target.blackbox and s.checks:
            raise where.error(
                where.key_line("checks", s.line),
                f"suspect {s.id!r}: an endpoint without a capture cannot be ablated or emulated against; "
                'with candidate = "blackbox" leave checks out (the characterization reads its answers)',
            )
        if target.dump is not None and s.checks:
            raise where.error(
                where.key_line("checks", s.line),
                f"suspect {s.id!r}: a tensor dump cannot be ablated, emulated against or audited; with "
                'candidate = "dump" leave checks out and ask questions (the localization comes from the dump)',
            )
        if wrong in s.checks:
            need = (
                'an in-process candidate Setting (the live endpoint cannot be ablated: use "live_emulation")'
                if wrong == "ablation"
                else 'candidate = "live" and an endpoint (in-process candidates use "ablation")'
            )
            raise where.error(
                where.key_line("checks", s.line), f"suspect {s.id!r}: check {wrong!r} needs {need}"
            )


def parse_ledger(text: str, path: Path, *, allow_outside: bool = False) -> Ledger:
    """Parse ledger ``text`` read from ``path``; BadInput ``FILE:LINE: what`` on any error.

    ``allow_outside``: accept paths outside the ledger's folder (``--allow-outside``)."""
    where = Where(path, text, allow_outside)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        m = re.search(r"line (\d+)", str(exc))
        raise where.error(int(m.group(1)) if m else 1, f"not valid TOML: {exc}") from None
    base = path.parent
    for section in ("target", "symptom"):
        if not isinstance(raw.get(section), dict):
            raise where.error(1, f"missing [{section}] table")
    tables = ("target", "symptom", "suspects", "blackbox")
    unknown = sorted(set(raw) - set(tables))
    if unknown:
        hint = suggestion(unknown[0], tables)
        raise where.error(
            1, f"unknown top-level key(s) {', '.join(unknown)}{hint}; expected {', '.join(tables)}"
        )
    raw["target"], raw["symptom"] = Tracked(raw["target"]), Tracked(raw["symptom"])
    target = _target(where, raw["target"], base)
    sy = raw["symptom"]
    sl = where.table_line("symptom")
    lengths = expect(where, sl, sy, "lengths", list, "a list of token lengths such as [256, 512, 1024]")
    depths = expect(where, sl, sy, "depths", list, "a list of depth percents such as [0, 50, 100]", [50])
    if not lengths or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in lengths):
        raise where.error(where.key_line("lengths", sl), f"lengths = {lengths!r}; expected positive integers")
    for n in lengths:
        where.in_range("lengths", n, sl)
    if not all(isinstance(d, (int, float)) and 0 <= d <= 100 for d in depths):
        raise where.error(where.key_line("depths", sl), f"depths = {depths!r}; expected percents in 0..100")
    symptom = Symptom(
        kind=expect(where, sl, sy, "kind", str, "a case kind such as 'multiturn'", "multiturn"),
        lengths=tuple(lengths),
        depths=tuple(float(d) for d in depths),
        trials=expect(where, sl, sy, "trials", int, "a positive integer", 1),
        seed=expect(where, sl, sy, "seed", int, "an integer", 0) if "seed" in sy else 0,
        max_new_tokens=expect(where, sl, sy, "max_new_tokens", int, "a positive integer", 8),
    )
    if symptom.kind not in KINDS:
        raise where.error(
            where.key_line("kind", sl), f"kind = {symptom.kind!r}; expected one of {', '.join(KINDS)}"
        )
    for key in ("trials", "max_new_tokens", "seed"):
        where.in_range(key, getattr(symptom, key), sl)
    where.no_unknown_keys(sy, sl, "[symptom]")
    where.no_unknown_keys(raw["target"], where.table_line("target"), "[target]")
    suspects_raw = raw.get("suspects", [])
    if not isinstance(suspects_raw, list) or (not suspects_raw and not target.blackbox):
        raise where.error(1, "no suspects; add at least one [[suspects]] table")
    suspects = tuple(_suspect(where, i, s, base) for i, s in enumerate(suspects_raw))
    ids = [s.id for s in suspects]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise where.error(
            where.suspect_line(ids.index(dup[0], ids.index(dup[0]) + 1)),
            f"suspect id {dup[0]!r} appears twice",
        )
    _check_routes(where, target, suspects)
    plan = parse_blackbox(where, raw.get("blackbox"), target.blackbox)
    return Ledger(path=path, target=target, symptom=symptom, suspects=suspects, blackbox=plan)


def load_ledger(path: str | Path, *, allow_outside: bool = False) -> Ledger:
    """Read and validate ``path``; BadInput if it is missing or malformed."""
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"ledger {str(p)!r} does not exist; write one with 'needlescope investigate init'")
    return parse_ledger(
        read_utf8(p, "ledger", "a ledger is a UTF-8 TOML file"), p.resolve(), allow_outside=allow_outside
    )
