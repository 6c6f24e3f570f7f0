"""The command line: `python -m lookahead_jax.generate` (also the `lookahead-generate` script).

Strategy flags come from the strategies' own dataclass fields (`strategies.py`): a field
`decoding_length` is `--decoding-length`, unless the strategy renames it (`mode` ->
`--lookahead-mode`); "auto"-or-integer fields parse both.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import logging
import os
import sys
from typing import Optional

import jax

from .core.engine import engine_for
from .core.multihost import STALL_TIMEOUT_S, check_flags, check_same_config, exit_on_failure, init_distributed
from .core.compile import enable_compilation_cache  # noqa: F401 (the CLI's entry points call it)
from .core.params import GenerationParams, ParamError, parse_logit_bias
from .generate import generate
from .argparsing import Parser, add_distributed_flags, parse_mesh
from .interrupt import EXIT_INTERRUPTED, CtrlC, exit_now
from .prompts import check_messages
from .strategies import REGISTRY, SpecInfer
from .strategies.speculation import merge_counters

log = logging.getLogger("lookahead_jax")


@dataclasses.dataclass(frozen=True)
class CliConfig:
    model: str
    prompts: tuple  # str or chat-message lists
    references: tuple  # per prompt: tuple of texts
    chat: bool
    strategy: str
    params: GenerationParams  # the request's options (length, stops, sampling, penalties, n, logprobs)
    dtype: str
    json: bool
    batch_size: int
    options: tuple = ()  # (field, value) of the strategy's own options given on the command line
    verbose: bool = False
    mesh: Optional[tuple] = None  # (("data", n), ("model", m)) given with --mesh
    max_cache_len: Optional[int] = None
    sources: tuple = ()  # per prompt, where it came from for error messages: "--prompt" or "FILE:LINE"
    references_field: Optional[str] = None
    raw: bool = False  # --no-chat: plain prompts are raw text on purpose (no instruct-model warning)
    prefix_cache_mb: float = 0.0  # MiB of generate's prefix cache (0: off)
    distributed: tuple = (None, None, None, False)  # coordinator address, processes, process id, auto
    stall_timeout_s: float = STALL_TIMEOUT_S  # (in the config hash: every process must give the same)

    def strategy_object(self):
        """The strategy with the options given on the command line."""
        return REGISTRY[self.strategy](**dict(self.options))


def _fail(msg: str):
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _undecodable(data: bytes, where: str) -> Optional[str]:
    """An error naming `where` and its first byte that is not UTF-8, or None if `data` decodes."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        lines = data.count(b"\n", 0, e.start) + 1
        line = f", line {lines}" if b"\n" in data else ""
        return f"{where} is not UTF-8 text: byte 0x{data[e.start]:02x} at byte offset {e.start}{line}"
    return None


def _read_prompts_file(path: str, references_field: Optional[str]):
    prompts, refs, sources = [], [], []
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        _fail(f"cannot read --prompts-file {path}: {e.strerror}")
    error = _undecodable(data, f"--prompts-file {path}")
    if error:
        _fail(f"{error} (save it as UTF-8)")
    with io.StringIO(data.decode("utf-8")) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                _fail(f"{path}:{n}: not valid JSON ({e.msg})")
            if not isinstance(obj, dict):
                _fail(f"{path}:{n}: each line must be a JSON object with 'prompt' or 'messages'")
            if "messages" in obj:
                try:
                    check_messages(obj["messages"], f"{path}:{n}")
                except ValueError as e:
                    _fail(str(e))
                prompts.append(obj["messages"])
            elif "prompt" in obj:
                prompts.append(obj["prompt"])
            else:
                _fail(f"{path}:{n}: each line needs a 'prompt' or 'messages' field")
            sources.append(f"{path}:{n}")
            if references_field:
                if references_field not in obj:
                    _fail(f"{path}:{n}: no field {references_field!r} (--references-field)")
                r = obj[references_field]
                refs.append(tuple([r] if isinstance(r, str) else r))
            else:
                refs.append(())
    if not prompts:
        _fail(f"--prompts-file {path} holds no prompts")
    return prompts, refs, sources


def _strategy_flags(ap) -> dict:
    """One flag per strategy field name: {flag: [(strategy class, field, parse), ...]}.
    Strategies with a field of the same name (RaLMSpec inherits RaLM's) share its flag;
    the value goes to the strategy chosen with --strategy."""
    flags, docs = {}, {}
    for cls in REGISTRY.values():
        for field in dataclasses.fields(cls):
            flag = cls.cli_names.get(field.name, field.name.replace("_", "-"))
            if field.name in getattr(cls, "parsers", {}):
                parse = cls.parsers[field.name]
            elif isinstance(field.default, str) and field.default == "auto":
                parse = _auto_or_int
            elif isinstance(field.default, bool):
                parse = lambda v: v.lower() in ("1", "true", "yes")  # noqa: E731
            else:
                parse = type(field.default)
            flags.setdefault(flag, []).append((cls, field, parse))
            docs.setdefault(flag, getattr(cls, "field_help", {}).get(
                field.name, f"{field.name} (default {field.default!r})"))
    for flag, entries in flags.items():
        cls, field, _ = entries[0]
        names = ", ".join(c.name for c, _, _ in entries)
        if "default" not in docs[flag].lower():
            docs[flag] += _field_defaults(entries)
        # a switch (--speculative) for a boolean field; --speculative false also parses
        switch = dict(nargs="?", const="true") if isinstance(field.default, bool) else {}
        ap.add_argument(f"--{flag}", default=None, help=f"{names}: {docs[flag]}",
                        choices=getattr(cls, "choices", {}).get(field.name),
                        metavar=getattr(cls, "metavars", {}).get(field.name), **switch)
    return flags


def _field_defaults(entries) -> str:
    """" (default: X)" for a strategy flag whose help does not say it: the strategies'
    field defaults, per strategy where they differ (--speculation-stride: ralmspec auto,
    knnlm 4); "" where none has one (None: a required option, e.g. --draft-model)."""
    def show(v):
        return str(v).lower() if isinstance(v, bool) else str(v)

    found = [(cls.name, show(field.default)) for cls, field, _ in entries if field.default is not None]
    if not found:
        return ""
    if len({v for _, v in found}) == 1:
        return f" (default: {found[0][1]})"
    return " (default: " + ", ".join(f"{name} {v}" for name, v in found) + ")"


def _auto_or_int(v: str):
    if v == "auto":
        return v
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"must be an integer or 'auto', got {v!r}") from None


def _token_ids(v: str) -> list:
    """'1,2' -> [1, 2]."""
    try:
        ids = [int(x) for x in v.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be token ids separated by commas, like 2,13, got {v!r}") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"must be token ids >= 0 separated by commas, like 2,13, got {v!r}")
    return ids


def parse_args(argv=None, prog: Optional[str] = None) -> CliConfig:
    """`prog`: the command's name in usage lines (default `python -m lookahead_jax.generate`)."""
    ap, flags = build_parser(prog)
    a = ap.parse_args(argv)
    return _config(ap, flags, a)


def build_parser(prog: Optional[str] = None):
    """(the command's `argparsing.Parser`, its strategy flags: `_strategy_flags`)."""
    from .presets import DEFAULT_MODEL

    ap = Parser(
        prog=prog or "python -m lookahead_jax.generate",
        description="Generate text with a JAX decoder; --strategy lookahead gives the same "
        "tokens as greedy, faster.",
    )
    ap.add_argument("--model", default=DEFAULT_MODEL, help="preset name, local path (.gguf, HF dir, saved checkpoint) or HF hub id")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="a single prompt")
    src.add_argument("--prompts-file", help="JSONL file: objects with 'prompt' (text) or 'messages' (chat)")
    ap.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                    help="apply the model's chat template to plain prompts; --no-chat: send them as raw text "
                    "on purpose, for completion (code to complete, text to continue), without the warning an "
                    "instruct model gets (default: raw text, with that warning)")
    ap.add_argument("--strategy", default="greedy", choices=tuple(REGISTRY),
                    help="; ".join(f"{n}: {c.help}" for n, c in REGISTRY.items()))
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per answer at most")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0, help="sample from the k most likely ids only (0 = all)")
    ap.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of ids whose "
                    "probability reaches p (1 = all)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (each token's key: seed, row, position)")
    ap.add_argument("--n", "--num-return-sequences", dest="n", type=int, default=1, metavar="N",
                    help="samples per prompt (needs --temperature > 0); with --json each row has "
                    "its sample_index. Several samples are printed when done, not streamed")
    ap.add_argument("--stop-token-ids", type=_token_ids, action="append", default=[], metavar="ID,ID",
                    help="token ids that end a row as EOS does (comma-separated, repeatable)")
    ap.add_argument("--min-new-tokens", type=int, default=0, metavar="N",
                    help="EOS and --stop-token-ids cannot end an answer before N tokens (exact under every strategy)")
    ap.add_argument("--repetition-penalty", type=float, default=1.0, metavar="P",
                    help="> 0, 1 = off (HF): logits of ids already in the prompt or the answer are divided "
                    "by P where positive, multiplied where negative (exact under every strategy)")
    ap.add_argument("--presence-penalty", type=float, default=0.0, metavar="X",
                    help="in [-2, 2], 0 = off (OpenAI/vLLM): X is subtracted from the logit of every id the "
                    "answer already holds")
    ap.add_argument("--frequency-penalty", type=float, default=0.0, metavar="X",
                    help="in [-2, 2], 0 = off (OpenAI/vLLM): X times its count in the answer so far is "
                    "subtracted from each id's logit")
    ap.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                    help="add BIAS (in [-100, 100]) to token ID's logit at every step, as OpenAI's logit_bias "
                    "(repeatable; 100 forces the id, -100 bans it; exact under every strategy)")
    ap.add_argument("--logprobs", action="store_true",
                    help="with --json: each row carries the model's log-probability of every generated token")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16")
    ap.add_argument("--json", action="store_true", help="print one JSON object per answer (per sample with --n), then a summary line")
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ap.add_argument("--batch-size", type=int, default=1, help="prompts decoded together; at 1 (the default) text streams as it is "
                    "generated, larger batches do not stream: each answer is printed when its batch "
                    "is done")
    ap.add_argument("--max-cache-len", type=int, help="KV cache slots (default: the longest prompt + "
                    "--max-new-tokens + the verify block, rounded up)")
    ap.add_argument("--prefix-cache-mb", type=float, default=0.0, metavar="MB",
                    help="MiB of prompt-block K/V kept for prompts that begin alike (a few-shot header, a system "
                    "prompt): prompts are prefilled in 64-token blocks, one shared by the rows of a batch and by "
                    "later batches is forwarded once, with the same tokens (default 0: off, whole prompts)")
    ap.add_argument("--mesh", help="device mesh, e.g. data=2,model=4: params split over 'model' by the "
                    "rule table, batch rows and the KV cache over 'data' (default: one device)")
    add_distributed_flags(ap)
    flags = _strategy_flags(ap)
    ap.add_argument("--references-field", help="lookahead: JSONL field whose text(s) it drafts from too")
    ap.add_argument("-v", "--verbose", action="store_true", help="log compilations and loading")
    return ap, flags


def _config(ap, flags: dict, a) -> CliConfig:
    """The checked `CliConfig` of the parsed arguments `a` (`ap.error` on bad ones)."""
    if a.dtype not in ("float32", "bfloat16"):
        ap.error(f"--dtype must be float32 or bfloat16, got {a.dtype!r}")
    if a.batch_size < 1:
        ap.error("--batch-size must be >= 1")
    if a.max_cache_len is not None and a.max_cache_len < 2:
        ap.error("--max-cache-len must be >= 2")
    if not a.prefix_cache_mb >= 0:
        ap.error(f"--prefix-cache-mb must be >= 0 (0: off), got {a.prefix_cache_mb}")
    try:  # the request's options, checked where every front end's are
        params = GenerationParams(
            max_new_tokens=a.max_new_tokens, min_new_tokens=a.min_new_tokens, temperature=a.temperature,
            top_k=a.top_k, top_p=a.top_p, seed=a.seed, stop=tuple(a.stop),
            stop_token_ids=tuple(t for ids in a.stop_token_ids for t in ids), n=a.n, logprobs=a.logprobs,
            repetition_penalty=a.repetition_penalty, presence_penalty=a.presence_penalty,
            frequency_penalty=a.frequency_penalty, logit_bias=parse_logit_bias(a.logit_bias))
    except ParamError as e:
        ap.error(f"--{e.field.replace('_', '-')} {e.detail}")
    if a.logprobs and not a.json:
        ap.error("--logprobs needs --json (they are printed in each answer's JSON row)")
    mesh = parse_mesh(ap, a.mesh) or None
    distributed = (a.coordinator_address, a.num_processes, a.process_id, a.distributed_auto)
    error = check_flags(*distributed[:3], a.stall_timeout)
    if error:
        ap.error(error)
    options = []
    for flag, entries in flags.items():
        value = getattr(a, flag.replace("-", "_"))
        if value is None:
            continue
        mine = [(field, parse) for cls, field, parse in entries if cls.name == a.strategy]
        field, parse = mine[0] if mine else entries[0][1:]
        try:  # checked even when ignored: a typo is an error whatever the strategy
            value = parse(value)
        except ValueError as e:
            ap.error(f"--{flag} {e}")
        if not mine:
            owners = "|".join(cls.name for cls, _, _ in entries)
            print(f"warning: --{flag} is an option of --strategy {owners}: ignored", file=sys.stderr)
            continue
        options.append((field.name, value))
    # argv bytes that are not UTF-8 arrive as lone surrogates (Python's surrogateescape)
    for flag, values in (("--prompt", [a.prompt] if a.prompt is not None else []), ("--stop", a.stop)):
        for v in values:
            error = _undecodable(os.fsencode(v), flag)
            if error:
                ap.error(f"{error} (pass UTF-8 text)")
    if a.prompt is not None:
        if not a.prompt.strip():
            ap.error("--prompt is empty")
        prompts, refs, sources = [a.prompt], [()], ["--prompt"]
        if a.references_field:
            ap.error("--references-field needs --prompts-file")
    else:
        prompts, refs, sources = _read_prompts_file(a.prompts_file, a.references_field)
    return CliConfig(
        model=a.model, prompts=tuple(prompts), references=tuple(refs), chat=bool(a.chat),
        strategy=a.strategy, params=params, dtype=a.dtype, json=a.json,
        batch_size=a.batch_size, options=tuple(options), verbose=a.verbose,
        mesh=mesh, max_cache_len=a.max_cache_len, sources=tuple(sources), references_field=a.references_field,
        prefix_cache_mb=a.prefix_cache_mb, distributed=distributed, stall_timeout_s=a.stall_timeout,
        raw=a.chat is False,
    )


def is_instruct(model_name: str, tokenizer) -> bool:
    """A model tuned for chat: it has a chat template, and its name (or its preset's
    description) says Instruct / chat / it."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    from .presets import PRESETS

    text = model_name + " " + (PRESETS[model_name].description if model_name in PRESETS else "")
    import re

    return any(w in ("instruct", "chat", "it") for w in re.split(r"[^a-z0-9.]+", text.lower()))


def check_chat_templates(cfg: CliConfig, tokenizer) -> Optional[str]:
    """Render the chat template of every chat prompt before decoding anything: a template
    that rejects the messages (jinja's `raise_exception`, e.g. roles that do not alternate,
    or an undefined field) is an error naming the prompt's file line, not a traceback
    after earlier batches have run. Returns the error message, or None."""
    from jinja2 import TemplateError

    for p, where in zip(cfg.prompts, cfg.sources or [f"prompt {i}" for i in range(len(cfg.prompts))]):
        if isinstance(p, str):
            if not cfg.chat:
                continue
            p = [{"role": "user", "content": p}]
        try:
            tokenizer.apply_chat_template(p, add_generation_prompt=True)
        except TemplateError as e:
            return f"{where}: the model's chat template rejects these messages: {e}"
        except ValueError as e:  # no chat template
            return f"{where}: {e}"
    return None


def _row_json(r, n: int) -> dict:
    """A row as JSON; with n > 1 samples per prompt every row names its sample."""
    d = r.to_json()
    if n > 1:
        d = {"prompt_index": d.pop("prompt_index"), "sample_index": r.sample_index, **d}
    return d


def main(argv=None, prog: Optional[str] = None) -> int:
    """The command: 0 done, 2 bad input; Ctrl-C is exit status 130 and one line, keeping
    what was printed (streamed text, the finished rows' JSON), without a traceback: while
    decoding it stops at the next step boundary, a second Ctrl-C ends the process at once
    (`interrupt.CtrlC`)."""
    try:
        with CtrlC() as ctrl_c:
            return _run(argv, prog, ctrl_c)
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # one of several processes: end it, naming a lost peer (the others would hang)
        exit_on_failure(e)
        raise


def warn_unused_options(cfg: CliConfig, strategy) -> None:
    """One warning line per option given that the chosen strategy (or greedy decoding) does
    not use here (options of another strategy are warned about while parsing)."""
    if cfg.references_field and not strategy.takes_references:
        print(f"warning: --references-field is not used by --strategy {cfg.strategy} (references are drafted "
              "from: lookahead, specinfer with --lookahead-nodes, ralm/ralmspec with --lookahead): "
              "ignored", file=sys.stderr)
    p = cfg.params
    if p.greedy:  # greedy: the argmax, whatever the sampling filters keep
        for flag, given in (("--top-k", p.top_k != 0), ("--top-p", p.top_p != 1.0)):
            if given:
                print(f"warning: {flag} is not used at --temperature 0 (greedy decoding): ignored", file=sys.stderr)
    unused = strategy.unused_options(p.greedy)
    for field, _ in cfg.options:
        if field in unused:
            flag = type(strategy).cli_names.get(field, field.replace("_", "-"))
            print(f"warning: --{flag} is not used by --strategy {cfg.strategy} {unused[field]}: ignored",
                  file=sys.stderr)


def _run(argv, prog, ctrl_c: CtrlC) -> int:
    cfg = parse_args(argv, prog)
    # the root logger may be configured already by a dependency (basicConfig is then a
    # no-op and the root's WARNING level would drop -v's INFO records): set the level on
    # the library's own logger, whose records reach the root's handlers
    logging.basicConfig(format="%(message)s")
    logging.getLogger("lookahead_jax").setLevel(logging.INFO if cfg.verbose else logging.WARNING)
    from .loading import load

    try:  # before any other JAX call; then every process must have been given the same flags
        if init_distributed(*cfg.distributed[:3], auto=cfg.distributed[3], stall_timeout_s=cfg.stall_timeout_s):
            if not cfg.mesh:
                raise ValueError("several processes need --mesh (e.g. data=2,model=4 over 2 processes of 4 "
                                 "devices each): the mesh spans every process's devices")
            check_same_config(dataclasses.asdict(dataclasses.replace(cfg, distributed=())))
            if jax.process_index():  # process 0 prints the answers; the others compute the same
                sys.stdout = open(os.devnull, "w")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    try:  # the strategy's options are checked before the model loads (seconds)
        strategy = cfg.strategy_object()
        strategy.validate()
        if isinstance(strategy, SpecInfer):  # a draft model: its vocabulary against the target's
            strategy.check_target(cfg.model)
    except (TypeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    warn_unused_options(cfg, strategy)
    mesh = None
    try:
        if cfg.mesh:
            from .core.sharding import make_mesh

            mesh = make_mesh(**dict(cfg.mesh))
        model, tok = load(cfg.model, dtype=cfg.dtype, **({"mesh": mesh} if mesh else {}))
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    def stream(i, text):
        sys.stdout.write(text)
        sys.stdout.flush()

    if not cfg.chat and not cfg.raw and any(isinstance(p, str) for p in cfg.prompts) \
            and is_instruct(cfg.model, tok):
        print(f"warning: {cfg.model} is an instruct (chat) model and --chat is not set: plain prompts are "
              "sent as raw text, which such models often continue with junk. Pass --chat to wrap them "
              "in the model's chat template (--no-chat: raw text on purpose, e.g. code to complete).",
              file=sys.stderr)
    error = check_chat_templates(cfg, tok)
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    kw = dict(
        params=cfg.params, strategy=strategy, chat=cfg.chat,
        mesh=mesh, max_cache_len=cfg.max_cache_len or _shared_cache_len(cfg, tok, model, strategy),
        # a tree size compiles in the background while the steps do without it; over several
        # processes every process compiles it at once (the plan would wait for the slowest)
        fallback=jax.process_count() == 1,
        prefix_cache=int(cfg.prefix_cache_mb * (1 << 20)) or None,
    )
    totals = dict(new_tokens=0, wall_s=0.0, forward_steps=0, prefill_steps=0, compile_s=0.0, calibrate_s=0.0,
                  host_s=0.0, prefill_s=0.0)
    # tokens per step is per row (a batched forward of 4 greedy rows is 1.0, not 4) and
    # counts the decode steps: the prefill's forward and the first token it gives are apart
    # (knnlm's prefill gives none: its first token comes from a decode step)
    row_tokens = row_steps = 0
    ttft = None  # the first batch's time to its first token
    decode_tokens, decode_s = 0, 0.0  # tokens after each row's first, and the time after the first token
    cached = {}  # the prefix cache's counters over the batches
    retrieval = []  # per batch, the strategy's retrieval counters (knnlm, ralm, ralmspec)
    # one answer at a time streams; several samples of a prompt would interleave
    streaming = not cfg.json and cfg.batch_size == 1 and cfg.params.n == 1
    for start in range(0, len(cfg.prompts), cfg.batch_size):
        batch = list(cfg.prompts[start:start + cfg.batch_size])
        refs = [list(r) for r in cfg.references[start:start + cfg.batch_size]]
        if streaming and len(cfg.prompts) > 1:  # several streamed answers: one header each
            print(f"--- prompt {start}", flush=True)
        try:
            with ctrl_c.deferred():  # Ctrl-C takes effect between two steps
                out = generate(model, tok, batch, references=refs, on_text=stream if streaming else None,
                               first_index=start, on_step=ctrl_c.check, **kw)
        except (ValueError, *_retrieval_errors()) as e:  # bad input, a missing or stale index
            print(f"error: {e}", file=sys.stderr)
            return 2
        for r in out.rows:
            if cfg.json:
                print(json.dumps(_row_json(r, cfg.params.n), ensure_ascii=False), flush=True)
            elif streaming:
                print(flush=True)
            else:
                sample = f", sample {r.sample_index}" if cfg.params.n > 1 else ""
                print(f"--- prompt {r.prompt_index}{sample}\n{r.text}", flush=True)
        ctrl_c.check()  # a Ctrl-C after the batch's last step: its rows are out, stop here
        for k in totals:
            totals[k] += out.stats[k]
        for k in ("prefix_cache_queries", "prefix_cache_hits"):  # prompt tokens (with --prefix-cache-mb)
            if k in out.stats:
                cached[k] = cached.get(k, 0) + out.stats[k]
        if "retrieval" in out.stats:  # a retrieval strategy's counters (one shape: speculation.py)
            retrieval.append(out.stats["retrieval"])
        row_tokens += sum(r.new_tokens - r.prefill_tokens for r in out.rows)
        ttft = out.stats["ttft_s"] if ttft is None else ttft
        decode_tokens += sum(max(r.new_tokens - 1, 0) for r in out.rows)
        decode_s += out.stats["wall_s"] - out.stats["ttft_s"]
        row_steps += sum(r.decode_steps for r in out.rows)
    summary = dict(
        model=cfg.model, strategy=cfg.strategy, dtype=cfg.dtype, prompts=len(cfg.prompts),
        new_tokens=totals["new_tokens"], wall_s=round(totals["wall_s"], 4),
        tokens_per_s=round(totals["new_tokens"] / totals["wall_s"], 3) if totals["wall_s"] else 0.0,
        prefill_s=round(totals["prefill_s"], 4), ttft_s=round(ttft or 0.0, 4),
        decode_tokens_per_s=round(decode_tokens / decode_s, 3) if decode_tokens and decode_s > 0 else 0.0,
        forward_steps=totals["forward_steps"], decode_steps=totals["forward_steps"] - totals["prefill_steps"],
        tokens_per_step=round(row_tokens / row_steps, 3) if row_steps else 0.0,
        compile_s=round(totals["compile_s"], 3), calibrate_s=round(totals["calibrate_s"], 3),
        host_s=round(totals["host_s"], 4),
        compilations=len(engine_for(model, mesh).compiled.compilations),
    )
    summary.update(cached)
    if retrieval:
        summary["retrieval"] = merge_counters(retrieval)
    if cfg.json:
        print(json.dumps({"summary": summary}), flush=True)
    else:
        # decode time apart from the one-off costs a new process pays (compilation, and
        # auto's calibration of verify costs), which a user waits for all the same
        print(
            f"[{summary['new_tokens']} tokens in {summary['wall_s']:.2f} s = "
            f"{summary['tokens_per_s']:.1f} tok/s (first token {summary['ttft_s']:.2f} s, then "
            f"{summary['decode_tokens_per_s']:.1f} tok/s); {totals['prefill_steps']} prefill + "
            f"{summary['decode_steps']} decode steps, {summary['tokens_per_step']:.2f} tokens/step"
            + (" per row" if cfg.batch_size > 1 or cfg.params.n > 1 else "") + f"; compile {summary['compile_s']:.1f} s"
            + (f", calibration {summary['calibrate_s']:.1f} s" if summary["calibrate_s"] else "") + "]",
            file=sys.stderr,
        )
    return 0


def _retrieval_errors() -> tuple:
    """The retrieval package's errors a user fixes (an index not built or stale, an encoder
    not installed, a retrieval server not running): printed as errors, not tracebacks."""
    from .retrieval import EncoderUnavailable, IndexUnavailable, RemoteRetrievalError

    return IndexUnavailable, EncoderUnavailable, RemoteRetrievalError


def _shared_cache_len(cfg, tok, model, strategy) -> Optional[int]:
    """One KV cache size for every batch of a run (None: one batch, or a strategy whose
    run adds prompt tokens of its own, e.g. a retrieved passage): the smallest power of
    two that holds the longest prompt, the new tokens and any verify block. Each cache size
    compiles its own steps, so batches sized each to its own prompt (256 or 512 slots for the
    README's HumanEval file) compiled every step twice; one size shares them (on CPU a
    longer cache costs a verify step nothing measurable: `Engine.window`)."""
    from .core.buckets import CACHE_ROUND
    from .core.tree import MAX_NODES
    from .prompts import encode_prompts

    if len(cfg.prompts) <= cfg.batch_size or getattr(strategy, "runs_own_loop", False):
        return None
    try:
        longest = max(len(x) for x in encode_prompts(tok, list(cfg.prompts), cfg.chat))
    except ValueError:  # a bad prompt: its batch's generate reports it, naming the prompt
        return None
    need = longest + cfg.params.max_new_tokens + MAX_NODES + 1
    limit = max(model.config.max_position, need)
    return min(max(CACHE_ROUND, 1 << (need - 1).bit_length()), limit)


def console_main() -> int:
    """The `lookahead-generate` console script ([project.scripts]): the same setup as
    `python -m lookahead_jax.generate` (compilation cache on, then `main`), with usage lines
    that name the command as it was invoked."""
    import os

    name = os.path.basename(sys.argv[0]) if sys.argv else ""
    enable_compilation_cache()
    code = main(prog=name if name and not name.startswith("-") else "lookahead-generate")
    if code == EXIT_INTERRUPTED:  # no teardown: background compilations could crash it
        exit_now(code, message="")
    return code
