"""PyTorch's DDP tutorial trainer (multi-GPU training with torchrun), ported to livemig with its
structure kept: a `Trainer` class with `_run_batch`, `_run_epoch`, `_save_snapshot` and
`train(max_epochs)`, a `DistributedSampler` with `set_epoch` each epoch, and rank 0 saving a
snapshot every `save_every` epochs. What changes (README, "Porting a DDP script"):

- no `init_process_group`/`destroy_process_group` and no DDP wrapper: `@livemig.elastic()` and
  `livemig run`; the model and optimizer are registered;
- `for epoch in range(max_epochs)` is `for epoch in ctx.epochs(max_epochs, len(loader))`, and the
  loader is read through `ctx.batches(loader)` under `ctx.steps()`, so a rank taken over mid-epoch
  resumes at its sample;
- `optimizer.step()` is `ctx.step()` (the commit point; it zeroes the gradients);
- the rank is read from `ctx.rank` (never a cached `LOCAL_RANK`: a shrunk job's carried body).

The tutorial resumes from its own snapshot when the file exists; under livemig a recovered rank
takes its state from its peers instead, and restarting a finished or failed job from a checkpoint
is `livemig run --checkpoint-dir DIR` / `--resume-from` (README, "A script that resumes from its
own snapshot at start" for keeping the tutorial's).

livemig run --nproc 2 --spares 1 --fault kill:rank=1:step=40 --verify examples/ddp_tutorial.py
livemig run --nproc 2 --spares 1 --fault migrate:rank=0:step=40 --verify examples/ddp_tutorial.py
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import livemig


class MyTrainDataset(Dataset):
    """The tutorial's synthetic regression data (seeded here: every rank builds the same)."""

    def __init__(self, size: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index]


class Trainer:
    def __init__(self, ctx: livemig.Context, model: torch.nn.Module, train_data: DataLoader,
                 optimizer: torch.optim.Optimizer, save_every: int, snapshot_path: str) -> None:  # fmt: skip
        self.ctx = ctx
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        ctx.register(model=model, optimizer=optimizer)  # was: DDP(model, device_ids=[gpu_id])

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.ctx.step()  # was: self.optimizer.step() (zero_grad included)
        self.ctx.log(loss=loss.item())

    def _run_epoch(self, epoch: int) -> None:
        b_sz = self.train_data.batch_size
        if self.ctx.rank == 0 and not self.ctx.warming_up:
            print(f"[rank{self.ctx.rank}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        for _step, (source, targets) in zip(self.ctx.steps(), self.ctx.batches(self.train_data), strict=False):
            self._run_batch(source, targets)
            time.sleep(float(os.environ.get("TUTORIAL_STEP_SLEEP", "0")))  # room for a migration; no state

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {"MODEL_STATE": self.model.state_dict(), "EPOCHS_RUN": epoch}
        tmp = self.snapshot_path + ".tmp"
        torch.save(snapshot, tmp)
        os.replace(tmp, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int) -> None:
        for epoch in self.ctx.epochs(max_epochs, len(self.train_data)):  # was: range(self.epochs_run, max_epochs)
            self._run_epoch(epoch)
            if self.ctx.rank == 0 and epoch % self.save_every == 0 and self.snapshot_path:
                self._save_snapshot(epoch)


def load_train_objs(size: int) -> tuple[Dataset, torch.nn.Module, torch.optim.Optimizer]:
    train_set = MyTrainDataset(size)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, pin_memory=False, shuffle=False,
                      sampler=DistributedSampler(dataset))  # fmt: skip


@livemig.elastic(seed=0)
def main(ctx: livemig.Context, save_every: int, total_epochs: int, batch_size: int, size: int,
         snapshot_path: str) -> None:  # fmt: skip
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dataset, model, optimizer = load_train_objs(size)
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(ctx, model, train_data, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("--total-epochs", type=int, default=4, help="Total epochs to train the model")
    parser.add_argument("--save-every", type=int, default=1, help="How often to save a snapshot")
    parser.add_argument("--batch-size", type=int, default=32, help="Input batch size on each device")
    parser.add_argument("--size", type=int, default=2048, help="Samples in the dataset")
    parser.add_argument("--snapshot-path", default="", help="Where rank 0 saves its snapshot ('' for none)")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size, args.size, args.snapshot_path)
