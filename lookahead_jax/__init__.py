"""lookahead-jax: lossless accelerated LLM decoding in JAX."""
