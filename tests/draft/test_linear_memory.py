"""The linear-memory training-time test (blocked, recomputed attention, or the fused kernel;
chunked loss with its gradients formed in the forward pass) against the dense
implementation it replaced (eagle3x/testing/dense_ttt.py), in float32 on random inputs: every
step's logits, every metric, every gradient, for both attention paths. And the property
it exists for: what autograd keeps for backward grows linearly in T, where the dense
path's grows as T^2.
"""

from __future__ import annotations

import copy
from typing import Dict

import pytest
import torch

from eagle3x.draft.model import DraftShape, Eagle3Draft
from eagle3x.draft.ttt import shift, ttt_step_metrics
from eagle3x.testing.dense_ttt import dense_step_metrics, dense_unroll

H, TH, VD, VT = 32, 24, 20, 50
#: both attention paths: the blocked reference (model.ttt_attention) and the fused kernel
#: (draft/attention.py; on the CPU its flash kernel, on CUDA the variable-length one)
IMPLS = ["reference", "fused"]


def draft_and_batch(seed: int, t: int, lengths, heads: int = 4, kv: int = 2, block: int = 8,
                    impl: str = "auto"):
    g = torch.Generator().manual_seed(seed)
    s = DraftShape(hidden_size=H, target_hidden_size=TH, intermediate_size=48, num_heads=heads,
                   num_kv_heads=kv, head_dim=8, draft_vocab_size=VD, target_vocab_size=VT)
    chosen = torch.randperm(VT, generator=g)[:VD].sort().values
    t2d = torch.zeros(VT, dtype=torch.bool)
    t2d[chosen] = True
    torch.manual_seed(seed)
    draft = Eagle3Draft(s, chosen - torch.arange(VD), t2d)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    draft.midlayer.self_attn.block = block
    draft.midlayer.self_attn.impl = impl
    b = len(lengths)
    batch = {"input_ids": torch.randint(1, VT, (b, t), generator=g),
             "loss_mask": torch.randint(0, 2, (b, t), generator=g, dtype=torch.uint8),
             "lengths": torch.tensor(lengths),
             "aux_hidden": torch.randn(b, t, 3 * TH, generator=g),
             "last_hidden": 2 * torch.randn(b, t, TH, generator=g)}
    for i, n in enumerate(lengths):
        batch["loss_mask"][i, n:] = 0
    head = torch.randn(VT, TH, generator=g)
    return draft, batch, head


def grads(draft: Eagle3Draft, loss: torch.Tensor) -> Dict[str, torch.Tensor]:
    draft.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("t,block,heads,kv", [(37, 8, 4, 2), (37, 8, 2, 2), (16, 16, 4, 1),
                                              (40, 13, 4, 4)])
def test_blocked_attention_gives_the_dense_logits_and_gradients_at_every_step(t, block, heads, kv,
                                                                              impl):
    draft, batch, _ = draft_and_batch(1, t, [t, t - 5], heads, kv, block, impl)
    ids = batch["input_ids"]
    tokens = torch.cat([shift(ids, 1), ids.new_zeros(ids.shape[0], 5)], dim=1)
    new = draft.unroll(batch["aux_hidden"], tokens, 5)
    old = dense_unroll(draft, batch["aux_hidden"], tokens, 5)
    for k, (a, b) in enumerate(zip(new, old)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (k, (a - b).abs().max())
    weights = torch.randn(len(new), *new[0].shape, generator=torch.Generator().manual_seed(3))
    g_new = grads(draft, sum((w * x).sum() for w, x in zip(weights, new)))
    g_old = grads(draft, sum((w * x).sum() for w, x in zip(weights, old)))
    assert g_new.keys() == g_old.keys()
    for n in g_new:
        scale = g_old[n].abs().max().clamp(min=1e-6)
        assert (g_new[n] - g_old[n]).abs().max() / scale < 1e-5, n


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("chunk", [1, 7, 10 ** 6])
def test_chunked_loss_gives_the_dense_metrics_and_gradients(chunk, impl):
    draft, batch, head = draft_and_batch(2, 29, [29, 20, 11], block=8, impl=impl)
    new = ttt_step_metrics(draft, batch, head, 4, 0.8, chunk=chunk)
    old = dense_step_metrics(draft, batch, head, 4, 0.8)
    for k in range(4):
        assert int(new[f"count_{k}"]) == int(old[f"count_{k}"]) > 0
        assert float(new[f"acc_{k}"]) == float(old[f"acc_{k}"])
        assert float(new[f"loss_{k}"]) == pytest.approx(float(old[f"loss_{k}"]), rel=1e-5)
        assert float(new[f"ce_{k}"].detach()) == pytest.approx(
            float(old[f"loss_{k}"]) * int(old[f"count_{k}"]), rel=1e-5)
    assert float(new["accept_len"]) == pytest.approx(float(old["accept_len"]))
    g_new, g_old = grads(draft, new["loss"]), grads(draft, old["loss"])
    for n in g_old:
        scale = g_old[n].abs().max().clamp(min=1e-6)
        assert (g_new[n] - g_old[n]).abs().max() / scale < 1e-5, n


def test_the_default_block_keeps_short_sequences_on_the_dense_path_bit_for_bit():
    # the reference path (train.attention=reference): up to one block it is the dense code
    draft, batch, _ = draft_and_batch(3, 30, [30], block=512, impl="reference")
    ids = batch["input_ids"]
    tokens = torch.cat([shift(ids, 1), ids.new_zeros(1, 3)], dim=1)
    for a, b in zip(draft.unroll(batch["aux_hidden"], tokens, 3),
                    dense_unroll(draft, batch["aux_hidden"], tokens, 3)):
        assert torch.equal(a, b)


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd keeps for backward while `fn` runs."""
    seen: Dict[int, int] = {}

    def pack(x: torch.Tensor):
        st = x.untyped_storage()
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("impl", IMPLS)
def test_what_backward_keeps_grows_linearly_in_t_where_the_dense_path_grows_quadratically(impl):
    def kept(t: int, dense: bool) -> int:
        draft, batch, head = draft_and_batch(4, t, [t], heads=4, kv=4, block=16, impl=impl)
        ref = copy.deepcopy(draft)
        if dense:
            return saved_bytes(lambda: dense_step_metrics(ref, batch, head, 4, 0.8)["loss"])
        return saved_bytes(lambda: ttt_step_metrics(draft, batch, head, 4, 0.8, chunk=16)["loss"])

    new = [kept(t, False) for t in (256, 512, 1024)]
    old = [kept(t, True) for t in (256, 512, 1024)]
    # doubling T: linear memory doubles; the dense path's T^2 terms take over and quadruple
    assert all(1.8 < b / a < 2.2 for a, b in zip(new, new[1:])), new
    assert old[2] / old[1] > 3.3 and old[2] / old[1] > old[1] / old[0], old
    assert new[-1] < old[-1] / 5


# --------------------------------------------------------------------------------------
# Packed batches: several samples per row, kept apart
# --------------------------------------------------------------------------------------

def samples_for(seed: int, lengths) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        mask = torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8)
        out.append({"input_ids": torch.randint(1, VT, (n,), generator=g), "loss_mask": mask,
                    "aux_hidden": torch.randn(n, 3 * TH, generator=g),
                    "last_hidden": 2 * torch.randn(n, TH, generator=g)})
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("block,chunk", [(512, 2048), (8, 5)])
def test_a_packed_batch_gives_the_unpacked_batchs_loss_accuracy_and_gradients(block, chunk, impl):
    from eagle3x.data.datamodule import collate, collate_packed

    samples = samples_for(5, [23, 9, 7, 14, 3, 12, 6])
    packed, plain = collate_packed(samples), collate(samples)
    assert packed["input_ids"].shape[0] < plain["input_ids"].shape[0]  # fewer rows
    assert int(packed["lengths"].sum()) == int(plain["lengths"].sum())
    draft, _, head = draft_and_batch(6, 8, [8], block=block, impl=impl)
    a = ttt_step_metrics(draft, packed, head, 4, 0.8, chunk=chunk)
    ga = grads(draft, a["loss"])
    b = ttt_step_metrics(draft, plain, head, 4, 0.8, chunk=chunk)
    gb = grads(draft, b["loss"])
    for k in range(4):
        assert int(a[f"count_{k}"]) == int(b[f"count_{k}"]) > 0
        assert float(a[f"acc_{k}"]) == float(b[f"acc_{k}"])
        assert float(a[f"loss_{k}"]) == pytest.approx(float(b[f"loss_{k}"]), rel=1e-5)
    for n in gb:
        scale = gb[n].abs().max().clamp(min=1e-6)
        assert (ga[n] - gb[n]).abs().max() / scale < 1e-5, n


def test_packing_keeps_every_sample_whole_in_one_row_with_its_own_positions():
    from eagle3x.data.datamodule import collate_packed

    samples = samples_for(7, [10, 4, 6, 3, 7])
    p = collate_packed(samples)
    assert p["input_ids"].shape == (3, 10)  # 10 | 4+6 | 7+3
    found = []
    for r in range(p["input_ids"].shape[0]):
        for d in p["docs"][r].unique().tolist():
            if d < 0:
                continue
            where = (p["docs"][r] == d).nonzero().flatten()
            assert torch.equal(where, torch.arange(where[0], where[-1] + 1))  # contiguous
            assert torch.equal(p["positions"][r, where], torch.arange(len(where)))
            assert bool((p["doc_end"][r, where] == where[-1] + 1).all())
            ids = p["input_ids"][r, where]
            found.append(next(i for i, s in enumerate(samples) if torch.equal(s["input_ids"], ids)))
    assert sorted(found) == list(range(len(samples)))


# --------------------------------------------------------------------------------------
# The loss: teacher once per batch, trained positions from the loader, gradients in forward
# --------------------------------------------------------------------------------------

def test_the_loaders_trained_positions_give_the_loss_computed_without_them():
    from eagle3x.data.datamodule import collate_packed

    samples = samples_for(11, [19, 8, 13, 5])
    with_sel, bare = collate_packed(samples, steps=4), collate_packed(samples)
    draft, _, head = draft_and_batch(12, 8, [8], impl="fused")
    a = ttt_step_metrics(draft, with_sel, head, 4, 0.8)
    ga = grads(draft, a["loss"])
    b = ttt_step_metrics(draft, bare, head, 4, 0.8)
    gb = grads(draft, b["loss"])
    assert torch.equal(a["loss"].detach(), b["loss"].detach())
    assert all(torch.equal(ga[n], gb[n]) for n in gb)


def test_the_teacher_per_chunk_of_rows_gives_the_once_per_batch_table(monkeypatch):
    import eagle3x.draft.ttt as ttt

    draft, batch, head = draft_and_batch(13, 27, [27, 19], impl="fused")
    a = ttt_step_metrics(draft, batch, head, 3, 0.8, chunk=7)
    ga = grads(draft, a["loss"])
    monkeypatch.setattr(ttt, "TEACHER_TABLE_BYTES", 0)  # every chunk from the stored states
    b = ttt_step_metrics(draft, batch, head, 3, 0.8, chunk=7)
    gb = grads(draft, b["loss"])
    for k in range(3):
        assert float(a[f"loss_{k}"]) == pytest.approx(float(b[f"loss_{k}"]), rel=1e-6)
        assert float(a[f"acc_{k}"]) == float(b[f"acc_{k}"])
    for n in gb:
        assert torch.allclose(ga[n], gb[n], rtol=1e-5, atol=1e-7), n


def test_without_accuracy_the_loss_and_gradients_are_the_same_and_no_acc_is_reported():
    draft, batch, head = draft_and_batch(14, 21, [21, 16], impl="fused")
    a = ttt_step_metrics(draft, batch, head, 3, 0.8)
    ga = grads(draft, a["loss"])
    b = ttt_step_metrics(draft, batch, head, 3, 0.8, accuracy=False)
    gb = grads(draft, b["loss"])
    assert torch.equal(a["loss"].detach(), b["loss"].detach())
    assert all(torch.equal(ga[n], gb[n]) for n in gb)
    assert "acc_0" in a and not any(k.startswith("acc_") for k in b) and "accept_len" not in b


def test_the_loss_divides_each_steps_cross_entropy_by_the_given_denominators():
    draft, batch, head = draft_and_batch(15, 18, [18, 12], impl="fused")
    den = torch.tensor([3.0, 5.0, 7.0])
    m = ttt_step_metrics(draft, batch, head, 3, 0.5, denominators=den)
    want = sum(0.5 ** k * m[f"ce_{k}"] / den[k] for k in range(3))
    assert float(m["loss"].detach()) == pytest.approx(float(want), rel=1e-6)
    plain = ttt_step_metrics(draft, batch, head, 3, 0.5)
    assert float(plain["loss"].detach()) == pytest.approx(
        sum(0.5 ** k * float(plain[f"loss_{k}"]) for k in range(3)), rel=1e-6)
