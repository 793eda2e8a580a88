"""Config validation, admission bounds, stop-string helpers, the SGLang payload encoding, and a
non-DeepSeek-V4 checkpoint served without an indexer."""

from __future__ import annotations

import base64
import os
import subprocess
import threading

import httpx
import numpy as np
import openai
import pytest
import torch

from needlescope.errors import BadInput
from needlescope.organism.tokenizer import build_tokenizer
from needlescope.serve.admission import Admission, Overloaded
from needlescope.serve.answers import _find_stop, _held_back, encode_indexer_topk
from needlescope.serve.config import ServeConfig
from needlescope.serve.engine import Engine
from needlescope.serve.launch import SERVE_ARGV, ServerProcess
from needlescope.serve.metrics import ServeMetrics
from needlescope.setting import Setting


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("port", 70000, "--port"),
        ("max_queued_requests", 0, "--max-queued-requests"),
        ("max_running_requests", 0, "--max-running-requests"),
        ("device", "tpu", "--device"),
    ],
)
def test_config_rejects_bad_values_naming_the_flag(field, value, words):
    with pytest.raises(BadInput, match=words):
        ServeConfig(**{field: value})


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--index-k", "fp7"], "unknown key precision"),
        (["--score-dtype", "fp64"], "unknown score dtype"),
        (["--index-topk", "0"], "index_topk must be a positive integer"),
        (["--patch", "/no/such/patch.py"], "does not exist"),
        (["--patch", "fault:nope"], "unknown fault 'nope'"),
    ],
)
def test_serve_setting_flags_are_refused_with_one_line(run_cli, flags, words):
    code, _, err = run_cli("serve", "--model", "organism", *flags)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1


def test_config_round_trips_through_json_with_its_setting():
    cfg = ServeConfig(
        model="organism", port=0, threads=2, setting=Setting.parse("k=fp8_e4m3 hadamard=on topk=8")
    )
    again = ServeConfig.from_json(cfg.to_json())
    assert again == cfg and again.setting.hadamard is True
    with pytest.raises(BadInput, match="unknown field"):
        ServeConfig.from_json('{"model": "organism", "index_k": "fp8_e4m3"}')


def test_admission_bounds_waiting_and_batches_by_key():
    metrics = ServeMetrics()
    adm: Admission[tuple[str, int]] = Admission(max_running=2, max_queued=3, metrics=metrics)
    for it in [("a", 5), ("b", 7), ("c", 5)]:
        adm.submit(it)
    with pytest.raises(Overloaded):
        adm.submit(("d", 5))
    batch = adm.take_batch(lambda it: it[1], timeout=1)
    assert batch == [("a", 5), ("c", 5)] and adm.running == 2 and adm.waiting == 1
    adm.finish(2)
    assert adm.take_batch(lambda it: None, timeout=1) == [("b", 7)]
    adm.finish(1)
    assert adm.take_batch(lambda it: it[1], timeout=0.05) == []
    assert adm.withdraw(("zzz", 1)) is False


def test_admission_refuses_beyond_the_queue_without_blocking():
    adm: Admission[int] = Admission(max_running=1, max_queued=2)
    adm.submit(1)
    adm.submit(2)
    done = threading.Event()

    def third():
        with pytest.raises(Overloaded):
            adm.submit(3)
        done.set()

    threading.Thread(target=third).start()
    assert done.wait(timeout=5)
    assert adm.waiting == 2


def test_stop_helpers():
    assert _find_stop("abc STOP def", ("STOP", "c S"), start=0) == (2, "c S")
    assert _find_stop("abc", ("x",), start=0) is None
    assert _held_back("hello ST", ("STOP",)) == 2
    assert _held_back("hello", ("STOP",)) == 0


def test_indexer_topk_encoding_is_little_endian_int32():
    topk = torch.tensor([[[0, 1, -1]], [[2, -1, -1]]])
    raw = base64.b64decode(encode_indexer_topk(topk))
    assert len(raw) == topk.numel() * 4
    np.testing.assert_array_equal(np.frombuffer(raw, dtype="<i4").reshape(topk.shape), topk.numpy())


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("llama")
    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_non_v4_checkpoint_rejects_indexer_numerics(llama_dir):
    with pytest.raises(BadInput, match="no lightning indexer"):
        Engine(ServeConfig(model=str(llama_dir), setting=Setting(index_k="fp8_e4m3")))


def test_non_v4_checkpoint_is_served_without_an_indexer(llama_dir):
    with ServerProcess(["--model", str(llama_dir), "--port", "0"]) as srv:
        name = llama_dir.name
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0) as client:
            r = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "hello"}], max_tokens=3, temperature=0
            )
            assert r.usage.completion_tokens >= 1
        info = httpx.get(srv.url + "/get_server_info").json()
        assert info["architecture"] == "LlamaForCausalLM" and info["index_k"] == "none"
        r = httpx.post(srv.url + "/generate", json={"text": "hello", "return_indexer_topk": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "return_indexer_topk"


def test_cli_bad_model_exits_2_with_one_line(tmp_path):
    res = subprocess.run(
        [*SERVE_ARGV, "--model", str(tmp_path / "missing"), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert res.returncode == 2
    assert "does not exist" in res.stderr and len(res.stderr.strip().splitlines()) == 1


PATCH = """
def apply(model):
    mods = [m for m in model.modules() if type(m).__name__ == "DeepseekV4Indexer"]
    saved = [m.index_topk for m in mods]
    for m in mods:
        m.index_topk = PATCHED_TOPK

    def undo():
        for m, k in zip(mods, saved):
            m.index_topk = k

    return undo
"""


def test_patch_is_applied_for_the_servers_lifetime(tmp_path):
    from needlescope.testing.checkpoints import save_random

    patched_topk = 2
    ckpt = save_random(
        tmp_path / "ckpt", hidden_size=64, q_lora_rank=32, o_lora_rank=32, moe_intermediate_size=64
    )
    patch = tmp_path / "narrow_topk.py"
    patch.write_text(f"PATCHED_TOPK = {patched_topk}\n" + PATCH)
    with ServerProcess(["--model", str(ckpt), "--port", "0", "--patch", str(patch)]) as srv:
        info = httpx.get(srv.url + "/get_server_info").json()
        assert info["patch"] == patch.name  # the file's name: its path only with --expose-paths
        words = " ".join(["the river ran past the old mill"] * 6)
        body = {"text": words, "sampling_params": {"max_new_tokens": 2}, "return_indexer_topk": True}
        meta = httpx.post(srv.url + "/generate", json=body, timeout=60).json()["meta_info"]
        topk = np.frombuffer(base64.b64decode(meta["indexer_topk"]), "<i4").reshape(
            meta["indexer_topk_shape"]
        )
        assert topk.shape[2] == info["index_topk"] > patched_topk
        selected = (topk >= 0).sum(axis=2)
        assert selected.max() == patched_topk


def test_device_placement_and_chunk_settings_are_validated():
    from needlescope.serve.config import ServeConfig

    for device in ("auto", "cuda:0,cuda:1", "cpu,cpu", "cuda"):
        ServeConfig(device=device)
    ServeConfig(device="auto", max_memory="70GiB", prefill_chunk=1024)
    ServeConfig(device="cuda:0,cuda:1", max_memory="70GiB,60GiB")
    for kw, message in (
        ({"device": "tpu"}, "--device must be auto"),
        ({"device": "cuda:0,"}, "--device must be auto"),
        ({"device": "auto", "max_memory": "lots"}, "memory size 'lots'"),
        ({"device": "cuda:0,cuda:1", "max_memory": "1GiB,2GiB,3GiB"}, "3 budgets for 2 devices"),
        ({"prefill_chunk": 0}, "--prefill-chunk must be at least 1"),
    ):
        with pytest.raises(BadInput, match=message):
            ServeConfig(**kw)


def test_an_undisclosed_patch_runs_but_no_info_names_it(tmp_path):
    """Issue 37's planted runs: the server carries the patch, /get_server_info says none."""
    patch = tmp_path / "p.py"
    patch.write_text("def apply(model):\n    return None\n")
    setting = Setting.parse(f"topk=16 patch={patch}")
    shown = ServeConfig(model="organism", setting=setting)
    hidden = ServeConfig(model="organism", setting=setting, disclose_patch=False)
    assert shown.to_dict()["patch"] == patch.name
    assert hidden.to_dict()["patch"] is None and "disclose_patch" not in hidden.to_dict()
    engine = Engine(hidden)
    assert engine.info()["patch"] is None and engine.numerics.patch is not None
    assert ServeConfig.from_json(hidden.to_json()).disclose_patch is False
