"""One token budget per step, shared by running and waiting requests (vLLM V1 style).

Each step the scheduler hands out up to max_num_batched_tokens tokens: first to running requests
(one token for a decode, the next chunk for an unfinished prefill), then to waiting requests in
policy order (their first chunk, after prefix-cache hits). When blocks run out, the lowest-ranked
running request (the newest for FCFS) is preempted by recompute: its blocks are freed, its
num_computed_tokens is reset, and it waits at the front of the queue. Its full blocks usually
survive in the prefix cache, so the recompute is mostly cache hits.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from hf_paged.config import EngineConfig
from hf_paged.core.adapter_seats import AdapterSeats, held_back
from hf_paged.core.compiling_requests import CompilingRequests
from hf_paged.core.kv_cache_manager import KVCacheManager
from hf_paged.core.outputs import ModelRunnerOutput, NewRequestData, SchedulerOutput
from hf_paged.core.request import Request, RequestStatus
from hf_paged.core.spec_tokens import append_verified, lookahead, scheduled_proposals


class RequestTable(dict):
    """Live requests by id, counting those that must step synchronously (async_ok False: their
    sampling reads the token history on the host). The engine asks before every step whether it
    may run ahead; scanning every live request for that cost ~20 us a step at 1000 requests."""

    def __init__(self) -> None:
        super().__init__()
        self.num_sync_only = 0
        # requests with prompt lookup: while there are none (and no draft model), the engine
        # skips the speculation policy's per-step bookkeeping
        self.num_prompt_lookup = 0

    def __setitem__(self, request_id: str, request: Request) -> None:
        self.pop(request_id, None)
        super().__setitem__(request_id, request)
        self.num_sync_only += not request.async_ok
        self.num_prompt_lookup += request.sampling_params.prompt_lookup_num_tokens > 0

    def pop(self, request_id: str, *default):
        if request_id not in self:
            return super().pop(request_id, *default)
        request = super().pop(request_id)
        self.num_sync_only -= not request.async_ok
        self.num_prompt_lookup -= request.sampling_params.prompt_lookup_num_tokens > 0
        return request

    def __delitem__(self, request_id: str) -> None:
        self.pop(request_id)


class WaitingQueue:
    """FCFS: a deque, preempted requests go back to the front. Priority: a heap on
    (priority, arrival), so a preempted request regains its place by its own key."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[tuple, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, (request.sort_key("priority"), next(self._counter), request))
        else:
            self._fifo.append(request)

    def prepend(self, request: Request) -> None:
        if self.policy == "priority":
            self.add(request)
        else:
            self._fifo.appendleft(request)

    def peek(self) -> Request:
        return self._heap[0][2] if self.policy == "priority" else self._fifo[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2] if self.policy == "priority" else self._fifo.popleft()

    def remove(self, request: Request) -> None:
        if self.policy == "priority":
            self._heap = [e for e in self._heap if e[2] is not request]
            heapq.heapify(self._heap)
        else:
            self._fifo.remove(request)

    def __len__(self) -> int:
        return len(self._heap) if self.policy == "priority" else len(self._fifo)

    def __iter__(self):
        return (e[2] for e in self._heap) if self.policy == "priority" else iter(self._fifo)


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.policy = config.scheduling_policy
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.waiting = WaitingQueue(self.policy)
        self.running: list[Request] = []
        self.requests = RequestTable()
        self.num_preemptions = 0
        self.released_req_ids: list[str] = []  # see take_released_req_ids
        self.compiling = CompilingRequests()  # structured output: grammars not compiled yet
        self.lora_room = None  # a PeftModel's: LoraRouting.room (core/adapter_seats.py)
        # speculative decoding with a draft model: slots each step reserves past its tokens
        self.num_lookahead_tokens = (
            config.num_speculative_tokens if config.draft_model is not None else 0
        )

    # -- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request, siblings: list[Request] | None = None) -> None:
        """Queue a request. siblings (n > 1 samples, or beams): known to the scheduler and
        queued nowhere; they start when the request's prompt is computed (their seats are
        reserved at its admission)."""
        if siblings:
            request.pending_siblings = list(siblings)
            for sibling in siblings:
                self.requests[sibling.request_id] = sibling
        self.requests[request.request_id] = request
        self.waiting.add(request)
        self.compiling.add(request)

    def abort_request(self, request_id: str) -> list[Request]:
        """End a live request (running, waiting, or a sibling not forked yet) as aborted.
        Returns every request that ended: it, and its siblings still waiting for its prompt."""
        return self.end_requests([self.requests[request_id]], RequestStatus.FINISHED_ABORTED)

    def end_requests(self, requests: list[Request], status: RequestStatus) -> list[Request]:
        """The one way out of the scheduler, whatever ends a request (its stop condition, an
        abort, an error in its user code, a beam group that is done): out of running, the
        waiting queue or its parent's pending siblings; blocks freed; off the table; status
        set; its id queued in released_req_ids so the runner drops what it holds for it (row,
        penalty slot). Siblings still waiting for an ended request's prompt end with it.
        Returns every request ended (the given ones first)."""
        ended = [r for r in requests if not r.status.finished]
        for r in list(ended):
            for sibling in r.pending_siblings or ():
                sibling.error = r.error
                ended.append(sibling)
        running = {id(r) for r in ended if r.status == RequestStatus.RUNNING}
        if running:
            self.running = [r for r in self.running if id(r) not in running]
        for r in ended:
            if r.status != RequestStatus.RUNNING:
                parent = self.requests.get(r.parent_request_id or "")
                if parent is not None and r in (parent.pending_siblings or ()):
                    parent.pending_siblings.remove(r)  # never forked: holds nothing
                elif r in self.waiting:
                    self.waiting.remove(r)
            self.kv.free(r)
            self.requests.pop(r.request_id, None)
            r.status = status
            r.pending_siblings = None
            self._release(r)
        return ended

    def take_released_req_ids(self) -> list[str]:
        """Requests that left the running set since the last call (ended or preempted): the
        runner releases their rows. Drained by the engine after every operation."""
        out, self.released_req_ids = self.released_req_ids, []
        return out

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # -- one step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_index: dict[str, int] = {}  # request id -> position in out

        # This loop runs for every running request at every step (it was ~40% of a 256-row
        # decode step's host time): its common case is inlined, _add_to_batch's appends too.
        running = self.running
        allocate, block_ids_of = self.kv.allocate_slots, self.kv.req_to_block_ids
        num_lookahead, batch = self.num_lookahead_tokens, out.batch
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            num_pending = request.num_pending
            num_tokens = len(request.all_token_ids) + num_pending  # request.num_tokens
            num_computed = request.num_computed_tokens
            num_new = min(num_tokens - num_computed, budget)
            if num_new <= 0 or (num_pending and num_tokens >= request.max_total_tokens):
                # (second case: asynchronous scheduling, the token in flight is its last one)
                i += 1
                continue
            spec = request.spec_token_ids
            if spec:
                spec = scheduled_proposals(request, num_new, budget)
                num_new += len(spec)
            slots = (
                lookahead(request, num_computed + num_new, num_lookahead) if num_lookahead else 0
            )
            while allocate(request, num_new, (), slots) is None:
                victim = max(running, key=lambda r: r.sort_key(self.policy))
                self._preempt(victim, out)
                if victim.request_id in scheduled_index:
                    budget += unschedule(victim, out, scheduled_index)
                if victim is request:
                    break
                if running.index(request) < i:  # a victim before us shifted the list
                    i -= 1
            else:
                rid = request.request_id
                scheduled_index[rid] = len(out.requests)
                out.requests.append(request)
                batch.req_ids.append(rid)
                batch.num_scheduled_tokens.append(num_new)
                batch.num_computed_tokens.append(num_computed)
                batch.num_tokens.append(num_tokens)
                batch.block_ids.append(block_ids_of[rid])
                if spec:
                    if batch.spec_token_ids is None:
                        batch.spec_token_ids = {}
                    batch.spec_token_ids[rid] = spec
                budget -= num_new
                i += 1

        # Waiting requests join only when nothing was preempted: memory is tight otherwise.
        if not out.preempted and len(self.waiting):
            # Seats promised to siblings of running parents that have not forked yet: they join
            # running when the parent's prompt is computed, so they count against max_num_seqs.
            reserved = sum(len(r.pending_siblings) for r in self.running if r.pending_siblings)
            skipped: list[Request] = []  # held back this step (grammar compiling, no LoRA seat)
            adapters = AdapterSeats(self.lora_room, self.running) if self.lora_room else None
            while (
                len(self.waiting)
                and budget > 0
                and len(self.running) + reserved < self.max_num_seqs
            ):
                request = self.waiting.peek()
                if held_back(request, adapters):
                    skipped.append(self.waiting.pop())  # those behind it go on
                    continue
                seats = 1 + len(request.pending_siblings or ())
                if len(self.running) + reserved + seats > self.max_num_seqs:
                    break
                hits, num_hit_tokens = [], 0
                if request.num_computed_tokens == 0:
                    hits, num_hit_tokens = self.kv.get_computed_blocks(request)
                num_new = request.num_tokens - num_hit_tokens
                if not self.config.enable_chunked_prefill and num_new > budget:
                    break
                num_new = min(num_new, budget)
                slots = lookahead(request, num_hit_tokens + num_new, self.num_lookahead_tokens)
                if self.kv.allocate_slots(request, num_new, hits, slots) is None:
                    break
                self.waiting.pop()
                request.num_computed_tokens = num_hit_tokens
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_hit_tokens
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                reserved += seats - 1
                self._add_to_batch(out, request, num_new)
                budget -= num_new
            for request in reversed(skipped):  # back in their places
                self.waiting.prepend(request)
        self._finish_batch(out)
        return out

    def _add_to_batch(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        batch = out.batch
        out.requests.append(request)
        batch.req_ids.append(request.request_id)
        batch.num_scheduled_tokens.append(num_new)
        batch.num_computed_tokens.append(request.num_computed_tokens)
        batch.num_tokens.append(request.num_tokens)
        batch.block_ids.append(self.kv.get_block_ids(request.request_id))

    def _finish_batch(self, out: SchedulerOutput) -> None:
        """What the runner must do before the step: drop requests that left the running set or
        whose blocks or history changed other than by appending (a fork, a copy-on-write, a beam
        rewrite), copy the copied-on-write blocks, and take the requests it does not hold."""
        batch = out.batch
        copies, changed = self.kv.take_block_changes()
        batch.block_copies = copies
        for request_id in changed:
            request = self.requests.get(request_id)
            if request is not None and request.in_runner:
                self._release(request)
        batch.released_req_ids = self.take_released_req_ids()
        for request in out.requests:
            if not request.in_runner:
                request.in_runner = True
                batch.new_requests.append(new_request_data(request))

    def _release(self, request: Request) -> None:
        """The runner drops what it holds for the request (its row, its sampling state)."""
        request.in_runner = False
        self.released_req_ids.append(request.request_id)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)
        out.preempted.append(request)
        self._release(request)

    def _fork_siblings(self, parent: Request, fork_tokens: dict | None) -> list[Request]:
        """The parent's prompt is computed and it sampled its first token: its siblings take its
        blocks by reference and their own first tokens, sampled from the same logits row."""
        fork_tokens = fork_tokens or {}
        tokens = [fork_tokens.get(s.request_id) for s in parent.pending_siblings]
        if None in tokens:
            raise RuntimeError(f"no first tokens for the siblings of {parent.request_id}")
        siblings = self.start_siblings(parent)
        for sibling, token in zip(siblings, tokens):
            sibling.all_token_ids.append(token)
        return siblings

    # -- beams and siblings: the narrow interface beam search uses ---------------------------------

    def start_siblings(self, parent: Request) -> list[Request]:
        """The parent's pending siblings start running as copies of it: its blocks by reference
        (copy-on-write of a shared partial block), its progress."""
        siblings, parent.pending_siblings = parent.pending_siblings or [], None
        for sibling in siblings:
            self.kv.fork(parent, sibling)
            sibling.num_computed_tokens = parent.num_computed_tokens
            sibling.num_cached_tokens = parent.num_cached_tokens
            sibling.status = RequestStatus.RUNNING
            self.running.append(sibling)
        return siblings

    def rewrite_beams(self, beams: list[Request], sources: list[int], tokens: list[int]) -> None:
        """A beam step: beam j continues beam sources[j] plus tokens[j]. Block references move
        (no KV is copied: full blocks stay shared, a shared partial block is copied on write);
        the runner rebuilds the beams' rows at their next step (their block tables and token
        histories changed other than by appending)."""
        old_tokens = [list(b.all_token_ids) for b in beams]
        old_computed = [b.num_computed_tokens for b in beams]
        self.kv.reassign(beams, sources)
        for b, src, tok in zip(beams, sources, tokens):
            b.all_token_ids = old_tokens[src] + [tok]
            b.num_computed_tokens = old_computed[src]

    def on_launched(self, out: SchedulerOutput, sample_rows: list[int]) -> None:
        """Asynchronous scheduling: the step is on the GPU, its tokens count as computed, and
        each request that samples (indices into out.requests) has one more token whose value is
        pending until update_from_output(..., launched=True)."""
        requests = out.requests
        for request, num in zip(requests, out.num_scheduled_tokens):
            request.num_computed_tokens += num
        for i in sample_rows:
            requests[i].num_pending += 1

    def update_from_output(
        self, out: SchedulerOutput, runner_output: ModelRunnerOutput, launched: bool = False
    ) -> tuple[list[Request], list[Request]]:
        """Advance progress (unless on_launched already did), append sampled tokens, end requests
        that stop (an end-of-sequence or stop id, their length) or whose user code raised.
        Returns (requests that got a token, requests that ended). An exception in one request's
        user code (runner_output.failed: a logits processor) ends that request with
        FINISHED_ERROR and the exception on it; the other requests of the step go on as usual.
        With asynchronous scheduling, a request may have finished or been preempted since the
        step was launched: a finished one drops its token (computed past its end), a preempted
        one keeps it."""
        advanced: list[Request] = []
        ended: dict[RequestStatus, list[Request]] = {}
        failed = runner_output.failed
        spec = out.batch.spec_token_ids
        proposals = runner_output.spec_token_ids
        for request, num, token in zip(
            out.requests, out.num_scheduled_tokens, runner_output.sampled_token_ids
        ):
            if not launched:
                request.num_computed_tokens += num
            if request.status.finished:
                continue
            if failed and request.request_id in failed:
                request.error = failed[request.request_id]
                ended.setdefault(RequestStatus.FINISHED_ERROR, []).append(request)
                continue
            if token < 0:
                continue
            if launched:
                request.num_pending -= 1
            if spec and request.request_id in spec:
                append_verified(request, spec[request.request_id], runner_output.accepted_token_ids)
                check_stop(request, ended)
            else:
                tokens = request.all_token_ids  # check_stop's test inlined below (every row)
                tokens.append(token)
                request.num_new_tokens = 1
                if token in request.eos_token_ids or len(tokens) >= request.max_total_tokens:
                    check_stop(request, ended)
            advanced.append(request)
            if request.pending_siblings:  # before the parent may finish and free its blocks
                for sibling in self._fork_siblings(request, runner_output.fork_token_ids):
                    sibling.num_new_tokens = 1
                    advanced.append(sibling)
                    check_stop(sibling, ended)
            if proposals and not request.status.finished and request.request_id in proposals:
                request.spec_token_ids = proposals[request.request_id]
        finished: list[Request] = []
        for status, requests in ended.items():
            finished += self.end_requests(requests, status)
        return advanced, finished


def check_stop(request: Request, ended: dict[RequestStatus, list[Request]]) -> None:
    """File the request under the finished status its last token gives it, if any: an
    end-of-sequence or stop id, or its length limit. (Stop strings and user stopping
    criteria run in the engine's output processor, which ends requests through
    end_requests.)"""
    if request.all_token_ids[-1] in request.eos_token_ids:
        status = RequestStatus.FINISHED_STOPPED
    elif len(request.all_token_ids) >= request.max_total_tokens:
        status = RequestStatus.FINISHED_LENGTH
    else:
        return
    ended.setdefault(status, []).append(request)


def unschedule(request: Request, out: SchedulerOutput, index: dict[str, int]) -> int:
    pos = index.pop(request.request_id)
    b = out.batch
    num = b.num_scheduled_tokens[pos]
    del out.requests[pos], b.req_ids[pos], b.num_scheduled_tokens[pos]
    del b.num_computed_tokens[pos], b.num_tokens[pos], b.block_ids[pos]
    if b.spec_token_ids:
        b.spec_token_ids.pop(request.request_id, None)
    for rid, p in index.items():
        if p > pos:
            index[rid] = p - 1
    return num


def new_request_data(request: Request) -> NewRequestData:
    """What the runner needs of a request it does not hold (see NewRequestData)."""
    siblings = None
    if request.pending_siblings and request.sampling_params.n > 1:
        siblings = [new_request_data(s) for s in request.pending_siblings]
    return NewRequestData(
        req_id=request.request_id,
        token_ids=list(request.all_token_ids),
        num_prompt_tokens=len(request.prompt_token_ids),
        sampling_params=request.sampling_params,
        generator=request.generator,
        stop_token_ids=request.eos_token_ids,
        banned_token_ids=request.banned_token_ids,
        bad_word_prefixes=request.bad_word_prefixes,
        siblings=siblings,
        max_total_tokens=request.max_total_tokens,
        grammar=request.grammar.compiled if request.grammar is not None else None,
    )
