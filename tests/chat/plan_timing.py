"""Time the automatic chat plan against stock SGLang's render + encode, on the real tokenizer (no server).

Why: the plan runs on the HTTP process before SGLang checks the context
length, so its cost must stay proportional to what stock itself spends on a
chat. ``python -m tests.chat.plan_timing 500 1000 2000 4000`` prints, per chat
length, the best of a few runs of each; ``test_render.py`` asserts the bound.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable


def long_chat(n: int) -> list[dict[str, Any]]:
    """A system prompt and ``n`` alternating user / assistant messages ``m<i>``, ending with a user one."""
    roles = ("user", "assistant") if n % 2 else ("assistant", "user")
    return [{"role": "system", "content": "You are a helpful assistant."}] + [
        {"role": roles[i % 2], "content": f"m{i}"} for i in range(n)]


def _best(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def measure(tokenizer, n: int, repeat: int = 3) -> tuple[float, float]:
    """(stock render + encode, auto plan) seconds for an ``n``-message chat, best of ``repeat``."""
    from sglang_kvshare.chat import hooks
    from sglang_kvshare.chat.outputs import OutputMemory
    from sglang_kvshare.config import KVShareConfig

    render, tokenize = hooks.template_fns(tokenizer, {})
    messages = long_chat(n)
    stock_s, stock_ids = _best(lambda: tokenizer.encode(render(messages), add_special_tokens=False), repeat)
    saved = hooks.live_config, hooks.outputs
    hooks.live_config, hooks.outputs = (lambda: KVShareConfig(mode="fullshared", auto=True)), OutputMemory()
    try:
        plan_s, plan = _best(lambda: hooks._auto_plan(messages, render, tokenize, stock_ids, ("ns",), None),
                             repeat)
    finally:
        hooks.live_config, hooks.outputs = saved
    assert plan is not None and plan.input_ids == stock_ids
    return stock_s, plan_s


def main(argv: list[str]) -> None:
    from transformers import AutoTokenizer

    from devtools.models import prepare

    tokenizer = AutoTokenizer.from_pretrained(str(prepare("smollm2-135m")))
    print(f"{'messages':>8}  {'stock s':>8}  {'plan s':>8}  {'bound s':>8}")
    for n in [int(a) for a in argv] or [500, 1000, 2000, 4000]:
        stock_s, plan_s = measure(tokenizer, n)
        print(f"{n:>8}  {stock_s:8.3f}  {plan_s:8.3f}  {2 * stock_s + 0.05:8.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
