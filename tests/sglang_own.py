"""SGLang's own code in the tests: its import on a CPU-only torch, and a dump its dumper writes.

``import_sglang(name)`` imports a module of the pinned SGLang (the ``sglang`` test extra). SGLang's
configs import ``torchvision`` at module level (``sglang/srt/multimodal/internvl_utils.py``:
``import torchvision.transforms as T``) for InternVL's image preprocessing, which nothing here
runs. PyPI has only CUDA builds of torchvision for Linux; on the CPU build of torch their ops
library does not load (``_C.so`` needs ``libtorch_cuda.so``) and ``import torchvision`` fails
with ``RuntimeError: operator torchvision::nms does not exist`` (docs/peers.md). So the extra
does not install torchvision, and where none is importable this module puts a stand-in under
that name before importing SGLang: every attribute is a placeholder that raises when called.
transformers is asked first whether torchvision is available (its answer is cached), so it
keeps seeing none.

Run as a script, this file is one tensor-parallel rank of the organism's forward under SGLang's
dumper (``python tests/sglang_own.py RANK WORLD PORT OUT PAYLOAD``): ``torch.distributed`` over gloo
gives each rank its ``rank`` tag; each attention ``q_b_proj`` is column-parallel (a rank
computes its slice of the output features, gathered afterwards) and each shared expert's
``down_proj`` row-parallel (a rank computes a partial sum over its slice of the input features,
all-reduced afterwards), so the dumper sees what TP ranks hold. It writes two experiments under
OUT: ``clean`` and ``planted`` (``PLANTED`` scaled), one prefill pass each, with the
non-intrusive hooks of ``DUMPER_NON_INTRUSIVE_MODE=all``. Rank 0 then runs SGLang's
``dump_comparator`` on the pair (``OUT/dump_comparator.txt``) and the request/response contract
of ``_contract`` on PAYLOAD, our client's request body (``OUT/contract.json``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

PLANTED_LAYER = 3
PLANTED = f"model.layers.{PLANTED_LAYER}.self_attn.compressor.indexer.q_b_proj"
"""The planted bug: the indexer's query projection of one CSA layer, its sign flipped."""
TOKENS = 96
INDEX_TOPK = 8
SEED = 0

COMPARED = (
    r"name=non_intrusive__model\.(embed_tokens|layers\.\d+(\.self_attn\.(q_a_proj|q_b_proj|o_b_proj"
    r"|compressor\.indexer)|\.mlp\.shared_experts\.down_proj)?)\.output___"
)
"""The files SGLang's comparator checks: the mapped tensors (its filter, a regex on file names).
Unfiltered it stops at the first empty tensor (a compressor's output before its first window):
``RuntimeError: min(): Expected reduction dim to be specified for input.numel() == 0``."""

# The organism under SGLang's non-intrusive hooks: names are transformers' module names.
MAPPING = """
engine = "sglang-dumper on transformers"
model_type = "deepseek_v4"
input_ids = "input_ids"
positions = "positions"
ignore = ["non_intrusive__*.inputs.*", "non_intrusive__inputs.*"]

[[tensor]]
engine = "non_intrusive__model.embed_tokens.output"
reference = "model.embed_tokens"

[[tensor]]
engine = "non_intrusive__model.layers.{layer}.self_attn.q_a_proj.output"
reference = "model.layers.{layer}.self_attn.q_a_proj"

[[tensor]]
engine = "non_intrusive__model.layers.{layer}.self_attn.q_b_proj.output"
reference = "model.layers.{layer}.self_attn.q_b_proj"
shard = "concat:-1"

[[tensor]]
engine = "non_intrusive__model.layers.{layer}.self_attn.compressor.indexer.output"
reference = "model.layers.{layer}.self_attn.compressor.indexer"
kind = "topk"

[[tensor]]
engine = "non_intrusive__model.layers.{layer}.self_attn.o_b_proj.output"
reference = "model.layers.{layer}.self_attn.o_b_proj"

[[tensor]]
engine = "non_intrusive__model.layers.{layer}.mlp.shared_experts.down_proj.output"
reference = "model.layers.{layer}.mlp.shared_experts.down_proj"
shard = "sum"

[[tensor]]
engine = "non_intrusive__model.layers.{layer}.output"
reference = "model.layers.{layer}"
"""


class _Placeholder:
    """A torchvision name SGLang imports and never uses here; calling it says so."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} belongs to a torchvision stand-in (tests/sglang_own.py)")

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")


class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``torchvision`` and its submodules as modules of placeholders."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)

        def attribute(attr: str, _name=spec.name):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _Placeholder(f"{_name}.{attr}")

        module.__getattr__ = attribute
        return module

    def exec_module(self, module):
        return None


def _torchvision_or_stand_in() -> None:
    if any(isinstance(f, _StandIn) for f in sys.meta_path):
        return
    try:
        importlib.import_module("torchvision")
        return
    except ModuleNotFoundError:
        pass
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # cached: transformers keeps its (negative) answer
    sys.meta_path.insert(0, _StandIn())


def import_sglang(name: str):
    """``importlib.import_module(name)`` of a pinned-SGLang module (module docstring)."""
    importlib.import_module("sglang")  # ModuleNotFoundError when the extra is absent
    _torchvision_or_stand_in()
    return importlib.import_module(name)


def _ids() -> list[int]:
    import torch

    return torch.randint(10, 3000, (TOKENS,), generator=torch.Generator().manual_seed(SEED)).tolist()


def _rank_main(rank: int, world: int, port: str, out: str) -> None:
    import os

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dumper = import_sglang("sglang.srt.debug_utils.dumper").dumper
    from needlescope.dsa.checkpoint import load_bundle

    dist.init_process_group("gloo", rank=rank, world_size=world)
    causal, _, _ = load_bundle("organism", device="cpu")

    class Engine(torch.nn.Module):
        """SGLang's root signature, ``forward(input_ids, positions)``, over the organism's modules
        (same names), so the root hook dumps the core fields ``input_ids`` and ``positions``."""

        def __init__(self):
            super().__init__()
            self.model, self.lm_head = causal.model, causal.lm_head

        def forward(self, input_ids, positions):
            hidden = self.model(input_ids[None], position_ids=positions[None]).last_hidden_state
            return self.lm_head(hidden[:, -1])

    engine = Engine().eval()
    for m in engine.model.modules():
        if type(m).__name__ == "DeepseekV4Indexer":
            m.index_topk = INDEX_TOPK
    columns, rows = [], []
    for name, m in engine.named_modules():
        if name.endswith("self_attn.q_b_proj"):
            part = m.weight.detach().chunk(world, dim=0)[rank]
            m.weight, m.out_features = torch.nn.Parameter(part.clone()), part.shape[0]
            columns.append(m)
        elif name.endswith("shared_experts.down_proj"):
            part = torch.arange(m.in_features).chunk(world)[rank]
            m.weight = torch.nn.Parameter(m.weight.detach()[:, part].clone())
            m.register_forward_pre_hook(lambda _m, args, p=part: (args[0][..., p],))
            rows.append(m)

    def gather(_m, _args, out):
        parts = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(parts, out.contiguous())
        return torch.cat(parts, dim=-1)

    def reduce(_m, _args, out):
        total = out.clone()
        dist.all_reduce(total)
        return total

    ids = torch.tensor(_ids())
    for exp in ("clean", "planted"):
        dumper.reset()
        dumper.configure(enable=True, dir=out, exp_name=exp, non_intrusive_mode="all",
                         enable_output_console=False)  # fmt: skip
        dumper.register_non_intrusive_dumper(engine)
        # After the dumper's hooks, so it dumps what the rank holds before the collective.
        handles = [m.register_forward_hook(gather) for m in columns]
        handles += [m.register_forward_hook(reduce) for m in rows]
        if exp == "planted":
            handles.append(engine.get_submodule(PLANTED).register_forward_hook(lambda _m, _a, o: -o))
        with torch.no_grad():
            engine(input_ids=ids, positions=torch.arange(len(ids)))
        dumper.step()
        for h in handles:
            h.remove()
    dumper.reset()
    dist.barrier()  # every rank's files are written before rank 0 compares them
    dist.destroy_process_group()


def _contract(payload_file: str, out_file: str) -> None:
    """What the pinned SGLang makes of our ``/generate`` request and how it encodes a capture.

    Writes JSON: ``request``: the payload parsed as the HTTP server parses it
    (``GenerateReqInput(**payload)``, ``normalize_batch_and_arguments()``, then
    ``SamplingParams(**sampling_params)``), the fields it ended with, or the error;
    ``response``: an int32 [rows, layers, k] capture as its tokenizer manager writes it into
    ``meta_info`` (``pybase64.b64encode(tensor.numpy().tobytes())``, read in its source: importing
    that module needs uvloop, which the extra leaves out because uvicorn would then run our own
    server on it) and SGLang's ``extract_indexer_topk_from_meta_info`` decoding it.
    """
    import base64
    import dataclasses
    import json

    import numpy as np
    import torch

    io = import_sglang("sglang.srt.managers.io_struct")
    sampling = import_sglang("sglang.srt.sampling.sampling_params")
    capturer = import_sglang("sglang.srt.state_capturer.indexer_topk")
    payload = json.loads(open(payload_file).read())
    request: dict = {"fields": sorted(f.name for f in dataclasses.fields(io.GenerateReqInput))}
    try:
        req = io.GenerateReqInput(**payload)
        req.normalize_batch_and_arguments()
        params = sampling.SamplingParams(**req.sampling_params)
        request.update(error=None, is_single=req.is_single, return_indexer_topk=req.return_indexer_topk,
                       input_ids=req.input_ids, text=req.text, max_new_tokens=params.max_new_tokens,
                       temperature=params.temperature, top_k=params.top_k)  # fmt: skip
    except Exception as exc:  # what SGLang refuses is the finding
        request["error"] = f"{type(exc).__name__}: {exc}"
    topk = torch.randint(-1, 40, (7, 2, 8), generator=torch.Generator().manual_seed(SEED), dtype=torch.int32)
    encoded = base64.b64encode(topk.numpy().tobytes()).decode("utf-8")
    decoded = capturer.extract_indexer_topk_from_meta_info({"meta_info": {"indexer_topk": encoded}})
    response = {"indexer_topk": encoded, "shape": list(topk.shape), "values": topk.flatten().tolist(),
                "decoded": np.asarray(decoded).tolist()}  # fmt: skip
    with open(out_file, "w") as f:
        json.dump({"request": request, "response": response}, f)


def _dump_comparator(args: list[str]) -> None:
    """SGLang's single-file comparator, as ``python -m sglang.srt.debug_utils.dump_comparator``."""
    import os
    import runpy

    import_sglang("sglang.srt.debug_utils.dumper")
    # It moves every tensor to sglang.srt.utils.get_device(), which raises "No accelerator (CUDA,
    # XPU, HPU, NPU, MUSA, MPS) or platform plugin is available." without a GPU unless SGLang's CPU
    # switch is on; set before the import, that switch makes it import sgl_kernel's CPU build, so
    # it is set after, and the import-time answer of the cached is_cpu() is dropped.
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    import_sglang("sglang.srt.utils.common").is_cpu.cache_clear()
    sys.argv = ["dump_comparator", *args]
    runpy.run_module("sglang.srt.debug_utils.dump_comparator", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    rank, world, port, out, payload = int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:6]
    _rank_main(rank, world, port, out)
    if rank == 0:  # SGLang's comparator on the pair, and the contract, in the import rank 0 paid for
        import contextlib
        from pathlib import Path

        with open(Path(out) / "dump_comparator.txt", "w") as f, contextlib.redirect_stdout(f):
            _dump_comparator(["--baseline-path", f"{out}/clean", "--target-path", f"{out}/planted",
                              "--filter", COMPARED])  # fmt: skip
        _contract(payload, str(Path(out) / "contract.json"))
