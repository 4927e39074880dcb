"""The correction core of the served modes: exact RoPE alignment, low-rank
anchor pools, the gate, the estimators (fullshared, kvcmas), and the plans
they return.

Torch plus ``sglang_kvshare.kernels`` (the ops layer below); no SGLang imports.
Modules, lowest first: ``rope`` -> ``low_rank`` -> ``gate`` -> ``plan`` ->
``rank_reduce`` -> ``anchor_pool`` -> ``estimators``; ``apply`` turns plans into kernel arguments
or K/V. The offline baselines (KVCOMM, ablations, CacheBlend) live in
``benchmarks/baselines.py``.
"""

from .anchor_pool import (Anchor, AnchorPool, PoolConfig, PreparedObservation, advance, observation_steps,
                          prepare_observation, run_steps)
from .apply import materialize, plan_kernel_args
from .estimators import (DEFAULT_BUDGET_BYTES, DEFAULT_MAX_SLOTS, ESTIMATORS, AnchorEstimator, Estimator,
                         FullShared, SegmentCache, anchor_factory, make_estimator)
from .gate import top_mass
from .low_rank import Factors, factor_nbytes, factorize, stack_dense, stack_factors
from .plan import MIN_GATE_ANCHORS, CorrectionPlan, EstimateResult
from .rank_reduce import GroupReducer, LocalReducer, Reducer
from .rope import RopeSpec, UnsupportedAttentionError, from_canonical, rotate_keys, to_canonical

__all__ = [
    "Anchor", "AnchorPool", "PoolConfig", "PreparedObservation", "advance", "observation_steps",
    "prepare_observation", "run_steps",
    "materialize", "plan_kernel_args",
    "DEFAULT_BUDGET_BYTES", "DEFAULT_MAX_SLOTS", "ESTIMATORS", "AnchorEstimator", "Estimator",
    "FullShared", "SegmentCache", "anchor_factory", "make_estimator",
    "top_mass",
    "Factors", "factor_nbytes", "factorize", "stack_dense", "stack_factors",
    "CorrectionPlan", "EstimateResult", "MIN_GATE_ANCHORS",
    "GroupReducer", "LocalReducer", "Reducer",
    "RopeSpec", "UnsupportedAttentionError", "from_canonical", "rotate_keys", "to_canonical",
]
