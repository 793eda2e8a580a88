"""What an investigation measures: the shared ``session.Session``; the in-process route
(``inprocess``), the live route (``live``) and the tensor-dump route (``dump``); the case
records (``records``), the cheap questions, the causal measurements (``causal``: sufficiency,
residual), ``localize``, ``decode_path``, ``rank_paths`` and the resumable run state (``state``).
The only room of the investigation that loads torch."""
