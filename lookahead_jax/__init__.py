"""lookahead-jax: lossless accelerated LLM decoding in JAX.

    import lookahead_jax as lj
    model, tokenizer = lj.load("smollm2-135m")
    out = lj.generate(model, tokenizer, ["Hello"], max_new_tokens=32, strategy="lookahead")
    out.texts, out.token_ids, out.stats

`lookahead_jax.generate` is both the CLI module (`python -m lookahead_jax.generate`) and
callable as the generate function (`lookahead_jax.generate.generate`). It is imported
lazily so that `python -m` runs it once, without runpy's double-import warning.
"""

from .engine import Engine, engine_for
from .loading import Model, load, save_pretrained
from .sampling import SamplingParams
from .strategies import KNNLM, Greedy, Lookahead, RaLM, RaLMSpec, SpecInfer

__all__ = ["Engine", "GenerateOutput", "Greedy", "KNNLM", "Lookahead", "Model", "RaLM", "RaLMSpec", "RowOutput", "SamplingParams",
           "SpecInfer",
           "engine_for", "generate", "load", "save_pretrained"]
__version__ = "0.1.0"


def __getattr__(name):
    if name in ("generate", "GenerateOutput", "RowOutput"):
        import importlib

        mod = importlib.import_module(".generate", __name__)
        return mod if name == "generate" else getattr(mod, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
