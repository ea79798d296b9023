"""Scenarios run by ``test_distributed.py`` in 2 spawned gloo processes (and references).

Every scenario trains the same small float64 MLP for ``STEPS`` steps on per-rank batches
of different sizes (3 and 5 samples). Each rank's loss is ``W / N * sum_n l_n`` (``N``
the union batch size), so that the gradient averaged over the ranks is the union
batch's mean-loss gradient; the single-process reference trains on the union.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn

import curvature

STEPS = 10
SIZES = (3, 5)  # per-rank batch sizes
WORLD = 2
CE = nn.CrossEntropyLoss()


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)
    ).to(torch.float64)


def union_batch(step: int, sizes=SIZES) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    N = sum(sizes)
    X = torch.randn(N, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (N,), generator=g)
    return X, y


def make_wide_model() -> nn.Module:
    """12 inputs and 16 hidden units against 8 samples a step: the first refresh's
    factors are rank-deficient (EKFAC's basis there: ``canonical_null_basis``).
    """
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3)).to(torch.float64)


def wide_batch(step: int, sizes=SIZES) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    N = sum(sizes)
    return torch.randn(N, 12, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (N,), generator=g
    )


def rank_slice(rank: int, sizes=SIZES) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


# name -> (optimizer class name, kwargs, ddp, micro-batches per rank or None)
SCENARIOS: Dict[str, Tuple[str, dict, bool]] = {
    "kfac-empirical-plain": ("KFAC", dict(fisher="empirical"), False),
    "kfac-empirical-ddp": ("KFAC", dict(fisher="empirical"), True),
    "kfac-type2-ddp": ("KFAC", dict(fisher="type-2"), True),
    "kfac-type2-plain-all": ("KFAC", dict(fisher="type-2", decompose="all"), False),
    "kfac-type2-exact-ddp": ("KFAC", dict(fisher="type-2", damping_mode="exact"), True),
    "kfac-type2-owner": ("KFAC", dict(fisher="type-2", precondition="owner"), True),
    "ekfac-empirical-ddp": ("EKFAC", dict(fisher="empirical"), True),
    "ekfac-type2-plain": ("EKFAC", dict(fisher="type-2"), False),
    # bases tracked after the first refresh (each block's owner steps from its record)
    "ekfac-power-ddp": ("EKFAC", dict(fisher="empirical", eigenbasis_update="power"), True),
    "diag-type2-ddp": ("DiagonalNaturalGradient", dict(fisher="type-2"), True),
    # a deliberately broken run: statistics not reduced (each rank its own factors)
    "broken-unreduced": ("KFAC", dict(fisher="type-2", distributed=False), True),
}
COMMON = dict(lr=0.1, damping=1e-1, momentum=0.5, inverse_every=3, factor_decay=0.8)


def make_optimizer(cls_name: str, model, kwargs):
    cls = getattr(curvature, cls_name)
    return cls(model, **COMMON, loss_func=CE, **kwargs)


def train(opt, model, steps, rank=None, start=0, nan_at=None, batch=union_batch):
    """``steps`` steps; ``rank=None``: single process on the union batch."""
    for step in range(start, start + steps):
        X, y = batch(step)
        opt.zero_grad()
        if rank is None:
            CE(model(X), y).backward()
        else:
            s = rank_slice(rank)
            Xr, yr = X[s], y[s]
            if nan_at == step and rank == 1:
                Xr = Xr.clone()
                Xr[0, 0] = float("nan")
            out = model(Xr)
            loss = nn.functional.cross_entropy(out, yr, reduction="sum") * WORLD / len(y)
            loss.backward()
        opt.step()


def reference(name: str):
    """Single-process parameters and factors on the union batches."""
    cls_name, kwargs, _ = SCENARIOS[name]
    drop = ("decompose", "precondition", "distributed")
    kwargs = {k: v for k, v in kwargs.items() if k not in drop}
    model = make_model()
    opt = make_optimizer(cls_name, model, kwargs)
    train(opt, model, STEPS)
    return _result(opt, model)


def reference_wide():
    """Single-process EKFAC on the wide model's union batches."""
    model = make_wide_model()
    opt = make_optimizer("EKFAC", model, dict(fisher="empirical"))
    train(opt, model, STEPS, batch=wide_batch)
    return _result(opt, model)


def _result(opt, model):
    out = {"params": [p.detach().clone() for p in model.parameters()]}
    if hasattr(opt, "factors"):
        out["factors"] = {k: tuple(t.clone() for t in v) for k, v in opt.factors().items()}
    else:
        out["factors"] = {k: v.clone() for k, v in opt.diagonal_.items()}
    return out


def _wrap(model, ddp):
    return nn.parallel.DistributedDataParallel(model) if ddp else model


def run_scenarios(rank: int, out_dir: str) -> Dict[str, object]:
    results: Dict[str, object] = {}
    for name, (cls_name, kwargs, ddp) in SCENARIOS.items():
        model = make_model()
        wrapped = _wrap(model, ddp)
        opt = make_optimizer(cls_name, wrapped, kwargs)
        train(opt, model if not ddp else wrapped, STEPS, rank=rank)
        results[name] = _result(opt, model)
        results[name]["bytes"] = opt.bytes_communicated
        opt.close()

    # factors after one step equal the offline KFAC factors of the union batch
    model = make_model()
    ddp = _wrap(model, True)
    opt = make_optimizer("KFAC", ddp, dict(fisher="type-2"))
    train(opt, ddp, 1, rank=rank)
    results["one-step-factors"] = {k: tuple(t.clone() for t in v) for k, v in opt.factors().items()}
    opt.close()

    # gradient accumulation with no_sync: micro-batches of 1+2 and 2+3 samples (for
    # type-2 the statistics reduction starts at the end of the synced forward)
    for fisher in ("empirical", "type-2"):
        model = make_model()
        ddp = _wrap(model, True)
        opt = make_optimizer("KFAC", ddp, dict(fisher=fisher))
        micro = [(0, 1), (1, 3)] if rank == 0 else [(3, 5), (5, 8)]
        for step in range(STEPS):
            X, y = union_batch(step)
            opt.zero_grad()
            for i, (a, b) in enumerate(micro):
                ctx = ddp.no_sync() if i == 0 else _null()
                with ctx:
                    out = ddp(X[a:b])
                    loss = nn.functional.cross_entropy(out, y[a:b], reduction="sum")
                    (loss * WORLD / len(y)).backward()
            opt.step()
        results[f"accumulate-{fisher}"] = _result(opt, model)
        opt.close()

    # MC Fisher: reproducible with a fixed seed, identical parameters on every rank
    for run in range(2):
        model = make_model()
        ddp = _wrap(model, True)
        opt = make_optimizer("KFAC", ddp, dict(fisher="mc", seed=7))
        train(opt, ddp, STEPS, rank=rank)
        results[f"mc-{run}"] = _result(opt, model)
        opt.close()

    # resume: 5 steps, state saved on rank 0 only, every rank loads it, 5 more steps
    for cls_name in ("KFAC", "EKFAC"):
        kwargs = dict(fisher="type-2")
        model = make_model()
        ddp = _wrap(model, True)
        opt = make_optimizer(cls_name, ddp, kwargs)
        train(opt, ddp, 5, rank=rank)
        path = os.path.join(out_dir, f"state-{cls_name}.pt")
        if rank == 0:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
        opt.close()
        dist.barrier()
        state = torch.load(path, weights_only=False)
        model = make_model()
        model.load_state_dict(state["model"])
        ddp = _wrap(model, True)
        opt = make_optimizer(cls_name, ddp, kwargs)
        opt.load_state_dict(state["optim"])
        train(opt, ddp, 5, rank=rank, start=5)
        results[f"resume-{cls_name}"] = _result(opt, model)
        opt.close()
        dist.barrier()

    # EKFAC with rank-deficient factors at its first refreshes
    model = make_wide_model()
    ddp = _wrap(model, True)
    opt = make_optimizer("EKFAC", ddp, dict(fisher="empirical"))
    train(opt, ddp, STEPS, rank=rank, batch=wide_batch)
    results["ekfac-rank-deficient"] = _result(opt, model)
    opt.close()

    # a NaN batch on rank 1: its statistics are skipped, the update is skipped on every
    # rank (the averaged gradient is NaN), the ranks stay identical and finite
    import warnings

    model = make_model()
    ddp = _wrap(model, True)
    opt = make_optimizer("KFAC", ddp, dict(fisher="type-2"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(opt, ddp, STEPS, rank=rank, nan_at=3)
    results["nan"] = _result(opt, model)
    results["nan"]["skipped"] = opt.skipped_statistics
    opt.close()
    return results


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def run_failure(rank: int, out_dir: str, mode: str) -> Dict[str, object]:
    """Rank 1 raises (``"raise"``) or stalls (``"stall"``) before its second step, or
    (``"decompose"``) every eigendecomposition fails on rank 1."""
    if mode == "decompose" and rank == 1:
        import curvature.blocks.kronecker as kronecker_module
        import curvature.blocks.refresh as refresh_module

        def failing_eigh(M, name="matrix"):
            raise RuntimeError(f"eigh({name}) failed (injected on rank 1)")

        def failing_eighs(mats, names, also=(), canonical=()):
            failed = [RuntimeError(f"eigh({n}) failed (injected on rank 1)") for n in names]
            return failed + curvature.linalg.host_values(list(also))

        refresh_module.eighs = failing_eighs
        kronecker_module.eigh = failing_eigh
    model = make_model()
    kw = dict(fisher="empirical", comm_timeout=3.0)
    if mode == "decompose":  # eigendecompositions, split over the ranks (pi: Cholesky)
        kw["damping_mode"] = "exact"
    opt = make_optimizer("KFAC", model, kw)
    try:
        for step in range(3):
            if rank == 1 and step == 1:
                if mode == "raise":
                    raise ValueError("bad batch on rank 1")
                time.sleep(8.0)
                return {"error": None}
            train(opt, model, 1, rank=rank, start=step)
    except Exception as err:  # noqa: BLE001
        return {"error": f"{type(err).__name__}: {err}"}
    return {"error": None}


def main(rank: int, out_dir: str, task: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(out_dir, 'rendezvous-' + task)}",
        rank=rank,
        world_size=WORLD,
    )
    try:
        if task == "scenarios":
            result = run_scenarios(rank, out_dir)
        elif task == "rules":
            from distributed_rules_worker import run_rules

            result = run_rules(rank)
        else:
            result = run_failure(rank, out_dir, task)
            if rank == 1 and task == "raise":
                torch.save(result, os.path.join(out_dir, f"{task}-{rank}.pt"))
                os._exit(1)  # the rank dies with its error, as under torchrun
    except BaseException:
        torch.save(
            {"traceback": traceback.format_exc()}, os.path.join(out_dir, f"{task}-{rank}.pt")
        )
        raise
    torch.save(result, os.path.join(out_dir, f"{task}-{rank}.pt"))
    if task in ("scenarios", "rules"):
        dist.barrier()
        dist.destroy_process_group()
    else:
        os._exit(0)  # a broken group cannot be destroyed cleanly


def spawn(out_dir: str, task: str, timeout: float = 120.0) -> List[dict]:
    """Run ``main`` on 2 ranks as subprocesses; return each rank's result."""
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(r), out_dir, task],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(WORLD)
    ]
    logs = []
    deadline = time.time() + timeout
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        logs.append(out.decode(errors="replace"))
    results = []
    for r in range(WORLD):
        path = os.path.join(out_dir, f"{task}-{r}.pt")
        if not os.path.exists(path):
            raise RuntimeError(f"rank {r} wrote no result; its output:\n{logs[r]}")
        results.append(torch.load(path, weights_only=False))
    for r, res in enumerate(results):
        if isinstance(res, dict) and "traceback" in res:
            raise RuntimeError(f"rank {r} failed:\n{res['traceback']}")
    return results


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
