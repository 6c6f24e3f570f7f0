"""KNN-LM (Khandelwal et al. 2020) and speculative KNN-LM (RaLMSpec, Zhang et al. ICML'24).

    python -m lookahead_jax.knnlm build --model smollm2-135m --corpus passages.jsonl --max-passages 200
    out = lj.generate(model, tok, prompts, strategy="knnlm", corpus="passages.jsonl")
    out = lj.generate(model, tok, prompts, strategy=lj.KNNLM(corpus="passages.jsonl", speculative=True))
    out.stats["retrieval"], out.rows[0].retrieval

`datastore.py` the datastore (hidden state -> next token) on disk: load, the errors
naming the build command, its faiss indexes; `build.py` its resumable build; `search.py` the device side: canonical distances, exact / subset
search, faiss candidates, the mixed distribution and the token pick, the model step;
`cli.py` the command line. The strategy and its runs: `strategies/knnlm.py`,
`strategies/knnlm_runs.py`.
"""

from .build import BuildInterrupted, build_datastore
from .datastore import (
    Datastore, DatastoreNotBuilt, DatastoreUnavailable, StaleDatastore, datastore_dir, load_datastore,
)

__all__ = ["BuildInterrupted", "Datastore", "DatastoreNotBuilt", "DatastoreUnavailable", "StaleDatastore",
           "build_datastore", "datastore_dir", "load_datastore"]
