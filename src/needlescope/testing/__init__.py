"""Test support: reference targets with known behaviour, tiny checkpoints, child servers.

``scripted_server`` is a stdlib-only OpenAI-compatible server with a known recall window;
``servers.scripted`` starts it as a child (the one READY handshake of ``serve.launch``);
``checkpoints.save_random`` writes a random organism-shaped DeepSeek-V4 checkpoint;
``prometheus.PrometheusServer`` runs a real Prometheus on loopback.
Nothing in the library imports this package; tests, bench and docs examples do.
"""
