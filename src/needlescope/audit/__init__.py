"""Numerics audit: op-level microtests of reduced-precision or rewritten ops against fp32."""
