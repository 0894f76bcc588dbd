"""Run services: hardware targets (`target.py`), multi-process start-up (`distributed.py`), preemption (`preemption.py`), pre-flight checks (`preflight.py`), run directories (`rundir.py`), the run log (`runlog.py`) and storage errors (`storage.py`).

Each module is imported by its own name; this file imports nothing."""
