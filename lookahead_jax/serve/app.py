"""The HTTP layer (FastAPI): OpenAI's /v1/completions and /v1/chat/completions (SSE
streaming and not), /v1/models (and /v1/models/{id}), /health, /tokenize, /detokenize,
/tokenizer_info, /metrics.

A request becomes one `scheduler.Job` per prompt and sample (choice index prompt * n +
sample, sampling row the same, as `generate(prompts, n=n)` numbers its rows), whose
outputs come back from the engine thread through an asyncio queue. Errors are OpenAI's
shape (`errors`): 400 for a body that does not validate or a request the slots cannot
hold, 404 for another model's name or an unknown route, 429 when the waiting queue is
full, 503 while shutting down, 500 when the engine failed this request (the server goes
on). A client that disconnects cancels its jobs (their slots are freed before the next
step) and leaves one INFO line in the log.

The context length `/v1/models` advertises (`Server.max_model_len`) is the one a request
may use: prompt + max_tokens up to it is accepted, one token more is a 400 (`--max-len`
less the verify block and a retrieval strategy's passage).

With the prefix cache on, a chat request of one choice that ends (eos, stop, length) queues
a warm job for its next turn (`Server.warm_chat`: the conversation with the answer, as the
next turn's prompt begins; `Scheduler.warm`), rendered off the event loop.

On a retrieval server (ralm, ralmspec, knnlm: a run drives the slots) each job carries its
prompt's question span (the last user message of a chat, the text of a plain prompt, as
`generate` finds them), and a request may ask for each choice's retrieval record.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import secrets
import time
import uuid
import weakref

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..core.params import GenerationParams, ParamError
from ..prompts import encode_prompts
from ..strategies import Greedy
from . import errors
from .chat import CannotRender, next_turn_ids, template_tokenizer
from .errors import APIError
from .protocol import FINISH, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, error_body
from .scheduler import Job, QueueFull, ShuttingDown

log = logging.getLogger("lookahead_jax.serve")


class ClientGone(Exception):
    """The client of a request closed its connection (its jobs are cancelled)."""


class Server:
    """What the routes need: the scheduler (engine thread), tokenizer, the served model's
    name, and the metrics."""

    def __init__(self, scheduler, tokenizer, model_name: str, metrics=None, vocab: int = 0, max_position: int = 0,
                 warmup: str = "none"):
        self.scheduler, self.tokenizer, self.model_name, self.metrics = scheduler, tokenizer, model_name, metrics
        self.vocab, self.max_position = vocab, max_position
        # "none", or the warm-up the app's lifespan starts before the engine thread
        # (`Scheduler.warm_up_in_background`: requests wait for the minimum set)
        self.warmup = warmup
        strat = scheduler.strategy
        self.strategy_name = getattr(strat, "name", "greedy")
        self.drafting = scheduler.slots.drafter is not None
        run = scheduler.slots.run  # a retrieval strategy's: its slots take only its own requests
        self.retrieving = run is not None
        self.spans = bool(getattr(strat, "uses_question_spans", False))
        self.extra = run.extra_tokens if run is not None else 0  # prompt tokens it may add (a passage)
        self.corpus = getattr(run, "corpus", None)  # ralm / ralmspec: the passages' titles

    @property
    def max_model_len(self) -> int:
        """The most prompt + completion tokens a request may ask for: the cache's slots
        (`--max-len`, at most the model's positions) less the verify block and a
        retrieval strategy's passage (what `/v1/models` advertises)."""
        sched = self.scheduler
        reserve = sched.max_nodes + 1  # the verify block
        return min(sched.max_len - reserve, self.max_position or sched.max_len) - self.extra

    def chat_tokenizer(self, messages: list, tools=None):
        """The tokenizer to encode chat `messages` with (`chat.template_tokenizer`: a 400
        when the model's chat template cannot render their tool calls, results or tools)."""
        try:
            return template_tokenizer(self.tokenizer, messages, tools)
        except CannotRender as e:
            raise APIError(400, str(e), e.param) from None

    # ------------------------------------------------------------------ request -> jobs
    def jobs(self, req, chat: bool, sink) -> list:
        sched = self.scheduler
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"The model `{req.model}` does not exist: this server serves "
                                f"`{self.model_name}`", "model")
        tok = self.chat_tokenizer(req.template_messages, req.template_tools) if chat else self.tokenizer
        try:
            enc = encode_prompts(tok, req.prompts[0] if chat else req.prompts, chat, spans=self.spans)
        except ValueError as e:
            raise APIError(400, str(e), "messages" if chat else "prompt") from None
        ids_list, spans = enc if self.spans else (enc, [None] * len(enc))
        for ids in ids_list:
            if self.vocab and (min(ids) < 0 or max(ids) >= self.vocab):
                raise APIError(400, f"prompt token ids must be in [0, {self.vocab})", "prompt")
        ext = req.lookahead_jax
        plain = None
        if ext.strategy not in (None, self.strategy_name):
            if ext.strategy != "greedy":
                raise APIError(400, f"lookahead_jax.strategy: this server runs {self.strategy_name!r}; a "
                                    f"request may pick it or 'greedy' (plain decoding), got {ext.strategy!r}",
                               "lookahead_jax.strategy")
            if self.retrieving:
                raise APIError(400, f"lookahead_jax.strategy: this server runs {self.strategy_name!r}, which "
                                    "retrieves between decode steps; its slots take only its own requests, so "
                                    "plain decoding ('greedy') needs a server of its own (--strategy greedy): "
                                    "leave lookahead_jax.strategy unset", "lookahead_jax.strategy")
            plain = Greedy()
        if getattr(req, "echo", False) and self.retrieving:
            raise APIError(400, f"echo: this server runs {self.strategy_name!r}, which puts a retrieved passage into "
                                "the prompt: echo is not served on it", "echo")
        if ext.return_retrieval and not self.retrieving:
            raise APIError(400, f"lookahead_jax.return_retrieval: this server runs {self.strategy_name!r}, which "
                                "retrieves nothing (serve ralm, ralmspec or knnlm)", "lookahead_jax.return_retrieval")
        refs = [self.tokenizer.encode(t, add_special_tokens=False) for t in req.references] \
            if self.drafting and plain is None else []  # (a chat's `prediction` among them)
        seed = req.seed if req.seed is not None else secrets.randbits(32)
        limit = req.token_limit
        params = self.params(req, max(req.min_tokens, 1) if limit is None else limit, seed)
        if params.adjusts_logits and plain is None and sched.strategy is not None \
                and not sched.strategy.supports_penalties:
            raise APIError(400, f"strategy {self.strategy_name!r} does not apply repetition / presence / "
                                "frequency penalties or logit_bias: leave them at their defaults or ask for "
                                '"lookahead_jax": {"strategy": "greedy"}')
        if params.logprobs and not sched.logprobs:
            raise APIError(400, "this server was started with --no-logprobs", "logprobs")
        if params.top_logprobs and self.retrieving:
            name = req.field_name("top_logprobs")
            raise APIError(400, f"{name}: this server runs {self.strategy_name!r}, whose own steps pick the tokens: "
                                f"the most likely alternatives are not served on it ({name} 0 gives the tokens' "
                                "log-probabilities)", name)
        if params.min_new_tokens and not set(params.eos_ids(sched.eos_ids)) <= set(sched.eos_ids):
            raise APIError(400, "min_tokens with stop_token_ids other than the model's EOS ids (or ignore_eos) is "
                                "not supported", "min_tokens")
        less = f"{sched.max_nodes + 1} for verification" + \
            (f" and {self.extra} for the retrieved passage" if self.extra else "")
        jobs = []
        for i, ids in enumerate(ids_list):
            room = self.max_model_len - len(ids)
            max_new = limit if limit is not None else room
            if max_new > room or room < (1 if max_new else 0):
                raise APIError(400, f"This model's maximum context length is {self.max_model_len} "
                                    f"tokens (--max-len {sched.max_len} less {less}). However, you "
                                    f"requested {len(ids) + (limit or 1)} tokens ({len(ids)} in the prompt, "
                                    f"{limit or 1} for the completion). Please reduce the prompt or the "
                                    "completion length.", req.field_name("max_new_tokens") if limit and room >= 1
                               else "prompt")
            mine = params if max_new == params.max_new_tokens else self.params(req, max_new, seed)
            for j in range(req.n):
                k = i * req.n + j
                jobs.append(Job(ids, mine, sink, index=k, sampling_row=k, references=refs, strategy=plain,
                                question_span=spans[i]))
        return jobs

    def params(self, req, max_new_tokens: int, seed: int) -> GenerationParams:
        """The request's checked options (`protocol.SamplingFields.params`), or a 400
        naming the field as the request spells it; stop_token_ids must be this model's ids."""
        try:
            params = req.params(max_new_tokens, seed)
            if self.vocab:
                params.check_vocab(self.vocab)
        except ParamError as e:
            name = req.field_name(e.field)
            raise APIError(400, f"{name} {e.detail}", name) from None
        return params

    def submit(self, jobs) -> None:
        try:
            self.scheduler.submit(jobs)
        except QueueFull as e:
            raise APIError(429, str(e)) from None
        except ShuttingDown as e:
            raise APIError(503, str(e)) from None

    def warm_chat(self, req, answer: str) -> bool:
        """Queue a prefix-cache warm job for the next turn of the chat `req` answered with
        `answer` (`chat.next_turn_ids`): its blocks are then cached, exactly, before the next
        turn arrives. False (nothing queued): no prefix cache, or it cannot be rendered."""
        if not self.scheduler.warms:
            return False
        try:
            tok = template_tokenizer(self.tokenizer, req.template_messages, req.template_tools)
            ids = next_turn_ids(tok, req.template_messages, answer)
            return self.scheduler.warm(ids)
        except Exception:  # noqa: BLE001 - only a cache warm-up is lost; the log says why
            log.warning("prefix-cache warm job not queued", exc_info=True)
            return False

    # ------------------------------------------------------------------ responses
    def retrieval_record(self, rec):
        """A choice's `retrieval` (`lookahead_jax.return_retrieval`): the run's record of the
        request, each passage with its title (ralm / ralmspec: {"passages": [{"id", "title",
        "position", "from_token"}], "reprefills", ralmspec's speculation counters}; knnlm:
        {"searches", speculative knnlm's counters})."""
        if rec is None:
            return None
        rec = dict(rec)
        if "passages" in rec and self.corpus is not None:
            rec["passages"] = [dict(id=p["id"], title=self.corpus[p["position"]].title, position=p["position"],
                                    from_token=p["from_token"]) for p in rec["passages"]]
        return rec

    def token_text(self, t: int) -> str:
        return self.tokenizer.decode([t])

    def logprobs_block(self, chat: bool, tokens: list, lps: list, top: bool, offset: int = 0, tops=None):
        """A choice's `logprobs` (chat's or completions' shape) of `tokens` and their `lps`;
        top: with the alternatives, `tops` per token its (id, log-probability) pairs (None
        there: the token alone; a prompt's first id: None)."""
        strs = [self.token_text(t) for t in tokens]
        tops = tops if tops is not None else [None] * len(strs)
        if chat:
            return {"content": [dict(token=s, logprob=lp, bytes=list(s.encode()), top_logprobs=[
                dict(token=(a := self.token_text(i)), logprob=v, bytes=list(a.encode())) for i, v in alts or ()]
                if top else []) for s, lp, alts in zip(strs, lps, tops)]}
        offsets = list(itertools.accumulate([len(s) for s in strs[:-1]], initial=offset)) if strs else []
        return dict(tokens=strs, token_logprobs=lps, text_offset=offsets, top_logprobs=[
            None if alts is None else {self.token_text(i): v for i, v in alts}
            for alts in tops] if top else None)


def _sink(loop, queue):
    def put(out):
        with contextlib.suppress(RuntimeError):  # the loop has closed (shutdown)
            loop.call_soon_threadsafe(queue.put_nowait, out)
    return put


async def _next(queue, raw: HTTPRequest, jobs, sched):
    """The next output; cancels the jobs and raises ClientGone when the client has gone."""
    while True:
        try:
            return await asyncio.wait_for(queue.get(), 1.0)
        except asyncio.TimeoutError:
            if await raw.is_disconnected():
                sched.cancel(jobs)
                raise ClientGone() from None


def _gone(rid: str, t0: float, jobs) -> None:
    """The one log line of a request whose client went away."""
    log.info("%s: the client went away after %.1f s; its %d sequence(s) cancelled", rid, time.perf_counter() - t0,
             len(jobs))


WARMED = ("eos", "stop", "length")  # a chat answer that ended so is the next turn's to take


def _warm(server, body, chat: bool, jobs, finish, answer: str) -> None:
    """After a chat request of one sequence that ended (`WARMED`): its next turn's warm job,
    rendered and queued in the loop's executor (`Server.warm_chat`)."""
    if chat and len(jobs) == 1 and finish in WARMED and server.scheduler.warms:
        asyncio.get_running_loop().run_in_executor(None, server.warm_chat, body, answer)


def _metrics(jobs, speculation) -> dict:
    """The response's `metrics` (vLLM's per-request metrics): `speculative_decoding`, the
    acceptance of a drafting request (`scheduler.Speculation.record`); for one sequence
    only (a request of several prompts or samples gets none), and none without drafts."""
    return {"metrics": {"speculative_decoding": speculation}} if speculation is not None and len(jobs) == 1 else {}


def _usage(prompt_lens: list, completion: int) -> dict:
    p = sum(prompt_lens)
    return dict(prompt_tokens=p, completion_tokens=completion, total_tokens=p + completion)


def build_app(server: Server) -> FastAPI:
    """The FastAPI app over a `Server` (its scheduler started, after its warm-up started,
    and drained with the app).
    The app holds the server (`app.state.server`); its routes reach it through a weak
    reference, since FastAPI keeps route functions in process-wide caches: a route that
    closed over the server would keep it (its engine, model and KV caches) alive after
    the app is gone, e.g. every server a test or notebook started and stopped."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server = app.state.server
        if not server.scheduler.alive:
            # /health says 503 with the progress until the minimum set is compiled (unless
            # the caller warmed the scheduler up itself before serving it)
            if server.warmup != "none" and server.scheduler.slots.warm is None:
                server.scheduler.warm_up_in_background()
            server.scheduler.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, server.scheduler.shutdown)

    app = FastAPI(title="lookahead-jax", lifespan=lifespan)
    app.state.server = server
    ref = weakref.ref(server)
    del server

    errors.install(app)

    @app.get("/health")
    async def health():
        """200 once the engine thread serves; 503 before (the warm-up's progress in the body:
        step programs compiled of the minimum set and of all) and after it stopped."""
        server = ref()
        sched = server.scheduler
        body = sched.programs()
        ok = sched.alive and body["ready"]
        body["status"] = "ok" if ok else ("warming up" if sched.alive or not body["ready"] else "stopped")
        if server.metrics is not None:
            server.metrics.programs(body)
        return JSONResponse(body, status_code=200 if ok else 503)

    created = int(time.time())

    def model_card(server) -> dict:
        return dict(id=server.model_name, object="model", created=created, owned_by="lookahead-jax",
                    max_model_len=server.max_model_len)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(ref())]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        server = ref()
        if model_id != server.model_name:
            raise APIError(404, f"The model `{model_id}` does not exist: this server serves `{server.model_name}`",
                           "model")
        return model_card(server)

    @app.get("/metrics")
    async def metrics():
        server = ref()
        if server.metrics is not None:
            sched = server.scheduler
            server.metrics.programs(sched.programs())
            server.metrics.queue(len(sched.running), len(sched.waiting))  # now, not at the engine's last admission
        body = server.metrics.render() if server.metrics is not None else b""
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        server = ref()
        if body.messages is not None:
            msgs = [m.template() for m in body.messages]
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            try:
                ids = encode_prompts(server.chat_tokenizer(msgs, tools), [msgs], True)[0]
            except ValueError as e:
                raise APIError(400, str(e), "messages") from None
        else:
            ids = server.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return dict(tokens=ids, count=len(ids), max_model_len=server.max_model_len)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """vLLM's shape: the tokenizer's configuration as tokenizer_config.json has it."""
        server = ref()
        tok = server.tokenizer
        info = dict(tokenizer_class=type(tok).__name__, **dict(getattr(tok, "special_tokens_map", None) or {}),
                    model_max_length=server.max_model_len)
        if getattr(tok, "add_bos_token", None) is not None:
            info["add_bos_token"] = bool(tok.add_bos_token)
        if getattr(tok, "chat_template", None):
            info["chat_template"] = tok.chat_template
        return info

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        server = ref()
        if server.vocab and any(not 0 <= t < server.vocab for t in body.tokens):
            raise APIError(400, f"tokens must be ids in [0, {server.vocab})", "tokens")
        return dict(prompt=server.tokenizer.decode(body.tokens))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: HTTPRequest):
        return await _serve(body, raw, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: HTTPRequest):
        return await _serve(body, raw, chat=True)

    async def _serve(body, raw: HTTPRequest, chat: bool):
        server = ref()
        t0 = time.perf_counter()
        queue: asyncio.Queue = asyncio.Queue()
        jobs = server.jobs(body, chat, _sink(asyncio.get_running_loop(), queue))
        server.submit(jobs)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        head = dict(id=rid, object="chat.completion" if chat else "text_completion", created=int(time.time()),
                    model=server.model_name)
        prompt_lens = [len(j.prompt_ids) for j in jobs[::body.n]]
        if body.stream:
            return StreamingResponse(_stream(body, raw, chat, jobs, queue, head, prompt_lens, t0),
                                     media_type="text/event-stream")
        try:
            return await _whole(body, raw, chat, jobs, queue, head, prompt_lens)
        except ClientGone:  # nobody to answer: one log line, not a traceback
            _gone(rid, t0, jobs)
            return Response(status_code=499)  # (nginx's "client closed request"; never sent)

    async def _whole(body, raw, chat, jobs, queue, head, prompt_lens):
        server = ref()
        res = [dict(text=[], tokens=[], lps=[], tops=[], finish=None, retrieval=None, prompt_lps=None,
                    prompt_top=None) for _ in jobs]
        echo = bool(getattr(body, "echo", False))
        left = len(jobs)
        try:
            while left:
                out = await _next(queue, raw, jobs, server.scheduler)
                if out.error:
                    raise APIError(out.status, out.error)
                r = res[out.index]
                r["text"].append(out.text)
                r["tokens"] += out.tokens
                r["lps"] += out.logprobs or []
                r["tops"] += out.tops or [None] * len(out.tokens)
                if out.prompt_logprobs is not None:  # (with the job's last tokens)
                    r["prompt_lps"], r["prompt_top"] = out.prompt_logprobs, out.prompt_top
                if out.finish:
                    r["finish"], r["retrieval"], r["spec"] = out.finish, out.retrieval, out.speculation
                    left -= 1
        except BaseException:
            server.scheduler.cancel(jobs)
            raise
        choices = []
        for k, r in enumerate(res):
            text = "".join(r["text"])
            top = body.top_logprobs_wanted > 0
            if echo:  # the prompt, then the completion (OpenAI's echo); its ids scored by the prefill
                ids = jobs[k].prompt_ids
                p = body.prompts[k // body.n]
                text = (p if isinstance(p, str) else server.tokenizer.decode(ids)) + text
                lp = None if not body.wants_logprobs else server.logprobs_block(
                    chat, ids + r["tokens"], r["prompt_lps"] + r["lps"], top,
                    tops=r["prompt_top"] + r["tops"] if top else None)
            else:
                lp = server.logprobs_block(chat, r["tokens"], r["lps"], top, tops=r["tops"]) if body.wants_logprobs \
                    else None
            c = dict(index=k, logprobs=lp, finish_reason=FINISH.get(r["finish"], r["finish"]))
            if chat:
                c["message"] = dict(role="assistant", content=text)
            else:
                c["text"] = text
            if body.token_ids_wanted:
                c["token_ids"] = r["tokens"]
            if body.lookahead_jax.return_retrieval:
                c["retrieval"] = server.retrieval_record(r["retrieval"])
            choices.append(c)
        out = dict(head, choices=choices, usage=_usage(prompt_lens, sum(len(r["tokens"]) for r in res)),
                   **_metrics(jobs, res[0].get("spec")))
        _warm(server, body, chat, jobs, res[0]["finish"], "".join(res[0]["text"]))
        if body.token_ids_wanted:
            out["prompt_token_ids"] = [j.prompt_ids for j in jobs[::body.n]]
        return out

    async def _stream(body, raw, chat, jobs, queue, head, prompt_lens, t0):
        server = ref()
        head = dict(head, object="chat.completion.chunk" if chat else "text_completion")
        left, n_tokens, offsets = len(jobs), 0, [0] * len(jobs)
        answer, finish = [], None  # (one sequence: its text, for the next turn's warm job)

        def chunk(choices, **extra):
            if body.continuous_usage and "usage" not in extra:  # vLLM's continuous_usage_stats: the usage so far
                extra["usage"] = _usage(prompt_lens, n_tokens)
            return "data: " + json.dumps(dict(head, choices=choices, **extra)) + "\n\n"

        try:
            if chat:
                yield chunk([dict(index=k, delta=dict(role="assistant", content=""), logprobs=None,
                                  finish_reason=None) for k in range(len(jobs))])
            while left:
                out = await _next(queue, raw, jobs, server.scheduler)
                if out.error:
                    yield "data: " + json.dumps(error_body(out.error, out.status)) + "\n\n"
                    server.scheduler.cancel(jobs)
                    break
                n_tokens += len(out.tokens)
                answer.append(out.text)
                if out.finish:
                    left -= 1
                    finish = out.finish
                if not (out.text or out.tokens or out.finish):
                    continue
                lp = server.logprobs_block(chat, out.tokens, out.logprobs or [], body.top_logprobs_wanted > 0,
                                           offsets[out.index], tops=out.tops) \
                    if body.wants_logprobs and out.tokens else None
                offsets[out.index] += len(out.text)
                c = dict(index=out.index, logprobs=lp, finish_reason=FINISH.get(out.finish, out.finish))
                c.update(delta=dict(content=out.text) if out.text or not out.finish else {}) if chat else \
                    c.update(text=out.text)
                if body.token_ids_wanted:
                    c["token_ids"] = out.tokens
                if out.finish and body.lookahead_jax.return_retrieval:
                    c["retrieval"] = server.retrieval_record(out.retrieval)
                yield chunk([c], **_metrics(jobs, out.speculation if out.finish else None))
            if body.include_usage:
                yield chunk([], usage=_usage(prompt_lens, n_tokens))
            yield "data: [DONE]\n\n"
            _warm(server, body, chat, jobs, finish, "".join(answer))
        except ClientGone:  # noticed by `_next`: the stream just ends
            _gone(head["id"], t0, jobs)
        except asyncio.CancelledError:  # Starlette noticed it first and cancels the stream
            _gone(head["id"], t0, jobs)
            raise
        finally:  # normal end, or the client went away: free the slots of unfinished jobs
            if left:
                server.scheduler.cancel(jobs)

    return app
