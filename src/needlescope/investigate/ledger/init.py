"""Ledgers ``needlescope investigate init`` writes for a live deployment: ``--live URL`` (a
working ledger for that endpoint) and ``--from-probe RUN_DIR`` (one whose symptom is the stored
probe's failing cells, against the endpoint that probe measured).

Both are the live route (``candidate = "live"``, docs/investigate.md): nothing can be removed
from a running server, so each suspect is emulated in the reference checkpoint and compared with
the selection the endpoint captures (``live_emulation``). The suspects are the indexer faults a
live capture can tell apart, plus ``index_topk`` when the server advertises a top-k below its
checkpoint's. The reference checkpoint is the served model when ``/get_server_info`` says
``organism`` (or exposes its directory); otherwise the ledger names ``organism`` and says to
edit it, because a live capture must be compared with the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path

from needlescope.errors import BadInput
from needlescope.run.store import ResultStore
from needlescope.targets import collect_provenance, normalize_base_url

__all__ = [
    "BLACKBOX_SYMPTOM",
    "LIVE_SYMPTOM",
    "blackbox_ledger",
    "from_probe_ledger",
    "live_ledger",
    "write_ledger",
]

# A symptom small enough to run on CPU in about a minute (the live route's tested size).
LIVE_SYMPTOM = {"kind": "multiturn", "lengths": [512], "depths": [0, 25, 50, 75, 100], "trials": 2, "seed": 0}
# The black box reads a length x depth grid (positional_bias, graded): two lengths, five depths.
BLACKBOX_SYMPTOM = {
    "kind": "multiturn",
    "lengths": [1024, 2048],
    "depths": [0, 25, 50, 75, 100],
    "trials": 2,
    "seed": 0,
}

_SUSPECTS = (
    ("page_table", "the paged indexer reads the key cache by logical page", 'patch = "fault:indexer_page_table"'),
    ("key_slot", "the indexer writes each key into the wrong cache slot", 'patch = "fault:indexer_key_slot"'),
    ("index_keys_fp8", "fp8 index keys lose the needle's score margin", 'setting = "k=fp8_e4m3"'),
)  # fmt: skip


def _reference_model(info: dict | None) -> tuple[str, str]:
    """(the ledger's ``model``, its comment): the served checkpoint when the server says which."""
    info = info if isinstance(info, dict) else {}
    path = info.get("model_path")
    if info.get("model") == "organism":
        return "organism", "the endpoint serves the shipped organism"
    if isinstance(path, str) and Path(path).is_dir():
        return path, "the endpoint's model directory (/get_server_info model_path)"
    return "organism", "EDIT: the local checkpoint the endpoint serves (its capture is compared with it)"


def _symptom_toml(symptom: dict, why: str) -> list[str]:
    return [
        "[symptom]",
        f"# {why}",
        f'kind = "{symptom["kind"]}"',
        f"lengths = {json.dumps(symptom['lengths'])}",
        f"depths = {json.dumps(symptom['depths'])}",
        f"trials = {symptom['trials']}",
        f"seed = {symptom['seed']}",
        "max_new_tokens = 6",
        "",
    ]


def live_ledger(
    url: str,
    *,
    symptom: dict | None = None,
    why: str = "",
    api_key: str | None = None,
    config: str | None = None,
    topk_endpoint: str | None = None,
    served_model: str | None = None,
    probed_model: str | None = None,
) -> str:
    """The text of a live ledger for the endpoint at ``url`` (its info endpoints are read once):
    a black-box one (``blackbox_ledger``) when the endpoint has no indexer capture
    (``/get_server_info`` missing, or ``enable_return_indexer_topk`` not true). ``config``: the
    served checkpoint's ``config.json`` as the black-box ledger names it; ``topk_endpoint``: its
    second endpoint with a larger top-k; ``served_model``: the model id its chats send (needed
    where ``/v1/models`` lists none); ``probed_model``: the id a probe sent (``--from-probe``), the
    black-box ledger's ``served_model`` unless one is given (a live ledger sends none)."""
    root, v1 = normalize_base_url(url)
    prov = collect_provenance(root, v1, api_key=api_key)
    status = prov.get("status", {})
    if status and all(isinstance(v, str) and v.startswith("error") for v in status.values()):
        raise BadInput(
            f"nothing answers at {root} ({status.get('/get_server_info', next(iter(status.values())))}): "
            "start the server first; 'investigate init --live' reads its /get_server_info"
        )
    if status.get("/get_server_info") in (401, 403):
        # Else a ledger was written from nothing it had read ("EDIT: the local checkpoint"), and
        # the run failed on the same refusal.
        raise BadInput(
            f"{root}/get_server_info answered HTTP {status['/get_server_info']}: the server needs an API "
            "key; pass --api-key (or NEEDLESCOPE_API_KEY), which is sent, never written"
        )
    info = prov.get("/get_server_info")
    model, model_why = _reference_model(info)
    if not (isinstance(info, dict) and info.get("enable_return_indexer_topk") is True):
        served_model = served_model or probed_model
        if served_model is None and not _lists_a_model(prov, info):
            raise BadInput(
                f"{v1}/models lists no model (HTTP {status.get('/v1/models')}) and /get_server_info names "
                "none: pass --served-model ID, the id the endpoint serves (transformers serve: its model path)"
            )
        return blackbox_ledger(
            root,
            model,
            symptom or BLACKBOX_SYMPTOM,
            why,
            config=config,
            served_model=served_model,
            topk_endpoint=topk_endpoint,
        )
    for flag, value in (
        ("--config", config),
        ("--served-model", served_model),
        ("--topk-endpoint", topk_endpoint),
    ):
        if value is not None:
            raise BadInput(
                f"{flag} is for an endpoint without a capture; {root} captures its indexer top-k "
                f"(its ledger is a live one): drop {flag}"
            )
    return _capture_ledger(root, model, model_why, symptom, why, info)


def _capture_ledger(root: str, model: str, model_why: str, symptom: dict | None, why: str, info) -> str:
    """The live ledger's text for an endpoint that captures its indexer top-k: the suspects of
    ``_SUSPECTS``, and the served top-k when ``/get_server_info`` says it is below the checkpoint's."""
    lines = [
        "# needlescope investigation ledger for a live endpoint (needlescope investigate run THIS --out DIR).",
        "# Each suspect is emulated in the reference checkpoint and compared with the selection the",
        "# endpoint captures (/generate with return_indexer_topk); docs/investigate.md.",
        "",
        "[target]",
        f'model = "{model}"   # {model_why}',
        "threads = 2",
        'reference = "k=fp32 q=fp32 acc=fp32 topk=cfg"',
        'candidate = "live"',
        f'endpoint = "{root}"',
        "",
        *_symptom_toml(
            symptom or LIVE_SYMPTOM, why or "multiturn needles at 512 tokens: about a minute on CPU"
        ),
    ]
    suspects = list(_SUSPECTS)
    info = info if isinstance(info, dict) else {}
    topk, own = info.get("index_topk"), info.get("checkpoint_index_topk")
    if isinstance(topk, int) and isinstance(own, int) and topk < own:
        suspects.append(
            (
                "index_topk",
                f"top-{topk} (the checkpoint's is {own}) drops the needle",
                f'setting = "topk={topk}"',
            )
        )
    for i, (sid, hypothesis, mapping) in enumerate(suspects):
        lines += [
            "[[suspects]]",
            f'id = "{sid}"',
            f"tier = {1 + i // 2}",
            f'hypothesis = "{hypothesis}"',
            mapping,
        ]
        lines += ['checks = ["live_emulation"]', ""]
    return "\n".join(lines)


def _lists_a_model(prov: dict, info: object) -> bool:
    """Whether the endpoint says a model id the black box can send: ``/v1/models`` lists one, or
    ``/get_server_info`` names one."""
    listed = prov.get("/v1/models")
    data = listed.get("data") if isinstance(listed, dict) else None
    if isinstance(data, list) and any(isinstance(m, dict) and m.get("id") for m in data):
        return True
    return isinstance(info, dict) and isinstance(info.get("model"), str) and bool(info["model"])


def blackbox_ledger(
    root: str,
    model: str,
    symptom: dict,
    why: str,
    *,
    config: str | None = None,
    topk_endpoint: str | None = None,
    served_model: str | None = None,
) -> str:
    """A black-box ledger (``candidate = "blackbox"``) for an endpoint without a capture: no
    suspects (nothing can be emulated against answers alone); ``config`` names the checkpoint's
    ``config.json`` for the architecture numbers ``/get_server_info`` does not give,
    ``topk_endpoint`` the same deployment served with a larger top-k (``decide.blackbox_topk``),
    ``served_model`` the model id its chats send; a commented ``[blackbox]`` table shows the
    experiments' sizes (``investigate.ledger.blackbox``)."""
    pair = (
        [f'topk_endpoint = "{topk_endpoint}"   # the same deployment with a larger --index-topk']
        if topk_endpoint is not None
        else ['# topk_endpoint = "http://HOST:PORT"   # the same deployment with a larger --index-topk']
    )
    pair.append("# topk_endpoint_topk = 128   # its index_topk, when its /get_server_info does not say it")
    cfg = (
        f'config = "{config}"   # the served checkpoint\'s config.json: its compression ratio and index_topk'
        if config is not None
        else '# config = "config.json"   # the served checkpoint\'s, when /get_server_info does not say its index_topk'
    )
    lines = [
        "# needlescope investigation ledger for an endpoint without an indexer capture (a black box):",
        "# needlescope investigate run THIS --out DIR decides every class decidable from outside",
        "# (answers, prompt logprobs where offered); docs/investigate.md.",
        "",
        "[target]",
        f'model = "{model}"   # its tokenizer sizes the prompts when the endpoint has no /tokenize',
        'reference = "k=fp32 q=fp32 acc=fp32 topk=cfg"',
        'candidate = "blackbox"',
        f'endpoint = "{root}"',
        cfg,
        *pair,
        *(
            [f"served_model = {json.dumps(served_model)}   # the model id the chats send"]
            if served_model
            else []
        ),
        "",
        *_symptom_toml(symptom, why or "a length x depth grid at 1K and 2K tokens"),
        "# [blackbox]             # the experiments after a loss, at their default sizes",
        "# dense_cases = 6        # cases at the dense length (ratio x top-k - 1 tokens)",
        "# failing_cases = 3      # failing cases sent again alone and teacher-forced",
        "# scan_depths = 3        # failing depths of the residue scan",
        "",
    ]
    return "\n".join(lines)


def from_probe_ledger(run_dir: str | Path, *, api_key: str | None = None) -> str:
    """A live ledger whose symptom is the failing cells of the probe run in ``run_dir``
    (recall below its threshold): their lengths and depths, its kind, trials and seed."""
    run_dir = Path(run_dir)
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file() or not (run_dir / "results.sqlite").is_file():
        raise BadInput(
            f"--from-probe {run_dir} holds no finished probe (summary.json, results.sqlite); give a probe --out"
        )
    try:
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
        cells, threshold = summary["cells"], summary["threshold"]
    except (ValueError, KeyError, TypeError) as e:
        raise BadInput(
            f"--from-probe: {summary_path} is not a probe summary ({e}); re-run the probe"
        ) from None
    failing = [c for c in cells if c.get("n") and c["recall"] < threshold]
    if not failing:
        raise BadInput(
            f"--from-probe: no cell of {run_dir} recalls below {threshold:g}; nothing to investigate"
        )
    with ResultStore(run_dir / "results.sqlite") as store:
        fingerprint = store.get_meta("fingerprint") or {}
    root = (summary.get("provenance") or {}).get("root")
    if not root:
        raise BadInput(f"--from-probe: {summary_path} does not name the probed endpoint; use --live URL")
    symptom = {
        "kind": summary["kind"],
        "lengths": sorted({int(c["length"]) for c in failing}),
        "depths": sorted({c["depth"] for c in failing}),
        "trials": int(fingerprint.get("trials", 2)),
        "seed": int(fingerprint.get("seed", 0)),
    }
    where = ", ".join(f"{c['length']}@{c['depth']:g}% ({c['correct']}/{c['n']})" for c in failing)
    why = f"the failing cells of {run_dir} (recall < {threshold:g}): {where}"
    model = summary.get("model")
    return live_ledger(
        root,
        symptom=symptom,
        why=why[:300],
        api_key=api_key,
        probed_model=model if isinstance(model, str) else None,
    )


def write_ledger(directory: str | Path, text: str, *, force: bool = False) -> Path:
    """Write ``text`` as ``directory/investigation.toml`` (refusing to overwrite unless ``force``)."""
    path = Path(directory) / "investigation.toml"
    if path.exists() and not force:
        raise BadInput(f"{path} exists; pass --force to overwrite or choose another directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path
