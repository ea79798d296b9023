"""What an optimizer accepts as its state: param groups and ``load_state_dict``.

- ``add_param_group`` (and the constructor's ``param_groups``) refuses a parameter that is
  not the model's (it would get a gradient and never be updated), warns about a frozen
  one, and preconditions a group added later like the others;
- ``load_state_dict`` checks a saved state against the optimizer before changing anything:
  the table :data:`MISMATCHES` gives one hostile state per row and the error it must give
  (the key, the saved and the expected shape, the way out); a state saved from a
  ``torch.compile``'d model (block names ``_orig_mod.<name>``) resumes the plain model
  bit for bit; KFAC and EKFAC states load into each other;
- every optimizer warns when a model in eval mode gives it no statistics;
- the update rules as documented in docs/optimizers.md: KL clipping with per-group learning
  rates and the damping adaptation's quadratic model with per-group damping.

Public API only; oracles from the definitions (dense Kronecker products, explicit sums).
"""

from __future__ import annotations

import copy
import io
import math
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict

import pytest
import torch
from cases import torch_state
from optimizer_info import OPTIMIZERS, layer_groups, optimizer_params, tiny_batch, tiny_mlp
from torch import nn

import curvature
from curvature import EKFAC, KFAC, DiagonalNaturalGradient
from curvature.capture import unwrap_model

CE = nn.CrossEntropyLoss()
KW = dict(lr=0.1, damping=1e-2, inverse_every=2)
WAY_OUT = "load only the model's state_dict and build a new optimizer"


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_state(seed=None):
        yield


# -- helpers ---------------------------------------------------------------------------------------
def params(model):
    return [p.detach().clone() for p in model.parameters()]


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def train(opt, model, steps, start=0, dtype=torch.float32):
    for s in range(start, start + steps):
        X, y = tiny_batch(s, dtype=dtype)
        opt.zero_grad()
        CE(model(X), y).backward()
        opt.step()


def saved(obj):
    """``obj`` through ``torch.save`` / ``torch.load``."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


def state_equal(a, b) -> bool:
    """Tensors bit for bit, containers recursively, the rest by ``==``."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return set(a) == set(b) and all(state_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(state_equal(x, y) for x, y in zip(a, b))
    return a == b


def with_prefix(state, prefix="_orig_mod."):
    """The state as a ``torch.compile``'d model's optimizer of an earlier version saved it."""
    curv = state["curvature"]

    def rename(entries):
        return {
            (prefix + k[0], k[1]) if isinstance(k, tuple) else prefix + k: v
            for k, v in entries.items()
        }

    for key in ("blocks", "diag", "terms", "diagonals"):
        if key in curv:
            curv[key] = rename(curv[key])
    return state


def quiet(build: Callable[[], Any]) -> Any:
    """``build()`` with the warnings it may give (e.g. ``max_factor_size``) silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build()


# -- add_param_group -------------------------------------------------------------------------------
@pytest.mark.parametrize("info", optimizer_params())
@pytest.mark.parametrize("where", ["add_param_group", "constructor"])
def test_a_parameter_outside_the_model_is_refused(info, where):
    """A parameter the model does not hold would get a gradient and never be updated:
    refused with its shape, the reason and the way out; the optimizer is unchanged."""
    model = tiny_mlp()
    stray = nn.Parameter(torch.ones(3, 2))
    match = (
        r"shape \[3, 2\] at param group 1\['params'\]\[1\] is not a parameter of the model "
        r"the optimizer was built on \(Sequential\).*never be updated.*torch\.optim\.AdamW"
    )
    if where == "constructor":
        groups = [{"params": layer_groups(model)[0]}, {"params": [model[2].weight, stray]}]
        with pytest.raises(ValueError, match=match):
            info.cls(model, **KW, param_groups=groups)
        return
    opt = info.cls(model, **KW, param_groups=[{"params": layer_groups(model)[0]}])
    with pytest.raises(ValueError, match=match):
        opt.add_param_group({"params": [model[2].weight, stray], "lr": 0.2})
    assert len(opt.param_groups) == 1
    with pytest.raises(ValueError, match=r"shape \[3, 2\] at param group 1\['params'\]\[0\]"):
        opt.add_param_group({"params": stray})  # a single tensor, as torch.optim allows


@pytest.mark.parametrize("info", optimizer_params())
def test_bad_hyperparameters_of_an_added_group_are_refused(info):
    model = tiny_mlp()
    opt = info.cls(model, **KW, param_groups=[{"params": layer_groups(model)[0]}])
    with pytest.raises(ValueError, match=r"damping=0\.0 is invalid; damping must be > 0"):
        opt.add_param_group({"params": layer_groups(model)[1], "damping": 0.0})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("info", optimizer_params())
def test_a_frozen_model_parameter_in_a_group_warns_and_is_updated_once_unfrozen(info):
    """Decision: a frozen model parameter in a group is accepted (gradual unfreezing) with
    a warning naming it; it stays put while frozen and moves once unfrozen."""
    model = tiny_mlp()
    model[0].weight.requires_grad_(False)
    with pytest.warns(UserWarning, match=r"\['0\.weight'\] in param group 0 are frozen"):
        opt = info.cls(model, **KW, param_groups=[{"params": list(model.parameters())}])
    w = model[0].weight.detach().clone()
    train(opt, model, 2)
    assert torch.equal(model[0].weight, w) and model[0].weight.grad is None
    model[0].weight.requires_grad_(True)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        train(opt, model, 1, start=2)  # the reset curvature has no statistics yet either
    assert any("trainable parameters changed" in str(r.message) for r in rec)
    assert not torch.equal(model[0].weight, w)


@pytest.mark.parametrize("info", optimizer_params())
def test_a_group_added_later_is_preconditioned_like_the_others(info):
    """A group added after two steps: its update is ``-lr2 * (C + lambda2)^{-1} g`` on
    its positions (the direction of ``optim.inverse_matvec``), and the run equals an
    optimizer built with both groups whose second group had ``lr=0`` until then."""
    first, second = dict(lr=0.1, damping=1e-2), dict(lr=0.3, damping=1e-1)
    model, ref = tiny_mlp(dtype=torch.float64), tiny_mlp(dtype=torch.float64)
    opt = info.cls(model, **KW, param_groups=[{"params": layer_groups(model)[0], **first}])
    both = [{"params": ps, **s} for ps, s in zip(layer_groups(ref), (first, {**second, "lr": 0}))]
    opt_ref = info.cls(ref, **KW, param_groups=both)
    train(opt, model, 2, dtype=torch.float64)
    train(opt_ref, ref, 2, dtype=torch.float64)
    assert same(params(model), params(ref))
    opt.add_param_group({"params": layer_groups(model)[1], **second})
    opt_ref.param_groups[1]["lr"] = second["lr"]
    X, y = tiny_batch(2, dtype=torch.float64)
    opt.zero_grad()
    CE(model(X), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    before = params(model)
    opt.step()
    train(opt_ref, ref, 1, start=2, dtype=torch.float64)
    assert same(params(model), params(ref))
    directions = opt.inverse_matvec(grads)
    for i in (2, 3):  # the added group: layer 2's weight and bias
        step = list(model.parameters())[i].detach() - before[i]
        torch.testing.assert_close(step, -0.3 * directions[i], rtol=1e-12, atol=1e-14)
        assert not torch.allclose(step, -0.3 * grads[i], rtol=1e-3)  # not plain SGD


# -- load_state_dict: hostile states ---------------------------------------------------------------
def named_mlp(seed=0, dtype=torch.float32):
    """:func:`tiny_mlp` with named layers ``fc1``, ``fc2`` (same shapes, other names)."""
    plain = tiny_mlp(seed, dtype)
    return nn.Sequential(OrderedDict(fc1=plain[0], act=plain[1], fc2=plain[2]))


def wide_mlp(seed=0, dtype=torch.float32):
    """``Linear(4, 7) -> Tanh -> Linear(7, 3)``: one more hidden unit."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)


def no_bias_mlp(seed=0, dtype=torch.float32):
    """:func:`tiny_mlp`'s widths, the first layer without a bias (``A`` is ``[4, 4]``)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6, bias=False), nn.Tanh(), nn.Linear(6, 3)).to(dtype)


def deep_mlp(seed=0, dtype=torch.float32):
    """:func:`tiny_mlp` with one more layer (block ``"4"``)."""
    plain = tiny_mlp(seed, dtype)
    return nn.Sequential(*plain, nn.Tanh(), nn.Linear(3, 3).to(dtype))


def small_cnn(channels=3, seed=0, dtype=torch.float32):
    """:func:`tiny_batch`'s ``[N, 4]`` as ``[N, 1, 2, 2]`` images, padded, then
    ``Conv2d(1, channels, 3)`` (block ``"2"``) and ``Linear(4 channels, 3)`` (block ``"4"``)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Unflatten(1, (1, 2, 2)),
        nn.ConstantPad2d(1, 0.0),
        nn.Conv2d(1, channels, 3),
        nn.Flatten(),
        nn.Linear(4 * channels, 3),
    ).to(dtype)


def tensor_to_list(state):
    state["curvature"]["blocks"][("0", "")]["A"] = state["curvature"]["blocks"][("0", "")][
        "A"
    ].tolist()
    return state


def bad_corrections(state):
    block = state["curvature"]["blocks"][("2", "")]
    block["corrections"] = block["corrections"][..., :-1]
    return state


def bad_record(state):
    state["curvature"]["blocks"][("0", "")]["record"]["lA"] = torch.ones(1, 3)
    return state


def unknown_record(state):
    state["curvature"]["blocks"][("0", "")]["record"]["kind"] = "Cholesky"
    return state


def bad_diagonal(state):
    block = state["curvature"]["diagonals"]["2"]
    block["d"] = block["d"][:-1]
    return state


@dataclass(frozen=True)
class Mismatch:
    """A state saved by ``save`` (after two steps), transformed, loaded by ``load``."""

    id: str
    save: Callable[[nn.Module], Any]
    load: Callable[[nn.Module], Any]
    match: str
    saver_model: Callable[..., nn.Module] = tiny_mlp
    loader_model: Callable[..., nn.Module] = tiny_mlp
    transform: Callable[[Dict[str, Any]], Dict[str, Any]] = lambda s: s


def kfac(**kw):
    return lambda m: KFAC(m, **{**KW, **kw})


def ekfac(**kw):
    return lambda m: EKFAC(m, **{**KW, **kw})


def diagonal(**kw):
    return lambda m: DiagonalNaturalGradient(m, **{**KW, **kw})


class BigParam(nn.Module):
    """A layer without a Kronecker rule, too large for an exact block (5000 parameters)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 5000))

    def forward(self, x):
        return x * self.scale[: x.shape[-1]]


def with_big_param(seed=0, dtype=torch.float32):
    """:func:`tiny_mlp` with :class:`BigParam` (block ``"1"``) after the first layer."""
    plain = tiny_mlp(seed, dtype)
    return nn.Sequential(plain[0], BigParam().to(dtype), plain[1], plain[2])


def two_groups(cls):
    return lambda m: cls(m, **KW, param_groups=[{"params": ps} for ps in layer_groups(m)])


def sgd(m):
    return torch.optim.SGD(m.parameters(), lr=0.1)


MISMATCHES = [
    Mismatch(
        "KFAC-wider-model",
        kfac(),
        kfac(),
        r"block '0' G has saved shape \[1, 6, 6\], expected \[1, 7, 7\] \(a model of other layer",
        loader_model=wide_mlp,
    ),
    Mismatch(
        "EKFAC-wider-model",
        ekfac(),
        ekfac(),
        r"block '0' G has saved shape \[1, 6, 6\], expected \[1, 7, 7\]",
        loader_model=wide_mlp,
    ),
    Mismatch(
        "KFAC-narrower-model",
        kfac(),
        kfac(),
        r"block '0' G has saved shape \[1, 7, 7\], expected \[1, 6, 6\] \(a model of other layer",
        saver_model=wide_mlp,
    ),
    Mismatch(
        "EKFAC-wider-model-into-KFAC",
        ekfac(),
        kfac(),
        r"block '0' G has saved shape \[1, 6, 6\], expected \[1, 7, 7\]",
        loader_model=wide_mlp,
    ),
    Mismatch(
        "KFAC-wider-model-into-EKFAC",
        kfac(),
        ekfac(),
        r"block '0' G has saved shape \[1, 6, 6\], expected \[1, 7, 7\]",
        loader_model=wide_mlp,
    ),
    Mismatch(
        "EKFAC-corrections-shape-into-KFAC",
        ekfac(),
        kfac(),
        r"block '2' corrections has saved shape \[1, 3, 6\], expected \[1, 3, 7\]",
        transform=bad_corrections,
    ),
    Mismatch(
        "KFAC-exact-wider-model",
        kfac(damping_mode="exact"),
        kfac(damping_mode="exact"),
        r"block '0' G has saved shape \[1, 6, 6\], expected \[1, 7, 7\]",
        loader_model=wide_mlp,
    ),
    Mismatch(
        "KFAC-a-layer-without-bias",
        kfac(),
        kfac(),
        r"param group 0 has 4 saved parameter\(s\), this optimizer's 3",
        loader_model=no_bias_mlp,
    ),
    Mismatch(
        "KFAC-deeper-model-into-shallower",
        kfac(),
        kfac(),
        r"param group 0 has 6 saved parameter\(s\), this optimizer's 4",
        saver_model=deep_mlp,
    ),
    Mismatch(
        "KFAC-conv-other-channels",
        kfac(),
        kfac(),
        r"block '2' G has saved shape \[1, 3, 3\], expected \[1, 5, 5\]",
        saver_model=lambda: small_cnn(3),
        loader_model=lambda: small_cnn(5),
    ),
    Mismatch(
        "Diagonal-wider-model-into-KFAC",
        diagonal(),
        kfac(),
        r"saved by DiagonalNaturalGradient.*loads only into DiagonalNaturalGradient",
        loader_model=wide_mlp,
    ),
    Mismatch(
        "KFAC-wider-model-into-Diagonal",
        kfac(),
        diagonal(),
        r"saved by KFAC.*loads only into KFAC or EKFAC",
        loader_model=wide_mlp,
    ),
    Mismatch(
        "Diagonal-wider-model",
        diagonal(),
        diagonal(),
        r"diagonal '0' index has saved shape \[30\], expected \[35\]",
        loader_model=wide_mlp,
    ),
    Mismatch(
        "KFAC-wider-model-momentum",
        kfac(momentum=0.9),
        kfac(momentum=0.9),
        r"momentum_buffer of parameter '0\.weight' has saved shape \[6, 4\], expected \[7, 4\]",
        loader_model=wide_mlp,
    ),
    Mismatch(
        "KFAC-other-layer-names",
        kfac(),
        kfac(),
        r"block '0' is not a block of this model \(its blocks: \['fc1', 'fc2'\]\)",
        loader_model=named_mlp,
    ),
    Mismatch(
        "Diagonal-other-layer-names",
        diagonal(),
        diagonal(),
        r"diagonal '0' is not a layer of this model \(its layers: \['fc1', 'fc2'\]\)",
        loader_model=named_mlp,
    ),
    Mismatch(
        "KFAC-into-a-diagonal-block",
        kfac(),
        kfac(max_factor_size=5),
        r"block '0' was saved as a Kronecker block, this optimizer makes it a diagonal block "
        r"\(another block structure: max_factor_size",
    ),
    Mismatch(
        "KFAC-diagonal-into-a-Kronecker-block",
        kfac(max_factor_size=5),
        kfac(),
        r"block '0' was saved as a diagonal block, this optimizer makes it a Kronecker block",
    ),
    Mismatch(
        "KFAC-unsupported-diagonal-into-warn",
        kfac(unsupported="diagonal"),
        kfac(unsupported="warn"),
        r"block '1' was saved as a diagonal block, this optimizer has no block for it "
        r"\(another block structure",
        saver_model=with_big_param,
        loader_model=with_big_param,
    ),
    Mismatch(
        "Diagonal-into-KFAC",
        diagonal(),
        kfac(),
        r"saved by DiagonalNaturalGradient.*not Kronecker blocks.*a DiagonalNaturalGradient "
        r"state loads only into DiagonalNaturalGradient",
    ),
    Mismatch(
        "Diagonal-into-EKFAC",
        diagonal(),
        ekfac(),
        r"saved by DiagonalNaturalGradient.*loads only into DiagonalNaturalGradient",
    ),
    Mismatch(
        "KFAC-into-Diagonal",
        kfac(),
        diagonal(),
        r"saved by KFAC.*not per-layer diagonals.*a KFAC state loads only into KFAC or EKFAC",
    ),
    Mismatch(
        "EKFAC-into-Diagonal",
        ekfac(),
        diagonal(),
        r"saved by EKFAC.*loads only into KFAC or EKFAC",
    ),
    Mismatch(
        "KFAC-other-param-groups",
        kfac(),
        two_groups(KFAC),
        r"the state has 1 param group\(s\), this optimizer 2",
    ),
    Mismatch(
        "Diagonal-other-param-groups",
        two_groups(DiagonalNaturalGradient),
        diagonal(),
        r"the state has 2 param group\(s\), this optimizer 1",
    ),
    Mismatch(
        "KFAC-factor-not-a-tensor",
        kfac(),
        kfac(),
        r"block '0' A is a list, expected a tensor \[1, 5, 5\]",
        transform=tensor_to_list,
    ),
    Mismatch(
        "EKFAC-corrections-shape",
        ekfac(),
        ekfac(),
        r"block '2' corrections has saved shape \[1, 3, 6\], expected \[1, 3, 7\]",
        transform=bad_corrections,
    ),
    Mismatch(
        "KFAC-eigenvalues-shape",
        kfac(damping_mode="exact"),
        kfac(damping_mode="exact"),
        r"block '0' record lA has saved shape \[1, 3\], expected \[1, 5\]",
        transform=bad_record,
    ),
    Mismatch(
        "KFAC-record-of-unknown-kind",
        kfac(),
        kfac(),
        r"block '0' has a record of unknown kind",
        transform=unknown_record,
    ),
    Mismatch(
        "Diagonal-diagonal-shape",
        diagonal(),
        diagonal(),
        r"diagonal '2' d has saved shape \[20\], expected \[21\]",
        transform=bad_diagonal,
    ),
    Mismatch(
        "SGD-into-KFAC",
        sgd,
        kfac(),
        r"no 'curvature' entry \(was it saved by a different optimizer\?\)",
    ),
]


@pytest.mark.parametrize("row", [pytest.param(r, id=r.id) for r in MISMATCHES])
def test_load_state_dict_refuses_a_mismatching_state(row):
    """Refused at ``load_state_dict`` (not one step later) with the key, the saved and the
    expected shape and the way out; the loading optimizer is left unchanged and trains."""
    saver_model = row.saver_model()
    saver = quiet(lambda: row.save(saver_model))
    train(saver, saver_model, 2)
    state = row.transform(saved(saver.state_dict()))
    model = row.loader_model()
    opt = quiet(lambda: row.load(model))
    train(opt, model, 1)
    before = saved(opt.state_dict())
    with pytest.raises(ValueError, match=row.match) as err:
        opt.load_state_dict(state)
    assert WAY_OUT in str(err.value)
    assert state_equal(opt.state_dict(), before)  # nothing changed
    train(opt, model, 1, start=1)
    assert all(torch.isfinite(p).all() for p in model.parameters())


# -- load_state_dict: torch.compile's prefix -------------------------------------------------------
@pytest.mark.parametrize("fisher", ["empirical", "type-2"])
@pytest.mark.parametrize("info", optimizer_params())
def test_a_state_with_the_compiled_prefix_resumes_the_plain_model_bit_for_bit(info, fisher):
    """Block names ``_orig_mod.<name>`` (a compiled model's state of an earlier version)
    are those of the plain model: the resumed run equals the continued original."""
    k, n = 3, 3
    kw = dict(KW, momentum=0.5, fisher=fisher, loss_func=CE if fisher != "empirical" else None)
    model = tiny_mlp()
    opt = info.cls(model, **kw)
    train(opt, model, k)
    checkpoint = saved({"model": model.state_dict(), "optim": opt.state_dict()})
    plain_state = saved(opt.state_dict())
    train(opt, model, n, start=k)

    resumed = tiny_mlp(seed=5)
    resumed.load_state_dict(checkpoint["model"])
    opt2 = info.cls(resumed, **kw)
    prefixed = with_prefix(checkpoint["optim"])
    assert not state_equal(prefixed, plain_state)  # the prefix is there
    opt2.load_state_dict(prefixed)
    assert state_equal(opt2.state_dict(), plain_state)
    train(opt2, resumed, n, start=k)
    assert same(params(resumed), params(model))


def compiled(model):
    """``torch.compile(model)`` (eager backend: no C++ compiler needed), or a skip.

    The probe compiles another module: a compiled model's first call must come after
    the optimizer placed its hooks (dynamo does not guard on hooks added later).
    """
    try:
        torch.compile(nn.Linear(2, 2), backend="eager")(torch.ones(1, 2))
    except Exception as e:  # pragma: no cover - depends on the platform
        pytest.skip(f"torch.compile is unavailable here: {type(e).__name__}: {e}")
    return torch.compile(model, backend="eager")


@pytest.mark.parametrize("info", optimizer_params())
def test_a_compiled_models_state_resumes_the_plain_model_bit_for_bit(info):
    """The optimizer of a ``torch.compile``'d model names its blocks as the plain model
    does; its state loads into an optimizer on the plain model, and the resumed run
    equals the continued compiled run bit for bit."""
    k, n = 3, 3
    kw = dict(KW, momentum=0.5)
    model = tiny_mlp()
    fast = compiled(model)
    opt = info.cls(fast, **kw)
    train(opt, fast, k)
    assert set(opt.blocks) == {"0", "2"}
    checkpoint = saved({"model": model.state_dict(), "optim": opt.state_dict()})
    train(opt, fast, n, start=k)

    plain = tiny_mlp(seed=5)
    plain.load_state_dict(checkpoint["model"])
    opt2 = info.cls(plain, **kw)
    opt2.load_state_dict(checkpoint["optim"])
    train(opt2, plain, n, start=k)
    assert same(params(plain), params(model))
    # not vacuous: without the optimizer's state the continued run differs
    alone = tiny_mlp(seed=5)
    alone.load_state_dict(checkpoint["model"])
    train(info.cls(alone, **kw), alone, n, start=k)
    assert not same(params(alone), params(model))


# -- KFAC <-> EKFAC --------------------------------------------------------------------------------
def dense_blocks(opt, damping, mode):
    """Per Linear block of :func:`tiny_mlp`: the damped inverse from ``factors()``."""
    out = {}
    for name, (A, G) in opt.factors().items():
        eye_a, eye_g = torch.eye(A.shape[0], dtype=A.dtype), torch.eye(G.shape[0], dtype=G.dtype)
        if mode == "exact":
            K = torch.kron(G, A)
            out[name] = torch.linalg.inv(K + damping * torch.eye(K.shape[0], dtype=K.dtype))
        else:
            pi = math.sqrt((A.trace() / A.shape[0]) / (G.trace() / G.shape[0]))
            root = math.sqrt(damping)
            Ginv = torch.linalg.inv(G + root / pi * eye_g)
            Ainv = torch.linalg.inv(A + pi * root * eye_a)
            out[name] = torch.kron(Ginv, Ainv)
    return out


def oracle_direction(model, inverses, v):
    """Apply each block's dense inverse to ``[W | b]`` of its layer (row-major vec)."""
    out = []
    for i, name in enumerate(("0", "2")):
        W, b = v[2 * i], v[2 * i + 1]
        M = torch.cat([W, b[:, None]], 1)
        d = (inverses[name] @ M.reshape(-1)).reshape(M.shape)
        out += [d[:, :-1], d[:, -1]]
    return out


def test_a_kfac_state_loads_into_ekfac():
    """Decision: KFAC's factors are meaningful to EKFAC (they share them). Loaded without
    a warning, EKFAC has KFAC's factors and, until its first corrections, preconditions
    with them exactly damped; its next steps collect corrections."""
    dt = torch.float64
    model = tiny_mlp(dtype=dt)
    opt = KFAC(model, **KW)
    train(opt, model, 3, dtype=dt)
    twin = copy.deepcopy(model)
    ek = EKFAC(twin, **KW)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ek.load_state_dict(saved(opt.state_dict()))
    for name, (A, G) in opt.factors().items():
        assert torch.equal(ek.factors()[name][0], A) and torch.equal(ek.factors()[name][1], G)
    assert all(b.corrections is None for b in ek.blocks.values())
    v = [torch.randn_like(p) for p in twin.parameters()]
    expected = oracle_direction(twin, dense_blocks(ek, 1e-2, "exact"), v)
    for got, want in zip(ek.inverse_matvec(v), expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    train(ek, twin, 2, start=3, dtype=dt)
    assert all(b.corrections is not None for b in ek.blocks.values())


def test_an_ekfac_state_loads_into_kfac_without_its_corrections():
    """Decision: EKFAC's eigenvalue corrections have no place in KFAC; they are dropped
    with a warning naming the blocks, the factors are kept, and KFAC preconditions with
    them (pi damping, the dense oracle from the factors)."""
    dt = torch.float64
    model = tiny_mlp(dtype=dt)
    opt = EKFAC(model, **{**KW, "inverse_every": 1})
    train(opt, model, 3, dtype=dt)
    assert all(b.corrections is not None for b in opt.blocks.values())
    twin = copy.deepcopy(model)
    kf = KFAC(twin, **KW)
    with pytest.warns(UserWarning, match=r"corrections of \['0', '2'\]; they are dropped"):
        kf.load_state_dict(saved(opt.state_dict()))
    assert state_equal(kf.factors(), opt.factors())
    v = [torch.randn_like(p) for p in twin.parameters()]
    expected = oracle_direction(twin, dense_blocks(kf, 1e-2, "pi"), v)
    for got, want in zip(kf.inverse_matvec(v), expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    train(kf, twin, 2, start=3, dtype=dt)
    assert all(torch.isfinite(p).all() for p in twin.parameters())


@pytest.mark.parametrize("fisher", ["empirical", "mc"])
@pytest.mark.parametrize("pattern", [(0, 1), (0, 1, 1)], ids=["good-bad", "good-bad-bad"])
@pytest.mark.parametrize("inverse_every", [1, 3])
def test_an_ekfac_state_saved_before_any_finite_corrections_resumes_bit_for_bit(
    fisher, pattern, inverse_every
):
    """A step with a non-finite batch after the first refresh leaves the corrections with
    no finite statistics: KFAC's eigenvalues stand in for them. A checkpoint taken then
    must resume with the same stand-in (it resumed with zero corrections, i.e. the bare
    damping as denominators, before)."""
    dt = torch.float64
    model = tiny_mlp(dtype=dt)
    kw = {**KW, "inverse_every": inverse_every, "fisher": fisher, "loss_func": CE}
    opt = EKFAC(model, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s, bad in enumerate(pattern):
            X, y = tiny_batch(s, dtype=dt)
            if bad:
                X = X.clone()
                X[0, 0] = float("nan")
            opt.zero_grad()
            CE(model(X), y).backward()
            opt.step()
    twin = copy.deepcopy(model)
    resumed = EKFAC(twin, **kw)
    resumed.load_state_dict(saved(opt.state_dict()))
    train(opt, model, 3, start=len(pattern), dtype=dt)
    train(resumed, twin, 3, start=len(pattern), dtype=dt)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


# -- a model in eval mode --------------------------------------------------------------------------
@pytest.mark.parametrize("fisher", ["empirical", "type-2"])
@pytest.mark.parametrize("info", optimizer_params())
def test_every_optimizer_warns_once_when_eval_mode_gives_no_statistics(info, fisher):
    """In eval mode nothing is recorded: the steps are plain ``-lr g`` and each optimizer
    says so, once, naming the layers."""
    model = tiny_mlp(dtype=torch.float64).eval()
    opt = info.cls(model, **KW, fisher=fisher, loss_func=CE)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for s in range(3):
            X, y = tiny_batch(s, dtype=torch.float64)
            opt.zero_grad()
            CE(model(X), y).backward()
            before, grads = params(model), [p.grad.clone() for p in model.parameters()]
            opt.step()
            for p, q, g in zip(model.parameters(), before, grads):
                torch.testing.assert_close(p.detach(), q - 0.1 * g, rtol=0, atol=1e-15)
    hits = [r for r in rec if "no curvature statistics yet" in str(r.message)]
    assert len(hits) == 1, [str(r.message) for r in rec]
    assert "['0', '2']" in str(hits[0].message) and "plain gradient" in str(hits[0].message)
    assert hits[0].filename == __file__


# -- the documented update rules -------------------------------------------------------------------
def flat(ts):
    return torch.cat([t.reshape(-1) for t in ts])


def first_step(info, kl_clip, lrs):
    """One step with two groups of learning rates ``lrs``: gradients, steps, directions."""
    dt = torch.float64
    model = tiny_mlp(dtype=dt)
    groups = [{"params": ps, "lr": lr} for ps, lr in zip(layer_groups(model), lrs)]
    opt = info.cls(model, **{**KW, "kl_clip": kl_clip}, param_groups=groups)
    X, y = tiny_batch(0, dtype=dt)
    opt.zero_grad()
    CE(model(X), y).backward()
    grads, before = [p.grad.clone() for p in model.parameters()], params(model)
    opt.step()
    steps = [p.detach() - q for p, q in zip(model.parameters(), before)]
    return grads, steps, opt.inverse_matvec(grads), opt.last_kl_scale


@pytest.mark.parametrize("info", optimizer_params())
def test_kl_clipping_is_ba_et_al_rule_with_per_group_learning_rates(info):
    """docs/optimizers.md: the update ``-lr_p d_p`` is scaled by ``nu = min(1,
    sqrt(kl_clip / sum_p lr_p^2 d_p^T g_p))``, with ``d`` the preconditioned gradient."""
    lrs = (0.1, 0.4)
    lr_of = [lrs[0], lrs[0], lrs[1], lrs[1]]  # per parameter of tiny_mlp
    grads, plain, d, nu_plain = first_step(info, None, lrs)
    total = sum(lr**2 * float((dp * gp).sum()) for lr, dp, gp in zip(lr_of, d, grads))
    assert total > 0 and nu_plain == 1.0
    for kl_clip, nu in ((10 * total, 1.0), (total / 9, 1 / 3)):
        _, steps, _, got = first_step(info, kl_clip, lrs)
        assert got == pytest.approx(min(1.0, math.sqrt(kl_clip / total)), rel=1e-12)
        assert got == pytest.approx(nu, rel=1e-12)
        for lr, s, dp in zip(lr_of, steps, d):
            torch.testing.assert_close(s, -lr * nu * dp, rtol=1e-10, atol=1e-15)
    # not vacuous: one learning rate for all (the first group's) gives another bound
    single = sum(lrs[0] ** 2 * float((dp * gp).sum()) for dp, gp in zip(d, grads))
    assert single != pytest.approx(total, rel=1e-2)


@pytest.mark.parametrize("info", optimizer_params())
def test_damping_adaptation_uses_each_groups_damping(info):
    """docs/optimizers.md: ``rho = (L(x + delta) - L(x)) / q(delta)``, ``q(delta) = g^T
    delta + 1/2 delta^T C delta + 1/2 sum_i lambda_i delta_i^2`` with each position's own
    group damping ``lambda_i``; every group's damping is then rescaled by the same factor."""
    dt = torch.float64
    model = tiny_mlp(dtype=dt)
    dampings = (1e-3, 3.0)
    groups = [{"params": ps, "damping": lam} for ps, lam in zip(layer_groups(model), dampings)]
    opt = info.cls(
        model,
        **{**KW, "lr": 0.5},
        param_groups=groups,
        adaptive_damping=True,
        damping_adaptation_interval=1,
        damping_adaptation_decay=0.5,
    )
    X, y = tiny_batch(0, dtype=dt)
    first_grads = []

    def closure():
        opt.zero_grad()
        loss = CE(model(X), y)
        loss.backward()
        if not first_grads:  # the gradient at the start of the step
            first_grads.append(flat([p.grad for p in model.parameters()]))
        return loss

    before = params(model)
    loss_before = float(opt.step(closure).detach())
    g = first_grads[0]
    with torch.no_grad():
        loss_after = float(CE(model(X), y))
    delta = [p.detach() - q for p, q in zip(model.parameters(), before)]
    d = flat(delta)
    Cd = flat(opt.matvec(delta))
    lam = flat(
        [torch.full_like(p, dampings[0 if i < 2 else 1]) for i, p in enumerate(model.parameters())]
    )
    q = float(g @ d + 0.5 * (d @ Cd) + 0.5 * (lam * d * d).sum())
    rho = (loss_after - loss_before) / q
    assert q < 0
    assert opt.last_reduction_ratio == pytest.approx(rho, rel=1e-9)
    # not vacuous: the first group's damping everywhere gives another ratio
    q_first = float(g @ d + 0.5 * (d @ Cd) + 0.5 * dampings[0] * (d * d).sum())
    assert (loss_after - loss_before) / q_first != pytest.approx(rho, rel=1e-3)
    factor = 0.5 if rho > 0.75 else (2.0 if rho < 0.25 else 1.0)
    assert [grp["damping"] for grp in opt.param_groups] == pytest.approx(
        [lam_ * factor for lam_ in dampings], rel=1e-15
    )


def test_the_table_covers_every_optimizer():
    loaders = {type(quiet(lambda r=r: r.load(r.loader_model()))) for r in MISMATCHES}
    assert {i.cls for i in OPTIMIZERS} <= loaders


def test_the_engine_names_a_compiled_models_layers_as_the_plain_model():
    """``unwrap_model`` removes ``torch.compile``'s wrapper (and DDP-style wrappers
    around it): layer names have no ``_orig_mod.`` prefix."""
    model = tiny_mlp()
    fast = compiled(model)
    assert [n for n, _ in fast.named_modules()][1] == "_orig_mod"  # what torch names them
    assert unwrap_model(fast) is model
    assert unwrap_model(nn.DataParallel(fast)) is model
    with curvature.capture(fast) as cap:
        assert [name for name, _, _ in cap.layers] == ["0", "2"]
