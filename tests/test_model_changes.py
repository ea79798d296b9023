"""Changes to the model and to the param groups between steps reach the next ``step()``.

Each step compares the model's module tree, parameters and ``requires_grad`` flags with
a snapshot of the last full look instead of walking ``named_parameters()``, and keeps
the groups' parameter index until the groups change (``curvature.optim.watch``): these
tests change the model or the groups in the ways a training script does (and a few
hostile ones) and check that the step sees each change as the full walk did.
"""

import warnings

import pytest
import torch
from torch import nn

import curvature

CE = nn.CrossEntropyLoss()


def model_and_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 5), nn.Tanh()), nn.Linear(5, 3))
    return model, torch.randn(16, 4), torch.randint(0, 3, (16,))


def step(opt, model, X, y):
    opt.zero_grad()
    CE(model(X), y).backward()
    opt.step()


@pytest.mark.parametrize("cls", [curvature.KFAC, curvature.DiagonalNaturalGradient])
def test_a_nested_submodule_replaced_mid_run_is_refused(cls):
    """``model[0][0] = nn.Linear(...)``: the same names, new parameters that the groups
    do not hold (they would never train): refused, as for a replaced parameter."""
    model, X, y = model_and_batch()
    opt = cls(model, lr=0.1, damping=1e-2)
    step(opt, model, X, y)
    step(opt, model, X, y)
    model[0][0] = nn.Linear(4, 5)
    with pytest.raises(ValueError, match="replaced"):
        step(opt, model, X, y)


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m[1].register_parameter("extra", nn.Parameter(torch.zeros(3))),
        lambda m: m[0].add_module("late", nn.Linear(5, 5)),
    ],
    ids=["parameter-registered", "module-added"],
)
def test_a_parameter_or_module_added_mid_run_rebuilds_the_optimizer(change):
    model, X, y = model_and_batch()
    opt = curvature.KFAC(model, lr=0.1, damping=1e-2)
    step(opt, model, X, y)
    change(model)
    with pytest.warns(UserWarning, match="trainable parameters changed"):
        step(opt, model, X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # seen once: no rebuild at every step after it
        step(opt, model, X, y)


def test_a_parameter_frozen_and_unfrozen_by_its_flag_is_seen_each_time():
    model, X, y = model_and_batch()
    opt = curvature.KFAC(model, lr=0.1, damping=1e-2)
    step(opt, model, X, y)
    model[1].bias.requires_grad_(False)
    with pytest.warns(UserWarning, match="trainable parameters changed"):
        step(opt, model, X, y)
    frozen = model[1].bias.detach().clone()
    step(opt, model, X, y)
    assert torch.equal(model[1].bias, frozen)
    model[1].bias.requires_grad_(True)
    with pytest.warns(UserWarning, match="trainable parameters changed"):
        step(opt, model, X, y)


def test_groups_loaded_from_a_state_dict_take_effect_at_once():
    """``load_state_dict`` makes new group dicts: the next step uses their ``lr`` (0 for
    the second layer here), not the groups the step looked up before."""
    model, X, y = model_and_batch()
    groups = [{"params": list(model[0].parameters())}, {"params": list(model[1].parameters())}]
    opt = curvature.KFAC(model, lr=0.1, damping=1e-2, param_groups=groups)
    step(opt, model, X, y)
    state = opt.state_dict()
    state["param_groups"][1]["lr"] = 0.0
    opt.load_state_dict(state)
    before = [p.detach().clone() for p in model.parameters()]
    step(opt, model, X, y)
    after = list(model.parameters())
    assert not torch.equal(after[0], before[0])  # the first group moves
    assert torch.equal(after[2], before[2]) and torch.equal(after[3], before[3])


def test_a_parameter_appended_to_a_group_is_updated():
    """A frozen layer unfrozen and appended to the existing group's list: updated from the
    step that sees it (its group's index is rebuilt when the list grows)."""
    model, X, y = model_and_batch()
    model[1].requires_grad_(False)
    opt = curvature.KFAC(model, lr=0.1, damping=1e-2)
    step(opt, model, X, y)
    model[1].requires_grad_(True)
    opt.param_groups[0]["params"].extend(model[1].parameters())
    with pytest.warns(UserWarning, match="trainable parameters changed"):
        step(opt, model, X, y)
    before = model[1].weight.detach().clone()
    step(opt, model, X, y)
    assert not torch.equal(model[1].weight, before)
