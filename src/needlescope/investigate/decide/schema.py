"""The schema of ``verdicts.json`` (``VERDICTS_SCHEMA``, checked by ``verdicts.validate_verdicts``);
docs/investigate.md gives every key with its meaning."""

from __future__ import annotations

from needlescope.schema import record

__all__ = ["VERDICTS_SCHEMA", "INVESTIGATION_SCHEMA"]

_EVIDENCE = {
    "type": "object",
    "required": ["check", "metric", "value", "threshold"],
    "properties": {
        "check": {"type": "string"},
        "metric": {"type": "string"},
        "value": {"type": ["number", "string"]},
        "threshold": {"type": ["number", "null"]},
    },
}
_PAIR = record(
    {
        "n": {"type": "integer"},
        "b": {"type": "integer"},
        "c": {"type": "integer"},
        "p": {"type": "number"},
        "recall_with": {"type": "number"},
        "recall_without": {"type": "number"},
    }
)
_DIFFERENCE = record(
    {
        "kind": {"type": "string"},  # setting | patch | env | server_info
        "name": {"type": "string"},  # field, patch (relative to the ledger), variable, server field
        "reference": {"type": ["string", "null"]},
        "candidate": {"type": ["string", "null"]},
        "covered_by": {"type": "array", "items": {"type": "string"}},  # ledger suspects naming it
        "suspect": {"type": ["string", "null"]},  # the automatic suspect ("auto:NAME"), null when covered
        "testable": {"type": "boolean"},  # an in-process ablation can remove / add it
        "verdict": {"type": ["string", "null"]},  # the automatic suspect's verdict
    }
)
_RESIDUAL = record(
    {
        "removed": {"type": "array", "items": {"type": "string"}},  # implicated suspects taken out
        "config": {"type": "string"},  # the residual candidate's label
        "pair": _PAIR,  # with = residual candidate, without = reference
        "loses": {"type": "boolean"},  # p < ALPHA and b > c
        "text": {"type": "string"},
    }
)
_LOCAL_LAYER = record(
    {
        "layer": {"type": "integer"},
        "topk_overlap": {"type": ["number", "null"]},  # mean Jaccard of the selected sets
        "needle_visible": {"type": "integer"},
        "needle_kept_reference": {"type": ["boolean", "null"]},  # a needle entry selected at the query
        "needle_kept_candidate": {"type": ["boolean", "null"]},
    }
)
_LOCAL_PATH = record(
    {
        "path": {"type": "string"},  # "prefill" (teacher-forced) | "decode" (cache, token by token)
        "diverges": {"type": "boolean"},
        "first_divergent_module": {"type": ["string", "null"]},
        "module_type": {"type": ["string", "null"]},  # its class, e.g. DeepseekV4IndexerScorer
        "layer": {"type": ["integer", "null"]},
        "own_err": {"type": ["number", "string", "null"]},
        "own_budget": {"type": ["number", "string", "null"]},
        "first_departing_layer": {"type": ["integer", "null"]},  # first CSA layer whose selection departs
        "layers": {"type": "array", "items": _LOCAL_LAYER},
        "summary": {"type": "string"},
    }
)
_LOCALIZATION = record(
    {
        "case_id": {"type": "string"},
        "target": {"type": "string"},  # what is localized: the residual candidate, or the candidate itself
        "config": {"type": "string"},  # its label
        "analysed_token": {"type": "integer"},
        "query_pos": {"type": "integer"},
        "paths": {"type": "array", "items": _LOCAL_PATH},
        "diverges_first": {"type": "string"},  # "prefill" | "decode" | "decode only" | "neither"
        "summary": {"type": "string"},
        "command": {"type": "string"},  # reproduces the localizer step
    }
)
_RANK_STATS = record(
    {
        "best_rank": {"type": "integer"},  # the best needle entry's rank (1 = first; ties pessimistic)
        "percentile": {"type": "number"},  # signature.rank_percentile, mid-p: 0 = first, 0.5 = chance
        "needle_selected": {"type": "integer"},  # needle entries in the top-k
    }
)
_NULLABLE_STATS = {"type": ["object", "null"], **{k: v for k, v in _RANK_STATS.items() if k != "type"}}
_RANK_LAYER = record(
    {
        "layer": {"type": "integer"},
        "visible": {"type": "integer"},
        "needle_visible": {"type": "integer"},
        "prefill": _NULLABLE_STATS,  # the candidate, teacher-forced (null: no needle entry visible)
        "decode": _NULLABLE_STATS,  # the candidate, prompt prefilled then answer decoded token by token
        "reference_prefill": _NULLABLE_STATS,
        "reference_decode": _NULLABLE_STATS,
        "prefill_same_as_reference": {"type": "boolean"},  # same selected set at the analysed query
        "decode_same_as_reference": {"type": "boolean"},
        "paths_overlap": {"type": "number"},  # Jaccard of the candidate's prefill and decode selections
    }
)
_RANK_PATHS = record(
    {
        "case_id": {"type": "string"},
        "config": {"type": "string"},  # the candidate's label
        "reference": {"type": "string"},  # the reference at the candidate's index_topk
        "analysed_token": {"type": "integer"},
        "query_pos": {"type": "integer"},
        "layers": {"type": "array", "items": _RANK_LAYER},
        "diverges_first": {"type": "string"},  # "prefill" | "decode only" | "neither"
        "paths_agree": {"type": "boolean"},  # the candidate's rank statistics equal on both paths
        "summary": {"type": "string"},
    }
)
_NONFINITE = record(
    {
        "counts": {"type": "object"},  # configuration -> CSA layer (str) -> {neg_inf, nan, pos_inf}
        "findings": {  # every (configuration, case, layer) with NaN or +inf scores
            "type": "array",
            "items": record(
                {
                    "config": {"type": "string"},
                    "case_id": {"type": "string"},
                    "layer": {"type": "integer"},
                    "position": {"type": ["integer", "null"]},
                    "nan": {"type": "integer"},
                    "pos_inf": {"type": "integer"},
                }
            ),
        },
    }
)
_SUSPECT = record(
    {
        "id": {"type": "string"},
        "tier": {"type": "integer"},
        "verdict": {"type": "string"},
        "reason": {"type": "string"},
        "evidence": {"type": "array", "items": _EVIDENCE},
        "auto": {"type": "boolean"},  # an automatic suspect (an uncovered difference)
        "role": {"type": ["string", "null"]},  # "root cause" | "co-factor" | "workaround" | null
        "necessary": {"type": ["boolean", "null"]},  # removing it restores recall (Holm-adjusted)
        "sufficient": {"type": ["boolean", "null"]},  # added alone to the reference it costs recall
        "p_holm": {"type": ["number", "null"]},
        "power": {"type": ["object", "null"]},  # verdicts.power_check of its ablation
        # live route: path -> the emulation's comparison with the live selection on that path
        # ("prefill" teacher-forced, "decode" the server's way), and "decided_by": the path whose
        # comparison gave the verdict (live_verdict_paths)
        "live_paths": {"type": ["object", "null"]},
    },
    optional=("auto", "role", "necessary", "sufficient", "p_holm", "power", "live_paths"),
)
_CHARACTERIZATION = record(
    {
        "classes": {"type": "array", "items": {"type": "string"}},  # decide.characterize.VOCABULARY
        "where": {"type": ["object", "null"]},
        "evidence": {"type": "object"},  # class -> {"rule", "null", numbers}
        "undecided": {"type": "array", "items": {"type": "string"}},  # what would decide it
        "next": {"type": ["string", "null"]},  # a needlescope command
        "text": {"type": "string"},
        "measured": {"type": "object"},  # in-process: baseline, cells, layers (the rules' inputs)
        "sites": {"type": "array", "items": {"type": "object"}},  # two independent bugs: each class's where
        "topk_pair": {"type": "object"},  # black box: the top-k pair's counts, ruled_out, narrowed_to
    },
    optional=("measured", "sites", "topk_pair"),
)
VERDICTS_SCHEMA: dict = record(
    {
        "symptom": {"type": "object"},
        "root_cause": {"type": ["string", "null"]},
        "root_causes": {"type": "array", "items": {"type": "string"}},
        "signature": {
            "type": "object",
            "required": ["uninformative_ranking", "layers", "collapse_vs_topk"],
            "properties": {
                "uninformative_ranking": {"type": "boolean"},
                "layers": {"type": "array"},
                "collapse_vs_topk": {"type": "array"},
            },
        },
        "suspects": {"type": "array", "items": _SUSPECT},
        "differences": {"type": "array", "items": _DIFFERENCE},
        "unaccounted_differences": {"type": "array", "items": _DIFFERENCE},
        "residual": {"type": ["object", "null"], **{k: v for k, v in _RESIDUAL.items() if k != "type"}},
        "localization": {
            "type": ["object", "null"],
            **{k: v for k, v in _LOCALIZATION.items() if k != "type"},
        },
        "rank_paths": {"type": ["object", "null"], **{k: v for k, v in _RANK_PATHS.items() if k != "type"}},
        "nonfinite_scores": _NONFINITE,
        "characterization": {
            "type": ["object", "null"],
            **{k: v for k, v in _CHARACTERIZATION.items() if k != "type"},
        },
        "multiplicity": record(
            {"method": {"type": "string"}, "tests": {"type": "integer"}, "alpha": {"type": "number"}}
        ),
    },
    optional=("characterization",),
)
"""``verdicts.json`` (checked by ``validate_verdicts``); docs/investigate.md gives every key."""

_INV_SUSPECT = record(
    {
        "id": {"type": "string"},
        "tier": {"type": "integer"},
        "hypothesis": {"type": "string"},
        "maps_to": {"type": "string"},  # the patch spec or "field=value ..." it stands for
        "changes_topk": {"type": "boolean"},
        "auto": {"type": "boolean"},
        "verdict": {"type": "string"},
        "reason": {"type": "string"},
        "present": {"type": ["boolean", "null"]},  # in the candidate (null: unknown, live route)
        "pair": {"type": ["object", "null"], **{k: v for k, v in _PAIR.items() if k != "type"}},
        "divergence": {"type": ["number", "null"]},  # final-logit relative error added alone
        "sufficiency": {"type": ["object", "null"], **{k: v for k, v in _PAIR.items() if k != "type"}},
        "live": {"type": ["object", "null"]},  # live route: the deciding path's comparison
    },
    optional=("live",),
)
_FIX = record(
    {
        "name": {"type": "string"},
        "label": {"type": "string"},
        "removes": {"type": ["string", "null"]},
        "index_topk": {"type": "integer"},
        "keeps_topk": {"type": "boolean"},
        "changes": {"type": "string"},  # "kernel" | "config"
        "pair": _PAIR,
        "recall_by_length": {"type": "object"},
        "case": {"type": ["object", "null"]},  # the explained case's record under the fix
        "label_kind": {"type": "string"},  # "root-cause fix" | "workaround" | "no effect"
    }
)
INVESTIGATION_SCHEMA: dict = record(
    {
        "route": {"type": "string"},  # "in-process" | "live"
        "ledger": {"type": "string"},
        "target": {
            "type": "object",
            "required": ["model", "device"],
            "properties": {"model": {"type": "string"}, "device": {"type": "string"}},
        },
        "symptom": {"type": "object"},
        "configs": {"type": "object"},  # name -> Config.to_json() of every configuration measured
        "candidate_topk": {"type": ["integer", "null"]},
        "suspects": {"type": "array", "items": _INV_SUSPECT},
        "fixes": {"type": "array", "items": _FIX},
        "explained": {"type": ["object", "null"]},  # {"case_id", "why", "candidate", "reference"}
        "verdicts": VERDICTS_SCHEMA,
    }
)
"""``investigation.json``: everything DIAGNOSIS renders; docs/investigate.md gives every key."""
