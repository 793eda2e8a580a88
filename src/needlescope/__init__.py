"""needlescope: find, explain and fix long-context recall failures in LLM inference deployments."""

__version__ = "0.1.0"

__all__ = ["__version__"]
