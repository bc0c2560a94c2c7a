"""HiddenStateDataModule: extracted shards as Lightning train / validation loaders.

`prepare_data()` builds whatever is missing (prepare, extract) through the configured
engine, so `stage=train` on a fresh config does the whole job. `setup()` opens the shards
memory-mapped. Batches pad to the longest sample and carry lengths and loss masks.
The training order is a pure function of (seed, global step): a resumed run reads the
same batches from the step it stopped at.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import lightning as L
import numpy as np
import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, Dataset

from eagle3x.data.shards import ShardReader


class HiddenStateDataset(Dataset):
    def __init__(self, reader: ShardReader, indices: Sequence[int]):
        self.reader, self.indices = reader, list(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        s = self.reader[self.indices[i]]
        return {"input_ids": s.input_ids.long(), "loss_mask": s.loss_mask,
                "aux_hidden": s.aux_hidden, "last_hidden": s.last_hidden}


def collate(samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Right-pad to the longest sample; `lengths` marks the real tokens."""
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    t = int(lengths.max())
    out: Dict[str, torch.Tensor] = {"lengths": lengths}
    for key in ("input_ids", "loss_mask", "aux_hidden", "last_hidden"):
        first = samples[0][key]
        buf = first.new_zeros((len(samples), t, *first.shape[1:]))
        for i, s in enumerate(samples):
            buf[i, : len(s[key])] = s[key]
        out[key] = buf
    return out


class StepBatchSampler:
    """Batches as a function of the global batch number: epoch e is a permutation seeded by
    (seed, e); rank r of w takes every w-th batch. Iteration starts at `start()`."""

    def __init__(self, n: int, batch_size: int, seed: int, start: Callable[[], int],
                 rank: int = 0, world: int = 1, total: int = 10 ** 9):
        self.n, self.bs, self.seed, self.start = n, min(batch_size, n), seed, start
        self.rank, self.world, self.total = rank, world, total
        self.per_epoch = max(n // self.bs, 1)

    def batch(self, g: int) -> List[int]:
        epoch, j = divmod(g, self.per_epoch)
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return perm[j * self.bs:(j + 1) * self.bs].tolist()

    def __iter__(self) -> Iterator[List[int]]:
        s = self.start()
        while s < self.total:
            yield self.batch(s * self.world + self.rank)
            s += 1

    def __len__(self) -> int:
        return self.total


class HiddenStateDataModule(L.LightningDataModule):
    def __init__(self, cfg: DictConfig, hidden_dir: Optional[str] = None):
        super().__init__()
        self.cfg = cfg
        self.hidden_dir = hidden_dir
        self.train_set: Optional[HiddenStateDataset] = None
        self.val_set: Optional[HiddenStateDataset] = None

    def prepare_data(self) -> None:
        """Build prepared data and hidden states unless the caller handed over a folder."""
        if self.hidden_dir is not None:
            return
        from eagle3x.stages import extract, prepare

        prepare.run(self.cfg)
        self.hidden_dir = extract.run(self.cfg)

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        if self.hidden_dir is None:
            from eagle3x.stages.extract import Plan

            self.hidden_dir = str(Plan(self.cfg).out)
        from eagle3x.layout import sample_split

        reader = ShardReader(self.hidden_dir, verify=self.cfg.extract.verify.value,
                             repair_hint="python -m eagle3x stage=extract extract.verify=sha256")
        hold, end = sample_split(self.cfg, len(reader))
        self.val_set = HiddenStateDataset(reader, range(0, hold))
        self.train_set = HiddenStateDataset(reader, range(hold, end))

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        accumulate = trainer.accumulate_grad_batches if trainer else 1
        sampler = StepBatchSampler(
            len(self.train_set), self.cfg.train.batch_size, self.cfg.train.seed,
            start=lambda: (trainer.global_step * accumulate) if trainer else 0,
            rank=trainer.global_rank if trainer else 0, world=trainer.world_size if trainer else 1)
        return DataLoader(self.train_set, batch_sampler=sampler, collate_fn=collate,
                          num_workers=self.cfg.train.num_workers)

    def val_dataloader(self) -> Any:
        if not self.val_set or len(self.val_set) == 0:
            return []
        return DataLoader(self.val_set, batch_size=self.cfg.train.batch_size, collate_fn=collate,
                          num_workers=self.cfg.train.num_workers)
