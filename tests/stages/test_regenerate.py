"""Stage regenerate as a user runs it: resumable after kill -9, vLLM and transformers agree
at temperature 0, and a thinking template round-trips through regenerate -> prepare with
the loss mask on the reply (seen through `python -m eagle3x.inspect`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import messages_record, write_jsonl

QUESTIONS = ["What is 12 plus 30?", "Spell garden backwards.", "How many metres are in 3 km?",
             "What is a batch?", "Name a colour.", "Is 7 prime?"]


def small_data(folder: Path) -> Path:
    records = [messages_record(("user", q), ("assistant", "I do not know."),
                               ("user", "Try again."), ("assistant", "Still no idea."))
               for q in QUESTIONS]
    return write_jsonl(folder / "chats.jsonl", records)


def args(data: Path, out: Path, *extra: str, engine: str = "hf") -> list:
    return ["stage=regenerate", f"engine={engine}", f"data.path={data}", "data=jsonl",
            "regenerate.max_new_tokens=8", "regenerate.chunk_size=2",
            f"regenerate.output_dir={out}", *extra]


@pytest.mark.slow
def test_killed_regeneration_resumes_without_redoing_a_finished_chunk(cli, store, tmp_path):
    data = small_data(tmp_path)
    whole = cli(*args(data, tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    out = tmp_path / "killed"
    env = dict(os.environ, **{"EAGLE3X_ARTIFACTS": str(store)})
    proc = subprocess.Popen([sys.executable, "-m", "eagle3x", *args(data, out)], cwd=tmp_path,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if json.loads((out / "manifest.json").read_text())["chunks"]:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    manifest = json.loads((out / "manifest.json").read_text())
    assert not manifest["complete"] and manifest["chunks"], manifest
    first = out / manifest["chunks"][0]["name"]
    before = first.stat()
    again = cli(*args(data, out))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "(1 done)" in again.stdout + again.stderr or "done)" in again.stdout + again.stderr
    after = first.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert (out / "conversations.jsonl").read_text() == (tmp_path / "whole" / "conversations.jsonl").read_text()
    stats = json.loads((out / "manifest.json").read_text())["stats"]
    assert stats["conversations"] == 6 and stats["replies"] == 12


@pytest.mark.vllm
def test_vllm_and_transformers_write_the_same_greedy_replies(cli, store, tmp_path):
    pytest.importorskip("vllm")
    data = small_data(tmp_path)
    hf = cli(*args(data, tmp_path / "hf", "engine.dtype=float32"))
    vl = cli(*args(data, tmp_path / "vllm", "engine.dtype=float32", "engine.enforce_eager=true",
                   "engine.gpu_memory_utilization=0.3", engine="vllm"))
    assert hf.returncode == 0 and vl.returncode == 0, vl.stderr[-3000:]
    rows = [[json.loads(x) for x in (tmp_path / d / "conversations.jsonl").read_text().splitlines()]
            for d in ("hf", "vllm")]
    assert rows[0] == rows[1]
    assert any(m["content"] != "I do not know." for r in rows[0] for m in r["messages"])
    assert json.loads((tmp_path / "vllm" / "manifest.json").read_text())["stats"]["tokens_per_second"] > 0


THINKING = ("{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
            "{% if m['role'] == 'assistant' and enable_thinking is defined and not enable_thinking %}"
            "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{{ m['content'] + '<|im_end|>\\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
            "{% if enable_thinking is defined and not enable_thinking %}"
            "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}")


@pytest.mark.slow
def test_a_thinking_template_round_trips_with_the_mask_on_the_reply(cli, store, tmp_path,
                                                                    tiny_verifier):
    verifier = tmp_path / "thinking-verifier"
    shutil.copytree(tiny_verifier, verifier)
    (verifier / "chat_template.jinja").write_text(THINKING)
    data = small_data(tmp_path)
    common = [f"data.path={data}", "data=jsonl", "verifier=local", f"verifier.path={verifier}",
              "experiment=tiny", "engine=hf", "data.responses=regenerated",
              "regenerate.max_new_tokens=8", "+data.chat_template_kwargs.enable_thinking=false",
              "data.holdout_samples=1"]
    r = cli("stage=prepare", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    shown = subprocess.run([sys.executable, "-m", "eagle3x.inspect", "--samples", "6", "--plain",
                            *common], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, EAGLE3X_ARTIFACTS=str(store)))
    assert shown.returncode == 0, shown.stderr[-3000:]
    samples = [s for s in shown.stdout.split("\n\n") if s.startswith("sample")]
    assert len(samples) == 6
    for s in samples:
        text = s.splitlines()[1]
        # every assistant turn: the empty think block is prompt, the reply is trained
        parts = text.split("[[")
        assert len(parts) == 3, text
        for before in parts[:2]:  # token separators removed; newlines shown as \\n
            assert before.replace("|", "").endswith("assistant\\n<think>\\n\\n</think>\\n\\n"), text
        for trained in parts[1:]:
            reply = trained.split("]]")[0].replace("|", "")
            assert "think" not in reply and reply.endswith("<im_end>\\n"), text  # "<|im_end|>" less its |
    regenerated = next(store.glob("regenerated/*/conversations.jsonl")).read_text()
    assert "I do not know." not in regenerated  # the verifier's own replies were trained
