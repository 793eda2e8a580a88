"""Layer-major streaming of a Flash-shaped checkpoint larger than the memory budget (one device call).

Writes a random DeepSeek-V4-Flash-shaped checkpoint with ``--layers`` layers on the machine
(fp8 block projections, routed experts packed fp4 as the release ships them), loads it with
``load_bundle(device="auto", max_memory=BUDGET)`` (the weights do not fit the budget, so it
streams), and measures: load time and resident bytes, per-layer read / place / compute times of
every pass, peak device memory, streamed rank dumps at ``--lengths``, with ``--localize N``
a streamed localization at N tokens of a planted fault (layer ``--fault-layer``'s MLP output
scaled by 1.5) in chunks, and with ``--cpu-length N`` one streamed prefill pass on the host's CPU
cores. ``--cold`` evicts the shards from the page cache first
(``posix_fadvise(DONTNEED)``) so the first pass reads from disk. Everything goes to
``$OUT/stream.json``; docs/scale.md holds the numbers.

Usage (repository root):
    OUT=/some/dir python3 bench/flash_stream.py --layers 8 --max-memory 20GiB --lengths 32768,131072
    OUT=/tmp/x python3 bench/flash_stream.py --device cpu --tiny --layers 8 --lengths 300 --chunk 64 \\
        --max-memory 3MiB --localize 200      # the CPU rehearsal at test widths
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch


def gib(n: int) -> float:
    return round(n / 2**30, 3)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak() -> dict:
    if not torch.cuda.is_available():
        return {}
    return {
        "peak_allocated_gib": gib(torch.cuda.max_memory_allocated()),
        "peak_reserved_gib": gib(torch.cuda.max_memory_reserved()),
    }


def evict(ckpt: Path) -> str:
    """Drop the shards' pages from the page cache, so the next read comes from the disk."""
    for f in ckpt.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "posix_fadvise(DONTNEED) on every shard"


def write_checkpoint(args) -> dict:
    """Write the Flash-shaped checkpoint (fp8 projections, fp4 experts) to ``args.ckpt`` afresh;
    its summary with the seconds it took (``--tiny``: test widths, 1 MiB shards)."""
    from needlescope.testing.flash import TEST_WIDTHS, write_flash_checkpoint

    ckpt = Path(args.ckpt)
    shutil.rmtree(ckpt, ignore_errors=True)
    t0 = time.perf_counter()
    summary = write_flash_checkpoint(
        ckpt, layers=args.layers, fmt="fp8", experts="fp4", device=args.device,
        overrides=TEST_WIDTHS if args.tiny else None, shard_bytes=(1 << 20) if args.tiny else 4 << 30,
    )  # fmt: skip
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    return summary


def needle_case(tok, length: int, seed: int):
    from needlescope.cases.assemble import CaseSpec, build_cases
    from needlescope.dsa.prompt import render_prompt

    def count(msgs):
        return len(render_prompt(tok, msgs).input_ids)

    return build_cases(CaseSpec("single", (length,), (50.0,), 1, seed), count)[0]


def passes_since(model, n: int) -> list[list[dict]]:
    from needlescope.dsa.streaming import streamer_of

    return [[{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in p]
            for p in streamer_of(model).passes[n:]]  # fmt: skip


def rank_dump_at(model, tok, length: int, chunk: int) -> dict:
    from needlescope.dsa.rankdump import rank_dump
    from needlescope.dsa.streaming import streamer_of

    case = needle_case(tok, length, seed=length)
    before = len(streamer_of(model).passes)
    reset_peak()
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        dump = rank_dump(model, tok, case.messages, needle=case.needle, max_new_tokens=2, chunk=chunk)
    sync()
    wall = time.perf_counter() - t0
    return {
        "length_target": length,
        "prompt_tokens": dump["prompt_tokens"],
        "chunk": chunk,
        "rank_dump_s": round(wall, 2),
        **peak(),
        "generated_tokens": dump["generated_tokens"],
        "first_answer_position": [
            {k: layer["positions"][0][k] for k in ("query_pos", "visible_entries", "best_rank", "selected")}
            for layer in dump["layers"]
            if layer["positions"]
        ],
        "passes": passes_since(model, before),
    }


def localize_at(
    ckpt: Path, model, tok, length: int, chunk: int, budget: str, fault_layer: int, out: Path
) -> dict:
    from needlescope.dsa.checkpoint import load_bundle
    from needlescope.dsa.diff import localize
    from needlescope.dsa.prompt import needle_token_span, render_prompt
    from needlescope.dsa.streaming import streamer_of
    from needlescope.setting import Setting

    patch = out / "planted_mlp_scale.py"
    patch.write_text(
        "def apply(model):\n"
        f"    handle = model.model.layers[{fault_layer}].mlp.register_forward_hook(lambda m, a, o: o * 1.5)\n"
        "    return handle.remove\n"
    )
    case = needle_case(tok, length, seed=length + 1)
    prompt = render_prompt(tok, case.messages)
    ids = torch.tensor([prompt.input_ids])
    candidate = load_bundle(ckpt, device="auto", max_memory=budget, stream_if_needed=True)[0]
    before = len(streamer_of(model).passes)
    reset_peak()
    sync()
    t0 = time.perf_counter()
    result = localize(
        model, candidate, ids, setting=Setting(patch=patch), chunk=chunk,
        needle_span=needle_token_span(prompt, case.needle),
    )  # fmt: skip
    sync()
    wall = time.perf_counter() - t0
    (out / "diff.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    return {
        "prompt_tokens": ids.shape[1],
        "chunk": chunk,
        "planted": f"model.layers.{fault_layer}.mlp output x 1.5",
        "first_divergent_module": result["first_divergent_module"],
        "modules_judged": len(result["modules"]),
        "localize_s": round(wall, 2),
        **peak(),
        "passes": passes_since(model, before),
    }


def cpu_pass(ckpt: Path, tok, length: int, chunk: int) -> dict:
    """One streamed prefill pass on the CPU (the host's cores): per-layer read, place, compute."""
    from needlescope.dsa.checkpoint import load_bundle
    from needlescope.dsa.passes import prefill
    from needlescope.dsa.prompt import render_prompt

    ids = render_prompt(tok, needle_case(tok, length, seed=length + 2).messages).input_ids
    t0 = time.perf_counter()
    model = load_bundle(ckpt, device="cpu", stream_layers=True)[0]
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with torch.no_grad():
        prefill(model, torch.tensor([ids]), chunk=chunk, logits_at=[len(ids) - 1])
    return {
        "prompt_tokens": len(ids),
        "chunk": chunk,
        "threads": torch.get_num_threads(),
        "load_s": round(load_s, 2),
        "pass_s": round(time.perf_counter() - t0, 2),
        "passes": passes_since(model, 0),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--max-memory", default="20GiB")
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--ckpt", default="/tmp/flash-stream")
    ap.add_argument("--device", default="cuda", help="where the checkpoint is generated")
    ap.add_argument("--tiny", action="store_true", help="test widths (the CPU rehearsal)")
    ap.add_argument("--cold", action="store_true", help="evict the shards from the page cache first")
    ap.add_argument("--localize", type=int, default=0, help="prompt tokens of a streamed localization")
    ap.add_argument("--fault-layer", type=int, default=5)
    ap.add_argument(
        "--localize-chunk", type=int, default=0, help="the localization's chunk (default --chunk)"
    )
    ap.add_argument("--reuse", action="store_true", help="keep an existing checkpoint at --ckpt")
    ap.add_argument("--cpu-length", type=int, default=0, help="prompt tokens of one streamed pass on the CPU")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "flash-stream-out"))
    out.mkdir(parents=True, exist_ok=True)
    import transformers

    from needlescope.dsa.checkpoint import load_bundle
    from needlescope.dsa.placement import unit_bytes
    from needlescope.dsa.streaming import is_streamed

    res: dict = {
        "machine": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "args": vars(args),
    }

    def save() -> None:
        (out / "stream.json").write_text(json.dumps(res, indent=1) + "\n")

    ckpt = Path(args.ckpt)
    if not (args.reuse and (ckpt / "config.json").is_file()):
        res["write"] = write_checkpoint(args)
        save()
    if args.cold:
        res["page_cache"] = evict(ckpt)
    reset_peak()
    t0 = time.perf_counter()
    model, tok, _ = load_bundle(ckpt, device="auto", max_memory=args.max_memory, stream_if_needed=True)
    sync()
    sizes = unit_bytes(model)
    res["load"] = {
        "seconds": round(time.perf_counter() - t0, 2),
        "streamed": is_streamed(model),
        "budget": args.max_memory,
        "dequantized_weight_bytes": sum(n for _, n in sizes),
        "layer_bytes": [n for u, n in sizes if u.startswith("model.layers.")],
        "resident_bytes": sum(n for u, n in sizes if not u.startswith("model.layers.")),
        "disk_bytes": sum(f.stat().st_size for f in ckpt.glob("*.safetensors")),
        **peak(),
    }
    save()
    res["rank_dumps"] = []
    for n in [int(x) for x in args.lengths.split(",") if x]:
        try:
            res["rank_dumps"].append(rank_dump_at(model, tok, n, args.chunk))
        except torch.OutOfMemoryError as exc:
            res["rank_dumps"].append({"length_target": n, "error": f"OOM: {str(exc)[:300]}"})
        save()
    if args.localize:
        try:
            res["localize"] = localize_at(
                ckpt,
                model,
                tok,
                args.localize,
                args.localize_chunk or args.chunk,
                args.max_memory,
                args.fault_layer,
                out,
            )
        except torch.OutOfMemoryError as exc:
            res["localize"] = {"error": f"OOM: {str(exc)[:300]}"}
        save()
    if args.cpu_length:
        res["cpu_pass"] = cpu_pass(ckpt, tok, args.cpu_length, args.chunk)
        save()
    print(
        json.dumps(
            {k: v for k, v in res.items() if k not in ("rank_dumps", "localize", "cpu_pass")}, indent=1
        )
    )
    for d in res["rank_dumps"] + [res[k] for k in ("localize", "cpu_pass") if k in res]:
        print(json.dumps({k: v for k, v in d.items() if k != "passes"}))


if __name__ == "__main__":
    main()
