"""A plan / solve / critique team with the OpenAI Agents SDK, talking to any OpenAI-compatible server.

Nothing here knows about kvshare. Each agent has its own instructions (its
system prompt) and reads the conversation so far (``result.to_input_list()``),
so the task and the earlier answers sit behind a different prefix in every
agent. Against a kvshare server started with ``--kvshare-auto true`` the
server reuses their KV across agents::

    python examples/openai_agents_team.py --base-url http://127.0.0.1:30000/v1

The Agents SDK talks to the Responses API by default; a local server is
reached through its Chat Completions model (``OpenAIChatCompletionsModel``),
and tracing (which uploads to OpenAI) is turned off.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Optional

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from openai import AsyncOpenAI

AGENTS = {
    "planner": "You are the planner of a small team. Write a short numbered plan (at most three steps) for "
               "the task. Do not solve it.",
    "solver": "You are the solver of a small team. Follow the plan and solve the task step by step. End with "
              "'Answer: <number>'.",
    "critic": "You are the critic of a small team. Check the solution step by step and give the final result "
              "in one sentence ending with 'Answer: <number>'.",
}

QUESTIONS = [
    "A baker makes 24 rolls and sells 15 of them. Then she bakes 10 more. How many rolls does she have?",
    "A car uses 6 litres of fuel per 100 km. How many litres does it use for 250 km?",
]


async def run_team(question: str, base_url: str, *, max_tokens: int = 96, model: str = "default",
                   api_key: Optional[str] = None) -> dict[str, str]:
    """Run the agents in turn on one question; returns each agent's answer by name."""
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url, api_key=api_key or os.environ.get("OPENAI_API_KEY", "unused"))
    chat_model = OpenAIChatCompletionsModel(model=model, openai_client=client)
    settings = ModelSettings(temperature=0, max_tokens=max_tokens)
    items: list = [{"role": "user", "content": f"Task: {question}"}]
    answers = {}
    for name, instructions in AGENTS.items():
        agent = Agent(name=name, instructions=instructions, model=chat_model, model_settings=settings)
        result = await Runner.run(agent, items)
        answers[name] = result.final_output
        items = result.to_input_list()
    return answers


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:30000/v1"))
    parser.add_argument("--model", default="default")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    for question in QUESTIONS:
        answers = asyncio.run(run_team(question, args.base_url, max_tokens=args.max_tokens, model=args.model))
        print(f"# {question}")
        for name, text in answers.items():
            print(f"[{name}] {text}\n")


if __name__ == "__main__":
    main()
