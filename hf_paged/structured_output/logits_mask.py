"""The sampler's one structured output hook: grammar matchers -> token bitmask -> masked logits.

Two parts:

prepare (host only, GrammarBitmask.prepare or .start): each constrained row catches its matcher
  up with the row's output tokens (usually one token a row: one batched accept for all of them;
  a row rebuilt after preemption replays every output token, so recompute needs no rollback),
  then the rows fill their rows of an int32 bitmask [rows, ceil(V / 32)] (xgrammar's batch fill,
  on several threads). Under asynchronous scheduling the runner defers a constrained step's
  sampling and start() runs these two xgrammar calls on a helper thread from the moment the
  previous step's tokens land, beside the step loop's own work (worker/deferred_sampling.py has
  the order); the Python around them stays on the step loop's thread (GrammarJob says why).
apply (GrammarBitmask.apply): one host-to-device copy and one kernel
  (xgrammar.apply_token_bitmask_inplace: CUDA/Triton on a GPU, its C++ loop on the CPU) on the
  constrained rows only. Unconstrained rows are not read or written; a step without a
  constrained row never gets here (the sampler checks the F_STRUCTURED bit).
  A step whose rows are all greedy takes GrammarBitmask.argmax instead: on a GPU the copy and
  one argmax kernel that reads the bitmask beside the logits (kernels/argmax.py, allowed=), so
  the masked logits are never written. That step's sampling is on the chain from one step's
  tokens to the next step's (worker/deferred_sampling.py): H200, 256 rows of 32,000 logits,
  xgrammar's apply took 0.19 ms and the sampler's general path (a float32 copy of the logits,
  the apply, the processors' checks, an argmax) 0.47-0.66 ms of host time a step.

The mask is applied to the raw logits, before penalties, temperature and the top-k/top-p/min-p
filters: the draw is from the model's distribution restricted to the grammar's tokens, and
recorded logits/logprobs of a constrained row are of that masked distribution.
"""

from __future__ import annotations

import itertools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from hf_paged.gil_switch import switch_interval
from hf_paged.structured_output import batch_calls
from hf_paged.structured_output.batch_calls import BatchCalls
from hf_paged.structured_output.constraint import import_xgrammar
from hf_paged.worker.host_to_device import to_device

HELPER_SWITCH_INTERVAL_S = 1e-4  # the GIL switch interval while a grammar job runs


class RowMatcher:
    """A running row's grammar state. stop_token_ids: the request's end-of-sequence and stop
    ids, the only tokens the grammar allows once it is complete (sampling one ends the request,
    and the scheduler's stop check ends it as for any request)."""

    __slots__ = ("matcher", "handle", "num_accepted", "stops")

    def __init__(self, compiled, stop_token_ids) -> None:
        xgr = import_xgrammar()
        self.stops = frozenset(stop_token_ids)
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(self.stops))
        self.handle = batch_calls.handle(self.matcher)  # what the batched calls take
        # output tokens the matcher has consumed (but a steady run's: RepeatRows.lag)
        self.num_accepted = 0

    def unseen(self, token_ids: list[int], num_prompt_tokens: int) -> list[int]:
        """The row's output tokens the matcher has not accepted yet."""
        return token_ids[num_prompt_tokens + self.num_accepted :]

    def accept(self, tokens: list[int]) -> int | None:
        """Accept tokens one by one. Returns the first token the grammar refuses (the matcher
        stays before it), or None."""
        for token in tokens:
            if not self.matcher.accept_token(token):
                return token
            self.num_accepted += 1
        return None


@dataclass(slots=True)
class GrammarMask:
    """A step's bitmask on the host: rows[k] of the sampler's rows is constrained by
    bitmask[k]; failed: request id -> why its row cannot go on (a refused token)."""

    bitmask: torch.Tensor | None  # int32 [num_rows, ceil(V / 32)]; None: no row to mask
    sel: list[int]
    num_rows: int
    failed: dict = field(default_factory=dict)


@dataclass(slots=True)
class GrammarJob:
    """One step's grammar work, split so that the part that may run on other threads is little
    more than xgrammar's calls: gathered from the rows on the step loop's thread
    (GrammarBitmask.gather), run (GrammarBitmask.run: accept the new tokens, fill the bitmask),
    finished on the step loop's thread again (GrammarBitmask.finish). xgrammar's calls release
    the GIL; any Python the helper runs needs it back from the step loop, which holds it nearly
    all the time, so the helper's Python is kept to two calls (a per-row call there, such as
    the is_terminated() of each row, would hand the GIL over hundreds of times a step).

    Rows with one new token each (every decode step after a row's first) go through one batched
    accept; rows replaying several (rebuilt after preemption) accept token by token. Only rows
    that go on are filled (filling a matcher that accepted its stop token is an error): a
    one-token row goes on unless its token is one of its stop tokens, which the matcher accepts
    only as its grammar's end, so that is known before the accept; a replaying row's is read
    after it."""

    req_ids: list[str]  # of the constrained rows, in sel's order
    sel: list[int]  # the constrained rows among the sampler's rows
    states: list[RowMatcher]
    one: list[int]  # positions (in sel) of the rows with one new token
    one_handles: list  # (batch_calls.handle of their matchers)
    one_tokens: list[int]
    replay: list[tuple[int, list[int]]]  # (position in sel, new tokens) of the other rows
    # the one-token rows to fill: their matchers' handles and bitmask rows (built on the step
    # loop's thread, as the helper's own Python needs the GIL back: see above)
    fill_handles: list
    fill_rows: list[int]
    bitmask: torch.Tensor
    accepted: object = None  # the batched accept's result (one's order), set by run()
    all_accepted: bool = True  # whether that result is all True, set by run()
    refused: dict = field(default_factory=dict)  # position -> the replaying row's refused token
    ended: set = field(default_factory=set)  # positions of replaying rows now terminated
    # every row has one new token, none a stop token: finish() only counts, when all accepted
    steady: bool = False
    clean: bool = False  # finish() ran (the counts include this job's tokens), every row goes on


@dataclass(slots=True)
class RepeatRows:
    """The last steady job's rows, for GrammarBitmask.gather's repeat: the same rows one step
    on need none of the per-row work but reading each row's new token."""

    rows: list  # the sampler's rows (compared by identity)
    job: GrammarJob
    histories: list  # the constrained rows' token lists (appended to in place by the runner)
    expected: list  # their lengths one token on from job's gather
    stops: frozenset  # every constrained row's stop tokens
    # steady steps whose token each of job.states has accepted but not counted yet (counted
    # when the run ends: GrammarBitmask._forget), so a steady finish does no per-row work
    lag: int = 0


def fill_threads() -> int:
    """Threads for the batch fill: half the cores this process may use, at most 4. (xgrammar's
    'auto' takes half of std::thread::hardware_concurrency(), every core of the host, which
    oversubscribes a container that is given a few of them. H200 host, 16 cores, 256 rows:
    1.13 ms on 4 threads, 1.27 on 8, 2.32 on 1: grammar_mask_bench.py.)"""
    return max(1, min(4, len(os.sched_getaffinity(0)) // 2))


class GrammarBitmask:
    """Owned by the sampler: the host bitmask buffer (pinned on a GPU, grown on demand), the
    batch matcher, and the helper thread that runs a deferred step's grammar work beside the
    step loop (start())."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host: torch.Tensor | None = None
        self._batch: BatchCalls | None = None  # made on first use
        self._helper: ThreadPoolExecutor | None = None
        self._last: RepeatRows | None = None  # the last steady job (gather's repeat)

    def prepare(self, rows: list, vocab: int) -> GrammarMask:
        """Catch the rows' matchers up with their histories and fill their bitmask, on this
        thread."""
        job = self.gather(rows, vocab)
        if job is None:
            return GrammarMask(None, [], len(rows))
        self.run(job)
        return self.finish(job, len(rows))

    def start(self, rows: list, vocab: int) -> EarlyMask:
        """prepare() with its xgrammar work on the helper thread: gather now, run there, finish
        in EarlyMask.result(). Until then nothing else may touch these rows' matchers or the
        bitmask buffer (worker/deferred_sampling.py starts it as the rows' tokens land and
        takes the result before any other sampling). One thread: a step's rows split over four
        helpers were slower (H200, 256 rows: their four batched accepts took 9.0 ms of thread
        time a step together, against 0.7 ms for all the rows on one thread)."""
        job = self.gather(rows, vocab)
        if job is None:
            return EarlyMask(self, None, None, len(rows))
        if self._helper is None:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="hf-paged-grammar")
        # the helper needs the GIL three times a job (to start, and after each of its two
        # xgrammar calls, which release it): a short switch interval while it runs, given back
        # as its work ends, not when its mask is taken (a deferred sampling may wait unlaunched
        # for long: an engine idle after its last request ended)
        switch_interval.acquire(HELPER_SWITCH_INTERVAL_S)
        try:
            future = self._helper.submit(self.run, job)
        except BaseException:
            switch_interval.release(HELPER_SWITCH_INTERVAL_S)
            raise
        future.add_done_callback(lambda _: switch_interval.release(HELPER_SWITCH_INTERVAL_S))
        return EarlyMask(self, future, job, len(rows))

    def close(self) -> None:
        self._forget()  # (it holds the last steady step's rows)
        if self._helper is not None:
            self._helper.shutdown(wait=True)
            self._helper = None

    def gather(self, rows: list, vocab: int) -> GrammarJob | None:
        """The constrained rows, their new tokens, the rows to fill (step loop's thread: reads
        the rows). A decode step whose rows are the last steady job's, each one token on,
        repeats that job's lists (repeat()); otherwise the rows are read one by one."""
        job = self.repeat(rows, vocab)
        return job if job is not None else self._gather_rows(rows, vocab)

    def repeat(self, rows: list, vocab: int) -> GrammarJob | None:
        """The last steady job again, with each row's new token, when that job finished with
        every row going on and these are its rows: then each row sampled once since (one
        token, checked by the rows' lengths) and none sampled a stop token (checked),
        and the job's lists hold (H200 host, 256 rows: the per-row loop took ~0.2 ms of the
        step loop's time a step, on the chain from one step's tokens to the next's sampling:
        docs/structured_output.md). None: read the rows."""
        last = self._last
        if last is None or not last.job.clean or rows != last.rows:
            return None
        histories = last.histories
        lengths = list(map(len, histories))  # (map, not a loop: these run per step)
        if lengths != last.expected:
            return None
        tokens = [ids[-1] for ids in histories]
        if not last.stops.isdisjoint(tokens):
            return None
        old = last.job
        job = GrammarJob(
            old.req_ids, old.sel, old.states, old.one, old.one_handles, tokens, [],
            list(old.one_handles), list(old.sel), self._buffer(len(rows), (vocab + 31) // 32),
            steady=True,
        )  # fmt: skip
        last.job, last.expected = job, list(map((1).__add__, lengths))
        return job

    def _forget(self) -> None:
        """Drop the last steady job, first counting the steady steps its rows have not counted
        (RepeatRows.lag): every matcher count is exact again."""
        last, self._last = self._last, None
        if last is not None and last.lag:
            for state in last.job.states:
                state.num_accepted += last.lag

    def _gather_rows(self, rows: list, vocab: int) -> GrammarJob | None:
        self._forget()
        req_ids, sel, states, one, one_handles, one_tokens = [], [], [], [], [], []
        replay, fill_handles, fill_rows = [], [], []
        for i, row in enumerate(rows):
            state = row.structured
            if state is None:
                continue
            pos = len(sel)
            sel.append(i)
            states.append(state)
            req_ids.append(row.req_id)
            token_ids = row.token_ids
            new = len(token_ids) - row.num_prompt_tokens - state.num_accepted
            if new == 1:
                token = token_ids[-1]
                one.append(pos)
                one_handles.append(state.handle)
                one_tokens.append(token)
                if token not in state.stops:
                    fill_handles.append(state.handle)
                    fill_rows.append(i)
            else:  # no output yet (nothing to accept), or a rebuilt row replaying its history
                replay.append((pos, state.unseen(token_ids, row.num_prompt_tokens)))
        if not sel:
            return None
        bitmask = self._buffer(len(rows), (vocab + 31) // 32)
        job = GrammarJob(
            req_ids, sel, states, one, one_handles, one_tokens, replay,
            fill_handles, fill_rows, bitmask,
        )  # fmt: skip
        if not replay and len(fill_rows) == len(sel):  # one token a row, none a stop token
            job.steady = True
            histories = [rows[i].token_ids for i in sel]
            stops = frozenset().union(*(s.stops for s in states))
            expected = list(map((1).__add__, map(len, histories)))
            self._last = RepeatRows(rows, job, histories, expected, stops)
        return job

    def run(self, job: GrammarJob) -> None:
        """Accept and fill: xgrammar calls only (on the helper thread, or in line)."""
        calls = self._batch
        if calls is None:
            calls = self._batch = BatchCalls(fill_threads())
        if job.one:
            job.accepted = calls.accept(job.one_handles, job.one_tokens)
            job.all_accepted = calls.all_accepted(job.accepted)
        handles, fill_rows = job.fill_handles, job.fill_rows
        for pos, new in job.replay:  # rare: a row's first sampling, or a rebuilt row
            state = job.states[pos]
            bad = state.accept(new)
            if bad is not None:
                job.refused[pos] = bad
            elif state.matcher.is_terminated():
                job.ended.add(pos)
            else:
                handles.append(state.handle)
                fill_rows.append(job.sel[pos])
        if handles:
            calls.fill(handles, job.bitmask, fill_rows)

    def finish(self, job: GrammarJob, num_rows: int) -> GrammarMask:
        """The accept's outcome on the rows (step loop's thread): counts, failures, the rows
        the mask applies to."""
        if job.steady and job.all_accepted:  # every row goes on: count, nothing else
            last = self._last
            if last is not None and last.job is job:  # counted when the run ends (_forget):
                last.lag += 1  # a loop over 256 rows here was ~20-30 us a step (2-core CPU)
            else:
                for state in job.states:
                    state.num_accepted += 1
            job.clean = True
            return GrammarMask(job.bitmask, job.sel, num_rows)
        refused, ended = job.refused, job.ended  # (the replaying rows', from run())
        oks = itertools.repeat(True) if job.all_accepted else BatchCalls.accepted(job.accepted)
        for pos, token, ok in zip(job.one, job.one_tokens, oks):
            state = job.states[pos]
            if ok:
                state.num_accepted += 1
                if token in state.stops:
                    # it sampled a stop token: it has ended, and this step's token
                    # (asynchronous scheduling ran it one step ahead) is dropped by the scheduler
                    ended.add(pos)
            else:
                refused[pos] = token
        failed = {}
        for pos, bad in refused.items():
            failed[job.req_ids[pos]] = ValueError(
                f"structured: token {bad} is not allowed by the request's grammar: "
                "every allowed token was masked (by an option such as min_tokens or "
                "bad_words_ids, or no token spells the grammar's next character)"
            )
        job.clean = not refused and not ended
        keep = job.sel  # usually every row goes on: no loop over them then
        if refused or ended:
            keep = [i for pos, i in enumerate(keep) if pos not in refused and pos not in ended]
        if not keep:
            return GrammarMask(None, [], num_rows, failed)
        return GrammarMask(job.bitmask, keep, num_rows, failed)

    def apply(self, logits: torch.Tensor, mask: GrammarMask) -> None:
        """Mask logits [B, V] in place on mask's rows."""
        if mask.bitmask is None:
            return
        bitmask = mask.bitmask
        if logits.device.type != "cpu":
            # the pinned buffer is reused: the previous step's copy has finished, since this
            # step's bitmask was filled after the host read that step's tokens (sampled after
            # the copy on the same stream)
            bitmask = bitmask.to(logits.device, non_blocking=True)
        num_rows, vocab = logits.shape
        indices = None if len(mask.sel) == num_rows else mask.sel
        import_xgrammar().apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=vocab, indices=indices
        )

    def argmax(self, logits: torch.Tensor, mask: GrammarMask) -> torch.Tensor:
        """The greedy token of each row [B, V], a constrained row's among its grammar's tokens
        (the tokens apply() then an argmax give)."""
        if logits.is_cuda:
            return self.argmax_kernel(logits, mask)
        scores = logits.float()  # (the in-place mask writes a float32 copy, or logits)
        self.apply(scores, mask)
        return scores.argmax(dim=-1)

    @staticmethod
    def argmax_kernel(logits: torch.Tensor, mask: GrammarMask) -> torch.Tensor:
        """argmax() on the GPU: kernels/argmax.py reading the bitmask (the interpreter's on
        the CPU, in tests)."""
        from hf_paged.kernels import argmax_rows  # (Triton is imported on first use only)

        if mask.bitmask is None:
            return argmax_rows(logits)
        num_rows = logits.shape[0]
        on = None
        if len(mask.sel) != num_rows:
            flags = np.zeros(num_rows, dtype=np.int32)
            flags[mask.sel] = 1
            on = to_device(flags, logits.device)
        bitmask = mask.bitmask.to(logits.device, non_blocking=True)  # (apply() says why safe)
        return argmax_rows(logits, allowed=(bitmask, on))

    def _buffer(self, num_rows: int, width: int) -> torch.Tensor:
        host = self._host
        if host is None or host.shape[0] < num_rows or host.shape[1] != width:
            rows = max(num_rows, 2 * host.shape[0] if host is not None else 8)
            pin = self.device.type == "cuda"
            host = torch.empty((rows, width), dtype=torch.int32, pin_memory=pin)
            self._host = host
        return host[:num_rows]


class EarlyMask:
    """A bitmask whose xgrammar work runs on the helper thread; result() waits for it and
    finishes it on the caller's thread."""

    def __init__(self, owner: GrammarBitmask, future, job, num_rows: int) -> None:
        self._owner, self._future, self._job, self._num_rows = owner, future, job, num_rows

    def result(self) -> GrammarMask:
        if self._job is None:
            return GrammarMask(None, [], self._num_rows)
        future, self._future = self._future, None
        if future is not None:
            future.result()  # (raises what the helper raised)
        return self._owner.finish(self._job, self._num_rows)
