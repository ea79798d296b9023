"""``nn.MultiheadAttention`` under the empirical Fisher (the optimizers' default).

The rule takes the projections' output gradients from edges inside the attention's
graph. In the user's backward, the out-projection's parameters accumulate before the
in-projections' gradients arrive: the layer used to be committed there, the q / k / v
gradients came "late" and were dropped (their curvature exactly zero, a step of
``1 / damping`` times the gradient, and a wrong warning about a second backward). The
twin: the same attention written with four ``nn.Linear`` projections, whose blocks the
library handles as plain layers; one step of each optimizer moves both alike.
"""

import math

import pytest
import torch
from torch import nn

import curvature

E, H, L, N = 6, 2, 4, 5


class Attention(nn.Module):
    def __init__(self, batch_first: bool):
        super().__init__()
        torch.manual_seed(0)
        self.att = nn.MultiheadAttention(E, H, batch_first=batch_first).double()
        self.head = nn.Linear(E, 3).double()
        self.batch_first = batch_first

    def forward(self, x):  # [N, L, E]
        t = x if self.batch_first else x.transpose(0, 1)
        o = self.att(t, t, t)[0]
        o = o if self.batch_first else o.transpose(0, 1)
        return self.head(o.mean(1))


class ExplicitAttention(nn.Module):
    """The same function with ``q``, ``k``, ``v``, ``out`` as ``nn.Linear`` layers."""

    def __init__(self, twin: Attention):
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(E, E).double() for _ in range(4))
        self.head = nn.Linear(E, 3).double()
        with torch.no_grad():
            for lin, w, b in zip(
                (self.q, self.k, self.v),
                twin.att.in_proj_weight.chunk(3),
                twin.att.in_proj_bias.chunk(3),
            ):
                lin.weight.copy_(w)
                lin.bias.copy_(b)
            self.out.load_state_dict(twin.att.out_proj.state_dict())
            self.head.load_state_dict(twin.head.state_dict())

    def forward(self, x):
        def heads(t):  # [N, L, E] -> [N, H, L, E / H]
            return t.reshape(N, L, H, E // H).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(E // H), -1)
        o = (w @ v).transpose(1, 2).reshape(N, L, E)
        return self.head(self.out(o).mean(1))


def one_step(cls, model):
    g = torch.Generator().manual_seed(1)
    X = torch.randn(N, L, E, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (N,), generator=g)
    ce = nn.CrossEntropyLoss()
    opt = cls(model, lr=0.1, damping=1e-3, loss_func=ce)
    opt.zero_grad()
    ce(model(X), y).backward()
    opt.step()
    return opt


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize(
    "cls", [curvature.KFAC, curvature.EKFAC, curvature.DiagonalNaturalGradient]
)
def test_the_empirical_step_equals_the_explicit_twins(cls, batch_first, recwarn):
    model = Attention(batch_first)
    twin = ExplicitAttention(model)
    opt = one_step(cls, model)
    one_step(cls, twin)
    after = torch.cat([twin.q.weight, twin.k.weight, twin.v.weight])
    torch.testing.assert_close(model.att.in_proj_weight, after, rtol=1e-9, atol=1e-12)
    after_b = torch.cat([twin.q.bias, twin.k.bias, twin.v.bias])
    torch.testing.assert_close(model.att.in_proj_bias, after_b, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(model.att.out_proj.weight, twin.out.weight, rtol=1e-9, atol=1e-12)
    assert not [w for w in recwarn if "second backward" in str(w.message)]
    if cls is not curvature.DiagonalNaturalGradient:
        for proj in ("q", "k", "v"):
            assert opt.factors()[f"att.{proj}_proj"][1].norm() > 0
