"""Server facts: ``/health``, ``/get_server_info`` (SGLang), ``/version``, ``/metrics`` (Prometheus)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from needlescope import __version__
from needlescope.serve.protocol import Health, Version
from needlescope.serve.routes.generation import Serving
from needlescope.serve.routes.responses import JSON_ERRORS

__all__ = ["info_router"]


def info_router(serving: Serving) -> APIRouter:
    router = APIRouter()
    engine = serving.engine

    @router.get("/health", response_model=Health)
    async def health():
        return {"status": "ok"}

    @router.get("/get_server_info", response_model=dict[str, Any], responses=JSON_ERRORS)
    async def server_info():
        return {**engine.info(), "args": engine.cfg.to_dict()}

    @router.get("/version", response_model=Version, responses=JSON_ERRORS)
    async def version():
        return {"version": __version__, "server": "needlescope"}

    @router.get(
        "/metrics",
        response_class=Response,
        responses={**JSON_ERRORS, 200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}},
    )
    async def prometheus():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router
