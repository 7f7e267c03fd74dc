"""`eigenvalue` (legacy; removed upstream in 0.19): Hessian eigenvalues for MoQ."""

from __future__ import annotations

from ..types import Bool, Float, Int, Section, Str


class EigenvalueConfig(Section):
    enabled: Bool = False
    verbose: Bool = False
    max_iter: Int = 100
    tol: Float = 1e-2
    stability: Float = 1e-6
    gas_boundary_resolution: Int = 1
    layer_name: Str = "bert.encoder.layer"
    layer_num: Int = 0
