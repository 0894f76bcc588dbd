"""Pipeline parallelism: schedules as data (schedules.py) and their SPMD executor (executor.py)."""
