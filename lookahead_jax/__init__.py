"""lookahead-jax: lossless accelerated LLM decoding in JAX.

    import lookahead_jax as lj
    model, tokenizer = lj.load("smollm2-135m")
    out = lj.generate(model, tokenizer, ["Hello"], max_new_tokens=32, strategy="lookahead")
    out.texts, out.token_ids, out.stats
    params = lj.GenerationParams(max_new_tokens=32, temperature=0.7, seed=1)  # one request's options
    lj.generate(model, tokenizer, ["Hello"], params=params, strategy="lookahead")

`lookahead_jax.generate` is the generate function here; the package of the same name
holds it and `python -m lookahead_jax.generate` (its `__main__` hands over to `cli.py`).
"""

from .core.engine import Engine, engine_for
from .core.sharding import make_mesh
from .generate import GenerateOutput, RowOutput, generate
from .loading import Model, load, save_pretrained
from .core.params import GenerationParams, ParamError, SamplingParams
from .strategies import KNNLM, Greedy, Lookahead, RaLM, RaLMSpec, SpecInfer

__all__ = ["Engine", "GenerateOutput", "GenerationParams", "Greedy", "KNNLM", "Lookahead", "Model", "ParamError", "RaLM", "RaLMSpec", "RowOutput",
           "SamplingParams",
           "SpecInfer",
           "engine_for", "generate", "load", "make_mesh", "save_pretrained"]
__version__ = "0.1.0"
