"""Client library: multi-agent sgl.function programs that mark shared segments (installed as sglang_kvshare.frontend).

Public API::

    from sglang_kvshare.frontend import KVShareEndpoint, agent, shared, workflow

``shared(text, slot=...)`` marks text many agents see, ``agent(name)`` declares
who speaks, ``workflow(name)`` names the run (the reuse scope; its requests stay
on one server behind SGLang's router); ``KVShareEndpoint(url)`` is a ``RuntimeEndpoint`` that turns the
marks into the kvshare request annotation. The workloads written with it
(roles, topologies, GSM8K tasks) live in ``benchmarks.workloads``.
"""

from sglang_kvshare.frontend.primitives import agent, shared, workflow

__all__ = ["KVShareEndpoint", "agent", "shared", "workflow"]


def __getattr__(name):  # lazy: the backend imports transformers
    if name == "KVShareEndpoint":
        from sglang_kvshare.frontend.backend import KVShareEndpoint

        return KVShareEndpoint
    raise AttributeError(name)
