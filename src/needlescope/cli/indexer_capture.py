"""``needlescope indexer capture``: ask a live SGLang server for its indexer top-k.

Server and protocol failures are reported like bad input: one line, exit 2.
"""

from __future__ import annotations

from pathlib import Path

import typer

from needlescope.cli.indexer import indexer_app
from needlescope.cli.output import console
from needlescope.cli.outputs import API_KEY, FORCE, guard
from needlescope.paths import check_out_dir
from needlescope.run.config import parse_int_list
from needlescope.workflows.capture import CaptureConfig

# Flag defaults come from the library's config (workflows.capture imports no torch).
_CAPTURE = CaptureConfig(url="", prompt=Path(), needle="")


@indexer_app.command("capture")
def capture_command(
    sglang: str = typer.Option(..., "--sglang", help="SGLang server root URL, e.g. http://127.0.0.1:30000."),
    prompt: Path = typer.Option(..., "--prompt", help="Prompt file: plain text or a JSON messages list."),
    needle: str = typer.Option(..., "--needle", help="The needle's text, as it appears in the prompt."),
    out: Path = typer.Option(
        Path("capture-out"), "--out", help="Output directory (capture.json, capture.md)."
    ),
    tokenizer: str = typer.Option(
        _CAPTURE.tokenizer,
        "--tokenizer",
        help="'organism' or a local checkpoint dir: renders the chat template and finds the needle's tokens; "
        "the token ids are sent as input_ids so the server sees exactly these tokens.",
    ),
    index_topk: int = typer.Option(None, "--index-topk", help="Override the server's index_topk."),
    num_layers: int = typer.Option(None, "--num-layers", help="Override the number of indexer layers."),
    layer_ids: str = typer.Option(
        None,
        "--layer-ids",
        help="Model layer id of each capture layer, e.g. 2,4,6 (default: from the config).",
    ),
    max_new_tokens: int = typer.Option(_CAPTURE.max_new_tokens, "--max-new-tokens"),
    timeout: float = typer.Option(_CAPTURE.timeout, "--timeout", help="Request timeout in seconds."),
    api_key: str = API_KEY,
    force: bool = FORCE,
) -> None:
    """Ask a live SGLang server for its indexer top-k and report whether the needle was selected."""
    from needlescope.workflows import capture

    cfg = CaptureConfig(
        url=sglang,
        prompt=prompt,
        needle=needle,
        tokenizer=tokenizer,
        index_topk=index_topk,
        num_layers=num_layers,
        layer_ids=tuple(parse_int_list(layer_ids, "--layer-ids")) if layer_ids is not None else None,
        max_new_tokens=max_new_tokens,
        timeout=timeout,
        api_key=api_key,
    )
    check_out_dir(out)
    with guard(out, "indexer capture", force):
        result = capture.run(cfg)
        capture.write(result, out)
    for r in result["layers"]:
        first = r["selected_at_first_answer"]
        console.print(f"layer {r['layer']}: needle selected at first answer position: {first}")
    console.print(f"wrote {out}/capture.json, capture.md")
