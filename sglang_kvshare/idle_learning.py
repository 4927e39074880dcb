"""The scheduler hook that runs the learner's steps while the scheduler is fully idle.

SGLang 0.5.23's event loop calls ``Scheduler.on_idle`` whenever it has no
batch to run, and ``on_idle`` calls ``maybe_sleep_on_idle`` only when nothing
runs and nothing waits (``is_fully_idle``). A BEFORE hook there runs at most
one posted learning step per pass (``cache/idle_steps.py`` says why). Not on
``on_idle`` itself: the admin metrics already hook it, and SGLang patches a
target once.

Everything that names an SGLang scheduler symbol for idle learning is in this module.
"""

from __future__ import annotations

from typing import Any

IDLE_TARGET = "sglang.srt.managers.scheduler.Scheduler.maybe_sleep_on_idle"


def before_sleep_on_idle(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """Run one posted learning step of this scheduler's kvshare cache, if any."""
    learner = getattr(getattr(scheduler, "tree_cache", None), "learner", None)
    steps = getattr(learner, "idle_steps", None)
    if steps is None or not steps.pending:  # the idle loop polls this many times a second
        return None
    import torch

    # NOTE: on_idle runs under SGLang's grad mode (inference mode where supported);
    # anchors made in inference mode could not be updated in place outside it.
    with torch.inference_mode(False), torch.no_grad():
        steps.run_pending()
    return None


_registered = False


def register() -> None:
    """Install the hook (idempotent); called by the cache factory in the scheduler process."""
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(IDLE_TARGET, before_sleep_on_idle, HookType.BEFORE)
    HookRegistry.apply_hooks()
    _registered = True
