"""jaxptd: Megatron-LM PTD-P (pipeline x tensor x data parallelism) in JAX."""
