"""The papers' multi-agent workloads, written with the client library (``sglang_kvshare.frontend``).

* ``roles``: the agents of each task (names, titles, system prompts).
* ``tasks``: GSM8K samples, answer extraction and scoring.
* ``role_set``: 24 role prompts in development and held-out halves.
* ``retrieval``: the lookup workload (a shared document of facts).

The topologies as ``sgl.function`` programs (chain, refer, debate) are the frontend's
server tests (``tests/frontend/workflows.py``).

They live with the benchmarks, not in the library, because they are what we
measure with, not what a user imports.
"""
