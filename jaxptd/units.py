"""Byte units: the one place the size of a GB (and its binary cousins) is written down.

Decimal units (GB = 1e9 bytes) are what the planner's flags and reports, the hardware
datasheets (jaxptd/runtime/target.py) and the benchmarks' GB/s speak; binary ones (GiB = 2**30)
are what XLA's memory reports and the deviceless compile check (jaxptd/plan/compile_check.py)
speak. Pick one per number shown and say which in its label.
"""
MB = 1e6
GB = 1e9

KiB = 2**10
MiB = 2**20
GiB = 2**30
TiB = 2**40
