"""lookahead-jax: lossless accelerated LLM decoding in JAX.

    model, tokenizer = lookahead_jax.load("smollm2-135m")
    out = lookahead_jax.generate(model, tokenizer, ["Hello"], max_new_tokens=32,
                                 strategy="lookahead")
    out.texts, out.token_ids, out.stats
"""

from .generate import GenerateOutput, RowOutput, generate
from .loading import Model, load, save_pretrained
from .sampling import SamplingParams

__all__ = ["GenerateOutput", "Model", "RowOutput", "SamplingParams", "generate", "load", "save_pretrained"]
__version__ = "0.1.0"
