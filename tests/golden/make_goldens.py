"""Make the golden ``Measured`` and ``Findings`` files (tests/golden/measured, tests/golden/findings).

    # a real run: `needlescope investigate run LEDGER --out OUT` exactly as the command line runs it,
    # the route's Measured captured on its way into decide; writes measured/NAME/ (measured.json
    # and the ledger's files) and findings/NAME.json (its investigation.json)
    python tests/golden/make_goldens.py capture LEDGER OUT NAME

    # one golden per characterization class, from the captured run BASE (module docstring below)
    python tests/golden/make_goldens.py classes BASE

The class goldens are BASE's measurements with the characterization's evidence replaced by the
evidence ``CLASS_EVIDENCE`` builds for each class (the records ``characterize``'s unit tests plant,
``selection_evidence.layer_selection`` over sets, as the routes build them), and for ``none`` the
candidate's records replaced by the reference's (no recall lost); their Findings are what
``decide`` makes of them today. Not a test (no ``test_`` prefix); the goldens' README says which
command made each file.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).parent
MEASURED = HERE / "measured"
FINDINGS = HERE / "findings"


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n", encoding="utf-8")


def capture(ledger: Path, out: Path, name: str) -> None:
    """Run the ledger through the command line's own entry point, keeping the Measured."""
    from needlescope.cli import main as cli
    from needlescope.investigate import run as run_module
    from needlescope.paths import relativize

    seen, maps = [], []
    real, real_write = run_module.decide, run_module._write

    def keep(measured, led):
        seen.append(measured)
        return real(measured, led)

    def write(session, findings):
        maps.append(session.path_map())  # what the run's artifacts say instead of this machine's paths
        return real_write(session, findings)

    run_module.decide, run_module._write = keep, write
    sys.argv = ["needlescope", "investigate", "run", str(ledger), "--out", str(out)]
    try:
        cli.main()
    except SystemExit as exc:
        if exc.code not in (0, 1, None):
            raise
    (measured,) = seen
    target = MEASURED / name
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    base = ledger.parent
    shutil.copy(ledger, target / "investigation.toml")
    if (base / "patches").is_dir():  # the files the ledger names; never the run's own outputs
        shutil.copytree(base / "patches", target / "patches")
    # through JSON first: relativize reads lists, and to_json keeps some tuples (the context's flags)
    _write_json(target / "measured.json", relativize(json.loads(json.dumps(measured.to_json())), maps[0]))
    shutil.copy(out / "investigation.json", FINDINGS / f"{name}.json")


def _class_evidence():
    """class -> (evidence, candidate records are the reference's), as characterize's tests plant them."""
    from needlescope.investigate.decide.characterize_inputs import Evidence, LayerSelection, LengthCell
    from needlescope.investigate.decide.selection_evidence import Row, layer_selection

    selective = (LengthCell(512, 12, 6, 0, 128), LengthCell(1024, 12, 8, 0, 256))

    def rows(candidate, reference=None, visible=128, needle=(40, 41), n=4):
        ref = frozenset(reference if reference is not None else range(40, 56))
        return [Row(frozenset(candidate), ref, visible, frozenset(needle)) for _ in range(n)]

    def twin(sel):
        return LayerSelection(**{**sel.__dict__, "path": "decode"})

    def ev(*layers, cells=selective, **kw):
        return Evidence(
            recall_lost=True, recall_reference=1.0, recall_candidate=0.4, cells=cells, layers=layers, **kw
        )

    same = layer_selection(1, "prefill", rows(range(40, 56)))
    rnd = random.Random(0)
    uninformative = layer_selection(
        1,
        "prefill",
        [
            Row(frozenset(rnd.sample(range(128), 16)), frozenset(range(40, 56)), 128, frozenset({40}))
            for _ in range(8)
        ],
    )
    residue_cells = (
        LengthCell(1024, 8, 8, 0, 256),
        LengthCell(1025, 8, 0, 0, 256),
        LengthCell(1026, 8, 0, 0, 256),
        LengthCell(1027, 8, 1, 0, 256),
    )
    residue_sel = layer_selection(1, "prefill", rows(random.Random(2).sample(range(128), 16)))
    graded = layer_selection(1, "prefill", rows(set(range(40, 50)) | set(range(90, 96))))
    excluded = layer_selection(1, "prefill", rows(set(range(42, 56)) | {100, 101}))
    shifted = layer_selection(1, "prefill", rows(range(41, 57)))
    late = layer_selection(1, "prefill", rows(range(112, 128)))
    decode_departs = layer_selection(1, "decode", rows(random.Random(1).sample(range(128), 16)))
    return {
        "state_dependent": (ev(same, twin(same), rerun=2, not_reproduced=2), False),
        "outside_selection": (ev(same, twin(same), answers_differ=True), False),
        "length_residue": (ev(residue_sel, twin(residue_sel), cells=residue_cells), False),
        "decode_only": (ev(same, decode_departs), False),
        "misaddressed": (ev(shifted, twin(shifted)), False),
        "needle_excluded": (ev(excluded, twin(excluded)), False),
        "positional_bias": (ev(late, twin(late)), False),
        "ranking_uninformative": (ev(uninformative, twin(uninformative)), False),
        "graded": (
            ev(graded, twin(graded), cells=(LengthCell(512, 12, 0, 0, 128), LengthCell(1024, 12, 5, 0, 256))),
            False,
        ),
        "none": (Evidence(recall_lost=False, recall_reference=1.0, recall_candidate=1.0), True),
        "undecided": (Evidence(recall_lost=True, cells=(LengthCell(1024, 8, 3, 0, 256),)), False),
    }


def class_measured(base):
    """class -> the Measured of that class, from the captured run ``base`` (module docstring)."""
    out = {}
    for name, (evidence, no_loss) in _class_evidence().items():
        char = replace(base.characterization, evidence=evidence)
        m = replace(base, characterization=char)
        if no_loss:
            m = replace(m, candidate_records=base.reference_records)
        out[name] = m
    return out


def classes(base_name: str) -> None:
    sys.path.insert(0, str(HERE.parent))
    from golden_measured import decided, measured

    base = measured(base_name)
    for name, m in class_measured(base).items():
        golden = f"class-{name.replace('_', '-')}"
        _write_json(FINDINGS / f"{golden}.json", decided(m, base_name))


if __name__ == "__main__":
    if sys.argv[1] == "capture":
        capture(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
    elif sys.argv[1] == "classes":
        classes(sys.argv[2])
    else:
        sys.exit(f"unknown step {sys.argv[1]!r}: capture or classes")
