"""The engine: requests in, token deltas out, one `step()` at a time. Not thread-safe; see loop.py."""
from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time

from trellm_backend.engine.kv_cache_manager import KVCacheManager
from trellm_backend.engine.limits import context_limit, kv_window, resolve_block_size, resolve_device_dtype
from trellm_backend.engine.config import EngineConfig
from trellm_backend.models.config import ModelConfig, load_model_config
from trellm_backend.models.lora import AdapterRegistry, adapter_table
from trellm_backend.models.rope import long_rope_from
from trellm_backend.engine.runner import ModelRunner
from trellm_backend.engine.output_processor import OutputProcessor, bad_words_ids
from trellm_backend.engine.request import Request, RequestOutput, SamplingParams, Status
from trellm_backend.engine.draft import load_draft_config
from trellm_backend.engine.sampler import SampledToken
from trellm_backend.engine.scheduler import ScheduledChunk, Scheduler
from trellm_backend.engine.stats import SchedulerStats
from trellm_backend.engine.structured_output import GrammarCompiler, GuidedRow, fill_masks

log = logging.getLogger("trellm")


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer=None):
        self.model_config = mc = load_model_config(config.model_path)
        device, _ = resolve_device_dtype(config, mc)
        # `config` as served: defaults that depend on the device are settled here, once.
        self.config = config = dataclasses.replace(config, block_size=resolve_block_size(config, device))
        self.tokenizer = tokenizer   # with one, outputs carry text and stop strings work; without, token ids only
        # Tokenized bad-word lists (the n samples of one request arrive one after another with the same words):
        # lru_cache is thread-safe, so make_request may be called from any thread.
        self._bad_words_ids = functools.lru_cache(maxsize=8)(
            lambda words: bad_words_ids(self.tokenizer, list(words)))
        self.max_model_len = context_limit(config, mc)
        draft_cfg = load_draft_config(config, mc, self.max_model_len)
        self.runner = ModelRunner(config, mc, self.max_model_len, draft_cfg)
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                 window=kv_window(mc, draft_cfg))
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill, config.long_prefill_token_threshold,
                                   num_speculative_tokens=config.num_speculative_tokens if self.runner.proposer else 0,
                                   speculative_disable_batch_size=config.speculative_disable_batch_size,
                                   lookahead_slots=draft_cfg is not None, max_loras=config.max_loras,
                                   long_rope_from=long_rope_from(mc))
        self.requests: dict[str, Request] = {}
        self.eos_token_ids = frozenset(mc.eos_token_ids)
        self.pool_tokens = self.kv.num_blocks * config.block_size
        self.loras = AdapterRegistry(adapter_table(config.lora_adapters), mc, config.max_lora_rank,
                                     config.max_cpu_loras, self.runner.dtype, self.runner.device)
        for why in self.loras.broken.values():
            log.error("%s", why)
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()

    @property
    def grammars(self) -> GrammarCompiler:
        """The guide compiler, made with the first guided request: building xgrammar's tokenizer tables takes time
        that an engine without guided requests need not spend (perf/RESULTS.md, section "Structured output")."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
            return self._grammars

    # -- requests in ---------------------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """Validate and build a request. Any thread may call it (Triton's execute does, while the loop steps): it
        reads the engine's settings and touches only state that is locked for that, namely the bad-words cache, the
        adapter registry (which may read an adapter from disk and evict another: models/lora.py) and the grammar
        compiler (which starts compiling the request's guide on its own thread). It also fills
        `params.bad_words_ids` from `params.bad_words`."""
        params.validate()
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty: it must contain at least one token")
        if n >= self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens but the context length (max_model_len) is "
                             f"{self.max_model_len}: it must be at most {self.max_model_len - 1} to leave room "
                             "for one generated token")
        if n + 1 > self.pool_tokens:
            raise ValueError(f"the prompt has {n} tokens but the whole KV cache holds {self.pool_tokens} "
                             f"({self.kv.num_blocks} blocks of {self.config.block_size}); it can never fit")
        vocab = self.model_config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        bad_ids = [t for t in params.stop_token_ids if t >= vocab]
        if bad_ids:
            raise ValueError(f"stop token ids (end_id, stop_token_ids) must be in [0, {vocab}), got {bad_ids}")
        bad_ids = sorted(t for t in params.logit_bias if t >= vocab)
        if bad_ids:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab}), got {bad_ids[:8]}")
        if (params.stop or params.bad_words) and self.tokenizer is None:
            raise ValueError("stop strings and bad words need the engine's tokenizer")
        if params.guide is not None and self.tokenizer is None:
            raise ValueError("guided decoding needs the engine's tokenizer")
        if params.bad_words:
            params.bad_words_ids = self._bad_words_ids(tuple(params.bad_words))
        req = Request(request_id, list(prompt_token_ids), params, max_len=min(self.max_model_len, self.pool_tokens))
        if params.lora_name is not None:
            req.lora = self.loras.get(params.lora_name)
            req.cache_salt = f"lora:{params.lora_name}"   # two adapters (or one and the base) never share KV
        if params.guide is not None:
            req.grammar_future = self.grammars.compile(params.guide)    # compiles on its own thread, cached
        if self.tokenizer is not None:
            req.output_processor = OutputProcessor(self.tokenizer, req.prompt_token_ids, params)
        return req

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already running")
        if req.grammar_future is not None and req.grammar is None:
            req.grammar = self.grammars.matcher(req.grammar_future.result())   # GuideError: this request's error
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.add(self.make_request(request_id, prompt_token_ids, params))

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks now. Returns its final output, or None if it is not known."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.finish(req, "abort")
        if req.output_processor is None:
            return self._output(req, len(req.unsent))
        r = req.output_processor.flush()
        return self._output(req, r.num_tokens, r.text, r.context_ids)

    # -- stepping ------------------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample; returns an output for each request that got a token."""
        sched = self.scheduler.schedule()
        if not sched.chunks and not sched.reset_ids:
            return []
        result = self.runner.execute(sched, self._grammar_masks(sched))
        sampled = iter(result.sampled)
        return [self._advance(chunk, next(sampled), result.guesses.get(chunk.request_id, []))
                for chunk in sched.chunks if chunk.samples]

    def _grammar_masks(self, sched):
        """The step's token bitmask for the guided requests' rows (structured_output.py), or None."""
        if self._grammars is None:
            return None
        rows = []
        for c in sched.chunks:
            if c.samples:
                m = self.requests[c.request_id].grammar
                rows += [None if m is None else GuidedRow(m, c.draft_token_ids[:j])
                         for j in range(len(c.draft_token_ids) + 1)]
        return fill_masks(self._grammars, rows)

    def _advance(self, chunk: ScheduledChunk, rows: list[SampledToken], guesses: list[int]) -> RequestOutput:
        """Append the step's tokens to the chunk's request: the guesses the target sampled the same token for,
        then the target's token at the first disagreement (or after the last guess); stop at the first token that
        finishes the request (the rest are dropped, so max_tokens and stops are never overshot). The output carries the
        tokens whose text is settled (output_processor.py); the rest wait in `req.unsent`. `guesses`: those
        proposed for the request's next step."""
        req, drafts = self.requests[chunk.request_id], chunk.draft_token_ids
        if drafts:
            self.scheduler.verify(req, len(drafts), len(rows) - 1)
        if req.generator is not None and rows[-1].rng_state is not None:
            req.generator.set_state(rows[-1].rng_state)
        now = time.time_ns()
        req.times.first_token_ns = req.times.first_token_ns or now
        req.times.last_token_ns = now
        texts, context, cut, released, reason = [], None, 0, 0, None
        for s in rows:
            token = s.token_id
            req.token_ids.append(token)
            req.unsent.append(s)
            if s.logprob is not None:
                req.cumulative_logprob += s.logprob
            reason = self._finish_reason(req, token)
            if req.grammar is not None:
                if not req.grammar.accept_token(token):
                    log.warning("%s: token %d is outside its grammar; ending it", req.request_id, token)
                    reason = "stop"
                elif req.grammar.is_terminated():   # the grammar took a stop token: done, ignore_eos or not
                    reason = "stop"
            if req.output_processor is None:
                released = len(req.unsent)
            else:
                # Like EOS, stop strings count only once min_tokens are out.
                r = req.output_processor.add(token, reason is not None,
                                             req.num_output_tokens >= req.params.min_tokens)
                if r.num_tokens and context is None:
                    context = r.context_ids
                released, cut = released + r.num_tokens, r.cut_chars
                texts.append(r.text)
                reason = "stop" if r.stopped else reason
            if reason:
                break
        if reason:
            self.scheduler.finish(req, reason)
            del self.requests[req.request_id]
        else:
            req.spec_token_ids = guesses
        return self._output(req, released, "".join(texts), context, cut)

    def _finish_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos):
            return "stop"
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= req.max_len:
            return "length"
        return None

    @staticmethod
    def _output(req: Request, num_released: int, text: str = "", context_ids: list[int] | None = None,
                cut_chars: int = 0) -> RequestOutput:
        """The request's output for the oldest `num_released` unsent tokens (with their logprobs)."""
        out, req.unsent = req.unsent[:num_released], req.unsent[num_released:]
        logprobs = [s.logprob for s in out] if out and out[0].logprob is not None else None
        top = [(s.rank, s.top) for s in out] if out and out[0].top is not None else None
        return RequestOutput(req.request_id, [s.token_id for s in out], finished=req.status is Status.FINISHED,
                             finish_reason=req.finish_reason, num_prompt_tokens=req.num_prompt_tokens,
                             num_output_tokens=req.num_output_tokens, text=text, context_ids=context_ids or [],
                             cut_chars=cut_chars,
                             logprobs=logprobs, top_logprobs=top, cumulative_logprob=req.cumulative_logprob,
                             times=dataclasses.replace(req.times), num_cached_tokens=req.num_cached_tokens)

    # -- convenience ---------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Run prompts to completion (all admitted at once); returns each one's generated token ids."""
        ids = [f"generate-{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts):
            self.add_request(rid, p, params)
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for o in self.step():
                out[o.request_id].extend(o.new_token_ids)
        return [out[rid] for rid in ids]

    def kv_blocks_used(self) -> int:
        return self.kv.num_used

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def stats(self) -> SchedulerStats:
        s = self.scheduler.make_stats()
        if self._grammars is not None:
            g = self._grammars.stats
            s = dataclasses.replace(s, grammar_compile_requests=g.requests, grammar_cache_hits=g.cache_hits,
                                    grammar_compile_s=g.compile_s, grammar_mask_s=g.mask_s,
                                    grammar_mask_steps=g.mask_steps)
        if self.loras.names:
            def names(reqs):
                return tuple(sorted({r.lora.name for r in reqs if r.lora is not None}))
            s = dataclasses.replace(s, max_loras=self.config.max_loras, running_loras=names(self.scheduler.running),
                                    waiting_loras=names(self.scheduler.waiting), lora_loads=self.loras.loads,
                                    lora_evictions=self.loras.evictions)
        return s
