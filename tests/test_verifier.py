"""Verifier facts: the default aux layers and which aux layer ids a run may use."""

from __future__ import annotations

import pytest

from eagle3x.verifier import aux_layer_problem, default_aux_layers


@pytest.mark.parametrize("n", range(4, 129))
def test_default_aux_layers_are_three_distinct_increasing_layers(n):
    ids = default_aux_layers(n)
    assert len(ids) == 3 and 0 <= ids[0] < ids[1] < ids[2] < n, (n, ids)
    assert aux_layer_problem(ids, n) is None


@pytest.mark.parametrize("n", range(8, 129))
def test_default_is_low_middle_high_where_those_never_collided(n):
    assert default_aux_layers(n) == [1, n // 2 - 1, n - 4]


def test_six_layers_no_longer_repeat_a_layer():
    assert default_aux_layers(6) == [1, 2, 3]


@pytest.mark.parametrize("ids,needle", [([5, 1, 3], "increasing order"), ([1, 2, 2], "distinct"),
                                        ([1, 3, 8], "out of range"), ([1, 2], "three layers")])
def test_unusable_aux_ids_are_explained(ids, needle):
    why = aux_layer_problem(ids, 8)
    assert why and needle in why, why


def test_a_verifier_with_fewer_than_three_layers_cannot_feed_a_draft():
    assert aux_layer_problem(default_aux_layers(2), 2)
    assert default_aux_layers(3) == [0, 1, 2] and aux_layer_problem([0, 1, 2], 3) is None
