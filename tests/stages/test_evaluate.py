"""Stage eval, the parts that run without an engine: what a served greedy request returns,
the replay of greedy rounds on a known acceptance pattern, and the startup note when the
offline figure will follow the data's replies rather than the verifier's. (The greedy
estimate against vLLM's served figure: tests/stages/test_train.py, on the live eval's one
vLLM engine.)"""

from __future__ import annotations

from eagle3x.evaluation.live import greedy_rounds, summarise
from eagle3x.evaluation.offline import MEASURES, served_length


def test_a_greedy_request_returns_up_to_its_stop_token_or_the_limit():
    stops = {2, 7}
    assert served_length([5, 6, 2, 9, 9], stops, 64) == 3  # the stop token is returned
    assert served_length([5, 6, 8, 9, 9, 7], stops, 4) == 4  # the limit comes first
    assert served_length([7, 1, 1], stops, 10) == 1
    assert served_length([5, 6, 8], stops, 10) == 3  # a path shorter than the limit


def test_rounds_replayed_on_a_known_acceptance_pattern():
    # Position t accepts acc[t] drafts; a round at t makes acc[t] + 1 tokens.
    acc = [0, 0, 2, 0, 0, 3, 0, 1, 1, 0, 0, 0]
    r = greedy_rounds(acc, start=2, served=8)  # rounds at 2 (+3), 5 (+4): 1 + 3 + 4 = 8 made
    assert (r["num_drafts"], r["num_accepted_tokens"]) == (2, 5)
    assert r["accepted_per_pos"] == [2, 2, 1]
    s = summarise(r["num_drafts"], r["num_accepted_tokens"], r["accepted_per_pos"], 3)
    assert s["mean_accepted_length"] == 1 + 5 / 2
    assert s["acceptance_rate_per_depth"] == [1.0, 1.0, 0.5]


def test_each_offline_figure_is_named():
    from eagle3x.config.schema import OfflineEval

    assert set(MEASURES) == set(OfflineEval)
    assert "replies" in MEASURES[OfflineEval.data]
    assert "vLLM" in MEASURES[OfflineEval.greedy]


def test_startup_notes_when_the_offline_figure_follows_the_data_not_the_verifier(
        store, tiny_verifier):
    from eagle3x.__main__ import validate

    local = ["verifier=local", f"verifier.path={tiny_verifier}", "experiment=tiny"]
    for argv, noted in [(["stage=eval"], False),  # the embedded verifier: its demo figure
                        (["stage=eval", *local], True),
                        (["stage=eval", *local, "eval.offline=greedy"], False),
                        (["stage=eval", *local, "data.responses=regenerated"], False),
                        (["stage=vocab", *local], False)]:
        notes: list = []
        validate(argv, notes)
        assert any("eval.offline=greedy scores" in n for n in notes) == noted, (argv, notes)


def test_a_greedy_estimate_vllm_cannot_make_is_refused_at_startup(cli, tiny_verifier, tmp_path):
    """eval.offline=greedy runs the engine: with engine=vllm on a family vLLM cannot give aux
    hidden states for, startup refuses it naming the key and engine=hf; engine=hf runs."""
    from tests.test_families import named

    verifier = named(tiny_verifier, tmp_path, "Gemma3ForCausalLM")
    args = ["stage=eval", "verifier=local", f"verifier.path={verifier}", "experiment=tiny",
            "eval.offline=greedy", "logger=none"]
    r = cli(*args, "engine=vllm")
    assert r.returncode == 2
    assert "eval.offline=greedy" in r.stderr and "engine=hf" in r.stderr
    assert "SupportsEagle3" in r.stderr
    assert cli.refusal([*args, "engine=hf"], None) is None  # nothing refused
