"""The unchanged LangGraph and OpenAI Agents SDK examples against a ``--kvshare-auto`` server:
reuse shows in ``/kvshare/stats``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import requests

pytest.importorskip("langgraph")
pytest.importorskip("langchain_openai")

from tests.servers import shared_server  # noqa: E402 - one server for every chat test module

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "langgraph_team.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("langgraph_team", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_langgraph_team_reuses_the_shared_conversation(server_pool):
    server = shared_server(server_pool)
    team = _load_example()

    def slot_stats():
        return requests.get(server.url + "/kvshare/stats", timeout=30).json()["slots"].get("auto:message", {})

    before = slot_stats()
    answers = team.run_team(team.QUESTIONS[0] + " (langgraph test)", server.url + "/v1", max_tokens=40)
    assert list(answers) == list(team.AGENTS) and all(answers.values())
    after = slot_stats()
    seen = after["shared_tokens_seen"] - before.get("shared_tokens_seen", 0)
    reused = (after["resolved_alignment"] + after["resolved_correction"]
              - before.get("resolved_alignment", 0) - before.get("resolved_correction", 0))
    # Prompts carry the task 4 times, the plan 3, the solution 2, the critique once; only the task's
    # first copy has nothing to reuse (answers come with the KV computed while generating them).
    assert seen > 0 and reused / seen > 0.5, (reused, seen)
    chat = requests.get(server.url + "/kvshare/chat", timeout=30).json()
    assert chat["outputs"]["seen_again"] >= 3 and chat["outputs"]["retokenized_equal"] >= 1


def test_openai_agents_sdk_team_reuses_the_task(server_pool):
    pytest.importorskip("agents")
    import asyncio

    server = shared_server(server_pool)
    spec = importlib.util.spec_from_file_location("openai_agents_team", EXAMPLE.parent / "openai_agents_team.py")
    team = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(team)

    def reused():
        slot = requests.get(server.url + "/kvshare/stats", timeout=30).json()["slots"].get("auto:message", {})
        return slot.get("resolved_alignment", 0) + slot.get("resolved_correction", 0)

    before = reused()
    answers = asyncio.run(team.run_team(team.QUESTIONS[0] + " (agents sdk test)", server.url + "/v1",
                                        max_tokens=32))
    assert list(answers) == list(team.AGENTS) and all(answers.values())
    assert reused() > before
