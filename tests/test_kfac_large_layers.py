"""``kfac()`` / ``ekfac()`` on layers whose Kronecker factors exceed ``max_factor_size``.

A block with a factor larger than ``max_factor_size`` (``D`` or ``D_out``) becomes a
:class:`~curvature.blocks.DiagonalBlock` holding the exact per-sample Fisher diagonal
``d = sum_{k,n} grad_nk^2`` of its entries (as in the optimizers), computed without
forming the factors, and one warning names it. The oracles: the diagonal of the dense GGN
(:func:`curvature.ggn`) and :func:`curvature.diag_ggn` for the diagonal blocks,
``kfac()`` / ``ekfac()`` without the limit for the Kronecker blocks, and the dense matrix
assembled from both for ``to_dense``, ``matvec``, ``inverse_matvec``, ``trace`` and
``logdet``.
"""

from __future__ import annotations

import time
import warnings
from typing import Callable, Dict, NamedTuple

import pytest
import torch
from torch import Tensor, nn

import curvature
from curvature.blocks import DiagonalBlock

pytestmark = pytest.mark.usefixtures("float64_seeded")

SMALL = 5  # max_factor_size of the tests: some blocks of each model are over it
NO_LIMIT = 10**6


# -- models (each has blocks over and under SMALL) -------------------------------------------
class EmbedLinear(nn.Module):
    """Embedding (A: 12 > SMALL) -> mean over the sequence -> Linear (A: 4, G: 2)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(12, 3)
        self.fc = nn.Linear(3, 2)

    def forward(self, tokens):
        return self.fc(self.emb(tokens).mean(1))


class CrossAttention(nn.Module):
    """Attention with ``kdim=6`` (k_proj's A: 7 > SMALL; q, v, out projections under it)."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, kdim=6, vdim=3, batch_first=True)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        q, k, v = x[..., :4], x[..., 4:10], x[..., 10:13]
        return self.fc(self.attn(q, k, v, need_weights=False)[0].mean(1))


def _mlp():  # '0': A 7 > SMALL (diagonal); '2': A 5, G 3 (Kronecker)
    return nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3))


def _cnn():  # '0' grouped, A 5 per group (Kronecker); '2' A 17, '5' A 13 (diagonal)
    return nn.Sequential(
        nn.Conv2d(2, 4, 2, groups=2),
        nn.Tanh(),
        nn.Conv2d(4, 3, 2),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(12, 3),
    )


class Case(NamedTuple):
    model: Callable[[], nn.Module]
    X: Callable[[], Tensor]
    y: Callable[[], Tensor]
    loss: Callable[[], nn.Module]
    diagonal: tuple  # the block names over SMALL


CASES: Dict[str, Case] = {
    "mlp-ce": Case(
        _mlp,
        lambda: torch.randn(8, 6),
        lambda: torch.randint(0, 3, (8,)),
        nn.CrossEntropyLoss,
        ("0",),
    ),
    "mlp-mse-sum": Case(
        _mlp,
        lambda: torch.randn(8, 6),
        lambda: torch.randn(8, 3),
        lambda: nn.MSELoss(reduction="sum"),
        ("0",),
    ),
    "cnn-ce": Case(
        _cnn,
        lambda: torch.randn(4, 2, 4, 4),
        lambda: torch.randint(0, 3, (4,)),
        nn.CrossEntropyLoss,
        ("2", "5"),
    ),
    "embedding-ce": Case(
        EmbedLinear,
        lambda: torch.randint(0, 12, (5, 4)),
        lambda: torch.randint(0, 2, (5,)),
        nn.CrossEntropyLoss,
        ("emb",),
    ),
    "attention-ce": Case(
        CrossAttention,
        lambda: torch.randn(4, 3, 13),
        lambda: torch.randint(0, 3, (4,)),
        nn.CrossEntropyLoss,
        ("attn.k_proj",),
    ),
}


def _build(case: Case, batches: int = 1):
    model = case.model()
    data = [(case.X(), case.y()) for _ in range(batches)]
    return model, case.loss(), data[0] if batches == 1 else data


def _flat(d: Dict[str, Tensor], names) -> Tensor:
    return torch.cat([d[n].flatten() for n in names])


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def _expected_dense(full: curvature.KFACApprox, limited: curvature.KFACApprox, diag: Tensor):
    """``full.to_dense()`` with the diagonal blocks' rows and columns replaced by ``diag``."""
    D = full.to_dense().clone()
    for b in limited.blocks:
        if isinstance(b, DiagonalBlock):
            D[b.index, :] = 0
            D[:, b.index] = 0
            D[b.index, b.index] = diag[b.index]
    return D


def _split(fn, model, loss, data, **kw):
    limited = _quiet(fn, model, loss, data, max_factor_size=SMALL, **kw)
    full = fn(model, loss, data, max_factor_size=NO_LIMIT, **kw)
    return limited, full


# -- the blocks ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("fisher", ["type-2", "empirical", "mc"])
def test_diagonal_blocks_are_the_fisher_diagonal(name, fisher):
    case = CASES[name]
    model, loss, data = _build(case)
    kw = dict(fisher=fisher, mc_samples=3, seed=4) if fisher == "mc" else dict(fisher=fisher)
    K, full = _split(curvature.kfac, model, loss, data, **kw)
    diag = _flat(curvature.diag_ggn(model, loss, data, **kw), K.param_names)
    assert sorted(K.diagonals) == sorted(case.diagonal)
    for b in K.blocks:
        if isinstance(b, DiagonalBlock):
            torch.testing.assert_close(b.d, diag[b.index], rtol=1e-10, atol=1e-12)
    # the Kronecker blocks are those of kfac() without the limit
    assert set(K.factors) | set(K.diagonals) == set(full.factors)
    assert not set(K.factors) & set(K.diagonals)
    for n, (A, G) in K.factors.items():
        torch.testing.assert_close(A, full.factors[n][0], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(G, full.factors[n][1], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", ["mlp-ce", "cnn-ce"])
def test_type2_diagonal_is_the_dense_ggn_diagonal(name):
    model, loss, data = _build(CASES[name])
    K = _quiet(curvature.kfac, model, loss, data, max_factor_size=SMALL)
    ggn = curvature.ggn(model, loss, data).diagonal()
    for b in K.blocks:
        if isinstance(b, DiagonalBlock):
            torch.testing.assert_close(b.d, ggn[b.index], rtol=1e-10, atol=1e-12)


def test_diagonals_are_laid_out_like_the_layer_matrix():
    model, loss, data = _build(CASES["embedding-ce"])
    K = _quiet(curvature.kfac, model, loss, data, max_factor_size=SMALL)
    diag = curvature.diag_ggn(model, loss, data)
    # Embedding's layer matrix is E^T [D, V]
    torch.testing.assert_close(K.diagonals["emb"], diag["emb.weight"].T)
    model, loss, data = _build(CASES["mlp-ce"])
    K = _quiet(curvature.kfac, model, loss, data, max_factor_size=SMALL)
    diag = curvature.diag_ggn(model, loss, data)
    expected = torch.cat([diag["0.weight"], diag["0.bias"].unsqueeze(1)], 1)  # [W | b]
    torch.testing.assert_close(K.diagonals["0"], expected)


@pytest.mark.parametrize("kfac_approx", ["expand", "reduce"])
def test_weight_sharing_diagonal_is_exact_for_both_approximations(kfac_approx):
    model, loss, data = _build(CASES["cnn-ce"])
    K, full = _split(curvature.kfac, model, loss, data, kfac_approx=kfac_approx)
    diag = _flat(curvature.diag_ggn(model, loss, data), K.param_names)
    torch.testing.assert_close(K.to_dense(), _expected_dense(full, K, diag))


def test_several_batches_are_weighted_like_diag_ggn():
    model, loss, data = _build(CASES["mlp-ce"], batches=3)
    K, full = _split(curvature.kfac, model, loss, data)
    diag = _flat(curvature.diag_ggn(model, loss, data), K.param_names)
    torch.testing.assert_close(K.to_dense(), _expected_dense(full, K, diag))


# -- KFACApprox methods against the dense matrix -------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("method", [curvature.kfac, curvature.ekfac], ids=["kfac", "ekfac"])
def test_methods_against_dense(name, method):
    model, loss, data = _build(CASES[name])
    K, full = _split(method, model, loss, data)
    diag = _flat(curvature.diag_ggn(model, loss, data), K.param_names)
    D = _expected_dense(full, K, diag)
    torch.testing.assert_close(K.to_dense(), D, rtol=1e-10, atol=1e-12)
    v = [torch.randn_like(p) for p in model.parameters()]
    flat_v = torch.cat([x.flatten() for x in v])
    mv = torch.cat([x.flatten() for x in K.matvec(v)])
    torch.testing.assert_close(mv, D @ flat_v, rtol=1e-10, atol=1e-12)
    lam = 0.1
    eye = torch.eye(D.shape[0])
    inv = torch.cat([x.flatten() for x in K.inverse_matvec(v, lam)])
    torch.testing.assert_close(inv, torch.linalg.solve(D + lam * eye, flat_v))
    torch.testing.assert_close(K.trace(), D.trace())
    torch.testing.assert_close(K.logdet(lam), torch.logdet(D + lam * eye))


def test_pi_damping_leaves_diagonal_blocks_exact():
    model, loss, data = _build(CASES["cnn-ce"])
    K, full = _split(curvature.kfac, model, loss, data)
    v = [torch.randn_like(p) for p in model.parameters()]
    flat_v = torch.cat([x.flatten() for x in v])
    lam = 0.05
    got = torch.cat([x.flatten() for x in K.inverse_matvec(v, lam, mode="pi")])
    expected = torch.cat([x.flatten() for x in full.inverse_matvec(v, lam, mode="pi")])
    for b in K.blocks:  # diagonal blocks: v / (d + lambda); Kronecker ones: pi as before
        if isinstance(b, DiagonalBlock):
            expected[b.index] = flat_v[b.index] / (b.d + lam)
    torch.testing.assert_close(got, expected)


# -- forward-only: the diagonal of kron(I, A) ------------------------------------------------------
@pytest.mark.parametrize("kfac_approx", ["expand", "reduce"])
def test_forward_only_diagonal_is_that_of_kron_identity_A(kfac_approx):
    model, loss, data = _build(CASES["cnn-ce"])
    K, full = _split(
        curvature.kfac, model, loss, data, fisher="forward-only", kfac_approx=kfac_approx
    )
    assert sorted(K.diagonals) == ["2", "5"]
    torch.testing.assert_close(K.to_dense(), _expected_dense(full, K, full.to_dense().diagonal()))
    A = full.factors["5"][0]
    torch.testing.assert_close(K.diagonals["5"], A.diagonal().expand(3, -1))


def test_forward_only_embedding_over_the_limit_is_reported():
    model, loss, data = _build(CASES["embedding-ce"])
    with pytest.warns(UserWarning, match=r"'emb' \(factor > max_factor_size=5, forward-only\)"):
        K = curvature.kfac(model, loss, data, fisher="forward-only", max_factor_size=SMALL)
    assert K.uncovered == ["emb.weight"] and "emb" not in K.diagonals
    with pytest.raises(ValueError, match="max_factor_size=5"):
        curvature.kfac(
            model, loss, data, fisher="forward-only", max_factor_size=SMALL, unsupported="error"
        )


# -- the warning and the argument ---------------------------------------------------------------
@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_one_warning_names_the_blocks_sizes_and_the_way_out(method):
    model, loss, data = _build(CASES["cnn-ce"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        getattr(curvature, method)(model, loss, data, max_factor_size=SMALL)
    assert len(caught) == 1, [str(w.message) for w in caught]
    msg = str(caught[0].message)
    assert msg.startswith(f"{method}(): Kronecker factors larger than max_factor_size=5 in ")
    assert "'2' (A: 17, G: 3)" in msg and "'5' (A: 13, G: 3)" in msg and "'0'" not in msg
    assert "per-sample Fisher diagonal" in msg and "Pass max_factor_size=17" in msg
    assert caught[0].filename == __file__  # attributed to the user's line


@pytest.mark.parametrize("method", [curvature.kfac, curvature.ekfac], ids=["kfac", "ekfac"])
def test_default_limit_keeps_small_models_unchanged(method):
    model, loss, data = _build(CASES["cnn-ce"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        K = method(model, loss, data)
    assert K.diagonals == {} and not any(isinstance(b, DiagonalBlock) for b in K.blocks)
    torch.testing.assert_close(
        K.to_dense(), method(model, loss, data, max_factor_size=17).to_dense()
    )


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "64", None])
@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_invalid_max_factor_size(method, bad):
    model, loss, data = _build(CASES["mlp-ce"])
    with pytest.raises(ValueError, match=rf"{method}\(max_factor_size=.*a positive int"):
        getattr(curvature, method)(model, loss, data, max_factor_size=bad)


# -- no stall ----------------------------------------------------------------------------------
def test_wide_layer_does_not_stall():
    """Linear(20000, 2): A would be 20001^2 (3.2 GB in float64); kfac + inverse in seconds."""
    model = nn.Linear(20000, 2)
    X, y = torch.randn(4, 20000), torch.randint(0, 2, (4,))
    loss = nn.CrossEntropyLoss()
    start = time.perf_counter()
    with pytest.warns(UserWarning, match=r"'<model>' \(A: 20001, G: 2\)"):
        K = curvature.kfac(model, loss, (X, y))
    v = [torch.randn_like(p) for p in model.parameters()]
    out = K.inverse_matvec(v, 1e-3)
    assert time.perf_counter() - start < 10.0
    assert K.factors == {} and all(isinstance(b, DiagonalBlock) for b in K.blocks)
    diag = curvature.diag_ggn(model, loss, (X, y))
    for o, x, name in zip(out, v, K.param_names):
        torch.testing.assert_close(o, x / (diag[name] + 1e-3))


# -- the block itself ---------------------------------------------------------------------------
def test_diagonal_block_dense_shape_and_state():
    index = torch.arange(6).view(1, 2, 3) + 10
    d = torch.rand(1, 2, 3)
    block = DiagonalBlock("fc", index, d)
    assert block.shape == (1, 2, 3) and block.index.shape == (6,) and block.d.shape == (6,)
    torch.testing.assert_close(block.dense(), torch.diag(d.flatten()))
    copy = DiagonalBlock("fc", index)
    copy.load_state_dict(block.state_dict())
    assert copy.shape == (1, 2, 3)
    torch.testing.assert_close(copy.d, block.d)


def test_the_optimizers_precondition_a_large_embedding_by_its_diagonal():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 4), nn.Flatten(), nn.Linear(12, 3)).double()
    X, y = torch.randint(0, 50, (8, 3)), torch.randint(0, 3, (8,))
    CE = nn.CrossEntropyLoss()
    with pytest.warns(UserWarning, match="max_factor_size"):
        opt = curvature.KFAC(model, lr=0.0, fisher="type-2", loss_func=CE, max_factor_size=10)
    opt.zero_grad()
    CE(model(X), y).backward()
    opt.step()
    assert "0" in opt.blocks
    got = opt.matvec([torch.ones_like(p) for p in model.parameters()])[0]
    ref = curvature.diag_ggn(model, CE, (X, y))["0.weight"]
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
