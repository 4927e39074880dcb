"""Agent teams as frameworks write them (a plain OpenAI-style chat client), and the request traces they leave.

A team is a function of a ``chat(messages) -> answer`` client: ``groupchat`` (AutoGen's round robin: each agent
reads the task and every message so far, its own as ``assistant``, the others' as ``user``; a retrieval team's
agents also read 2-3K tokens of documents) or ``supervisor`` (agent 0 instructs each worker in turn). ``main``
runs every team once against a stock server; ``compact`` stores each text once and an answer read again as a
reference to the request that gave it, so a replay sends the answer its own server gave. Texts: GSM8K test
problems (MIT, data/gsm8k/LICENSE), role prompts of ``role_set.json``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from benchmarks.workloads.role_set import DEV, HELDOUT

TRACES = Path(__file__).with_name("traces") / "agent_teams.json.gz"
FORMAT = 1
Chat = Callable[[list[dict]], str]
SIZES = (4, 8, 16)


def _system(i: int) -> dict:
    roles = DEV + HELDOUT
    return {"role": "system", "content": roles[i % len(roles)].system + f" You are agent {i + 1} of the team."}


def _seen_by(history: list[tuple[int, str]], me: int) -> list[dict]:
    """The conversation as agent ``me`` reads it: its own turns as ``assistant``, the others' as ``user``."""
    return [{"role": "assistant" if who == me else "user", "content": text} for who, text in history]


def groupchat(chat: Chat, team: dict) -> None:
    """AutoGen's round robin; a retrieval team's agents read the documents after the task."""
    head = [{"role": "user", "content": c} for c in (team["task"], team.get("documents")) if c]
    history: list[tuple[int, str]] = []
    for _ in range(team["rounds"]):
        for me in range(team["agents"]):
            history.append((me, chat([_system(me), *head, *_seen_by(history, me)])))


def supervisor(chat: Chat, team: dict) -> None:
    """Agent 0 instructs each worker in turn; everyone reads the whole history."""
    boss = {"role": "system", "content": "You are the supervisor. Give the next worker one short instruction."}
    task, history = {"role": "user", "content": team["task"]}, []
    for _ in range(team["rounds"]):
        for worker in range(1, team["agents"]):
            history.append((0, chat([boss, task, *_seen_by(history, 0)])))
            history.append((worker, chat([_system(worker), task, *_seen_by(history, worker)])))


def documents(tokenizer, n_tokens: int, rng: random.Random) -> str:
    """About ``n_tokens`` tokens of numbered GSM8K problems, as a retriever would return passages."""
    from benchmarks.texts import gsm8k_questions

    pool, parts, count = gsm8k_questions(), ["Retrieved documents:"], 0
    while count < n_tokens:
        text = f"[{len(parts)}] {pool[rng.randrange(len(pool))]}"
        parts.append(text)
        count += len(tokenizer(text + "\n", add_special_tokens=False).input_ids)
    return "\n".join(parts)


def plan(tokenizer, seed: int = 0) -> list[dict]:
    """The teams to record: every kind at every size, several rounds (histories grow), one task each."""
    from benchmarks.texts import gsm8k_questions

    rng, questions, teams = random.Random(seed), gsm8k_questions(), []
    for kind in ("groupchat", "supervisor", "retrieval"):
        for n in SIZES:
            rounds = 1 if kind == "supervisor" or (kind == "retrieval" and n == 16) else 2
            team = {"name": f"{kind}-{n}", "kind": kind, "agents": n, "rounds": rounds,
                    "task": "Solve this problem as a team, briefly: " + questions[rng.randrange(len(questions))]}
            if kind == "retrieval":
                team["documents"] = documents(tokenizer, 3072 if n == 4 else 2048, rng)
            teams.append(team)
    return teams


def run_team(team: dict, chat: Chat) -> None:
    (supervisor if team["kind"] == "supervisor" else groupchat)(chat, team)


def compact(team: dict, log: list[tuple[list[dict], str, int]]) -> dict:
    """A team's trace from its log of (messages, answer, prompt tokens): texts stored once; a message that is an
    earlier request's answer becomes ``{"answer_of": k}``."""
    texts: dict[str, int] = {}
    answer_of: dict[str, int] = {}
    requests = []
    for k, (messages, answer, prompt_tokens) in enumerate(log):
        msgs = []
        for m in messages:
            c = m["content"]
            msgs.append([m["role"], {"answer_of": answer_of[c]} if c in answer_of
                         else texts.setdefault(c, len(texts))])
        requests.append({"messages": msgs, "answer": answer, "prompt_tokens": prompt_tokens})
        answer_of.setdefault(answer, k)
    return {**{k: team[k] for k in ("name", "kind", "agents", "rounds")}, "texts": list(texts),
            "requests": requests}


def messages_of(team: dict, k: int, answers: list[str]) -> list[dict]:
    """Request ``k`` of a trace as a framework would send it now: references filled with ``answers`` (this run's)."""
    return [{"role": role, "content": answers[ref["answer_of"]] if isinstance(ref, dict) else team["texts"][ref]}
            for role, ref in team["requests"][k]["messages"]]


def load(path: Path = TRACES) -> list[dict]:
    data = json.loads(gzip.decompress(path.read_bytes()))
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: trace format {data.get('format')!r}, this code reads {FORMAT}")
    return data["teams"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.workloads.agent_teams", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=TRACES)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    import requests
    from transformers import AutoTokenizer

    from devtools.models import prepare
    from devtools.server_process import ServerProcess

    model = str(prepare("smollm2-135m"))
    teams = plan(AutoTokenizer.from_pretrained(model))
    with ServerProcess(model_path=model, stock=True, extra_args=["--max-total-tokens", "65536"]) as server:

        def one(team: dict) -> dict:  # a team's trace, run greedily with a plain client
            log: list = []

            def chat(messages: list[dict]) -> str:
                r = requests.post(server.url + "/v1/chat/completions", timeout=600, json={
                    "model": "default", "messages": messages, "temperature": 0, "max_tokens": args.max_tokens})
                r.raise_for_status()
                body = r.json()
                log.append((messages, body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens"]))
                return log[-1][1]

            run_team(team, chat)
            return compact(team, log)

        with ThreadPoolExecutor(max_workers=len(teams)) as pool:  # teams side by side, as they would run
            traces = list(pool.map(one, teams))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": FORMAT, "model": "SmolLM2-135M-Instruct", "max_tokens": args.max_tokens,
            "texts_from": "GSM8K test problems (MIT, data/gsm8k/LICENSE); benchmarks/workloads/role_set.json",
            "teams": traces}
    args.out.write_bytes(gzip.compress(json.dumps(data, separators=(",", ":")).encode(), mtime=0))
    print(f"wrote {args.out}: {sum(len(t['requests']) for t in traces)} requests in {len(traces)} teams")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
