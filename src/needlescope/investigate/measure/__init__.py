"""What an investigation measures: the in-process route (``inprocess``) and the live route
(``live``), the case records (``records``), the cheap questions, the causal measurements
(``causal``: sufficiency, residual), ``localize``, ``decode_path``, ``rank_paths`` and the
resumable run state (``state``). The only room of the investigation that loads torch."""
