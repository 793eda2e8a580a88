"""The organism's training recipe (one GPU, minutes).

Phases, all on the corpus of ``needlescope.organism.data``:

1. **dense**: every weight trains on the answer loss (plus a small next-token loss on all
   tokens) with ``index_topk`` covering every compressed entry, so sparse selection never
   drops anything. At the same time the indexer is distilled (the DeepSeek sparse-attention
   warm-up): its softmax over visible entries is pulled, by KL, towards the main attention's
   mass per compressed entry (summed over heads, L1-normalised). The indexer's inputs are
   detached, so the distillation loss trains only the indexer, and rows are weighted by how
   much attention mass they put on compressed entries at all (a row that reads only its
   sliding window has no opinion about which entry matters).
2. **distil**: the main model frozen, the indexer alone continues on the KL loss.
3. **sparse** (optional, ``steps_sparse > 0``): everything trains with ``index_topk`` set to
   the deployment value, answer loss through the sparse attention plus the KL loss.

Lengths follow a curriculum: the cap rises from ``min_len`` to ``max_len`` over the first
``ramp_frac`` of the dense steps. Each step holds about ``tokens_per_batch`` tokens.
``train`` returns the record written to ``training.json`` (schema: ``TRAINING_SCHEMA``).
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, DeepseekV4ForCausalLM

from needlescope.dsa.checkpoint import quiet_transformers
from needlescope.dsa.emulate import csa_indexers
from needlescope.dsa.reference import visible_entries
from needlescope.organism.config import DENSE_TOPK, init_hash_routing, organism_config
from needlescope.organism.data import IGNORE, DataSpec, make_example
from needlescope.organism.tokenizer import build_tokenizer

__all__ = ["TrainConfig", "TRAINING_SCHEMA", "train"]

TRAINING_SCHEMA = {
    "config": "TrainConfig as a dict",
    "steps": "{'dense': int, 'distil': int, 'sparse': int} steps actually run",
    "log": "[{'step', 'phase', 'loss', 'answer_loss', 'lm_loss', 'kl', 'len_cap', 'window', 'elapsed_s'}]",
    "eval": "[{'step', 'phase', 'answer_exact': {length: fraction of held-out answers fully correct}}]",
    "hardware": "{'device', 'gpu', 'torch', 'transformers', 'python'}",
    "wall_s": "float: total training time",
}


@dataclass(frozen=True)
class TrainConfig:
    """One training stage's knobs. The shipped organism is two stages of these
    (``needlescope.organism.recipe.SHIPPED_STAGES``), not the defaults."""

    seed: int = 0
    steps_dense: int = 1500
    steps_distil: int = 150
    steps_sparse: int = 0
    sparse_topk: int = 64
    tokens_per_batch: int = 65536
    # Eager attention memory grows with B * S^2: cap the batch so B * cap^2 stays under this.
    max_batch_tokens_sq: int = 8 * 4096 * 4096
    lr: float = 3e-3
    lr_distil: float = 2e-3
    warmup: int = 150
    weight_decay: float = 0.01
    lm_weight: float = 0.1
    kl_weight: float = 1.0
    min_len: int = 256
    max_len: int = 4096
    kind_weights: tuple[float, ...] = DataSpec.kind_weights
    # Digits per needle value (the probe's --value-digits); the held-out evaluation uses it.
    value_digits: int = 3
    # Value-length curriculum: values start with this many digits and grow to value_digits
    # over the length ramp (None = no curriculum).
    value_digits_start: int | None = None
    # Window curriculum: the dense phase's first ``wide_window_frac`` of steps run with a
    # sliding window of ``wide_window`` tokens on examples no longer than it (the needle
    # inside the window, so a copy circuit forms through plain attention), then the
    # checkpoint's window with the length ramp; the circuit then moves to the compressed
    # entries far faster than it forms there from scratch (docs/organism.md).
    wide_window: int | None = None
    wide_window_frac: float = 0.3
    ramp_frac: float = 0.4
    eval_every: int = 250
    eval_lengths: tuple[int, ...] = (512, 2048, 4096)
    eval_examples: int = 24
    log_every: int = 25
    workers: int = 8
    max_minutes: float | None = None
    # Stop the dense phase after this many steps of the schedule planned for steps_dense
    # (learning-rate decay and length ramp): a truncated schedule at a fixed step, where
    # max_minutes would cut it at a speed-dependent one.
    dense_stop: int | None = None
    # Continue from an earlier checkpoint (its config wins over config_overrides).
    init_from: str | None = None
    config_overrides: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("steps_dense", "steps_distil", "steps_sparse"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.dense_stop is not None and not 1 <= self.dense_stop <= self.steps_dense:
            raise ValueError("dense_stop must be in 1..steps_dense")
        if self.tokens_per_batch < self.max_len:
            raise ValueError("tokens_per_batch must hold at least one max_len example")
        if not 0.0 <= self.ramp_frac <= 1.0:
            raise ValueError("ramp_frac must be in [0, 1]")
        if not 0.0 <= self.wide_window_frac < 1.0:
            raise ValueError("wide_window_frac must be in [0, 1)")
        if self.wide_window is not None and self.wide_window < 1:
            raise ValueError("wide_window must be a positive number of tokens")
        if self.value_digits_start is not None and not 1 <= self.value_digits_start <= self.value_digits:
            raise ValueError("value_digits_start must be in 1..value_digits")
        if self.wide_window is not None and self.wide_window < self.min_len:
            raise ValueError("wide_window must be at least min_len")
        DataSpec(
            min_len=self.min_len,
            max_len=self.max_len,
            kind_weights=tuple(self.kind_weights),
            value_digits=self.value_digits,
        )

    def wide_steps(self, phase: str, steps: int) -> int:
        """How many of ``phase``'s first steps run with the wide window."""
        return int(self.wide_window_frac * steps) if (self.wide_window and phase == "dense") else 0


class _Batches(torch.utils.data.Dataset):
    """Batch ``i`` = padded examples drawn from seeds derived from (seed, phase, i): deterministic."""

    def __init__(self, cfg: TrainConfig, caps: list[int], digits: list[int], salt: int, tokenizer) -> None:
        self.cfg, self.caps, self.digits, self.salt, self.tokenizer = cfg, caps, digits, salt, tokenizer
        self.pad_id = tokenizer.pad_token_id

    def __len__(self) -> int:
        return len(self.caps)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        cap = self.caps[i]
        spec = DataSpec(
            min_len=min(self.cfg.min_len, cap),
            max_len=cap,
            kind_weights=self.cfg.kind_weights,
            value_digits=self.digits[i],
        )
        n = max(1, min(self.cfg.tokens_per_batch // cap, self.cfg.max_batch_tokens_sq // (cap * cap)))
        base = (self.cfg.seed * 1_000_003 + self.salt) * 10_000_019 + i * 1024
        exs = [make_example(self.tokenizer, spec, base + j) for j in range(n)]
        return _pad(exs, self.pad_id)


def _pad(exs, pad_id: int) -> dict[str, torch.Tensor]:
    T = max(len(e.input_ids) for e in exs)
    ids = torch.full((len(exs), T), pad_id, dtype=torch.long)
    labels = torch.full((len(exs), T), IGNORE, dtype=torch.long)
    real = torch.zeros((len(exs), T), dtype=torch.bool)
    for b, e in enumerate(exs):
        ids[b, : len(e.input_ids)] = torch.tensor(e.input_ids)
        labels[b, : len(e.labels)] = torch.tensor(e.labels)
        real[b, : len(e.input_ids)] = True
    return {"input_ids": ids, "labels": labels, "real": real}


class _Taps:
    """Forward hooks on CSA layers: main attention mass on compressed entries and indexer scores."""

    def __init__(self, model: DeepseekV4ForCausalLM) -> None:
        self.attn: dict[int, torch.Tensor] = {}
        self.scores: dict[int, torch.Tensor] = {}
        self.handles = []
        for layer, indexer in csa_indexers(model):
            attn = model.model.layers[layer].self_attn
            self.handles.append(attn.register_forward_hook(self._attn_hook(layer)))
            self.handles.append(indexer.scorer.register_forward_hook(self._score_hook(layer)))
            # Detach the indexer's inputs: its distillation loss must not train the main model.
            self.handles.append(indexer.register_forward_pre_hook(_detach_inputs))

    def _attn_hook(self, layer: int) -> Callable:
        def hook(module, args, output):
            probs = output[1]  # [B, H, S, S + L] eager attention probabilities
            S = probs.shape[2]
            self.attn[layer] = probs[..., S:].detach().float().sum(dim=1)  # [B, S, L]

        return hook

    def _score_hook(self, layer: int) -> Callable:
        def hook(module, args, output):
            self.scores[layer] = output  # [B, S, L] fp32, unmasked

        return hook

    def kl(self, real: torch.Tensor, ratio: int = 4) -> torch.Tensor:
        """Mass-weighted KL(attention || softmax(indexer)) averaged over CSA layers."""
        total = real.new_zeros((), dtype=torch.float32)
        n_layers = max(1, len(self.attn))
        for layer, mass in self.attn.items():
            scores = self.scores[layer]
            B, S, L = scores.shape
            vis = visible_entries(torch.arange(S, device=scores.device), ratio)  # [S]
            visible = torch.arange(L, device=scores.device).view(1, L) < vis.view(S, 1)  # [S, L]
            logq = scores.masked_fill(~visible, float("-inf")).log_softmax(-1)
            row_mass = mass.sum(-1)  # [B, S]
            p = mass / row_mass.clamp_min(1e-9).unsqueeze(-1)
            term = torch.where(p > 0, p * (p.clamp_min(1e-12).log() - logq), torch.zeros_like(p)).sum(-1)
            weight = row_mass * real.float() * (vis > 0).view(1, S)
            total = total + (term * weight).sum() / weight.sum().clamp_min(1e-9)
        self.attn.clear()
        self.scores.clear()
        return total / n_layers

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _detach_inputs(module, args):
    return tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)


def _ramp(cfg: TrainConfig, steps: int, ramp: bool, hold: int = 0) -> list[float]:
    """Per step, how far along the length ramp it is (0..1); the first ``hold`` steps sit at 0."""
    ramp_steps = max(1, int(cfg.ramp_frac * (steps - hold))) if ramp else 0
    return [min(1.0, max(0, i - hold) / ramp_steps) if ramp_steps else 1.0 for i in range(steps)]


def _caps(cfg: TrainConfig, steps: int, ramp: bool, hold: int = 0) -> list[int]:
    caps = []
    for i, frac in enumerate(_ramp(cfg, steps, ramp, hold)):
        cap = int(cfg.min_len * (cfg.max_len / cfg.min_len) ** frac)
        if i < hold:
            cap = max(cap, cfg.wide_window or 0)
        caps.append(max(cfg.min_len, min(cfg.max_len, cap)))
    return caps


def _digits(cfg: TrainConfig, steps: int, ramp: bool, hold: int = 0) -> list[int]:
    start, end = cfg.value_digits_start or cfg.value_digits, cfg.value_digits
    return [min(end, start + int((end - start + 1) * frac)) for frac in _ramp(cfg, steps, ramp, hold)]


def _lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    prog = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, prog))))


def _losses(model, batch, taps: _Taps, cfg: TrainConfig, device: str):
    ids = batch["input_ids"].to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True)
    real = batch["real"].to(device, non_blocking=True)
    with _autocast(device):
        logits = model(input_ids=ids, use_cache=False).logits
    logits = logits[:, :-1].float()
    tgt = labels[:, 1:]
    # Mean per example, then over examples: a repeat chat's hundreds of copied tokens must not
    # drown the eight answer tokens of a needle case.
    tok = F.cross_entropy(logits.transpose(1, 2), tgt.clamp_min(0), reduction="none")  # [B, T-1]
    has = tgt != IGNORE
    per_ex = (tok * has).sum(1) / has.sum(1).clamp_min(1)
    answer = per_ex[has.any(1)].mean()
    lm_tgt = ids[:, 1:].masked_fill(~real[:, 1:], IGNORE)
    lm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), lm_tgt.reshape(-1), ignore_index=IGNORE)
    kl = taps.kl(real)
    if torch.isnan(answer):  # a batch of filler chats has no answer tokens
        answer = logits.new_zeros(())
    return answer, lm, kl


@torch.no_grad()
def _evaluate(model, cfg: TrainConfig, tokenizer, device: str) -> dict[str, float]:
    """Fraction of held-out examples whose every answer token is the argmax (= greedy-correct)."""
    out = {}
    for length in cfg.eval_lengths:
        spec = DataSpec(min_len=length, max_len=length, max_drill=0, value_digits=cfg.value_digits)
        exs = [
            make_example(tokenizer, spec, 900_000_000 + length * 1000 + j) for j in range(cfg.eval_examples)
        ]
        exs = [e for e in exs if any(lbl != IGNORE for lbl in e.labels)]
        correct = 0
        for i in range(0, len(exs), 4):
            batch = _pad(exs[i : i + 4], tokenizer.pad_token_id)
            ids = batch["input_ids"].to(device)
            with _autocast(device):
                logits = model(input_ids=ids, use_cache=False).logits
            pred = logits[:, :-1].argmax(-1).cpu()
            tgt = batch["labels"][:, 1:]
            mask = tgt != IGNORE
            correct += int(((pred == tgt) | ~mask).all(dim=1).sum())
        out[str(length)] = correct / max(1, len(exs))
    return out


def _autocast(device: str):
    """bf16 autocast on CUDA; plain fp32 on CPU, where bf16 autocast is several times slower."""
    if device.startswith("cuda"):
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _set_window(model, window: int) -> None:
    model.config.sliding_window = window  # the mask builder reads the config
    for layer in model.model.layers:
        layer.self_attn.sliding_window = window


def _set_topk(model, k: int) -> None:
    for _, indexer in csa_indexers(model):
        indexer.index_topk = k


def train(
    cfg: TrainConfig, out: Path, *, device: str = "cuda", on_log: Callable[[dict], None] | None = None
) -> dict:
    """Train the organism per ``cfg`` and save the checkpoint + ``training.json`` to ``out``.

    One function on purpose (over 80 lines): it is the recorded recipe's loop, whose order of
    seeded draws (weights, data, dropout-free steps) must stay exactly as run so that the shipped
    weights reproduce bit for bit; the pieces with their own logic (losses, eval, data) are
    already separate functions.
    """
    t0 = time.monotonic()
    torch.manual_seed(cfg.seed)
    # A continued checkpoint keeps its own tokenizer: token ids must match its embeddings.
    tokenizer = AutoTokenizer.from_pretrained(cfg.init_from) if cfg.init_from else build_tokenizer()
    config = organism_config(
        len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **cfg.config_overrides,
    )
    config._attn_implementation = "eager"
    if cfg.init_from:
        model = DeepseekV4ForCausalLM.from_pretrained(
            cfg.init_from,
            use_safetensors=True,
            local_files_only=True,
            attn_implementation="eager",
            dtype=torch.float32,  # master weights in fp32 even if the checkpoint was stored in bf16
        ).to(device)
    else:
        model = DeepseekV4ForCausalLM(config)
        init_hash_routing(model, cfg.seed)
        model = model.to(device)
    model.train()
    window = model.config.sliding_window
    taps = _Taps(model)
    indexer_params = [p for _, ix in csa_indexers(model) for p in ix.parameters()]
    record: dict = {"config": _jsonable(asdict(cfg)), "steps": {}, "log": [], "eval": []}
    # With a time cap, each phase gets a fixed share of it so later phases always run.
    shares = (
        {"dense": 0.8, "distil": 0.1, "sparse": 0.1} if cfg.steps_sparse else {"dense": 0.88, "distil": 0.12}
    )

    def run_phase(
        name: str, steps: int, params, lr: float, ramp: bool, topk: int, use_answer: bool, salt: int
    ):
        if steps == 0:
            record["steps"][name] = 0
            return
        deadline = time.monotonic() + shares[name] * cfg.max_minutes * 60 if cfg.max_minutes else None
        _set_topk(model, topk)
        for p in model.parameters():
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        switch = cfg.wide_steps(name, steps)
        loader = torch.utils.data.DataLoader(
            _Batches(
                cfg, _caps(cfg, steps, ramp, switch), _digits(cfg, steps, ramp, switch), salt, tokenizer
            ),
            batch_size=None,
            num_workers=cfg.workers,
            prefetch_factor=4 if cfg.workers else None,
            persistent_workers=False,
        )
        done = 0
        last = cfg.dense_stop if (name == "dense" and cfg.dense_stop) else steps
        _set_window(model, cfg.wide_window if switch else window)
        for step, batch in enumerate(loader):
            if switch and step == switch:
                _set_window(model, window)
            for g in opt.param_groups:
                g["lr"] = _lr(step, steps, lr, min(cfg.warmup, max(1, steps // 10)))
            answer, lm, kl = _losses(model, batch, taps, cfg, device)
            loss = cfg.kl_weight * kl + ((answer + cfg.lm_weight * lm) if use_answer else 0.0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            done = step + 1
            if step % cfg.log_every == 0 or done == last:
                entry = {
                    "step": step,
                    "phase": name,
                    "loss": float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss),
                    "answer_loss": float(answer.detach()),
                    "lm_loss": float(lm.detach()),
                    "kl": float(kl.detach()),
                    "len_cap": int(batch["input_ids"].shape[1]),
                    "window": int(model.config.sliding_window),
                    "elapsed_s": round(time.monotonic() - t0, 1),
                }
                record["log"].append(entry)
                if on_log:
                    on_log(entry)
            if (done % cfg.eval_every == 0 or done == last) and cfg.eval_examples:
                model.eval()
                ev = {"step": step, "phase": name, "answer_exact": _evaluate(model, cfg, tokenizer, device)}
                model.train()
                record["eval"].append(ev)
                if on_log:
                    on_log(ev)
            if deadline and time.monotonic() > deadline:
                break
            if done == last:
                break
        record["steps"][name] = done

    run_phase("dense", cfg.steps_dense, list(model.parameters()), cfg.lr, True, DENSE_TOPK, True, 1)
    run_phase("distil", cfg.steps_distil, indexer_params, cfg.lr_distil, False, DENSE_TOPK, False, 2)
    run_phase(
        "sparse", cfg.steps_sparse, list(model.parameters()), cfg.lr * 0.3, False, cfg.sparse_topk, True, 3
    )
    taps.remove()
    _set_window(model, window)
    _set_topk(model, DENSE_TOPK)
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    with quiet_transformers():
        model.to("cpu").float().save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    record["wall_s"] = round(time.monotonic() - t0, 1)
    record["hardware"] = _hardware(device)
    (out / "training.json").write_text(json.dumps(record, indent=1))
    return record


def _jsonable(d: dict) -> dict:
    return json.loads(json.dumps(d, default=list))


def _hardware(device: str) -> dict:
    import transformers

    gpu = torch.cuda.get_device_name(0) if device.startswith("cuda") and torch.cuda.is_available() else None
    return {
        "device": device,
        "gpu": gpu,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
