"""Benchmark the Triton lightning indexer and top-k on one GPU against measured ceilings.

One command (``python bench/indexer_bench.py --out DIR``) measures, in one run:

* ceilings: a device-to-device copy (bytes read + written) and an 8192^3 bf16 matmul;
* paged decode logits (batch 1/8/32/64 x context 8K/32K/128K/256K tokens, entries = context/4)
  with fp8 and bf16 keys; achieved GB/s, % of the copy; top-k 512 on the result; the torch
  reference (bmm + ReLU + weighted head sum + scale + ``torch.topk``) and the speedup;
* prefill logits (4K and 8K queries x 8K..64K keys, bf16 and fp8 operands): TFLOP/s, % of matmul;
* top-k candidates (radix digit width, chunk, warps; rows split over many programs by segment
  size) on single rows and batches, k = 512/2048, each checked against the unsplit top-k set;
* DeepGEMM's fp8 logits kernels side by side when ``deep_gemm`` imports (else the reason).

Timing: ``triton.testing.do_bench`` (median, L2 flushed between reps) for logits alone (the
bandwidth columns); CUDA-graph replays (``do_bench_cudagraph``, median) for top-k alone, for
logits + top-k and for the torch reference, so that host launch gaps count for neither side.
Top-k alone reads the logits the previous kernel just wrote (L2-resident, as in the pipeline).
Writes ``DIR/indexer_bench.json`` and prints markdown tables (docs/perf/indexer.md).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import importlib.util
import json
import platform
import subprocess
import sys
import traceback
from functools import partial
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from needlescope.kernels import page_keys, quantize_keys, quantize_queries, triton_logits, triton_topk

H, D = 64, 128
DEV = torch.device("cuda")


def med(fn, graph: bool = False) -> float:
    """Median time of fn() in microseconds."""
    if graph:
        return do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def ceilings() -> dict:
    n = 1 << 30  # 1 GiB of fp32 each way
    src = torch.randn(n // 4, device=DEV)
    dst = torch.empty_like(src)
    t_copy = med(partial(dst.copy_, src))
    del src, dst
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    t_mm = med(partial(torch.matmul, a, b))
    return {"copy_GBps": 2 * n / t_copy / 1e3, "bf16_matmul_TFLOPs": 2 * 8192**3 / t_mm / 1e6}


def decode_case(B: int, ctx: int, key_dtype: str, seed: int) -> dict:
    """Paged inputs for B requests of ``ctx`` tokens (ctx/4 entries) with scattered pages."""
    L = ctx // 4
    pages = L // 64
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(B, H, D, generator=g, device=DEV)
    w = torch.randn(B, H, generator=g, device=DEV)
    k = torch.randn(L, D, generator=g, device=DEV)
    qc, wf = quantize_queries(q, w, key_dtype)
    keys = quantize_keys(k, key_dtype)
    pool = B * pages
    bt = torch.randperm(pool, generator=g, device=DEV)[: B * pages].view(B, pages).int()
    entry_of = torch.arange(L, device=DEV).view(1, -1).expand(B, -1)
    paged = page_keys(keys, bt, pool, entry_of)
    lens = torch.full((B,), L, dtype=torch.int32, device=DEV)
    return {"q": qc, "w": wf, "keys": keys, "paged": paged, "lens": lens, "L": L}


def reference_decode(c: dict, k: int):
    """The torch path on gathered, dequantized bf16 keys [B, L, D]: bmm + ReLU + weights + topk."""
    B, L = c["q"].shape[0], c["L"]
    kb = c["keys"].codes.to(torch.bfloat16).unsqueeze(0).expand(B, L, D).contiguous()  # gathered per request
    sc = c["keys"].scales.view(1, L).expand(B, L).contiguous()
    qb = c["q"].to(torch.bfloat16)
    w = c["w"]

    def run():
        s = torch.bmm(kb, qb.transpose(1, 2)).float()  # [B, L, H]
        logits = (s.relu() * w.unsqueeze(1)).sum(-1) * sc  # [B, L]
        return logits.topk(k, dim=1, sorted=False).indices

    return run


def bench_decode(cfg: dict, out: dict, quick: bool) -> None:
    rows = []
    batches, contexts = (
        ((1, 64), (8192, 131072)) if quick else ((1, 8, 32, 64), (8192, 32768, 131072, 262144))
    )
    for B in batches:
        for ctx in contexts:
            row = {"batch": B, "context": ctx, "entries": ctx // 4}
            for kd in ("fp8_e4m3", "bf16"):
                c = decode_case(B, ctx, kd, seed=B * 7 + ctx)
                logits = triton_logits.paged_logits(c["q"], c["w"], c["paged"], c["lens"])
                t_log = med(
                    lambda c=c, o=logits: triton_logits.paged_logits(
                        c["q"], c["w"], c["paged"], c["lens"], out=o
                    )
                )
                zeros = torch.zeros_like(c["lens"])
                t_topk = med(
                    lambda lg=logits, c=c, z=zeros: triton_topk.topk(lg, 512, z, c["lens"]), graph=True
                )

                def both(c=c, z=zeros):
                    lg = triton_logits.paged_logits(c["q"], c["w"], c["paged"], c["lens"])
                    return triton_topk.topk(lg, 512, z, c["lens"])

                t_both = med(both, graph=True)
                per_entry = D + (4 if kd == "fp8_e4m3" else D) + 4  # key bytes (+scale) + logit write
                nbytes = B * c["L"] * per_entry + c["q"].numel() * c["q"].element_size() + c["w"].numel() * 4
                row[kd] = {
                    "logits_us": t_log,
                    "GBps": nbytes / t_log / 1e3,
                    "pct_copy": 100 * nbytes / t_log / 1e3 / cfg["copy_GBps"],
                    "topk512_us": t_topk,
                    "logits_topk_us": t_both,
                }
                if kd == "fp8_e4m3":
                    try:
                        t_ref = med(reference_decode(c, 512), graph=True)
                        row["reference_us"] = t_ref
                        row["speedup"] = t_ref / t_both
                    except torch.OutOfMemoryError:
                        row["reference_us"] = None
                del c, logits
                torch.cuda.empty_cache()
            row["bf16_over_fp8"] = row["bf16"]["logits_us"] / row["fp8_e4m3"]["logits_us"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    out["decode"] = rows


def bench_decode_variants(out: dict) -> None:
    """Pages per program x pages per MMA x warps x pipeline stages at batch 64 x 128K, fp8 and bf16 keys."""
    res = []
    for kd in ("fp8_e4m3", "bf16"):
        c = decode_case(64, 131072, kd, seed=1)
        args = (c["q"], c["w"], c["paged"], c["lens"])
        for ppp in (8, 16):
            for ppm in (1, 2):
                for nw in (4, 8):
                    for ns in (2, 3):
                        kw = {"pages_per_prog": ppp, "pages_per_mma": ppm, "num_warps": nw, "num_stages": ns}
                        try:
                            t = med(partial(triton_logits.paged_logits, *args, **kw))
                        except Exception as e:  # a config that does not fit (registers, shared memory)
                            print(f"decode variant {kw}: {type(e).__name__}: {str(e)[:120]}")
                            continue
                        res.append({"key_dtype": kd, **kw, "us": t})
        if kd == "fp8_e4m3":
            t = med(partial(triton_logits.paged_logits, *args, native_fp8=False))
            res.append({"key_dtype": kd, "native_fp8": False, "us": t})
        del c, args
    print(json.dumps(res), flush=True)
    out["decode_variants"] = res


def bench_prefill(cfg: dict, out: dict, quick: bool) -> None:
    rows = []
    g = torch.Generator(device=DEV).manual_seed(11)
    configs = ((64, 128, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2))
    for T in (4096,) if quick else (4096, 8192):
        for N in (8192,) if quick else (8192, 16384, 32768, 65536):
            row = {"queries": T, "keys": N}
            q = torch.randn(T, H, D, generator=g, device=DEV)
            w = torch.randn(T, H, generator=g, device=DEV)
            k = torch.randn(N, D, generator=g, device=DEV)
            st = torch.zeros(T, dtype=torch.int32, device=DEV)
            en = torch.full((T,), N, dtype=torch.int32, device=DEV)
            flops = 2 * T * N * H * D
            for kd in ("bf16", "fp8_e4m3"):
                qc, wf = quantize_queries(q, w, kd)
                keys = quantize_keys(k, kd)
                o = torch.empty(T, N, device=DEV)
                best = None
                for bt, bn, nw, ns in configs[:1] if quick else configs:
                    try:
                        fn = partial(
                            triton_logits.prefill_logits,
                            qc,
                            wf,
                            keys,
                            st,
                            en,
                            out=o,
                            block_t=bt,
                            block_n=bn,
                            num_warps=nw,
                            num_stages=ns,
                        )
                        t = med(fn)
                    except Exception as e:  # a config that does not fit (shared memory) is skipped
                        print(f"prefill config {bt}x{bn} w{nw} s{ns}: {type(e).__name__}: {str(e)[:120]}")
                        continue
                    if best is None or t < best["us"]:
                        best = {"us": t, "config": [bt, bn, nw, ns]}
                best["TFLOPs"] = flops / best["us"] / 1e6
                best["pct_matmul"] = 100 * best["TFLOPs"] / cfg["bf16_matmul_TFLOPs"]
                row[kd] = best
                del o
            row["bf16_over_fp8"] = row["bf16"]["us"] / row["fp8_e4m3"]["us"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    out["prefill"] = rows


def bench_topk(out: dict, quick: bool) -> None:
    """One program per row (bisection / radix digit width, chunk, warps) against rows split over
    many programs (segment size), on single rows and batches."""
    g = torch.Generator(device=DEV).manual_seed(13)
    cases = [
        (1, 32768, 512),
        (1, 32768, 2048),
        (64, 32768, 512),
        (64, 32768, 2048),
        (1, 262144, 2048),
        (8, 262144, 512),
    ]
    # (bits, block, warps, segment); bits 0 = bisection, None = the defaults; segment 0 = one program
    # per row, None = triton_topk.split_segment's choice
    variants = [(None, None, None, None), (0, None, None, 0), (8, 8192, 16, 0)]
    variants += [(None, None, None, seg) for seg in (1024, 2048, 4096, 8192, 16384)]
    variants += [(None, None, 4, 2048), (None, None, 4, 1024)]
    # radix select with 4-bit and 2-bit digits (16 / 4 histogram bins a pass) in both stages
    variants += [
        (b, blk, None, seg) for b in (4, 2) for blk, seg in ((4096, 4096), (2048, 2048), (8192, 8192))
    ]
    variants += [(4, 8192, None, 0), (4, 32768, 32, 0)]
    res = []
    for R, L, k in cases[:2] if quick else cases:
        x = torch.randn(R, L, generator=g, device=DEV)
        st = torch.zeros(R, dtype=torch.int32, device=DEV)
        en = torch.full((R,), L, dtype=torch.int32, device=DEV)
        row = {
            "rows": R,
            "length": L,
            "k": k,
            "default_segment": triton_topk.split_segment(R, L, k),
            "variants": [],
        }
        want = triton_topk.topk(x, k, st, en, segment=0).sort(1).values
        for bits, block, nw, seg in variants:
            if seg and seg < k:  # every segment would pass all its entries on: a merge over > L candidates
                continue
            try:
                fn = partial(
                    triton_topk.topk, x, k, st, en, bits=bits, block=block, num_warps=nw, segment=seg
                )
                same = bool(torch.equal(fn().sort(1).values, want))  # full-size check beside the tests
                t = med(fn, graph=True)
            except Exception as e:
                print(f"topk variant {bits}/{block}/{nw}/{seg}: {type(e).__name__}: {str(e)[:120]}")
                continue
            row["variants"].append(
                {"bits": bits, "block": block, "num_warps": nw, "segment": seg, "us": t, "same_set": same}
            )
        row["torch_topk_us"] = med(partial(torch.topk, x, k, dim=1, sorted=False), graph=True)
        if L <= 32768:
            row["stages"] = topk_stages(x, k, st, en)
        res.append(row)
        print(json.dumps(row), flush=True)
    out["topk"] = res


def topk_stages(x: torch.Tensor, k: int, st: torch.Tensor, en: torch.Tensor) -> list[dict]:
    """Where a split top-k spends its time: the per-segment stage alone and the merge alone."""
    R, L = x.shape
    res = []
    for seg in (2048, 4096, 8192):
        if seg < k or seg >= L:
            continue
        S = triton.cdiv(L, seg)
        cand = torch.empty(R, S * k, dtype=torch.int32, device=DEV)
        out = torch.empty(R, k, dtype=torch.int32, device=DEV)
        tune1 = triton_topk._search(seg, None, None, None)
        tune2 = triton_topk._search(S * k, None, None, None)
        stage1 = partial(triton_topk._launch, x, cand, st, en, cand, L, k, (R, S), seg, tune1)
        merge = partial(triton_topk._launch, x, cand, st, en, out, S * k, k, (R, 1), 0, tune2)
        stage1()
        res.append(
            {
                "segment": seg,
                "stage1_us": med(stage1, graph=True),
                "merge_us": med(merge, graph=True),
                "candidates": S * k,
            }
        )
    return res


def bench_deepgemm(out: dict) -> None:
    """DeepGEMM's fp8 paged logits at batch 64 x 64K context, and fp8 prefill logits 4K x 32K."""
    try:
        import deep_gemm
    except Exception as e:  # report why it cannot run; the rest of the benchmark does not depend on it
        out["deepgemm"] = {"error": f"import deep_gemm: {type(e).__name__}: {str(e)[:300]}"}
        spec = importlib.util.find_spec("deep_gemm")
        so = Path(spec.origin).parent / "_C.so" if spec and spec.origin else Path("_C.so")
        try:  # the loader's own message names the missing symbol or library
            ctypes.CDLL(str(so))
        except OSError as dl:
            out["deepgemm"]["dlopen"] = str(dl)[:400]
        print(out["deepgemm"], flush=True)
        return
    res = {}
    try:
        c = decode_case(64, 65536, "fp8_e4m3", seed=3)
        B, pages = c["paged"].block_table.shape
        kv = c["paged"].data.view(-1, 64, 1, D + 4)
        q4 = c["q"].unsqueeze(1)  # [B, next_n=1, H, D]
        lens = c["lens"]
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        meta = deep_gemm.get_paged_mqa_logits_metadata(lens, 64, sms)
        fn = partial(
            deep_gemm.fp8_fp4_paged_mqa_logits, q4, kv, c["w"], lens, c["paged"].block_table, meta, c["L"]
        )
        got = fn()
        ours = triton_logits.paged_logits(c["q"], c["w"], c["paged"], lens)
        res["paged_64x64K_us"] = med(fn)
        res["paged_max_abs_diff_vs_triton"] = float(
            (got[:, : c["L"]].float() - ours[:, : c["L"]]).abs().max()
        )
        res["triton_paged_64x64K_us"] = med(
            lambda: triton_logits.paged_logits(c["q"], c["w"], c["paged"], lens)
        )
    except Exception as e:
        res["paged_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    try:
        g = torch.Generator(device=DEV).manual_seed(5)
        T, N = 4096, 32768
        qc, wf = quantize_queries(
            torch.randn(T, H, D, generator=g, device=DEV),
            torch.randn(T, H, generator=g, device=DEV),
            "fp8_e4m3",
        )
        keys = quantize_keys(torch.randn(N, D, generator=g, device=DEV), "fp8_e4m3")
        ks = torch.zeros(T, dtype=torch.int32, device=DEV)
        ke = torch.full((T,), N, dtype=torch.int32, device=DEV)
        fn = partial(deep_gemm.fp8_fp4_mqa_logits, qc, (keys.codes, keys.scales), wf, ks, ke, N)
        fn()
        t = med(fn)
        res["prefill_4Kx32K_us"] = t
        res["prefill_4Kx32K_TFLOPs"] = 2 * T * N * H * D / t / 1e6
    except Exception as e:
        res["prefill_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    out["deepgemm"] = res
    print(json.dumps(res), flush=True)


def environment() -> dict:
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0),
        "nvidia_smi": smi,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="a few sizes only (smoke test)")
    ap.add_argument(
        "--skip", default="", help="comma-separated sections to skip: decode,variants,prefill,topk,deepgemm"
    )
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    out: dict = {"env": environment()}
    print(json.dumps(out["env"]), flush=True)
    out["ceilings"] = ceilings()
    print(json.dumps(out["ceilings"]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    sections = [
        ("topk", lambda: bench_topk(out, args.quick)),
        ("decode", lambda: bench_decode(out["ceilings"], out, args.quick)),
        ("variants", lambda: bench_decode_variants(out)),
        ("prefill", lambda: bench_prefill(out["ceilings"], out, args.quick)),
        ("deepgemm", lambda: bench_deepgemm(out)),
    ]
    for name, fn in sections:
        if name in skip:
            continue
        try:
            fn()
        except Exception:  # one broken section must not cost the others' numbers in a short GPU lease
            traceback.print_exc()
            out.setdefault("errors", []).append(f"{name}: {traceback.format_exc(limit=3)}")
        (args.out / "indexer_bench.json").write_text(json.dumps(out, indent=1))  # keep partial results
    print(render_markdown(out))


def render_markdown(out: dict) -> str:
    c = out["ceilings"]
    lines = [
        f"Ceilings: copy {c['copy_GBps']:.0f} GB/s (read + write), bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s",
        "",
    ]
    if "decode" in out:
        lines += [
            "| batch | context | entries | fp8 logits µs | fp8 GB/s | % copy | bf16 logits µs | bf16 GB/s | % copy | bf16/fp8 | top-k 512 µs | logits+top-k µs | torch ref µs | speedup |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in out["decode"]:
            f, b = r["fp8_e4m3"], r["bf16"]
            ref = r.get("reference_us")
            ref_s, speed_s = ("n/a", "n/a") if ref is None else (f"{ref:.0f}", f"{r['speedup']:.1f}x")
            lines.append(
                f"| {r['batch']} | {r['context'] // 1024}K | {r['entries']} | {f['logits_us']:.1f} | {f['GBps']:.0f} | {f['pct_copy']:.0f}% "
                f"| {b['logits_us']:.1f} | {b['GBps']:.0f} | {b['pct_copy']:.0f}% | {r['bf16_over_fp8']:.2f} | {f['topk512_us']:.1f} "
                f"| {f['logits_topk_us']:.1f} | {ref_s} | {speed_s} |"
            )
        lines.append("")
    if "prefill" in out:
        lines += [
            "| queries | keys | bf16 µs | bf16 TFLOP/s | % matmul | fp8 µs | fp8 TFLOP/s | bf16/fp8 | best config bf16 / fp8 |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in out["prefill"]:
            b, f = r["bf16"], r["fp8_e4m3"]
            lines.append(
                f"| {r['queries']} | {r['keys'] // 1024}K | {b['us']:.0f} | {b['TFLOPs']:.0f} | {b['pct_matmul']:.0f}% | {f['us']:.0f} | {f['TFLOPs']:.0f} "
                f"| {r['bf16_over_fp8']:.2f} | {b['config']} / {f['config']} |"
            )
        lines.append("")
    if "topk" in out:
        lines += [
            "| rows | length | k | default µs (segment) | one program per row µs | best variant (bits/block/warps/segment) | µs | torch.topk µs |",
            "|---:|---:|---:|---:|---:|---|---:|---:|",
        ]
        for r in out["topk"]:
            vs = r["variants"]
            best = min(vs, key=lambda v: v["us"]) if vs else None
            v = (
                f"{best['bits']}/{best['block']}/{best['num_warps']}/{best['segment']}"
                if best
                else "none ran"
            )
            us = best["us"] if best else float("nan")
            dflt = next((x["us"] for x in vs if x["segment"] is None and x["bits"] is None), float("nan"))
            one = min((x["us"] for x in vs if x["segment"] == 0), default=float("nan"))
            bad = [x for x in vs if not x["same_set"]]
            lines.append(
                f"| {r['rows']} | {r['length']} | {r['k']} | {dflt:.1f} ({r['default_segment']}) | {one:.1f} | {v} | {us:.1f} "
                f"| {r['torch_topk_us']:.1f} |" + (f" DIFFERENT SETS: {bad}" if bad else "")
            )
        lines.append("")
        for r in out["topk"]:
            for st in r.get("stages", []):
                lines.append(
                    f"- {r['rows']} x {r['length']}, k={r['k']}, segment {st['segment']}: per-segment stage "
                    f"{st['stage1_us']:.1f} us, merge over {st['candidates']} candidates {st['merge_us']:.1f} us"
                )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
