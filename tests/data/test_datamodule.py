"""Unit tests for the training batch order (StepBatchSampler) and `collate`."""

from __future__ import annotations

from itertools import islice

import pytest
import torch

from eagle3x.data.datamodule import StepBatchSampler, collate


def sampler(n=12, bs=3, seed=0, start=0, rank=0, world=1, total=10 ** 9) -> StepBatchSampler:
    return StepBatchSampler(n, bs, seed, start=lambda: start, rank=rank, world=world, total=total)


def take(s: StepBatchSampler, k: int) -> list:
    return list(islice(iter(s), k))


# --------------------------------------------------------------------------------------
# StepBatchSampler
# --------------------------------------------------------------------------------------

def test_batches_are_a_pure_function_of_seed_and_global_batch_number():
    a, b = sampler(seed=5), sampler(seed=5)
    assert take(a, 10) == take(b, 10)
    assert [a.batch(g) for g in (7, 0, 3)] == [b.batch(7), b.batch(0), b.batch(3)]
    assert a.batch(4) == a.batch(4)  # asking twice (or out of order) changes nothing
    assert take(a, 10) == [a.batch(g) for g in range(10)]


def test_different_seeds_give_different_orders():
    assert take(sampler(seed=0), 8) != take(sampler(seed=1), 8)


@pytest.mark.parametrize("start", [1, 3, 4, 9])
def test_sampler_started_at_step_s_yields_the_tail_of_one_started_at_zero(start):
    whole = take(sampler(seed=2), 15)
    resumed = take(sampler(seed=2, start=start), 15 - start)
    assert resumed == whole[start:]


def test_start_is_read_when_iteration_begins():
    step = {"now": 0}
    s = StepBatchSampler(12, 3, 0, start=lambda: step["now"])
    first = take(s, 6)
    step["now"] = 4
    assert take(s, 2) == first[4:6]


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_split_the_global_batch_one_process_reads(world):
    # one process with batch 2*world reads, at every step, what `world` ranks of 2 read
    single = take(sampler(n=24, bs=2 * world, seed=3), 6)
    per_rank = [take(sampler(n=24, bs=2, seed=3, rank=r, world=world), 6) for r in range(world)]
    for step in range(6):
        assert [i for r in range(world) for i in per_rank[r][step]] == single[step]


@pytest.mark.parametrize("world,accumulate", [(1, 2), (2, 2), (3, 1)])
def test_accumulated_micro_batches_of_all_ranks_make_the_same_global_batch(world, accumulate):
    g = 2 * world * accumulate
    single = take(sampler(n=30, bs=g, seed=6), 5)
    ranks = [take(StepBatchSampler(30, 2, 6, start=lambda: 0, rank=r, world=world,
                                   accumulate=accumulate), 5 * accumulate) for r in range(world)]
    for step in range(5):
        got = [i for a in range(accumulate) for r in range(world)
               for i in ranks[r][step * accumulate + a]]
        assert got == single[step]


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2), (2, 4)])
def test_a_run_resumed_on_another_number_of_processes_continues_the_same_stream(before, after):
    """Killed at step 3 on `before` processes, resumed on `after`, same global batch 4."""
    whole = take(sampler(n=22, bs=4, seed=9), 8)

    def steps(world: int, start: int, count: int) -> list:
        ranks = [take(sampler(n=22, bs=4 // world, seed=9, rank=r, world=world, start=start),
                      count) for r in range(world)]
        return [[i for r in range(world) for i in ranks[r][s]] for s in range(count)]

    assert steps(before, 0, 3) + steps(after, 3, 5) == whole


@pytest.mark.parametrize("n,bs", [(12, 3), (12, 4), (10, 10), (7, 1)])
def test_each_epoch_covers_every_sample_exactly_once_when_batch_divides_n(n, bs):
    per_epoch = n // bs
    batches = take(sampler(n=n, bs=bs, seed=7), 3 * per_epoch)
    assert all(len(b) == bs for b in batches)
    epochs = [batches[e * per_epoch:(e + 1) * per_epoch] for e in range(3)]
    for ep in epochs:
        flat = [i for b in ep for i in b]
        assert sorted(flat) == list(range(n))
    assert epochs[0] != epochs[1]  # a new permutation each epoch


def test_uneven_epoch_drops_the_remainder_and_never_repeats_within_an_epoch():
    n, bs = 11, 3  # 3 full batches per epoch, 2 samples left out
    batches = take(sampler(n=n, bs=bs, seed=8), 9)
    for e in range(3):
        flat = [i for b in batches[e * 3:(e + 1) * 3] for i in b]
        assert len(flat) == 9 and len(set(flat)) == 9
        assert set(flat) <= set(range(n))


def test_batch_size_larger_than_the_data_gives_the_whole_data_each_batch():
    batches = take(sampler(n=5, bs=8, seed=0), 3)
    for b in batches:
        assert sorted(b) == [0, 1, 2, 3, 4]


def test_iteration_stops_at_total_local_steps():
    assert len(take(sampler(total=5), 100)) == 5
    assert take(sampler(total=5, start=3), 100) == take(sampler(total=5), 100)[3:]
    assert take(sampler(total=5, start=5), 100) == []
    assert len(sampler(total=5)) == 5


def test_batch_indices_are_plain_ints_in_range():
    for b in take(sampler(n=9, bs=4, seed=1), 6):
        assert all(type(i) is int and 0 <= i < 9 for i in b)


# --------------------------------------------------------------------------------------
# collate
# --------------------------------------------------------------------------------------

def sample(n: int, base: int, h: int = 2):
    ids = torch.arange(base, base + n, dtype=torch.long)
    return {"input_ids": ids,
            "loss_mask": torch.ones(n, dtype=torch.uint8),
            "aux_hidden": (ids[:, None] + torch.arange(3 * h)[None] / 10 + 1).float(),
            "last_hidden": (ids[:, None] * 2 + torch.arange(h)[None] + 1).float()}


def test_collate_right_pads_with_zeros_to_the_longest_sample():
    samples = [sample(3, 1), sample(5, 20), sample(1, 40)]
    out = collate(samples)
    assert out["lengths"].tolist() == [3, 5, 1]
    assert out["input_ids"].shape == (3, 5)
    assert out["aux_hidden"].shape == (3, 5, 6) and out["last_hidden"].shape == (3, 5, 2)
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        for key in ("input_ids", "loss_mask", "aux_hidden", "last_hidden"):
            assert torch.equal(out[key][i, :n], s[key]), key
            assert not out[key][i, n:].any(), key
    assert out["input_ids"].tolist() == [[1, 2, 3, 0, 0], [20, 21, 22, 23, 24], [40, 0, 0, 0, 0]]
    assert out["loss_mask"].tolist() == [[1, 1, 1, 0, 0], [1] * 5, [1, 0, 0, 0, 0]]


def test_collate_keeps_each_fields_dtype():
    s = sample(2, 1)
    s["aux_hidden"] = s["aux_hidden"].bfloat16()
    out = collate([s, sample(4, 5) | {"aux_hidden": sample(4, 5)["aux_hidden"].bfloat16()}])
    assert out["input_ids"].dtype == torch.long
    assert out["loss_mask"].dtype == torch.uint8
    assert out["aux_hidden"].dtype == torch.bfloat16
    assert out["last_hidden"].dtype == torch.float32


def test_collate_keeps_a_samples_own_loss_mask_zeros():
    s = sample(4, 1)
    s["loss_mask"] = torch.tensor([0, 1, 0, 1], dtype=torch.uint8)
    out = collate([s, sample(6, 10)])
    assert out["loss_mask"][0].tolist() == [0, 1, 0, 1, 0, 0]


def test_collate_of_equal_lengths_only_stacks():
    samples = [sample(3, 1), sample(3, 7)]
    out = collate(samples)
    for key in ("input_ids", "loss_mask", "aux_hidden", "last_hidden"):
        assert torch.equal(out[key], torch.stack([s[key] for s in samples]))
    assert out["lengths"].tolist() == [3, 3]


def test_a_global_batch_larger_than_the_data_is_refused_on_several_processes():
    from eagle3x.data.conversations import DataError

    assert len(sampler(n=6, bs=8).batch(0)) == 6  # one process: all of it
    with pytest.raises(DataError, match="global batch .* = 8 samples.* 6 training samples"):
        StepBatchSampler(6, 4, 0, start=lambda: 0, rank=0, world=2)
    with pytest.raises(DataError):
        StepBatchSampler(6, 4, 0, start=lambda: 0, accumulate=2)


# --------------------------------------------------------------------------------------
# Token-sized batches (train.max_tokens)
# --------------------------------------------------------------------------------------

LENGTHS = [5, 17, 3, 9, 12, 30, 7, 7, 21, 2, 14, 8, 11, 26, 4, 6, 19, 10, 3, 15]


def token_sampler(max_tokens=40, seed=0, start=0, rank=0, world=1, accumulate=1,
                  lengths=LENGTHS) -> StepBatchSampler:
    return StepBatchSampler(len(lengths), 1, seed, start=lambda: start, rank=rank, world=world,
                            accumulate=accumulate, lengths=lengths, max_tokens=max_tokens)


def test_token_batches_cut_the_order_into_consecutive_runs_within_the_budget():
    from eagle3x.data.datamodule import token_batches

    order = list(range(len(LENGTHS)))[::-1]
    cut = token_batches(order, LENGTHS, 40)
    assert [i for b in cut for i in b] == order  # consecutive, nothing dropped or repeated
    for b, nxt in zip(cut, cut[1:] + [None]):
        used = sum(LENGTHS[i] for i in b)
        assert used <= 40
        if nxt is not None:  # the next sample would not have fitted
            assert used + LENGTHS[nxt[0]] > 40
    assert token_batches([0, 1], [50, 3], 40) == [[0], [1]]  # too long: alone


def test_token_sized_batches_are_a_pure_function_of_seed_and_step():
    a, b = token_sampler(seed=3), token_sampler(seed=3)
    assert take(a, 12) == take(b, 12) == [a.batch(m) for m in range(12)]
    assert take(token_sampler(seed=3, start=5), 7) == take(a, 12)[5:]
    assert take(token_sampler(seed=4), 12) != take(a, 12)


def test_each_token_sized_epoch_covers_each_sample_at_most_once_within_the_budget():
    s = token_sampler(max_tokens=45, seed=1)
    for epoch in range(3):
        batches = s._epoch(epoch)
        flat = [i for b in batches for i in b]
        assert len(flat) == len(set(flat))
        assert all(sum(LENGTHS[i] for i in b) <= 45 for b in batches)
    assert take(s, len(s._epoch(0))) == s._epoch(0)  # epoch 0 first, then epoch 1
    assert take(s, len(s._epoch(0)) + 1)[-1] == s._epoch(1)[0]


@pytest.mark.parametrize("world,accumulate", [(2, 1), (1, 3), (2, 2)])
def test_ranks_and_accumulation_share_one_token_sized_stream(world, accumulate):
    """Every rank and accumulated micro-batch of a step takes its own micro-batch of the
    one stream of the seed: together they read what one process with accumulate x world
    micro-batches per step reads, and a resume at step s continues it."""
    single = take(token_sampler(seed=2, accumulate=world * accumulate), 6 * world * accumulate)
    ranks = [take(token_sampler(seed=2, rank=r, world=world, accumulate=accumulate),
                  6 * accumulate) for r in range(world)]
    for step in range(6):
        got = [ranks[r][step * accumulate + a] for a in range(accumulate) for r in range(world)]
        assert got == single[step * world * accumulate:(step + 1) * world * accumulate]
    resumed = take(token_sampler(seed=2, rank=1 % world, world=world, accumulate=accumulate,
                                 start=3 * accumulate), 3 * accumulate)
    assert resumed == ranks[1 % world][3 * accumulate:]


def test_a_token_budget_too_large_for_the_global_batch_is_refused():
    from eagle3x.data.conversations import DataError

    with pytest.raises(DataError, match="train.max_tokens"):
        token_sampler(max_tokens=10 ** 6, world=2)
    assert len(token_sampler(max_tokens=10 ** 6).batch(0)) == len(LENGTHS)  # one process: all


def test_token_sized_batches_pack_into_one_row_of_exactly_the_budget():
    from eagle3x.data.datamodule import collate_packed

    samples = [sample(n, 10 * i) for i, n in enumerate([5, 9, 3])]
    out = collate_packed(samples, width=32)
    assert out["input_ids"].shape == (1, 32)
    assert out["lengths"].tolist() == [17]
    assert out["docs"][0, 17:].eq(-1).all() and out["loss_mask"][0, 17:].eq(0).all()


def test_collate_hands_each_steps_trained_positions_to_the_training_step():
    from eagle3x.data.datamodule import collate_packed
    from eagle3x.draft.ttt import trained_positions

    s = [sample(6, 1), sample(4, 20), sample(9, 40)]
    s[1]["loss_mask"] = torch.tensor([0, 1, 1, 0], dtype=torch.uint8)
    for batch in (collate(s, steps=3), collate_packed(s, steps=3)):
        want = trained_positions(batch["loss_mask"], batch["lengths"], 3, batch.get("doc_end"))
        assert [x.tolist() for x in batch["select"]] == [x.tolist() for x in want]
        assert batch["counts"].tolist() == [len(x) for x in want]
    assert "select" not in collate(s)


# --------------------------------------------------------------------------------------
# train.loss_on=all: every position of a training sample trained
# --------------------------------------------------------------------------------------

class _Reader:
    """Stands in for ShardReader: sample i as a fresh dict, with a loss mask on its tail."""

    def __init__(self, lengths):
        self.lengths = lengths

    def __getitem__(self, i):
        n = self.lengths[i]
        s = sample(n, 10 * i)
        s["loss_mask"] = torch.tensor([0] * (n // 2) + [1] * (n - n // 2), dtype=torch.uint8)
        return s


def test_loss_on_all_trains_every_position_a_step_can_reach_and_the_mask_only_otherwise():
    from eagle3x.data.datamodule import HiddenStateDataset, collate_packed

    reader = _Reader([7, 4, 9])
    masked = HiddenStateDataset(reader, [0, 1, 2])
    every = HiddenStateDataset(reader, [0, 1, 2], all_positions=True)
    assert masked[0]["loss_mask"].tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert every[0]["loss_mask"].tolist() == [1] * 7
    steps = 3
    a = collate_packed([masked[i] for i in range(3)], steps=steps)
    b = collate_packed([every[i] for i in range(3)], steps=steps)
    for k in range(steps):
        # step k at position t predicts token t + 2 + k of the same document: every such
        # position with loss_on=all, only those whose target lies in the tail otherwise
        want_all = sum(max(n - 2 - k, 0) for n in reader.lengths)
        want_masked = sum(min(n - n // 2, max(n - 2 - k, 0)) for n in reader.lengths)
        assert int(b["counts"][k]) == want_all
        assert int(a["counts"][k]) == want_masked <= want_all
    assert int(a["counts"][0]) < int(b["counts"][0])
    assert set(a["select"][0].tolist()) < set(b["select"][0].tolist())


def test_loss_on_all_is_handed_to_the_datamodule():
    from types import SimpleNamespace

    from eagle3x.config.schema import ExtractConfig, LossOn, TrainConfig
    from eagle3x.data.datamodule import HiddenStateDataModule

    plan = SimpleNamespace(hidden=SimpleNamespace(folder="x"), split=None)
    for on, want in ((LossOn.mask, False), (LossOn.all, True)):
        dm = HiddenStateDataModule.from_plan(plan, TrainConfig(loss_on=on), ExtractConfig())
        assert dm.all_positions is want


class _Features:
    """Stands in for OnlineFeatures (eagle3x/data/online.py): `samples(ids)` makes the
    samples of prepared ids a batch at a time, fresh dicts as the engine returns them."""

    def __init__(self, lengths):
        self.reader, self.asked = _Reader(lengths), []

    def samples(self, ids):
        self.asked.append(list(ids))
        return [self.reader[i] for i in ids]


def test_loss_on_all_trains_every_position_of_online_batches_too():
    """hidden=online: the batch the engine made has every position trained with
    loss_on=all, its loss mask otherwise; the held-out batches keep the mask."""
    from eagle3x.data.datamodule import OnlineDataset

    features = _Features([7, 4, 9])
    every = OnlineDataset(features, [1, 2], all_positions=True)
    held = OnlineDataset(features, [0])
    got = every.__getitems__([0, 1])
    assert features.asked == [[1, 2]]  # one engine call for the batch
    assert [s["loss_mask"].tolist() for s in got] == [[1] * 4, [1] * 9]
    assert held[0]["loss_mask"].tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert got[0]["input_ids"].dtype == torch.long
