"""The settings of a distillation run (`DistillConfig`) and the formats of what it saves."""

from __future__ import annotations

import dataclasses
from typing import Optional

DATA_FORMAT = "lookahead-jax-distill-data/1"
STATE_FORMAT = "lookahead-jax-distill/1"
DATA_SHARE = 0.45  # of --minutes: teacher data stops there (the rest is training)


@dataclasses.dataclass
class DistillConfig:
    """Everything that shapes a run. Fields marked (resume) must match a saved run."""

    layers: int = 2  # (resume)
    init: str = "spaced"  # (resume) "first" | "spaced"
    train_embed: bool = False  # (resume)
    steps: int = 100  # cosine horizon; a rerun with more steps extends the run
    batch_size: int = 8  # (resume) packed rows per step
    seq_len: int = 288  # (resume) tokens per packed row (and the longest prompt + continuation)
    lr: float = 1.5e-3
    warmup: int = 10
    weight_decay: float = 0.01
    ce_weight: float = 0.25  # cross-entropy on the target's greedy token, beside the KL
    prompt_weight: float = 0.0  # loss weight of prompt positions (continuation: 1)
    topk: int = 32  # (resume) teacher log-probs kept per position
    gen_tokens: int = 128  # (resume) greedy continuation length (stops at EOS)
    gen_batch: int = 16  # prompts per teacher chunk
    seed: int = 0  # (resume)
    minutes: Optional[float] = None  # wall-clock budget of one invocation
    eval_every: int = 25
    save_every: int = 25

    RESUME_KEYS = ("layers", "init", "train_embed", "batch_size", "seq_len", "topk", "gen_tokens",
                   "seed")
