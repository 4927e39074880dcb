"""The correction core: exact RoPE alignment, low-rank anchor pools, the gate,
and the estimation modes (fullshared, kvcomm, kvcmas and ablations, CacheBlend).

Torch only; no SGLang imports. Layers, lowest first:
``rope`` -> ``low_rank`` -> ``gate`` -> ``anchor_pool`` -> ``estimators``;
``cacheblend`` holds the selective-recompute math.
"""

from .anchor_pool import Anchor, AnchorPool, EstimateResult, PoolConfig
from .cacheblend import merge_rows, select_tokens, token_deviation
from .estimators import (ESTIMATORS, AnchorEstimator, CacheBlend, CacheBlendConfig, Estimator, FullShared,
                         SegmentCache, make_estimator)
from .gate import gate_weights, normalized_entropy, token_weights, top_mass
from .low_rank import Factors, factor_nbytes, factorize
from .rope import RopeSpec, UnsupportedAttentionError, from_canonical, rotate_keys, to_canonical

__all__ = [
    "Anchor", "AnchorPool", "EstimateResult", "PoolConfig",
    "merge_rows", "select_tokens", "token_deviation",
    "ESTIMATORS", "AnchorEstimator", "CacheBlend", "CacheBlendConfig", "Estimator", "FullShared",
    "SegmentCache", "make_estimator",
    "gate_weights", "normalized_entropy", "token_weights", "top_mass",
    "Factors", "factor_nbytes", "factorize",
    "RopeSpec", "UnsupportedAttentionError", "from_canonical", "rotate_keys", "to_canonical",
]
