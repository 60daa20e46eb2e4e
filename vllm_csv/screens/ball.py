"""The paper's cluster ("ball") bound, faithful; and its two-sided form (tensor parallelism).

For token ``i`` in cluster ``c``: ``<w_i, h> = <mu_c, h> + <w_i - mu_c, h> <= <mu_c, h> + R_c ||h||``
(Cauchy-Schwarz), so ``z_i <= UB_c = <mu_c, h> + R_c ||h|| + bmax_c``. ``<mu_c, h>`` is
computed in fp32 with error at most ``gamma_d ||mu_c|| ||h||``, folded into the radius;
the runtime adds the relative error of the final additions. The paper's form (the default)
is one-sided (``lo = -inf``): the runtime certifies with exact logits of the clusters it
expands, in order of ``UB_c``.

Two-sided (``two_sided=True``, what the sharded head needs): Cauchy-Schwarz bounds both sides,
``|<w_i - mu_c, h>| <= ||w_i - mu_c|| ||h|| <= R_c ||h||``, so with the token's *own* bias as the
center's offset, ``y_i = <mu_c, h> + b_i``,

    ``|z_i - y_i| = |<w_i - mu_c, h>| <= R_c ||h||``  (real arithmetic),

and the computed ``fl(fl(<mu_c, h>) + b_i)`` is off by at most ``gamma_(d+2) ||mu_c|| ||h||``
(in the radius, both sides) plus one fp32 rounding of the sum (``u |y_i|``, a relative term
the runtime takes on ``|y| + |b|``, the bias being the head's own). The upper side is never
looser than the paper's (``b_i <= bmax_c``). Using ``bmax_c`` as the offset would keep the upper
side but break the lower one for every token whose bias is below its cluster's maximum
(``tests/test_tp.py`` checks that mutation is caught).
"""

from __future__ import annotations

import torch

from ..fp import FP32_UNIT_ROUNDOFF, gamma, matmul32


class BallScreen:
    name = "ball"

    def __init__(self, index, weight: torch.Tensor, bias: torch.Tensor | None, two_sided: bool = False):
        from ..errors import CSVError

        from ..index import fingerprint_weights

        V, d = weight.shape
        if index.vocab_size != V or index.hidden_size != d:
            raise CSVError(f"CSV index is for a {index.vocab_size}x{index.hidden_size} head, "
                           f"the model's is {V}x{d}; rebuild it with `vllm-csv build-index`")
        fp = fingerprint_weights(weight, bias)
        if index.fingerprint != fp:  # radii of other weights would not bound these rows
            raise CSVError(f"CSV index was built for other weights (fingerprint {index.fingerprint}, "
                           f"this head has {fp}); rebuild it with `vllm-csv build-index`")
        index.check_bounds(weight, bias)  # (and its numbers are those weights')
        dev = weight.device
        self.centroids = index.centroids.to(dev)
        mu_norm = self.centroids.double().norm(dim=1).float()
        g = gamma(d + 2)
        # hi = <mu,h> + rad * ||h|| + bmax, with rad absorbing fp error of the centroid dot product.
        self.rad = ((index.radii.to(dev) + g * (mu_norm.to(dev) + index.radii.to(dev))) * (1 + 4 * FP32_UNIT_ROUNDOFF))
        self.radius = self.rad[index.cluster_of().to(dev)]  # per token, [V]
        self.bmax = index.bias_max.to(dev)
        self.cluster_of = index.cluster_of().to(dev)
        self.two_sided = two_sided
        # the per-token constant added to y: the head's own bias (two-sided), else bmax_c
        self.offset = None if bias is None else bias.float().to(dev)
        self.offset_abs = None if two_sided else self.bmax.abs()[self.cluster_of]
        self.num_clusters = index.num_clusters
        self.extra_bytes = self.centroids.numel() * 4 + self.num_clusters * 12 + V * 8

    def center_radius(self, h: torch.Tensor):
        """One-sided: ``y = <mu_c, h> + bmax_c`` per token (``[B, V]``) and ``r = rad_c`` (``[V]``),
        ``<w_i, h> + b_i <= y_i + r_i ||h||``. Two-sided: ``y = <mu_c, h> + b_i``,
        ``|<w_i, h> + b_i - y_i| <= r_i ||h||`` (module docstring)."""
        from . import ScreenOut

        if not self.two_sided:
            yc = matmul32(h.float(), self.centroids.T) + self.bmax[None]
            return ScreenOut(yc[:, self.cluster_of], self.radius, False)
        y = matmul32(h.float(), self.centroids.T)[:, self.cluster_of]
        if self.offset is not None:
            y += self.offset[None]
        return ScreenOut(y, self.radius, True)
