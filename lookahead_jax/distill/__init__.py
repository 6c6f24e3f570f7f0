"""Distil a small draft model from a target: `python -m lookahead_jax.distill`.

    python -m lookahead_jax.distill                        # SmolLM2-135M -> 2-layer draft
    python -m lookahead_jax.distill --layers 4 --minutes 60 --out ~/drafts/smol-l4
    model, tok = lookahead_jax.load(out_dir)               # the draft, the target's tokenizer

A draft only has to propose the tokens the target would pick (the target verifies them),
so it is trained for top-1 agreement with the target, on the target's own outputs:

* Architecture: the target's `ModelConfig` with `--layers` layers (default 2). The
  embedding (and the tied output layer it doubles as, or an untied `lm_head`) is the
  target's, frozen unless `--train-embed`; the layers and the final norm start from the
  target's (`--init spaced`, the default: evenly spaced, first and last included;
  `first`: layers 0..L-1. Neither agrees with the target untrained (SmolLM2, 2 layers:
  6% / 0% top-1); after 30 steps on 32 prompts both reach 14%, spaced with the lower
  KL, 5.0 against 5.9). Same
  tokenizer and vocabulary, so draft tokens are target tokens.
* Data: prompts from several datasets (`--data`, default ../shared/data: NQ passage +
  question and GSM8K as chat, HumanEval as plain text, Wikipedia summaries as chat). The
  target continues each one greedily (`--gen-tokens`, to EOS) on the engine's own prefill
  and decode steps (`teacher.py`: `generate`'s tokens), which also keep its top-`--topk`
  log-probabilities at every position: the greedy outputs and the teacher-forced logits
  over prompt + continuation come from one pass.
  Each prompt's result is cached on disk (`--data-dir`), so reruns and resumes skip it;
  with `--minutes`, new teacher work stops at DATA_SHARE of the budget.
  Evaluation prompts come from the first `EVAL_POOL` records of each file (where the
  benchmarks take theirs), training prompts from the rest: the two never overlap.
* Loss: KL(target || draft) at temperature 1 over the target's top-k tokens plus one
  bucket for the rest of the vocabulary (exact on the top-k, a lower bound of the full
  KL), plus `--ce-weight` x cross-entropy on the target's greedy token. Positions are the
  continuation (where a draft proposes), plus the prompt at `--prompt-weight`.
  Sequences are packed into rows of `--seq-len` tokens (block-diagonal causal masks,
  positions restart per sequence). optax AdamW, linear warmup + cosine decay, grad-norm
  clipping at 1.
* Metric: top-1 agreement (draft argmax == the target's greedy next token) on the
  continuations of the held-out prompts, every `--eval-every` steps and at the end (top-5
  too: the target's token is among the draft's 5 best, what a token tree can use).
* Output: `--out` (default `<cache root>/drafts/<target>-L<layers>`) is a directory that
  `lookahead_jax.load` reads (`save_pretrained` format: orbax params + model config +
  the target's tokenizer), plus `train_state/<step>/` (orbax: trainable params and
  optimizer state), `distill.json` (the run's settings, step, loss and agreement
  history). Rerunning with the same `--out` resumes at the saved step; Ctrl-C saves
  first. `--minutes` bounds the wall time of one invocation (data included): training
  stops early when the next steps and the final evaluation would not fit.

Modules: `config.py` (DistillConfig), `data.py` (prompts, the teacher's cached examples,
packing), `teacher.py`, `train.py` (the draft, loss, optimizer, evaluation, saved state),
`run.py` (`distill`: the resumable run), `cli.py` (the command line).
"""

from .config import DistillConfig
from .data import (SOURCES, batch_stream, build_examples, default_data_dir, epoch_batches, loss_positions,
                   loss_slots, make_batch, model_fingerprint, pack_rows, source_prompts, split_prompts)
from .run import default_out, distill
from .teacher import teacher_chunk
from .train import (distill_loss, draft_config, evaluate, export_model, init_draft, init_layers,
                    make_optimizer, restore_state, save_state, split_trainable)

__all__ = [
    "DistillConfig", "SOURCES", "batch_stream", "build_examples", "default_data_dir", "default_out",
    "distill", "distill_loss", "draft_config", "epoch_batches", "evaluate", "export_model", "init_draft",
    "init_layers", "loss_positions", "loss_slots", "make_batch", "make_optimizer", "model_fingerprint",
    "pack_rows", "restore_state", "save_state", "source_prompts", "split_prompts", "split_trainable",
    "teacher_chunk",
]
