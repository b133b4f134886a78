"""Capacity planning: per-GPU memory arithmetic (``memory.py``) and fake-process-group dry runs
(``dry_run.py``) of a job's layout, before any GPU is allocated."""
