"""The training step program and its command line: the step (`step.py`), the train state and its layouts (`state.py`), gradient reduction (`reduction.py`), host offload (`offload.py`), the optimizer (`optim.py`), FLOPs and throughput (`metrics.py`), and `python -m jaxptd.train` (`loop.py`, run by `__main__.py`).

Each module is imported by its own name; this file imports nothing."""
