"""KFAC under DistributedDataParallel: train an MLP on scikit-learn's digits.

    torchrun --nproc_per_node 2 examples/ddp_train.py            # 2 CPU processes (gloo)
    torchrun --nproc_per_node 4 examples/ddp_train.py --fisher mc  # one process per GPU (nccl)
    python examples/ddp_train.py                                  # one process, no launcher

Every rank reads its shard of each batch (``DistributedSampler``); DDP averages the
gradients, the optimizer averages the Kronecker factors over the ranks and splits the
eigendecompositions between them (``decompose="split"``). The checkpoint is written by
rank 0 only and resumes every rank (``--resume``).
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import curvature


def digits():
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X / 16.0, dtype=torch.float32)
    return TensorDataset(X, torch.tensor(y))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=64, help="per rank")
    ap.add_argument("--fisher", default="mc", choices=["empirical", "mc", "type-2"])
    ap.add_argument("--optimizer", default="KFAC", choices=["KFAC", "EKFAC"])
    ap.add_argument("--checkpoint", default=None, help="written by rank 0 after training")
    ap.add_argument("--resume", default=None, help="a checkpoint to start from")
    args = ap.parse_args()

    launched = "RANK" in os.environ  # torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*
    if launched:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", 0))
    else:
        rank, world, local = 0, 1, 0
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    data = digits()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=0) if launched else None
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, shuffle=sampler is None)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    net = nn.parallel.DistributedDataParallel(model) if launched else model
    loss_func = nn.CrossEntropyLoss()
    cls = getattr(curvature, args.optimizer)
    optim = cls(net, lr=1e-2, damping=1e-3, fisher=args.fisher, loss_func=loss_func)
    if args.resume:
        state = torch.load(args.resume, map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])

    start, first_step = time.perf_counter(), optim.steps
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        total = torch.zeros(2, device=device)
        for X, y in loader:
            X, y = X.to(device), y.to(device)
            optim.zero_grad()
            loss = loss_func(net(X), y)
            loss.backward()
            optim.step()
            total += torch.stack([loss.detach() * len(y), torch.tensor(len(y), device=device)])
        if launched:
            dist.all_reduce(total)
        if rank == 0:
            print(
                f"epoch {epoch + 1}: train loss {float(total[0] / total[1]):.4f} "
                f"({time.perf_counter() - start:.1f} s, {world} rank(s))",
                flush=True,
            )
    if rank == 0:
        sent = optim.bytes_communicated
        if sent:
            steps = max(1, optim.steps - first_step)
            per_step = {k: f"{v / steps / 1e3:.1f} kB" for k, v in sent.items()}
            print(f"sent per step and rank: {per_step}")
        if args.checkpoint:
            torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, args.checkpoint)
    optim.close()
    if launched:
        # DDP's reducer holds the process group; freed last, at the end of main() with the
        # GIL held, it would join gloo's threads while one of them waits for the GIL to
        # free a finished work's tensors: a hang at exit (torch issue #75097; here about
        # once in ten runs under load). Freed now, the group outlives it.
        del optim, net, model
        gc.collect()
        dist.barrier()  # no rank tears the group down while another still talks to it
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
