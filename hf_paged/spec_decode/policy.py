"""How many tokens to propose: speculation only where it pays, measured.

A verify step makes the target compute k + 1 tokens per request instead of 1, and a draft model
k forwards of its own; it gives (1 - a^(k+1)) / (1 - a) tokens per request on average when each
proposal is accepted with probability a (given the ones before it were). At small batches the
target's forward costs about the same for 1 or k + 1 tokens a request (it reads its weights once
either way), so speculation multiplies throughput; at large batches the forward is
compute-bound, every extra token costs, and the engine also loses what it gains from running a
step ahead of the host (speculative steps are synchronous), so speculation costs more than it
gives.

Two layers decide:
- A roofline model picks k for a batch size and acceptance, and says where speculation cannot
  pay even at a = 0.95 (never tried there):

      cost(T tokens) = 1 + T / ridge_tokens       (weights read once, plus compute per token)
      step(k) = cost(B (k + 1)) + draft_ratio * (cost(2 B) + (k - 1) cost(B))
      gain(k) = B (1 - a^(k+1)) / (1 - a) / step(k)   against   gain(0) = B / cost(B)

  ridge_tokens is where compute time equals weight-reading time (H200: 775 TFLOP/s / 4.2 TB/s
  * 2 bytes / 2 FLOPs per parameter and token = ~185 tokens in bf16); draft_ratio is the draft's
  parameter bytes over the target's.
- Measurement decides on or off: per batch-size bucket (powers of two), the engine reports each
  decode step's wall time and tokens; the policy keeps the output rate with and without
  speculation and uses the faster, trying the other for a few steps now and then
  (explore_every), so a model error, host overheads the model does not see, or a change in
  acceptance costs at most those few steps.

The acceptance a is estimated per proposal position: accepted / (accepted + rejections), a
moving average over verify steps (accepted / proposed would count the proposals after a
rejection, which are never looked at, as failures).
"""

from __future__ import annotations

H200_RIDGE_TOKENS_BF16 = 185.0


class _Bucket:
    """Output rates of decode steps without (0) and with (1) speculation, for one batch-size
    bucket: decayed sums of tokens over decayed sums of seconds (a verify step gives anywhere
    from 1 to k + 1 tokens a request, so a mean of per-step rates would be biased and noisy)."""

    # steps a mode is measured for before it is compared, off and on: plain decode steps give
    # one token each at an even pace, speculative ones 1 to k + 1 (and the off mode's steps
    # cost the most where speculation pays: ~5% of a 256-token batch-1 run at 6 of them)
    SAMPLES = (3, 6)
    DECAY = 0.9

    def __init__(self, start_on: bool) -> None:
        self.tokens = [0.0, 0.0]
        self.seconds = [0.0, 0.0]
        self.count = [0, 0]
        self.mode = int(start_on)
        self.trial = 0  # steps left in a trial of the other mode
        self.since_trial = 0
        self.last_observed = -1  # the mode of the last step observed

    def rate(self, mode: int) -> float:
        return self.tokens[mode] / self.seconds[mode] if self.seconds[mode] else 0.0

    def choose(self, explore_every: int) -> int:
        for mode in (self.mode, 1 - self.mode):  # measure both first, the model's pick first
            if self.count[mode] < self.SAMPLES[mode]:
                return mode
        if self.trial:
            self.trial -= 1
            return 1 - self.mode
        self.mode = int(self.rate(1) > self.rate(0))
        self.since_trial += 1
        if self.since_trial >= explore_every:
            self.since_trial, self.trial = 0, self.SAMPLES[1 - self.mode]
        return self.mode

    def observe(self, mode: int, tokens: int, seconds: float) -> None:
        # the first step after a switch is neither mode's: turning speculation on, it verifies
        # nothing yet and the draft catches up on what it missed; turning it off, it verifies
        # the last proposals
        switched, self.last_observed = mode != self.last_observed, mode
        if switched:
            return
        self.tokens[mode] = self.DECAY * self.tokens[mode] + tokens
        self.seconds[mode] = self.DECAY * self.seconds[mode] + seconds
        self.count[mode] += 1


class SpecPolicy:
    TRIAL_STEPS = max(_Bucket.SAMPLES)  # steps of a trial of the mode not in use, at most

    def __init__(
        self,
        max_k: int,
        draft_ratio: float,
        bytes_per_param: int,
        fixed: bool = False,
        prior_acceptance: float = 0.7,
        explore_every: int = 128,
        max_verify_rows: int | None = None,
    ) -> None:
        self.max_k = max_k
        self.draft_ratio = draft_ratio
        self.ridge = H200_RIDGE_TOKENS_BF16 * bytes_per_param / 2
        self.fixed = fixed
        self.acceptance = prior_acceptance
        self.explore_every = explore_every
        # logits rows a verify step may keep and still replay a CUDA graph (max_num_seqs):
        # a verify step past it runs without graphs, which never pays
        self.max_verify_rows = max_verify_rows
        self.buckets: dict[int, _Bucket] = {}
        self.k_next = 0  # the plan of the step in progress: proposals made at its end
        # what the engine reports: totals over verify steps
        self.num_proposed = 0
        self.num_accepted = 0
        self.num_verify_steps = 0
        self.num_verified = 0  # request-steps that verified proposals

    @staticmethod
    def bucket_of(batch_size: int) -> int:
        return max(batch_size, 1).bit_length()

    def plan(self, batch_size: int) -> int:
        """k for the proposals made at the end of the next step, a step of about batch_size
        decoding requests (0: no speculation)."""
        max_k = self.max_k
        if self.max_verify_rows is not None:
            max_k = min(max_k, self.max_verify_rows // max(batch_size, 1) - 1)
        if batch_size <= 0 or max_k <= 0:
            k = 0
        elif self.fixed:
            k = max_k
        elif self.best_k(batch_size, 0.95) == 0:
            k = 0  # cannot pay here whatever the acceptance
        else:
            model_k = self.best_k(batch_size, self.acceptance)
            bucket = self.buckets.get(self.bucket_of(batch_size))
            if bucket is None:
                bucket = self.buckets[self.bucket_of(batch_size)] = _Bucket(model_k > 0)
            k = max(model_k, 1) if bucket.choose(self.explore_every) else 0
        self.k_next = min(k, max_k)
        return self.k_next

    def observe(self, batch_size: int, seconds: float, tokens: int, speculated: bool) -> None:
        """A decode step of batch_size requests gave `tokens` in `seconds` of wall time."""
        bucket = self.buckets.get(self.bucket_of(batch_size))
        if bucket is not None and seconds > 0:
            bucket.observe(int(speculated), tokens, seconds)

    def best_k(self, batch_size: int, acceptance: float) -> int:
        b = float(batch_size)
        a = min(max(acceptance, 0.0), 0.999)

        def cost(tokens: float) -> float:
            return 1.0 + tokens / self.ridge

        best, best_gain = 0, b / cost(b)
        for k in range(1, self.max_k + 1):
            tokens = b * (1 - a ** (k + 1)) / (1 - a)
            step = cost(b * (k + 1)) + self.draft_ratio * (cost(2 * b) + (k - 1) * cost(b))
            if tokens / step > best_gain * 1.02:  # a clear gain only: the model is rough
                best, best_gain = k, tokens / step
        return best

    def record(self, proposed: int, accepted: int, num_requests: int, rejections: int) -> None:
        """One verify step's totals."""
        if not proposed:
            return
        self.num_verify_steps += 1
        self.num_verified += num_requests
        self.num_proposed += proposed
        self.num_accepted += accepted
        looked_at = accepted + rejections
        if looked_at:
            weight = min(0.2, looked_at / 64)
            self.acceptance += weight * (accepted / looked_at - self.acceptance)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed, over the engine's life."""
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a request gets per verify step: its accepted proposals + the target's."""
        return 1 + self.num_accepted / self.num_verified if self.num_verified else 0.0
