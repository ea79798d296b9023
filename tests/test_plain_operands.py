"""The plain-operand GEMMs of a Linear layer equal the general expanded paths.

``curvature.layers.plain`` computes KFAC's ``"expand"`` sums, the Fisher diagonal and
EKFAC's rotated second moments of a one-group layer as batched GEMMs over
``a [1, M, D]`` and ``g [K, M, D_out]``; the general paths (``expanded_kfac``,
``expanded_diagonal``, ``rotated_second_moments`` over ``expand_calls``) and a
brute-force sum over per-sample gradients must give the same numbers.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from curvature.layer_stats import expanded_diagonal, rotated_second_moments
from curvature.layers import Call
from curvature.layers.base import expanded_kfac
from curvature.layers.linear import LinearRule
from curvature.layers.plain import plain_diagonal, plain_kfac, plain_rotated


def _call(x, g):
    return Call(
        args=(x,), kwargs={}, versions=[], out_edges=[], out_meta=[], out_index=[0], grads=[g]
    )


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("K", [1, 3])
@pytest.mark.parametrize("shape", [(5,), (4, 3)])  # [N, D_in] and [N, S, D_in]
def test_plain_operands_give_the_expanded_sums(bias, K, shape):
    torch.manual_seed(0)
    layer = nn.Linear(6, 4, bias=bias).double()
    x = torch.randn(*shape, 6, dtype=torch.float64)
    g = torch.randn(K, *shape, 4, dtype=torch.float64)
    rule = LinearRule()
    ops = rule.plain_operands(layer, [_call(x, g)])
    a, ge = rule.expand_calls(layer, [_call(x, g)])
    A, G, count = expanded_kfac(a, ge, "expand")
    A2, G2 = plain_kfac(ops)
    assert ops.a.shape[1] == count and ops.positions == (1 if len(shape) == 1 else 3)
    torch.testing.assert_close(A2, A, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(G2, G, rtol=1e-12, atol=1e-12)
    # brute force: per-sample gradients sum_s g a^T of [W | b]
    cols = [x] + ([torch.ones(*shape, 1, dtype=x.dtype)] if bias else [])
    ab = torch.cat(cols, -1).reshape(shape[0], -1, 6 + bias)
    gb = g.reshape(K, shape[0], -1, 4)
    grads = torch.einsum("knso,nsi->knoi", gb, ab)  # [K, N, D_out, D]
    if len(shape) == 1:  # one position: the diagonal and the rotated moments
        torch.testing.assert_close(plain_diagonal(ops)[0], grads.pow(2).sum((0, 1)))
        torch.testing.assert_close(plain_diagonal(ops), expanded_diagonal(a, ge))
        QA = torch.linalg.qr(torch.randn(1, 6 + bias, 6 + bias, dtype=x.dtype))[0]
        QG = torch.linalg.qr(torch.randn(1, 4, 4, dtype=x.dtype))[0]
        rot = (QG[0].T @ grads @ QA[0]).pow(2).sum((0, 1))
        torch.testing.assert_close(plain_rotated(ops, QA, QG)[0], rot)
        torch.testing.assert_close(
            plain_rotated(ops, QA, QG), rotated_second_moments(a, ge, QA, QG)
        )


def test_plain_operands_are_made_once_per_gradients():
    layer = nn.Linear(6, 4)
    call = _call(torch.randn(5, 6), torch.randn(1, 5, 4))
    rule = LinearRule()
    first = rule.plain_operands(layer, [call])
    assert rule.plain_operands(layer, [call]) is first
    call.grads = [torch.randn(1, 5, 4)]  # new gradients: new operands
    again = rule.plain_operands(layer, [call])
    assert again is not first and again.g is call.grads[0]
    assert rule.plain_operands(layer, [call, call]) is None  # several calls: general path


def test_expanded_blocks_are_made_once_per_gradients():
    """The quadratic rule's records and the Kronecker statistics of one pull share the
    expanded blocks of a call; new gradients (the next pull) make new ones."""
    torch.manual_seed(0)
    layer = nn.Linear(6, 4).double()
    x = torch.randn(5, 3, 6, dtype=torch.float64)
    call = _call(x, torch.randn(1, 5, 3, 4, dtype=torch.float64))
    rule = LinearRule()
    first = rule.expanded_blocks(layer, [call])
    assert rule.expanded_blocks(layer, [call]) is first
    a, g = rule.expand_calls(layer, [call])
    torch.testing.assert_close(first[""][0], a)
    torch.testing.assert_close(first[""][1], g)
    call.grads = [torch.randn(1, 5, 3, 4, dtype=torch.float64)]
    again = rule.expanded_blocks(layer, [call])
    assert again is not first
    torch.testing.assert_close(again[""][1], rule.expand_calls(layer, [call])[1])
    two = [call, _call(x, call.grads[0])]  # several calls: not kept
    assert rule.expanded_blocks(layer, two) is not rule.expanded_blocks(layer, two)
