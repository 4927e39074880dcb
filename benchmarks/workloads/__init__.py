"""The papers' multi-agent workloads, written with the client library (``sglang_kvshare.frontend``).

* ``roles``: the agents of each task (names, titles, system prompts).
* ``tasks``: GSM8K samples, answer extraction and scoring.
* ``workflows``: the topologies (chain, refer, debate) as ``sgl.function`` programs.

They live with the benchmarks, not in the library, because they are what we
measure with, not what a user imports.
"""
