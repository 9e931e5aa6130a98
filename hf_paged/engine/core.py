"""The step loop: schedule -> run -> update -> outputs, synchronously or one step ahead.

EngineCore owns the scheduler (with the KV cache manager), the runner and the output processor,
and moves plain data between them in one direction: the scheduler's ScheduledBatch goes to the
runner, the runner's ModelRunnerOutput goes back to the scheduler, and the requests that advanced
or ended go to the output processor. It takes no locks: Engine calls it under its step lock.
"""

from __future__ import annotations

import time

from hf_paged.config import EngineConfig
from hf_paged.core.kv_cache_manager import KVCacheManager
from hf_paged.core.outputs import ModelRunnerOutput, SchedulerOutput
from hf_paged.core.request import RequestOutput, RequestStatus
from hf_paged.core.scheduler import Scheduler
from hf_paged.engine.output_processor import OutputProcessor
from hf_paged.spec_decode.draft_model import check_draft, draft_bytes_per_block
from hf_paged.spec_decode.spec_decoder import build_spec_decoder
from hf_paged.worker.model_runner import ModelRunner


class EngineCore:
    def __init__(
        self, model, config: EngineConfig, lora=None, tokenizer=None, tp=None, startup=None
    ) -> None:
        """startup: the Engine's StartupTimes (worker/startup_times.py), which the runner and
        the speculative decoder's set-up add their phases to."""
        self.config = config
        reserved = 0
        if config.draft_model is not None:  # its KV shares the target's block ids
            check_draft(config.draft_model, model)
            reserved = draft_bytes_per_block(config.draft_model, config)
        self.runner = ModelRunner(
            model,
            config,
            lora=lora is not None,
            reserved_bytes_per_block=reserved,
            tp=tp,
            startup=startup,
        )
        try:
            with self.runner.startup.phase("speculative"):
                self.runner.spec = build_spec_decoder(self.runner, config)
        except BaseException:
            self.runner.shutdown()
            raise
        # a PeftModel's hf_paged.lora.routing.LoraRouting: each step's adapters get their slots
        self.lora = lora
        if lora is not None:
            lora.attach(self.runner.input_batch)
        with self.runner.startup.phase("setup"):
            self.kv = KVCacheManager(
                self.runner.num_blocks, config.block_size, config.enable_prefix_caching
            )
            self.scheduler = Scheduler(config, self.kv)
            if lora is not None:  # at most max_loras adapters running at once; the rest wait
                self.scheduler.lora_room = lora.room
            self.output_processor = OutputProcessor(self.scheduler, tokenizer)
        self.num_steps = 0
        self.peak_blocks_used = 0
        # beam search groups in flight (hf_paged.generation.beam_search): each takes its beams'
        # logits rows from the runner's output and, once it has them all, one beam step
        self.beam_groups: set = set()
        self._inflight = None  # async_scheduling: (SchedulerOutput, PendingOutput) launched
        self._last_step_end: float | None = None  # when the last step returned outputs
        self._decode_only = False  # the last scheduled step had no prefill tokens
        self._verified = False  # the last scheduled step verified proposals

    def shutdown(self) -> None:
        """The runner's KV cache and graphs go; its rows no longer hold LoRA slots."""
        if self.lora is not None:
            self.lora.detach(self.runner.input_batch)
        self.runner.shutdown()

    def release_rows(self) -> None:
        """The runner drops what it holds for requests that left the running set (whatever
        ended them: the scheduler's end_requests and preemption queue their ids)."""
        released = self.scheduler.take_released_req_ids()
        if released:
            self.runner.release(released)

    def step(self) -> list[RequestOutput]:
        spec = self.runner.spec
        may_speculate = spec.draft is not None or self.scheduler.requests.num_prompt_lookup
        if may_speculate:
            batch_size = self._batch_size_estimate()
            spec.plan(batch_size)  # speculate from this step's end on, or not
        else:
            spec.policy.k_next = 0
            self._last_step_end = None  # no stale start for the next measured step
        # structured output: a request whose grammar failed to compile ends alone (with its
        # siblings, FINISHED_ERROR), reported now
        failed = self.scheduler.compiling.take_failed()
        if failed:
            failed = self.scheduler.end_requests(failed, RequestStatus.FINISHED_ERROR)
        if self.config.async_scheduling:
            outputs = self._step_async()
        else:
            outputs = self._step_sync()
        if failed:
            outputs = self.output_processor.make_outputs([], failed) + outputs
        if may_speculate:  # a step counts as speculating when it verified proposals
            self._measure(batch_size, outputs, self._verified)
        return outputs

    def _measure(self, batch_size: int, outputs: list[RequestOutput], speculated: bool) -> None:
        """Decode steps' output rates, with and without speculation, for the policy that
        turns it on and off (spec_decode/policy.py). A step is timed from the end of the one
        before; a step with prefill tokens or after an idle call is not counted."""
        now = time.perf_counter()
        last, self._last_step_end = self._last_step_end, (now if outputs else None)
        if last is not None and outputs and self._decode_only:
            tokens = sum(len(o.new_token_ids) for o in outputs)
            self.runner.spec.policy.observe(batch_size, now - last, tokens, speculated)

    def _schedule(self) -> SchedulerOutput:
        sched = self.scheduler.schedule()
        spec = sched.batch.spec_token_ids
        extra = sum(len(t) for t in spec.values()) if spec else 0
        self._decode_only = sched.total_num_scheduled_tokens == len(sched) + extra
        self._verified = extra > 0
        used = self.kv.num_blocks - self.kv.get_num_free_blocks()
        self.peak_blocks_used = max(self.peak_blocks_used, used)
        if not sched.requests and sched.batch.released_req_ids:  # no step to carry them
            self.runner.release(sched.batch.released_req_ids)
        return sched

    def _step_sync(self) -> list[RequestOutput]:
        sched = self._schedule()
        if not sched.requests:
            self._check_progress()
            return []
        runner_out = self.runner.execute(sched.batch)
        self.num_steps += 1
        return self._after_execute(sched, runner_out, launched=False)

    def _step_async(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        if not self._can_run_ahead():  # this step's sampling reads tokens on the host
            if self._inflight is not None:
                outputs = self._resolve_inflight()
            return outputs + self._step_sync()
        sched = self._schedule()
        if not sched.requests:
            if self._inflight is not None:  # e.g. every running request awaits its last token
                return self._resolve_inflight()
            self._check_progress()
            return []
        pending = self.runner.execute(sched.batch, async_output=True)
        self.scheduler.on_launched(sched, pending.sample_rows)
        self.num_steps += 1
        if self._inflight is not None:  # the GPU now runs this step while the host reads the last
            # (a step with grammar-constrained rows queues its sampling in the next execute:
            # ModelRunner._defer_sampling has the order)
            outputs = self._resolve_inflight()
        self._inflight = (sched, pending)
        return outputs

    def _check_progress(self) -> None:
        """Nothing was scheduled: fine while grammars compile (wait a little for one), a bug
        otherwise."""
        if self.scheduler.compiling:
            self.scheduler.compiling.wait()  # only compiling requests wait: no spinning
        elif self.scheduler.has_unfinished_requests():
            raise RuntimeError("scheduler made no progress with requests pending")

    def _can_run_ahead(self) -> bool:
        """Asynchronous steps need no value on the host: no beams, no request whose sampling
        reads its history, and no speculation (proposals are made from the known tokens)."""
        return (
            not self.beam_groups
            and not self.scheduler.requests.num_sync_only
            and not self.runner.spec.wants_sync()
        )

    def _batch_size_estimate(self) -> int:
        """Requests the next step may carry: the running ones and those waiting to join."""
        sched = self.scheduler
        return min(len(sched.running) + len(sched.waiting), self.config.max_num_seqs)

    def _resolve_inflight(self) -> list[RequestOutput]:
        sched, pending = self._inflight
        self._inflight = None
        return self._after_execute(sched, self.runner.finish_async(pending), launched=True)

    def _after_execute(
        self, sched: SchedulerOutput, runner_out: ModelRunnerOutput, launched: bool
    ) -> list[RequestOutput]:
        self.output_processor.add_records(runner_out)
        advanced, ended = self.scheduler.update_from_output(sched, runner_out, launched)
        if self.beam_groups:  # groups whose beams all have their logits take a beam step
            for group in self.beam_groups:
                group.add_logits(runner_out.beam_logits)
            for group in [g for g in self.beam_groups if g.ready()]:
                group.step_or_fail()
            self.beam_groups = {g for g in self.beam_groups if not g.done}
        return self.output_processor.make_outputs(advanced, ended)

    def stats(self) -> dict:
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
            **(self.runner.spec.stats() if self.runner.spec is not None else {}),
        }

    def check_invariants(self) -> None:
        """Everything held has a live owner (see Engine.check_invariants)."""
        sched, kv, ib = self.scheduler, self.kv, self.runner.input_batch
        kv.check_invariants()
        live = sched.requests
        assert live.num_sync_only == sum(not r.async_ok for r in live.values()), "sync count"
        lookup = sum(r.sampling_params.prompt_lookup_num_tokens > 0 for r in live.values())
        assert live.num_prompt_lookup == lookup, "prompt lookup count"
        running = {r.request_id for r in sched.running}
        assert len(running) == len(sched.running), "a request is in running twice"
        for r in sched.running:
            assert r.status == RequestStatus.RUNNING, f"{r.request_id} running as {r.status}"
            assert live.get(r.request_id) is r, f"running {r.request_id} not in the table"
        waiting = set()
        for r in sched.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), r.status
            assert live.get(r.request_id) is r, f"waiting {r.request_id} not in the table"
            assert not r.in_runner, f"waiting {r.request_id} holds a runner row"
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
        held_rows = {rid for rid in running if live[rid].in_runner}
        assert held_rows == set(rows), f"rows and in_runner disagree: {held_rows ^ set(rows)}"
        for rid, row in rows.items():
            assert ib.sampling[row] is not None and ib.sampling[row].req_id == rid, rid
        assert len(set(ib.free_rows)) == len(ib.free_rows), "a row freed twice"
        assert not set(ib.free_rows) & set(rows.values()), "a row both free and held"
        assert len(ib.free_rows) + len(rows) == ib.max_num_reqs, "runner rows leaked"
        pool = ib.penalty_counts
        assert set(pool.slot_of) <= set(rows), "penalty rows without an owner"
        for rid, slot in pool.slot_of.items():
            assert pool.owners[slot].req_id == rid, f"penalty row {slot} mixed up"
        held = sum(owner is not None for owner in pool.owners)
        assert held == len(pool.slot_of), "penalty rows held outside the index"
        for group in self.beam_groups:
            assert all(b.request_id in live for b in group.beams), "a beam ended early"
        if not sched.has_unfinished_requests():
            assert kv.get_num_free_blocks() == kv.num_blocks, "KV blocks leaked"
            assert not kv.req_to_blocks, "finished requests still hold blocks"
            assert not rows, "finished requests still hold runner rows"
