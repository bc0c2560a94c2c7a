"""Stage `prepare`: conversations -> chat template -> token ids + assistant loss mask.

Everything it reads is in the plan (the conversations, seed, max_seq_len, the verifier's
tokenizer); the work is ``eagle3x.data.prepared.build``, which the datamodule reuses.
"""

from __future__ import annotations

from eagle3x.artifacts import Outcome
from eagle3x.data import prepared
from eagle3x.plan import RunPlan


def run(plan: RunPlan) -> Outcome:
    return prepared.build(plan)
