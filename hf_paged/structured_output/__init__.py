"""Structured output: a request's tokens constrained to a JSON schema, any JSON, a regex, an
EBNF grammar or a choice list, on xgrammar (docs/structured_output.md).

constraint.py    StructuredOutputs: what a request asks for, parsed in the caller's thread
compiler.py      GrammarService: compilation on a worker thread, cached by constraint
logits_mask.py   RowMatcher (a running row's grammar state) and GrammarBitmask (the sampler's
                 hook: matchers -> bitmask -> masked logits, one kernel)
batch_calls.py   BatchCalls: xgrammar's batched accept and fill with no per-row Python
"""

from hf_paged.structured_output.constraint import StructuredOutputs

__all__ = ["StructuredOutputs"]
