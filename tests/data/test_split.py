"""Unit tests for the held-out / training split of the prepared order (plan.Split)."""

from __future__ import annotations

import pytest

from eagle3x.artifacts import ArtifactError
from eagle3x.plan import Split


@pytest.mark.parametrize("split,available,want", [
    (Split(2, 5), 10, (2, 7)),       # held out [0, 2), training [2, 7)
    (Split(2, 8), 10, (2, 10)),      # exactly enough
    (Split(2, None), 10, (2, 10)),   # None: all the rest
    (Split(0, None), 4, (0, 4)),
    (Split(0, 3), 4, (0, 3)),
    (Split(9, None), 10, (9, 10)),   # one training sample left
])
def test_bounds_hold_out_a_prefix_and_train_on_the_next_samples(split, available, want):
    assert split.bounds(available) == want


@pytest.mark.parametrize("split,available,need", [
    (Split(2, 9), 10, 11),
    (Split(0, 5), 4, 5),
    (Split(10, None), 10, 11),  # nothing left to train on
    (Split(12, None), 10, 13),
    (Split(0, None), 0, 1),
])
def test_bounds_refuse_data_that_holds_too_few_samples(split, available, need):
    with pytest.raises(ArtifactError) as err:
        split.bounds(available)
    msg = str(err.value)
    assert f"need {need} samples" in msg and f"holds {available}" in msg


def test_bounds_error_names_both_settings():
    with pytest.raises(ArtifactError) as err:
        Split(3, 20).bounds(10)
    assert "data.holdout_samples=3" in str(err.value)
    assert "data.num_samples=20" in str(err.value)


def test_min_samples_does_not_change_training_bounds():
    assert Split(2, 5, min_samples=50).bounds(100) == (2, 7)


@pytest.mark.parametrize("split,available,want", [
    (Split(2, 5), 20, 7),                   # no min_samples: the training end
    (Split(2, 5, min_samples=8), 20, 10),   # raised to holdout + min_samples
    (Split(2, 5, min_samples=3), 20, 7),    # never lowered
    (Split(2, 5, min_samples=8), 8, 8),     # capped at what is available
    (Split(2, 5, min_samples=100), 7, 7),
    (Split(2, None, min_samples=100), 20, 20),  # num_samples None: all the rest already
    (Split(2, None, min_samples=3), 20, 20),
    (Split(0, 4, min_samples=6), 10, 6),
])
def test_extract_until_is_the_training_end_raised_by_min_samples(split, available, want):
    assert split.extract_until(available) == want


def test_extract_until_refuses_what_bounds_refuses():
    with pytest.raises(ArtifactError):
        Split(2, 9, min_samples=1).extract_until(10)
    with pytest.raises(ArtifactError):
        Split(5, None, min_samples=10).extract_until(5)
