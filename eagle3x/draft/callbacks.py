"""Lightning callbacks of a training run: progress lines, preemption, a failed rank.

``ProgressLines``  a line every `every` seconds (and at the last step): step, loss, acc_0,
                   tokens/s, ETA. Off a terminal (a job log, nohup, SLURM) on the console
                   and in the job's log file; on a terminal, where the bar shows progress,
                   in the log file only. The metrics are read when a line is printed: no
                   device sync at the other steps.
``Preemption``     SIGTERM or SIGINT (SLURM sends SIGTERM before it kills a job) ends
                   training at the end of a step: every rank agrees on the step (on
                   several processes a host-side all-reduce of the stop flag is started
                   each step and read the step after, so no step waits on it and the
                   stop comes one step later), a checkpoint is
                   written to ``last.ckpt`` where the step checkpoints would save it (on
                   train batch end, so the resumed run continues at the next step with the
                   same batches), and ``failures.Stopped`` is raised (status 128 + signal).
                   It replaces Lightning's own SIGTERM handler, which ends `fit` without a
                   checkpoint and lets the process exit 0. Grace period: the step under way
                   plus the checkpoint's write (a validation under way finishes first).
``RankFailures``   on several processes: a rank that fails writes why into the run folder
                   and every rank stops within ``distributed.WATCH_INTERVAL`` (+ its exit);
                   see ``distributed.RankWatch``.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L

from eagle3x import console
from eagle3x.failures import Stopped, signal_exit, signal_name

log = logging.getLogger("eagle3x")


class ProgressLines(L.Callback):
    """"train step 60/200 (30%): loss 2.114, acc_0 0.482, 1850 tok/s, 32.1s elapsed, ETA 1m15s"."""

    def __init__(self, every: float, to_console: bool):
        self.every, self.extra = every, None if to_console else console.LOG_ONLY
        self.counted = 0  # this rank's real tokens, from the loader's host-side count

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.t0 = self.last = time.perf_counter()
        self.step0 = trainer.global_step
        self.counted = 0

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if isinstance(batch, dict) and trainer.is_global_zero:
            self.counted += int(batch.get("n_tokens", 0))  # no device read

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        # callback_metrics hold the step just finished (Lightning updates them after the
        # batch-end hooks), so the line is printed as the next step starts.
        now = time.perf_counter()
        if (trainer.is_global_zero and trainer.global_step > self.step0
                and now - self.last >= self.every):
            self.last = now
            self._line(trainer, now)

    def on_train_end(self, trainer: Any, module: Any) -> None:
        if trainer.is_global_zero and trainer.global_step > self.step0:
            self._line(trainer, time.perf_counter())

    def _line(self, trainer: Any, now: float) -> None:
        m = trainer.callback_metrics
        step, total = trainer.global_step, trainer.max_steps
        took, done = now - self.t0, trainer.global_step - self.step0
        parts = []
        for key, name in (("train/loss", "loss"), ("train/acc_0", "acc_0")):
            if key in m:
                parts.append(f"{name} {float(m[key]):.3f}")
        world = trainer.world_size
        parts.append(f"{self.counted / max(took, 1e-9):.0f} tok/s"
                     + (f" per process ({world})" if world > 1 else ""))
        parts.append(f"{console.duration(took)} elapsed")
        eta = (took / done * (total - step) if total and total > 0 and step < total and done
               else None)
        left = time_left(trainer)  # trainer.max_time: whichever bound comes first
        if left is not None:
            eta = left if eta is None else min(eta, left)
        if eta is not None:
            parts.append(f"ETA {console.duration(eta)}")
        of = f"/{total} ({100 * step / total:.0f}%)" if total and total > 0 else ""
        log.info("train step %d%s: %s", step, of, ", ".join(parts), extra=self.extra)


def time_left(trainer: Any) -> Optional[float]:
    """Seconds of trainer.max_time left (Lightning's Timer), or None without one."""
    from lightning.pytorch.callbacks import Timer

    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
    left = timer.time_remaining("train") if timer is not None else None
    return None if left is None else max(float(left), 0.0)


class Preemption(L.Callback):
    """SIGTERM / SIGINT: a checkpoint at the end of the step under way, then `Stopped`."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, checkpoint: Path):
        self.checkpoint = checkpoint
        self.signal: Optional[int] = None
        self.saved_step: Optional[int] = None
        self._old: dict = {}
        self._group: Any = None  # the gloo group of the stop flag (several processes)
        self._pending: Any = None  # (work, flag) of the all-reduce started a step ago

    def install(self) -> None:
        """Own SIGTERM/SIGINT from here until `restore` (the main thread only). Called
        before fit and again when training starts, after Lightning installed its own."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s in self.SIGNALS:
            old = signal.signal(s, self._handler)
            self._old.setdefault(s, old)

    def restore(self) -> None:
        for s, old in self._old.items():
            try:
                signal.signal(s, old)
            except (ValueError, TypeError):
                pass
        self._old = {}

    def _handler(self, signum: int, _frame: Any) -> None:
        if self.signal is None:
            log.warning("%s: training stops at the end of this step, with a checkpoint",
                        signal_name(signum))
        self.signal = signum

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.install()
        self._pending = self._group = None
        if trainer.world_size > 1:
            import torch.distributed as dist

            # A gloo group of its own: the flag is a CPU tensor, so neither its all-reduce
            # nor reading it touches the accelerator's stream (NCCL would sync the host).
            self._group = dist.new_group(backend="gloo")
        if self._agreed_now():  # asked to stop before the first step: nothing to save
            raise Stopped(f"stopped by {signal_name(self.signal or signal.SIGTERM)} before "
                          f"training step {trainer.global_step + 1}",
                          signal_exit(self.signal or signal.SIGTERM))

    def _agreed_now(self) -> bool:
        """Whether any rank was asked to stop, waiting for the answer (once, before the
        first step)."""
        mine = self.signal is not None
        if self._group is None:
            return mine
        import torch
        import torch.distributed as dist

        flag = torch.tensor([int(mine)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    def _agreed(self) -> bool:
        """Whether any rank had been asked to stop by the previous step's end. Each rank
        starts one all-reduce of its flag per step (the same sequence on every rank) and
        reads the one it started a step ago, which has long finished: every rank reads
        the same value at the same step, and no step waits on the others' answer."""
        mine = self.signal is not None
        if self._group is None:
            return mine
        import torch
        import torch.distributed as dist

        agreed = False
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            agreed = bool(flag.item())
        flag = torch.tensor([int(mine)], dtype=torch.int32)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group,
                                         async_op=True), flag)
        return agreed

    def _settle(self) -> None:
        """Wait for the last all-reduce started (every rank started it)."""
        pending, self._pending = getattr(self, "_pending", None), None
        if pending is not None:
            pending[0].wait()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # With gradient accumulation the optimizer steps on the last micro-batch: stop
        # only where a step ended (what a step checkpoint holds).
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        if not self._agreed():
            return
        signum = self.signal or signal.SIGTERM  # another rank's signal
        self._settle()
        trainer.save_checkpoint(str(self.checkpoint))
        self.saved_step = trainer.global_step
        raise Stopped(f"stopped by {signal_name(signum)} after step {trainer.global_step}",
                      signal_exit(signum),
                      kept=f"checkpoint at step {trainer.global_step} ({self.checkpoint})")

    def on_train_end(self, trainer: Any, module: Any) -> None:
        self._settle()

    def on_exception(self, trainer: Any, module: Any, exception: BaseException) -> None:
        self.restore()

    def on_fit_end(self, trainer: Any, module: Any) -> None:
        self.restore()


class RankFailures(L.Callback):
    """On several processes: watch the other ranks (``distributed.RankWatch``) while
    training, and tell them when this one fails."""

    def __init__(self, board: Path):
        self.board = board
        self.watch: Any = None

    def setup(self, trainer: Any, module: Any, stage: str) -> None:
        from eagle3x import distributed

        if trainer.world_size <= 1 or self.watch is not None:
            return
        launcher = getattr(trainer.strategy, "launcher", None)
        children = list(getattr(launcher, "procs", []) or []) if trainer.global_rank == 0 else []
        self.watch = distributed.RankWatch(self.board, trainer.global_rank, trainer.world_size,
                                           children)
        self.watch.start()

    def on_exception(self, trainer: Any, module: Any, exception: BaseException) -> None:
        if self.watch is None:
            return
        if isinstance(exception, Stopped):  # every rank stops at the same step: no failure
            self.watch.stop()
            return
        self.watch.failed(f"{type(exception).__name__}: {exception}")

    def stop(self) -> None:
        """Training ended on every rank (the stage calls it after its last collective)."""
        if self.watch is not None:
            self.watch.stop()
