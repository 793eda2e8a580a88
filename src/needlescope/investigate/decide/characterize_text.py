"""The root-cause line of a characterization (``characterize.characterize``'s ``text``): the
deciding class's rule and numbers, what kind of bug each class points at, where, and the second
site of two independent bugs. Words only: it reads the characterization dict, decides nothing."""

from __future__ import annotations

__all__ = ["summary_line"]


def summary_line(ch: dict) -> str:
    """The root-cause line's words for a characterization (without the 'next' command)."""
    first = ch["classes"][0]
    if first == "none":
        return "nothing to explain: no recall lost"
    if first == "undecided":
        return "not among the suspects; the kind of bug is undecided: " + "; ".join(ch["undecided"])
    e, where = ch["evidence"][first], ch["where"] or {}
    place = (
        f"{where['family']} ({where['module']})"
        if where.get("family")
        else f"CSA layer {where['first_departing_layer']}"
        if where.get("first_departing_layer") is not None
        else "the model"
    )
    numbers = ", ".join(
        f"{k} {_fmt(v)}" for k, v in e.items() if k not in ("rule", "null") and isinstance(v, (int, float))
    )
    found = f" ({where['finding']})" if where.get("finding") else ""
    agree = (
        f"; decided by {where['decided_by']}, agree: {', '.join(where['agree'])}"
        if where.get("agree")
        else ""
    )
    line = f"not among the suspects: {e['rule']} ({numbers}); {_HINT[first]}; at {place}{found}{agree}"
    for site in ch.get("sites", [])[1:]:
        other = ch["evidence"][site["class"]]
        line += (
            f"; and, independently, {site['class']} at layer {site['where']['layer']} "
            f"{site['where']['path']}: {other['rule']} ({_HINT[site['class']]})"
        )
    return line


def _fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


_HINT = {
    "state_dependent": "state kept across requests (a cache slot or buffer never reset) or the batch",
    "outside_selection": "the bug is upstream or downstream of the indexer's selection (attention, MoE, norms)",
    "decode_only": "a decode-path bug (paged decode kernel, speculative decoding)",
    "length_residue": "a chunk or compressor-boundary arithmetic bug",
    "misaddressed": "an index-key cache layout or page-table bug",
    "needle_excluded": "a top-k or masking bug dropping candidates",
    "positional_bias": "a position-dependent scoring bug (RoPE, masks)",
    "ranking_uninformative": "a scoring bug (key scales, RoPE layout, head weights)",
    "graded": "a precision, partial-scoring or window bug whose damage grows with length",
}
