"""Issue 38, item 19: in recall.png a fix that restores recall to 1.0 stays visible on the
reference's line (drawn in its own colour across the plot), and a report with no replayed fix
has no caption about one. Rendered from golden ``Findings`` (tests/golden_findings.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from golden_findings import golden  # noqa: E402
from needlescope.investigate.report import diagnosis  # noqa: E402

FULL = {"256": 1.0, "512": 1.0, "1024": 1.0}


def _findings(fixes: list[dict]):
    symptom = {"recall_reference": FULL, "recall_candidate": {"256": 1.0, "512": 0.33, "1024": 0.0}}
    f = golden("in-process-root-cause")
    return replace(
        f,
        symptom={**f.symptom, **symptom, "cases": 18, "kind": "multiturn"},
        fixes=tuple(fixes),
        signature={**f.signature, "layers": []},
    )


def _pixels_of(path, hex_colour: str) -> int:
    import matplotlib.image as mpimg

    img = mpimg.imread(path)[..., :3]
    rgb = np.array([int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(img - rgb).sum(-1) < 0.1).sum())


def test_a_fix_at_the_reference_line_is_visible(tmp_path):
    fix = {"name": "remove-x", "label_kind": "root-cause fix", "recall_by_length": FULL}
    (made,) = diagnosis._plots(_findings([fix]), tmp_path)
    assert made[0] == "recall.png" and "each replayed fix (dashed" in made[1]
    # The fix's own colour across the plot's width (it was 53 pixels under the reference line).
    assert _pixels_of(tmp_path / "recall.png", diagnosis._FIX_COLOURS[0]) > 500


def test_no_fix_no_fix_caption(tmp_path):
    (made,) = diagnosis._plots(_findings([]), tmp_path)
    assert "fix" not in made[1]
