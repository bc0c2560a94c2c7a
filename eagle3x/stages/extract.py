"""Stage `extract`: run the verifier over the prepared samples, store hidden states in shards.

The loop itself (resumable, incremental, shard repair, signals) is
``eagle3x.data.extraction``, the same code the datamodule drives in ``prepare_data()``.
The prepared data must exist (preflight refuses the run otherwise and names the command).
"""

from __future__ import annotations

from eagle3x.artifacts import Outcome
from eagle3x.config.schema import EngineConfig, ExtractConfig
from eagle3x.data.extraction import HiddenStates
from eagle3x.plan import RunPlan


def run(plan: RunPlan, extract: ExtractConfig, engine: EngineConfig) -> Outcome:
    return HiddenStates(plan, extract, engine).make(prepare=False)[-1]
