"""Beam search on the paged cache, with transformers' selection rules and outputs.

A BeamGroup is one prompt's num_beams beams, each a Request in the engine. The prompt is
computed once (the root request); the other beams wait as its pending siblings, so admission
reserves their seats. The runner does not sample beam rows: it returns each beam's logits row in
its output (Sampler._defer_beams), and the engine hands them to the group (add_logits). When
every beam of a group has its row, the group takes one
transformers beam step: log-softmax, the request's logits processors, top-k continuations,
stopping criteria, finished-hypothesis update and the early-stop heuristic, calling
GenerationMixin's own step functions on a batch of one, so length_penalty and early_stopping
mean exactly what they mean there. Then every beam j continues beam sources[j] plus a token
(Scheduler.rewrite_beams moves block references: no KV is copied; full blocks stay shared and a
shared partial last block is copied on write when a beam next writes to it).

The group drives the engine through a narrow interface only: Engine.add_beam_group /
end_beam_groups / wait_or_step, and the scheduler's start_siblings / rewrite_beams / end_requests.

Groups advance independently (a group that is done frees its blocks at once); transformers runs
a batch until every item is done, which does not change any item's result.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import StoppingCriteriaList
from transformers.generation.utils import GenerateBeamDecoderOnlyOutput

from hf_paged.core.request import Request, RequestStatus
from hf_paged.core.scheduler import new_request_data
from hf_paged.generation.generate import repetition_penalty
from hf_paged.sample.logits_processing import TokenCountPool, process_logits
from hf_paged.sampling_params import F_BEAM, F_FORK, F_RECORD, F_WARP, SamplingParams
from hf_paged.worker.input_batch import sampling_row

NEG = -1.0e9


class BeamGroup:
    def __init__(self, engine, root: Request, num_beams: int, plan, max_new: int) -> None:
        gen = plan.gen
        self.engine = engine
        self.model = engine.model
        self.root = root
        self.beams: list[Request] = [root]
        self.num_beams = num_beams
        self.eos = list(plan.eos)
        self.criteria = StoppingCriteriaList(plan.criteria) if plan.criteria else None
        self.length_penalty = float(gen.length_penalty if gen.length_penalty is not None else 1.0)
        self.early_stopping = gen.early_stopping if gen.early_stopping is not None else False
        self.keep_scores = bool(gen.return_dict_in_generate and gen.output_scores)
        self.keep_logits = bool(gen.return_dict_in_generate and gen.output_logits)
        prompt = root.prompt_token_ids
        self.prompt_len = len(prompt)
        self.max_length = self.prompt_len + max_new
        self.cur_len = self.prompt_len
        self.beams_to_keep = max(2, 1 + len(self.eos)) * num_beams
        self.top_mask = torch.arange(self.beams_to_keep) < num_beams
        fill = (plan.pad or (self.eos[0] if self.eos else 0)) if self.eos else -1
        self.fill = fill
        nb = num_beams
        self.running = torch.full((1, nb, self.max_length), fill, dtype=torch.long)
        self.running[:, :, : self.prompt_len] = torch.tensor(prompt)
        self.sequences = self.running.clone()
        self.running_scores = torch.zeros((1, nb))
        self.running_scores[:, 1:] = NEG
        self.beam_scores = torch.full((1, nb), NEG)
        self.finished = torch.zeros((1, nb), dtype=torch.bool)
        self.heuristic_open = torch.ones((1, 1), dtype=torch.bool)
        self.running_indices = torch.full((1, nb, max_new), -1, dtype=torch.int32)
        self.beam_indices = self.running_indices.clone()
        self.scores: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []
        self.done = False
        self.error: BaseException | None = None  # what the group's user code raised
        self._rows: dict[str, torch.Tensor] = {}  # beam id -> its logits row of the last step
        self._pool = TokenCountPool(torch.device("cpu"))  # penalty counts of the beams

    def add_logits(self, beam_logits: dict[str, torch.Tensor] | None) -> None:
        """The engine hands over the beam rows of a step (of every group: take ours)."""
        if beam_logits:
            for b in self.beams:
                row = beam_logits.get(b.request_id)
                if row is not None:
                    self._rows[b.request_id] = row

    def step_or_fail(self) -> None:
        """One beam step; if the request's own user code raises (a logits processor, a
        stopping criterion), the group ends with the error on it and beam_generate raises it.
        Other requests in the engine are not affected."""
        try:
            self.step()
        except Exception as exc:
            self.error = exc
            self.finish(RequestStatus.FINISHED_ERROR)

    def ready(self) -> bool:
        return not self.done and all(
            b.request_id in self._rows and b.status == RequestStatus.RUNNING for b in self.beams
        )

    def step(self) -> None:
        nb, model = self.num_beams, self.model
        first = len(self.beams) == 1
        beams = self.beams * nb if first else self.beams  # step 1: every beam is the prompt
        logits = torch.stack([self._rows[b.request_id] for b in beams]).cpu()
        self._rows = {}
        log_probs = logits.log_softmax(dim=-1)
        # the beams' sampling state, built afresh: a beam step rewrites their histories
        for b in self.beams:
            self._pool.release(b.request_id)
        rows = [sampling_row(new_request_data(b)) for b in beams]
        feats = [r.features for r in rows]
        any_feats = 0
        for f in feats:
            any_feats |= f
        log_probs = process_logits(log_probs, rows, feats, any_feats & ~_WARP_BITS, self._pool)
        if self.keep_logits:
            self.logits.append(logits)
        if self.keep_scores:
            self.scores.append(log_probs)
        acc = (log_probs + self.running_scores[0, :, None]).reshape(1, -1)
        cur, plen = self.cur_len, self.prompt_len
        topk_lp, topk_seq, topk_idx = model._get_top_k_continuations(
            accumulated_log_probs=acc,
            running_sequences=self.running,
            running_beam_indices=self.running_indices,
            cur_len=cur,
            decoder_prompt_len=plen,
            do_sample=False,
            beams_to_keep=self.beams_to_keep,
            num_beams=nb,
            batch_size=1,
        )
        hits = self._hits(topk_seq[0, :, : cur + 1])[None]
        self.running, self.running_scores, self.running_indices = (
            model._get_running_beams_for_next_iteration(
                topk_log_probs=topk_lp,
                topk_running_sequences=topk_seq,
                topk_running_beam_indices=topk_idx,
                next_token_hits_stopping_criteria=hits,
                num_beams=nb,
            )
        )
        self.sequences, self.beam_scores, self.beam_indices, self.finished = (
            model._update_finished_beams(
                sequences=self.sequences,
                topk_running_sequences=topk_seq,
                beam_scores=self.beam_scores,
                topk_log_probs=topk_lp,
                beam_indices=self.beam_indices,
                topk_running_beam_indices=topk_idx,
                is_early_stop_heuristic_unsatisfied=self.heuristic_open,
                is_sent_finished=self.finished,
                next_token_hits_stopping_criteria=hits,
                top_num_beam_mask=self.top_mask,
                num_beams=nb,
                cur_len=cur,
                decoder_prompt_len=plen,
                length_penalty=self.length_penalty,
                early_stopping=self.early_stopping,
            )
        )
        self.cur_len = cur + 1
        self.heuristic_open = model._check_early_stop_heuristic(
            is_early_stop_heuristic_unsatisfied=self.heuristic_open,
            running_beam_scores=self.running_scores,
            beam_scores=self.beam_scores,
            is_sent_finished=self.finished,
            cur_len=self.cur_len,
            max_length=self.max_length,
            decoder_prompt_len=plen,
            early_stopping=self.early_stopping,
            length_penalty=self.length_penalty,
        )
        more = model._beam_search_has_unfinished_sequences(
            self.heuristic_open, self.finished, hits, self.early_stopping
        )
        if not bool(more):
            self.finish()
            return
        sources = self.running_indices[0, :, cur - plen].tolist()
        tokens = self.running[0, :, cur].tolist()
        self._continue(sources, tokens, first)

    def _hits(self, candidates: torch.Tensor) -> torch.Tensor:
        """transformers' stopping criteria for each candidate sequence [K, cur_len + 1]."""
        hits = torch.zeros(candidates.shape[0], dtype=torch.bool)
        if candidates.shape[1] >= self.max_length:
            hits[:] = True
        if self.eos:
            hits |= torch.isin(candidates[:, -1], torch.tensor(self.eos))
        if self.criteria is not None:
            scores = tuple(self.scores) if self.keep_scores else None
            hits |= self.criteria(candidates, scores).cpu()
        return hits

    def _continue(self, sources: list[int], tokens: list[int], first: bool) -> None:
        scheduler = self.engine.scheduler
        if first:  # the other beams start: they share the root's prompt blocks
            self.beams = [self.root, *scheduler.start_siblings(self.root)]
        scheduler.rewrite_beams(self.beams, sources, tokens)

    def finish(self, status: RequestStatus = RequestStatus.FINISHED_STOPPED) -> None:
        """End every beam (and beams not started yet) through the scheduler's one exit."""
        self.done = True
        for b in self.beams:
            b.error = self.error
        self.engine.scheduler.end_requests(self.beams, status)


# stages that do not apply to beam rows: warpers (no beam sampling), sampler records, forks
_WARP_BITS = F_WARP | F_RECORD | F_FORK | F_BEAM


def beam_generate(engine, plan, batches) -> list:
    """generate() with num_beams > 1 for each RowBatch; transformers' outputs per batch."""
    gen = plan.gen
    nb = int(gen.num_beams)
    if gen.do_sample:
        raise ValueError("do_sample with num_beams > 1 (beam sampling) is not supported")
    if nb > engine.config.max_num_seqs:
        limit = engine.config.max_num_seqs
        raise ValueError(f"num_beams: {nb} beams exceed max_num_seqs ({limit})")
    nrs = int(gen.num_return_sequences or 1)
    groups_per_batch: list[list[BeamGroup]] = []
    all_groups: list[BeamGroup] = []
    try:
        for b in batches:
            groups = []
            for prompt in b.prompts:
                groups.append(_add_group(engine, plan, prompt, nb, b))
            groups_per_batch.append(groups)
            all_groups.extend(groups)
        # any thread's step advances these groups; an error in a group's user code ends it
        engine.wait_or_step(lambda: all(g.done for g in all_groups))
    except BaseException:
        engine.end_beam_groups(all_groups)
        raise
    for g in all_groups:
        if g.error is not None:
            raise g.error
    return [_outputs(gen, b, groups, nrs) for b, groups in zip(batches, groups_per_batch)]


def _add_group(engine, plan, prompt, nb, batch) -> BeamGroup:
    params = SamplingParams(
        max_tokens=batch.max_new,
        min_tokens=max(batch.min_new, 0),
        temperature=0.0,
        eos_token_id=plan.eos,
        repetition_penalty=repetition_penalty(plan.gen),
        no_repeat_ngram_size=int(plan.gen.no_repeat_ngram_size or 0),
        bad_words_ids=plan.gen.bad_words_ids,
        suppress_tokens=plan.gen.suppress_tokens,
        begin_suppress_tokens=plan.gen.begin_suppress_tokens,
        logits_processors=plan.processors,
        beam_search=True,
    )
    root = engine.inputs.make_requests(prompt, params)[0]
    rid = root.request_id
    group = BeamGroup(engine, root, nb, plan, batch.max_new)
    # the other beams: pending siblings of the root (admission reserves their seats)
    siblings = []
    for j in range(1, nb):
        s = dataclasses.replace(
            root,
            request_id=f"{rid}@{j}",
            all_token_ids=list(prompt),
            block_hashes=[],
            banned_token_ids=list(root.banned_token_ids),
            bad_word_prefixes=list(root.bad_word_prefixes),
        )
        s.parent_request_id = rid
        siblings.append(s)
    engine.add_beam_group(group, root, siblings)
    return group


def _outputs(gen, batch, groups: list[BeamGroup], nrs: int):
    input_ids = batch.input_ids
    nb = groups[0].num_beams
    rows, seq_scores, indices = [], [], []
    for g_i, g in enumerate(groups):
        seqs = g.sequences[0, :nrs]
        for k in range(nrs):
            new = seqs[k, g.prompt_len :]
            rows.append(new)
            seq_scores.append(g.beam_scores[0, k])
            idx = g.beam_indices[0, k].long()
            indices.append(torch.where(idx >= 0, idx + g_i * nb, idx))
    gen_len = max(int((idx >= 0).sum()) for idx in indices)
    fill = groups[0].fill
    new_tokens = torch.stack(
        [
            r[:gen_len]
            if len(r) >= gen_len
            else torch.cat([r, torch.full((gen_len - len(r),), fill)])
            for r in rows
        ]
    )
    prompts = input_ids.repeat_interleave(nrs, dim=0)
    sequences = torch.cat([prompts, new_tokens.to(input_ids.device, input_ids.dtype)], dim=1)
    if not gen.return_dict_in_generate:
        return sequences
    beam_indices = torch.stack([i[:gen_len] for i in indices])
    scores = logits = None
    steps = max(len(g.scores) or len(g.logits) for g in groups)
    if gen.output_scores:
        scores = _stack(groups, "scores", steps)
    if gen.output_logits:
        logits = _stack(groups, "logits", steps)
    return GenerateBeamDecoderOnlyOutput(
        sequences=sequences,
        sequences_scores=torch.stack(seq_scores) if gen.output_scores else None,
        scores=scores,
        logits=logits,
        beam_indices=beam_indices,
    )


def _stack(groups: list[BeamGroup], attr: str, steps: int) -> tuple:
    """Per-group per-step [num_beams, V] rows -> transformers' tuple of [batch*num_beams, V]; a
    group that finished early contributes -inf rows for the later steps."""
    out = []
    for s in range(steps):
        parts = []
        for g in groups:
            rows = getattr(g, attr)
            if s < len(rows):
                parts.append(rows[s])
            else:
                parts.append(torch.full_like(rows[0], float("-inf")))
        out.append(torch.cat(parts))
    return tuple(out)
