"""Watching a deployment: a health smoke test and a recall canary exported to Prometheus.

Core (no torch): it builds probes with ``needlescope.cases``, sends them with
``needlescope.targets``, scores them with ``needlescope.analysis``; ``prometheus-client`` and
(optionally) ``nvidia-ml-py`` come with the ``[watch]`` extra.
"""
