"""Multi-agent topologies as plain ``sgl.function`` programs with shared marks.

Every agent call is a fork of an empty program state that declares its agent,
its system prompt, and a user turn::

    <|im_start|>user
    [shared: query]

    The math solver said:
    [shared: out:solver]
    ...
    <instruction><|im_end|>

The query and every other agent's answer are ``shared`` (slots ``query`` and
``out:<agent>``); the rest is private. Topologies:

* ``chain``: agent i reads agent i-1's answer; the final agent reads the last.
* ``refer``: role agents answer independently; the final agent reads all.
* ``debate``: ``rounds`` rounds of ``refer``-style answers, where each round
  reads every agent's previous answer; the final agent reads the last round.

Ordering: the first role agent runs alone (so the server holds the query once
before anyone else needs it), the others of the same round run concurrently
(``parallel=True``) or one by one. Each program returns a dict with the final
text and one record per agent call (agent, round, ttft_s, latency_s, report).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import sglang as sgl

from benchmarks.workloads.roles import Role
from benchmarks.workloads.tasks import Task
from sglang_kvshare.frontend.primitives import agent, shared, workflow

TOPOLOGIES = ("chain", "refer", "debate")


def out_slot(role: Role) -> str:
    return f"out:{role.name}"


def speak(s, role: Role, query: str, refs: Sequence[tuple[Role, str]], instruction: str,
          max_tokens: int, var: str = "answer", workflow_name: Optional[str] = None) -> None:
    """Submit one agent turn to program state ``s`` (an empty fork); does not wait."""
    if workflow_name is not None:
        s += workflow(workflow_name)
    s += agent(role.name)
    s += sgl.system(role.system)
    s += sgl.user_begin()
    s += shared(query, slot="query")
    for ref_role, text in refs:
        s += f"\n\n{ref_role.title} said:\n"
        s += shared(text, slot=out_slot(ref_role))
    s += f"\n\n{instruction}"
    s += sgl.user_end()
    s += sgl.assistant(sgl.gen(var, max_tokens=max_tokens))


def _record(fork, role: Role, round_: int, var: str = "answer") -> dict:
    meta = fork.get_meta_info(var) or {}
    client = meta.get("kvshare_client") or {}
    return {
        "agent": role.name, "round": round_,
        "ttft_s": client.get("ttft_s"), "latency_s": client.get("latency_s"),
        "prompt_tokens": meta.get("prompt_tokens"), "completion_tokens": meta.get("completion_tokens"),
        "cached_tokens": meta.get("cached_tokens"),
        "report": (meta.get("kvshare") or [None])[0],
        "text": fork[var],
    }


def _round(s, roles: Sequence[Role], query: str, refs_for, instruction: str, max_tokens: int,
           round_: int, parallel: bool, groups: list, workflow_name: Optional[str] = None) -> list[tuple[Role, str, dict]]:
    """Run ``roles`` for one round; the first alone, the rest concurrently if ``parallel``."""
    results: list[Optional[tuple[Role, str, dict]]] = [None] * len(roles)
    pending = []
    for i, role in enumerate(roles):
        group = s.fork(1)
        groups.append(group)
        fork = group[0]
        speak(fork, role, query, refs_for(role), instruction, max_tokens, workflow_name=workflow_name)
        pending.append((i, role, fork))
        if i == 0 or not parallel:  # wait: later agents reuse what this one prefilled
            for j, r, f in pending:
                results[j] = (r, f["answer"], _record(f, r, round_))
            pending = []
    for j, r, f in pending:
        results[j] = (r, f["answer"], _record(f, r, round_))
    return results  # type: ignore[return-value]


@sgl.function
def multi_agent(s, query: str, task: Task, topology: str = "refer", num_agents: int = 4,
                rounds: int = 2, max_tokens: int = 128, parallel: bool = True, workflow_name: Optional[str] = None):
    """One sample through ``topology`` with ``num_agents - 1`` role agents and the final agent; every
    request names ``workflow_name`` when given (the client library then routes it, docs/SCALING.md)."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {topology!r}; choose one of {TOPOLOGIES}")
    if not 2 <= num_agents <= len(task.roles) + 1:
        raise ValueError(f"num_agents must be in [2, {len(task.roles) + 1}] for {task.name}")
    roles = task.roles[: num_agents - 1]
    groups: list = []
    records: list[dict] = []
    if topology == "chain":
        last: list[tuple[Role, str]] = []
        for role in roles:
            (r, text, rec), = _round(s, [role], query, lambda _r: last, task.instruction, max_tokens,
                                     0, parallel, groups, workflow_name)
            records.append(rec)
            last = [(r, text)]
        final_refs = last
    else:
        prev = _round(s, roles, query, lambda _r: [], task.instruction, max_tokens, 0, parallel, groups,
                      workflow_name)
        records += [rec for _, _, rec in prev]
        for k in range(1, rounds if topology == "debate" else 1):
            answers = [(r, t) for r, t, _ in prev]
            prev = _round(s, roles, query, lambda _r: answers, task.instruction, max_tokens, k,
                          parallel, groups, workflow_name)
            records += [rec for _, _, rec in prev]
        final_refs = [(r, t) for r, t, _ in prev]
    group = s.fork(1)
    groups.append(group)
    speak(group[0], task.final, query, final_refs, task.final_instruction, max_tokens,
          workflow_name=workflow_name)
    final_rec = _record(group[0], task.final, -1)
    records.append(final_rec)
    for g in groups:  # end the forks' worker threads
        for st in g.states:
            st.stream_executor.end()
    return {"final": final_rec["text"], "records": records}


def run_workflow(backend: Any, task: Task, samples: Sequence, *, topology: str = "refer",
                 num_agents: int = 4, rounds: int = 2, max_tokens: int = 128, parallel: bool = True,
                 progress_bar: bool = True, desc: str = "", concurrency: int = 1,
                 workflow_names: bool = False) -> list[dict]:
    """Run ``samples``, ``concurrency`` at a time; one result dict per sample, in order.

    Greedy decoding (temperature 0). Each result has ``id``, ``final``,
    ``records`` and ``seconds`` (end-to-end wall time). Raises the first
    program error. Running several samples at once lets the server batch their
    decode steps, which is where a CPU spends its time; the price is that each
    request's TTFT then includes queueing behind the other samples. (``run_batch``
    is not used: its prefix tracing would call the program with placeholder
    arguments.) ``workflow_names``: each sample is its own workflow (``sample-<id>``).
    """
    import time
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")

    def one(smp) -> dict:
        t0 = time.perf_counter()
        st = multi_agent.run(query=smp.query, task=task, topology=topology, num_agents=num_agents,
                             rounds=rounds, max_tokens=max_tokens, parallel=parallel,
                             workflow_name=f"sample-{smp.id}" if workflow_names else None,
                             backend=backend, temperature=0)
        err = st.stream_executor.error()
        if err is not None:
            raise err
        return {"id": smp.id, **st.ret_value, "seconds": time.perf_counter() - t0}

    bar = tqdm(total=len(samples), desc=desc or f"{task.name}/{topology}", disable=not progress_bar)
    with bar, ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(one, smp) for smp in samples]
        for fut in futures:
            fut.add_done_callback(lambda _f: bar.update(1))
        try:
            return [fut.result() for fut in futures]
        except BaseException:
            pool.shutdown(cancel_futures=True)  # do not run the remaining samples after a failure
            raise
