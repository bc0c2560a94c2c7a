"""Stage `extract`: run the verifier over the prepared samples, store hidden states in shards.

The loop itself (resumable, incremental, shard repair, signals) is
``eagle3x.data.extraction``, the same code the datamodule drives in ``prepare_data()``.
The prepared data is made first when missing (pipeline.STAGES: stage=extract runs prepare
before it, which reuses a finished artifact).
With ``extract.workers`` > 1 this process is one worker of a data-parallel extraction
(its index: ``extract.worker``, else SLURM_PROCID / RANK; ``distributed.extract_worker``).
"""

from __future__ import annotations

from eagle3x import distributed
from eagle3x.artifacts import Outcome
from eagle3x.config.schema import EngineConfig, ExtractConfig
from eagle3x.data import extraction
from eagle3x.plan import RunPlan


def run(plan: RunPlan, extract: ExtractConfig, engine: EngineConfig) -> Outcome:
    source = extraction.HiddenStates(plan, extract, engine)
    worker, _ = distributed.extract_worker(extract.workers, extract.worker)
    return extraction.extract(plan, extract, engine.name.value, source.open_engine, worker)
