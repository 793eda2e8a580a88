"""Talking to the inference server under test: chat, preflight, token counting, provenance."""

from needlescope.targets.client import ChatResult, ChatTarget, preflight, served_models
from needlescope.targets.endpoints import normalize_base_url
from needlescope.targets.provenance import collect_provenance, strip_secrets
from needlescope.targets.tokenize import (
    LocalTokenCounter,
    ServerTokenCounter,
    detect_server_tokenizer,
)

__all__ = [
    "ChatResult",
    "ChatTarget",
    "LocalTokenCounter",
    "ServerTokenCounter",
    "collect_provenance",
    "detect_server_tokenizer",
    "normalize_base_url",
    "preflight",
    "served_models",
    "strip_secrets",
]
