"""HTTP routes of ``needlescope serve``, one module per family, sharing one generate-and-render
path (``generation.Serving``) and one error layer (``errors``)."""

from __future__ import annotations

from fastapi import FastAPI

from needlescope.serve.routes.generation import Serving
from needlescope.serve.routes.info import info_router
from needlescope.serve.routes.native import native_router
from needlescope.serve.routes.openai import openai_router

__all__ = ["include_routes"]


def include_routes(app: FastAPI, serving: Serving) -> None:
    for router in (openai_router(serving), native_router(serving), info_router(serving)):
        app.include_router(router)
