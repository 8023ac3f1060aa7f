"""Binding a BellowsKV policy's latent (:class:`~pask.kv.latent.LatentSpec`) to the loaded model."""

from __future__ import annotations

import dataclasses

from pask.kv.config import CacheConfig
from pask.kv.latent import LatentTier
from pask.policies.base import Policy
from pask.runtime.models import LoadedModel


def with_latent(config: CacheConfig, policy: Policy, lm: LoadedModel) -> CacheConfig:
    """``config`` as a latent cache when ``policy`` keeps BellowsKV latents (its ``latent``): the
    projections checked against the model's fingerprint and shapes, bound to it (capture hooks,
    RoPE), one layer group per latent block. Unchanged otherwise."""
    spec = policy.latent
    if spec is None:
        return config
    tier = LatentTier.bind(spec.projections, lm.model, spec.bits, lm.fingerprint, config.quant_group)
    return dataclasses.replace(config, latent=tier, num_groups=len(tier.groups))


def same_latent(config: CacheConfig, policy: Policy) -> bool:
    """Whether ``policy`` runs on a cache built as ``config``: both without a latent tier, or the
    same projections at the same width."""
    spec, tier = policy.latent, config.latent
    if spec is None or tier is None:
        return spec is None and tier is None
    return spec.projections is tier.projections and spec.bits == tier.bits
