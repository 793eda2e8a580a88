"""SGLang's formats as SGLang's own code writes and reads them (the ``sglang`` test extra).

One module fixture runs ``tests/sglang_own.py`` as two tensor-parallel ranks (gloo): SGLang's
``debug_utils.dumper`` dumps the organism's forward, clean and with a planted bug (the indexer
query projection of layer 3, sign flipped); rank 0 then runs SGLang's ``dump_comparator`` on that
pair and parses our client's ``/generate`` request with SGLang's ``io_struct``. SGLang is only
ever imported in those child processes: importing it patches transformers for the whole process.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("sglang") is None:
    pytest.skip("the sglang test extra is not installed (make install)", allow_module_level=True)

import sglang_own  # noqa: E402
from needlescope.dsa.capture import decode_indexer_topk  # noqa: E402
from needlescope.dsa.checkpoint import load_bundle  # noqa: E402
from needlescope.dsa.compare_dump import compare_dump  # noqa: E402
from needlescope.dsa.dump_mapping import parse_mapping  # noqa: E402
from needlescope.errors import ProtocolViolation  # noqa: E402
from needlescope.targets.sglang import SGLangTarget  # noqa: E402
from needlescope.testing.servers import JsonHandler, in_thread  # noqa: E402

SCRIPT = Path(__file__).with_name("sglang_own.py")
PROMPT = [11, 12, 13, 14, 15]


def _recording(store: list):
    class Handler(JsonHandler):
        def do_POST(self):
            store.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            self._send(200, store[-1][1].get("answer") or {"text": "", "meta_info": {}})

    return Handler


def _our_request(tmp: Path) -> Path:
    """The body our capture client posts to ``/generate`` (recorded by a loopback server)."""
    seen: list = []
    with in_thread(_recording(seen)) as url:

        async def go():
            async with SGLangTarget(url) as target:
                with pytest.raises(ProtocolViolation):  # the recorder answers no capture
                    await target.generate(input_ids=PROMPT, max_new_tokens=4)

        asyncio.run(go())
    assert [p for p, _ in seen] == ["/generate"]
    path = tmp / "payload.json"
    path.write_text(json.dumps(seen[0][1]))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sglang_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sglang_own")
    payload = _our_request(out)
    src = str(Path(__import__("needlescope").__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, str(SCRIPT.parent)]), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    port = str(_free_port())
    logs = [out / f"rank{r}.log" for r in (0, 1)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(r), "2", port, str(out), str(payload)],
            stdout=logs[r].open("w"),
            stderr=subprocess.STDOUT,
            env=env,
        )  # fmt: skip
        for r in (0, 1)
    ]
    for p, log in zip(procs, logs):
        try:
            rc = p.wait(timeout=900)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = "timeout"
        assert rc == 0, f"{log.name} ended {rc}: {log.read_text()[-3000:]}"
    return out


@pytest.fixture(scope="module")
def organism():
    model, _, _ = load_bundle("organism", device="cpu")
    return model


def _comparator_failures(text: str) -> list[tuple[int, str, int | None]]:
    """(dump_index, name, layer) of every file SGLang's dump_comparator marks ❌, in its order."""
    out, target = [], None
    for line in text.splitlines():
        if line.startswith("target="):
            target = Path(line.split("=", 1)[1].split(" (duplicate_index")[0]).stem
        elif line.startswith("❌") and target is not None:
            tags = dict(part.split("=", 1) for part in target.split("___"))
            layer = int(tags["layer_id"]) if "layer_id" in tags else None
            out.append((int(tags["dump_index"]), tags["name"], layer))
            target = None
    return out


def test_compare_dump_names_the_planted_layer_in_sglangs_own_dump(sglang_run, organism):
    mapping = parse_mapping(sglang_own.MAPPING, "sglang_own.toml")
    clean = compare_dump(organism, sglang_run / "clean", mapping, index_topk=sglang_own.INDEX_TOPK)
    assert clean["first_beyond"] is None and clean["ranks"] == [0, 1]
    shards = {t["shard"] for t in clean["tensors"] if t["verdict"] == "within budget"}
    assert shards == {"replicated", "concat:-1", "sum"}
    assert all(t["verdict"] == "within budget" for t in clean["tensors"])
    planted = compare_dump(organism, sglang_run / "planted", mapping, index_topk=sglang_own.INDEX_TOPK)
    first = planted["first_beyond"]
    assert first["layer"] == sglang_own.PLANTED_LAYER
    assert first["reference"] == f"model.layers.{sglang_own.PLANTED_LAYER}.self_attn.compressor.indexer"
    before = [
        t for t in planted["tensors"] if t["layer"] is not None and t["layer"] < sglang_own.PLANTED_LAYER
    ]
    assert before and all(t["verdict"] == "within budget" for t in before)
    overlap = {r["layer"]: r["topk_overlap"] for r in planted["indexer"]}
    assert overlap[1] == 1.0 and overlap[sglang_own.PLANTED_LAYER] < 1.0


def test_sglangs_comparator_agrees_on_the_layer(sglang_run):
    text = (sglang_run / "dump_comparator.txt").read_text()
    checked = text.count("\ntarget=") + text.startswith("target=")
    failures = _comparator_failures(text)
    assert checked > 0 and failures, text[-2000:]
    assert re.search(r"✅ rel_diff=0\.0\b", text)  # the layers before the bug match exactly
    first = min(failures)
    assert first[2] == sglang_own.PLANTED_LAYER and first[1].endswith("self_attn.compressor.indexer.output")
    assert {layer for _, _, layer in failures} <= set(range(sglang_own.PLANTED_LAYER, 99))


def test_our_request_parses_as_sglangs_generate_request(sglang_run):
    sent = json.loads((sglang_run / "payload.json").read_text())
    request = json.loads((sglang_run / "contract.json").read_text())["request"]
    assert request["error"] is None
    assert set(sent) <= set(request["fields"]), set(sent) - set(request["fields"])
    assert request["is_single"] and request["return_indexer_topk"] is True
    assert request["input_ids"] == PROMPT and request["text"] is None
    # temperature 0 is greedy in SGLang: it keeps top_k = 1 (and sets temperature to 1.0).
    assert request["max_new_tokens"] == 4 and request["top_k"] == 1


def test_we_decode_the_capture_as_sglang_encodes_it(sglang_run):
    response = json.loads((sglang_run / "contract.json").read_text())["response"]
    rows, layers, k = response["shape"]
    assert response["decoded"] == response["values"]  # SGLang's own round trip
    ours = decode_indexer_topk(response["indexer_topk"], num_layers=layers, index_topk=k)
    assert list(ours.shape) == [rows, layers, k]
    assert ours.flatten().tolist() == response["values"]

    answer = {"text": " 42", "meta_info": {"prompt_tokens": rows + 1, "completion_tokens": 1,
                                           "indexer_topk": response["indexer_topk"]}}  # fmt: skip

    class Handler(JsonHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self._send(200, answer)

    async def go(url):
        async with SGLangTarget(url) as target:
            return await target.generate(input_ids=list(range(rows + 1)), max_new_tokens=1)

    with in_thread(Handler) as url:
        got = asyncio.run(go(url))
    assert got.indexer_topk == response["indexer_topk"] and got.prompt_tokens == rows + 1


def test_response_keys_we_read_are_the_keys_sglang_writes():
    """Read in the pinned SGLang's source (never imported here): the meta_info keys our client reads."""
    root = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
    source = (root / "srt/managers/tokenizer_manager.py").read_text()
    for key in ("prompt_tokens", "completion_tokens", "indexer_topk"):
        assert re.search(rf'"{key}"', source), key
    assert re.search(r'meta_info\["indexer_topk"\]\s*=', source)
    # The encoding the contract test's sample uses: the tensor's raw bytes, base64.
    assert re.search(r"b64encode\(val\.numpy\(\)\.tobytes\(\)\)", source)
