"""The example ledger ``needlescope investigate init`` writes: the original DeepSeek-V4-Flash
investigation replayed on the shipped organism.

Eight suspects in three risk tiers, as the original forensic ranking had them, each mapped to
a planted patch or a ``Setting`` field the organism can run. The deployment under suspicion
is fp8 index keys, ``index_topk`` 64 and a Triton paged indexer, emulated by the built-in
``fault:indexer_page_table``. ``write_example(dir)`` writes ``investigation.toml``, the
deployment's env file and the patch files (``patches/``) next to it.
"""

from __future__ import annotations

from pathlib import Path

from needlescope.errors import BadInput

__all__ = ["EXAMPLE_LEDGER", "EXAMPLE_FILES", "write_example"]

_HEADER = """\
# needlescope investigation ledger (needlescope investigate run investigation.toml --out DIR).
# The original DeepSeek-V4-Flash coherence investigation, replayed on the shipped organism:
# recall of facts from earlier turns collapsed after a round of speed patches. Eight patches
# were ranked in three risk tiers; every one is a suspect below, mapped to a patch file in
# patches/ or to a field of the indexer Setting, so each can be removed from the candidate
# (or added alone to the reference) and measured. Paths are relative to this file.

[target]
model = "organism"            # reference checkpoint: 'organism' or a DeepSeek-V4 directory
device = "cpu"
threads = 2
# The reference: fp32 indexer, the checkpoint's own index_topk (2048), no patch.
reference = "k=fp32 q=fp32 acc=fp32 topk=cfg"
# The deployment under suspicion: fp8 index keys, index_topk 64, and the Triton paged
# indexer (emulated by the built-in fault:indexer_page_table, docs/faults.md).
candidate = "k=fp8_e4m3 q=fp32 acc=fp32 topk=64 patch=fault:indexer_page_table"
extra_patches = []            # model-level patch files the deployment also carries
endpoint = ""                 # a live server for server_info questions ("" = none: those are blocked)
# A live deployment instead: candidate = "live" and endpoint = "http://HOST:PORT" (a server
# answering /generate with return_indexer_topk, e.g. needlescope serve); checks are then
# "live_emulation" (each suspect emulated in the reference, compared with the live capture).
env_file = "deployment.env"   # the deployment's environment
reference_env_file = "reference.env"   # the reference's (every variable that differs is a difference to explain)

[symptom]
# Multiturn needles, measured in-process on the reference checkpoint under both settings.
kind = "multiturn"
lengths = [256, 512, 1024]
depths = [0, 50, 100]
trials = 2
seed = 0

"""

# (tier banner or None, id, tier, hypothesis, mapping line, checks, questions as
# [(TOML lines, ...)]): the eight suspects of the original forensic ranking.
_SUSPECTS = [
    (
        "Tier 1: most likely (numerics touched in every layer)",
        "hc_mix_bf16",
        1,
        "the hyper-connection mixing GEMM cast from fp32 to bf16 compounds over the layers",
        'patch = "patches/hc_mix_bf16.py"',
        ["audit:hc_mix_bf16"],
        [
            (
                'type = "checkpoint_dtype"     # Q3: what dtype are the mixing weights stored in?',
                'pattern = "model.layers.*.hc_*_fn"',
            )
        ],
    ),
    (
        None,
        "routed_scaling",
        1,
        "the rewritten MoE routed scaling applies routed_scaling_factor twice, or not at all",
        'patch = "patches/routed_scale_twice.py"',
        ["audit:routed_scale"],
        [
            (
                'type = "config"               # Q2: the factor the model expects, applied exactly once',
                'key = "routed_scaling_factor"',
            ),
            (
                'type = "source"',
                'path = "patches/routed_scale_twice.py"',
                'pattern = "routed_scaling_factor"',
            ),
        ],
    ),
    (
        "Tier 2: plausible drift (near-margin flips in the sparse selection)",
        "decode_splitk",
        2,
        "the split-K decode attention kernel merges its partial results in bf16",
        'patch = "patches/decode_splitk_bf16.py"',
        ["audit:decode_splitk_bf16"],
        [('type = "env"', 'name = "SGLANG_MMA_SPLITK_DECODE"')],
    ),
    (
        None,
        "indexer_scores_bf16",
        2,
        "the indexer accumulates its scores in bf16 and flips near-margin entries",
        'setting = "acc=bf16"',
        ["audit:indexer_scores_bf16"],
        [
            (
                'type = "env"                  # Q1: which indexer path is live (the torch fallback scores in bf16)',
                'name = "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH"',
            )
        ],
    ),
    (
        None,
        "index_keys_fp8",
        2,
        "fp8 index keys (the model was trained with fp4 keys) drop the needle below the cutoff",
        'setting = "k=fp8_e4m3"',
        ["audit:index_keys_fp8", "ablation"],
        [('type = "config"', 'key = "index_head_dim"')],
    ),
    (
        None,
        "index_topk",
        2,
        "index_topk 64 keeps too few entries for long contexts",
        'setting = "topk=64"',
        ["audit:index_topk", "ablation"],
        [('type = "config"', 'key = "index_topk"')],
    ),
    (
        "Tier 3: low risk (non-numeric toggles)",
        "triton_paged_indexer",
        3,
        "the toggle that makes the Triton paged-MQA indexer live (a kernel swap, no precision change)",
        'patch = "fault:indexer_page_table"',
        ["ablation"],
        [
            (
                'type = "env"                  # set to 1, the torch fallback is live and this kernel is not',
                'name = "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH"',
                'means_absent = "1"',
            )
        ],
    ),
    (
        None,
        "thinking_default",
        3,
        "the thinking-by-default toggle changes the prompt, not the numerics",
        'patch = "patches/thinking_default.py"',
        [],
        [('type = "server_info"', 'field = "chat_template_kwargs"')],
    ),
]


def _suspect_toml(banner, sid, tier, hypothesis, mapping, checks, questions) -> str:
    lines = [f"# ---- {banner} " + "-" * max(3, 88 - len(banner))] if banner else []
    lines += ["[[suspects]]", f'id = "{sid}"', f"tier = {tier}", f'hypothesis = "{hypothesis}"', mapping]
    lines.append("checks = [" + ", ".join(f'"{c}"' for c in checks) + "]")
    for q in questions:
        lines += ["[[suspects.questions]]", *q]
    return "\n".join(lines) + "\n"


EXAMPLE_LEDGER = _HEADER + "\n".join(_suspect_toml(*s) for s in _SUSPECTS)
"""The example ledger (``init`` writes it as ``investigation.toml``)."""

_SUBSTITUTE_PATCH = '''\
"""{doc}"""

from needlescope.audit.substitutes import {name}


def apply(model):
    return {name}(model)
'''

EXAMPLE_FILES: dict[str, str] = {
    "investigation.toml": EXAMPLE_LEDGER,
    "deployment.env": (
        "# The deployment's environment, as /proc/PID/environ of the server showed it.\n"
        "CUDA_VISIBLE_DEVICES=0\n"
        "SGLANG_MMA_SPLITK_DECODE=1\n"
    ),
    "reference.env": (
        "# The reference deployment's environment (the variables the two deployments share).\n"
        "CUDA_VISIBLE_DEVICES=0\n"
    ),
    "patches/hc_mix_bf16.py": _SUBSTITUTE_PATCH.format(
        name="hc_mix_bf16",
        doc="The hyper-connection mixing GEMM in bf16 (operands rounded, fp32 accumulation).",
    ),
    "patches/routed_scale_twice.py": _SUBSTITUTE_PATCH.format(
        name="routed_scale_twice", doc="routed_scaling_factor applied in the router and again on the output."
    ),
    "patches/decode_splitk_bf16.py": _SUBSTITUTE_PATCH.format(
        name="attn_out_bf16", doc="Split-K decode attention merging its partial results in bf16."
    ),
    "patches/thinking_default.py": (
        '"""The thinking-by-default toggle: a chat-template default, no numerics (the organism has no\n'
        'thinking mode, so applying it changes nothing)."""\n\n\n'
        "def apply(model):\n    return None\n"
    ),
}


def write_example(directory: str | Path, *, force: bool = False) -> Path:
    """Write the example ledger and its files into ``directory``; returns the ledger's path."""
    d = Path(directory)
    existing = [n for n in EXAMPLE_FILES if (d / n).exists()]
    if existing and not force:
        raise BadInput(f"{d / existing[0]} exists; pass --force to overwrite or choose another directory")
    for name, text in EXAMPLE_FILES.items():
        path = d / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return d / "investigation.toml"
