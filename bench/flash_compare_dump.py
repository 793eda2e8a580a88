"""``compare-dump`` on a dump of a Flash-shaped checkpoint larger than the memory budget (one device call).

Writes a random DeepSeek-V4-Flash-shaped checkpoint with ``--layers`` layers on the machine (fp8
block projections, routed experts packed fp4 as the release ships them; ``bench/flash_stream.py``
does the same), loads it with ``load_bundle(device="auto", max_memory=BUDGET)`` (the weights do not
fit the budget, so it streams), plants a fault (layer ``--fault-layer``'s MLP output x 1.5), writes
a two-rank dump of a ``--length``-token needle prompt in SGLang's dumper layout streamed
(``testing.sglang_dump.write_sglang_dump``: engine passes of ``--pass-tokens`` tokens then two
one-token passes, each layer read once and its files written while it is on the device), removes
the fault and runs ``dsa.compare_dump.compare_dump`` streamed in chunks of ``--chunk`` (the
reference reads each layer once). Times (write, load, dump, compare), peak device memory, the
dump's size on disk, the named layer and tensor and every pass's per-layer records go to
``$OUT/compare_dump_run.json``; the comparison itself to ``$OUT/compare_dump.json`` and ``.md``.
The dump is deleted at the end (it is ~1.9 GB per layer at 8K tokens on Flash's widths).

``--render RUN_JSON`` prints the markdown rows docs/scale.md takes from such a run.

Usage (repository root):
    OUT=/some/dir python3 bench/flash_compare_dump.py --layers 8 --max-memory 20GiB --length 8192
    OUT=/tmp/x python3 bench/flash_compare_dump.py --device cpu --tiny --layers 8 --length 300 \\
        --chunk 64 --pass-tokens 128 --max-memory 3MiB      # the CPU rehearsal at test widths
    python3 bench/flash_compare_dump.py --render docs/scale_runs/flash8_compare_dump_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from flash_stream import evict, needle_case, peak, reset_peak, sync, write_checkpoint


def engine_passes(n: int, pass_tokens: int) -> list[int]:
    """A chunked prefill of the first n - 2 tokens in passes of ``pass_tokens``, then two decode steps."""
    head = n - 2
    return [min(pass_tokens, head - a) for a in range(0, head, pass_tokens)] + [1, 1]


def timed(fn):
    reset_peak()
    sync()
    t0 = time.perf_counter()
    value = fn()
    sync()
    return value, round(time.perf_counter() - t0, 2), peak()


def layer_records(model, since: int) -> list[list[dict]]:
    from needlescope.dsa.streaming import streamer_of

    return [[{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in p]
            for p in streamer_of(model).passes[since:]]  # fmt: skip


def dump_and_compare(model, tok, args, out: Path) -> dict:
    """Plant the fault, write the dump streamed, remove the fault, compare streamed."""
    from needlescope.dsa.compare_dump import compare_dump
    from needlescope.dsa.compare_dump_md import compare_dump_to_json, render_compare_dump_md
    from needlescope.dsa.dump_mapping import load_mapping
    from needlescope.dsa.prompt import needle_token_span, render_prompt
    from needlescope.dsa.streaming import streamer_of
    from needlescope.testing.sglang_dump import write_sglang_dump

    case = needle_case(tok, args.length, seed=args.length + 3)
    prompt = render_prompt(tok, case.messages)
    ids = list(prompt.input_ids)
    passes = engine_passes(len(ids), args.pass_tokens)
    dump_dir = Path(args.dump)
    shutil.rmtree(dump_dir, ignore_errors=True)
    mapping = load_mapping()
    handle = model.model.layers[args.fault_layer].mlp.register_forward_hook(lambda m, a, o: o * 1.5)
    n0 = len(streamer_of(model).passes)
    try:
        written, dump_s, dump_peak = timed(
            lambda: write_sglang_dump(
                model, ids, dump_dir, mapping=mapping, tp=2, passes=passes, chunk=args.chunk
            )
        )
    finally:
        handle.remove()
    files = list(written.iterdir())
    res = {"prompt_tokens": len(ids), "engine_passes": passes, "chunk": args.chunk,
           "planted": f"model.layers.{args.fault_layer}.mlp output x 1.5",
           "dump": {"seconds": dump_s, **dump_peak, "files": len(files),
                    "bytes": sum(f.stat().st_size for f in files), "passes": layer_records(model, n0)}}  # fmt: skip
    n1 = len(streamer_of(model).passes)
    span = needle_token_span(prompt, case.needle)
    result, compare_s, compare_peak = timed(
        lambda: compare_dump(model, written, mapping, prompt_ids=ids, needle_span=span, chunk=args.chunk)
    )
    (out / "compare_dump.json").write_text(compare_dump_to_json(result))
    (out / "compare_dump.md").write_text(render_compare_dump_md(result))
    res["compare"] = {
        "seconds": compare_s, **compare_peak, "first_beyond": result["first_beyond"], "summary": result["summary"],
        "tensors": len(result["tensors"]), "beyond": sum(t["verdict"] == "beyond budget" for t in result["tensors"]),
        "layers": result["layers"], "indexer": result["indexer"], "unknown_names": result["unknown_names"],
        "passes": layer_records(model, n1),
    }  # fmt: skip
    shutil.rmtree(dump_dir, ignore_errors=True)
    return res


def render(run: dict) -> str:
    """The markdown rows docs/scale.md takes from a run (every number from the run's JSON)."""
    w, ld, d, c = run["write"], run["load"], run["dump"], run["compare"]
    pk = "peak_allocated_gib"
    first = c["first_beyond"] or {}
    rows = [
        f"Machine: {run['machine']}, torch {run['torch']}, transformers {run['transformers']}, {run['date_utc']} UTC. "
        f"Checkpoint: {run['args']['layers']} layers, {w['total_size'] / 1e9:.2f} GB on disk, "
        f"{ld['dequantized_weight_bytes'] / 1e9:.1f} GB dequantized; budget `--max-memory {ld['budget']}` "
        f"(streamed: {ld['streamed']}). Prompt: {run['prompt_tokens']} tokens, engine passes "
        f"{run['engine_passes'][0]} x {len(run['engine_passes']) - 2} then two one-token passes; chunk {run['chunk']}.",
        "",
        "| step | wall time | device memory |",
        "|---|---|---|",
        f"| write the checkpoint (generated on the GPU) | {w['seconds']} s | {w['total_size'] / 1e9:.2f} GB on disk |",
        f"| load streamed (resident units) | {ld['seconds']} s | {ld.get(pk, '-')} GiB allocated |",
        f"| write the two-rank dump streamed ({run['planted']}) | {d['seconds']} s | peak {d.get(pk, '-')} GiB; "
        f"{d['files']} files, {d['bytes'] / 1e9:.2f} GB on disk |",
        f"| `compare-dump` streamed | {c['seconds']} s | peak {c.get(pk, '-')} GiB |",
        "",
        f"Named: `{first.get('engine_name')}` (reference `{first.get('reference')}`, layer {first.get('layer')}); "
        f"{c['beyond']} of {c['tensors']} tensors beyond budget; layers read per pass: "
        f"dump {[len(p) for p in d['passes']]}, compare {[len(p) for p in c['passes']]}.",
    ]
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--render", help="print docs/scale.md's rows from a run's JSON and stop")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--max-memory", default="20GiB")
    ap.add_argument("--length", type=int, default=8192, help="prompt tokens of the dumped request")
    ap.add_argument("--pass-tokens", type=int, default=2048, help="tokens per engine prefill pass")
    ap.add_argument("--chunk", type=int, default=1024, help="tokens per layer call (dump and compare)")
    ap.add_argument("--fault-layer", type=int, default=5)
    ap.add_argument("--ckpt", default="/tmp/flash-dump-ckpt")
    ap.add_argument("--dump", default="/tmp/flash-dump")
    ap.add_argument("--device", default="cuda", help="where the checkpoint is generated")
    ap.add_argument("--tiny", action="store_true", help="test widths (the CPU rehearsal)")
    ap.add_argument("--cold", action="store_true", help="evict the shards from the page cache first")
    args = ap.parse_args()
    if args.render:
        print(render(json.loads(Path(args.render).read_text())))
        return
    out = Path(os.environ.get("OUT", "flash-compare-dump-out"))
    out.mkdir(parents=True, exist_ok=True)
    import transformers

    from needlescope.dsa.checkpoint import load_bundle
    from needlescope.dsa.placement import unit_bytes
    from needlescope.dsa.streaming import is_streamed

    res: dict = {"machine": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                 "torch": torch.__version__, "transformers": transformers.__version__,
                 "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "args": vars(args)}  # fmt: skip
    ckpt = Path(args.ckpt)
    res["write"] = write_checkpoint(args)
    if args.cold:
        res["page_cache"] = evict(ckpt)
    (model, tok, _), load_s, load_peak = timed(
        lambda: load_bundle(ckpt, device="auto", max_memory=args.max_memory, stream_if_needed=True)
    )
    sizes = unit_bytes(model)
    res["load"] = {"seconds": load_s, "streamed": is_streamed(model), "budget": args.max_memory,
                   "dequantized_weight_bytes": sum(n for _, n in sizes), **load_peak}  # fmt: skip
    if not res["load"]["streamed"]:
        sys.exit(f"the weights fit --max-memory {args.max_memory}: give a smaller budget")
    run_json = out / "compare_dump_run.json"
    run_json.write_text(json.dumps(res, indent=1) + "\n")  # what a failure below would leave
    try:
        res.update(dump_and_compare(model, tok, args, out))
    except torch.OutOfMemoryError as exc:
        res["error"] = f"OOM: {str(exc)[:300]}"
        run_json.write_text(json.dumps(res, indent=1) + "\n")
        raise
    run_json.write_text(json.dumps(res, indent=1) + "\n")
    print(render(res))


if __name__ == "__main__":
    main()
