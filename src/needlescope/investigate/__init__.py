"""The investigation layer: multi-step workflows from measurements to a causal verdict."""
