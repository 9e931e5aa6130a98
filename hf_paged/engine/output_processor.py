"""Outputs out: what the runner returned becomes RequestOutputs.

After each step the output processor files what requests asked to keep (logprobs, scores and
logits rows, prompt log-probs) on them, runs stop strings and user stopping criteria (the user's
code: a criterion that raises fails its own request only), ends the requests they stop through
the scheduler's one exit, and builds a RequestOutput per request that got a token or ended
(whose `text` the engine's tokenizer decodes when read).
"""

from __future__ import annotations

import time

from hf_paged.core.outputs import ModelRunnerOutput
from hf_paged.core.request import Request, RequestOutput, RequestStatus
from hf_paged.core.scheduler import Scheduler
from hf_paged.engine.stop_checker import first_stop


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, tokenizer=None) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer  # RequestOutput.text decodes with it

    def add_records(self, out: ModelRunnerOutput) -> None:
        """File the step's kept rows on their requests (before update_from_output, which may end
        them: a stopping criterion reads the scores row of the token that stops it)."""
        if out.scores is None and out.logits is None and out.logprobs is None:
            if out.prompt_logprobs is None:
                return
        requests = self.scheduler.requests
        for attr, kept in (
            ("output_scores", out.scores),
            ("output_logits", out.logits),
            ("output_logprobs", out.logprobs),
        ):
            for req_id, value in (kept or {}).items():
                r = requests.get(req_id)
                if r is None:
                    continue
                if getattr(r, attr) is None:
                    setattr(r, attr, [])
                getattr(r, attr).append(value)
        for req_id, (first, values) in (out.prompt_logprobs or {}).items():
            r = requests.get(req_id)
            if r is None:
                continue
            if r.prompt_logprobs is None:
                r.prompt_logprobs = [None] * r.num_prompt_tokens
            r.prompt_logprobs[first : first + len(values)] = values

    def make_outputs(self, advanced: list[Request], ended: list[Request]) -> list[RequestOutput]:
        """Stop checks of the requests that got a token, then one output per request that got a
        token (finished or not) or ended with an error and no token."""
        stopped: dict[RequestStatus, list[Request]] = {}
        for r in advanced:
            if r.stop_checkers is not None and not r.status.finished:
                try:
                    length = first_stop(r)  # a stop string or a user criterion
                    if length is not None:
                        cut = len(r.all_token_ids) - length  # later tokens of the same step
                        if cut:
                            del r.all_token_ids[length:]
                            r.num_new_tokens -= cut
                        stopped.setdefault(RequestStatus.FINISHED_STOPPED, []).append(r)
                except Exception as exc:
                    r.error = exc
                    stopped.setdefault(RequestStatus.FINISHED_ERROR, []).append(r)
        for status, requests in stopped.items():
            self.scheduler.end_requests(requests, status)
        now = time.perf_counter()  # rows of ended requests: released by step() once it returns
        tokenizer = self.tokenizer
        outputs = []
        add = outputs.append
        for r in advanced:  # every running request at every step: kept to one call each
            if r.first_token_time is None:
                r.first_token_time = now
            if r.status.finished:
                r.finish_time = now
            add(make_output(r, max(r.num_new_tokens, 1), tokenizer))
        for r in ended:
            if r.status == RequestStatus.FINISHED_ERROR and r.finish_time is None:
                r.finish_time = now  # no token this step: the final output reports the error
                add(make_output(r, 0, tokenizer))
        return outputs


def make_output(r: Request, num_new: int, tokenizer=None) -> RequestOutput:
    tokens = r.all_token_ids
    status = r.status
    # positional, in RequestOutput's field order (keywords cost ~3x as much at 256 rows a step;
    # tests/test_request_output.py checks every field against the request)
    return RequestOutput(
        r.request_id,  # request_id
        r.prompt_token_ids,  # prompt_token_ids
        tokens,  # token_ids_ref
        len(tokens),  # num_tokens
        tokens[-num_new:] if num_new else [],  # new_token_ids
        status.finished,  # finished
        status.reason,  # finish_reason
        r.num_cached_tokens if r.num_cached_tokens > 0 else 0,  # num_cached_tokens
        r.prompt_logprobs,  # prompt_logprobs
        r.arrival_time,  # arrival_time
        r.first_token_time,  # first_token_time
        r.finish_time,  # finish_time
        r.output_logprobs,  # logprobs
        r.sibling_index,  # index
        r.output_scores,  # scores
        r.output_logits,  # logits
        r.parent_request_id,  # parent_request_id
        r.error,  # error
        tokenizer,  # tokenizer
        r.num_spec_proposed,  # num_spec_proposed
        r.num_spec_accepted,  # num_spec_accepted
    )
