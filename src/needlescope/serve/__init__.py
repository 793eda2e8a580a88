"""``needlescope serve``: an OpenAI-compatible and SGLang-native reference server.

It serves the organism (or any local transformers causal-LM checkpoint) with emulated
indexer numerics. ``ServeConfig`` holds the settings, ``Engine`` loads the model and runs the
decode loop, ``create_app`` builds the FastAPI routes and ``run_server`` serves them with
uvicorn. Needs the ``[model]`` extra (torch, transformers, fastapi, uvicorn, prometheus-client).
"""

from __future__ import annotations

from needlescope.serve.config import ServeConfig

__all__ = ["ServeConfig", "Engine", "create_app", "run_server"]


def __getattr__(name: str):
    # The engine and app import torch/fastapi; keep ``import needlescope.serve`` light.
    if name == "Engine":
        from needlescope.serve.engine import Engine

        return Engine
    if name in ("create_app", "run_server"):
        from needlescope.serve import app

        return getattr(app, name)
    raise AttributeError(name)
