"""The engine: requests in, one scheduled step at a time, outputs out.

engine = Engine(model, tokenizer)
engine.add_request("Hello", SamplingParams(max_tokens=32, temperature=0))
while engine.has_unfinished_requests():
    for out in engine.step(): ...
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable, Sequence
from functools import partial
from numbers import Integral

import torch

from hf_paged.config import EngineConfig
from hf_paged.core.kv_cache_manager import KVCacheManager
from hf_paged.core.request import Request, RequestOutput, RequestStatus
from hf_paged.core.scheduler import Scheduler
from hf_paged.core.stop_checker import build_stop_checkers
from hf_paged.gc_freeze import frozen_heap
from hf_paged.generation.streaming import RequestStream
from hf_paged.sampling_params import F_RENORM, F_WARP, SamplingParams
from hf_paged.worker.attention import ATTN_IMPLEMENTATION
from hf_paged.worker.model_runner import ModelRunner


class Engine:
    """Thread rules: every public method may be called from any thread.
    - add_request / stream validate in the caller's thread (tokenising too) and put the new
      requests in an inbox; they never wait for a step in progress. The next step admits them.
    - step() runs under the engine's lock, one at a time; each step serves every live request,
      whoever added it, and delivers each output to the RequestStream that owns its request.
      Streams (Engine.stream / generate, and so model.generate) take turns stepping: one thread
      steps while the others wait for their outputs, so concurrent generate calls share one
      continuously batched run and each caller waits for its own requests only.
    - abort() acts at once when no step is running, else at the start of the next step.
    - A callback that runs inside a step (a stopping criterion, a logits processor, a streamer)
      may call add_request or abort; they take effect at the next step.

    While it lives, an Engine holds its model's attention routing (a ModelLease shared by every
    Engine on the model): unpatching or shutting down another Engine leaves this one working;
    switching the model's attention implementation by hand under it makes step() raise."""

    def __init__(self, model: torch.nn.Module, tokenizer=None, **options) -> None:
        from hf_paged.integrations.transformers import enable_paged_attention

        self.model = model
        self.tokenizer = tokenizer
        self.config = config = EngineConfig.from_options(**options)
        # the lock a step holds; the inbox and its lock, which adding never waits behind
        self._lock = threading.Lock()
        self._inbox_lock = threading.Lock()
        self._inbox: list = []  # actions (admissions, aborts) the next step runs first
        self._reserved: set[str] = set()  # request ids in the inbox, not admitted yet
        # streams waiting for outputs: one of them steps (_stepping), the others wait here
        self._turn = threading.Condition()
        self._stepping = False
        self._closed = False
        self._lease = enable_paged_attention(model, self)
        try:
            self._build(model, config)
        except BaseException:  # bad options found late: the model goes back as it came
            self._release_model()
            raise

    def _build(self, model: torch.nn.Module, config: EngineConfig) -> None:
        text_cfg = model.config.get_text_config()
        model_max = getattr(text_cfg, "max_position_embeddings", None)
        if config.max_model_len is None:
            if model_max is None:
                raise ValueError("max_model_len: the model config has no max_position_embeddings")
            config.max_model_len = model_max
        elif model_max is not None and config.max_model_len > model_max:
            # positions past the trained range give wrong output, silently (as vLLM, refused)
            raise ValueError(
                f"max_model_len ({config.max_model_len}) exceeds the model's "
                f"max_position_embeddings ({model_max})"
            )
        self.vocab_size = text_cfg.vocab_size
        device = next(model.parameters()).device
        if config.max_num_batched_tokens is None:
            config.max_num_batched_tokens = 8192 if device.type == "cuda" else 2048
        if config.compile is None:  # CPU: inductor's C++ compile costs more than it saves
            config.compile = device.type == "cuda"
        if not config.enable_chunked_prefill:
            config.max_num_batched_tokens = max(config.max_num_batched_tokens, config.max_model_len)
        self.num_fused_projections = 0
        if config.fuse_projections:  # before compile and graph capture see the model
            from hf_paged.integrations.fused_projections import fuse_projections

            self.num_fused_projections = fuse_projections(model)
            if self.num_fused_projections:  # put back by the last Engine on the model
                self._lease.fused = True
        self.runner = ModelRunner(model, config)
        self.kv = KVCacheManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.kv)
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.default_eos_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self.num_steps = 0
        self._beam_groups: set = set()  # hf_paged.generation.beam_search groups in flight
        self._inflight = None  # async_scheduling: (SchedulerOutput, PendingOutput) launched
        self.peak_blocks_used = 0
        self._streams: dict[str, RequestStream] = {}  # request id -> the stream it reports to
        self._queued: list[RequestOutput] = []  # final outputs of aborts, reported by step()

    def _release_model(self) -> None:
        from hf_paged.integrations.transformers import disable_paged_attention

        lease, self._lease = self._lease, None
        if lease is not None and disable_paged_attention(self.model, self) and lease.fused:
            from hf_paged.integrations.fused_projections import unfuse_projections

            unfuse_projections(self.model)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("Engine: shut down (shutdown() or unpatch); build a new Engine")
        if self.model.config._attn_implementation != ATTN_IMPLEMENTATION:
            raise RuntimeError(
                "model: its attention implementation was switched to "
                f"{self.model.config._attn_implementation!r} while this Engine is live; the "
                "Engine needs 'hf_paged' (shut the Engine down before switching)"
            )

    # -- requests --------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Sequence[int] | str,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        """Queue a request; returns its id. Bad input raises ValueError and changes nothing.
        The request joins at the next step."""
        self._check_open()
        requests = self._make_requests(prompt, params, request_id, priority)
        self._submit(requests, partial(self._admit, requests))
        return requests[0].request_id

    def _submit(self, requests: list[Request], action, stream=None) -> None:
        """Put an admission in the inbox, refusing ids already live or queued (checked under the
        inbox lock, which the step's admission holds too: no id can slip between the two)."""
        with self._inbox_lock:
            for r in requests:
                if r.request_id in self.scheduler.requests or r.request_id in self._reserved:
                    raise ValueError(f"request_id {r.request_id!r} already exists")
            self._reserved.update(r.request_id for r in requests)
            if stream is not None:
                for r in requests:
                    self._streams[r.request_id] = stream
            self._inbox.append(action)

    def _admit_inbox(self) -> None:
        """Run what the inbox holds, in order (under the step lock, at the start of a step)."""
        if not self._inbox:  # the usual step: nothing new (an empty inbox reserves no id)
            return
        with self._inbox_lock:
            actions, self._inbox = self._inbox, []
            for action in actions:
                action()
            self._reserved.clear()

    def _admit(self, requests: list[Request]) -> None:
        parent = requests[0]
        if parent.status.finished:  # its stream closed before it was admitted
            return
        if len(requests) > 1:
            parent.pending_siblings = requests[1:]
            for sibling in requests[1:]:  # known to the scheduler, queued nowhere until the fork
                self.scheduler.requests[sibling.request_id] = sibling
        self.scheduler.add_request(parent)

    def _make_requests(self, prompt, params, request_id, priority) -> list[Request]:
        """Validate one prompt's request and build it (with its n - 1 siblings); touches no
        engine state, so it runs in the caller's thread."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {type(request_id).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if params.n > self.config.max_num_seqs:
            raise ValueError(
                f"n: {params.n} samples exceed max_num_seqs ({self.config.max_num_seqs})"
            )
        prompt_ids = self._prompt_token_ids(prompt)
        n = len(prompt_ids)
        cfg = self.config
        max_total = n + params.max_tokens
        if max_total > cfg.max_model_len:
            raise ValueError(
                f"max_tokens: prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {max_total} "
                f"exceeds max_model_len ({cfg.max_model_len})"
            )
        if self.kv.blocks_needed(max_total) > self.kv.num_blocks:
            raise ValueError(
                f"max_tokens: prompt ({n}) + max_tokens ({params.max_tokens}) needs "
                f"{self.kv.blocks_needed(max_total)} KV blocks, the cache has {self.kv.num_blocks}"
            )
        eos = params.eos_token_id if params.eos_token_id is not None else self.default_eos_token_ids
        stop = set() if params.ignore_eos else set(eos)
        stop.update(params.stop_token_ids or ())
        _check_vocab(params, self.vocab_size)
        stop_checkers = build_stop_checkers(params, self.tokenizer)
        requests = []
        for index in range(params.n):
            rid = request_id if index == 0 else f"{request_id}#{index}"
            generator = None
            if params.seed is not None:  # sibling k: its own stream, derived from the seed
                seed = params.seed if index == 0 else hash((params.seed, index)) & (2**63 - 1)
                generator = torch.Generator(device=self.runner.device).manual_seed(seed)
            request = Request(
                request_id=rid,
                prompt_token_ids=prompt_ids,
                sampling_params=params,
                eos_token_ids=frozenset(stop),
                max_total_tokens=max_total,
                priority=priority,
                arrival_index=next(self._arrivals),
                generator=generator,
                sibling_index=index,
                parent_request_id=None if index == 0 else request_id,
                stop_checkers=list(stop_checkers) if stop_checkers else None,
            )
            set_bans(request, eos)
            request.async_ok = (
                not params.features & ~(F_WARP | F_RENORM)
                and not params.prompt_logprobs
                and params.n == 1
            )
            requests.append(request)
        return requests

    def _prompt_token_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: a string prompt needs Engine(model, tokenizer)")
            prompt = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if isinstance(prompt, torch.Tensor):
            if prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.ndim != 1:
                raise ValueError(
                    "prompt: a tensor prompt must be 1-D integer token ids, got "
                    f"{prompt.dtype} of shape {tuple(prompt.shape)}"
                )
            prompt = prompt.tolist()
        if isinstance(prompt, (bytes, dict)) or not isinstance(prompt, Iterable):
            raise ValueError(
                f"prompt must be a string or a sequence of integer token ids, got {prompt!r:.80}"
            )
        ids = list(prompt)
        wrong = [t for t in ids if not isinstance(t, Integral) or isinstance(t, bool)]
        if wrong:  # 1.5 or True silently taken as 1 would run a different prompt
            raise ValueError(f"prompt token ids must be integers, got {wrong[:5]!r}")
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError("prompt is empty: at least one token is needed")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})"
            )
        return ids

    def abort(self, request_id: str) -> None:
        """End a live request: its blocks and row are freed, and the next step() reports its
        final output (finish_reason "abort"), and that of siblings that had not started yet.
        Acts at once when no step is running, else at the start of the next step (a request that
        finishes first keeps its own ending). Other requests are untouched."""
        self._abort(request_id, report=True)

    def _abort(self, request_id: str, report: bool) -> None:
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {type(request_id).__name__}")
        with self._inbox_lock:
            if request_id not in self.scheduler.requests and request_id not in self._reserved:
                raise ValueError(f"request_id {request_id!r} is not a running or waiting request")
        action = partial(self._end_by_abort, request_id, report)
        if self._lock.acquire(blocking=False):  # no step running (nor in this thread's stack)
            try:
                self._admit_inbox()
                action()
            finally:
                self._lock.release()
        else:
            with self._inbox_lock:
                self._inbox.append(action)

    def _end_by_abort(self, request_id: str, report: bool) -> None:
        if request_id not in self.scheduler.requests:
            return  # it ended on its own meanwhile
        ended = self.scheduler.abort_request(request_id)
        self._release_rows()
        if report:
            self._queued += [_make_output(r, 0) for r in ended]
        else:  # the stream that owns them has closed: nobody waits for their outputs
            for r in ended:
                self._streams.pop(r.request_id, None)

    def _release_rows(self) -> None:
        """The runner drops what it holds for requests that left the running set (all of them,
        whatever ended them: the scheduler's end_requests and preemption queue their ids)."""
        for request_id in self.scheduler.take_released_req_ids():
            self.runner.release(request_id)

    def has_unfinished_requests(self) -> bool:
        """Requests to run or to admit, or final outputs (of aborts) step() has yet to report."""
        return self.scheduler.has_unfinished_requests() or bool(self._queued or self._inbox)

    # -- stepping ----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and report every request that got a token or ended.
        With async_scheduling, the step is launched before the previous step's tokens are read,
        and the outputs reported are the previous step's. Each output also goes to the
        RequestStream that owns its request, if any (see the class docstring)."""
        with self._lock:
            self._check_open()
            self._admit_inbox()
            outputs, self._queued = self._queued, []
            try:
                if self.config.async_scheduling:
                    outputs += self._step_async()
                else:
                    outputs += self._step_sync()
            finally:
                self._release_rows()
            delivered = self._route(outputs)
        if delivered:
            with self._turn:  # streams waiting for their turn: some have outputs now
                self._turn.notify_all()
        return outputs

    def _wait_or_step(self, ready) -> None:
        """Return once ready() holds, stepping the engine meanwhile: one waiting thread steps
        (for everyone), the others sleep until its step ends or delivers to them. Used by
        RequestStream and beam search, so concurrent callers take turns instead of queueing on
        the step lock (which is not fair: the stepping thread would take it again at once)."""
        turn = self._turn
        while True:
            with turn:
                while not ready():
                    if not self._stepping:
                        self._stepping = True
                        break
                    turn.wait()
                else:
                    return
            try:
                self.step()
            finally:
                with turn:
                    self._stepping = False
                    turn.notify_all()
            if not ready() and not self.has_unfinished_requests():
                # every request ends with a final output: nothing can be left to wait for
                raise RuntimeError("the engine has no requests left but an awaited one never ended")

    def _route(self, outputs: list[RequestOutput]) -> bool:
        streams = self._streams
        if not streams:
            return False
        delivered = False
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is not None:
                stream.deliver(out)
                delivered = True
                if out.finished:
                    del streams[out.request_id]
        return delivered

    def _step_sync(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if not sched.requests:
            if self.scheduler.has_unfinished_requests():
                raise RuntimeError("scheduler made no progress with requests pending")
            return []
        self._before_execute(sched)
        runner_out = self.runner.execute(sched, self.kv)
        self.num_steps += 1
        return self._after_execute(sched, runner_out, launched=False)

    def _step_async(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        if not self._can_run_ahead():  # this step's sampling reads tokens on the host
            if self._inflight is not None:
                outputs = self._resolve_inflight()
            return outputs + self._step_sync()
        sched = self.scheduler.schedule()
        if not sched.requests:
            if self._inflight is not None:  # e.g. every running request awaits its last token
                return self._resolve_inflight()
            if self.scheduler.has_unfinished_requests():
                raise RuntimeError("scheduler made no progress with requests pending")
            return []
        self._before_execute(sched)
        pending = self.runner.execute(sched, self.kv, async_output=True)
        self.scheduler.on_launched(sched, pending.sample_rows)
        self.num_steps += 1
        if self._inflight is not None:  # the GPU now runs this step while the host reads the last
            outputs = self._resolve_inflight()
        self._inflight = (sched, pending)
        return outputs

    def _can_run_ahead(self) -> bool:
        return not self._beam_groups and not self.scheduler.requests.num_sync_only

    def _resolve_inflight(self) -> list[RequestOutput]:
        sched, pending = self._inflight
        self._inflight = None
        return self._after_execute(sched, pending.result(), launched=True)

    def _before_execute(self, sched) -> None:
        self._release_rows()  # preempted by this schedule
        copies, changed = self.kv.take_block_changes()
        for rid in changed:  # forked or copied-on-write: rebuild the runner's row
            self.runner.release(rid)
        if copies:
            self.runner.copy_blocks(copies)
        used = self.kv.num_blocks - self.kv.get_num_free_blocks()
        self.peak_blocks_used = max(self.peak_blocks_used, used)

    def _after_execute(self, sched, runner_out, launched: bool) -> list[RequestOutput]:
        advanced, ended = self.scheduler.update_from_output(sched, runner_out, launched)
        if self._beam_groups:  # groups whose beams all have their logits take a beam step
            for group in [g for g in self._beam_groups if g.ready()]:
                group.step_or_fail()
            self._beam_groups = {g for g in self._beam_groups if not g.done}
        now = time.perf_counter()  # rows of ended requests: released by step() once it returns
        outputs = []
        for r in advanced:
            if r.first_token_time is None:
                r.first_token_time = now
            if r.status.finished:
                r.finish_time = now
            outputs.append(_make_output(r, 1))
        for r in ended:
            if r.status == RequestStatus.FINISHED_ERROR and r.finish_time is None:
                r.finish_time = now  # no token this step: the final output reports the error
                outputs.append(_make_output(r, 0))
        return outputs

    def generate(
        self,
        prompts: Sequence[Sequence[int] | str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion through continuous batching; outputs in input order.
        A prompt with n > 1 gives n consecutive outputs (index 0..n-1). If a request's own user
        code (stopping criterion, logits processor) raises, the other requests of this call are
        aborted and that exception is raised here. Safe to call from several threads at once:
        the calls share the engine's batch. The run is inside frozen_heap(): no full garbage
        collection of the pre-run heap stalls it."""
        final: dict[str, RequestOutput] = {}
        bar = None
        with self.stream(prompts, params) as stream, frozen_heap():
            if use_tqdm:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(stream.request_ids), desc="hf_paged", unit="req")
            try:
                for out in stream:
                    if out.error is not None:
                        raise out.error
                    if out.finished:
                        final[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
            finally:
                if bar is not None:
                    bar.close()
        missing = [
            rid
            for rid in stream.request_ids
            if rid not in final or final[rid].finish_reason == "abort"
        ]
        if missing:
            raise RuntimeError(f"requests {missing[:5]} were aborted before they finished")
        return [final[rid] for rid in stream.request_ids]

    def stream(
        self,
        prompts: Sequence[Sequence[int] | str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> RequestStream:
        """Queue every prompt and return an iterator that steps the engine and yields a
        RequestOutput each time one of these requests gets a token (new_token_ids holds it;
        finished=True on its last), many requests interleaved. `.request_ids` lists them in input
        order (siblings of n > 1 after their first). Closing the iterator early aborts its
        unfinished requests; bad input raises ValueError before anything is queued."""
        if isinstance(prompts, (str, torch.Tensor)):
            raise ValueError("prompts must be a list of prompts (a list of one for one prompt)")
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: {len(params)} given for {len(prompts)} prompts")
        self._check_open()
        # every prompt validated before any is queued; a group is one prompt and its siblings
        groups = [self._make_requests(prompt, p, None, 0) for prompt, p in zip(prompts, params)]
        requests = [r for group in groups for r in group]
        stream = RequestStream(self, [r.request_id for r in requests])
        self._submit(requests, partial(self._admit_groups, groups), stream)
        return stream

    def _admit_groups(self, groups: list[list[Request]]) -> None:
        for group in groups:
            self._admit(group)

    # -- introspection -----------------------------------------------------------------------------

    def stats(self) -> dict:
        with self._lock:
            return self._stats()

    def _stats(self) -> dict:
        pc = self.kv.prefix_cache_stats
        return {
            "num_blocks": self.kv.num_blocks,
            "block_size": self.config.block_size,
            "free_blocks": self.kv.get_num_free_blocks(),
            "peak_blocks_used": self.peak_blocks_used,
            "prefix_cache_queries": pc.queries,
            "prefix_cache_hits": pc.hits,
            "prefix_cache_hit_rate": pc.hit_rate,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "attention_backend": self.runner.backend.name,
            "max_model_len": self.config.max_model_len,
            "max_num_batched_tokens": self.config.max_num_batched_tokens,
        }

    def check_invariants(self) -> None:
        """Raise AssertionError unless everything held has a live owner: every running request
        is RUNNING and in the table, every waiting one WAITING or PREEMPTED, nothing in the
        table is in neither (no ghost); KV blocks (refcounts, free queue), runner rows and
        penalty rows are held by running requests only; with no requests left, nothing is held.
        Tests call it after every test and, in the randomized tests, after every operation."""
        with self._lock:
            sched, kv, ib = self.scheduler, self.kv, self.runner.input_batch
            kv.check_invariants()
            live = sched.requests
            assert live.num_sync_only == sum(not r.async_ok for r in live.values()), "sync count"
            running = {r.request_id for r in sched.running}
            assert len(running) == len(sched.running), "a request is in running twice"
            for r in sched.running:
                assert r.status == RequestStatus.RUNNING, f"{r.request_id} running as {r.status}"
                assert live.get(r.request_id) is r, f"running {r.request_id} not in the table"
            waiting = set()
            for r in sched.waiting:
                assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), r.status
                assert live.get(r.request_id) is r, f"waiting {r.request_id} not in the table"
                waiting.add(r.request_id)
            pending = set()
            for r in live.values():
                for sibling in r.pending_siblings or ():
                    assert sibling.status == RequestStatus.WAITING, sibling.status
                    assert live.get(sibling.request_id) is sibling, sibling.request_id
                    pending.add(sibling.request_id)
            ghosts = set(live) - running - waiting - pending
            assert not ghosts, f"requests in the table but in no queue: {sorted(ghosts)[:5]}"
            assert not running & waiting, "a request both running and waiting"
            assert set(kv.req_to_blocks) <= running, "blocks held by a request not running"
            rows = ib.req_to_row
            assert set(rows) <= running, f"runner rows without an owner: {set(rows) - running}"
            assert len(set(ib.free_rows)) == len(ib.free_rows), "a row freed twice"
            assert not set(ib.free_rows) & set(rows.values()), "a row both free and held"
            assert len(ib.free_rows) + len(rows) == ib.max_num_reqs, "runner rows leaked"
            processor = self.runner.sampler._processor
            if processor is not None:
                pool = processor.pool
                assert set(pool.slot_of) <= running, "penalty rows without an owner"
                for rid, slot in pool.slot_of.items():
                    assert pool.owners[slot].request_id == rid, f"penalty row {slot} mixed up"
                held = sum(owner is not None for owner in pool.owners)
                assert held == len(pool.slot_of), "penalty rows held outside the index"
            waited = set(live) | {out.request_id for out in self._queued} | self._reserved
            assert set(self._streams) <= waited, "a stream waits for nobody"
            for group in self._beam_groups:
                assert all(b.request_id in live for b in group.beams), "a beam ended early"
            if not sched.has_unfinished_requests():
                assert kv.get_num_free_blocks() == kv.num_blocks, "KV blocks leaked"
                assert not kv.req_to_blocks, "finished requests still hold blocks"
                assert not rows, "finished requests still hold runner rows"

    def shutdown(self) -> None:
        """Release the KV cache and CUDA graphs now (unpatch calls this), rather than whenever the
        garbage collector breaks the runner's reference cycles, and give up the model: the last
        Engine on it switches its attention back and puts fused projections back. The engine
        cannot step after (step() raises)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.runner.shutdown()
            self._release_model()

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()


def _check_vocab(params: SamplingParams, vocab_size: int) -> None:
    for seq in params.bad_words_ids or ():
        bad = [t for t in seq if t >= vocab_size]
        if bad:  # as transformers' SequenceBiasLogitsProcessor
            raise ValueError(
                f"bad_words_ids: token ids {bad} outside the vocabulary [0, {vocab_size})"
            )
    if params.logprobs is not None and params.logprobs > vocab_size:
        raise ValueError(f"logprobs: {params.logprobs} exceeds the vocabulary size {vocab_size}")


def set_bans(request: Request, eos: list[int]) -> None:
    """Precompute the request's token bans: suppress_tokens and one-token bad words always, longer
    bad words after their prefix. As in transformers, a bad word equal to [eos] is dropped."""
    p = request.sampling_params
    banned = list(p.suppress_tokens or ())
    for seq in p.bad_words_ids or ():
        if len(seq) == 1:
            if seq[0] not in eos:
                banned.append(seq[0])
        else:
            request.bad_word_prefixes.append((tuple(seq[:-1]), seq[-1]))
    request.banned_token_ids = sorted(set(banned))


def _make_output(r: Request, num_new: int) -> RequestOutput:
    return RequestOutput(
        request_id=r.request_id,
        prompt_token_ids=r.prompt_token_ids,
        token_ids_ref=r.all_token_ids,
        num_tokens=len(r.all_token_ids),
        new_token_ids=r.all_token_ids[-num_new:] if num_new else [],
        finished=r.status.finished,
        finish_reason=r.finish_reason,
        num_cached_tokens=max(r.num_cached_tokens, 0),
        prompt_logprobs=r.prompt_logprobs,
        arrival_time=r.arrival_time,
        first_token_time=r.first_token_time,
        finish_time=r.finish_time,
        logprobs=r.output_logprobs,
        scores=r.output_scores,
        logits=r.output_logits,
        index=r.sibling_index,
        parent_request_id=r.parent_request_id,
        error=r.error,
    )
