"""Parallel basics: the device mesh (`mesh.py`), logical-axis sharding rules (`sharding.py`) and the varying-manual-axes helpers used inside shard_map (`varying.py`).

Each module is imported by its own name; this file imports nothing."""
