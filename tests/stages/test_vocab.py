"""Stage vocab: the draft vocabulary sized by coverage (vocab.draft_vocab_size=auto), the
warning when most of a fixed size is never trained, and its refusal at startup where the
prepared data already proves it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eagle3x.stages.vocab import (KEPT_SHORTFALL, auto_size, build_mapping, chosen_size,
                                  kept_vocab_warning, mostly_unseen)
from tests.helpers import messages_record, stage_output, write_jsonl


def brute_auto(counts, coverage, cap):
    """The fewest most frequent tokens covering `coverage`, by trying every size."""
    ranked = sorted((c for c in counts if c > 0), reverse=True)
    total = sum(ranked)
    for n in range(1, len(ranked) + 1):
        if sum(ranked[:n]) >= coverage * total - 1e-9 * total:
            return max(1, min(n, cap))
    return max(1, min(len(ranked), cap))


@pytest.mark.parametrize("coverage", [0.5, 0.9, 0.99, 0.999, 1.0])
def test_auto_size_is_the_fewest_most_frequent_tokens_covering_the_share(coverage):
    rng = np.random.default_rng(1)
    counts = (rng.zipf(1.3, size=2000) * (rng.random(2000) < 0.6)).clip(0, 10**6)
    n = auto_size(counts, coverage, cap=10**6)
    assert n == brute_auto(counts.tolist(), coverage, 10**6)
    d2t, t2d, filled = build_mapping(counts, n)
    covered = counts[t2d].sum() / counts.sum()
    assert filled == 0 and covered >= coverage - 1e-12
    if n > 1:  # one token fewer (the least frequent chosen one) falls short
        assert (counts[t2d].sum() - counts[t2d].min()) / counts.sum() < coverage


def test_auto_size_is_capped_and_never_zero():
    counts = np.array([0, 10, 10, 10, 10, 0])
    assert auto_size(counts, 1.0, cap=10) == 4  # every distinct token
    assert auto_size(counts, 1.0, cap=2) == 2  # the cap wins
    assert auto_size(counts, 0.01, cap=10) == 1
    assert auto_size(np.zeros(5, dtype=np.int64), 0.99, cap=10) == 1  # nothing trained
    assert chosen_size(counts, 3, 0.99, cap=2) == 3  # a fixed size is taken as given
    assert chosen_size(counts, "auto", 0.5, cap=10) == 2


def test_mostly_unseen_is_more_than_half_never_trained():
    assert mostly_unseen(32000, 291) and mostly_unseen(1000, 499)
    assert not mostly_unseen(1000, 500) and not mostly_unseen(256, 300)


@pytest.mark.parametrize("coverage", [0.65, 0.93, 0.95, 0.99])
def test_a_kept_init_vocabulary_short_of_auto_coverage_is_warned_about(coverage):
    """draft.init's vocabulary kept: a warning naming vocab.remap=true once it covers more
    than KEPT_SHORTFALL less of the trained tokens than auto would; none otherwise."""
    warn = kept_vocab_warning(287, coverage, 1359, 0.999)
    if coverage < 0.999 - KEPT_SHORTFALL:
        assert warn and "vocab.remap=true" in warn and "287 tokens" in warn
        assert f"{100 * coverage:.1f}%" in warn and "1359" in warn
    else:
        assert warn is None


@pytest.mark.slow
def test_auto_vocab_stage_records_how_it_chose(cli, tiny_verifier):
    from eagle3x import artifacts
    from eagle3x.stages import vocab

    assert cli("stage=prepare").returncode == 0
    r = cli("stage=vocab", "vocab.draft_vocab_size=auto", "vocab.coverage=0.9")
    assert r.returncode == 0, r.stderr
    folder = stage_output(r, "vocab")
    stats = artifacts.read_manifest(folder)["stats"]
    v = vocab.load(folder)
    assert stats["size_rule"] == "auto" and stats["draft_vocab_size"] == len(v["d2t"])
    assert stats["draft_vocab_size"] == auto_size(v["counts"], 0.9, 32000) < 1024
    assert 0.9 <= stats["coverage"] and stats["filled"] == 0
    assert 0 < stats["heldout_coverage"] <= 1 and stats["heldout_tokens"] > 0
    assert "(auto: 90% coverage) covers" in r.stdout + r.stderr


def few_conversations(tmp_path, n=6):
    return write_jsonl(tmp_path / "few.jsonl", [
        messages_record(("user", f"Question number {i}?"), ("assistant", f"Answer {i}."))
        for i in range(n)])


@pytest.mark.slow
def test_a_mostly_unseen_fixed_vocab_is_refused_once_the_prepared_data_proves_it(cli, tmp_path,
                                                                         tiny_verifier):
    data = ["data=jsonl", f"data.path={few_conversations(tmp_path)}", "data.holdout_samples=1"]
    r = cli("stage=prepare", *data)
    assert r.returncode == 0, r.stderr
    trained = json.loads(
        (stage_output(r, "prepare") / "manifest.json").read_text())["stats"]["loss_tokens"]
    assert trained < 450
    refused = cli("stage=vocab", *data, "vocab.draft_vocab_size=900")
    assert refused.returncode == 2
    assert "vocab.draft_vocab_size=900" in refused.stdout + refused.stderr
    assert f"{trained} trained tokens" in refused.stdout + refused.stderr
    assert "vocab.draft_vocab_size=auto" in refused.stdout + refused.stderr
    ok = cli("stage=vocab", *data, "vocab.draft_vocab_size=auto")
    assert ok.returncode == 0, ok.stderr


@pytest.mark.slow
def test_the_vocab_stage_warns_when_the_split_shows_too_few_tokens(cli, tiny_verifier):
    # 5 training samples of the bundled data: far fewer distinct tokens than 1000, but
    # the whole prepared data holds more than 2000 trained tokens (no startup proof).
    assert cli("stage=prepare").returncode == 0
    r = cli("stage=vocab", "data.num_samples=5", "vocab.draft_vocab_size=1000")
    assert r.returncode == 0, r.stderr
    assert "vocab.draft_vocab_size=1000: the training samples show only" in r.stdout + r.stderr
    assert "vocab.draft_vocab_size=auto chooses" in r.stdout + r.stderr
