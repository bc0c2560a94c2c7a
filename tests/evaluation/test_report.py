"""The eval's console words for how vLLM's rounds compare with the replay's."""

from __future__ import annotations

from eagle3x.evaluation.live import compare_rounds
from eagle3x.evaluation.report import rounds_line


def test_rounds_that_all_match_say_every_prompt():
    said = rounds_line(compare_rounds([[[5, 1], [5, 0]]] * 4, [[1, 0]] * 4, 5), 5)
    assert said == "vLLM's rounds are the replay's, round for round, on all 4 prompts"


def test_a_departure_names_the_prompt_the_round_and_both_counts():
    served = [[[5, 1], [5, 0]], [[5, 2], [5, 0], [5, 1]]]
    said = rounds_line(compare_rounds(served, [[1, 0], [2, 3]], 5), 5)
    assert said.startswith("vLLM's rounds are the replay's on 1 of 2 prompts; the first "
                           "that differs (prompt 1) departs at round 2, where vLLM accepted "
                           "0 of 5 and the trained draft's replay 3"), said
    assert "no round was cut short" in said and "scheduler" not in said


def test_rounds_the_scheduler_cut_are_counted_not_blamed_on_the_drafter():
    said = rounds_line(compare_rounds([[[5, 1], [2, 0], [5, 0]]], [[1, 2]], 5), 5)
    assert "2 rounds verified" not in said and "; 1 round verified fewer than 5 proposals (vLLM's scheduler cut it)" in said
    assert "no round was cut short" not in said
    assert "prompt 0 took 3 rounds in vLLM and 2 in the replay" not in said  # round 2 differs
    assert "departs at round 2, where vLLM accepted 0 of 2" in said


def test_nothing_said_without_vllms_rounds():
    assert rounds_line(None, 5) == ""
    assert rounds_line(compare_rounds([None, None], [[1], [2]], 5), 5) == ""
