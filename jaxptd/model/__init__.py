"""The GPT model (Flax): layers.py holds the modules, gpt.py the parameter tree and stage functions."""
