"""A plan / solve / critique / revise team in LangGraph, talking to any OpenAI-compatible server.

Nothing here knows about kvshare: it is an ordinary LangGraph program using
``langchain-openai``. Point it at a kvshare server started with
``--kvshare-auto true`` and the server reuses, across the four agents, the KV
of the text they share (the task, the plan, the solution, the critique), even
though each agent puts its own system prompt in front of it::

    python -m sglang_kvshare.launch_server --model-path "$(python -m devtools.models path smollm2-135m)" \\
        --port 30000 --kvshare-mode fullshared --kvshare-auto true
    python examples/langgraph_team.py --base-url http://127.0.0.1:30000/v1
    curl -s http://127.0.0.1:30000/kvshare/stats     # slot auto:message: reuse_ratio

Every agent reads the whole conversation so far (LangGraph's ``MessagesState``)
behind its own system prompt and appends its answer, as in LangGraph's
multi-agent tutorials.
"""

from __future__ import annotations

import argparse
import os
from typing import Optional

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, MessagesState, StateGraph

AGENTS = {
    "planner": "You are the planner of a small team. Read the task and write a short numbered plan "
               "(at most three steps) for solving it. Do not solve it.",
    "solver": "You are the solver of a small team. Follow the plan in the conversation and solve the task "
              "step by step. End with 'Answer: <number>'.",
    "critic": "You are the critic of a small team. Check the solution in the conversation step by step and "
              "point out any mistake in one or two sentences.",
    "reviser": "You are the reviser of a small team. Using the task, the solution and the critique, give the "
               "corrected final result in one sentence ending with 'Answer: <number>'.",
}

QUESTIONS = [
    "A farmer has 17 sheep. He buys 5 more and then sells 8. How many sheep does he have now?",
    "A book costs 12 dollars and a pen costs 3 dollars. How much do 2 books and 4 pens cost?",
    "A train travels 60 km in the first hour and 45 km in the second hour. How far does it travel in total?",
    "Tom has 3 boxes with 8 apples each. He eats 5 apples. How many apples are left?",
]


def build_team(llm: ChatOpenAI):
    """The graph: planner -> solver -> critic -> reviser, each a node with its own system prompt."""

    def agent(name: str):
        def run(state: MessagesState) -> dict:
            reply = llm.invoke([SystemMessage(AGENTS[name]), *state["messages"]])
            return {"messages": [AIMessage(content=reply.content, name=name)]}

        return run

    graph = StateGraph(MessagesState)
    order = list(AGENTS)
    for name in order:
        graph.add_node(name, agent(name))
    graph.add_edge(START, order[0])
    for a, b in zip(order, order[1:]):
        graph.add_edge(a, b)
    graph.add_edge(order[-1], END)
    return graph.compile()


def run_team(question: str, base_url: str, *, max_tokens: int = 96, model: str = "default",
             api_key: Optional[str] = None) -> dict[str, str]:
    """Run the team on one question; returns each agent's answer by name."""
    llm = ChatOpenAI(base_url=base_url, api_key=api_key or os.environ.get("OPENAI_API_KEY", "unused"),
                     model=model, temperature=0, max_tokens=max_tokens)
    state = build_team(llm).invoke({"messages": [HumanMessage(f"Task: {question}")]})
    return {m.name: m.content for m in state["messages"] if isinstance(m, AIMessage)}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:30000/v1"))
    parser.add_argument("--model", default="default")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--questions", type=int, default=len(QUESTIONS))
    args = parser.parse_args(argv)
    for question in QUESTIONS[: args.questions]:
        answers = run_team(question, args.base_url, max_tokens=args.max_tokens, model=args.model)
        print(f"# {question}")
        for name, text in answers.items():
            print(f"[{name}] {text}\n")


if __name__ == "__main__":
    main()
