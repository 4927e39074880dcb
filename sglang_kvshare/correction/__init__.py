"""The correction core: exact RoPE alignment, low-rank anchor pools, the gate,
the estimation modes (fullshared, kvcomm, kvcmas and ablations, CacheBlend),
and the plans they return.

Torch plus ``sglang_kvshare.kernels`` (the ops layer below); no SGLang imports.
Modules, lowest first: ``rope`` -> ``low_rank`` -> ``gate`` -> ``plan`` ->
``anchor_pool`` -> ``estimators``; ``apply`` turns plans into kernel arguments
or K/V; ``cacheblend`` holds the selective-recompute math.
"""

from .anchor_pool import (Anchor, AnchorPool, PoolConfig, PreparedObservation, advance, observation_steps,
                          prepare_observation, run_steps)
from .apply import materialize, plan_kernel_args
from .cacheblend import merge_rows, select_tokens, token_deviation
from .estimators import (DEFAULT_BUDGET_BYTES, DEFAULT_MAX_SLOTS, ESTIMATORS, AnchorEstimator, CacheBlend,
                         CacheBlendConfig, Estimator, FullShared, SegmentCache, make_estimator)
from .gate import top_mass
from .low_rank import Factors, factor_nbytes, factorize, stack_dense, stack_factors
from .plan import CorrectionPlan, EstimateResult
from .rope import RopeSpec, UnsupportedAttentionError, from_canonical, rotate_keys, to_canonical

__all__ = [
    "Anchor", "AnchorPool", "PoolConfig", "PreparedObservation", "advance", "observation_steps",
    "prepare_observation", "run_steps",
    "materialize", "plan_kernel_args",
    "merge_rows", "select_tokens", "token_deviation",
    "DEFAULT_BUDGET_BYTES", "DEFAULT_MAX_SLOTS", "ESTIMATORS", "AnchorEstimator", "CacheBlend",
    "CacheBlendConfig", "Estimator", "FullShared", "SegmentCache", "make_estimator",
    "top_mass",
    "Factors", "factor_nbytes", "factorize", "stack_dense", "stack_factors",
    "CorrectionPlan", "EstimateResult",
    "RopeSpec", "UnsupportedAttentionError", "from_canonical", "rotate_keys", "to_canonical",
]
