"""The quiet console, in a real process: libraries' output of every kind goes to the job log
file, eagle3x's lines and any ERROR stay on the console."""

from __future__ import annotations

import pytest
import subprocess
import sys
import textwrap


SCRIPT = textwrap.dedent("""
    import logging, os, subprocess, sys, warnings
    from pathlib import Path
    from eagle3x import console

    log_file = Path(sys.argv[1])
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    root.addHandler(logging.StreamHandler(sys.stdout))  # what Hydra's console handler is
    root.addHandler(logging.FileHandler(log_file))
    assert console.job_log_file() == log_file
    with console.quiet(console.job_log_file()):
        logging.getLogger("eagle3x").info("own line")
        logging.getLogger("lightning.pytorch").info("library info")
        logging.getLogger("vllm").warning("library warning")
        logging.getLogger("vllm").error("library error")
        warnings.warn("a python warning")
        print("a library print")
        os.write(2, b"C-level write\\n")
        subprocess.run([sys.executable, "-c", "print('from a child process')"], check=True)
        console.stream().write("a progress bar\\n")
    logging.getLogger("eagle3x").info("after")
    print("print after")
""")


@pytest.mark.slow
def test_libraries_go_to_the_log_file_and_eagle3x_to_the_console(tmp_path):
    log_file = tmp_path / "eagle3x.log"
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(log_file)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    shown = r.stdout + r.stderr
    logged = log_file.read_text()
    for line in ("own line", "library error", "a progress bar", "after", "print after"):
        assert line in shown, (line, shown)
    for line in ("library info", "library warning", "a python warning", "a library print",
                 "C-level write", "from a child process"):
        assert line in logged and line not in shown, (line, shown)


def test_without_a_log_file_nothing_is_redirected(capfd):
    from eagle3x import console

    with console.quiet(None):
        print("still here")
        assert console.stream() is sys.stderr
    assert "still here" in capfd.readouterr().out


def test_the_last_progress_line_comes_once(caplog):
    """Off a terminal: a line per `every` seconds, and at the end one last line only when
    the count moved since the last one (not the same count again with another rate)."""
    import logging

    from eagle3x import console

    with caplog.at_level(logging.INFO, logger="eagle3x"):
        bar = console._Lines(4, "regenerate", "conversations", 0, every=0.0)
        bar.set_postfix(tok_s=10)
        bar.update(3)
        bar.set_postfix(tok_s=12)
        bar.update(1)
        bar.set_postfix(tok_s=11)
        bar.close()
        moved = console._Lines(4, "regenerate", "conversations", 0, every=0.0)
        moved.update(2)
        moved.every = 3600.0
        moved.update(2)
        moved.close()
    shown = [r.getMessage().split(" conversations")[0] for r in caplog.records
             if r.getMessage().startswith("regenerate: ")]
    assert shown == ["regenerate: 3/4", "regenerate: 4/4", "regenerate: 2/4", "regenerate: 4/4"]


def test_the_eta_is_measured_from_the_engine_start_not_the_bar_start(caplog, monkeypatch):
    """An engine start is elapsed time but no progress: after `rate_from_now` the ETA's
    rate counts only what came after it; the elapsed time still counts from the start."""
    import logging

    from eagle3x import console

    clock = [0.0]
    monkeypatch.setattr(console.time, "perf_counter", lambda: clock[0])
    with caplog.at_level(logging.INFO, logger="eagle3x"):
        for measured in (True, False):
            bar = console._Lines(100, "regenerate", "replies", 0, every=0.0)
            clock[0] = 40.0  # the engine is ready
            if measured:
                bar.rate_from_now()
            clock[0] = 50.0
            bar.update(10)
            clock[0] = 0.0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("regenerate: ")]
    assert lines[0].endswith(f"{console.duration(50)} elapsed, ETA {console.duration(90)}")
    assert lines[1].endswith(f"ETA {console.duration(450)}")
