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
from dataclasses import dataclass, field

from hf_paged.config import EngineConfig
from hf_paged.core.kv_cache_manager import KVCacheManager
from hf_paged.core.request import Request, RequestStatus
from hf_paged.core.stop_checker import should_stop


@dataclass(slots=True)
class SchedulerOutput:
    """The step's batch: requests in batch order and how many new tokens each computes."""

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def __len__(self) -> int:
        return len(self.requests)


@dataclass(slots=True)
class ModelRunnerOutput:
    """sampled_token_ids[i] belongs to SchedulerOutput.requests[i]; -1 where nothing was sampled
    (a prefill chunk that does not reach the end of the request's tokens)."""

    sampled_token_ids: list[int]
    # n > 1: parent request id -> first tokens of its pending siblings (same logits row)
    fork_token_ids: dict[str, list[int]] | None = None
    # request id -> what its own user code (a logits processor) raised; its token is void
    failed: dict[str, BaseException] | None = None

    @classmethod
    def from_rows(
        cls,
        num_seqs: int,
        sample_rows: list[int],
        tokens: list[int],
        fork_token_ids=None,
        failed=None,
    ) -> ModelRunnerOutput:
        """tokens[j] was sampled by request sample_rows[j]; the others sampled nothing."""
        if len(sample_rows) == num_seqs:  # a decode step: every request sampled, in order
            sampled = list(tokens)
        else:
            sampled = [-1] * num_seqs
            for i, t in zip(sample_rows, tokens):
                sampled[i] = t
        return cls(sampled_token_ids=sampled, fork_token_ids=fork_token_ids, failed=failed)


class RequestTable(dict):
    """Live requests by id, counting those that must step synchronously (async_ok False: their
    sampling reads the token history on the host). The engine asks before every step whether it
    may run ahead; scanning every live request for that cost ~20 us a step at 1000 requests."""

    def __init__(self) -> None:
        super().__init__()
        self.num_sync_only = 0

    def __setitem__(self, request_id: str, request: Request) -> None:
        self.pop(request_id, None)
        super().__setitem__(request_id, request)
        self.num_sync_only += not request.async_ok

    def pop(self, request_id: str, *default):
        if request_id not in self:
            return super().pop(request_id, *default)
        request = super().pop(request_id)
        self.num_sync_only -= not request.async_ok
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

    # -- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.add(request)

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
            self.released_req_ids.append(r.request_id)
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

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0 or (
                request.num_pending and request.num_tokens >= request.max_total_tokens
            ):
                # (second case: asynchronous scheduling, the token in flight is its last one)
                i += 1
                continue
            while self.kv.allocate_slots(request, num_new) is None:
                victim = max(self.running, key=lambda r: r.sort_key(self.policy))
                self._preempt(victim, out)
                if victim.request_id in scheduled_index:
                    budget += self._unschedule(victim, out, scheduled_index)
                if victim is request:
                    break
                if self.running.index(request) < i:  # a victim before us shifted the list
                    i -= 1
            else:
                scheduled_index[request.request_id] = len(out.requests)
                out.requests.append(request)
                out.num_scheduled_tokens.append(num_new)
                budget -= num_new
                i += 1

        # Waiting requests join only when nothing was preempted: memory is tight otherwise.
        if not out.preempted and len(self.waiting):
            # Seats promised to siblings of running parents that have not forked yet: they join
            # running when the parent's prompt is computed, so they count against max_num_seqs.
            reserved = sum(len(r.pending_siblings) for r in self.running if r.pending_siblings)
            while (
                len(self.waiting)
                and budget > 0
                and len(self.running) + reserved < self.max_num_seqs
            ):
                request = self.waiting.peek()
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
                if self.kv.allocate_slots(request, num_new, hits) is None:
                    break
                self.waiting.pop()
                request.num_computed_tokens = num_hit_tokens
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_hit_tokens
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                reserved += seats - 1
                out.requests.append(request)
                out.num_scheduled_tokens.append(num_new)
                budget -= num_new
        return out

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)
        out.preempted.append(request)
        self.released_req_ids.append(request.request_id)

    @staticmethod
    def _unschedule(request: Request, out: SchedulerOutput, index: dict[str, int]) -> int:
        pos = index.pop(request.request_id)
        num = out.num_scheduled_tokens[pos]
        del out.requests[pos], out.num_scheduled_tokens[pos]
        for rid, p in index.items():
            if p > pos:
                index[rid] = p - 1
        return num

    def _fork_siblings(self, parent: Request, fork_tokens: dict | None) -> list[Request]:
        """The parent's prompt is computed and it sampled its first token: its siblings take its
        blocks by reference and their own first tokens, sampled from the same logits row."""
        siblings, parent.pending_siblings = parent.pending_siblings, None
        tokens = (fork_tokens or {}).get(parent.request_id)
        if tokens is None or len(tokens) != len(siblings):
            raise RuntimeError(f"no first tokens for the siblings of {parent.request_id}")
        for sibling, token in zip(siblings, tokens):
            self.kv.fork(parent, sibling)
            sibling.num_computed_tokens = parent.num_computed_tokens
            sibling.num_cached_tokens = parent.num_cached_tokens
            sibling.status = RequestStatus.RUNNING
            sibling.all_token_ids.append(token)
            self.running.append(sibling)
        return siblings

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
        that stop or whose user code raised. Returns (requests that got a token, requests that
        ended). An exception in one request's user code (runner_output.failed: a logits
        processor; here: a stopping criterion) ends that request with FINISHED_ERROR and the
        exception on it; the other requests of the step go on as usual.
        With asynchronous scheduling, a request may have finished or been preempted since the
        step was launched: a finished one drops its token (computed past its end), a preempted
        one keeps it."""
        advanced: list[Request] = []
        ended: dict[RequestStatus, list[Request]] = {}
        failed = runner_output.failed
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
            request.all_token_ids.append(token)
            advanced.append(request)
            if request.pending_siblings:  # before the parent may finish and free its blocks
                for sibling in self._fork_siblings(request, runner_output.fork_token_ids):
                    advanced.append(sibling)
                    self._check_stop(sibling, ended)
            self._check_stop(request, ended)
        finished: list[Request] = []
        for status, requests in ended.items():
            finished += self.end_requests(requests, status)
        return advanced, finished

    @staticmethod
    def _check_stop(request: Request, ended: dict[RequestStatus, list[Request]]) -> None:
        """File the request under the finished status its last token gives it, if any. A stop
        string or user criterion runs the user's code: if it raises, this request fails alone
        (FINISHED_ERROR, the exception on it)."""
        if request.all_token_ids[-1] in request.eos_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif len(request.all_token_ids) >= request.max_total_tokens:
            status = RequestStatus.FINISHED_LENGTH
        elif request.stop_checkers is None:
            return
        else:
            try:
                if not should_stop(request):
                    return
                status = RequestStatus.FINISHED_STOPPED  # a stop string or user criterion
            except Exception as exc:
                request.error = exc
                status = RequestStatus.FINISHED_ERROR
        ended.setdefault(status, []).append(request)
