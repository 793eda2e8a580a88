"""Issue 37's planted set on both routes: the characterization against the planted class.

    python bench/investigate_planted_37.py OUT [--table cpu:512,1024] [--table cuda:1024,2048]
        [--jobs 12] [--gpu-jobs 4] [--threads 1] [--deadline 540] [--depths 0,50,100]
        [--trials 1] [--inprocess-trials 4] [--bugs NAME,...] [--routes inprocess,live]
    python bench/investigate_planted_37.py --render OUT/rows.jsonl     # the docs/investigate.md tables

Each bug is a patch file of ``tests/planted_bugs/`` (``CLASSES`` there: the planted class).
**In-process**: the example ledger with the candidate ``k=fp8_e4m3 topk=64`` carrying the bug as
an unnamed ``extra_patches`` entry (no page-table fault). **Live**: ``needlescope serve`` with
``--index-k fp8_e4m3 --index-topk 64 --patch BUG --undisclosed-patch`` (``/get_server_info``
names no patch), a ledger written by ``investigate init --live``, then ``investigate run``.

In-process runs take ``--inprocess-trials`` (4: 24 paired cases at two lengths and three depths,
enough for ``power_check`` to exonerate a benign bug's automatic suspect at the Holm level of the
example ledger's ablations; with one trial it can only be "inconclusive"); live runs ``--trials``
(one: a benign bug's "nothing to explain" needs no power).

Every (table, bug, route) run is its own process (``--one``), ``--jobs`` at a time on the CPU
table(s) and ``--gpu-jobs`` on a CUDA one, each with ``--threads`` torch threads (the ledger's
``threads``, the live server's ``--threads``, ``OMP_NUM_THREADS``). Each finished run appends its
row to OUT/rows.jsonl at once (and OUT/summary.json is rewritten), so a run cut short keeps
every finished row; a second invocation skips the rows that completed. At ``--deadline`` seconds
the runs still going are stopped and recorded as not completed ("cut at the deadline"). Not a
test: the table goes to docs/investigate.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from planted_bugs import CLASSES  # noqa: E402

PLANTED = ROOT / "tests" / "planted_bugs"
CANDIDATE = "k=fp8_e4m3 q=fp32 acc=fp32 topk=64"


def _target_text(text: str, args, lengths: list[int]) -> str:
    """The ledger's target and symptom with this run's device, threads, lengths, depths, trials."""
    text = text.replace('device = "cpu"', f'device = "{args.device}"')
    text = text.replace("threads = 2", f"threads = {args.threads}")
    if 'device = "' not in text:  # a live ledger names no device: the reference runs on ours
        text = text.replace("[target]\n", f'[target]\ndevice = "{args.device}"\n', 1)
    text = text.replace("lengths = [256, 512, 1024]", f"lengths = {json.dumps(lengths)}")
    return text.replace("depths = [0, 50, 100]", f"depths = {json.dumps(args.depths)}")


def inprocess_ledger(d: Path, bug: str, args, lengths: list[int]) -> Path:
    from needlescope.investigate.ledger.example import write_example

    write_example(d, force=True)
    text = _target_text((d / "investigation.toml").read_text(), args, lengths)
    text = text.replace("trials = 2", f"trials = {args.inprocess_trials}\nmax_new_tokens = 6")
    (d / "extra").mkdir(exist_ok=True)
    shutil.copy(PLANTED / bug, d / "extra" / "p1.py")  # a neutral name: nothing reads it but the run
    text = text.replace(
        'candidate = "k=fp8_e4m3 q=fp32 acc=fp32 topk=64 patch=fault:indexer_page_table"',
        f'candidate = "{CANDIDATE}"',
    )
    text = text.replace("extra_patches = []", 'extra_patches = ["extra/p1.py"]')
    (d / "investigation.toml").write_text(text)
    return d / "investigation.toml"


def live_run(d: Path, bug: str, args, lengths: list[int]) -> Path:
    from needlescope.investigate.ledger.init import live_ledger, write_ledger
    from needlescope.investigate.run import run_investigation
    from needlescope.serve.config import ServeConfig
    from needlescope.serve.launch import ServerProcess
    from needlescope.setting import Setting

    setting = Setting.parse(f"{CANDIDATE} patch={PLANTED / bug}")
    cfg = ServeConfig(
        model="organism",
        port=0,
        setting=setting,
        disclose_patch=False,
        device=args.device,
        threads=args.threads,
    )
    with ServerProcess(cfg, timeout=300) as server:
        symptom = {
            "kind": "multiturn",
            "lengths": lengths,
            "depths": args.depths,
            "trials": args.trials,
            "seed": 0,
        }
        text = live_ledger(server.url, symptom=symptom, why="issue 37 planted run")
        assert "p1" not in text and bug not in text, "the ledger must not see the patch"
        ledger = write_ledger(d, _target_text(text, args, lengths), force=True)
        run_investigation(ledger, d / "out")
        return d / "out" / "verdicts.json"


def summarise(verdicts: Path) -> dict:
    from needlescope.investigate.decide.findings import Findings
    from needlescope.investigate.report.diagnosis import write_reports

    write_reports(Findings.read(verdicts.parent))
    v = json.loads(verdicts.read_text())
    ch = v.get("characterization") or {}
    diag = (verdicts.parent / "DIAGNOSIS.md").read_text()
    line = next((ln for ln in diag.splitlines() if "**Root cause:**" in ln), "")
    return {
        "root_cause": v["root_cause"],
        "classes": ch.get("classes"),
        "where": ch.get("where"),
        "next": ch.get("next"),
        "root_line": line,
        "suspects": {s["id"]: s["verdict"] for s in v["suspects"]},
        "recall_reference": v["symptom"]["recall_reference"],
        "recall_candidate": v["symptom"]["recall_candidate"],
        "measured": ch.get("measured"),
    }


def run_one(args) -> None:
    """Child mode: one (table, bug, route); its row is written to ``--row``."""
    import torch

    from needlescope.investigate.run import run_investigation

    device, table_lengths, bug, route = args.one.split(":")
    args.device, lengths = device, [int(x) for x in table_lengths.split(",")]
    torch.set_num_threads(args.threads)
    # one folder per table: two tables of one device (cpu:512,1024 and cpu:1024,2048) run at once
    d = args.out / f"{device}-{table_lengths.replace(',', '-')}" / bug.removesuffix(".py") / route
    d.mkdir(parents=True, exist_ok=True)
    row = {"key": args.one, "device": device, "lengths": lengths, "bug": bug, "route": route}
    row.update(planted=CLASSES[bug][0], undo=CLASSES[bug][1])
    t0 = time.time()
    try:
        if route == "inprocess":
            run_investigation(inprocess_ledger(d, bug, args, lengths), d / "out")
            verdicts = d / "out" / "verdicts.json"
        else:
            verdicts = live_run(d, bug, args, lengths)
        row.update(completes=True, **summarise(verdicts))
    except Exception:  # noqa: BLE001 - a crash is a row of the table
        row.update(completes=False, error=traceback.format_exc()[-1500:])
    row["seconds"] = round(time.time() - t0, 1)
    Path(args.row).write_text(json.dumps(row))


def _pairs(args) -> list[str]:
    keys = []
    for table in args.table:
        device, lengths = table.split(":")
        for bug in args.bugs.split(","):
            bug = bug if bug.endswith(".py") else f"{bug}.py"
            if bug not in CLASSES:
                sys.exit(f"--bugs: {bug} is not in tests/planted_bugs (CLASSES)")
            keys += [f"{device}:{lengths}:{bug}:{route}" for route in args.routes.split(",")]
    return keys


def _append(out: Path, row: dict, rows: dict) -> None:
    with open(out / "rows.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())
    rows[row["key"]] = row
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    print(row["key"], row.get("classes"), row.get("root_cause"), row["seconds"], flush=True)


def _child(args, key: str) -> subprocess.Popen:
    row = args.out / "rows" / (key.replace(":", "_").replace(",", "-") + ".json")
    row.parent.mkdir(parents=True, exist_ok=True)
    row.unlink(missing_ok=True)
    argv = [sys.executable, __file__, str(args.out), "--one", key, "--row", str(row)]
    argv += [
        "--depths",
        ",".join(map(str, args.depths)),
        "--trials",
        str(args.trials),
        "--threads",
        str(args.threads),
        "--inprocess-trials",
        str(args.inprocess_trials),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    log = open(args.out / "rows" / (row.stem + ".log"), "w")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.row_file, proc.key, proc.t0 = row, key, time.time()
    return proc


def run_all(args) -> None:
    """Parent mode: every pair not yet completed, ``--jobs`` CPU and ``--gpu-jobs`` CUDA at a time."""
    args.out.mkdir(parents=True, exist_ok=True)
    rows: dict = {}
    if (args.out / "rows.jsonl").exists():
        for line in (args.out / "rows.jsonl").read_text().splitlines():
            rows[json.loads(line)["key"]] = json.loads(line)
    todo = [k for k in _pairs(args) if not rows.get(k, {}).get("completes")]
    todo.sort(key=lambda k: k.endswith(":live"))  # in-process runs (more trials) are the longer ones
    running: list[subprocess.Popen] = []
    deadline = time.time() + args.deadline
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's TERM: stop the children too
    try:
        _schedule(args, todo, running, rows, deadline)
    finally:
        for p in running:  # the deadline: stop what is still going, the live servers with it
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            _append(args.out, _cut(p, "cut at the deadline"), rows)


def _schedule(args, todo: list[str], running: list, rows: dict, deadline: float) -> None:
    while (todo or running) and time.time() < deadline:
        for kind, limit in (("cpu", args.jobs), ("cuda", args.gpu_jobs)):
            busy = sum(p.key.startswith(kind) for p in running)
            for key in [k for k in todo if k.startswith(kind)][: max(0, limit - busy)]:
                todo.remove(key)
                running.append(_child(args, key))
        for p in [p for p in running if p.poll() is not None]:
            running.remove(p)
            row = json.loads(p.row_file.read_text()) if p.row_file.exists() else None
            _append(args.out, row or _cut(p, f"exit {p.returncode} (log: {p.row_file.stem}.log)"), rows)
        time.sleep(0.5)


def _cut(p, why: str) -> dict:
    device, lengths, bug, route = p.key.split(":")
    return {"key": p.key, "device": device, "bug": bug, "route": route, "planted": CLASSES[bug][0],
            "undo": CLASSES[bug][1], "completes": False, "error": why, "seconds": round(time.time() - p.t0, 1)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("--table", action="append", help="DEVICE:LENGTHS, e.g. cpu:512,1024 (repeatable)")
    ap.add_argument("--depths", default="0,50,100")
    ap.add_argument("--trials", type=int, default=1, help="trials per length and depth, live")
    ap.add_argument(
        "--inprocess-trials",
        type=int,
        default=4,
        help="in-process: 24 paired cases can exonerate (power_check)",
    )
    ap.add_argument("--bugs", default=",".join(CLASSES))
    ap.add_argument("--routes", default="inprocess,live")
    ap.add_argument("--jobs", type=int, default=1, help="CPU-table runs at a time")
    ap.add_argument("--gpu-jobs", type=int, default=1, help="CUDA-table runs at a time")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds; then the runs left are stopped")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--row", help=argparse.SUPPRESS)
    ap.add_argument("--render", type=Path, help="print the docs/investigate.md tables of a rows.jsonl")
    args = ap.parse_args()
    if args.render is not None:
        from investigate_planted_37_table import render

        print(render(args.render))
        return
    args.depths = [int(x) for x in args.depths.split(",")]
    args.table = args.table or ["cpu:512,1024"]
    if args.one:
        run_one(args)
    else:
        run_all(args)


if __name__ == "__main__":
    main()
