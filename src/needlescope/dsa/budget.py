"""What one prefill of a transformers DeepSeek-V4 model holds, and how many rows fit a budget.

The eager forward's largest tensors are per layer, live one layer at a time: the attention
scores ``[B, H, S, K]`` fp32 over the ``K`` keys a query row can read (its sliding window and
the chunk, plus every compressed entry of a CSA or HCA layer: the mask keeps the top-k, the
matmul still spans them all) in about four copies at once (the scores, the masked scores, the
sinks concatenated, the softmax), the mask ``[B, 1, S, K]``, and the lightning indexer's
per-head scores ``[B, S, H_I, L/4]`` fp32 in about three. A one-pass forward has ``S = K = T``:
``O(T^2)`` per row; a prefill in chunks of ``C`` tokens through the KV cache (``dsa.passes``)
has ``S = C`` and ``K = C + window + T/4``: ``O(C * T)``.

``prefill_bytes`` is that count for the last (largest) chunk; ``rows_within`` the number of
prompts of one length a batch may hold under a budget (``memory_budget``, set once by a
command's ``--max-memory``; ``DEFAULT_BUDGET`` otherwise). ``DEFAULT_CHUNK`` is the chunk the
measurements use when none is asked for: at it the per-row bytes at 8K tokens are tens of MiB
(``tests/test_prefill_memory.py`` measures a step's peak against this bound).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

__all__ = [
    "indexed_device",
    "DEFAULT_BUDGET",
    "DEFAULT_CHUNK",
    "bounded_memory",
    "measurement_chunk",
    "memory_budget",
    "prefill_bytes",
    "prefill_flops",
    "rows_within",
]

DEFAULT_CHUNK = 512
"""Prefill chunk of a measurement that names none (tokens)."""

DEFAULT_BUDGET = 1 << 30
"""Activation bytes a batch of prompts may take when no ``--max-memory`` says otherwise."""

_BUDGET: ContextVar[int | None] = ContextVar("needlescope_memory_budget", default=None)

FP32 = 4
ATTENTION_COPIES = 4  # scores, masked scores, scores with the sinks, softmax
INDEXER_COPIES = 3  # per-head products, ReLU * scale, * head weights


@contextmanager
def memory_budget(nbytes: int | None) -> Iterator[None]:
    """Inside the block, batches are sized to ``nbytes`` of activations (None: the default)."""
    token = _BUDGET.set(nbytes)
    try:
        yield
    finally:
        _BUDGET.reset(token)


def indexed_device(device: str, current):
    """``device`` with its index: a bare ``"cuda"`` means the current CUDA device (``current()``),
    because ``torch.cuda.set_per_process_memory_fraction`` refuses a device without an index.
    Returns a ``torch.device``."""
    import torch

    dev = torch.device(device)
    return dev if dev.index is not None else torch.device(dev.type, current())


@contextmanager
def bounded_memory(max_memory: str | None, device: str) -> Iterator[int | None]:
    """``--max-memory``: inside the block, batches are sized to half of ``max_memory`` (the rest
    is the weights, the caches and the allocator's slack), and on a CUDA ``device`` the process's
    caching allocator is capped at ``max_memory`` (``torch.cuda.set_per_process_memory_fraction``;
    the cap is lifted on exit), so several runs can share one GPU, each within its bound.
    Yields the bytes (None: no bound asked, nothing changes)."""
    if max_memory is None:
        yield None
        return
    from needlescope.dsa.placement import parse_max_memory

    nbytes = parse_max_memory(max_memory, 1)[0]
    capped = None
    if device.startswith("cuda"):
        import torch

        dev = indexed_device(device, torch.cuda.current_device)
        total = torch.cuda.get_device_properties(dev).total_memory
        capped = dev
        torch.cuda.set_per_process_memory_fraction(min(1.0, nbytes / total), dev)
    try:
        with memory_budget(nbytes // 2):
            yield nbytes
    finally:
        if capped is not None:
            import torch

            torch.cuda.set_per_process_memory_fraction(1.0, capped)


def current_budget() -> int:
    """The budget in force: ``memory_budget``'s, else ``DEFAULT_BUDGET``."""
    budget = _BUDGET.get()
    return DEFAULT_BUDGET if budget is None else budget


def measurement_chunk(chunk: int | None, length: int) -> int:
    """The prefill chunk a measurement of a ``length``-token prompt uses: ``chunk`` if given (the
    ledger's ``prefill_chunk``: a server's chunking, kept exactly), else steps of at most
    ``DEFAULT_CHUNK`` as equal as they can be (a prompt no longer than it runs in one forward).

    Equal steps because the default only bounds memory and must not change what runs: steps of
    512 would leave a 513-token prompt's last token alone, and a model's code takes a one-token
    forward for a decode step (a bug planted on the decode path then fired in the prefill)."""
    if chunk is not None:
        return min(length, chunk)
    if length <= DEFAULT_CHUNK:
        return length
    steps = -(-length // DEFAULT_CHUNK)
    return -(-length // steps)


def prefill_bytes(config, rows: int, length: int, chunk: int | None) -> int:
    """Peak activation bytes of prefilling ``rows`` prompts of ``length`` tokens in chunks of
    ``chunk`` (None: one pass) with ``config`` (a ``DeepseekV4Config``); see the module docstring.

    The largest layer decides: sliding layers read ``window + S`` keys, CSA layers add
    ``length / compress_rate_csa`` entries and run the indexer, HCA layers add
    ``length / compress_rate_hca``. Hidden states (``rows x S x hc_mult x hidden``) are added
    for the residual streams and a layer's working copies."""
    S = length if chunk is None else min(chunk, length)
    window = int(config.sliding_window)
    heads = int(config.num_attention_heads)
    rates = dict(getattr(config, "compress_rates", {}) or {})
    base_keys = S + (0 if chunk is None else window)
    per_layer = []
    for kind in set(config.layer_types):
        rate = rates.get(kind)
        keys = base_keys + (length // rate if rate else 0)
        attn = (ATTENTION_COPIES * heads + 2) * S * keys * FP32
        if kind == "compressed_sparse_attention":
            attn += INDEXER_COPIES * int(config.index_n_heads) * S * (length // rate) * FP32
        per_layer.append(attn)
    hidden = 8 * int(getattr(config, "hc_mult", 1)) * S * int(config.hidden_size) * FP32
    return rows * (max(per_layer) + hidden)


def rows_within(config, length: int, chunk: int | None, budget: int | None = None) -> int:
    """How many ``length``-token prompts one batch may prefill under ``budget`` bytes of
    activations (``current_budget()`` when None); at least one."""
    budget = current_budget() if budget is None else budget
    return max(1, budget // max(1, prefill_bytes(config, 1, length, chunk)))


def prefill_flops(config, length: int, *, logits_at: int = 1) -> int:
    """Multiply-add FLOPs (2 per MAC) the math of a ``length``-token prefill needs, by ``config``'s
    sizes: every projection per token, the routed (``num_experts_per_tok``) and shared experts,
    attention of each query over its window and the compressed entries it reads (CSA: the
    ``index_topk`` selected of those visible; HCA: every visible one), the lightning indexer's
    compression, and its queries and scores over the visible entries of the rows whose top-k
    leaves some out (a row that selects every entry needs no ranking), the head at ``logits_at`` positions. Norms, RoPE, softmax and the
    hyper-connections' Sinkhorn are elementwise and left out."""
    h, heads, d = int(config.hidden_size), int(config.num_attention_heads), int(config.head_dim)
    q_lora, hc = int(config.q_lora_rank), int(getattr(config, "hc_mult", 1))
    mix = (2 + hc) * hc
    rates = dict(config.compress_rates)
    window = int(config.sliding_window)
    attn_proj = h * q_lora + q_lora * heads * d + h * d + heads * d * int(config.o_lora_rank)
    attn_proj += int(config.o_groups) * int(config.o_lora_rank) * h
    experts = int(config.num_experts_per_tok) + int(getattr(config, "n_shared_experts", 0) or 0)
    mlp = experts * 3 * h * int(config.moe_intermediate_size) + h * int(config.n_routed_experts)
    per_token = 2 * mix * hc * h  # the attention and MLP hyper-connection mixes
    macs = length * len(config.layer_types) * (attn_proj + mlp + per_token)
    ih, idim = int(config.index_n_heads), int(config.index_head_dim)
    for kind in config.layer_types:
        keys = sum(min(t + 1, window) for t in range(length))
        rate = rates.get(kind)
        if kind == "compressed_sparse_attention":
            visible = [(t + 1) // rate for t in range(length)]
            keys += sum(min(int(config.index_topk), v) for v in visible)
            macs += length * (2 * h * 2 * d + 2 * h * 2 * idim)
            # the indexer's queries and scores, in the rows whose top-k leaves entries out (a row
            # that selects every visible entry needs no ranking: dsa.full_selection)
            ranked = [v for v in visible if v > int(config.index_topk)]
            macs += len(ranked) * (q_lora * ih * idim + h * ih) + ih * idim * sum(ranked)
        elif kind == "heavily_compressed_attention":
            keys += sum((t + 1) // rate for t in range(length))
            macs += length * 2 * h * d
        macs += 2 * heads * d * keys  # scores and the weighted sum of values
    macs += logits_at * h * int(config.vocab_size) + length * hc * hc * h
    return 2 * macs
