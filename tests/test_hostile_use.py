"""Ordinary but hostile uses that were silently wrong: now a clear error.

- A Kronecker block has one damping: a layer whose weight and bias are in param groups
  of different damping took the weight's and ignored the bias group's.
- Parameters replaced after the optimizer was built (``load_state_dict(assign=True)``, a
  new ``nn.Parameter`` or module): the optimizer updated the old tensors, the model's
  never trained.
- ``empirical_fisher`` of a model with dropout in train mode raised a raw ``vmap`` error.
- A Hessian trace of a monitoring loss was reported as a gradient penalty.
"""

import warnings

import pytest
import torch
from torch import nn

import curvature

OPTIMIZERS = [curvature.KFAC, curvature.EKFAC, curvature.DiagonalNaturalGradient]


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)


def step(model, opt):
    X, y = data()
    opt.zero_grad()
    nn.functional.cross_entropy(model(X), y).backward()
    opt.step()


def same_runs(a, opt_a, b, opt_b, steps: int = 3) -> None:
    """Three steps of each model with its optimizer: equal parameters after them."""
    for _ in range(steps):
        step(a, opt_a)
        step(b, opt_b)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q)


def split_groups(model, d_weight, d_bias):
    weights = [m.weight for m in model if isinstance(m, nn.Linear)]
    biases = [m.bias for m in model if isinstance(m, nn.Linear)]
    return [{"params": weights, "damping": d_weight}, {"params": biases, "damping": d_bias}]


@pytest.mark.parametrize("opt_cls", [curvature.KFAC, curvature.EKFAC])
def test_a_layer_in_groups_of_different_damping_is_refused(opt_cls):
    model = mlp()
    opt = opt_cls(model, lr=1e-2, param_groups=split_groups(model, 1e-1, 1e-4))
    with pytest.raises(ValueError, match=r"layer '0' are in param groups of different damping"):
        step(model, opt)


@pytest.mark.parametrize("opt_cls", [curvature.KFAC, curvature.EKFAC])
def test_a_layer_in_groups_of_equal_damping_trains_as_one_group(opt_cls):
    """Weight and bias in two groups of the same damping (each its own lr entry): the
    same block as one group."""
    a, b = mlp(), mlp()
    groups = split_groups(a, 1e-2, 1e-2)
    groups[1]["lr"] = 1e-2
    opt_a = opt_cls(a, lr=1e-2, param_groups=groups)
    opt_b = opt_cls(b, lr=1e-2, damping=1e-2)
    same_runs(a, opt_a, b, opt_b)


def test_the_diagonal_honours_each_groups_damping():
    """DiagonalNaturalGradient has no blocks across parameters: mixed groups are fine."""
    model = mlp()
    opt = curvature.DiagonalNaturalGradient(
        model, lr=1e-2, param_groups=split_groups(model, 1e-1, 1e-4)
    )
    step(model, opt)


def test_a_damping_changed_later_into_a_mismatch_is_refused_at_the_next_refresh():
    model = mlp()
    groups = split_groups(model, 1e-2, 1e-2)
    opt = curvature.KFAC(model, lr=1e-2, inverse_every=2, param_groups=groups)
    step(model, opt)  # refresh at step 0
    opt.param_groups[1]["damping"] = 1e-4
    step(model, opt)  # no refresh: the block still has its damping of step 0
    with pytest.raises(ValueError, match="different damping"):
        step(model, opt)  # refresh


@pytest.mark.parametrize("opt_cls", OPTIMIZERS)
def test_parameters_replaced_by_load_state_dict_assign_are_refused(opt_cls):
    model = mlp()
    opt = opt_cls(model, lr=1e-2, damping=1e-3)
    step(model, opt)
    state = {k: v.clone() for k, v in mlp().state_dict().items()}
    model.load_state_dict(state, assign=True)
    with pytest.raises(ValueError, match=r"\['0.weight', '0.bias', '2.weight', '2.bias'\] are not"):
        step(model, opt)


@pytest.mark.parametrize("opt_cls", OPTIMIZERS)
def test_a_new_parameter_or_module_is_refused(opt_cls):
    model = mlp()
    opt = opt_cls(model, lr=1e-2, damping=1e-3)
    model[2].weight = nn.Parameter(model[2].weight.detach().clone())
    with pytest.raises(ValueError, match=r"\['2.weight'\] are not the tensors"):
        step(model, opt)
    model = mlp()
    opt = opt_cls(model, lr=1e-2, damping=1e-3)
    model[2] = nn.Linear(5, 3)
    with pytest.raises(ValueError, match=r"\['2.weight', '2.bias'\] are not the tensors"):
        step(model, opt)


@pytest.mark.parametrize("opt_cls", OPTIMIZERS)
def test_load_state_dict_without_assign_keeps_training(opt_cls):
    """The ordinary load copies into the parameters: the same run as from those values."""
    a, b = mlp(), mlp()
    start = {k: v + 0.1 for k, v in a.state_dict().items()}
    opt_a = opt_cls(a, lr=1e-2, damping=1e-3)
    a.load_state_dict(start)
    b.load_state_dict(start)
    opt_b = opt_cls(b, lr=1e-2, damping=1e-3)
    same_runs(a, opt_a, b, opt_b)


class RootScaleWithDropout(nn.Module):
    """A learned scale directly on the model (as a ViT's ``pos_embedding``) and dropout."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.scale = nn.Parameter(torch.ones(()))
        self.body = nn.Sequential(nn.Linear(4, 5), nn.Dropout(0.5), nn.Tanh(), nn.Linear(5, 3))

    def forward(self, x):
        return self.body(x) * self.scale


@pytest.mark.parametrize("opt_cls", OPTIMIZERS)
def test_a_root_parameter_with_dropout_gets_the_plain_gradient(opt_cls):
    """The root's own parameter has no layer rule: the whole model would be replayed per
    sample for it, which dropout forbids. One warning names the parameter and the way
    out; it takes the plain gradient, every layer keeps its curvature (before: an error
    at the first step, "put this module in eval mode")."""
    model = RootScaleWithDropout()
    opt = opt_cls(model, lr=1e-2, damping=1e-3)
    with pytest.warns(UserWarning, match=r"<model>: .*own parameters \['scale'\].*plain gradient"):
        step(model, opt)
    before = model.scale.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second replay attempt, no second warning
        step(model, opt)
    grad = model.scale.grad.clone()
    torch.testing.assert_close(model.scale.detach(), before - 1e-2 * grad)
    if opt_cls is not curvature.DiagonalNaturalGradient:
        assert set(opt.factors()) == {"body.0", "body.3"}


def test_empirical_fisher_refuses_per_sample_bce_weights_and_keeps_class_weights():
    """A BCE weight ``[N, C]`` was broadcast over every one-sample loss (the dense
    reference 33% off with a mean, 17x with a sum); a weight ``[C]`` stays exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2)).double()
    X = torch.randn(5, 4, dtype=torch.float64)
    y = torch.randint(0, 2, (5, 2)).double()
    per_sample = nn.BCEWithLogitsLoss(weight=torch.rand(5, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"weight=...\) of shape \(5, 2\) weights each sample"):
        curvature.empirical_fisher(model, per_sample, (X, y))
    w = torch.rand(2, dtype=torch.float64)
    F = curvature.empirical_fisher(model, nn.BCEWithLogitsLoss(weight=w), (X, y))
    grads = []
    for n in range(5):  # R sum_n g_n g_n^T, g_n the gradient of sample n's loss alone
        model.zero_grad()
        nn.BCEWithLogitsLoss(weight=w)(model(X[n : n + 1]), y[n : n + 1]).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    G = torch.stack(grads)
    torch.testing.assert_close(F, G.T @ G / 5)


def test_the_curvature_functions_warn_about_dropout_in_train_mode():
    """Each forward draws new masks (``ggn()`` took its Jacobian from one and its loss
    Hessian from another: 17% off either mask's GGN): one warning per call names the
    dropout and ``model.eval()``; in eval mode they are quiet and deterministic."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Dropout(0.5), nn.Tanh(), nn.Linear(5, 3))
    X, y = data()
    ce = nn.CrossEntropyLoss()
    for fn in (curvature.ggn, curvature.kfac, curvature.diag_ggn):
        with pytest.warns(UserWarning, match=r"dropout in train mode \(\['1'\]\).*model.eval"):
            fn(model, ce, (X, y))
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        torch.testing.assert_close(
            curvature.ggn(model, ce, (X, y)), curvature.ggn(model, ce, (X, y))
        )


def test_empirical_fisher_with_dropout_in_train_mode_draws_a_mask_per_sample():
    """Before, ``torch.func.vmap`` refused the random op ("called random operation while
    in randomness error mode"); now each sample draws its own mask, as in one batched
    forward, with the dropout warning of the other functions: a PSD matrix whose masks
    differ between samples (not the eval-mode one), and the eval-mode result unchanged."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Dropout(0.5), nn.Tanh(), nn.Linear(5, 3))
    X, y = data()
    ce = nn.CrossEntropyLoss()
    with pytest.warns(UserWarning, match=r"dropout in train mode \(\['1'\]\)"):
        F = curvature.empirical_fisher(model, ce, (X, y))
    P = sum(p.numel() for p in model.parameters())
    assert F.shape == (P, P) and bool(torch.isfinite(F).all())
    assert float(torch.linalg.eigvalsh(F).min()) > -1e-6 * float(F.diagonal().max())
    model.eval()
    F_eval = curvature.empirical_fisher(model, ce, (X, y))
    assert not torch.allclose(F, F_eval)
    grads = curvature.per_sample_grads(model, ce, X, y)
    flat = torch.cat([g.flatten(1) for g in grads.values()], 1)
    torch.testing.assert_close(F_eval, flat.T @ flat / X.shape[0], rtol=1e-4, atol=1e-6)


def test_ekfac_reads_a_one_shot_iterable_once():
    """``ekfac()`` passes over the data twice: a generator used to be empty the second
    time ("the batch is empty"); now it is read once, the same as a list."""
    model, ce = mlp(), nn.CrossEntropyLoss()
    X, y = data()
    batches_ = [(X[:4], y[:4]), (X[4:], y[4:])]
    from_list = curvature.ekfac(model, ce, batches_).to_dense()
    from_gen = curvature.ekfac(model, ce, (b for b in batches_)).to_dense()
    torch.testing.assert_close(from_gen, from_list)


@pytest.mark.parametrize("opt_cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_a_hessian_trace_of_a_monitoring_loss_is_no_gradient_penalty(opt_cls):
    """``hutchinson_trace`` of a monitoring loss between steps (``create_graph`` passes
    that never accumulate into ``.grad``) leaves the empirical statistics alone and, unlike
    a gradient penalty, is not reported as one (before: a false ``create_graph=True``
    warning at the next forward)."""
    ce = nn.CrossEntropyLoss()
    X, y = data()
    runs = []
    for monitor in (False, True):
        model = mlp()
        opt = opt_cls(model, loss_func=ce)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            for _ in range(3):
                step(model, opt)
                if monitor:
                    curvature.hutchinson_trace(ce(model(X), y), list(model.parameters()), 4)
        assert not [r for r in rec if "create_graph" in str(r.message)]
        runs.append(model)
    for p, q in zip(*(m.parameters() for m in runs)):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


class _LearnedState(nn.Module):
    """A learned initial state on the model itself, fed to a GRU."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(4, 6, batch_first=True)
        self.head = nn.Linear(6, 3)
        self.h0 = nn.Parameter(0.3 * torch.randn(1, 1, 6))

    def forward(self, x):
        out, _ = self.rnn(x, self.h0.expand(-1, x.shape[0], -1).contiguous())
        return self.head(out[:, -1])


def test_a_learned_state_on_the_model_itself_is_named_in_the_error():
    """The model is replayed whole per sample for its own ``h0``, and the GRU fails under
    ``vmap``: before, a raw broadcast error from every entry point (found by an audit)."""
    torch.manual_seed(0)
    model, ce = _LearnedState(), nn.CrossEntropyLoss()
    X, y = torch.randn(5, 7, 4), torch.randint(0, 3, (5,))
    with pytest.raises(RuntimeError, match=r"replayed per sample under.*\['h0'\].*submodule"):
        curvature.kfac(model, ce, (X, y))
    opt = curvature.KFAC(model)
    with pytest.warns(UserWarning, match=r"no curvature for layer <model>.*\['h0'\]"):
        opt.zero_grad()
        ce(model(X), y).backward()
        opt.step()
    assert {"rnn", "head"} <= set(opt.factors())
    opt.close()


def test_empirical_fisher_of_a_recurrent_model_without_an_initial_state():
    """``torch.func.vmap`` fails on a recurrent layer that makes its own ``h_0`` (before,
    found by an audit: the raw error); the dense reference then takes one sample at a
    time: the per-sample gradients' ``R sum g g^T``."""
    torch.manual_seed(0)
    model = _GRUHead()
    ce = nn.CrossEntropyLoss()
    X, y = torch.randn(5, 7, 4), torch.randint(0, 3, (5,))
    F = curvature.empirical_fisher(model, ce, (X, y))
    grads = curvature.per_sample_grads(model, ce, X, y)
    flat = torch.cat([g.flatten(1) for g in grads.values()], 1)
    torch.testing.assert_close(F, flat.T @ flat / X.shape[0], rtol=1e-4, atol=1e-6)


class _GRUHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(4, 6, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


class _FewShot(nn.Module):
    """The encoder runs on the query batch (N) and on a support set (M) shared by all."""

    def __init__(self, recurrent):
        super().__init__()
        self.recurrent = recurrent
        self.enc = nn.LSTM(3, 33, batch_first=True) if recurrent else nn.Linear(15, 33)
        self.head = nn.Linear(33, 2)
        self.support = torch.randn(6, 5, 3)

    def embed(self, x):
        return self.enc(x)[0][:, -1] if self.recurrent else torch.tanh(self.enc(x.flatten(1)))

    def forward(self, x):
        return self.head(self.embed(x) * self.embed(self.support).mean(0))


@pytest.mark.parametrize("recurrent", [False, True], ids=["linear", "lstm"])
def test_a_layer_called_on_batches_of_different_sizes_is_refused_clearly(recurrent):
    """Before (found by an audit): ``torch.cat``'s raw size error."""
    torch.manual_seed(0)
    model, ce = _FewShot(recurrent), nn.CrossEntropyLoss()
    X, y = torch.randn(4, 5, 3), torch.randint(0, 2, (4,))
    match = r"called 2 times in one forward on batches of different sizes \[4, 6\].*Freeze"
    with pytest.raises(ValueError, match=match):
        curvature.kfac(model, ce, (X, y))
    opt = curvature.KFAC(model, loss_func=ce)
    with pytest.raises(ValueError, match=match):
        opt.zero_grad()
        ce(model(X), y).backward()
        opt.step()
    opt.close()
    model.enc.requires_grad_(False)  # the way out
    opt = curvature.KFAC(model, loss_func=ce)
    opt.zero_grad()
    ce(model(X), y).backward()
    opt.step()
    assert set(opt.factors()) == {"head"}
    opt.close()
