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


def test_a_verifier_with_fewer_than_four_layers_cannot_feed_a_draft():
    # three servable layers are 0..N-2: the last layer's output is never captured
    assert aux_layer_problem(default_aux_layers(2), 2)
    assert aux_layer_problem(default_aux_layers(3), 3)


@pytest.mark.parametrize("n,ids", [(4, [0, 1, 2]), (5, [1, 2, 3]), (7, [1, 2, 3])])
def test_small_verifiers_get_servable_defaults(n, ids):
    assert default_aux_layers(n) == ids and aux_layer_problem(ids, n) is None


def test_the_last_layer_is_refused_and_the_servable_range_named():
    why = aux_layer_problem([1, 3, 7], 8)
    assert why and "last layer" in why and "0..6" in why, why


def test_a_first_layer_of_0_is_refused_only_where_sglang_cannot_express_it():
    assert aux_layer_problem([0, 3, 5], 8) is None
    why = aux_layer_problem([0, 3, 5], 8, ("DeepseekV3ForCausalLM",))
    assert why and "first layer of 0" in why, why
    assert aux_layer_problem([1, 3, 5], 8, ("DeepseekV3ForCausalLM",)) is None
