"""`strategy="knnlm"`: KNN-LM decoding, plain or speculative (RaLMSpec), on the decode state.

This module holds the strategy's options: the `KNNLM` dataclass (its fields, their CLI
names, choices and help, validation, the options a configuration leaves unused) and
`start`, which opens a run over the rows. The runs themselves, the loop of forwards,
searches, speculation and verification (`KnnRun`, `KnnSpecRun`), and why speculative
KNN-LM's outputs are plain KNN-LM's, token for token: `knnlm_runs.py`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .base import StrategyBase
from .knnlm_runs import KnnRun, KnnSpecRun
from .speculation import KNNLM_DEFAULT_STRIDE, auto_or_int, check_speculation_stride, number_in

SEARCHES = ("exact", "hnsw", "flat")
SPECULATE = ("auto", "cache", "ivf")


def parse_speculative(v, strict: bool = True):
    """The CLI's / a request's text as `speculative`: "auto", or true / false (1 / 0, yes /
    no, "" = true: the bare switch); other text raises (strict) or is returned as it is
    (for `validate` to name)."""
    t = str(v).strip().lower()
    if t == "auto":
        return "auto"
    if t in ("1", "true", "yes", ""):
        return True
    if t in ("0", "false", "no"):
        return False
    if strict:
        raise ValueError(f"must be true, false or auto, got {v!r}")
    return v


@dataclasses.dataclass(frozen=True)
class KNNLM(StrategyBase):
    """KNN-LM (Khandelwal et al. 2020): the next token is drawn from lam * p_kNN + (1 - lam)
    * p_LM, p_kNN from the k datastore entries nearest (squared L2) to the model's final
    hidden state (knnlm_runs.py's module docstring; search.py).

    datastore: a directory built by `python -m lookahead_jax.knnlm build`, a `Datastore`,
        or None: the one built for this model (and `corpus`, when given).
    corpus: the JSON Lines corpus the datastore was built from (picks the default
        datastore; checked against the datastore's sha256).
    knn_k: neighbours (default 32; KNN-LM used 1024, too many for a CPU step).
    knn_lambda: weight of p_kNN (default 0.25, as KNN-LM on Wikitext-103); 0 = the model.
    knn_temperature: p_kNN = softmax(-d / temperature) (default 1, KNN-LM's).
    knn_search: "exact" (device matmul over key chunks, exact top-k), "hnsw" (faiss,
        approximate) or "flat" (faiss brute force on the host).
    speculative: RaLMSpec's speculative retrieval: the same tokens, fewer real searches. True
        speculates whatever it costs; "auto" measures a search and a forward at the start of
        the run and speculates only where that is predicted to pay, else runs plain KNN-LM
        (knnlm_decision.py); False: plain KNN-LM.
    speculation_stride: speculative steps per verification, 1..16 or "auto" (OS3).
    knn_cache_next: n, the entries after each retrieved neighbour kept in the speculation cache.
    knn_speculate: what a speculative step ranks: "cache" (RaLMSpec's: the cache above),
        "ivf" (the cache plus 2k + 8 candidates from an approximate faiss IVF index over the
        whole datastore, built once into it; the same tokens, fewer rollbacks) or "auto"
        (default: "ivf" from 500K entries where faiss is installed, else "cache").
    knn_nprobe: the IVF lists searched per speculative query (knn_speculate="ivf")."""

    datastore: object = None
    corpus: object = None
    knn_k: int = 32
    knn_lambda: float = 0.25
    knn_temperature: float = 1.0
    knn_search: str = "exact"
    speculative: object = False  # False | True | "auto"
    speculation_stride: object = KNNLM_DEFAULT_STRIDE
    knn_cache_next: int = 8
    knn_speculate: str = "auto"
    knn_nprobe: int = 32

    name = "knnlm"
    supports_penalties = False  # its tokens come from the kNN mixture (`choose`), unpenalized
    runs_own_loop = True
    help = ("KNN-LM: the model's next-token distribution mixed with its nearest datastore entries' "
            "(--speculative: the same tokens with speculative, batch-verified searches)")
    cli_names = {}
    choices = {"knn_search": SEARCHES, "knn_speculate": SPECULATE}
    parsers = {"datastore": str, "corpus": str, "speculation_stride": auto_or_int,
               "speculative": parse_speculative, "knn_speculate": str}  # (default "auto": not a stride)
    metavars = {"datastore": "DIR", "corpus": "JSONL", "speculative": "true|false|auto",
                "speculation_stride": "N|auto"}
    field_help = {
        "datastore": "the KNN-LM datastore directory (python -m lookahead_jax.knnlm build; default: "
                     "the one built for --model and --corpus)",
        "knn_k": "neighbours per step (default 32)",
        "knn_lambda": "weight of the neighbours' distribution (default 0.25)",
        "knn_temperature": "p_kNN = softmax(-distance / T) (default 1)",
        "knn_search": "exact (device, exact top-k), hnsw (faiss, approximate) or flat (faiss brute force)",
        "speculative": "speculative KNN-LM: the same tokens, searches speculated from a cache and "
                       "verified in batches; auto: only where a search and a forward measured at the start "
                       "say it pays, else plain KNN-LM (default false)",
        "knn_cache_next": "entries after each retrieved neighbour kept in the speculation cache (default 8)",
        "knn_speculate": "what speculation ranks: cache (RaLMSpec's cache of the entries after earlier "
                         "neighbours), ivf (the cache plus an approximate IVF index's candidates) or auto "
                         "(default: ivf from 500K entries where faiss is installed, else cache)",
        "knn_nprobe": "IVF lists searched per speculative query (default 32)",
    }

    def __post_init__(self):
        object.__setattr__(self, "speculation_stride", auto_or_int(self.speculation_stride))
        if isinstance(self.speculative, str):
            object.__setattr__(self, "speculative", parse_speculative(self.speculative, strict=False))

    takes_references = False

    def unused_options(self, greedy: bool) -> dict:
        """{field: why} for fields this configuration does not use (the CLI warns when given)."""
        if not self.speculative:
            return {f: "without --speculative" for f in ("speculation_stride", "knn_speculate", "knn_nprobe")}
        return {} if self.knn_speculate != "cache" else {"knn_nprobe": "with knn_speculate=cache"}

    def validate(self) -> None:
        from ..retrieval.corpus import Corpus
        from ..knnlm.datastore import Datastore

        if not (self.datastore is None or isinstance(self.datastore, (str, Path, Datastore))):
            raise ValueError(f"datastore must be a directory or a Datastore, got {type(self.datastore).__name__}")
        if not (self.corpus is None or isinstance(self.corpus, (str, Path, Corpus))):
            raise ValueError(f"corpus must be a JSON Lines path or a Corpus, got {type(self.corpus).__name__}")
        number_in("knn_k", self.knn_k, 1, 4096)
        number_in("knn_lambda", self.knn_lambda, 0.0, 1.0, integer=False)
        if not (isinstance(self.knn_temperature, (int, float)) and self.knn_temperature > 0):
            raise ValueError(f"knn_temperature must be a number > 0, got {self.knn_temperature!r}")
        if self.knn_search not in SEARCHES:
            raise ValueError(f"knn_search must be one of {', '.join(SEARCHES)}, got {self.knn_search!r}")
        if not (isinstance(self.speculative, bool) or self.speculative == "auto"):
            raise ValueError(f"speculative must be True, False or 'auto', got {self.speculative!r}")
        check_speculation_stride(self.speculation_stride)
        number_in("knn_cache_next", self.knn_cache_next, 1, 1024)
        if self.knn_speculate not in SPECULATE:
            raise ValueError(f"knn_speculate must be one of {', '.join(SPECULATE)}, got {self.knn_speculate!r}")
        number_in("knn_nprobe", self.knn_nprobe, 1, 1 << 16)

    # ---- the strategy protocol (generate.py): no drafter, plain verification
    def drafter(self, engine):
        return None

    def max_nodes(self, drafter=None) -> int:
        return 0

    def setup(self, engine, state, drafter=None, references=None):
        from ..core.acceptance import TokenMatch
        from ..core.budget import FixedBudget

        return None, TokenMatch(state.sampling), FixedBudget(0)

    def start(self, tokenizer, n_rows: int, engine=None):
        """The run over n_rows rows (`strategies.base.Run`): loads the datastore (errors
        before any forward), then drives the loop."""
        if engine is None:
            raise ValueError("strategy 'knnlm' needs the engine (generate and Slots pass it)")
        return (KnnSpecRun if self.speculative else KnnRun)(self, tokenizer, n_rows, engine)
