"""The Hugging Face bridge: import/export (`bridge.py`, `python -m jaxptd.hf` through `__main__.py`), safetensors files (`files.py`) and parameter names as data (`names.py`).

Each module is imported by its own name; this file imports nothing."""
