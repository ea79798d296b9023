"""Benchmark: per-sample gradients, gradient norms and Gram matrices (SPEC section 2).

Side by side in one process, on the same batch: a plain forward+backward (the baseline),
curvature's ``capture``, and the peers (``torch.func`` vmap(grad), opacus
``GradSampleModule`` / ghost clipping / ExpandedWeights, BackPACK ``BatchGrad`` /
``BatchL2Grad``). Every quantity is timed as the whole call a user makes (forward, loss,
backward, per-sample quantity) and reported as a ratio to the plain forward+backward
(alternating, median of per-repeat ratios; see ``benchmarks/common.py``). Peak memory
is the increase of the resident set during one call (VmHWM reset through
``/proc/self/clear_refs``) next to the plain step's, measured the same way. Each
method's output is compared once per workload with curvature's (curvature's with
``torch.func``'s), so that methods computing something different are flagged.

Usage::

    python benchmarks/per_sample.py                 # full run (~5 min), refreshes docs
    python benchmarks/per_sample.py --quick         # < 1 min smoke run, docs untouched:
                                                    # 2 repeats, memory from the first
                                                    # call, norms / Gram from gradients
                                                    # for torch.func only
    python benchmarks/per_sample.py --workloads mlp,cnn --repeats 9 --json out.json

Each workload runs in a child process of its own (``--in-process`` runs them all here):
process-wide allocator state would otherwise carry over from one workload to the next.
glibc's malloc raises its mmap and trim thresholds (up to 32 and 64 MiB) after freeing
large blocks, which the hundreds of MB of per-sample gradients of the MLP and CNN do, and
from then on freed memory stays in the process: a method that allocates its results
afresh each call stops paying page faults in the later workloads, although in a
training process of its own it pays them on every step. ``--keep-freed-memory`` sets
that state on purpose (``mallopt``: freed memory is never returned to the OS), for
every method alike, to measure the methods without page faults.
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import json
import os
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import curvature  # noqa: E402

QUANTITIES = ("grads", "norms", "gram")
QUANTITY_NAMES = {"grads": "per-sample gradients", "norms": "norms only", "gram": "Gram matrix"}
METHODS = (
    "curvature",
    "curvature out=",
    "torch.func",
    "opacus",
    "opacus ghost",
    "opacus EW",
    "BackPACK",
)
PEERS = METHODS[2:]
DOC_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "benchmarks.md")
DOC_TITLE = "Per-sample quantities"
DOC_INTRO = """# Benchmarks

Scripts in `benchmarks/` measure curvature against a plain forward+backward of the same
model on the same batch and against peer libraries, in one process. The machine is
small and noisy (see the measurement notes in `benchmarks/common.py`), so speed is
reported as ratios to the plain step (alternating, median of per-repeat ratios), never
as milliseconds alone. Each section below is rewritten by its script.
"""
REL_TOL = 1e-3  # a relative max abs difference above this is flagged as a mismatch


class Skip(Exception):
    """A method that cannot run a workload or quantity; the message says why."""


# -- workloads ----------------------------------------------------------------------------------
class TransformerBlock(nn.Module):
    """Embedding, pre-LN attention and MLP blocks with residuals, vocabulary logits."""

    def __init__(self, vocab: int = 1000, d: int = 128, heads: int = 4, hidden: int = 512):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.emb(tokens)
        a = self.ln1(h)
        h = h + self.attn(a, a, a, need_weights=False)[0]
        h = h + self.mlp(self.ln2(h))
        return self.head(h)  # [N, S, vocab]


def classification_losses(out: Tensor, y: Tensor) -> Tensor:
    """Per-sample cross-entropy ``[N]``."""
    return F.cross_entropy(out, y, reduction="none")


def sequence_losses(out: Tensor, y: Tensor) -> Tensor:
    """Per-sequence loss ``[N]``: the cross-entropy averaged over the tokens."""
    N, S, V = out.shape
    return (
        F.cross_entropy(out.reshape(N * S, V), y.reshape(N * S), reduction="none")
        .view(N, S)
        .mean(1)
    )


@dataclass
class Workload:
    name: str
    title: str
    model: nn.Module
    X: Tensor
    y: Tensor
    losses: Callable[[Tensor, Tensor], Tensor]  # (output, y) -> [N] per-sample losses

    @property
    def N(self) -> int:
        return self.X.shape[0]


def make_workload(name: str) -> Workload:
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(
            nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)
        )
        X = torch.randn(128, 784, generator=g)
        y = torch.randint(0, 10, (128,), generator=g)
        return Workload(name, "MLP 784-512-256-10, N=128", model, X, y, classification_losses)
    if name == "cnn":
        model = nn.Sequential(
            nn.Conv2d(1, 32, 3),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(9216, 128),
            nn.ReLU(),
            nn.Linear(128, 10),
        )
        X = torch.randn(64, 1, 28, 28, generator=g)
        y = torch.randint(0, 10, (64,), generator=g)
        return Workload(name, "tutorial CNN 1x28x28, N=64", model, X, y, classification_losses)
    if name == "transformer":
        model = TransformerBlock()
        X = torch.randint(0, 1000, (16, 64), generator=g)
        y = torch.randint(0, 1000, (16, 64), generator=g)
        return Workload(name, "transformer block d=128, S=64, N=16", model, X, y, sequence_losses)
    raise ValueError(f"unknown workload {name!r}")


WORKLOADS = ("mlp", "cnn", "transformer")


# -- helpers shared by the peers ------------------------------------------------------------------
def norms_from_grads(grads: Dict[str, Tensor]) -> Tensor:
    # vector_norm reduces in place: no [N, *p.shape] temporary (as g.pow(2) would make)
    dims = {k: tuple(range(1, g.dim())) for k, g in grads.items()}
    return sum(torch.linalg.vector_norm(g, dim=dims[k]) ** 2 for k, g in grads.items()).sqrt()


def gram_from_grads(grads: Dict[str, Tensor]) -> Tensor:
    return sum(g.flatten(1) @ g.flatten(1).T for g in grads.values())


def from_grads(q: str, grads_fn: Callable[[], Dict[str, Tensor]]) -> Callable[[], Any]:
    """The quantity ``q`` computed from materialized per-sample gradients."""
    if q == "grads":
        return grads_fn

    def derived():
        grads = grads_fn()
        return norms_from_grads(grads) if q == "norms" else gram_from_grads(grads)

    derived.from_grads = True  # --quick measures these for torch.func only
    return derived


def identity(q: str, out: Any) -> Any:
    return out


# A method builder returns {quantity: (fn, to_reference)}: ``fn()`` computes the quantity on
# the workload's batch the way a user of that library would; ``to_reference(q, out)``
# converts (outside the timing) to curvature's conventions: parameter names of the
# original model, grad(l_n) scale.
Built = Dict[str, Tuple[Callable[[], Any], Callable[[str, Any], Any]]]


def build_curvature(wl: Workload) -> Built:
    model, X, y = wl.model, wl.X, wl.y

    def run(q: str) -> Callable[[], Any]:
        def fn():
            with curvature.capture(model) as cap:
                out = model(X)
            losses = wl.losses(out, y)
            if q == "grads":
                return cap.per_sample_grads(losses, retain_graph=False)
            if q == "norms":
                return cap.per_sample_grad_norms(losses, retain_graph=False)
            return cap.gram(losses, retain_graph=False)

        return fn

    return {q: (run(q), identity) for q in QUANTITIES}


def build_curvature_out(wl: Workload) -> Built:
    """``per_sample_grads(..., out=buffers)``: results written into buffers allocated (and
    touched) once outside the timed call, as a training loop would reuse them."""
    if "out" not in inspect.signature(curvature.Capture.per_sample_grads).parameters:
        raise Skip("this version of curvature has no per_sample_grads(out=...)")
    model, X, y = wl.model, wl.X, wl.y
    buffers = {k: torch.zeros(wl.N, *p.shape, dtype=p.dtype) for k, p in model.named_parameters()}

    def fn():
        with curvature.capture(model) as cap:
            out = model(X)
        return cap.per_sample_grads(wl.losses(out, y), retain_graph=False, out=buffers)

    return {"grads": (fn, identity)}


def build_torch_func(wl: Workload) -> Built:
    from torch.func import functional_call, grad, vmap

    model, X, y = wl.model, wl.X, wl.y
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def loss_one(p, x, t):
        out = functional_call(model, (p, buffers), (x.unsqueeze(0),))
        return wl.losses(out, t.unsqueeze(0))[0]

    per_sample = vmap(grad(loss_one), in_dims=(None, 0, 0))

    def grads_fn():
        return per_sample(params, X, y)

    return {q: (from_grads(q, grads_fn), identity) for q in QUANTITIES}


class _HeadsToTokens(nn.Module):
    """Undo the head/token mix-up of opacus 1.6 ``DPMultiheadAttention(batch_first=True)``.

    Its forward views the attention output ``[N * heads, S, d_head]`` directly as
    ``[N, S, embed]`` (no transpose), so with ``batch_first=True`` it computes a different
    function from ``nn.MultiheadAttention`` (max output difference ~0.8 at d=128, S=64).
    Placed in front of its ``out_proj``, this module restores the right layout; it is a
    parameter-free permutation, so opacus' per-sample hooks on ``out_proj`` see the
    correct activations.
    """

    def __init__(self, heads: int):
        super().__init__()
        self.heads = heads

    def forward(self, x: Tensor) -> Tensor:
        N, S, E = x.shape
        return x.reshape(N, self.heads, S, E // self.heads).transpose(1, 2).reshape(N, S, E)


def opacus_model(model: nn.Module) -> Tuple[nn.Module, Callable[[Dict[str, Tensor]], Dict]]:
    """A copy with ``nn.MultiheadAttention`` replaced by opacus' ``DPMultiheadAttention``
    (same weights), and the map of its per-sample gradients back to the original names."""
    model = copy.deepcopy(model)
    renamed: List[str] = []
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.MultiheadAttention):
            from opacus.layers import DPMultiheadAttention

            dp = DPMultiheadAttention(
                module.embed_dim,
                module.num_heads,
                dropout=module.dropout,
                bias=module.in_proj_bias is not None,
                batch_first=module.batch_first,
            )
            dp.load_state_dict(dict(module.state_dict()))
            if module.batch_first:
                dp.out_proj = nn.Sequential(_HeadsToTokens(module.num_heads), dp.out_proj)
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            setattr(parent, name.rpartition(".")[2], dp)
            renamed.append(name)

    def back(grads: Dict[str, Tensor]) -> Dict[str, Tensor]:
        out = dict(grads)
        for name in renamed:
            for kind in ("weight", "bias"):
                keys = [f"{name}.{p}linear.{kind}" for p in "qkv"]
                if keys[0] in out:
                    out[f"{name}.in_proj_{kind}"] = torch.cat([out.pop(k) for k in keys], 1)
                if f"{name}.out_proj.1.{kind}" in out:
                    out[f"{name}.out_proj.{kind}"] = out.pop(f"{name}.out_proj.1.{kind}")
        return out

    return model, back


def build_opacus(wl: Workload) -> Built:
    from opacus import GradSampleModule

    m, back = opacus_model(wl.model)
    gsm = GradSampleModule(m, batch_first=True, loss_reduction="sum")
    X, y = wl.X, wl.y

    def grads_fn():
        gsm.zero_grad(set_to_none=True)
        wl.losses(gsm(X), y).sum().backward()
        grads = {k: p.grad_sample for k, p in m.named_parameters()}
        gsm.zero_grad(set_to_none=True)  # leave nothing attached to the parameters
        return grads

    def to_ref(q, out):
        return back(out) if q == "grads" else out

    return {q: (from_grads(q, grads_fn), to_ref) for q in QUANTITIES}


def build_opacus_ghost(wl: Workload) -> Built:
    from opacus.grad_sample import GradSampleModuleFastGradientClipping

    m, _ = opacus_model(wl.model)
    gsm = GradSampleModuleFastGradientClipping(
        m, batch_first=True, loss_reduction="sum", use_ghost_clipping=True, max_grad_norm=1.0
    )
    X, y = wl.X, wl.y

    def norms_fn():
        gsm.zero_grad(set_to_none=True)
        wl.losses(gsm(X), y).sum().backward()
        norms = gsm.get_norm_sample()
        gsm.zero_grad(set_to_none=True)
        for p in m.parameters():
            p._norm_sample = None
        return norms

    return {"norms": (norms_fn, identity)}


def build_opacus_ew(wl: Workload) -> Built:
    from opacus.grad_sample.gsm_exp_weights import GradSampleModuleExpandedWeights

    m, back = opacus_model(wl.model)
    gsm = GradSampleModuleExpandedWeights(m, batch_first=True, loss_reduction="sum")
    X, y = wl.X, wl.y

    def grads_fn():
        for p in m.parameters():
            p.grad_sample = None
        wl.losses(gsm(X), y).sum().backward()
        grads = {k: p.grad_sample for k, p in m.named_parameters()}
        for p in m.parameters():
            p.grad, p.grad_sample = None, None
        return grads

    def to_ref(q, out):
        return back(out) if q == "grads" else out

    return {q: (from_grads(q, grads_fn), to_ref) for q in QUANTITIES}


def build_backpack(wl: Workload) -> Built:
    from backpack import backpack, extend
    from backpack.extensions import BatchGrad, BatchL2Grad

    m = extend(copy.deepcopy(wl.model))
    # mean reduction: BackPACK returns grad(l_n) / N. For sequences, [N, C, S] logits and
    # the mean over N * S tokens give grad(mean_s l_ns) / N, the same scale.
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y, N = wl.X, wl.y, wl.N
    seq = wl.losses is sequence_losses

    def loss():
        out = m(X)
        return lossfunc(out.permute(0, 2, 1) if seq else out, y)

    def collect(attr: str) -> Dict[str, Tensor]:
        res = {k: getattr(p, attr, None) for k, p in m.named_parameters()}
        for p in m.parameters():
            p.grad = None
            setattr(p, attr, None)
        missing = [k for k, v in res.items() if v is None]
        if missing:  # BackPACK only warns about modules it has no extension for
            owners = {
                type(m.get_submodule(k.rpartition(".")[0])).__name__ for k in missing if "." in k
            }
            raise RuntimeError(
                f"BackPACK has no {attr} extension for {', '.join(sorted(owners))} "
                f"({len(missing)} parameters without a result)"
            )
        return res

    def batch_grad():
        m.zero_grad(set_to_none=True)
        with backpack(BatchGrad()):
            loss().backward()
        return collect("grad_batch")

    def norms_fn():
        m.zero_grad(set_to_none=True)
        with backpack(BatchL2Grad()):
            loss().backward()
        return sum(collect("batch_l2").values()).sqrt()

    def to_ref(q, out):  # grad(l_n) / N -> grad(l_n)
        if q == "grads":
            return {k: v * N for k, v in out.items()}
        return out * (N if q == "norms" else N * N)

    return {
        "grads": (batch_grad, to_ref),
        "norms": (norms_fn, to_ref),
        "gram": (from_grads("gram", batch_grad), to_ref),
    }


BUILDERS = {
    "curvature": build_curvature,
    "curvature out=": build_curvature_out,
    "torch.func": build_torch_func,
    "opacus": build_opacus,
    "opacus ghost": build_opacus_ghost,
    "opacus EW": build_opacus_ew,
    "BackPACK": build_backpack,
}


# -- the run ---------------------------------------------------------------------------------------
def reason(err: BaseException) -> str:
    msg = str(err).strip().splitlines()
    first = msg[0] if msg else ""
    return f"{type(err).__name__}: {first[:160]}"


def run_workload(
    wl: Workload, methods: List[str], args: argparse.Namespace, log: Callable[[str], None]
) -> Dict[str, Any]:
    model, X, y = wl.model, wl.X, wl.y

    def plain_step():
        model.zero_grad(set_to_none=True)
        wl.losses(model(X), y).mean().backward()
        model.zero_grad(set_to_none=True)  # the step's gradients count in its peak

    n_params = sum(p.numel() for p in model.parameters())
    log(f"\n## {wl.title}: {n_params / 1e6:.3f}M parameters")
    inner_b = common.calibrate(plain_step, args.min_time, warmup=3)
    base_mem = common.peak_memory(plain_step, args.mem_repeats)
    base = common.compare(
        plain_step, plain_step, repeats=args.repeats, min_time=args.min_time, gate=args.gate
    )
    floor = min(base["baseline_times"])  # the fastest plain step seen in this workload
    log(
        f"plain forward+backward: {base['time'] * 1e3:.2f} ms (self-ratio "
        f"{base['ratio']:.2f}), peak {base_mem / common.MB:.1f} MB"
    )
    result: Dict[str, Any] = {
        "title": wl.title,
        "params": n_params,
        "batch": wl.N,
        "plain": {"time": base["time"], "peak_bytes": base_mem, "self_ratio": base["ratio"]},
        "methods": {},
        "skipped": {},
    }

    reference: Dict[str, Any] = {}  # curvature's outputs, converted
    kept: Dict[Tuple[str, str], Callable[[], Any]] = {}  # for the head-to-head runs
    exact: Dict[str, Any] = {}  # torch.func's, to check curvature itself
    # torch.func first (the exact reference for curvature), then curvature (the reference
    # for the peers), then the other peers
    order = [m for m in ("torch.func", "curvature") if m in methods]
    order += [m for m in methods if m not in order]
    for method in order:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                built = BUILDERS[method](wl)
        except Skip as err:
            result["skipped"][method] = str(err)
            log(f"  skip {method}: {err}")
            continue
        except ImportError as err:
            result["skipped"][method] = f"not installed ({err})"
            log(f"  skip {method}: not installed ({err})")
            continue
        except Exception as err:  # noqa: BLE001
            result["skipped"][method] = reason(err)
            log(f"  skip {method}: {reason(err)}")
            continue
        for q in QUANTITIES:
            if q not in built:
                continue
            fn, to_ref = built[q]
            key = f"{method}/{q}"
            if args.quick and getattr(fn, "from_grads", False) and method != "torch.func":
                continue  # a smoke run: norms / Gram from materialized gradients once
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if args.quick:  # a smoke run: memory and calibration from this call
                        mem_first, out, first = common.peak_memory_of(fn)
                    else:
                        out = fn()
                    out = to_ref(q, out)
            except Exception as err:  # noqa: BLE001
                result["skipped"][key] = reason(err)
                log(f"  skip {method} {q}: {reason(err)}")
                if args.verbose:
                    traceback.print_exc()
                continue
            # correctness: peers against curvature, curvature against torch.func
            if method == "curvature":
                reference[q] = out
            if method == "torch.func":
                exact[q] = out
            if method == "curvature":
                against = exact.get(q)
            elif method == "torch.func":
                against = None  # filled in from curvature's comparison below
            else:  # against torch.func's where curvature failed
                against = reference.get(q, exact.get(q))
            diff, rel, note = None, None, ""
            if against is not None:
                try:
                    diff = common.max_abs_diff(out, against)
                    rel = diff / max(common.max_abs(against), 1e-30)
                except (KeyError, ValueError) as err:
                    note = f"not comparable: {err}"
            del out
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    timing = None
                    for attempt in range(2):  # one retry of a disturbed comparison
                        t = common.compare(
                            plain_step,
                            fn,
                            repeats=args.repeats,
                            min_time=args.min_time,
                            warmup=0 if args.quick or attempt else 1,
                            inner_baseline=inner_b,
                            estimate=first if args.quick else None,
                            gate=args.gate,
                            baseline_floor=floor,
                        )
                        floor = min(floor, *t["baseline_times"])
                        if timing is None or (timing["disturbed"], timing["spread"]) > (
                            t["disturbed"],
                            t["spread"],
                        ):
                            timing = t
                        if not timing["disturbed"] or args.retries <= 0:
                            break
                        args.retries -= 1
                        log(f"  ({method} {q}: disturbed, measuring again)")
                    if args.quick:
                        mem = mem_first
                    else:
                        mem = common.peak_memory(fn, args.mem_repeats)
            except Exception as err:  # noqa: BLE001
                result["skipped"][key] = reason(err)
                log(f"  skip {method} {q}: {reason(err)}")
                continue
            entry = {
                "time": timing["time"],
                "ratio": timing["ratio"],
                "ratios": timing["ratios"],
                "clean_repeats": timing["clean_repeats"],
                "disturbed": timing["disturbed"],
                "spread": timing["spread"],
                "baseline_time": timing["baseline_time"],
                "peak_bytes": mem,
                "mem_ratio": mem / max(base_mem, 1),
                "max_abs_diff": diff,
                "rel_diff": rel,
                "mismatch": rel is not None and rel > REL_TOL,
                "note": note,
            }
            result["methods"].setdefault(method, {})[q] = entry
            if method == "curvature" or method in PEERS:
                kept[(method, q)] = fn
            tf = result["methods"].get("torch.func", {}).get(q)
            if method == "curvature" and tf is not None:  # the same comparison
                tf.update(max_abs_diff=diff, rel_diff=rel, mismatch=entry["mismatch"])
            log(
                f"  {method:14s} {q:5s} {timing['time'] * 1e3:9.2f} ms  "
                f"{timing['ratio']:6.2f}x{'†' if timing['disturbed'] else ' '} "
                f"peak {mem / common.MB:7.1f} MB "
                f"({entry['mem_ratio']:.2f}x)  diff {fmt_diff(entry)}"
            )
        del built
        gc.collect()
    result["head_to_head"] = head_to_head(result, kept, args, log)
    kept.clear()
    gc.collect()
    return result


def head_to_head(
    result: Dict[str, Any],
    kept: Dict[Tuple[str, str], Callable[[], Any]],
    args: argparse.Namespace,
    log: Callable[[str], None],
) -> Dict[str, Dict[str, Any]]:
    """Time curvature directly against each peer that comes close.

    Dividing two ratios to the plain step measured minutes apart adds both of their
    errors, and on this machine the speed drifts between comparisons. So each peer
    whose ratio (output agreeing with curvature's) is within 1.5x of curvature's, either
    way, is timed against curvature in one alternating loop, the peer as the baseline
    (``4 * repeats + 1`` repeats). ``{quantity: {peer: entry}}``; ``entry["ratio"]`` is
    the median of the per-repeat ratios curvature / peer.
    """
    out: Dict[str, Dict[str, Any]] = {}
    for q in QUANTITIES:
        c = result["methods"].get("curvature", {}).get(q)
        ours = kept.get(("curvature", q))
        if c is None or ours is None:
            continue
        for m, entries in result["methods"].items():
            e, peer = entries.get(q), kept.get((m, q))
            if m not in PEERS or e is None or peer is None or e["mismatch"]:
                continue
            if not (1 / 1.5 <= c["ratio"] / e["ratio"] <= 1.5):
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t = common.compare(
                    peer,
                    ours,
                    repeats=4 * args.repeats + 1,
                    min_time=args.min_time,
                    warmup=1,
                    gate=args.gate,
                )
            out.setdefault(q, {})[m] = {
                "ratio": t["ratio"],
                "ratios": t["ratios"],
                "disturbed": t["disturbed"],
                "spread": t["spread"],
                "clean_repeats": t["clean_repeats"],
                "time": t["time"],
                "peer_time": t["baseline_time"],
            }
            log(
                f"  head-to-head {q}: curvature / {m} = {t['ratio']:.2f}"
                f"{' †' if t['disturbed'] else ''} ({t['time'] * 1e3:.2f} vs "
                f"{t['baseline_time'] * 1e3:.2f} ms, {t['clean_repeats']} clean repeats)"
            )
    return out


def versus_peers(res: Dict[str, Any], q: str) -> Optional[Tuple[str, float, bool, bool]]:
    """Curvature against its closest competitor on ``q``.

    ``(peer, ratio, disturbed, direct)``: the largest of curvature / peer over the
    peers whose output agrees with curvature's, measured head to head where it was
    (``direct``), else as the quotient of the two ratios to the plain step.
    """
    c = res["methods"].get("curvature", {}).get(q)
    if c is None:
        return None
    h2h = res.get("head_to_head", {}).get(q, {})
    cands = []
    for m, entries in res["methods"].items():
        e = entries.get(q)
        if m not in PEERS or e is None or e["mismatch"]:
            continue
        if m in h2h:
            h = h2h[m]
            cands.append((m, h["ratio"], bool(h["disturbed"]), True))
        else:
            dist = bool(e.get("disturbed") or c.get("disturbed"))
            cands.append((m, c["ratio"] / e["ratio"], dist, False))
    return max(cands, key=lambda x: x[1]) if cands else None


# -- report -----------------------------------------------------------------------------------
def fmt_diff(e: Dict[str, Any]) -> str:
    if e.get("note"):
        return e["note"]
    if e.get("max_abs_diff") is None:
        return "-"
    s = f"{e['max_abs_diff']:.1e}"
    return s + (" **MISMATCH**" if e["mismatch"] else "")


def best_peer(res: Dict[str, Any], q: str) -> Optional[Tuple[str, float, bool]]:
    """``(name, ratio, disturbed)`` of the fastest peer on ``q`` matching curvature's."""
    cands = [
        (m, e[q]["ratio"], bool(e[q].get("disturbed")))
        for m, e in res["methods"].items()
        if m in PEERS and q in e and not e[q]["mismatch"]
    ]
    return min(cands, key=lambda c: c[1]) if cands else None


def tables(results: Dict[str, Any]) -> str:
    header = [
        "workload",
        "quantity",
        "method",
        "time [ms]",
        "x fwd+bwd",
        "x fastest peer",
        "peak [MB]",
        "x plain peak",
        "max abs diff",
    ]
    rows = []
    for wl in results["workloads"].values():
        p = wl["plain"]
        rows.append(
            [
                wl["title"],
                "plain forward+backward",
                "torch",
                f"{p['time'] * 1e3:.2f}",
                "1",
                "",
                f"{p['peak_bytes'] / common.MB:.1f}",
                "1",
                "",
            ]
        )
        for q in QUANTITIES:
            bp = best_peer(wl, q)
            vp = versus_peers(wl, q)
            for method in METHODS:
                e = wl["methods"].get(method, {}).get(q)
                if e is None:
                    continue
                vs = ""
                if method == "curvature" and vp is not None:
                    vs = f"{vp[1]:.2f}{' (head to head)' if vp[3] else ''} ({vp[0]}"
                    vs += " †)" if vp[2] else ")"
                elif method.startswith("curvature") and bp is not None:
                    vs = f"{e['ratio'] / bp[1]:.2f} ({bp[0]}{' †' if bp[2] else ''})"
                rows.append(
                    [
                        "",
                        QUANTITY_NAMES[q],
                        method,
                        f"{e['time'] * 1e3:.2f}",
                        f"{e['ratio']:.2f}" + (" †" if e.get("disturbed") else ""),
                        vs,
                        f"{e['peak_bytes'] / common.MB:.1f}",
                        f"{e['mem_ratio']:.2f}",
                        fmt_diff(e),
                    ]
                )
    return common.markdown_table(header, rows)


def skipped_lines(results: Dict[str, Any]) -> List[str]:
    out = []
    for wl in results["workloads"].values():
        for key, why in wl["skipped"].items():
            out.append(f"- {wl['title']}: {key} skipped: {why}")
    return out


def targets(results: Dict[str, Any]) -> Tuple[List[str], List[Dict[str, Any]]]:
    lines, data = [], []

    def add(name: str, ok: Optional[bool], detail: str, unreliable: bool = False):
        status = "n/a" if ok is None else ("met" if ok else "**not met**")
        if unreliable and ok is not None:
            status += " (unreliable: a ratio it rests on is marked †)"
        lines.append(f"- {name}: {status} ({detail})")
        data.append({"target": name, "met": ok, "detail": detail})

    for key, wl in results["workloads"].items():
        c = wl["methods"].get("curvature", {}).get("grads")
        bp = best_peer(wl, "grads")
        vp = versus_peers(wl, "grads")
        if c is None or bp is None or vp is None:
            add(f"per-sample gradients faster than every peer, {key}", None, "no comparison")
        else:
            peer_ratio = wl["methods"][vp[0]]["grads"]["ratio"]
            how = "head to head" if vp[3] else "quotient of the ratios to fwd+bwd"
            detail = (
                f"curvature / {vp[0]} = {vp[1]:.2f} ({how}); ratios to fwd+bwd "
                f"{c['ratio']:.2f}x vs {peer_ratio:.2f}x"
            )
            co = wl["methods"].get("curvature out=", {}).get("grads")
            if co is not None:
                detail += f"; with out= buffers {co['ratio']:.2f}x"
            add(
                f"per-sample gradients faster than every peer, {key}",
                vp[1] < 1,
                detail,
                unreliable=vp[2],
            )
    for key in ("mlp", "cnn"):
        wl = results["workloads"].get(key)
        c = wl and wl["methods"].get("curvature", {}).get("norms")
        if not c:
            continue
        add(
            f"norms-only <= 1.3x fwd+bwd, {key}",
            c["ratio"] <= 1.3,
            f"{c['ratio']:.2f}x",
            unreliable=bool(c.get("disturbed")),
        )
        add(
            f"norms-only peak memory <= 1.2x the plain step's, {key}",
            c["mem_ratio"] <= 1.2,
            f"{c['peak_bytes'] / common.MB:.1f} MB vs "
            f"{wl['plain']['peak_bytes'] / common.MB:.1f} MB: {c['mem_ratio']:.2f}x",
        )
    return lines, data


FAULT_FREE_METHODS = ("curvature", "opacus EW")


def wants_fault_free_check(args: argparse.Namespace, workloads: List[str], methods: List[str]):
    """Whether a full run also times the transformer without page faults (one more child)."""
    return (
        not (args.quick or args.child or args.in_process or args.keep_freed_memory)
        and "transformer" in workloads
        and all(m in methods for m in FAULT_FREE_METHODS)
    )


def fault_free_lines(results: Dict[str, Any]) -> List[str]:
    """The head-to-head of the extra ``--keep-freed-memory`` child, as report lines."""
    lines = []
    for key, wl in results.get("without_page_faults", {}).items():
        vp = versus_peers(wl, "grads")
        if vp is None:
            continue
        how = "head to head" if vp[3] else "quotient of the ratios to fwd+bwd"
        lines.append(
            f"- without page faults (a child with `--keep-freed-memory` and "
            f"{' and '.join(FAULT_FREE_METHODS)} only), per-sample gradients, {key}: "
            f"curvature / {vp[0]} = {vp[1]:.2f} ({how}){' †' if vp[2] else ''}"
        )
    return lines


def doc_body(results: Dict[str, Any], table: str, target_lines: List[str]) -> str:
    info = results["machine"]
    peers = ", ".join(f"{k} {v}" for k, v in results["versions"].items() if v)
    mem = (
        "resident-set increase during one call: free heap returned to the OS "
        "(`malloc_trim`), `VmRSS` read, the high-water mark reset by writing `5` to "
        "`/proc/self/clear_refs`, the call run once, `VmHWM` read; peak = VmHWM - VmRSS "
        "(every page the call touched: tensors, allocator slack, the returned result)"
        if results["memory_method"] == "rss"
        else "peak of live tensor bytes from `torch.profiler` memory events"
    )
    skipped = skipped_lines(results)
    gate = results["quiet_gate"]
    parts = [
        "Generated by `benchmarks/per_sample.py`; do not edit by hand.",
        f"Command: `{results['command']}` ({results['date']}, {results['elapsed_s']:.0f} s).",
        f"Machine: {common.machine_line(info)}. Versions: {peers}. Load average "
        f"(1 min) {results['loadavg_start'][0]:.1f} at the start, "
        f"{results['loadavg_end'][0]:.1f} at the end (other jobs share the 2 cores); "
        f"before each baseline measurement the script waited for other processes to leave "
        f"the CPUs ({gate['waited_s']:.0f} s in all), {gate['started_under_load']} of "
        f"{gate['measurements']} measurements started under load anyway.",
        "",
        "Each workload runs in a fresh process of its own (all methods side by side in "
        "it), so that allocator state left by one workload (glibc keeps freed memory "
        "after large frees) does not change which methods page-fault in the next. "
        + (
            f"This run: {results['allocator']}, so no method pays page faults. "
            if results.get("allocator")
            else ""
        )
        + "Each quantity is timed as the complete call a user makes (forward, per-sample "
        "losses, backward, the quantity) on the same batch as a plain forward+backward of "
        "the same model (`zero_grad`, `loss.mean().backward()`). `x fwd+bwd` is the median "
        "of per-repeat ratios, baseline and method alternating in one loop "
        f"({results['repeats']} repeats; repeats whose baselines ran more than 1.5x slower "
        "than the fastest baseline of that comparison, or 3x slower than the fastest plain "
        "step of the workload, are dropped as disturbed by other jobs); `time` is the "
        "median time of the method alone "
        "(the machine drifts by up to 2x: read the ratios). `x fastest peer` for "
        "`curvature` is curvature's time over its closest competitor's (the largest over "
        "the peers whose output agrees): where a peer's ratio comes within 1.5x of "
        "curvature's, the two calls are timed against each other in one more alternating "
        f"loop ({4 * results['repeats'] + 1} repeats, marked 'head to head'); otherwise, "
        "and for `curvature out=`, it is the quotient of the ratios to fwd+bwd. Peak memory: "
        f"{mem}; the plain step's peak counts its parameter gradients. `max abs diff`: "
        "each peer's output against curvature's, curvature's against torch.func's (peers "
        "converted to grad(l_n): BackPACK times N, opacus' `DPMultiheadAttention` "
        "q/k/v gradients concatenated into `in_proj_*`); **MISMATCH** above a relative "
        f"difference of {REL_TOL:g}.",
        "",
        "`curvature out=` passes `out=` buffers (allocated and touched once, outside the "
        "timed call and its peak) to `per_sample_grads`; the targets use the plain call. "
        "The plain `curvature` call returns new tensors each time (ordinary allocations, "
        "freed when dropped), so its peak counts the results' memory. "
        "Peers: torch.func = `vmap(grad(loss))` with `functional_call` (norms and Gram from "
        "its gradients); opacus = `GradSampleModule` (`p.grad_sample`); opacus ghost = "
        "`GradSampleModuleFastGradientClipping(use_ghost_clipping=True)`, norms only; opacus "
        "EW = `GradSampleModuleExpandedWeights` (torch ExpandedWeights); BackPACK = "
        "`BatchGrad` (norms with `BatchL2Grad`). On the transformer the opacus variants run "
        "with `nn.MultiheadAttention` replaced by opacus' `DPMultiheadAttention` (same "
        "weights), as opacus requires; opacus 1.6 mixes heads and tokens in that layer's "
        "output when `batch_first=True` (a different function: max output difference "
        "~0.8), which we undo with a parameter-free permutation in front of its `out_proj` "
        "so that all methods compute the same model.",
        "",
        table,
        "",
    ]
    if any(
        e.get("disturbed")
        for wl in results["workloads"].values()
        for m in wl["methods"].values()
        for e in m.values()
    ):
        parts += [
            "† unreliable (other jobs): the per-repeat ratios spread widely (interquartile "
            "range over 30% of the median), or most repeats ran with a disturbed baseline.",
            "",
        ]
    if skipped:
        parts += ["Skipped:", "", *skipped, ""]
    parts += ["Targets:", "", *target_lines]
    if fault_free_lines(results):
        parts += ["", *fault_free_lines(results)]
    return "\n".join(parts)


def keep_freed_memory() -> None:
    """Make glibc's malloc keep freed memory in the process (see the module docstring)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    if not (libc.mallopt(M_MMAP_THRESHOLD, 1 << 30) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 62)):
        raise RuntimeError("mallopt failed: --keep-freed-memory needs glibc")


def child_argv(argv: List[str], workload: str, json_path: str) -> List[str]:
    """Arguments for the child process of one workload: the parent's options, with
    ``--workloads``, ``--json`` and ``--doc`` replaced (the parent writes those)."""
    keep, replaced = [], {"--workloads", "--json", "--doc"}
    it = iter(argv)
    for a in it:
        if a.split("=")[0] in replaced:
            if "=" not in a:
                next(it, None)  # its value
        elif a not in ("--no-doc", "--child"):
            keep.append(a)
    return ["--workloads", workload, *keep, "--child", "--no-doc", "--json", json_path]


def run_child(workload: str, argv: List[str]) -> Dict[str, Any]:
    """Run one workload in a fresh Python process with the same options; its results."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "child.json")
        cmd = [sys.executable, os.path.abspath(__file__), *child_argv(argv, workload, path)]
        subprocess.run(cmd, check=True)
        with open(path) as f:
            return json.load(f)


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated")
    parser.add_argument("--repeats", type=int, default=None, help="7 (full) / 2 (--quick)")
    parser.add_argument("--quick", action="store_true", help="smoke run under a minute")
    parser.add_argument("--json", metavar="PATH", help="write all results as JSON")
    parser.add_argument("--doc", metavar="PATH", default=None, help="Markdown file to update")
    parser.add_argument("--no-doc", action="store_true", help="never touch the docs")
    parser.add_argument(
        "--no-wait", action="store_true", help="never wait for other jobs to leave the CPUs"
    )
    parser.add_argument("--verbose", action="store_true", help="tracebacks of failing peers")
    parser.add_argument(
        "--in-process", action="store_true", help="all workloads in this process (no children)"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="glibc malloc never returns freed memory to the OS (no page faults, all methods)",
    )
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)  # as given, for the children
    args.repeats = args.repeats or (2 if args.quick else 7)
    args.min_time = 0.01 if args.quick else 0.03
    args.mem_repeats = 2
    args.retries = 0 if args.quick else 12  # re-measurements of disturbed comparisons
    # wait for other jobs to leave the CPUs before measurements (bounded: see QuietGate)
    args.gate = common.QuietGate(max_wait=5.0, budget=120.0)
    if args.quick or args.no_wait:
        args.gate = common.QuietGate(max_wait=0.0, budget=0.0)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for w in workloads:
        if w not in WORKLOADS:
            parser.error(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
    for m in methods:
        if m not in METHODS:
            parser.error(f"unknown method {m!r}; choose from {', '.join(METHODS)}")

    if args.keep_freed_memory:
        keep_freed_memory()
    start = time.time()
    info = common.machine_info()
    versions = {
        "curvature": curvature.__version__,
        "opacus": common.package_version("opacus"),
        "backpack-for-pytorch": common.package_version("backpack-for-pytorch"),
    }
    # no absolute path of this machine: repository paths relative to it, as a reader types them
    command = common.portable_command("benchmarks/per_sample.py", argv)
    print(f"{common.machine_line(info)}; memory method: {common.memory_method()}")

    results: Dict[str, Any] = {
        "command": command.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": info,
        "versions": versions,
        "memory_method": common.memory_method(),
        "repeats": args.repeats,
        "loadavg_start": os.getloadavg(),
        "workloads": {},
    }
    if args.keep_freed_memory:
        results["allocator"] = "glibc malloc keeps freed memory (--keep-freed-memory)"
    gates = []  # quiet-gate summaries: the children's, then this process's
    if len(workloads) > 1 and not (args.in_process or args.child):
        for name in workloads:
            child = run_child(name, argv)
            results["workloads"][name] = child["workloads"][name]
            gates.append(child["quiet_gate"])
    else:
        for name in workloads:
            wl = make_workload(name)
            results["workloads"][name] = run_workload(wl, methods, args, log=print)
            del wl
            gc.collect()
    if wants_fault_free_check(args, workloads, methods):
        extra = ["--keep-freed-memory", "--methods", ",".join(FAULT_FREE_METHODS)]
        child = run_child("transformer", argv + extra)
        results["without_page_faults"] = {"transformer": child["workloads"]["transformer"]}
        gates.append(child["quiet_gate"])
    gates.append(args.gate.summary())
    results["elapsed_s"] = time.time() - start
    results["loadavg_end"] = os.getloadavg()
    results["quiet_gate"] = {
        "threshold": gates[0]["threshold"],
        **{k: sum(g[k] for g in gates) for k in ("measurements", "started_under_load")},
        "waited_s": round(sum(g["waited_s"] for g in gates), 1),
    }

    if args.child:  # the parent prints the tables of all workloads
        for wl_result in results["workloads"].values():
            wl_result["process"] = os.getpid()
        common.write_json(args.json, results)
        return results
    table = tables(results)
    target_lines, target_data = targets(results)
    results["targets"] = target_data
    print("\n" + table + "\n")
    for line in skipped_lines(results):
        print(line)
    print("\nTargets:")
    for line in target_lines:
        print(line)
    for line in fault_free_lines(results):
        print(line)
    print(
        f"\nelapsed {results['elapsed_s']:.0f} s; load average "
        f"{results['loadavg_start'][0]:.1f} -> {results['loadavg_end'][0]:.1f}; "
        f"quiet gate {results['quiet_gate']}"
    )

    if args.json:
        common.write_json(args.json, results)
        print(f"wrote {args.json}")
    full = set(workloads) == set(WORKLOADS) and set(methods) == set(METHODS)
    if not args.no_doc and (args.doc or (full and not args.quick)):
        path = args.doc or DOC_PATH
        common.update_doc_section(
            path, DOC_TITLE, doc_body(results, table, target_lines), intro=DOC_INTRO
        )
        print(f"updated section '{DOC_TITLE}' of {os.path.normpath(path)}")
    elif not args.no_doc:
        print("docs not updated (quick or partial run; pass --doc PATH to force)")
    return results


if __name__ == "__main__":
    main()
