"""Curvature blocks: one type per structure, shared by the functions and the optimizers.

Each block covers a set of flat parameter positions and owns its maths: ``update``
(fold statistics into running estimates), a refresh record (:mod:`.records`),
``matvec``, ``inverse_matvec``, ``trace``, ``state_dict``. :func:`curvature.kfac`,
:func:`curvature.ekfac` and the optimizers build blocks; :mod:`.refresh` decomposes many
at once.

========================  ==========================================================
:class:`KroneckerBlock`   KFAC ``kron(G, A)``, pi or exact damping; exact small blocks
                          (``A = [[1]]``)
:class:`EigenCorrectedBlock`  EKFAC: the Kronecker eigenbasis with corrected eigenvalues
:class:`KroneckerSumBlock`    a sum of Kronecker products (terms), inverted exactly
:class:`DiagonalBlock`    a Fisher diagonal
:class:`OneSidedBlock`    ``kron(G, A)`` with a factor over ``max_factor_size`` kept as its
                          diagonal (the small one full)
========================  ==========================================================
"""

from .diagonal import DiagonalBlock
from .gather import AllBlocks, BlockGather, BlockViews, inverse_into
from .kronecker import EigenCorrectedBlock, KroneckerBlock
from .onesided import OneSidedBlock, onesided_sides, refresh_blocks
from .records import (
    CurrentFactors,
    DampedInverses,
    Eigen,
    FactorSnapshot,
    GeneralizedEigen,
    Outcome,
    Record,
    RefreshStatus,
)
from .refresh import block_state, eigendecompositions, restore_block, snapshots
from .running import ema, mean_diagonal
from .sum import KroneckerSumBlock

__all__ = [
    "AllBlocks",
    "BlockGather",
    "BlockViews",
    "CurrentFactors",
    "DampedInverses",
    "DiagonalBlock",
    "Eigen",
    "EigenCorrectedBlock",
    "FactorSnapshot",
    "GeneralizedEigen",
    "KroneckerBlock",
    "KroneckerSumBlock",
    "OneSidedBlock",
    "Outcome",
    "Record",
    "block_state",
    "refresh_blocks",
    "restore_block",
    "RefreshStatus",
    "eigendecompositions",
    "ema",
    "inverse_into",
    "mean_diagonal",
    "onesided_sides",
    "snapshots",
]
