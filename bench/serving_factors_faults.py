"""Does ``needlescope serving-factors`` name the right factor for each planted serving fault of
``needlescope serve``, within a request budget (issue 52: 3,000 on CPU)?

Each ``--case`` is ``EXPECTED|SERVE ARGS A|SERVE ARGS B|SERVING-FACTORS ARGS``: the factor the
recall verdict must name, or ``output:FACTOR`` for the factor the output-identity verdict must
name (a fault that changes greedy output but costs no recall; add ``--continuation N`` to the
experiment's flags), or ``none`` (a healthy control: neither verdict names a factor); the first server's flags (after ``--model organism --port 0``), the second
server's (empty: one endpoint) and the experiment's flags (``--base-url``, ``--model`` and
``--out`` are added). One line per case and a final count; exit 1 when a case names another
factor or sends more than ``--budget`` requests.

    python bench/serving_factors_faults.py --keep /tmp/sf_faults \
      --case 'batch|--threads 1 --index-topk 16 --patch fault:batch_variant_scores||--factors batch,repeat --batch-mates 1,7 --lengths 256 --depths 0,25,50,75,100 --trials 3' \
      --case 'chunk|--threads 1 --patch fault:chunk_carry|--threads 1 --prefill-chunk 100 --patch fault:chunk_carry|--factors endpoint,repeat --endpoint-factor chunk --endpoint-labels off,100 --lengths 256 --depths 0,25,50,75,100 --trials 3'

docs/serving_factors.md ("Planted faults") has every fault's case and what each printed.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from needlescope.serve.launch import ServerProcess


def _case(text: str) -> tuple[str, list[str], list[str], list[str]]:
    parts = text.split("|")
    if len(parts) != 4:
        raise argparse.ArgumentTypeError(f"--case takes EXPECTED|SERVE A|SERVE B|ARGS; got {text!r}")
    expected, a, b, args = parts
    return expected.strip(), shlex.split(a), shlex.split(b), shlex.split(args)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", type=_case, action="append", required=True)
    p.add_argument("--budget", type=int, default=3000)
    p.add_argument(
        "--keep", type=Path, help="copy each case's serving_factors.md/.json to KEEP/<n>-<expected>/"
    )
    a = p.parse_args()
    wrong = 0
    for n, (expected, serve_a, serve_b, args) in enumerate(a.case):
        t0 = time.monotonic()
        with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
            urls = [
                stack.enter_context(
                    ServerProcess(["--model", "organism", "--port", "0", *flags], timeout=300)
                ).url
                for flags in ([serve_a, serve_b] if serve_b else [serve_a])
            ]
            cmd = [sys.executable, "-m", "needlescope.cli.main", "serving-factors", "--model", "organism"]
            cmd += [x for u in urls for x in ("--base-url", u + "/v1")] + ["--out", tmp, *args]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if a.keep is not None:
                shutil.copytree(tmp, a.keep / f"{n}-{expected}", dirs_exist_ok=True)
            body = (
                json.loads((Path(tmp) / "serving_factors.json").read_text()) if done.returncode < 2 else None
            )
        if body is None:
            print(
                f"{expected}: serving-factors failed (exit {done.returncode}): {done.stderr.strip()[-300:]}"
            )
            wrong += 1
            continue
        sent, named = body["requests"]["sent"], body["verdict"]["named"]
        ident = body["identity"]
        changed = ident["verdict"]["named"] if ident is not None else None
        if expected.startswith("output:"):
            ok = changed == expected.removeprefix("output:")
        elif expected == "none":
            ok = named is None and changed is None
        else:
            ok = named == expected
        ok = ok and sent <= a.budget
        wrong += not ok
        print(
            f"{'ok' if ok else 'WRONG'} {expected}: recall names {named!r}, output names {changed!r}, "
            f"{sent} requests, {time.monotonic() - t0:.0f} s: {body['verdict']['sentence']}"
            + (f" | output: {ident['verdict']['sentence']}" if ident is not None else ""),
            flush=True,
        )
    print(f"{len(a.case) - wrong} of {len(a.case)} cases named their factor within {a.budget} requests")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
