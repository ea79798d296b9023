"""``nn.Conv1d/2d/3d``: unfolded patches make a convolution a Linear layer shared over
output positions.

For input ``x [N, C_in, *spatial]`` and weight ``W [C_out, C_in / G, *k]``, the patch
of output position ``s`` and group ``c`` is ``a[n, s, c] in R^{C_in / G * prod(k)}``
(ordered like ``W[o].flatten()``), and ``z[n, :, s]`` of group ``c`` is ``W_c a[n, s, c]``.
Padding (numbers, ``"same"``, ``"valid"``, any ``padding_mode``), stride, dilation and
groups are handled by padding first and taking strided windows.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from .base import LinearFamilyRule
from .registry import register


def unfold_patches(module: nn.modules.conv._ConvNd, x: Tensor) -> Tensor:
    """Patches ``[N, S, G, C_in / G * prod(k)]`` of a convolution's input ``x``.

    ``S`` is the number of output positions, in the row-major order of the output.
    """
    d = len(module.kernel_size)
    if x.dim() == d + 1:
        raise ValueError(
            f"{type(module).__name__} got an unbatched input of shape {tuple(x.shape)}; "
            "per-sample quantities need a leading batch axis."
        )
    pad = module._reversed_padding_repeated_twice
    if any(pad):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, pad, mode=mode)
    N, C = x.shape[:2]
    for i in range(d):
        k, s, dil = module.kernel_size[i], module.stride[i], module.dilation[i]
        # window of extent dil * (k - 1) + 1 at every stride, then keep every dil-th entry
        x = x.unfold(2 + i, dil * (k - 1) + 1, s)[..., ::dil]
    # x: [N, C, O_1..O_d, k_1..k_d] -> [N, O_1..O_d, C, k_1..k_d]
    out_dims = list(range(2, 2 + d))
    k_dims = list(range(2 + d, 2 + 2 * d))
    x = x.permute(0, *out_dims, 1, *k_dims)
    G = module.groups
    return x.reshape(N, -1, G, (C // G) * module.weight[0, 0].numel())


@register(nn.Conv1d, nn.Conv2d, nn.Conv3d)
class ConvRule(LinearFamilyRule):
    """Convolutions as Linear layers over unfolded patches (shared over positions)."""

    def expand(self, module, call):  # noqa: D102
        a = unfold_patches(module, call.args[0])
        N, S, G, _ = a.shape
        g = call.grads[0]  # [..., N, C_out, *O]
        lead = g.shape[: g.dim() - call.args[0].dim()]
        g = g.reshape(*lead, N, G, -1, S).transpose(-1, -3).transpose(-1, -2)
        return a, g
