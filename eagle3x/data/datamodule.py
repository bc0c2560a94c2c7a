"""HiddenStateDataModule: extracted shards as Lightning train / validation loaders.

Takes plain arguments (folder, split, batch size, seed, workers). Handed a
``HiddenStates`` source, `prepare_data()` builds whatever is missing (prepared data,
hidden states) through the extraction layer and engine, the same code ``stage=extract``
runs. `setup()` opens the shards memory-mapped. Training batches are packed (several
samples per row, `collate_packed`), validation batches pad to the longest sample; both
carry lengths and loss masks.
The training order is a pure function of the seed and the global sample index
(`StepBatchSampler`): a resumed run reads the same batches from the step it stopped at,
on any number of processes with the same global batch.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from eagle3x.config.schema import (EngineConfig, ExtractConfig, HiddenConfig, HiddenSource,
                                   TrainConfig)
from eagle3x.data.extraction import HiddenStates
from eagle3x.data.shards import ShardReader
from eagle3x.plan import RunPlan, Split


class HiddenStateDataset(Dataset):
    def __init__(self, reader: ShardReader, indices: Sequence[int]):
        self.reader, self.indices = reader, list(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        s = self.reader[self.indices[i]]
        s["input_ids"] = s["input_ids"].long()
        return s  # aux_hidden and the teacher: last_hidden, or topk_ids + topk_logp


class OnlineDataset(Dataset):
    """The samples `indices` of the prepared data, their hidden states made by
    `features` (eagle3x.data.online.OnlineFeatures) a batch at a time."""

    def __init__(self, features: Any, indices: Sequence[int]):
        self.features, self.indices = features, list(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitems__(self, positions: Sequence[int]) -> List[Dict[str, torch.Tensor]]:
        out = self.features.samples([self.indices[p] for p in positions])
        for s in out:
            s["input_ids"] = s["input_ids"].long()
        return out

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return self.__getitems__([i])[0]

    def schedule(self, batches: Sequence[Sequence[int]]) -> None:
        """Hand the features the batches (dataset positions) that come next."""
        self.features.schedule([[self.indices[p] for p in b] for b in batches])


def collate(samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Right-pad to the longest sample; `lengths` marks the real tokens."""
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    t = int(lengths.max())
    out: Dict[str, torch.Tensor] = {"lengths": lengths}
    for key in samples[0]:
        first = samples[0][key]
        buf = first.new_zeros((len(samples), t, *first.shape[1:]))
        for i, s in enumerate(samples):
            buf[i, : len(s[key])] = s[key]
        out[key] = buf
    return out


def collate_packed(samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """The same samples packed into as few rows as first-fit-decreasing allows, each row as
    long as the longest sample (no sample is split): less padding to compute. Each
    position carries its document in the row (`docs`, -1 for padding), its position in
    that document (`positions`) and where the document ends (`doc_end`); `lengths` is
    each row's filled length. The draft's attention and training-time test keep the
    documents apart, so a packed batch gives the unpacked batch's loss and accuracy."""
    lengths = [len(s["input_ids"]) for s in samples]
    cap = max(lengths)
    rows: List[List[int]] = []
    fill: List[int] = []
    for i in sorted(range(len(samples)), key=lambda i: (-lengths[i], i)):
        for r in range(len(rows)):
            if fill[r] + lengths[i] <= cap:
                rows[r].append(i)
                fill[r] += lengths[i]
                break
        else:
            rows.append([i])
            fill.append(lengths[i])
    b = len(rows)
    out: Dict[str, torch.Tensor] = {"lengths": torch.tensor(fill)}
    for key in samples[0]:
        first = samples[0][key]
        out[key] = first.new_zeros((b, cap, *first.shape[1:]))
    docs = torch.full((b, cap), -1, dtype=torch.long)
    positions = torch.zeros(b, cap, dtype=torch.long)
    doc_end = torch.zeros(b, cap, dtype=torch.long)
    for r, members in enumerate(rows):
        at = 0
        for d, i in enumerate(members):
            n = lengths[i]
            for key in samples[i]:
                out[key][r, at:at + n] = samples[i][key]
            docs[r, at:at + n] = d
            positions[r, at:at + n] = torch.arange(n)
            doc_end[r, at:at + n] = at + n
            at += n
    out.update(docs=docs, positions=positions, doc_end=doc_end)
    return out


class StepBatchSampler:
    """Batches as a function of the seed and the global sample index, whatever the number
    of processes.

    Optimizer step s reads the global batch of G = batch_size x world x accumulate samples
    at positions s*G .. s*G+G-1 of the sample stream; epoch e of the stream is a
    permutation seeded by (seed, e), cut to whole global batches. Micro-batch i of that
    step on rank r of `world` reads the `batch_size` samples at offset (i*world + r) *
    batch_size. So one process with batch_size=G and two with G/2 train on the same
    samples at every step, and a run resumed on another number of processes (same G)
    continues where it stopped (a global batch larger than the data: all of it, for one
    process; refused with several, whose slices would repeat samples).
    Iteration starts at micro-batch `start()`.
    """

    def __init__(self, n: int, batch_size: int, seed: int, start: Callable[[], int],
                 rank: int = 0, world: int = 1, accumulate: int = 1, total: int = 10 ** 9,
                 ahead: Optional[Callable[[List[List[int]]], None]] = None, ahead_n: int = 0,
                 horizon: Optional[int] = None):
        if world * accumulate == 1:
            batch_size = min(batch_size, n)  # a batch larger than the data: all of it
        elif batch_size * world * accumulate > n:
            from eagle3x.data.conversations import DataError

            raise DataError(
                f"the global batch ({batch_size} x {world} processes x {accumulate} "
                f"accumulated = {batch_size * world * accumulate} samples) is larger than the "
                f"{n} training samples; lower train.batch_size or use more data")
        self.n, self.bs, self.seed, self.start = n, batch_size, seed, start
        self.rank, self.world, self.accumulate, self.total = rank, world, accumulate, total
        self.global_batch = batch_size * world * accumulate
        self.per_epoch = max(n // self.global_batch, 1)
        #: told the `ahead_n` batches after each one handed out (online hidden states),
        #: none at or past micro-batch `horizon` (the run's last: nothing made for nothing)
        self.ahead, self.ahead_n = ahead, ahead_n
        self.horizon = min(total, horizon if horizon is not None else total)

    def batch(self, micro: int) -> List[int]:
        step, i = divmod(micro, self.accumulate)
        epoch, j = divmod(step, self.per_epoch)
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        first = j * self.global_batch + (i * self.world + self.rank) * self.bs
        return perm[first:first + self.bs].tolist()  # G <= n: within this epoch

    def __iter__(self) -> Iterator[List[int]]:
        m = self.start()
        while m < self.total:
            if self.ahead is not None:
                self.ahead([self.batch(j) for j in range(m, min(m + 1 + self.ahead_n,
                                                               self.horizon))])
            yield self.batch(m)
            m += 1

    def __len__(self) -> int:
        return self.total


class HiddenStateDataModule(L.LightningDataModule):
    """Train / validation loaders over the hidden states in `hidden_dir`.

    `split` says which samples are held out (validation) and which train. Handed `source`
    (the plan, extraction settings and engine), ``prepare_data()`` first makes whatever is
    missing through the extraction layer; without it the folder must already be whole.
    """

    def __init__(self, hidden_dir: str | Path, split: Split, *, batch_size: int, seed: int = 0,
                 num_workers: int = 0, verify: str = "size", pack: bool = True,
                 source: Optional[HiddenStates] = None,
                 online: Optional[Callable[[], Any]] = None):
        super().__init__()
        self.pack = pack
        self.hidden_dir, self.split, self.source = Path(hidden_dir), split, source
        #: hidden=online: makes the OnlineFeatures (engine opened) at setup; nothing stored
        self.online, self.features = online, None
        self.batch_size, self.seed, self.num_workers, self.verify = (
            batch_size, seed, num_workers, verify)
        self.train_set: Optional[HiddenStateDataset] = None
        self.val_set: Optional[HiddenStateDataset] = None

    @classmethod
    def from_plan(cls, plan: RunPlan, train: TrainConfig, extract: ExtractConfig,
                  engine: Optional[EngineConfig] = None,
                  hidden: Optional[HiddenConfig] = None) -> "HiddenStateDataModule":
        """The plan's hidden states with the training settings; given an engine, it builds
        missing prepared data and hidden states in ``prepare_data()``. With `hidden`
        online or server, they are made batch by batch while training
        (`hidden.prefetch` batches ahead) by the engine or the servers; none stored."""
        source = HiddenStates(plan, extract, engine or EngineConfig()) if (
            engine is not None or hidden is not None) else None
        make = None
        if hidden is not None and hidden.source is not HiddenSource.offline:
            make = functools.partial(online_features, plan, source, hidden)
        return cls(plan.hidden.folder, plan.split, batch_size=train.batch_size, seed=train.seed,
                   num_workers=train.num_workers, verify=extract.verify.value,
                   pack=train.pack, source=source, online=make)

    def prepare_data(self) -> None:
        """Make prepared data and hidden states when a source was handed over (online:
        the prepared data only)."""
        if self.online is not None:
            from eagle3x.data import prepared

            prepared.build(self.source.plan)
        elif self.source is not None:
            self.source.make()

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        if self.online is not None:
            # each training process makes its own batches with its own engine, on its device
            self.features = self.online(str(self.trainer.strategy.root_device)
                                        if self.trainer else None)
            n = self.split.extract_until(self.features.data["n"])
            hold, end = self.split.bounds(n)
            self.val_set = OnlineDataset(self.features, range(0, hold))
            self.train_set = OnlineDataset(self.features, range(hold, end))
            return
        reader = ShardReader(self.hidden_dir, verify=self.verify,
                             repair_hint="python -m eagle3x stage=extract extract.verify=sha256")
        hold, end = self.split.bounds(len(reader))
        self.val_set = HiddenStateDataset(reader, range(0, hold))
        self.train_set = HiddenStateDataset(reader, range(hold, end))

    def teardown(self, stage: Optional[str] = None) -> None:
        self.close()

    def close(self) -> None:
        """Stop the online engine (nothing to do offline)."""
        if self.features is not None:
            self.features.close()

    def mean_tokens_per_batch(self) -> float:
        """Average real tokens in a training batch (for throughput figures)."""
        source = self.features if self.features is not None else self.train_set.reader
        lengths = [source.length(i) for i in self.train_set.indices]
        return sum(lengths) / max(len(lengths), 1) * min(self.batch_size, len(lengths))

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        accumulate = trainer.accumulate_grad_batches if trainer else 1
        last = trainer.max_steps * accumulate if trainer and trainer.max_steps > 0 else None
        sampler = StepBatchSampler(
            len(self.train_set), self.batch_size, self.seed,
            start=lambda: (trainer.global_step * accumulate) if trainer else 0,
            rank=trainer.global_rank if trainer else 0, world=trainer.world_size if trainer else 1,
            accumulate=accumulate,
            ahead=self.train_set.schedule if self.features is not None else None,
            ahead_n=self.features.prefetch if self.features is not None else 0, horizon=last)
        return DataLoader(self.train_set, batch_sampler=sampler,
                          collate_fn=collate_packed if self.pack else collate,
                          num_workers=self.num_workers)

    def val_dataloader(self) -> Any:
        """The held-out samples; with several processes each takes every world-th one
        (when there are enough for all), and the module sums the counts across ranks."""
        if not self.val_set or len(self.val_set) == 0:
            return []
        rank, world = ((self.trainer.global_rank, self.trainer.world_size) if self.trainer
                       else (0, 1))
        data = self.val_set
        if self.val_sharded():
            mine = self.val_set.indices[rank::world]
            data = (OnlineDataset(self.features, mine) if self.features is not None
                    else HiddenStateDataset(self.val_set.reader, mine))
        return DataLoader(data, batch_size=self.batch_size, collate_fn=collate,
                          num_workers=self.num_workers)

    def val_sharded(self) -> bool:
        world = self.trainer.world_size if self.trainer else 1
        return world > 1 and self.val_set is not None and len(self.val_set) >= world


def online_features(plan: RunPlan, source: HiddenStates, hidden: HiddenConfig,
                    device: Optional[str] = None) -> Any:
    """OnlineFeatures for the plan: its prepared data, the configured engine (opened
    now, in this thread) or the hidden-state servers, the run's storage format and dtype,
    the top-k head if needed. An hf engine with engine.device=auto goes on the training
    process's own GPU (`device`, the strategy's root device: cuda:2 for the first rank of
    trainer.devices=[2,3])."""
    from eagle3x.data import prepared
    from eagle3x.data.extraction import _teacher_head
    from eagle3x.data.online import OnlineFeatures
    from eagle3x.engines.base import open_engine
    from eagle3x.weights import FINAL_NORM_NAMES, find_tensor, torch_dtype

    def engine() -> Any:
        if hidden.source is HiddenSource.server:
            from eagle3x.engines.server import ServerEngine

            return ServerEngine(hidden.urls, find_tensor(plan.verifier.path, FINAL_NORM_NAMES),
                                plan.verifier.rms_norm_eps, len(plan.aux_layer_ids))
        settings = source.engine
        if settings.device == "auto" and device and device.startswith("cuda"):
            settings = dataclasses.replace(settings, device=device)
        # vLLM's captures pass through a hidden temporary folder in the run folder,
        # removed with the engine: nothing is left behind
        return open_engine(settings, plan.verifier, plan.aux_layer_ids,
                           source.extract.max_seq_len, plan.run_dir)

    data = prepared.load(plan.prepared.folder)
    head = _teacher_head(plan)
    return OnlineFeatures(data, engine, dict(plan.hidden_format),
                          torch_dtype(source.extract.dtype.value),
                          head.get if head is not None else None, hidden.prefetch)
