r"""Chains that warm-up left in a minor mode, found from their potentials over a window and
restarted from the other chains' points (used by :mod:`~aml_ppl.inference.chees`)."""

from __future__ import annotations

import torch

from aml_ppl.inference.hmc.integrator import Phase

# A chain whose mean potential over a warm-up window lies more than STRAY_GAP nats plus
# STRAY_SPREADS within-chain sds of the potential above the median chain's is in a minor mode.
STRAY_GAP, STRAY_SPREADS = 20.0, 4.0


class WindowPotentials:
    r"""Each chain's potential over a warm-up window, to find the chains left in a minor mode.

    A chain is *stray* when its mean potential :math:`\bar U_c` lies more than ``STRAY_GAP``
    nats plus ``STRAY_SPREADS`` within-chain sds :math:`s` (the chains' median) above the median
    chain's: its mode's density is below :math:`e^{-20}` of the main one's, so it holds no mass a
    draw should represent unless its volume is that much larger. Such chains are restarted from
    other chains' current points (``restart_stray``), as importance resampling discards the
    paths that end in minor modes before MCMC starts (Zhang, Carpenter, Gelman & Vehtari 2022,
    *Pathfinder*, §2.3)."""

    def __init__(self) -> None:
        self.count, self.sums, self.squares = 0, 0.0, 0.0

    def update(self, potential: torch.Tensor) -> None:
        self.count, self.sums, self.squares = self.count + 1, self.sums + potential, self.squares + potential.square()

    def stray(self) -> torch.Tensor:
        r"""Per chain, whether it is stray (a ``C`` mask; a chain whose potential is not finite is)."""
        means = self.sums / self.count
        finite = means.isfinite()
        if not bool(finite.any()):
            return torch.zeros_like(finite)
        spread = (self.squares / self.count - means.square())[finite].clamp_min(0).median().sqrt()
        return ~finite | (means - means[finite].median() > STRAY_GAP + STRAY_SPREADS * spread)


def restart_stray(current: Phase, stray: torch.Tensor) -> Phase:
    r"""``current`` with each ``stray`` chain moved to the point of a chain drawn uniformly from the
    others (torch's generator is drawn from only where a chain is stray)."""
    if not bool(stray.any()):
        return current
    others = (~stray).nonzero()[:, 0]
    index = torch.arange(len(stray), device=stray.device)
    index[stray] = others[torch.randint(len(others), (int(stray.sum()),), device=stray.device)]
    return Phase(current.z[index], current.r[index], current.potential[index], current.grad[index], current.velocity[index])
