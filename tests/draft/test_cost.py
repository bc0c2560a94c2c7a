"""eagle3x.draft.cost: the FLOPs per token it states are the matmul FLOPs the real training
step performs, counted independently by torch's FlopCounterMode; the attention context,
the peak table and the summary line."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from eagle3x.draft.cost import (causal_context, cost_line, flops_per_token, gpu_peak,
                                measured_matmul_rate)
from eagle3x.draft.model import DraftShape, Eagle3Draft
from eagle3x.draft.ttt import trained_positions, ttt_step_metrics


def step_and_shape(steps: int, layers: int, freeze_head: bool, t: int = 24, b: int = 2):
    """A draft with every part a different size (so a part counted with another's width
    shows), one batch, and the dense reference attention (every key scored, then masked)."""
    g = torch.Generator().manual_seed(steps + 10 * layers)
    shape = dict(hidden_size=64, target_hidden_size=96, intermediate_size=160, num_heads=4,
                 num_kv_heads=2, head_dim=16, draft_vocab_size=50, target_vocab_size=300,
                 num_layers=layers)
    vd, vt = 50, 300
    chosen = torch.randperm(vt, generator=g)[:vd].sort().values
    t2d = torch.zeros(vt, dtype=torch.bool)
    t2d[chosen] = True
    draft = Eagle3Draft(DraftShape(**shape), chosen - torch.arange(vd), t2d)
    draft.embed_tokens.weight.requires_grad_(False)  # train.freeze_embeddings (the default)
    draft.lm_head.weight.requires_grad_(not freeze_head)
    draft.set_layer_options(impl="reference", block=t)
    batch = {"input_ids": torch.randint(1, vt, (b, t), generator=g),
             "loss_mask": torch.randint(0, 2, (b, t), generator=g, dtype=torch.uint8),
             "lengths": torch.tensor([t] * b),
             "aux_hidden": torch.randn(b, t, 3 * 96, generator=g),
             "last_hidden": torch.randn(b, t, 96, generator=g)}
    head = torch.randn(vt, 96, generator=g)
    return draft, batch, head, shape


@pytest.mark.parametrize("steps,layers,freeze_head", [(3, 1, False), (7, 1, False),
                                                      (3, 1, True), (4, 2, False)])
def test_the_flop_count_is_what_the_real_step_multiplies(steps, layers, freeze_head):
    """Forward + backward of ttt_step_metrics under FlopCounterMode (every mm / bmm torch
    dispatches) against flops_per_token x positions: equal (rel 1e-9; the nearest wrong
    counts - the head counted frozen, one key fewer, the same-position keys counted - are
    0.2-0.7% off here). Left out on both sides: the same-position keys of later steps (an
    element-wise product in this path, `same_position_keys=False`) and non-matmul work;
    the reference path scores every key of the row (context = T)."""
    draft, batch, head, shape = step_and_shape(steps, layers, freeze_head)
    b, t = batch["input_ids"].shape
    select = trained_positions(batch["loss_mask"], batch["lengths"], steps)
    head_fraction = sum(len(s) for s in select) / (steps * b * t)
    counter = FlopCounterMode(display=False)
    with counter:
        out = ttt_step_metrics(draft, batch, head, steps, 0.8, accuracy=False)
        out["loss"].backward()
    measured = counter.get_total_flops()
    stated = flops_per_token(shape, steps, context=t, head_fraction=head_fraction,
                             lm_head_trained=not freeze_head, same_position_keys=False)
    assert measured == pytest.approx(stated["train"] * b * t, rel=1e-9)
    # and the forward alone is the sum of the parts
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        ttt_step_metrics(draft, batch, head, steps, 0.8, accuracy=False)
    parts = sum(v for k, v in stated.items() if k != "train")
    assert counter.get_total_flops() == pytest.approx(parts * b * t, rel=1e-9)


def test_the_causal_context_is_the_mean_number_of_keys_a_query_sees():
    for lengths, window in [([5], None), ([3, 10, 1], None), ([10, 4], 3), ([7], 7)]:
        seen = [min(i + 1, window or i + 1) for n in lengths for i in range(n)]
        assert causal_context(lengths, window) == pytest.approx(sum(seen) / len(seen))
    assert causal_context([]) == 0.0


def test_more_ttt_steps_or_a_trained_head_cost_more_and_the_fc_only_once():
    shape = dict(hidden_size=576, target_hidden_size=576, intermediate_size=1536,
                 num_heads=9, num_kv_heads=3, head_dim=64, draft_vocab_size=1359)
    three, seven = flops_per_token(shape, 3, 100), flops_per_token(shape, 7, 100)
    assert seven["fc"] == three["fc"] and seven["mlp"] == pytest.approx(7 / 3 * three["mlp"])
    frozen = flops_per_token(shape, 3, 100, lm_head_trained=False)
    assert three["train"] - frozen["train"] == pytest.approx(three["lm_head"])


def test_known_gpus_have_their_dense_bf16_peak_and_others_none():
    assert gpu_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_peak("NVIDIA H100 PCIe") == 756e12
    assert gpu_peak("NVIDIA A100-SXM4-80GB") == 312e12
    assert gpu_peak("NVIDIA L40S") == 362e12 and gpu_peak("NVIDIA L4") == 121e12
    assert gpu_peak("Some Future Card") is None


def test_the_cpu_rate_is_a_real_measurement_and_the_line_says_what_it_is_of():
    rate = measured_matmul_rate(size=128, seconds=0.05)
    assert 1e6 < rate < 1e14  # (68 MFLOP/s seen at 128x128 on the loaded 2-core VM)
    cost = {"flops_per_token": 2.5e9, "ttt_steps": 7, "tokens_per_second": 100.0,
            "achieved_flops": 2.5e11, "peak_flops": 1e12, "fraction_of_peak": 0.25,
            "peak": "X dense bf16 peak"}
    assert cost_line(cost) == ("cost: 2.5 GFLOP/token (forward + backward, 7 TTT steps), "
                               "100 tok/s, 0.25 TFLOP/s = 25% of X dense bf16 peak")
