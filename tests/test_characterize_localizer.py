"""The localizer's truth table over issue 37's planted set: every bug flagged in its family
(``FLAGGED``: the harmful ones and the RoPE-table mismatch, which costs no recall on the
organism but is a divergence), no rounding within its precision flagged, and a query/key
RoPE-table mismatch named as such.

One ``dsa.diff.localize`` per bug on a tiny random DeepSeek-V4 (two chunks: 4m prompt tokens,
then one token through the cache, so the prefill and a decode step are both judged and the
boundary bug's prefill length is 0 mod the compression ratio; the window bug gets the longer
prompt ``LOCALIZER_TOKENS`` names, as it changes nothing within its window), the candidate at fp8
index keys as the planted runs (docs/investigate.md). Cheap: about 2 s a bug.
"""

from __future__ import annotations

import textwrap

import pytest

torch = pytest.importorskip("torch")

from needlescope.dsa.checkpoint import load_bundle  # noqa: E402
from needlescope.dsa.diff import localize  # noqa: E402
from needlescope.investigate.decide.characterize import family_of  # noqa: E402
from needlescope.setting import PatchRef, Setting  # noqa: E402
from needlescope.testing.checkpoints import save_random  # noqa: E402
from planted_bugs import CLASSES, FLAGGED, LOCALIZER_TOKENS  # noqa: E402
from test_characterize_inprocess import PLANTED  # noqa: E402

T = 69  # 68 = 0 mod 4 prompt tokens in the first chunk, then one decode-like step


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_random(tmp_path_factory.mktemp("tiny_v4"), seed=1, hidden_size=64, index_topk=4)
    longest = max([T, *LOCALIZER_TOKENS.values()])
    ids = torch.randint(5, 200, (1, longest), generator=torch.Generator().manual_seed(0))
    return path, load_bundle(path)[0], ids


def _localize(tiny, patch) -> dict:
    path, reference, ids = tiny
    ids = ids[:, : LOCALIZER_TOKENS.get(patch.name, T)]
    return localize(
        reference,
        load_bundle(path)[0],
        ids,
        setting=Setting(index_k="fp8_e4m3"),
        extra_patches=(PatchRef.resolve(patch),),
        chunk=ids.shape[1] - 1,
    )


@pytest.mark.parametrize("bug", sorted(CLASSES))
def test_the_localizer_flags_every_planted_bug_and_no_rounding(tiny, bug):
    diff = _localize(tiny, PLANTED / bug)
    first = diff["first_divergent_module"]
    if bug not in FLAGGED:
        assert first is None, (bug, diff["summary"])  # rounding within its precision
        assert not diff["rope"]
        return
    assert first is not None, (bug, "missed")
    row = next(m for m in diff["modules"] if m["module"] == first)
    assert family_of(first, row["type"]) == FLAGGED[bug], (bug, first)
    if bug == "decode_sign_flip.py":  # only the one-token step takes the decode path
        assert first.endswith("[call 2]"), first
    named = [r["finding"] for r in diff["rope"]]
    if bug == "indexer_rope_mismatch.py":
        assert named and named[0].startswith("query/key RoPE-table mismatch"), named
        assert "'main'" in named[0] and "'compress'" in named[0], named[0]
        assert "RoPE-table mismatch" in diff["summary"]
    else:
        assert not named, (bug, named)


def test_keys_rotated_with_another_theta_are_named(tiny, tmp_path):
    """A variant the planted set does not hold: the keys' rotation uses a theta of no table of the
    model (twice the compressed one), the queries the right table."""
    patch = tmp_path / "p.py"
    patch.write_text(
        textwrap.dedent(
            """
            def apply(model):
                for _, idx in model.named_modules():
                    if type(idx).__name__ != "DeepseekV4Indexer":
                        continue
                    rope, head_dim, inner = idx.rotary_emb, idx.head_dim, idx.rotary_emb.forward

                    def forward(x, position_ids, layer_type=None, inner=inner, head_dim=head_dim):
                        if x.shape[-1] == head_dim:  # the keys: positions on another table
                            position_ids = position_ids * 2
                        return inner(x, position_ids, layer_type=layer_type)

                    rope.forward = forward
            """
        )
    )
    diff = _localize(tiny, patch)
    assert diff["first_divergent_module"] is not None
    rope = diff["rope"][0]
    assert rope["queries"]["table"] == "compress" and rope["keys"]["table"] is None, rope
    assert rope["finding"].startswith("query/key RoPE-table mismatch"), rope["finding"]
