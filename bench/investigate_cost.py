"""The investigation's cost: time and peak memory per phase, per case and per suspect, by length.

    python bench/investigate_cost.py --out OUT [--device cpu|cuda] [--lengths 1024,2048,4096,8192]
        [--routes inprocess,live] [--trials 2] [--depths 0,50,100] [--suspects 2] [--bug NAME]
        [--trials-sweep 1,2,4] [--suspects-sweep 1,2,4] [--threads N] [--src PATH[,PATH]]
        [--deadline SECONDS] [--max-memory 2GiB]
    python bench/investigate_cost.py --out OUT --device cuda --parallel 8 --lengths 4096   # 8 bugs at once
    python bench/investigate_cost.py --render OUT/rows.jsonl                               # the tables again

Each run is one investigation of the shipped organism with a planted bug of
``tests/planted_bugs`` (default ``topk_drops_best.py``: it costs recall, so every phase runs):

* **inprocess**: reference ``k=fp32 topk=cfg``, candidate ``k=fp8_e4m3 topk=64`` carrying the bug as
  an unnamed ``extra_patches`` entry; suspects (the first ``--suspects`` of ``SUSPECTS``) with
  ablations;
* **live**: ``needlescope serve`` with the candidate setting and ``--patch BUG
  --undisclosed-patch`` (a separate process: its memory is not in the run's numbers), a ledger from
  ``investigate init --live``, then ``investigate run``.

Every run is a child process (``--one``) with ``PYTHONPATH`` set to the source tree named by
``--src`` (default: this checkout's ``src``). Two trees (``--src OLD,NEW``) run each configuration
on both, one after the other on the same machine: the "before" and "after" of a change, side by side.
The child times the phases by wrapping the names ``needlescope.investigate.run`` calls (the
same in old and new trees): **symptom** (``measure_symptom``), **suspects** (``measure_suspects``,
``replay_fixes``), **localization** (``residual``, ``localize_residual``, ``failing_rank_paths``,
``live_localization``), **characterization** (``characterize_*``), **report** (``_write`` and
``write_reports``); the rest (questions, model load) is **other**. Per phase it records wall time,
the peak RSS of the process (sampled every 10 ms from ``/proc/self/statm``) and, on CUDA,
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` (reset at each phase start).
Cases measured are counted from the run's ``measure/*.jsonl`` records (every configuration's,
the localizer's and the characterization's included); cost per case is the run's wall time over
them, cost per suspect the suspects phase over the suspects. Growth exponents are least-squares slopes of log(cost) against log(length),
log(trials) and log(suspects).

``--parallel N``: N in-process investigations of N different planted bugs at one length, all at
once on the device (separate processes), each with its own peak memory; an out-of-memory error is
recorded as the run's error.

Writes OUT/rows.jsonl (one JSON row per run, appended as each finishes), OUT/cost.json (rows and
fits) and OUT/cost.md (the tables). Not a test: the numbers go to docs/perf.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLANTED = ROOT / "tests" / "planted_bugs"
CANDIDATE = "k=fp8_e4m3 q=fp32 acc=fp32 topk=64"
SUSPECTS = (  # (id, mapping): the first --suspects of these, each with an ablation
    ("index_topk", 'setting = "topk=64"'),
    ("index_keys_fp8", 'setting = "k=fp8_e4m3"'),
    ("hc_mix_bf16", 'patch = "patches/hc_mix_bf16.py"'),
    ("routed_scaling", 'patch = "patches/routed_scale_twice.py"'),
)
PARALLEL_BUGS = (  # --parallel: different planted bugs, harmful ones first
    "topk_drops_best.py",
    "scorer_key_scale.py",
    "key_cache_shift2.py",
    "recency_bias.py",
    "decode_sign_flip.py",
    "hash_router_table.py",
    "boundary_residue.py",
    "stale_far_keys.py",
    "indexer_rope_mismatch.py",
    "attn_out_bf16.py",
)
PHASES = ("symptom", "suspects", "localization", "characterization", "report", "other")
WRAPPED = {  # name -> phase, in needlescope.investigate.run and (a tree with typed seams) the
    # route modules of investigate/measure/ that call it; names absent from a tree are skipped
    "measure_suspects": "suspects",
    "replay_fixes": "suspects",
    "residual": "localization",
    "localize_residual": "localization",
    "failing_rank_paths": "localization",
    "live_localization": "localization",
    "characterize_inprocess": "characterization",
    "characterize_live": "characterization",
    "measure_characterization_inprocess": "characterization",
    "measure_characterization_live": "characterization",
    "_write": "report",
}
ROUTE_MODULES = ("inprocess", "live", "characterize", "localize", "rank_paths")
"""investigate/measure/ modules whose names ``WRAPPED`` also wraps (the typed-seams tree)."""


# ---------------------------------------------------------------- child: one investigation


class Meter:
    """Wall time and peak memory per phase of one process (the phase stack's top owns the time)."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.stack = ["other"]
        self.wall = dict.fromkeys(PHASES, 0.0)
        self.rss = dict.fromkeys(PHASES, 0)
        self.cuda_alloc = dict.fromkeys(PHASES, 0)
        self.cuda_reserved = dict.fromkeys(PHASES, 0)
        self.mark = time.perf_counter()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _sample(self) -> None:
        while not self.stop.wait(0.01):
            top = self.stack[-1]
            self.rss[top] = max(self.rss[top], self._rss())

    def _switch(self, new_top: str) -> None:
        now = time.perf_counter()
        top = self.stack[-1]
        self.wall[top] += now - self.mark
        self.rss[top] = max(self.rss[top], self._rss())
        if self.cuda:
            import torch

            self.cuda_alloc[top] = max(self.cuda_alloc[top], torch.cuda.max_memory_allocated())
            self.cuda_reserved[top] = max(self.cuda_reserved[top], torch.cuda.max_memory_reserved())
            torch.cuda.reset_peak_memory_stats()
        self.mark = now
        del new_top

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            self._switch(phase)
            self.stack.append(phase)
            try:
                return fn(*args, **kwargs)
            finally:
                self._switch(self.stack[-2])
                self.stack.pop()

        return timed

    def finish(self) -> dict:
        self._switch("other")
        self.stop.set()
        mib = 1 << 20
        out = {
            p: {"wall_s": round(self.wall[p], 2), "peak_rss_mib": round(self.rss[p] / mib, 1)} for p in PHASES
        }
        if self.cuda:
            for p in PHASES:
                out[p]["cuda_max_allocated_mib"] = round(self.cuda_alloc[p] / mib, 1)
                out[p]["cuda_max_reserved_mib"] = round(self.cuda_reserved[p] / mib, 1)
        return out


def _instrument(meter: Meter) -> None:
    """Wrap the phase functions ``needlescope.investigate.run`` calls, and (a tree with typed
    seams) those its routes call (in the tree on sys.path)."""
    import importlib

    import needlescope.investigate.run as run_mod
    from needlescope.investigate.report import diagnosis

    modules = [run_mod]
    for name in ROUTE_MODULES:
        try:
            modules.append(importlib.import_module(f"needlescope.investigate.measure.{name}"))
        except ImportError:  # an older tree without it
            pass
    for mod in modules:
        for name, phase in WRAPPED.items():
            if hasattr(mod, name):
                setattr(mod, name, meter.wrap(phase, getattr(mod, name)))
    inprocess = getattr(run_mod, "inprocess", None)
    if inprocess is not None:
        inprocess.measure_symptom = meter.wrap("symptom", inprocess.measure_symptom)
    live = next((m.LiveRoute for m in modules if hasattr(m, "LiveRoute")), None)
    if live is not None:
        live.measure_symptom = meter.wrap("symptom", live.measure_symptom)
    diagnosis.write_reports = meter.wrap("report", diagnosis.write_reports)


def _symptom_toml(length: int, depths: list[int], trials: int) -> list[str]:
    return [
        "[symptom]",
        'kind = "multiturn"',
        f"lengths = [{length}]",
        f"depths = {json.dumps(depths)}",
        f"trials = {trials}",
        "seed = 0",
        "max_new_tokens = 6",
        "",
    ]


def inprocess_ledger(d: Path, spec: dict) -> Path:
    from needlescope.investigate.ledger.example import write_example

    write_example(d, force=True)  # the patch files the suspects map to
    (d / "extra").mkdir(exist_ok=True)
    shutil.copy(PLANTED / spec["bug"], d / "extra" / "p1.py")  # a neutral name: the run never reads it
    lines = ["[target]", 'model = "organism"', f'device = "{spec["device"]}"', f"threads = {spec['threads']}"]
    lines += ['reference = "k=fp32 q=fp32 acc=fp32 topk=cfg"', f'candidate = "{CANDIDATE}"']
    lines += ['extra_patches = ["extra/p1.py"]', ""]
    lines += _symptom_toml(spec["length"], spec["depths"], spec["trials"])
    for i, (sid, mapping) in enumerate(SUSPECTS[: spec["suspects"]]):
        lines += ["[[suspects]]", f'id = "{sid}"', f"tier = {1 + i}", f'hypothesis = "{sid}"', mapping]
        lines += ['checks = ["ablation"]', ""]
    (d / "investigation.toml").write_text("\n".join(lines))
    return d / "investigation.toml"


def _run_inprocess(d: Path, spec: dict) -> None:
    from needlescope.investigate.run import run_investigation

    ledger = inprocess_ledger(d, spec)
    if not spec.get("max_memory"):
        return run_investigation(ledger, d / "out")
    from needlescope.dsa.budget import bounded_memory  # a tree before issue 55 has no --max-memory

    with bounded_memory(spec["max_memory"], spec["device"]):
        return run_investigation(ledger, d / "out")


def _run_live(d: Path, spec: dict) -> dict:
    """The live route against a served candidate; returns the server's peak RSS (MiB)."""
    from needlescope.investigate.ledger.init import live_ledger, write_ledger
    from needlescope.investigate.run import run_investigation
    from needlescope.serve.config import ServeConfig
    from needlescope.serve.launch import ServerProcess
    from needlescope.setting import Setting

    setting = Setting.parse(f"{CANDIDATE} patch={PLANTED / spec['bug']}")
    cfg = ServeConfig(
        model="organism",
        port=0,
        setting=setting,
        disclose_patch=False,
        device=spec["device"],
        threads=spec["threads"],
    )
    with ServerProcess(cfg, timeout=600) as server:
        symptom = {
            "kind": "multiturn",
            "lengths": [spec["length"]],
            "depths": spec["depths"],
            "trials": spec["trials"],
            "seed": 0,
        }
        text = live_ledger(server.url, symptom=symptom, why="bench/investigate_cost.py")
        text = text.replace("threads = 2", f'threads = {spec["threads"]}\ndevice = "{spec["device"]}"', 1)
        ledger = write_ledger(d, text, force=True)
        run_investigation(ledger, d / "out")
        pid = server.proc.pid if hasattr(server, "proc") else None
        return {"server_peak_rss_mib": _vm_hwm_mib(pid)} if pid else {}


def _vm_hwm_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def _cases_measured(out: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in (out / "measure").glob("*.jsonl"))


def run_one(spec: dict, row_file: Path) -> None:
    """Child mode: one investigation; its row is written to ``row_file``."""
    import torch

    torch.set_num_threads(spec["threads"])
    d = Path(spec["dir"])
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    import needlescope

    row = {**spec, "tree": str(Path(needlescope.__file__).resolve().parents[1])}
    meter = Meter(spec["device"])
    _instrument(meter)
    t0 = time.perf_counter()
    profiler = None
    if spec.get("profile"):
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    try:
        if spec["route"] == "inprocess":
            _run_inprocess(d, spec)
        else:
            row.update(_run_live(d, spec))
        from needlescope.investigate.decide.findings import Findings
        from needlescope.investigate.report import diagnosis

        diagnosis.write_reports(Findings.read(d / "out"))
        v = json.loads((d / "out" / "verdicts.json").read_text())
        row.update(completes=True, root_cause=v["root_cause"], symptom=v["symptom"].get("recall_candidate"))
    except BaseException as exc:  # noqa: BLE001 - a crash (an OOM included) is a row of the table
        row.update(completes=False, error=f"{type(exc).__name__}: {traceback.format_exc()[-1200:]}")
    row["wall_s"] = round(time.perf_counter() - t0, 2)
    if profiler is not None:
        _write_profile(profiler, Path(spec["dir"] + ".profile.txt"))
    row["phases"] = meter.finish()
    row["cases_measured"] = _cases_measured(d / "out") if (d / "out" / "measure").exists() else 0
    row.update(_derived(row))
    if spec["device"].startswith("cuda"):
        row["gpu"] = torch.cuda.get_device_name()
    shutil.rmtree(d, ignore_errors=True)
    row_file.write_text(json.dumps(row))


def _write_profile(profiler, path: Path) -> None:
    """The run's cProfile: the 60 heaviest functions by cumulative and by own time."""
    import io
    import pstats

    profiler.disable()
    buf = io.StringIO()
    stats = pstats.Stats(profiler, stream=buf).strip_dirs()
    stats.sort_stats("cumulative").print_stats(60)
    stats.sort_stats("tottime").print_stats(60)
    path.write_text(buf.getvalue())


def _derived(row: dict) -> dict:
    ph = row["phases"]
    n = row["cases_measured"]
    peak = max(p["peak_rss_mib"] for p in ph.values())
    out = {
        "s_per_case": round(row["wall_s"] / n, 3) if n else None,
        "s_per_suspect": round(ph["suspects"]["wall_s"] / row["suspects"], 2) if row["suspects"] else None,
        "peak_rss_mib": peak,
    }
    if "cuda_max_allocated_mib" in ph["symptom"]:
        out["cuda_max_allocated_mib"] = max(p["cuda_max_allocated_mib"] for p in ph.values())
        out["cuda_max_reserved_mib"] = max(p["cuda_max_reserved_mib"] for p in ph.values())
    return out


# ---------------------------------------------------------------- parent: the grid


def _spawn(args, spec: dict, src: str) -> subprocess.Popen:
    row = Path(spec["dir"] + ".row.json")
    row.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": str(spec["threads"])}
    env["MKL_NUM_THREADS"] = str(spec["threads"])
    env.setdefault("HF_HUB_OFFLINE", "1")
    log = open(spec["dir"] + ".log", "w")
    argv = [sys.executable, str(Path(__file__).resolve()), "--one", json.dumps(spec), "--row", str(row)]
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.row_file, proc.spec, proc.t0 = row, spec, time.time()
    return proc


def _collect(proc: subprocess.Popen, deadline: float | None) -> dict:
    try:
        proc.wait(timeout=None if deadline is None else max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        return {**proc.spec, "completes": False, "error": "cut at the deadline", "wall_s": None}
    if proc.row_file.exists():
        return json.loads(proc.row_file.read_text())
    tail = Path(proc.spec["dir"] + ".log").read_text()[-1200:]
    return {
        **proc.spec,
        "completes": False,
        "error": f"child exited {proc.returncode}: {tail}",
        "wall_s": None,
    }


def _append(out: Path, row: dict) -> None:
    with open(out / "rows.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    keep = {k: row.get(k) for k in ("tree", "route", "length", "trials", "suspects", "bug", "wall_s")}
    print(json.dumps(keep | {"s_per_case": row.get("s_per_case"), "error": (row.get("error") or "")[-200:]}))
    sys.stdout.flush()


def _spec(args, out: Path, src: str, tag: str, **over) -> dict:
    spec = {
        "route": "inprocess",
        "length": args.lengths[0],
        "trials": args.trials,
        "depths": args.depths,
        "suspects": args.suspects,
        "bug": args.bug,
        "device": args.device,
        "threads": args.threads,
        "max_memory": args.max_memory,
        "profile": args.profile,
    }
    spec.update(over)
    name = f"{tag}-{spec['route']}-L{spec['length']}-t{spec['trials']}-s{spec['suspects']}-{spec['bug'][:-3]}"
    spec["dir"] = str(out / "runs" / name)
    spec["src_tag"] = tag
    return spec


def grid(args) -> list[tuple[str, dict]]:
    """(source tree, spec) of every run: lengths x routes, then the trials and suspects sweeps."""
    out, runs = args.out, []
    for i, src in enumerate(args.src):
        tag = "old" if len(args.src) > 1 and i == 0 else ("new" if len(args.src) > 1 else "tree")
        for route in args.routes:
            for length in args.lengths:
                runs.append((src, _spec(args, out, src, tag, route=route, length=length)))
        for t in args.trials_sweep:
            if t != args.trials:
                runs.append((src, _spec(args, out, src, tag, trials=t)))
        for s in args.suspects_sweep:
            if s != args.suspects:
                runs.append((src, _spec(args, out, src, tag, suspects=s)))
    return runs


def run_grid(args) -> list[dict]:
    deadline = None if args.deadline is None else time.time() + args.deadline
    rows = []
    if args.parallel:
        procs = []
        for i in range(args.parallel):
            bug = PARALLEL_BUGS[i % len(PARALLEL_BUGS)]
            spec = _spec(args, args.out, args.src[-1], f"par{i}", bug=bug)
            procs.append(_spawn(args, spec, args.src[-1]))
        for p in procs:
            rows.append(_collect(p, deadline))
            _append(args.out, rows[-1])
        return rows
    # side by side: each configuration on every tree before the next configuration
    runs = grid(args)
    order = sorted(range(len(runs)), key=lambda i: (i % (len(runs) // len(args.src)), i))
    for i in order:
        src, spec = runs[i]
        if deadline is not None and time.time() > deadline:
            rows.append(
                {**spec, "completes": False, "error": "not started: past the deadline", "wall_s": None}
            )
        else:
            rows.append(_collect(_spawn(args, spec, src), deadline))
        _append(args.out, rows[-1])
    return rows


# ---------------------------------------------------------------- fits and tables


def _per_case(r: dict) -> float | None:
    """Seconds per case measured (rows of older runs of this bench are recomputed the same way)."""
    n = r.get("cases_measured")
    return round(r["wall_s"] / n, 3) if n and r.get("wall_s") else None


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of log(y) on log(x) over ``points`` (x, y > 0); None under two x."""
    pts = [(math.log(x), math.log(y)) for x, y in points if x and y and x > 0 and y > 0]
    if len({x for x, _ in pts}) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return round(sum((x - mx) * (y - my) for x, y in pts) / sxx, 2)


def fits(rows: list[dict]) -> dict:
    """Growth exponents per (tree, route): in length, trials and suspects."""
    out: dict = {}
    ok = [r for r in rows if r.get("completes")]
    for tree in sorted({r.get("src_tag", "tree") for r in ok}):
        for route in sorted({r["route"] for r in ok}):
            rs = [r for r in ok if r.get("src_tag", "tree") == tree and r["route"] == route]
            base_t = min((r["trials"] for r in rs), default=0)
            base_s = min((r["suspects"] for r in rs), default=0)
            by_len = [r for r in rs if r["trials"] == rs[0]["trials"] and r["suspects"] == rs[0]["suspects"]]
            length0 = min((r["length"] for r in rs), default=0)
            f = {
                "s_per_case_vs_length": slope([(r["length"], _per_case(r)) for r in by_len]),
                "wall_vs_length": slope([(r["length"], r["wall_s"]) for r in by_len]),
                "peak_rss_vs_length": slope([(r["length"], r["peak_rss_mib"]) for r in by_len]),
                "wall_vs_trials": slope(
                    [
                        (r["trials"], r["wall_s"])
                        for r in rs
                        if r["length"] == length0 and r["suspects"] == base_s
                    ]
                ),
                "wall_vs_suspects": slope(
                    [
                        (r["suspects"], r["wall_s"])
                        for r in rs
                        if r["length"] == length0 and r["trials"] == base_t
                    ]
                ),
            }
            if any("cuda_max_allocated_mib" in r for r in by_len):
                f["cuda_alloc_vs_length"] = slope(
                    [(r["length"], r.get("cuda_max_allocated_mib")) for r in by_len]
                )
            out[f"{tree}/{route}"] = f
    return out


def _mem(r: dict) -> str:
    if "cuda_max_allocated_mib" in r:
        return f"{r['cuda_max_allocated_mib']:.0f} / {r['cuda_max_reserved_mib']:.0f} (RSS {r['peak_rss_mib']:.0f})"
    return f"{r.get('peak_rss_mib', 0):.0f}"


def render(rows: list[dict]) -> str:
    cuda = any("cuda_max_allocated_mib" in r for r in rows)
    mem = "peak CUDA alloc / reserved MiB (RSS)" if cuda else "peak RSS MiB"
    head = (
        f"| tree | route | bug | length | trials | suspects | cases | wall s | s/case | s/suspect | {mem} |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        if not r.get("completes"):
            err = (r.get("error") or "").strip().splitlines()
            lines.append(
                f"| {r.get('src_tag')} | {r['route']} | {r['bug']} | {r['length']} | {r['trials']} | "
                f"{r['suspects']} | - | {r.get('wall_s')} | - | - | failed: {err[-1][:80] if err else ''} |"
            )
            continue
        lines.append(
            f"| {r.get('src_tag')} | {r['route']} | {r['bug'][:-3]} | {r['length']} | {r['trials']} | "
            f"{r['suspects']} | {r['cases_measured']} | {r['wall_s']:.1f} | {_per_case(r)} | "
            f"{r['s_per_suspect']} | {_mem(r)} |"
        )
    lines += ["", "Per phase, wall s / peak " + ("CUDA allocated MiB" if cuda else "RSS MiB") + ":", ""]
    lines += ["| tree | route | length | trials | suspects | " + " | ".join(PHASES) + " |", "|" + "---|" * 11]
    for r in rows:
        if not r.get("completes"):
            continue
        cells = []
        for p in PHASES:
            ph = r["phases"][p]
            m = ph.get("cuda_max_allocated_mib", ph["peak_rss_mib"])
            cells.append(f"{ph['wall_s']:.1f} / {m:.0f}")
        lines.append(
            f"| {r.get('src_tag')} | {r['route']} | {r['length']} | {r['trials']} | {r['suspects']} | "
            + " | ".join(cells)
            + " |"
        )
    f = fits(rows)
    if f:
        lines += ["", "Growth exponents (slope of log cost on log x):", ""]
        keys = sorted({k for v in f.values() for k in v})
        lines += ["| tree/route | " + " | ".join(keys) + " |", "|" + "---|" * (len(keys) + 1)]
        lines += [f"| {k} | " + " | ".join(str(v.get(x)) for x in keys) + " |" for k, v in f.items()]
    return "\n".join(lines) + "\n"


def write_outputs(out: Path, rows: list[dict], argv: list[str]) -> None:
    meta = {
        "command": "python bench/investigate_cost.py " + " ".join(argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    (out / "cost.json").write_text(json.dumps({**meta, "rows": rows, "fits": fits(rows)}, indent=1))
    (out / "cost.md").write_text(f"`{meta['command']}` ({meta['date']})\n\n" + render(rows))
    print(render(rows))


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--lengths", type=_ints, default=[1024, 2048, 4096, 8186])
    ap.add_argument("--routes", type=lambda s: s.split(","), default=["inprocess", "live"])
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--depths", type=_ints, default=[0, 50, 100])
    ap.add_argument("--suspects", type=int, default=2)
    ap.add_argument("--bug", default="topk_drops_best.py")
    ap.add_argument("--trials-sweep", type=_ints, default=[])
    ap.add_argument("--suspects-sweep", type=_ints, default=[])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--src", type=lambda s: [str(Path(x).resolve()) for x in s.split(",")], default=[str(ROOT / "src")]
    )
    ap.add_argument("--deadline", type=float, default=None, help="seconds for the whole grid")
    ap.add_argument("--max-memory", default=None, help="each run's bound (investigate run --max-memory)")
    ap.add_argument("--parallel", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="each run's cProfile to runs/NAME.profile.txt")
    ap.add_argument("--one")
    ap.add_argument("--row", type=Path)
    ap.add_argument("--render", type=Path)
    args = ap.parse_args(argv)
    if args.one:
        return run_one(json.loads(args.one), args.row)
    if args.render:
        rows = [json.loads(x) for x in args.render.read_text().splitlines() if x.strip()]
        print(render(rows))
        return None
    if args.out is None:
        ap.error("--out is required")
    if not (PLANTED / args.bug).exists():
        ap.error(f"--bug: no {args.bug} in tests/planted_bugs")
    if not 1 <= args.suspects <= len(SUSPECTS):
        ap.error(f"--suspects must be in 1..{len(SUSPECTS)}")
    (args.out / "runs").mkdir(parents=True, exist_ok=True)
    rows = run_grid(args)
    write_outputs(args.out, rows, argv)
    return None


if __name__ == "__main__":
    main(sys.argv[1:])
