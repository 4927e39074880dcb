"""Tests and benchmarks only: a kvshare server whose assembled KV for ``fault:`` slots is noise.

Why: the fidelity guard must be shown catching a scope that is served bad KV,
and no served setting produces bad KV on purpose. The fault lives here, never
in the package or its config: ``install`` wraps the assembly step
(``sglang_kvshare.cache.assemble.write_and_insert``) so that, after the
pieces are written, the rows of every shared segment whose slot name starts
with ``FAULT_PREFIX`` get their V replaced by random values eight times their
scale (a scope served them misses any target by far, so a test never hangs on
a borderline case). Unit tests call ``install`` through ``monkeypatch``;
a live server runs it in every process as::

    python -m devtools.fault_injection <sglang_kvshare.launch_server options>

(``devtools.server_process.ServerProcess(fault_injection=True)``). SGLang
starts its scheduler with ``spawn``, which imports this module again as the
child's main module, so the wrap is in place there before the cache is built.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

FAULT_PREFIX = "fault:"  # slots whose assembled KV is perturbed
COUNTER = "fault_perturbed_tokens"


def faulty(slot: Optional[str]) -> bool:
    return bool(slot) and slot.startswith(FAULT_PREFIX)


def perturb(kvcache: Any, rows: torch.Tensor) -> None:
    """Replace the V rows ``rows`` (pool slots) of every layer with noise eight times their scale."""
    from sglang_kvshare.cache.kv_pool_io import pool_layers

    idx = rows.to(torch.int64)
    for layer in pool_layers(kvcache):
        buf = kvcache.get_value_buffer(layer)
        scale = buf[idx].float().std().clamp(min=1e-3)
        buf[idx] = (torch.randn(buf[idx].shape, device=buf.device) * 8.0 * scale).to(buf.dtype)


def perturbing(write_and_insert: Callable[..., Any],
               which: Callable[[Optional[str]], bool] = faulty) -> Callable[..., Any]:
    """``write_and_insert`` followed by the perturbation of the rows it wrote for the slots ``which`` names
    (``fault:`` slots)."""

    @functools.wraps(write_and_insert)
    def wrapped(tree, spec, counters, plan, node, m, pieces, *args, **kwargs):
        last = write_and_insert(tree, spec, counters, plan, node, m, pieces, *args, **kwargs)
        if last is None:
            return last
        slots = tree.path_device_indices(last)
        pos = m
        for p in pieces:
            n = p.hi - p.lo
            if which(plan.annotation.segments[p.index].slot):
                perturb(tree.token_to_kv_pool_allocator.get_kvcache(), slots[pos:pos + n])
                counters.add(COUNTER, n)
            pos += n
        return last

    return wrapped


def install(monkeypatch: Any = None, which: Callable[[Optional[str]], bool] = faulty) -> None:
    """Wrap the assembly step (through ``monkeypatch`` when given, so a test undoes it); ``which`` names the
    slots perturbed."""
    from sglang_kvshare.cache import assemble

    wrapped = perturbing(assemble.write_and_insert, which)
    if monkeypatch is not None:
        monkeypatch.setattr(assemble, "write_and_insert", wrapped)
    else:
        assemble.write_and_insert = wrapped


if __name__ in ("__main__", "__mp_main__"):  # the launcher, and every process SGLang spawns from it
    install()
if __name__ == "__main__":
    from sglang_kvshare.server.launcher import main

    main()
