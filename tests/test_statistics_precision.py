"""KFAC(..., statistics_dtype=...): the Kronecker statistics' GEMMs in a narrower dtype.

Twins: the factors after one step are the Gram matrices of the operands rounded to the
narrower dtype (computed here in float64), to within that dtype's output rounding, and
they differ from the full-precision factors by more than the full precision's rounding
(the option is not ignored); the default path is unchanged.
"""

import pytest
import torch
from torch import nn

import curvature
from curvature.layers.precision import gram, statistics_precision

CE = nn.CrossEntropyLoss()


def one_step(model, X, y, **kw):
    opt = curvature.KFAC(model, lr=1e-2, damping=1e-2, **kw)
    opt.zero_grad()
    CE(model(X), y).backward()
    opt.step()
    return opt


def data(N=64, D=20, C=5, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = (torch.randn(N, D, generator=g) + 0.5).to(dtype)  # (a mean: a wide spectrum)
    return X, torch.randint(0, C, (N,), generator=g)


def mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 5)).to(dtype)


def rounded_gram(a, dtype):
    """``a^T a`` of ``a`` rounded to ``dtype``, summed exactly (float64)."""
    r = a.to(dtype).double()
    return r.T @ r


def test_bf16_statistics_are_the_gram_of_the_rounded_inputs():
    X, y = data()
    opt = one_step(mlp(), X, y, statistics_dtype=torch.bfloat16)
    A, _ = opt.factors()["0"]
    a = torch.cat([X, torch.ones(len(X), 1)], 1)
    twin = rounded_gram(a, torch.bfloat16) / len(X)
    assert A.dtype == torch.float32
    err = (A.double() - twin).abs().max() / twin.abs().max()
    assert err < 2.0**-7  # the result's rounding to bf16 (and float32 accumulation)
    full = one_step(mlp(), X, y).factors()["0"][0]
    exact = a.double().T @ a.double() / len(X)
    torch.testing.assert_close(full.double(), exact, rtol=1e-5, atol=1e-6)
    # the option is not ignored: far beyond float32's rounding from the full factor
    assert (A - full).abs().max() / full.abs().max() > 1e-5


def test_float32_statistics_of_a_float64_model():
    X, y = data(dtype=torch.float64)
    opt = one_step(mlp(torch.float64), X, y, statistics_dtype=torch.float32)
    A, G = opt.factors()["0"]
    assert A.dtype == G.dtype == torch.float64  # widened back: the blocks keep the model's
    a = torch.cat([X, torch.ones(len(X), 1, dtype=torch.float64)], 1)
    exact = a.T @ a / len(X)
    rel = (A - rounded_gram(a, torch.float32) / len(X)).abs().max() / exact.abs().max()
    assert rel < 1e-6
    assert (A - exact).abs().max() / exact.abs().max() > 1e-10  # not taken in float64


def test_the_default_takes_the_operands_dtype_bit_for_bit():
    X, y = data()
    a = torch.cat([X, torch.ones(len(X), 1)], 1).unsqueeze(0)
    assert torch.equal(gram(a), torch.bmm(a.mT, a))
    with statistics_precision(torch.float32):  # not narrower than float32: unchanged
        assert torch.equal(gram(a), torch.bmm(a.mT, a))
    with statistics_precision(torch.bfloat16):
        low = gram(a)
    assert low.dtype == torch.float32 and not torch.equal(low, torch.bmm(a.mT, a))
    assert torch.equal(gram(a), torch.bmm(a.mT, a))  # the context is left


def test_convolution_and_ekfac_take_the_option():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))
    X, y = torch.randn(8, 2, 6, 6) + 0.5, torch.randint(0, 3, (8,))
    for cls in (curvature.KFAC, curvature.EKFAC):
        facs = []
        for dt in (None, torch.bfloat16):
            opt = cls(net, lr=0.0, damping=1e-2, statistics_dtype=dt)  # (lr 0: same net)
            opt.zero_grad()
            CE(net(X), y).backward()
            opt.step()
            facs.append(opt.factors()["0"])
            opt.close()
        (Af, Gf), (Al, Gl) = facs
        rel = (Al - Af).abs().max() / Af.abs().max()
        assert 1e-5 < rel < 2.0**-6
        assert (Gl - Gf).abs().max() / Gf.abs().max() < 2.0**-6


def test_a_short_run_trains_as_with_full_precision_statistics():
    X, y = data(N=256)
    losses = {}
    for dt in (None, torch.bfloat16):
        model = mlp()
        opt = curvature.KFAC(model, lr=0.1, damping=1e-2, statistics_dtype=dt)
        for _ in range(30):
            opt.zero_grad()
            loss = CE(model(X), y)
            loss.backward()
            opt.step()
        with torch.no_grad():
            losses[dt] = float(CE(model(X), y))
    assert losses[torch.bfloat16] == pytest.approx(losses[None], rel=0.05)
    assert losses[torch.bfloat16] < 0.8 * float(CE(mlp()(X), y))


@pytest.mark.parametrize("bad", [torch.int8, "bfloat16", torch.complex64])
def test_a_bad_statistics_dtype_is_refused(bad):
    with pytest.raises(ValueError, match="statistics_dtype"):
        curvature.KFAC(mlp(), statistics_dtype=bad)


def test_a_device_without_wide_output_gemms_falls_back_to_the_rounded_product(monkeypatch):
    """``WIDE_OUTPUT_DEVICES`` (CUDA: a bf16 x bf16 -> float32 GEMM) on a device whose
    GEMM has no such kernel (the CPU): the rounded product, widened, as without it, and
    the device is not tried again."""
    import curvature.layers.precision as precision

    a = torch.randn(50, 7, generator=torch.Generator().manual_seed(0))
    with statistics_precision(torch.bfloat16):
        expected = gram(a)
        monkeypatch.setattr(precision, "WIDE_OUTPUT_DEVICES", ["cpu"])
        got = gram(a)
        assert precision.WIDE_OUTPUT_DEVICES == []
        again = gram(a[None])[0]
    assert got.dtype == torch.float32
    assert torch.equal(got, expected) and torch.equal(again, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_bf16_statistic_is_not_rounded_after_its_product():
    """On CUDA the bf16 operands' product comes out in float32: within float32's
    accumulation of the rounded operands' exact Gram matrix (2^-8 off without it)."""
    a = torch.randn(4096, 300, generator=torch.Generator().manual_seed(0)).add_(0.5).cuda()
    with statistics_precision(torch.bfloat16):
        got = gram(a)
    exact = rounded_gram(a, torch.bfloat16)
    err = ((got.double() - exact).abs().max() / exact.abs().max()).item()
    assert got.dtype == torch.float32 and err < 1e-5, err


def test_the_fallback_survives_an_older_torch_and_a_tuple_of_devices(monkeypatch):
    """A torch whose ``torch.mm`` takes no ``out_dtype`` (a TypeError), with the devices
    given as a tuple: the rounded product, and the device left out from then on."""
    import curvature.layers.precision as precision

    inner = torch.mm

    def old_mm(a, b, **kw):
        if kw:
            raise TypeError("mm() got an unexpected keyword argument 'out_dtype'")
        return inner(a, b)

    a = torch.randn(50, 7, generator=torch.Generator().manual_seed(1))
    with statistics_precision(torch.bfloat16):
        expected = gram(a)
        monkeypatch.setattr(precision, "WIDE_OUTPUT_DEVICES", ("cpu", "cuda"))
        monkeypatch.setattr(torch, "mm", old_mm)
        got = gram(a)
    assert torch.equal(got, expected) and list(precision.WIDE_OUTPUT_DEVICES) == ["cuda"]
