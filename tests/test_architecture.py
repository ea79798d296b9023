"""Architecture rules of the ``curvature`` package, checked on its source (``ast``, no import).

(a) no module over :data:`MAX_LINES` lines; (b) no access to a private member of another
object (``obj._x`` where ``obj`` is not ``self`` / ``cls``), except the torch internals in
:data:`TORCH_PRIVATE`; (c) no import of a private name across the package's modules;
(d) ``curvature/capture.py`` (every hook, knowing no feature) imports nothing from
``curvature.laplacian``. Each check reports every offending ``file:line``.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Iterator, List, Tuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "curvature"
MAX_LINES = 600

#: Private attributes of torch objects that have no public equivalent; ``obj._x`` with
#: one of these names is allowed whatever ``obj`` is. Only torch's names belong here.
TORCH_PRIVATE = frozenset(
    {
        # tensors: the in-place version counter and view bookkeeping
        "_version",  # Tensor._version: detects in-place changes of a saved tensor
        "_base",  # Tensor._base: the tensor a view was taken of
        "_is_view",  # Tensor._is_view()
        # module classes without a public base class
        "_ConvNd",  # torch.nn.modules.conv._ConvNd: every ConvNd / ConvTransposeNd
        "_BatchNorm",  # torch.nn.modules.batchnorm._BatchNorm: BatchNorm1d/2d/3d
        # attributes of torch modules that their forward uses
        "_qkv_same_embed_dim",  # nn.MultiheadAttention: one in_proj_weight or three
        "_reversed_padding_repeated_twice",  # nn.ConvNd with padding_mode != "zeros"
        # autograd graph nodes
        "_saved_result1",  # the saved mean of a native batch/layer norm backward node
        "_saved_result2",  # the saved inverse std of that node
        "_input_metadata",  # a node's input shapes / dtypes
        # the C++ functional ops (no public Python binding with the same semantics)
        "_C",  # torch._C
        # whether a torch.func transform (vmap, grad, jvp) is active: the forward Laplacian's
        # fused autograd function has no vmap rule, so it steps aside under one
        "_are_functorch_transforms_active",  # torch._C._are_functorch_transforms_active()
        "_nn",  # torch._C._nn
        # whether a gradient is a batched tensor of vmap / is_grads_batched (no public test)
        "_functorch",  # torch._C._functorch.is_batchedtensor / is_legacy_batchedtensor
        # which backward pass a gradient belongs to (an autograd.grad pass never commits)
        "_current_graph_task_id",  # torch._C._current_graph_task_id()
        # GradScaler's scale tensor (get_scale() reads it on the host: a synchronization)
        "_get_scale_async",  # torch.amp.GradScaler._get_scale_async()
        # a module's own parameter and child dicts, compared by identity at every step
        # (curvature.optim.watch; named_parameters() walks the tree with generators, 5x
        # the time, and has no "unchanged since" test)
        "_parameters",  # nn.Module._parameters (its "_modules" is listed below)
        # module hook dictionaries (registered hooks have no public listing)
        "_forward_hooks",  # nn.Module._forward_hooks
        "_forward_pre_hooks",  # nn.Module._forward_pre_hooks
        "_global_forward_hooks",  # torch.nn.modules.module._global_forward_hooks
        "_global_forward_pre_hooks",  # torch.nn.modules.module._global_forward_pre_hooks
        "_backward_hooks",  # nn.Module._backward_hooks
        "_backward_pre_hooks",  # nn.Module._backward_pre_hooks
        "_global_backward_hooks",  # torch.nn.modules.module._global_backward_hooks
        "_global_backward_pre_hooks",  # torch.nn.modules.module._global_backward_pre_hooks
        "_modules",  # nn.Module._modules: the children dict, set in place
        # torch.compile's wrapper (OptimizedModule) exposes the compiled model only here
        "_orig_mod",  # OptimizedModule._orig_mod: the model torch.compile wrapped
        # multi-tensor kernels (torch.optim's foreach path): one launch for many tensors
        "_foreach_mul",  # torch._foreach_mul
        "_foreach_mul_",  # torch._foreach_mul_
        "_foreach_add_",  # torch._foreach_add_
        "_foreach_div",  # torch._foreach_div (statistics normalized in one call)
        "_foreach_div_",  # torch._foreach_div_ (the same, in place)
        "_foreach_lerp_",  # torch._foreach_lerp_ (the running averages in one call)
        "_foreach_norm",  # torch._foreach_norm (finiteness of many tensors in one call)
        "_foreach_copy_",  # torch._foreach_copy_ (the gradients into one buffer, one call)
        "_foreach_maximum",  # torch._foreach_maximum (the flags of a contribution's values)
        "_foreach_add",  # torch._foreach_add (the damped diagonals of all blocks, one call)
    }
)


def _private(name: str) -> bool:
    """``_x`` and ``__x`` are private; dunders (``__x__``) are not."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def sources() -> Iterator[Tuple[str, str, ast.Module]]:
    """``(path relative to the repository, source, tree)`` of every module of the package."""
    files = sorted(PACKAGE.rglob("*.py"))
    if not files:
        pytest.skip(f"no package sources under {PACKAGE.name}/")
    for f in files:
        src = f.read_text(encoding="utf-8")
        yield f.relative_to(ROOT).as_posix(), src, ast.parse(src, filename=str(f))


def resolve(rel: str, node: ast.ImportFrom) -> str:
    """The absolute module of a ``from ... import`` in the package module at ``rel``."""
    if not node.level:
        return node.module or ""
    package = rel[: -len(".py")].split("/")[:-1]  # "curvature/optim/base.py" -> curvature.optim
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


# -- the checks (each returns its offending "file:line: what") -----------------------------------
def oversized(rel: str, src: str) -> List[str]:
    n = len(src.splitlines())
    return [f"{rel}: {n} lines (at most {MAX_LINES})"] if n > MAX_LINES else []


def private_accesses(rel: str, tree: ast.AST) -> List[str]:
    """``obj._x`` with ``obj`` not ``self`` / ``cls`` / ``super()``, ``_x`` not in torch's list."""
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        v = node.value
        if isinstance(v, ast.Name) and v.id in ("self", "cls"):
            continue
        if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
            continue
        if node.attr in TORCH_PRIVATE:
            continue
        out.append((node.lineno, f"{rel}:{node.lineno}: private access {ast.unparse(node)}"))
    return [o for _, o in sorted(out)]


def private_imports(rel: str, tree: ast.AST) -> List[str]:
    """``from .x import _y`` / ``from curvature.x import _y`` / ``from . import _y``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = resolve(rel, node)
            if module.split(".")[0] != "curvature":
                continue
            for alias in node.names:
                if _private(alias.name):
                    out.append(
                        f"{rel}:{node.lineno}: imports private {alias.name} from "
                        f"{'.' * node.level}{node.module or ''}"
                    )
    return out


def laplacian_imports(rel: str, tree: ast.AST) -> List[str]:
    """Any import of ``curvature.laplacian`` (or a name from it), lazy ones included."""
    target = "curvature.laplacian"

    def hits(module: str) -> bool:
        return module == target or module.startswith(target + ".")

    out = []
    for node in ast.walk(tree):
        found = None
        if isinstance(node, ast.ImportFrom):
            module = resolve(rel, node)
            names = [f"{module}.{a.name}" for a in node.names]
            if hits(module) or any(hits(n) for n in names):
                found = ast.unparse(node)
        elif isinstance(node, ast.Import):
            if any(hits(a.name) for a in node.names):
                found = ast.unparse(node)
        elif isinstance(node, ast.Constant) and node.value in (target, ".laplacian"):
            found = f"the module name {node.value!r} (importlib?)"
        if found:
            out.append(f"{rel}:{node.lineno}: {found}")
    return out


def _report(what: str, offending: List[str]) -> str:
    return f"{len(offending)} {what}:\n" + "\n".join(offending)


# -- the rules -------------------------------------------------------------------------------------
def test_no_module_over_600_lines():
    offending = [o for rel, src, _ in sources() for o in oversized(rel, src)]
    assert not offending, _report(f"modules over {MAX_LINES} lines", offending)


def test_no_private_member_access_of_other_objects():
    offending = [o for rel, _, tree in sources() for o in private_accesses(rel, tree)]
    assert not offending, _report(
        "accesses to private members of other objects (torch internals without a public "
        "equivalent go to TORCH_PRIVATE, with a comment)",
        offending,
    )


def test_no_private_name_imported_across_modules():
    offending = [o for rel, _, tree in sources() for o in private_imports(rel, tree)]
    assert not offending, _report("imports of private names across modules", offending)


def test_only_linalg_calls_torch_linalg():
    """One module owns every ``torch.linalg`` call (the numerics policy in one place)."""
    offenders = [
        str(path.relative_to(PACKAGE.parent))
        for path in PACKAGE.rglob("*.py")
        if path.name != "linalg.py" and "torch.linalg." in path.read_text()
    ]
    assert not offenders, offenders


def test_capture_does_not_import_laplacian():
    (found,) = [(rel, tree) for rel, _, tree in sources() if rel == "curvature/capture.py"]
    offending = laplacian_imports(*found)
    assert not offending, _report("imports of curvature.laplacian in capture.py", offending)


# -- the checks catch what they should -------------------------------------------------------------
@pytest.mark.parametrize(
    "code,flagged",
    [
        ("cap._active()", True),
        ("self._capture._recording = False", True),
        ("view[1]._owner", True),
        ("self._x; cls._y; super()._z()", False),
        ("t._version; torch._C._nn.gelu; nn.modules.conv._ConvNd", False),
        ("x.__class__; x.public", False),
    ],
)
def test_private_access_check(code, flagged):
    assert bool(private_accesses("curvature/m.py", ast.parse(code))) is flagged


@pytest.mark.parametrize(
    "rel,code,flagged",
    [
        ("curvature/optim/kfac.py", "from ..kfac import _exact_index", True),
        ("curvature/optim/kfac.py", "from .base import CurvatureOptimizer, _put", True),
        ("curvature/capture.py", "from . import _memory", True),
        ("curvature/x.py", "from curvature.linalg import _eigh", True),
        ("curvature/x.py", "def f():\n    from .linalg import _eigh", True),
        ("curvature/x.py", "from .linalg import eigh\nfrom torch.utils._pytree import x", False),
        ("curvature/x.py", "from __future__ import annotations", False),
    ],
)
def test_private_import_check(rel, code, flagged):
    assert bool(private_imports(rel, ast.parse(code))) is flagged


@pytest.mark.parametrize(
    "code,flagged",
    [
        ("from .laplacian import current_slots", True),
        ("from . import laplacian", True),
        ("def f():\n    from curvature.laplacian import x", True),
        ("import curvature.laplacian", True),
        ("importlib.import_module('curvature.laplacian')", True),
        ("from .layers import Call\nfrom .laplacian_free import y", False),
    ],
)
def test_laplacian_import_check(code, flagged):
    assert bool(laplacian_imports("curvature/capture.py", ast.parse(code))) is flagged
