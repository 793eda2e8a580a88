"""DeepSeek-V4 sparse attention (DSA) lightning-indexer reference math and fake quant.

Needs torch (the ``[model]`` extra). The torch-free layers (``setting``, ``cases``, ``analysis``,
``targets``, ``report``, ``run``) never import it (``tests/test_import_direction.py``); ``dsa``,
``organism``, ``serve``, ``investigate`` and the commands that run a model do.
"""

from needlescope.dsa.quant import QUANTIZERS, get_quantizer, hadamard_128, quantize_query_fp8_per_head
from needlescope.dsa.reference import (
    NO_ENTRY,
    apply_rope_interleaved,
    compress_index_keys,
    indexer_scores,
    rope_cos_sin,
    topk_indices,
    visibility_mask,
    visible_entries,
)

__all__ = [
    "NO_ENTRY",
    "QUANTIZERS",
    "apply_rope_interleaved",
    "compress_index_keys",
    "get_quantizer",
    "hadamard_128",
    "indexer_scores",
    "quantize_query_fp8_per_head",
    "rope_cos_sin",
    "topk_indices",
    "visibility_mask",
    "visible_entries",
]
