"""The lightning indexer without its scores when its top-k selects every visible entry.

transformers' ``DeepseekV4Indexer`` scores every query row against every compressed entry
(``[B, S, H_I, L]`` fp32 products, ReLU, head weights), masks the future, and sorts each row
(``topk`` of ``min(index_topk, L)``). When ``index_topk >= L`` (the organism: ``index_topk``
2048, at most 2048 entries at its 8K context) the selection is every entry, in score order,
and the CSA compressor turns it into a block bias that does not depend on the order: 0 at the
entries a row may see (``entry < (position + 1) // compress_rate``), ``-inf`` elsewhere. The
scores, the sort and the query projection change nothing then; at a 4K prefill they are a third
of the forward on one CPU core.

``use_full_selection(model)`` gives each CSA indexer of ``model`` a forward that, in that case,
runs the indexer's compression alone (its cache state, its compressed keys: a later call that
does select still finds them) and returns every entry, ``-1`` where the row may not see it.
Anything that could observe or change the scores or the sort keeps the stock forward, bit for
bit: a forward hook on the indexer or its scorer (``IndexerCapture``, the localizer's recorder),
a replaced scorer or indexer forward (a fault, ``emulate``'s numerics), a patched indexer class,
an active ``TorchFunctionMode`` (a fault that intercepts ``topk``), training, or a top-k smaller
than the visible entries. ``tests/test_dsa_full_selection.py`` checks logits, cache and
selection against the stock forward.
"""

from __future__ import annotations

import types

import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as modeling

__all__ = ["selects_everything", "use_full_selection"]

_STOCK_INDEXER = modeling.DeepseekV4Indexer.forward
_STOCK_SCORER = modeling.DeepseekV4IndexerScorer.forward


def _observed(module: torch.nn.Module) -> bool:
    """Whether a hook watches ``module`` or its ``forward`` is replaced on the instance."""
    return bool(module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)


def _global_hooks() -> bool:
    from torch.nn.modules import module as nn_module

    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


def selects_everything(indexer: torch.nn.Module) -> bool:
    """Whether ``indexer``'s call in flight may skip scoring: its forward is this module's and
    nothing observes or replaces the scores or the sort (see the module docstring). The top-k
    test needs the entry count and is made in the forward."""
    scorer = indexer.scorer
    return (
        not indexer.training
        and getattr(indexer.__dict__.get("forward"), "__func__", None) is _forward
        and type(indexer).forward is _STOCK_INDEXER
        and type(scorer).forward is _STOCK_SCORER
        and not (indexer._forward_hooks or indexer._forward_pre_hooks)
        and not _observed(scorer)
        and not _global_hooks()
        and torch._C._len_torch_function_stack() == 0
    )


def _entries_after(indexer: torch.nn.Module, hidden_states, past_key_values, layer_idx) -> int:
    """Compressed entries the indexer holds after this call: those emitted before (the cache's)
    and one per window this call closes."""
    if past_key_values is None:
        return hidden_states.shape[1] // indexer.compress_rate
    layer = past_key_values.layers[layer_idx]
    buffered = layer.buffer_kv["indexer"]
    pending = (0 if buffered is None else buffered.shape[1]) + hidden_states.shape[1]
    return layer.entry_count["indexer"] + pending // indexer.compress_rate


def _compress(self, hidden_states, past_key_values, layer_idx) -> torch.Tensor:
    """The indexer's compressed keys [B, L, index_head_dim] (the cache's running list when there
    is a cache): transformers' ``DeepseekV4Indexer.forward`` up to its query projection."""
    batch = hidden_states.shape[0]
    cache_layer = past_key_values.layers[layer_idx] if past_key_values is not None else None
    kv = self.kv_proj(hidden_states)
    gate = self.gate_proj(hidden_states)
    if cache_layer is None:
        usable = (kv.shape[1] // self.compress_rate) * self.compress_rate
        chunk_kv, chunk_gate, first_window_position = kv[:, :usable], gate[:, :usable], 0
    else:
        chunk_kv, chunk_gate, first_window_position = cache_layer.store_compression_weights(
            "indexer", kv, gate
        )
    if chunk_kv.shape[1] > 0:
        n_windows = chunk_kv.shape[1] // self.compress_rate
        ratio = self.compress_rate
        chunk_kv = chunk_kv.view(batch, n_windows, ratio, -1)
        chunk_gate = chunk_gate.view(batch, n_windows, ratio, -1) + self.position_bias
        new_kv = chunk_kv.new_zeros((batch, n_windows, 2 * ratio, self.head_dim))
        new_gate = chunk_gate.new_full((batch, n_windows, 2 * ratio, self.head_dim), float("-inf"))
        new_kv[:, :, ratio:] = chunk_kv[..., self.head_dim :]
        new_gate[:, :, ratio:] = chunk_gate[..., self.head_dim :]
        if n_windows > 1:
            new_kv[:, 1:, :ratio] = chunk_kv[:, :-1, :, : self.head_dim]
            new_gate[:, 1:, :ratio] = chunk_gate[:, :-1, :, : self.head_dim]
        if cache_layer is not None:
            prior_kv, prior_gate = cache_layer.update_overlap_state(
                "indexer", chunk_kv, chunk_gate, self.head_dim
            )
            if prior_kv is not None:
                new_kv[:, 0, :ratio] = prior_kv.to(new_kv.dtype)
                new_gate[:, 0, :ratio] = prior_gate.to(new_gate.dtype)
        compressed = self.kv_norm(
            (new_kv * new_gate.softmax(dim=2, dtype=torch.float32).to(new_kv.dtype)).sum(dim=2)
        )
        positions = torch.arange(n_windows, device=compressed.device)
        positions = (positions * self.compress_rate + first_window_position).unsqueeze(0).expand(batch, -1)
        cos, sin = self.rotary_emb(compressed, position_ids=positions, layer_type=self.rope_layer_type)
        compressed = modeling.apply_rotary_pos_emb(compressed.unsqueeze(1), cos, sin).squeeze(1)
    else:
        compressed = chunk_kv.new_zeros((batch, 0, self.head_dim))
    return compressed if cache_layer is None else cache_layer.update_compressor_states("indexer", compressed)


def _forward(self, hidden_states, q_residual, position_ids, past_key_values, layer_idx):
    """``DeepseekV4Indexer.forward``'s selection [B, S, k] (-1: not visible to the row); without
    scores when every visible entry is selected, else the forward in force."""
    args = (hidden_states, q_residual, position_ids, past_key_values, layer_idx)
    if not selects_everything(self) or self.index_topk < _entries_after(
        self, hidden_states, past_key_values, layer_idx
    ):
        return type(self).forward(self, *args)
    length = _compress(self, hidden_states, past_key_values, layer_idx).shape[1]
    # position_ids may be [1, S] for a batch of B rows: the selection is [B, S, L], as the scores'
    everything = torch.arange(length, device=hidden_states.device).expand(*hidden_states.shape[:2], length)
    visible = (position_ids + 1) // self.compress_rate  # [B, S]
    return torch.where(everything >= visible.unsqueeze(-1), -1, everything)


def use_full_selection(model: torch.nn.Module) -> torch.nn.Module:
    """Give every CSA indexer of ``model`` (a transformers DeepSeek-V4 model) the forward that
    skips scoring when it selects everything; returns ``model``. Other models come back unchanged."""
    for mod in model.modules():
        if isinstance(mod, modeling.DeepseekV4Indexer) and "forward" not in mod.__dict__:
            mod.forward = types.MethodType(_forward, mod)
    return model
