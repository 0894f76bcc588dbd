"""Pipeline parallelism: schedules as data (schedules/) and their SPMD executor (executor.py)."""
