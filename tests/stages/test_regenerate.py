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


def varied_data(folder: Path, n: int = 24) -> Path:
    """`n` conversations of one to three assistant turns (they finish at different times)."""
    records = []
    for i in range(n):
        turns = [("user", f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"), ("assistant", "No idea.")]
        for _ in range(i % 3):
            turns += [("user", "Try again."), ("assistant", "Still no idea.")]
        records.append(messages_record(*turns))
    return write_jsonl(folder / "varied.jsonl", records)


def part_lines(path: Path) -> list:
    try:
        return [json.loads(x) for x in path.read_text().split("\n") if x.endswith("}")]
    except (OSError, ValueError):
        return []


ENGINES = {"hf": ["engine=hf", "regenerate.batch_size=2"],
           "vllm": ["engine=vllm", "engine.enforce_eager=true",
                    "engine.gpu_memory_utilization=0.3"]}


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_sigterm_mid_chunk_stops_soon_keeping_each_finished_conversation(cli, store, tmp_path,
                                                                         engine):
    """SIGTERM while a chunk is under way: the run ends within 30 s with a non-zero status,
    its last line names the command that continues; the conversations finished so far are
    on disk, and the rerun takes them as they are (one is marked to see it) and regenerates
    only the rest, to what an uninterrupted run writes (greedy)."""
    if engine == "vllm":
        pytest.importorskip("vllm")
    data = varied_data(tmp_path)
    common = ["stage=regenerate", *ENGINES[engine], f"data.path={data}", "data=jsonl",
              "engine.dtype=float32", "regenerate.max_new_tokens=96"]
    # the reference: transformers, uninterrupted; with engine=vllm the comparison below is
    # also the check that vLLM writes transformers' greedy replies (float32)
    reference = [a for a in common if a not in ENGINES[engine] and not a.startswith("engine")]
    reference += ENGINES["hf"]
    whole = cli(*reference, "engine.dtype=float32", f"regenerate.output_dir={tmp_path / 'whole'}")
    assert whole.returncode == 0, whole.stderr[-3000:]
    out = tmp_path / "stopped"
    console = tmp_path / "console.txt"
    env = dict(os.environ, EAGLE3X_ARTIFACTS=str(store))
    proc = subprocess.Popen([sys.executable, "-m", "eagle3x", *common,
                             f"regenerate.output_dir={out}"], cwd=tmp_path, env=env,
                            stdout=open(console, "w"), stderr=subprocess.STDOUT)
    part = out / "chunk-00000.part.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None and not part_lines(part):
        time.sleep(0.02)
    assert proc.poll() is None, console.read_text()[-3000:]
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(120)
    took = time.time() - sent
    shown = console.read_text()
    assert code == 128 + signal.SIGTERM and took < 30, (code, took, shown[-3000:])
    last = shown.strip().splitlines()[-1]
    kept = part_lines(part)
    assert 0 < len(kept) < 24, shown[-3000:]
    assert last.startswith("eagle3x: regenerate stopped by SIGTERM in chunk 0; kept: "
                           f"{len(kept)} conversation"), last
    assert "continue with: python -m eagle3x stage=regenerate" in last, last
    assert not list(out.glob("chunk-?????.jsonl"))  # the chunk is still under way

    marked = next(e for e in kept if e["record"])
    marked["record"]["messages"][1]["content"] = "kept from the stopped run"
    part.write_text("".join(json.dumps(e) + "\n" for e in kept))
    again = cli(*common, f"regenerate.output_dir={out}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"({len(kept)} conversations done)" in again.stdout + again.stderr
    assert not part.exists()
    got = [json.loads(x) for x in (out / "conversations.jsonl").read_text().splitlines()]
    want = [json.loads(x) for x in (tmp_path / "whole" / "conversations.jsonl").read_text().splitlines()]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if g["source_line"] == marked["record"]["source_line"]:
            assert g["messages"][1]["content"] == "kept from the stopped run"
            assert g["messages"][2:] == w["messages"][2:]
        else:
            assert g == w
    stats = json.loads((out / "manifest.json").read_text())["stats"]
    assert stats == json.loads((tmp_path / "whole" / "manifest.json").read_text())["stats"] | {
        "tokens_per_second": stats.get("tokens_per_second")}
    assert stats["tokens_per_second"] > 0
