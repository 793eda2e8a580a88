"""The kernel and kernel-fault names, torch-free so configs and CLIs validate without importing torch."""

KERNELS = ("auto", "reference", "triton")
"""``auto``: Triton on CUDA, the torch reference elsewhere."""

KERNEL_FAULTS = ("indexer_page_table", "indexer_key_slot")
"""Debug-only kernel bugs: read pages by logical page number (block table ignored); score entry
s with the key stored for entry s - 1 (entry 0 keeps its own). Same names as the patch faults
in ``needlescope.dsa.faults`` that emulate them over the reference."""
