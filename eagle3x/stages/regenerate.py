"""Stage `regenerate`: the verifier writes the assistant turns anew (eagle3x.data.regenerate).

Runs before prepare when ``data.responses=regenerated`` (then prepare reads the result), or
on its own. Engine: vLLM offline with prefix caching (``engine=vllm``, the same ``engine.*``
settings and tensor parallelism as extraction) or transformers (``engine=hf``,
``regenerate.batch_size`` replies decoded together). SIGINT/SIGTERM stop it within one
decode step, every finished conversation kept.
"""

from __future__ import annotations

from eagle3x.artifacts import Outcome
from eagle3x.config.schema import EngineConfig, EngineName, RegenerateConfig
from eagle3x.plan import RunPlan


def run(plan: RunPlan, regenerate: RegenerateConfig, engine: EngineConfig) -> Outcome:
    from eagle3x.data.regenerate import context_length, regenerate as make
    from eagle3x.verifier import ensure

    ensure(plan.verifier.path, plan.verifier.tiny)

    def open_generator(stops):
        from eagle3x.engines.base import vllm_options
        from eagle3x.engines.generate import HFGenerator, VLLMGenerator

        if engine.name is EngineName.hf:
            return HFGenerator(plan.verifier.path, engine.dtype, engine.device,
                               plan.verifier.trust_remote_code, stops, regenerate.batch_size)
        return VLLMGenerator(plan.verifier.path, vllm_options(engine, plan.verifier),
                             context_length(plan), stops)

    return make(plan, regenerate, open_generator)
