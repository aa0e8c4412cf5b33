"""The engine: requests in, token deltas out, one `step()` at a time. Not thread-safe; see loop.py."""
from __future__ import annotations

import dataclasses
import functools
import logging
import threading

from trellm_backend.engine.kv_cache_manager import KVCacheManager
from trellm_backend.engine.limits import context_limit, kv_window, resolve_block_size, resolve_device_dtype
from trellm_backend.engine.config import EngineConfig
from trellm_backend.models.config import ModelConfig, load_model_config
from trellm_backend.models.lora import AdapterRegistry, adapter_table
from trellm_backend.models.rope import long_rope_from
from trellm_backend.engine.runner import ModelRunner
from trellm_backend.engine.output_processor import OutputProcessor, bad_words_ids
from trellm_backend.engine.request import Request, RequestOutput, SamplingParams, request_output
from trellm_backend.engine.draft import load_draft_config
from trellm_backend.engine.scheduler import Scheduler
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
        self.eos_token_ids = frozenset(mc.eos_token_ids)
        draft_cfg = load_draft_config(config, mc, self.max_model_len)
        self.runner = ModelRunner(config, mc, self.max_model_len, draft_cfg)
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                 window=kv_window(mc, draft_cfg))
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill, config.long_prefill_token_threshold,
                                   num_speculative_tokens=config.num_speculative_tokens if self.runner.proposer else 0,
                                   speculative_disable_batch_size=config.speculative_disable_batch_size,
                                   lookahead_slots=draft_cfg is not None, max_loras=config.max_loras,
                                   long_rope_from=long_rope_from(mc), eos_token_ids=self.eos_token_ids)
        self.pool_tokens = self.kv.num_blocks * config.block_size
        self.loras = AdapterRegistry(adapter_table(config.lora_adapters), mc, config.max_lora_rank,
                                     config.max_cpu_loras, self.runner.dtype, self.runner.device, self.runner.shard)
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
        if req.request_id in self.scheduler.requests:
            raise ValueError(f"request id {req.request_id!r} is already running")
        if req.grammar_future is not None and req.grammar is None:
            req.grammar = self.grammars.matcher(req.grammar_future.result())   # GuideError: this request's error
        self.scheduler.add(req)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.add(self.make_request(request_id, prompt_token_ids, params))

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks now. Returns its final output, or None if it is not known."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return None
        self.scheduler.finish(req, "abort")
        if req.output_processor is None:
            return request_output(req, len(req.unsent))
        r = req.output_processor.flush()
        return request_output(req, r.num_tokens, r.text, r.context_ids)

    # -- stepping ------------------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample; returns an output for each request that got a token."""
        sched = self.scheduler.schedule()
        if not sched.chunks and not sched.reset_ids:
            return []
        result = self.runner.execute(sched, self._grammar_masks(sched))
        return self.scheduler.update_from_output(sched, result.sampled, result.guesses)

    def _grammar_masks(self, sched):
        """The step's token bitmask for the guided requests' rows (structured_output.py), or None."""
        if self._grammars is None:
            return None
        rows = []
        for c in sched.chunks:
            if c.samples:
                m = self.scheduler.requests[c.request_id].grammar
                rows += [None if m is None else GuidedRow(m, c.draft_token_ids[:j])
                         for j in range(len(c.draft_token_ids) + 1)]
        return fill_masks(self._grammars, rows)

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

    def on_worker_lost(self, callback) -> None:
        """Call `callback(message)` once, on a thread of its own, if a worker of a split model (a tensor-parallel rank
        or a pipeline stage) is lost (the engine cannot step after that: each step raises GroupFailure)."""
        if self.runner.workers is not None:
            self.runner.workers.on_lost = callback

    def close(self) -> None:
        """End what the engine started outside this process (a split model's workers); the engine cannot step
        after it."""
        self.runner.close()

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
