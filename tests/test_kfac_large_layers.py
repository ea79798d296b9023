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

import copy
import time
import warnings
from typing import Callable, Dict, NamedTuple

import pytest
import torch
from torch import Tensor, nn

import curvature
from curvature.blocks import DiagonalBlock, OneSidedBlock

pytestmark = pytest.mark.usefixtures("float64_seeded")

SMALL = 5  # max_factor_size of the tests: some blocks of each model are over it
NO_LIMIT = 10**6
OLD = dict(large_factors="per_sample_diagonal")  # the per-sample diagonal of large blocks


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
    limited = _quiet(fn, model, loss, data, max_factor_size=SMALL, **OLD, **kw)
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
    K = _quiet(curvature.kfac, model, loss, data, max_factor_size=SMALL, **OLD)
    ggn = curvature.ggn(model, loss, data).diagonal()
    for b in K.blocks:
        if isinstance(b, DiagonalBlock):
            torch.testing.assert_close(b.d, ggn[b.index], rtol=1e-10, atol=1e-12)


def test_diagonals_are_laid_out_like_the_layer_matrix():
    model, loss, data = _build(CASES["embedding-ce"])
    K = _quiet(curvature.kfac, model, loss, data, max_factor_size=SMALL, **OLD)
    diag = curvature.diag_ggn(model, loss, data)
    # Embedding's layer matrix is E^T [D, V]
    torch.testing.assert_close(K.diagonals["emb"], diag["emb.weight"].T)
    model, loss, data = _build(CASES["mlp-ce"])
    K = _quiet(curvature.kfac, model, loss, data, max_factor_size=SMALL, **OLD)
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
        getattr(curvature, method)(model, loss, data, max_factor_size=SMALL, **OLD)
    assert len(caught) == 1, [str(w.message) for w in caught]
    msg = str(caught[0].message)
    assert msg.startswith(f"{method}(): Kronecker factors larger than max_factor_size=5 in ")
    assert "'2' (A: 17, G: 3)" in msg and "'5' (A: 13, G: 3)" in msg and "'0'" not in msg
    assert "per-sample Fisher diagonal" in msg and "Pass max_factor_size=17" in msg
    assert caught[0].filename == __file__  # attributed to the user's line
    with pytest.warns(UserWarning, match=r"that factor diagonal \(OneSidedBlock\)"):
        getattr(curvature, method)(model, loss, data, max_factor_size=SMALL)


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
        K = curvature.kfac(model, loss, (X, y), **OLD)
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


def test_the_optimizers_precondition_a_large_embedding_by_its_per_sample_diagonal():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 4), nn.Flatten(), nn.Linear(12, 3)).double()
    X, y = torch.randint(0, 50, (8, 3)), torch.randint(0, 3, (8,))
    CE = nn.CrossEntropyLoss()
    with pytest.warns(UserWarning, match="max_factor_size"):
        opt = curvature.KFAC(
            model,
            lr=0.0,
            fisher="type-2",
            loss_func=CE,
            max_factor_size=10,
            large_factors="per_sample_diagonal",
        )
    opt.zero_grad()
    CE(model(X), y).backward()
    opt.step()
    assert "0" in opt.blocks
    got = opt.matvec([torch.ones_like(p) for p in model.parameters()])[0]
    ref = curvature.diag_ggn(model, CE, (X, y))["0.weight"]
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


# -- OneSidedBlock: the small factor full, the large one diagonal (the optimizers' default) ------
def _one_step(model, loss, X, y, **kwargs):
    opt = _quiet(curvature.KFAC, model, lr=0.0, loss_func=loss, **kwargs)
    opt.zero_grad()
    loss(model(X), y).backward()
    opt.step()
    return opt


def _as_groups(t: Tensor) -> Tensor:
    return t if t.dim() == 3 else t.unsqueeze(0)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("fisher", ["empirical", "type-2"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_one_sided_block_is_kfac_with_the_large_factor_made_diagonal(case, fisher, approx):
    """``kron(diag(G), A)`` (or ``kron(G, diag(A))``) of KFAC's own factors, never formed."""
    model, loss, (X, y) = _build(CASES[case])
    full = _one_step(copy.deepcopy(model), loss, X, y, fisher=fisher, kfac_approx=approx)
    small = _one_step(model, loss, X, y, fisher=fisher, kfac_approx=approx, max_factor_size=SMALL)
    ref = full.factors()
    for name in CASES[case].diagonal:
        block = small.blocks[name]
        assert isinstance(block, OneSidedBlock)
        A, G = (_as_groups(t) for t in ref[name])
        assert (block.full_A, block.full_G) == (A.shape[-1] <= SMALL, G.shape[-1] <= SMALL)
        A = A if block.full_A else torch.diag_embed(A.diagonal(dim1=-2, dim2=-1))
        G = G if block.full_G else torch.diag_embed(G.diagonal(dim1=-2, dim2=-1))
        expected = torch.stack([torch.kron(g, a) for g, a in zip(G, A)])
        torch.testing.assert_close(block.dense(), expected, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(block.trace(), expected.diagonal(dim1=-2, dim2=-1).sum())
    for name, factors in small.factors().items():  # the small blocks are unchanged
        for got, want in zip(factors, ref[name]):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_on_one_datum_both_diagonal_factors_give_the_exact_fisher_diagonal():
    """One sample, one vector: ``grad = g a^T``, so ``diag(g g^T) x diag(a a^T)`` is exact."""
    model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 3))
    loss, X, y = nn.CrossEntropyLoss(), torch.randn(1, 6), torch.tensor([2])
    one = _one_step(copy.deepcopy(model), loss, X, y, max_factor_size=SMALL)
    old = _one_step(model, loss, X, y, max_factor_size=SMALL, large_factors="per_sample_diagonal")
    block = one.blocks["0"]
    assert (block.full_A, block.full_G) == (False, False)
    torch.testing.assert_close(block.dense()[0], torch.diag(old.blocks["0"].d), rtol=1e-12, atol=0)
    # the diagonal factors are the diagonals of KFAC's full factors
    A, G = _one_step(model, loss, X, y).factors()["0"]
    torch.testing.assert_close(block.G[0], G.diagonal(), rtol=1e-12, atol=0)
    torch.testing.assert_close(block.A[0], A.diagonal(), rtol=1e-12, atol=0)


def _random_block(full_A: bool, full_G: bool, C: int = 2, D: int = 4, D_out: int = 3):
    def psd(n, full):
        X = torch.randn(C, n, 2 * n)
        M = X @ X.mT / (2 * n)
        return M if full else M.diagonal(dim1=-2, dim2=-1).clone()

    index = torch.arange(C * D_out * D).view(C, D_out, D)
    block = OneSidedBlock("b", index, full_A, full_G)
    block.update(psd(D, full_A), psd(D_out, full_G))
    return block


SIDES = [(True, False), (False, True), (False, False), (True, True)]


@pytest.mark.parametrize("sides", SIDES, ids=lambda s: f"full_A={s[0]}-full_G={s[1]}")
def test_one_sided_products_match_the_dense_block(sides):
    block = _random_block(*sides)
    M = torch.randn(block.shape)
    dense = block.dense()
    C, n = dense.shape[0], dense.shape[1]
    eye = torch.eye(n)
    want = (dense @ M.reshape(C, n, 1)).view(M.shape)
    torch.testing.assert_close(block.matvec(M), want)
    lam = 0.3
    want = torch.linalg.solve(dense + lam * eye, M.reshape(C, n, 1)).view(M.shape)
    torch.testing.assert_close(block.inverse_matvec(M, lam, "exact"), want)
    torch.testing.assert_close(block.logdet(lam), torch.logdet(dense + lam * eye).sum())
    # pi damping: (G + sqrt(lam)/pi I) x (A + pi sqrt(lam) I), pi from the mean diagonals
    A = block.A if block.full_A else torch.diag_embed(block.A)
    G = block.G if block.full_G else torch.diag_embed(block.G)
    mA = A.diagonal(dim1=-2, dim2=-1).mean(-1)
    mG = G.diagonal(dim1=-2, dim2=-1).mean(-1)
    pi = (mA / mG).sqrt()
    damped = []
    for c in range(C):
        Ad = A[c] + pi[c] * lam**0.5 * torch.eye(A.shape[-1])
        Gd = G[c] + lam**0.5 / pi[c] * torch.eye(G.shape[-1])
        damped.append(torch.kron(Gd, Ad))
    want = torch.linalg.solve(torch.stack(damped), M.reshape(C, n, 1)).view(M.shape)
    torch.testing.assert_close(block.inverse_matvec(M, lam, "pi"), want)


@pytest.mark.parametrize("sides", SIDES, ids=lambda s: f"full_A={s[0]}-full_G={s[1]}")
def test_one_sided_per_factor_damping_matches_the_dense_damped_factors(sides):
    """``damping_mode="per_factor"``: ``(G + lambda I) x (A + lambda I)`` (not exact)."""
    block = _random_block(*sides)
    M = torch.randn(block.shape)
    C, lam = block.shape[0], 0.3
    A = block.A if block.full_A else torch.diag_embed(block.A)
    G = block.G if block.full_G else torch.diag_embed(block.G)
    damped = torch.stack(
        [
            torch.kron(G[c] + lam * torch.eye(G.shape[-1]), A[c] + lam * torch.eye(A.shape[-1]))
            for c in range(C)
        ]
    )
    n = damped.shape[-1]
    want = torch.linalg.solve(damped, M.reshape(C, n, 1)).view(M.shape)
    torch.testing.assert_close(block.inverse_matvec(M, lam, "per_factor"), want)


def test_one_sided_block_state_round_trip_and_running_average():
    block = _random_block(True, False)
    A0, G0 = block.A.clone(), block.G.clone()
    A1, G1 = _random_block(True, False).A, _random_block(True, False).G
    block.update(A1, G1, decay=0.9)
    torch.testing.assert_close(block.A, 0.9 * A0 + 0.1 * A1)
    torch.testing.assert_close(block.G, 0.9 * G0 + 0.1 * G1)
    block.update(A1 * 0, G1 * 0, decay=0.9, valid=torch.tensor(False))  # skipped: zeros
    torch.testing.assert_close(block.A, 0.9 * A0 + 0.1 * A1)  # invalid: unchanged
    M = torch.randn(block.shape)
    block.refresh()
    copy_ = OneSidedBlock("b", block.index, True, False)
    copy_.load_state_dict(block.state_dict())
    assert torch.equal(copy_.inverse_matvec(M, 0.1), block.inverse_matvec(M, 0.1))
    with pytest.raises(ValueError, match="full"):
        OneSidedBlock("b", block.index, False, False).load_state_dict(block.state_dict())


def _token_lm():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(30, 6), nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 30)
    )  # max_factor_size 8: emb (diag A, full G), "1" (full A, diag G), "3" (both diagonal)


def _lm_data(seed):
    g = torch.Generator().manual_seed(seed)
    X = torch.randint(0, 30, (8, 5), generator=g)
    return X, (7 * X + 3) % 30  # a token map to learn


def _lm_steps(model, opt, steps, start=0):
    losses = []
    for i in range(start, start + steps):
        X, y = _lm_data(i % 4)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(X).transpose(1, 2), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("cls", [curvature.KFAC, curvature.EKFAC])
@pytest.mark.parametrize("damping_mode", ["pi", "exact"])
def test_the_optimizers_train_with_one_sided_blocks_and_resume_bit_identically(cls, damping_mode):
    model = _token_lm()
    kw = dict(lr=0.1, damping=1e-2, max_factor_size=8, inverse_every=3, damping_mode=damping_mode)
    with pytest.warns(UserWarning, match="OneSidedBlock"):
        opt = cls(model, **kw)
    losses = _lm_steps(model, opt, 20)
    assert losses[-1] < 0.7 * losses[0]
    kinds = {n: type(b).__name__ for n, b in opt.blocks.items()}
    assert kinds == {"0": "OneSidedBlock", "1": "OneSidedBlock", "3": "OneSidedBlock"}
    sides = {n: (b.full_A, b.full_G) for n, b in opt.blocks.items()}
    assert sides == {"0": (False, True), "1": (True, False), "3": (False, False)}
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    after = _lm_steps(model, opt, 4, start=20)
    twin = _token_lm()
    twin.load_state_dict(saved[0])
    twin_opt = _quiet(cls, twin, **kw)
    twin_opt.load_state_dict(saved[1])
    assert _lm_steps(twin, twin_opt, 4, start=20) == after
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    # a state of the other structure is refused, naming the option
    other = _quiet(cls, _token_lm(), **kw, large_factors="per_sample_diagonal")
    with pytest.raises(ValueError, match="large_factors='diagonal_factor'"):
        other.load_state_dict(saved[1])
    twin = _token_lm()
    other = _quiet(cls, twin, **kw, large_factors="per_sample_diagonal")
    _lm_steps(twin, other, 2)
    with pytest.raises(ValueError, match="large_factors='per_sample_diagonal'"):
        opt.load_state_dict(other.state_dict())


def test_large_factors_is_checked():
    with pytest.raises(ValueError, match="large_factors"):
        curvature.KFAC(_token_lm(), large_factors="low-rank")


@pytest.mark.parametrize("inverse_every", [1000, 1])
@pytest.mark.parametrize("cls", [curvature.KFAC, curvature.EKFAC])
def test_one_sided_steps_keep_the_host_reads_of_a_step(cls, inverse_every):
    from test_optim_syncs import reads_per_step

    count, where = reads_per_step(cls, max_factor_size=5, inverse_every=inverse_every)
    assert count <= (0 if inverse_every > 1 else 2), dict(where)


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
@pytest.mark.parametrize("fisher", ["type-2", "empirical", "mc"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kfac_one_sided_blocks_are_the_full_factors_with_the_large_one_diagonal(
    case, fisher, method
):
    model, loss, data = _build(CASES[case])
    kw = dict(fisher=fisher, mc_samples=3, seed=4) if fisher == "mc" else dict(fisher=fisher)
    fn = getattr(curvature, method)
    K = _quiet(fn, model, loss, data, max_factor_size=SMALL, **kw)
    ref = curvature.kfac(model, loss, data, max_factor_size=NO_LIMIT, **kw).factors
    assert K.diagonals == {}
    sided = {b.name: b for b in K.blocks if isinstance(b, OneSidedBlock)}
    assert sorted(sided) == sorted(CASES[case].diagonal)
    for b in K.blocks:
        if b.name in sided:
            A, G = (_as_groups(t) for t in ref[b.name])
            A = A if b.full_A else torch.diag_embed(A.diagonal(dim1=-2, dim2=-1))
            G = G if b.full_G else torch.diag_embed(G.diagonal(dim1=-2, dim2=-1))
            want = torch.stack([torch.kron(g, a) for g, a in zip(G, A)])
            torch.testing.assert_close(b.dense(), want, rtol=1e-10, atol=1e-13)
    # the approximation's methods on the dense matrix
    D = K.to_dense()
    v = [torch.randn_like(p) for p in model.parameters()]
    flat = torch.cat([t.flatten() for t in v])
    got = torch.cat([t.flatten() for t in K.matvec(v)])
    torch.testing.assert_close(got, D @ flat)
    if method == "kfac":  # EKFAC's other blocks are corrected: exact inverse only there
        got = torch.cat([t.flatten() for t in K.inverse_matvec(v, 0.1)])
        torch.testing.assert_close(got, torch.linalg.solve(D + 0.1 * torch.eye(len(D)), flat))
        torch.testing.assert_close(K.logdet(0.1), torch.logdet(D + 0.1 * torch.eye(len(D))))
    torch.testing.assert_close(K.trace(), D.trace())


def test_a_one_sided_block_without_finite_statistics_passes_the_gradient_until_a_refresh():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 3))
    CE = nn.CrossEntropyLoss()
    opt = _quiet(curvature.KFAC, model, lr=0.1, max_factor_size=SMALL, inverse_every=3)
    X, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    bad = X.clone()
    bad[0, 0] = float("nan")
    for i, data in enumerate([bad, X, X, X]):
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        CE(model(data), y).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        _quiet(opt.step)
        moved = [b - p.detach() for b, p in zip(before, model.parameters())]
        if i == 1:  # finite statistics, no refresh since: the plain gradient
            for m, g in zip(moved, grads):
                torch.testing.assert_close(m, 0.1 * g)
        if i == 3:  # refreshed at step 3: preconditioned
            assert not torch.allclose(moved[0], 0.1 * grads[0])
            assert opt.blocks["0"].record is not None
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("method", ["kfac"])  # ekfac() reads 5 times already without them
def test_kfac_with_one_sided_blocks_keeps_its_host_reads(method):
    from test_optim_syncs import CE as ce
    from test_optim_syncs import HostReads, mlp

    model = mlp(3)
    X, y = torch.randn(5, 6), torch.randint(0, 4, (5,))
    with HostReads() as reads:
        K = _quiet(getattr(curvature, method), model, ce, (X, y), max_factor_size=SMALL)
    assert any(isinstance(b, OneSidedBlock) for b in K.blocks)
    assert reads.count <= 2, dict(reads.where)
