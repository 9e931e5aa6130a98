"""How many tokens to propose this step: speculation only where it pays.

A verify step makes the target compute k + 1 tokens per request instead of 1, and a draft model
k forwards of its own; it gives (1 - a^(k+1)) / (1 - a) tokens per request on average when each
proposal is accepted with probability a. At small batches the target's forward costs about the
same for 1 or k + 1 tokens a request (it reads its weights once either way), so speculation
multiplies throughput; at large batches the forward is compute-bound, its cost grows with every
extra token, and speculation costs more than it gives. The policy scores each k with a roofline
cost model of the step and picks the best (0 = do not speculate):

    cost(T tokens) = 1 + T / ridge_tokens        (weights read once, plus compute per token)
    step(k) = cost(B (k + 1)) + draft_ratio * (cost(2 B) + (k - 1) cost(B))
    gain(k) = B (1 - a^(k+1)) / (1 - a) / step(k)   against   gain(0) = B / cost(B)

ridge_tokens is where compute time equals weight-reading time: peak FLOP/s over bandwidth, times
bytes per parameter, over 2 FLOPs per parameter and token (H200: 775 TFLOP/s / 4.2 TB/s * 2 B / 2
= ~185 tokens in bf16). draft_ratio is the draft's parameter bytes over the target's. The
acceptance a is measured: a moving average over verify steps. While the policy says 0 because of
a low acceptance, it proposes one token every `probe_every` steps to measure again.
"""

from __future__ import annotations

H200_RIDGE_TOKENS_BF16 = 185.0


class SpecPolicy:
    def __init__(
        self,
        max_k: int,
        draft_ratio: float,
        bytes_per_param: int,
        fixed: bool = False,
        prior_acceptance: float = 0.7,
        probe_every: int = 32,
    ) -> None:
        self.max_k = max_k
        self.draft_ratio = draft_ratio
        self.ridge = H200_RIDGE_TOKENS_BF16 * bytes_per_param / 2
        self.fixed = fixed
        self.acceptance = prior_acceptance
        self.probe_every = probe_every
        self._idle_steps = 0
        # what the engine reports: totals over verify steps
        self.num_proposed = 0
        self.num_accepted = 0
        self.num_verify_steps = 0
        self.num_verified = 0  # request-steps that verified proposals

    def choose(self, batch_size: int) -> int:
        """k for a step of batch_size decoding requests."""
        if batch_size <= 0:
            return 0
        if self.fixed:
            return self.max_k
        k = self.best_k(batch_size, self.acceptance)
        if k == 0 and self.best_k(batch_size, 0.95) > 0:  # off for low acceptance: probe
            self._idle_steps += 1
            if self._idle_steps >= self.probe_every:
                self._idle_steps = 0
                return 1
        return k

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

    def record(self, proposed: int, accepted: int, num_requests: int) -> None:
        """One verify step's totals: the moving average follows the recent acceptance."""
        if not proposed:
            return
        self.num_verify_steps += 1
        self.num_verified += num_requests
        self.num_proposed += proposed
        self.num_accepted += accepted
        weight = min(0.2, proposed / 64)
        self.acceptance += weight * (accepted / proposed - self.acceptance)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a request gets per verify step: its accepted proposals + the target's."""
        return 1 + self.num_accepted / self.num_verified if self.num_verified else 0.0
