"""The live route at full width (one GPU call): `needlescope serve --device auto` on a Flash-shaped
fp8 checkpoint with a planted fault, captured at 32K tokens and emulated in-process.

Writes the random 4-layer Flash-shaped fp8 checkpoint on the machine, starts
``needlescope serve --model CKPT --device auto --prefill-chunk C`` with a planted fault (fp8 index
keys, ``--index-k fp8_e4m3``), sends one 32K-token needle prompt to ``/generate`` with
``return_indexer_topk`` (rows of the answer positions), then loads the same checkpoint in-process
(``load_bundle(device="auto")``) and replays the server's token ids teacher-forced under the
reference numerics and under the suspect (fp8 keys), with chunked prefill: the suspect that
reproduces the server's captured top-k rows is the fault. Writes ``$OUT/live.json``.

Usage (repository root, GPU machine):
    OUT=/some/dir python3 bench/flash_live.py --length 32768 --chunk 1024
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


def gib(n: int) -> float:
    return round(n / 2**30, 2)


def emulate_rows(model, ids: list[int], setting, chunk: int, first: int, n: int) -> tuple[dict, float]:
    """CSA layer -> the top-k entry sets of rows first..first+n-1, teacher-forced on ``ids``."""
    from needlescope.dsa.emulate import IndexerCapture, emulate
    from needlescope.dsa.passes import prefill

    capture = IndexerCapture()
    t0 = time.perf_counter()
    with torch.no_grad(), emulate(model, setting, capture=capture) as layers:
        prefill(model, torch.tensor([ids]), chunk=chunk)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    k = int(setting.index_topk or model.config.index_topk)
    rows = {
        str(layer): [
            sorted(int(e) for e in row if e >= 0)
            for row in capture.rows(layer, width=k)[1][first : first + n].tolist()
        ]
        for layer in layers
    }
    return rows, wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--ckpt", default="/tmp/flash4-fp8")
    ap.add_argument("--rows", type=int, default=2, help="answer rows to capture and compare")
    ap.add_argument("--overrides", default="{}", help="JSON width overrides (a CPU smoke run)")
    ap.add_argument("--reuse", action="store_true", help="keep a checkpoint already written at --ckpt")
    ap.add_argument(
        "--max-memory", default=None, help="in-process reference's weight budget (the server holds one copy)"
    )
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "flash-live-out"))
    out.mkdir(parents=True, exist_ok=True)
    import base64

    import httpx
    import numpy as np

    from needlescope.cases.assemble import CaseSpec, build_cases
    from needlescope.dsa.checkpoint import load_bundle, load_tokenizer
    from needlescope.dsa.loading import placement_of
    from needlescope.dsa.prompt import render_prompt
    from needlescope.serve.launch import ChildServer
    from needlescope.setting import REFERENCE, Setting
    from needlescope.testing.flash import write_flash_checkpoint

    cuda = torch.cuda.is_available()
    res: dict = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": torch.cuda.get_device_name(0) if cuda else "cpu",
    }

    def save() -> None:
        (out / "live.json").write_text(json.dumps(res, indent=2) + "\n")
        print(json.dumps({k: v for k, v in res.items() if k != "rows"}, indent=2), flush=True)

    if args.reuse and (Path(args.ckpt) / "model.safetensors.index.json").is_file():
        res["write"] = {"reused": args.ckpt}
    else:
        shutil.rmtree(args.ckpt, ignore_errors=True)
        t0 = time.perf_counter()
        res["write"] = write_flash_checkpoint(
            args.ckpt,
            layers=4,
            fmt="fp8",
            device="cuda" if cuda else "cpu",
            overrides=json.loads(args.overrides),
        )
        res["write"]["seconds"] = round(time.perf_counter() - t0, 1)
    tok = load_tokenizer(Path(args.ckpt))

    def count(msgs):
        return len(render_prompt(tok, msgs).input_ids)

    case = build_cases(CaseSpec("single", (args.length,), (50.0,), 1, 7), count)[0]
    ids = render_prompt(tok, case.messages).input_ids
    fault = Setting(index_k="fp8_e4m3")
    argv = [sys.executable, "-m", "needlescope.cli.main", "serve", "--model", args.ckpt, "--device", "auto"]
    argv += [
        "--prefill-chunk",
        str(args.chunk),
        "--index-k",
        "fp8_e4m3",
        "--port",
        "0",
        "--max-new-tokens",
        "4",
    ]
    t0 = time.perf_counter()
    with ChildServer(argv, health_path="/health", timeout=300) as server:
        res["serve"] = {"argv": argv[2:], "ready_s": round(time.perf_counter() - t0, 1)}
        info = httpx.get(server.url + "/get_server_info", timeout=30).json()
        res["serve"]["placement"] = info.get("placement")
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": args.rows, "temperature": 0},
            "return_indexer_topk": True,
            "indexer_topk_last": args.rows,
        }
        t0 = time.perf_counter()
        r = httpx.post(server.url + "/generate", json=body, timeout=600)
        res["serve"]["request_s"] = round(time.perf_counter() - t0, 2)
        r.raise_for_status()
        ans = r.json()
        meta = ans["meta_info"]
        shape = meta["indexer_topk_shape"]
        topk = np.frombuffer(base64.b64decode(meta["indexer_topk"]), dtype="<i4").reshape(shape)
        res["serve"].update(
            prompt_tokens=meta.get("prompt_tokens"),
            output_ids=ans.get("output_ids"),
            indexer_topk_shape=shape,
            indexer_topk_positions=meta.get("indexer_topk_positions"),
        )
        save()
        out_ids = ans["output_ids"]
        positions = meta.get("indexer_topk_positions") or list(range(len(ids) - 1, len(ids) - 1 + shape[0]))
        t0 = time.perf_counter()
        model, _, _ = load_bundle(args.ckpt, device="auto", max_memory=args.max_memory)
        res["reference"] = {
            "load_s": round(time.perf_counter() - t0, 1),
            "placement": placement_of(model).report(),
        }
        teacher = ids + out_ids[:-1]
        first, n = positions[0], len(positions)
        from needlescope.dsa.emulate import csa_indexers

        layers = [layer for layer, _ in csa_indexers(model)]  # the capture's layer axis, ascending
        live = {
            str(layer): [sorted(int(e) for e in topk[i, c] if e >= 0) for i in range(n)]
            for c, layer in enumerate(layers)
        }
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for name, setting in (("reference", REFERENCE), ("suspect_fp8_keys", fault)):
            rows, wall = emulate_rows(model, teacher[: positions[-1] + 1], setting, args.chunk, first, n)
            same = {layer: sum(a == b for a, b in zip(rows[layer], live[layer])) for layer in rows}
            recall = {
                layer: round(
                    sum(len(set(a) & set(b)) for a, b in zip(rows[layer], live[layer]))
                    / max(1, sum(len(b) for b in live[layer])),
                    4,
                )
                for layer in rows
            }
            res[name] = {
                "emulate_s": round(wall, 2),
                "rows_equal_to_live": same,
                "rows": n,
                "recall_of_live": recall,
            }
            save()
        res["reference"]["peak_gib"] = gib(torch.cuda.max_memory_allocated()) if cuda else None
    # The suspect that reproduces the live rows: the higher recall of the server's entries, per layer.
    verdict = [
        name
        for name, other in (("reference", "suspect_fp8_keys"), ("suspect_fp8_keys", "reference"))
        if all(
            res[name]["recall_of_live"][k] > res[other]["recall_of_live"][k]
            for k in res[name]["recall_of_live"]
        )
    ]
    res["reproduces_live"] = verdict
    save()


if __name__ == "__main__":
    main()
