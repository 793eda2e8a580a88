"""The measurements ``characterize.characterize`` reads (``Evidence``) and how the user reaches
the candidate (``Context``), as frozen values with their JSON form: ``state.json`` caches them
(measurements, never the classes decided from them), so a run resumed after a rule change
decides anew."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

__all__ = ["Context", "Evidence", "LayerSelection", "LengthCell", "Localized"]


@dataclass(frozen=True)
class LayerSelection:
    """One CSA layer's selection compared with the reference's on one path, over the analysed
    query rows of the failing cases (means over rows; needle counts summed)."""

    layer: int
    path: str  # "prefill" | "decode"
    rows: int
    overlap: float  # mean Jaccard of the candidate's and the reference's selected sets
    chance: float  # J0: the same for a uniformly random selection of as many entries (exact)
    needle_visible: int = 0
    needle_reference: int = 0
    needle_candidate: int = 0
    overlap_without_needle: float | None = None  # Jaccard over the non-needle entries
    shift: int | None = None  # the constant shift whose shifted selection agrees best
    shift_overlap: float | None = None
    permutation_overlap: float | None = None  # best Jaccard under a page permutation
    head_share: tuple[float, float] | None = None  # (candidate, reference) share in the first quarter
    tail_share: tuple[float, float] | None = None  # ... and in the last quarter


@dataclass(frozen=True)
class LengthCell:
    """Paired outcomes at one prompt length: ``lost`` cases wrong under the candidate and right
    under the reference, ``gained`` the reverse, of ``n``; ``entries`` the compressed entries a
    query there sees (dense when <= ``Context.topk``)."""

    length: int
    n: int
    lost: int
    gained: int
    entries: int


@dataclass(frozen=True)
class Localized:
    """The localizer's first divergent module on one path (in-process)."""

    path: str
    module: str | None
    module_type: str | None
    layer: int | None
    finding: str | None = None  # what the localizer names there (a query/key RoPE-table mismatch)


@dataclass(frozen=True)
class Evidence:
    """Everything ``characterize`` reads. ``recall_lost``: the symptom's paired loss is
    significant (or any case is lost when the run has no test for it)."""

    recall_lost: bool
    recall_reference: float | None = None
    recall_candidate: float | None = None
    cells: tuple[LengthCell, ...] = ()
    layers: tuple[LayerSelection, ...] = ()
    answers_differ: bool = False  # a failing case was analysed (wrong under the candidate only)
    localized: tuple[Localized, ...] = ()
    # failing cases whose rerun alone predicted another token on both paths (a failure that
    # depends on what ran before: their selections are not a failing run's, so not in ``layers``)
    not_reproduced: int = 0
    rerun: int = 0  # failing cases rerun alone (``not_reproduced`` of them answered otherwise)

    def to_json(self) -> dict:
        """These measurements as JSON (``from_json`` reads them back, equal)."""
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> Evidence:
        def tup(x):
            return tuple(x) if isinstance(x, list) else x

        layers = tuple(LayerSelection(**{k: tup(v) for k, v in ly.items()}) for ly in obj.get("layers", []))
        return cls(
            **{k: v for k, v in obj.items() if k not in ("cells", "layers", "localized")},
            cells=tuple(LengthCell(**c) for c in obj.get("cells", [])),
            layers=layers,
            localized=tuple(Localized(**x) for x in obj.get("localized", [])),
        )


@dataclass(frozen=True)
class Context:
    """How the user reaches the candidate: a live ``base_url``, or in-process the checkpoint and
    the candidate's setting flags (opaque text, quoted into commands, never read)."""

    route: str  # "live" | "in-process"
    ratio: int
    topk: int
    model: str = "organism"
    base_url: str | None = None
    candidate_flags: tuple[str, ...] = ()
    input_ids: str | None = None  # a failing case's ids file the run wrote (in-process: ``indexer diff``)
    prompt: str | None = None  # a failing case's messages file the run wrote (live: ``indexer capture``)
    needle: str | None = None
    served_model: str = "organism"  # the live server's model name (``probe --model``)
    sweep_flags: tuple[str, ...] | None = ()  # ``indexer sweep`` flags; None: not expressible (patches > 1)
    device: str = "cpu"
    lengths: tuple[int, ...] = field(default_factory=tuple)

    def to_json(self) -> dict:
        """This context as JSON (``from_json`` reads it back, equal)."""
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> Context:
        tuples = {f.name for f in fields(cls) if "tuple" in str(f.type)}
        return cls(**{k: tuple(v) if k in tuples and v is not None else v for k, v in obj.items()})
