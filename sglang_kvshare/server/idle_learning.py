"""The scheduler hook that runs the learner's steps while the scheduler is fully idle.

SGLang 0.5.23's event loop calls ``Scheduler.on_idle`` whenever it has no
batch to run, and ``on_idle`` calls ``maybe_sleep_on_idle`` only when nothing
runs and nothing waits (``is_fully_idle``). A BEFORE hook there runs at most
one posted learning step per pass (``learning/idle_steps.py`` says why). Not on
``on_idle`` itself: the admin metrics already hook it, and SGLang patches a
target once.

With ``learn_before_decode`` a BEFORE hook on ``Scheduler.run_batch``
also runs one posted step in front of a *decode* batch when no request waits:
under serving load the scheduler is rarely fully idle, but it decodes most of
the time, and a step there delays one decode iteration (inter-token latency)
instead of sharing the cores with a prefill (time to first token).

With ``--kvshare-pool-file`` and ``--kvshare-pool-save-interval-s``, a pass without a learning step saves
the pools when they are due (``cache.pool_persistence.PoolSaver``): a save holds the scheduler while the file
is written, and an idle scheduler delays no request.

Their targets are named in ``server/sglang_targets.py``; ``server/plugin.py`` installs them.
"""

from __future__ import annotations

from typing import Any

def _pending_steps(scheduler: Any) -> Any:
    """The idle-step handoff of this scheduler's kvshare cache when a step waits on it, else None."""
    learner = getattr(getattr(scheduler, "tree_cache", None), "learner", None)
    steps = getattr(learner, "idle_steps", None)
    return steps if steps is not None and steps.pending else None


def _run_one(steps: Any, where: str) -> None:
    import torch

    # NOTE: the scheduler loop runs under SGLang's grad mode (inference mode where supported);
    # anchors made in inference mode could not be updated in place outside it.
    with torch.inference_mode(False), torch.no_grad():
        steps.run_pending(where)


def before_sleep_on_idle(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """Run one posted learning step of this scheduler's kvshare cache, if any; else save its pools when
    ``--kvshare-pool-save-interval-s`` says they are due (``cache.pool_persistence.PoolSaver``)."""
    steps = _pending_steps(scheduler)  # the idle loop polls this many times a second: a bare check first
    if steps is not None:
        _run_one(steps, "idle")
        return None
    autosave = getattr(getattr(scheduler, "tree_cache", None), "autosave_pools", None)
    if autosave is not None:
        autosave()
    return None


def before_run_batch(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """Run one posted learning step in front of a decode batch, when no request waits for a prefill."""
    steps = _pending_steps(scheduler)
    if steps is None or getattr(scheduler, "waiting_queue", None):
        return None
    batch = args[0] if args else kwargs.get("batch")
    mode = getattr(batch, "forward_mode", None)
    if mode is not None and mode.is_decode():
        _run_one(steps, "decode")
    return None
