"""A draft model that proposes tokens for the target, run by a ModelRunner of its own.

The draft is a smaller causal LM with the target's vocabulary. It keeps a paged KV cache of its
own with as many blocks as the target's, addressed by the target's block tables: a request's
draft KV lives in the same block ids as its target KV, so the target's KV manager allocates and
frees both (the scheduler reserves `num_speculative_tokens` lookahead slots for the draft's
writes past the step's tokens), and no second block manager exists. Its runner is the engine's
own ModelRunner (CUDA graphs, torch.compile, the small-batch forward), with one greedy row per
request.

Per step, after the target's tokens are known:
1. catch-up: one forward of every request's tokens the draft has not computed yet (a prompt
   chunk the target computed, the tokens a verify step accepted, the target's last token),
   whose last logits give the first proposal d_1 (its greedy token);
2. k - 1 decode forwards, feeding d_1 .. d_{k-1}, give d_2 .. d_k.
All k are queued without a wait between them (each reads the token drawn before it on the
device, as asynchronous scheduling does); the host reads the proposals once, after the last.
Where every request proposes k, d_3 .. d_k replay the decode graph of d_2's step again with no
host work between (its inputs move themselves on): preparing a step on the host took longer
than the draft's forward (~0.65 ms against ~0.37 ms, SmolLM2-135M shape, H200). Where the
catch-up itself is a decode step of exactly those requests (a token each: after a verify step
that rejected a proposal), d_2 .. d_k replay the catch-up's graph, with no d_2 step prepared
on the host. Such a chain also leaves its proposals in the target runner's last_tokens, past
its rows (step_inputs.DeviceProposals): the target's verify step reads them there, so the host
prepares and launches it while the draft still runs, and reads the proposals only after that.
The draft's KV for d_1 .. d_{k-1} is valid as far as the target accepts them (on_verified);
past that the next catch-up rewrites it.

Proposals are the draft's greedy tokens, so for sampled requests the rejection sampler treats
the draft as a deterministic proposer (q one-hot): exact, at the cost of a lower acceptance than
sampling from the draft's distribution when the temperature is high.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from hf_paged.config import EngineConfig
from hf_paged.core.outputs import NewRequestData, ScheduledBatch
from hf_paged.sampling_params import SamplingParams
from hf_paged.worker.step_inputs import DeviceProposals

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


def check_draft(draft: torch.nn.Module, target: torch.nn.Module) -> None:
    """Refuse a draft that cannot propose the target's tokens, naming why."""
    d_vocab = draft.config.get_text_config().vocab_size
    t_vocab = target.config.get_text_config().vocab_size
    if d_vocab > t_vocab:
        raise ValueError(
            f"draft_model: its vocabulary ({d_vocab} tokens) is larger than the target's "
            f"({t_vocab}); the draft must share the target's vocabulary (draft models with "
            "another tokenizer are not supported)"
        )
    d_dev = next(draft.parameters()).device
    t_dev = next(target.parameters()).device
    if d_dev != t_dev:
        raise ValueError(f"draft_model: on {d_dev}, the target on {t_dev}; put both on one device")
    if draft is target:
        raise ValueError("draft_model: the target itself; pass a separate (smaller) model")


class DraftProposer:
    def __init__(
        self,
        model: torch.nn.Module,
        config: EngineConfig,
        num_blocks: int,
        proposal_entries: tuple[torch.Tensor, int] | None = None,
    ) -> None:
        """proposal_entries: (the target runner's last_tokens, the first entry past its rows)
        where a decode-run chain leaves its proposals on the device; None: only on the host."""
        from hf_paged.integrations.fused_projections import fuse_projections
        from hf_paged.integrations.transformers import enable_paged_attention
        from hf_paged.worker.model_runner import ModelRunner

        self.model = model
        self.vocab_size = model.config.get_text_config().vocab_size
        self._lease = enable_paged_attention(model, self)  # given back by shutdown()
        if config.fuse_projections:
            self._lease.fused |= fuse_projections(model) > 0
        draft_config = dataclasses.replace(
            config,
            num_blocks=num_blocks,
            draft_model=None,
            # its decode forwards read their input token on the device (see propose())
            async_scheduling=True,
            verify_model=False,
        )
        try:
            self.runner = ModelRunner(model, draft_config)
        except BaseException:
            self._give_back()
            raise
        # tokens of each request whose draft KV is valid (positions 0 .. valid - 1)
        self.valid: dict[str, int] = {}
        # requests that proposed last step: (first position fed a proposal, proposals made)
        self.fed: dict[str, tuple[int, int]] = {}
        self.entries = None  # the target's proposal entries, int64 [k * max_num_seqs]
        if proposal_entries is not None:
            last_tokens, first = proposal_entries
            self.entries, self.first_entry = last_tokens[first:], first
        # a chain queued whose tokens the host has not read (land()): the catch-up, its
        # pending output, the decode steps' batch, their decode run, the proposals handed out,
        # where they are on the device (DeviceProposals, or None)
        self._unread = None

    def propose(self, batch: ScheduledBatch, step, target_ib, accepted, limits: dict) -> dict:
        """limits: request id -> proposals wanted (requests that got a token this step and
        may speculate). Returns request id -> proposals: where the chain ran as a decode run,
        lists of k placeholders (-1) whose values land() writes once they are read (before the
        next step feeds them to the target: ModelRunner.execute), so the host handles the step's
        outputs and schedules the next while the GPU runs the draft."""
        self.land()  # a chain never verified (its requests ended or were not scheduled)
        self.fed.clear()  # proposals not verified (not scheduled): their KV counts for nothing
        catch_up, want = ScheduledBatch(), {}
        dib = self.runner.input_batch
        for i, rid in enumerate(batch.req_ids):
            row = int(step.rows[i])
            known = int(target_ib.num_known[row])
            k = limits.get(rid, 0)
            sampled = int(step.seq_lens[i]) >= int(step.total_tokens[i])
            # a proposing request feeds its newest token too (its logits give d_1); another
            # leaves it for later, so the draft samples nothing for it
            end = known if k > 0 else (known - 1 if sampled else int(step.seq_lens[i]))
            valid = self.valid.get(rid, 0)
            if end <= valid:
                continue
            if rid not in dib.req_to_row:
                dib.add(_draft_row(rid, target_ib, row, known, self.vocab_size))
            else:
                drow = dib.req_to_row[rid]
                tokens = target_ib.token_ids[row, valid:known]
                dib.token_ids[drow, valid:known] = _in_vocab(tokens, self.vocab_size)
                dib.num_known[drow] = known
            catch_up.req_ids.append(rid)
            catch_up.num_computed_tokens.append(valid)
            catch_up.num_scheduled_tokens.append(end - valid)
            catch_up.num_tokens.append(known)
            catch_up.block_ids.append(batch.block_ids[i])
            self.valid[rid] = end
            if k > 0:
                want[rid] = (k, known, batch.block_ids[i])
        if not catch_up.req_ids:
            return {}
        from hf_paged.worker.model_runner import queue_decode_run

        # The chain runs as asynchronous scheduling does: each decode forward reads the token
        # the one before it drew from the runner's last_tokens on the device, and the host
        # reads a step's tokens after queuing the next one (the runner's landing buffers hold
        # two steps), so the GPU runs the k forwards back to back while the host prepares.
        proposals: dict[str, list[int]] = {}
        before = None  # the step queued before, not read yet

        def read(scheduled: ScheduledBatch, pending) -> None:
            out = self.runner.finish_async(pending)
            for rid, t in zip(scheduled.req_ids, out.sampled_token_ids):
                if scheduled is catch_up and t >= 0 and rid in want:
                    proposals[rid] = [t]
                elif scheduled is not catch_up and rid in proposals:
                    proposals[rid].append(t)

        chain = [catch_up]  # then the decode steps: d_j in, d_{j+1} out
        for j in range(1, max((k for k, _, _ in want.values()), default=0)):
            decode = ScheduledBatch()
            for rid, (k, known, block_ids) in want.items():
                if k > j:  # (every proposing request samples in the catch-up: end == known)
                    decode.req_ids.append(rid)
                    decode.num_computed_tokens.append(known + j - 1)
                    decode.num_scheduled_tokens.append(1)
                    decode.num_tokens.append(known + j)
                    decode.block_ids.append(block_ids)
            chain.append(decode)
        # Every proposing request goes on to the last step: the rest of the chain may replay a
        # decode step's graph with no host work between (queue_decode_run), from the catch-up
        # itself where that is a decode step of exactly the proposing requests (a token each:
        # the usual step after a verify that rejected a proposal), else from the first decode
        # step, d_1 then taken from the catch-up's tokens.
        k, num = len(chain), len(want)
        as_run = k > 1 and len(chain[-1]) == num
        one_each = catch_up.req_ids == list(want) and sum(catch_up.num_scheduled_tokens) == num
        first = 0 if as_run and one_each else 1  # the chain step the run starts from
        entries = self._entries(k, num) if as_run else None  # the target's, [k, requests]
        for j, scheduled in enumerate(chain):
            pending = self.runner.execute(scheduled, async_output=True)
            run = None
            if as_run and j == first:
                out = entries[j:] if entries is not None else None
                run = queue_decode_run(self.runner, pending, k - 1 - j, out)
            if run is not None:
                # read later (land()): d_1 from the catch-up where the run starts after it,
                # the rest from the run
                proposals = {rid: [-1] * k for rid in scheduled.req_ids}
                device = None
                if entries is not None:
                    columns = {rid: c for c, rid in enumerate(scheduled.req_ids)}
                    device = DeviceProposals(self.first_entry, num, columns)
                catch_up_out = before[1] if before is not None else None
                self._unread = (catch_up, catch_up_out, scheduled, run, proposals, device)
                before = None
                break
            if as_run and j == 0:
                first = 1 if k > 2 else -1  # (a run from the catch-up did not start)
                if first == 1 and not self._hold_first(entries, pending, num):
                    entries = None
            if before is not None:
                read(*before)
            before = (scheduled, pending)
        if before is not None:
            read(*before)
        for rid, tokens in proposals.items():
            self.fed[rid] = (want[rid][1], len(tokens))
        return proposals

    def _entries(self, k: int, num_requests: int) -> torch.Tensor | None:
        """The target's entries for a chain of k tokens of num_requests requests, [k, requests]
        (contiguous), or None where they cannot hold the chain."""
        if self.entries is None or k * num_requests > self.entries.numel():
            return None
        return self.entries[: k * num_requests].view(k, num_requests)

    def _hold_first(self, entries, catch_up, num_requests: int) -> bool:
        """Copy d_1 (the catch-up's tokens: the proposing requests sample there, in the decode
        steps' order) into row 0 of the entries now, before the decode step's graph overwrites
        them. False where it cannot."""
        tokens = catch_up.device_tokens
        if entries is None or tokens is None or len(tokens) != num_requests:
            return False
        entries[0].copy_(tokens)
        return True

    def device_proposals(self) -> DeviceProposals | None:
        """Where the proposals of the chain queued last, not read yet, are on the device."""
        return self._unread[-1] if self._unread is not None else None

    def land(self) -> dict[str, list[int]] | None:
        """Read the tokens of the chain propose() queued last, if not read yet, into the
        proposal lists it handed out (and the draft's rows); returns those lists."""
        from hf_paged.worker.model_runner import finish_decode_run

        unread, self._unread = self._unread, None
        if unread is None:
            return None
        catch_up, pending, decodes, run, proposals, _ = unread
        if pending is not None:  # the run started after the catch-up: d_1 is the catch-up's
            out = self.runner.finish_async(pending)
            for rid, t in zip(catch_up.req_ids, out.sampled_token_ids):
                if rid in proposals:
                    if t < 0:  # propose() handed out k places for it: it must have sampled
                        raise RuntimeError(f"draft catch-up sampled nothing for {rid}")
                    proposals[rid][0] = t
        start = 1 if pending is not None else 0
        for j, tokens in enumerate(finish_decode_run(self.runner, run).tolist(), start=start):
            for rid, t in zip(decodes.req_ids, tokens):
                proposals[rid][j] = t
        return proposals

    def on_verified(self, scheduled: dict, accepted: dict[str, list[int]]) -> None:
        """The target kept the first len(run) - 1 proposals of each verified request: the
        draft's KV for the proposals it fed itself is valid that far."""
        for rid, run in accepted.items():
            fed = self.fed.pop(rid, None)
            if fed is not None and rid in self.valid:
                first, k = fed
                self.valid[rid] = first + min(len(run) - 1, k - 1)

    def release(self, req_ids: list[str]) -> None:
        self.runner.release(req_ids)
        for rid in req_ids:
            self.valid.pop(rid, None)
            self.fed.pop(rid, None)

    def shutdown(self) -> None:
        self._unread = None
        self.runner.shutdown()
        self._give_back()

    def _give_back(self) -> None:
        """The draft model goes back to its owner as it came (attention, projections)."""
        from hf_paged.integrations.transformers import disable_paged_attention

        lease, self._lease = self._lease, None
        if lease is not None and disable_paged_attention(self.model, self) and lease.fused:
            from hf_paged.integrations.fused_projections import unfuse_projections

            unfuse_projections(self.model)


def draft_bytes_per_block(draft: torch.nn.Module, config: EngineConfig) -> int:
    """KV bytes of one block of the draft's cache (the target's sizing reserves them)."""
    from hf_paged.quantization.kv_cache import kv_cache_torch_dtype
    from hf_paged.worker.startup import KVCacheSpec

    dtype = kv_cache_torch_dtype(config.kv_cache_dtype, next(draft.parameters()).dtype)
    return KVCacheSpec(draft, config.block_size, dtype).bytes_per_block


def _in_vocab(tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """A draft with a smaller vocabulary than the target's (the same tokenizer, a shorter
    padded embedding, as Qwen2.5's 0.5B against its 7B) sees target tokens past its vocabulary
    as token 0: they only make its proposals worse, never the output."""
    return np.where(tokens < vocab_size, tokens, 0)


def _draft_row(rid: str, target_ib, row: int, known: int, vocab_size: int) -> NewRequestData:
    state = target_ib.sampling[row]
    return NewRequestData(
        req_id=rid,
        token_ids=_in_vocab(target_ib.token_ids[row, :known], vocab_size).tolist(),
        num_prompt_tokens=state.num_prompt_tokens,
        sampling_params=_GREEDY,
        generator=None,
        stop_token_ids=frozenset(),
        banned_token_ids=[],
        bad_word_prefixes=[],
        max_total_tokens=int(target_ib.max_total[row]),
    )
