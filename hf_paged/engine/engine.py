"""The engine: requests in, one scheduled step at a time, outputs out.

engine = Engine(model, tokenizer)
engine.add_request("Hello", SamplingParams(max_tokens=32, temperature=0))
while engine.has_unfinished_requests():
    for out in engine.step(): ...
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from functools import partial

import torch

from hf_paged import envs
from hf_paged.config import EngineConfig
from hf_paged.core.request import Request, RequestOutput, RequestStatus
from hf_paged.engine.core import EngineCore
from hf_paged.engine.inbox import Inbox
from hf_paged.engine.input_processor import InputProcessor
from hf_paged.engine.output_processor import make_output
from hf_paged.engine.stream import RequestStream, StreamRouter
from hf_paged.engine.verify import verify_model
from hf_paged.gc_freeze import collections_paused, frozen_heap
from hf_paged.integrations.fused_projections import fuse_projections
from hf_paged.lora import routing as lora
from hf_paged.quantization.fp8_checkpoints import Fp8Checkpoint
from hf_paged.quantization.fp8_weights import check_quantizable, quantize_model
from hf_paged.sampling_params import SamplingParams
from hf_paged.worker.attention import ATTN_IMPLEMENTATION
from hf_paged.worker.startup_times import StartupTimes, format_startup

logger = logging.getLogger(__name__)


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

        startup = StartupTimes()  # from here to the end of __init__
        envs.use_compile_cache()  # HF_PAGED_COMPILE_CACHE, before anything compiles
        self.model = model
        self.tokenizer = tokenizer
        self.config = config = EngineConfig.from_options(**options)
        self._lock = threading.Lock()  # the lock a step holds
        self._inbox = Inbox()  # what adding and aborting leave for the next step
        # streams waiting for outputs: one of them steps (_stepping), the others wait here
        self._turn = threading.Condition()
        self._stepping = self._closed = False
        self._lease = enable_paged_attention(model, self)
        try:
            with collections_paused():  # compile's objects would set off full collections
                self._build(model, config, startup)
        except BaseException:  # bad options found late: the model goes back as it came
            if getattr(self, "runner", None) is not None:  # compiled layers undone first
                self.runner.shutdown()
            self._release_model()
            raise
        self.startup_stats = startup.finish()  # seconds per phase, graphs (startup_times.py)
        logger.info("hf_paged: %s", format_startup(self.startup_stats))

    def _build(self, model: torch.nn.Module, config: EngineConfig, startup: StartupTimes) -> None:
        config.resolve_for(model)
        self.vocab_size = model.config.get_text_config().vocab_size
        routing = lora.route_adapters(model, config, self._lease)  # a PeftModel's LoRA
        # before compile and graph capture see the model; put back by the last Engine on it
        self.num_fused_projections = _prepare_weights(model, config, self._lease, startup)
        self._lease.fused |= self.num_fused_projections > 0
        if routing is not None:  # slices' LoRA buffers: their group's; A rows in the GEMMs
            routing.slots.after_fusing()
        self.core = core = EngineCore(
            model, config, routing, self.tokenizer, self._lease.tp, startup
        )
        # the core's parts, for introspection (stats, tests, benchmarks)
        self.runner, self.kv, self.scheduler = core.runner, core.kv, core.scheduler
        with startup.phase("verify_model"):  # the check's relative logits error; None: off
            self.verify_error = (
                verify_model(model, self.runner, self._lease) if config.verify_model else None
            )
        self.inputs = InputProcessor(
            config,
            self.tokenizer,
            self.vocab_size,
            self.kv.num_blocks,
            self.runner.device,
            getattr(getattr(model, "generation_config", None), "eos_token_id", None),
            routing.check if routing is not None else None,
        )
        self._streams = StreamRouter()  # request id -> the stream its outputs go to
        self._queued: list[RequestOutput] = []  # final outputs of aborts, reported by step()

    def _release_model(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            _give_back(self.model, self, lease)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("Engine: shut down (shutdown() or unpatch); build a new Engine")
        adapted = self._lease is not None and self._lease.adapted  # attention swapped, not set
        if not adapted and self.model.config._attn_implementation != ATTN_IMPLEMENTATION:
            raise RuntimeError(
                f"model: attention switched to {self.model.config._attn_implementation!r} while "
                "this Engine is live; it needs 'hf_paged' (shut the Engine down first)"
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
        requests = self.inputs.make_requests(prompt, params, request_id, priority)
        self._submit(requests, partial(self._admit, [requests]))
        return requests[0].request_id

    def _submit(self, requests: list[Request], action, stream=None) -> None:
        ids = [r.request_id for r in requests]
        with lora.admitting(self.core.lora, requests, self._inbox, self.scheduler.requests):
            if stream is None:
                self._inbox.submit(ids, action, self.scheduler.requests)
                return
            self._streams.register(ids, stream)  # before the admission: no output may miss it
            try:
                self._inbox.submit(ids, action, self.scheduler.requests)
            except ValueError:
                self._streams.unregister(ids, stream)
                raise

    def _admit(self, groups: list[list[Request]]) -> None:  # a group: a request, its siblings
        for parent, *siblings in groups:
            if not parent.status.finished:  # else its stream closed before it was admitted
                self.scheduler.add_request(parent, siblings=siblings)

    def abort(self, request_id: str) -> None:
        """End a live request: its blocks and row are freed, and the next step() reports its
        final output (finish_reason "abort"), and that of siblings that had not started yet.
        Acts at once when no step is running, else at the start of the next step (a request that
        finishes first keeps its own ending). Other requests are untouched."""
        self._abort(request_id, report=True)

    def _abort(self, request_id: str, report: bool) -> None:
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {type(request_id).__name__}")
        if not self._inbox.knows(request_id, self.scheduler.requests):
            raise ValueError(f"request_id {request_id!r} is not a running or waiting request")
        action = partial(self._end_by_abort, request_id, report)
        if self._lock.acquire(blocking=False):  # no step running (nor in this thread's stack)
            try:
                self._inbox.run()
                action()
            finally:
                self._lock.release()
        else:
            self._inbox.defer(action)

    def _end_by_abort(self, request_id: str, report: bool) -> None:
        if request_id not in self.scheduler.requests:
            return  # it ended on its own meanwhile
        ended = self.scheduler.abort_request(request_id)
        self.core.release_rows()
        if report:
            self._queued += [make_output(r, 0, self.tokenizer) for r in ended]
        else:  # the stream that owns them has closed: nobody waits for their outputs
            for r in ended:
                self._streams.drop(r.request_id)

    def drop_stream(self, request_id: str) -> None:
        """A stream closed early: nobody waits for this request's outputs; end it if it runs."""
        self._streams.drop(request_id)
        try:
            self._abort(request_id, report=False)
        except ValueError:  # ended meanwhile (or a sibling ended with its parent)
            pass

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    # -- beam search (hf_paged.generation.beam_search): the narrow interface it drives ---------

    def add_beam_group(self, group, root: Request, beams: list[Request]) -> None:
        """Queue a beam group: the root request computes the prompt, the other beams wait as its
        pending siblings (admission reserves their seats) and the group gets every beam's
        logits row after each step (group.add_logits), then takes its beam step."""
        self._check_open()
        self._submit([root, *beams], partial(self._admit_beam_group, group, root, beams))

    def _admit_beam_group(self, group, root: Request, beams: list[Request]) -> None:
        if group.done:  # the call failed before its group was admitted
            return
        self.core.beam_groups.add(group)
        self.scheduler.add_request(root, siblings=beams)

    def end_beam_groups(self, groups) -> None:
        """End these groups' beams that still run (the caller gave up on them: an exception)."""
        with self._lock:
            for group in groups:
                if not group.done:
                    group.finish(RequestStatus.FINISHED_ABORTED)
            self.core.beam_groups -= set(groups)
            self.core.release_rows()

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
            self._inbox.run()
            outputs, self._queued = self._queued, []
            try:
                outputs += self.core.step()
            finally:
                self.core.release_rows()
            delivered = self._streams.route(outputs)
        if delivered:
            with self._turn:  # streams waiting for their turn: some have outputs now
                self._turn.notify_all()
        return outputs

    def wait_or_step(self, ready) -> None:
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
        with self.stream(prompts, params) as stream, frozen_heap():
            return stream.collect(use_tqdm)

    def stream(
        self,
        prompts: Sequence[Sequence[int] | str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        coalesce: bool = False,
    ) -> RequestStream:
        """Queue every prompt; an iterator that steps the engine and yields a RequestOutput each
        time one of these requests gets a token (new_token_ids; finished=True on its last), many
        interleaved. `.request_ids`: input order (siblings of n > 1 after their first). Closing
        it early aborts the unfinished ones; bad input raises ValueError, nothing queued."""
        self._check_open()
        groups = self.inputs.make_groups(prompts, params)
        stream = RequestStream(self, [r.request_id for g in groups for r in g], coalesce)
        self._submit([r for g in groups for r in g], partial(self._admit, groups), stream)
        return stream

    def add_requests(
        self,
        prompts: Sequence[Sequence[int] | str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        request_ids: Sequence[str] | None = None,
    ) -> list[str]:
        """Queue prompts with no stream (step() reports them), all validated before any is
        queued. Returns the ids in input order, each prompt's n - 1 siblings after it."""
        self._check_open()
        groups = self.inputs.make_groups(prompts, params, request_ids)
        self._submit([r for g in groups for r in g], partial(self._admit, groups))
        return [r.request_id for g in groups for r in g]

    # -- introspection -----------------------------------------------------------------------------

    def stats(self) -> dict:
        with self._lock:
            return self.core.stats()

    def check_invariants(self) -> None:
        """Raise AssertionError unless everything held has a live owner: every running request
        is RUNNING and in the table, every waiting one WAITING or PREEMPTED, nothing in the
        table is in neither (no ghost); KV blocks (refcounts, free queue), runner rows and
        penalty rows are held by running requests only; with no requests left, nothing is held.
        Tests call it after every test and, in the randomized tests, after every operation."""
        with self._lock:
            self.core.check_invariants()
            live = self.scheduler.requests
            waited = set(live) | {out.request_id for out in self._queued} | self._inbox.reserved
            assert self._streams.request_ids() <= waited, "a stream waits for nobody"

    def shutdown(self) -> None:
        """Release the KV cache and CUDA graphs now (unpatch calls this), not when the garbage
        collector gets to them, and give up the model (the last Engine on it restores its
        attention and projections). step() raises after."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.core.shutdown()
            self.inputs.shutdown()  # its grammar compiler's thread
            self._release_model()

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()


def _give_back(model: torch.nn.Module, engine: Engine, lease) -> None:
    """The engine lets go of the model; the last Engine on it puts back its attention, its
    projections, its LoRA layers and its tensor-parallel ranks."""
    from hf_paged.integrations.transformers import disable_paged_attention

    if not disable_paged_attention(model, engine):
        return
    if lease.fused:
        from hf_paged.integrations.fused_projections import unfuse_projections

        unfuse_projections(model)
    # FP8 checkpoint layers, LoRA routing, tensor-parallel ranks: after unfusing
    for held in (lease.fp8_checkpoint, lease.lora, lease.tp):
        if held is not None:
            held.close()


def _prepare_weights(
    model: torch.nn.Module, config: EngineConfig, lease, startup: StartupTimes
) -> int:
    """Tensor-parallel sharding (the other ranks started on their shards: hf_paged/distributed),
    an FP8 checkpoint's layers onto hf_paged's FP8 kernels, fused projections (per rank), then
    FP8 weights (the fused matrices quantised as one); a model that cannot be quantised is
    refused before it is touched. Returns the fused groups."""
    if config.tensor_parallel_size > 1:
        from hf_paged.distributed import TensorParallelExecutor

        lease.tp = TensorParallelExecutor(model, config, lease)
    if config.quantization is not None:
        check_quantizable(model, config.quantization)
    if lease.fp8_checkpoint is None and lease.tp is None:  # before fusing: fused as FP8
        lease.fp8_checkpoint = Fp8Checkpoint(model) or None
    fused = 0
    if config.fuse_projections:
        with startup.phase("fuse_projections"):
            fused = fuse_projections(model)
    if config.quantization is not None:
        with startup.phase("quantize"):
            quantize_model(model, config.quantization)
    return fused
