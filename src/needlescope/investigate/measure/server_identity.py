"""What identifies a live run's server across restarts: its configuration, not its URL.

A live ledger names its server by ``endpoint`` (a URL with a port). A server restarted after a
crash, or moved, often comes back on another port; the measurements a run made against it stay
valid as long as it serves the same thing. So the run directory's resume identity
(``state.json`` ``ledger_sha256``) is computed over the live ledger's text with the ``endpoint``
value left out (``resume_text``), and the server is identified instead by the fields of its
``/get_server_info`` that decide what it answers (``SERVER_IDENTITY``: model, architecture,
indexer numerics and top-k, CSA layers, context, prefill chunking, the patch it shows, its
version and device), stored with the first live record. Before a resumed run sends a case,
``check_same_server`` compares the server now at ``endpoint`` with the stored one; a different
one is refused (exit 2), naming the fields that changed.

Not identified: what a server does not report (a kernel change behind the same configuration,
a patch served with ``--undisclosed-patch``); the port, host, thread count, queue and body
limits, which change no answer.
"""

from __future__ import annotations

import re

from needlescope.errors import BadInput

__all__ = ["SERVER_IDENTITY", "check_same_server", "resume_text", "server_fingerprint"]

SERVER_IDENTITY = (
    "model",
    "architecture",
    "index_k",
    "index_q",
    "score_dtype",
    "index_topk",
    "checkpoint_index_topk",
    "csa_layers",
    "trained_value_digits",
    "context_length",
    "prefill_chunk",
    "patch",
    "needlescope_version",
    "device",
)

_ENDPOINT = re.compile(r"""^(\s*endpoint\s*=\s*)(["'])[^"'\n]*\2""", re.MULTILINE)


def resume_text(ledger_text: str) -> str:
    """A live ledger's text as its resume identity: the ``endpoint`` value left out."""
    return _ENDPOINT.sub(r'\1"(the live server, identified by its /get_server_info)"', ledger_text)


def server_fingerprint(info: dict) -> dict:
    """The ``SERVER_IDENTITY`` fields of a ``/get_server_info`` object (absent ones as None)."""
    return {k: info.get(k) for k in SERVER_IDENTITY}


def check_same_server(stored: dict | None, info: dict, url: str) -> None:
    """Raise BadInput when ``info`` (the server now at ``url``) is not the server ``stored`` (the
    ``/get_server_info`` a run recorded); nothing stored: nothing to compare."""
    if not stored:
        return
    was, now = server_fingerprint(stored), server_fingerprint(info)
    changed = [f"{k} {was[k]!r} -> {now[k]!r}" for k in SERVER_IDENTITY if was[k] != now[k]]
    if changed:
        raise BadInput(
            f"the server at {url} is not the one this run measured ({'; '.join(changed)}); "
            "point endpoint at that server, or pass a new --out for this one"
        )
