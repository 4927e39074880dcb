"""The agent-traffic benchmark's parts that need no server: the trace format, the schedule, what a cell derives,
the results file's shape and its report section, and the GPU step's dry run."""

from __future__ import annotations

import json
import os
import subprocess
from types import SimpleNamespace

import pytest

from benchmarks import agent_traffic as at
from benchmarks import report
from benchmarks.harness import ROOT, run_meta
from benchmarks.report_sections import render_agent_traffic
from benchmarks.workloads import agent_teams


class WordTokenizer:
    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=text.split())


def recorded(team: dict):
    log = []

    def chat(messages):
        answer = f"answer {len(log)} of {team['name']}"
        log.append(([dict(m) for m in messages], answer, 10 * len(messages)))
        return answer

    agent_teams.run_team(team, chat)
    return log


@pytest.mark.parametrize("team", agent_teams.plan(WordTokenizer()), ids=lambda t: t["name"])
def test_a_trace_replays_the_messages_the_team_sent(team):
    log = recorded(team)
    trace = agent_teams.compact(team, log)
    answers = [a for _, a, _ in log]
    for k, (messages, _, _) in enumerate(log):
        assert agent_teams.messages_of(trace, k, answers) == messages
        refs = [ref["answer_of"] for _, ref in trace["requests"][k]["messages"] if isinstance(ref, dict)]
        assert all(r < k for r in refs)  # an answer is read only after it was given
    # Every answer but the last ones is read again, so a replay sends this run's answers, not the recording's.
    assert len({r["answer_of"] for req in trace["requests"] for _, r in req["messages"] if isinstance(r, dict)}) \
        >= len(log) // 2
    if team["kind"] == "retrieval":
        assert all(m[2]["content"].startswith("Retrieved documents:") for m, _, _ in log)
    # Histories grow: an agent's every request is longer than its previous one.
    last: dict = {}
    for messages, _, _ in log:
        sys_ = messages[0]["content"]
        assert len(messages) > last.get(sys_, 0)
        last[sys_] = len(messages)


def test_the_committed_traces_cover_every_kind_and_size_and_stay_small():
    teams = agent_teams.load()
    assert {t["name"] for t in teams} == {f"{k}-{n}" for k in ("groupchat", "supervisor", "retrieval")
                                          for n in agent_teams.SIZES}
    assert agent_teams.TRACES.stat().st_size < 400_000
    for team in teams:
        answers = [r["answer"] for r in team["requests"]]
        for k in range(len(team["requests"])):
            assert agent_teams.messages_of(team, k, answers)[0]["role"] == "system"
    docs = [t for t in teams if t["kind"] == "retrieval"]
    assert all(r["prompt_tokens"] >= 2000 for t in docs for r in t["requests"])


def test_poisson_arrivals_are_seeded_increasing_and_at_the_rate():
    times = at.arrivals(4000, 30.0, seed=3)
    assert times == at.arrivals(4000, 30.0, seed=3) and times != at.arrivals(4000, 30.0, seed=4)
    assert all(a < b for a, b in zip(times, times[1:]))
    assert times[-1] / len(times) == pytest.approx(2.0, rel=0.08)  # 30 a minute: one every 2 s on average


def _team(name, prompts):
    return {"name": name, "requests": [{"messages": [["system", i % 2]], "prompt_tokens": p, "answer": ""}
                                       for i, p in enumerate(prompts)]}


def test_the_working_set_counts_each_agents_longest_prompt_and_half_fits_the_longest_request():
    teams = [_team("a", [100, 300, 200, 500]), _team("b", [1000])]
    assert at.working_set(teams, 10) == (210 + 510) + 1010
    assert at.pool_tokens("large", teams, 10) == 16384
    assert at.pool_tokens("half", teams, 10) == 1010 + 64  # half the working set (865) would not hold it
    big = [_team(f"c{i}", [4000]) for i in range(8)]
    assert at.pool_tokens("half", big, 0) == at.working_set(big, 0) // 2
    assert at.pool_tokens("large", big, 0) >= at.working_set(big, 0)


def _row(team, turn, ttft, status=200, text="x", **rep):
    return {"team": team, "agents": 4, "turn": turn, "status": status, "ttft_s": ttft, "e2e_s": 1.0, "text": text,
            "output_tokens": 10, **rep}


def test_a_cell_derives_percentiles_reuse_fallbacks_agreement_and_errors():
    rows = [_row("t", 1, 9.0, shared=0, reused=0, sources=0),
            *[_row("t", k, float(k), shared=100, reused=50, sources=1, assembly_s=0.01, aligned=40, recomputed=10,
                   fallbacks=["source_evicted"] if k == 2 else []) for k in range(2, 12)],
            _row("u", 2, None, status=503, shared=100, reused=0, fallbacks=["no_source", "no_source"]),
            _row("u", 3, None, status=0)]
    run = {"rows": rows, "spans": [[0.0, 30.0], [10.0, 60.0]], "wall_s": 60.0}
    stock = {("t", k): ("x" if k % 2 else "y") for k in range(1, 12)}
    cell = at.derive(run, stock)
    assert cell["ttft_p50_s"] == 6.5 and cell["ttft_p99_s"] == pytest.approx(10.91)  # turn 1 left out
    assert cell["ttft_s_per_turn"] == {"t": [9.0, *map(float, range(2, 12))]}  # per position; failures as gaps
    assert cell["reuse_ratio"] == pytest.approx(500 / 1100, abs=1e-4)  # the failed request's shared tokens count
    assert cell["fallbacks"] == {"source_evicted": 1, "no_source": 2}
    assert (cell["errors_5xx"], cell["lost"], cell["requests"]) == (1, 1, 13)
    assert cell["throughput_tok_s"] == pytest.approx(110 / 60, abs=1e-3) and cell["teams_per_min"] == 2.0
    assert cell["team_latency_p50_s"] == 40.0
    agree = cell["agreement_with_stock"]
    assert (agree["equal"], agree["n"]) == (6, 11) and agree["ci95"][0] < 6 / 11 < agree["ci95"][1]
    assert cell["by_sources"]["1"] == {"requests": 10, "ttft_p50_s": 6.5, "assembly_s": 0.01, "aligned": 40.0,
                                       "recomputed": 10.0}
    assert at.derive({"rows": rows[:1], "spans": [], "wall_s": 1.0})["reuse_ratio"] == 0.0


def test_the_quick_plan_runs_both_rates_on_the_large_pool_off_once_and_the_lru_order_beside_the_default_on_the_half():
    args = at.parse(["--quick"])
    teams = [t for t in agent_teams.load() if t["name"] in args.teams]
    cells = {(s["arm"], s["pool"]): s["cells"] for s in at.plan(args, teams)["servers"]}
    assert set(cells) == {(arm, pool) for arm in at.DEFAULT_ARMS for pool in ("large", "half")} - {("off", "half")}
    assert cells[("stock", "large")] == cells[("default", "large")] == [[4.0, None], [60.0, None]]
    assert cells[("stock", "half")] == cells[("off", "large")] == [[60.0, None]]
    assert cells[("default", "half")] == [[60.0, None], [60.0, at.LRU]]  # the same server, SGLang's order alone
    assert {s["flags"][-1] for s in at.plan(args, teams)["servers"] if s["pool"] == "half"} == {
        str(at.pool_tokens("half", teams, args.max_tokens))}
    extras = {(s["arm"], s["pool"]): s["extras"] for s in at.plan(args, teams)["servers"]}
    assert extras == {("stock", "large"): ["idle"], ("default", "large"): ["idle", "fidelity"],
                      ("off", "large"): [], ("stock", "half"): [], ("default", "half"): []}


def test_the_any_length_study_arm_runs_only_when_named_and_reuses_short_segments():
    teams = [t for t in agent_teams.load() if t["name"] == "groupchat-4"]
    servers = at.plan(at.parse(["--arms", "stock", "any_length", "--pools", "large", "--rates", "4"]), teams)["servers"]
    study = [s for s in servers if s["arm"] == "any_length"][0]
    assert "--kvshare-min-reuse-tokens 0" in study["command"] and study["extras"] == ["idle"]
    assert "any_length" not in at.parse([]).arms and "any_length" not in at.parse(["--quick"]).arms


def test_rate_zero_replays_one_team_at_a_time_in_order(monkeypatch):
    live, order, lock = [0], [], __import__("threading").Lock()

    def chat(url, messages, max_tokens):
        with lock:
            live[0] += 1
            order.append((messages[0]["content"], len(messages)))
            assert live[0] == 1  # never two requests at once
        __import__("time").sleep(0.01)
        with lock:
            live[0] -= 1
        return {"status": 200, "ttft_s": 0.1, "e2e_s": 0.2, "text": "a", "output_tokens": 1, "report": None}

    monkeypatch.setattr(at, "chat_stream", chat)
    teams = [t for t in agent_teams.load() if t["name"] in ("groupchat-4", "supervisor-4")]
    run = at.run_cell("http://unused", teams, 0.0, 0, 8)
    assert len(run["rows"]) == sum(len(t["requests"]) for t in teams) == len(order)
    assert [r["team"] for r in run["rows"]] == [t["name"] for t in teams for _ in t["requests"]]
    assert all(a[1] <= b[0] for a, b in zip(run["spans"], run["spans"][1:]))  # each team starts after the last


def test_the_idle_replay_keeps_turns_two_on_and_splits_reused_from_dense():
    rows = [_row("g", 1, 5.0, reused=0, forwards=1), _row("g", 2, 0.4, reused=0, forwards=1),
            _row("g", 3, 0.6, reused=0, forwards=1), _row("r", 2, 1.0, reused=300, forwards=2),
            _row("r", 3, None, status=503)]
    idle = at.derive_idle({"rows": rows}, 0.25)
    assert idle["floor_ttft_s"] == 0.25 and idle["ttft_p50_s"] == 0.6
    assert (idle["reused_requests"], idle["reused_ttft_p50_s"], idle["dense_ttft_p50_s"]) == (1, 1.0, 0.5)
    assert idle["prefill_forwards"] == {"1": 2, "2": 1} and (idle["errors_5xx"], idle["requests"]) == (1, 5)
    assert [(t["team"], t["turn"]) for t in idle["turns"]] == [("g", 2), ("g", 3), ("r", 2)]


def test_the_guard_per_agent_is_named_by_team_and_position_never_by_digest():
    rows = [_row("r", 1, 1.0, speaker="A", agent="auto-aa", reused=0),
            _row("r", 2, None, status=503, speaker="B"),  # a failed request: its report names no agent
            _row("r", 3, 1.0, speaker="C", agent="auto-cc", reused=10),
            _row("r", 4, 1.0, speaker="A", agent="auto-aa", reused=10),
            _row("r", 5, 1.0, speaker="B", agent="auto-bb", reused=10),
            _row("s", 1, 1.0, speaker="A", agent="auto-aa", reused=0)]
    scopes = {"auto-aa": {"samples": 1, "top1": {"n": 32, "mean": 0.97, "ci95": [0.9, 1.0]}}}
    agents = at.per_agent(rows, scopes)
    # Positions follow the trace's speakers: the failed request shifts no one.
    assert [(a["team"], a["position"], a["samples"]) for a in agents] == [("r", 1, 1), ("r", 2, 0), ("r", 3, 0),
                                                                            ("s", 1, 1)]
    assert agents[0]["top1"]["mean"] == 0.97 and agents[1]["top1"] == {"n": 0, "mean": None}
    assert [a["reused_requests"] for a in agents] == [1, 1, 1, 0]  # each team's own requests, one scope or not
    assert "auto-" not in json.dumps(agents)


def test_stock_runs_first_whatever_the_order_of_arms():
    teams = [t for t in agent_teams.load() if t["name"] == "groupchat-4"]
    servers = at.plan(at.parse(["--arms", "any_length", "default", "stock", "--pools", "large"]), teams)["servers"]
    assert [s["arm"] for s in servers] == ["stock", "default", "any_length"]


def test_the_wilson_interval():
    assert at.wilson(0, 0) is None
    lo, hi = at.wilson(10, 10)
    assert hi == pytest.approx(1.0) and 0.69 < lo < 0.73
    lo, hi = at.wilson(50, 100)
    assert lo == pytest.approx(1 - hi, abs=1e-3) and 0.40 < lo < 0.41


@pytest.mark.parametrize("stats, name", [(None, "lru"), ({}, "lru"), ({"retention": "workflow"}, "workflow"),
                                         ({"config": {"retention": {"policy": "keep_sources"}}}, "keep_sources")])
def test_the_retention_name_is_read_from_stats_or_is_lru(stats, name):
    assert at.retention(stats) == name


def results_file() -> dict:
    rows = [_row("groupchat-8", k, 0.5 * k, shared=100, reused=80, sources=1) for k in range(1, 5)]
    run = {"rows": rows, "spans": [[0.0, 10.0]], "wall_s": 10.0}
    cells = []
    for arm in at.DEFAULT_ARMS:
        for pool in ("large", "half"):
            cells.append({"arm": arm, "pool": pool, "rate": 4.0, "retention": "lru", "max_total_tokens": 16384,
                          **at.derive(run, None if arm == "stock" else {("groupchat-8", k): "x" for k in range(1, 5)}),
                          "guard_top1": {"agent a": {"samples": 4, "top1": {"n": 4, "mean": 0.9875}}}})
    idle_rows = [_row("groupchat-8", k, 0.4 + 0.1 * k, reused=300 if k == 3 else 0, forwards=1) for k in range(1, 5)]
    idle = {"stock": at.derive_idle({"rows": [{**r, "ttft_s": 2 * r["ttft_s"]} for r in idle_rows]}, 0.3),
            "default": at.derive_idle({"rows": idle_rows}, 0.31, {("groupchat-8", k): "x" for k in range(1, 5)})}
    fidelity = {"teams": ["retrieval-8"], "verify_rate": 1.0, "verified": 3, "errors_5xx": 0, "lost": 0,
                "per_agent": [{"team": "retrieval-8", "position": 2, "reused_requests": 2, "samples": 2,
                               "top1": {"n": 64, "mean": 0.96875, "ci95": [0.9, 1.0]}},
                              {"team": "retrieval-8", "position": 1, "reused_requests": 0, "samples": 0,
                               "top1": {"n": 0, "mean": None}}]}
    return {"meta": run_meta("python -m benchmarks.agent_traffic --quick"), "plan": {
        "teams": {"groupchat-8": 8}, "working_set_tokens": 1000, "rates": [4.0]}, "cells": cells, "wall_s": 10.0,
        "pool_samples": {"default/half/4.0": [[1.0, 0.5, 0], [2.0, 0.9, 100]]}, "idle": idle, "fidelity": fidelity}


def test_the_results_file_has_the_cells_the_issue_names_and_a_report_section():
    data = results_file()
    for cell in data["cells"]:
        assert {"arm", "pool", "rate", "retention", "ttft_p50_s", "ttft_p99_s", "throughput_tok_s", "reuse_ratio",
                "errors_5xx", "lost"} <= set(cell)
    entry = report.BY_NAME["agent_traffic"]
    assert entry.optional and entry.name in report.HEADLINE
    result, figure, fidelity = report.HEADLINE[entry.name](data)
    lru = ", SGLang's eviction order `lru`"  # every cell of this file names SGLang's order
    assert "groupchat-8" in result and f"half pool, 4 teams/min{lru}: TTFT p50 1.00x / p99 1.00x stock's" in figure
    assert "control `off` (large pool, 4 teams/min): TTFT p50 1.00x" in figure
    assert "reuse 0.80" in figure and f"large pool, 4 teams/min{lru}: 4/4 [" in fidelity
    text = report.section(entry, data, report.RESULTS)
    assert "| `default` | half (16384) | 4 | lru |" in text and "1.00x / 1.00x" in text
    by_sources = sum(len(c["by_sources"]) for c in data["cells"] if c["arm"] == "default")
    assert render_agent_traffic(data).count("\n| `") == len(data["cells"]) + len(data["idle"]) + by_sources
    assert "* `default` groupchat-8: 0.5 1.0 1.5 2.0" in text  # per position, a long team
    assert "top-1 per agent: default large 4/min lru: 0.988 (n 4); default half 4/min lru: 0.988 (n 4)." in text
    assert "Reuse per team: default large 4/min lru: groupchat-8 0.80;" in text
    assert "| `default` | 0.31 s | 0.70 s | 1 / 0.70 s | 0.70 s | 1: 3 | 3/3 [0.44, 1.00] | 0 / 0 |" in text
    assert "| `stock` | 0.30 s | 1.40 s |" in text and "| - | 0 / 0 |" in text  # stock: no agreement with itself
    assert ("`default` with reused tokens: median 2.00x over 1 turns (2.00-2.00x); `default` without: median 2.00x "
            "over 2 turns") in text
    assert "retrieval-8 agent 2: 0.969 [0.900, 1.000] (2 verified of 2 reused)." in text
    assert "agent 1" not in text.split("one at a time (verify rate")[1]  # agents that reused nothing
    assert "the guard's top-1 per agent (2 of 2 reused requests verified): 0.969-0.969 over 1 agents" in fidelity
    assert "(verify rate 1; 3 verified; 5xx / lost 0 / 0): retrieval-8 agent 2: 0.969" in text
    unset = {**data, "fidelity": {**data["fidelity"], "verify_rate": None}}
    assert "verify rate could not be set" in render_agent_traffic(unset)
    old = {k: v for k, v in data.items() if k not in ("idle", "fidelity")}  # files written before both replays
    assert "idle server" not in render_agent_traffic(old) and "verified:" not in report.HEADLINE[entry.name](old)[2]


def test_the_plot_draws_from_the_file(tmp_path):
    at.plot(results_file(), tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_the_gpu_steps_dry_run_plans_stock_and_default_on_a_dummy_8b_model(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "STEPS": "serving", "DRY_RUN": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], env=env, cwd=ROOT, timeout=120,
                   capture_output=True)
    plan = json.loads((tmp_path / "agent_traffic_plan.json").read_text())
    assert [(s["arm"], s["pool"]) for s in plan["servers"]] == [("stock", "large"), ("default", "large")]
    assert plan["servers"][0]["flags"] == plan["servers"][1]["flags"]  # the same flags in every arm
    for server in plan["servers"]:
        assert "--load-format dummy" in server["command"] and "--device cuda" in server["command"]
    assert "sglang.launch_server" in plan["servers"][0]["command"]
    assert "--kvshare-auto true" in plan["servers"][1]["command"]
    config = json.loads((tmp_path / "llama8b-dummy" / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (4096, 32, 8)
    assert (tmp_path / "llama8b-dummy" / "tokenizer.json").is_file()
    assert plan["rates"] == [20.0, 120.0] and set(plan["teams"]) == set(at.QUICK_TEAMS)


def test_pool_occupancy_and_evictions_are_read_from_sglangs_metrics():
    text = ('# HELP sglang:token_usage The token usage\nsglang:token_usage{model_name="m",engine_type="unified"} 0.25\n'
            'sglang:token_usage_max{model_name="m"} 0.9\nsglang:evicted_tokens_total{model_name="m"} 120.0\n')
    assert at.pool_sample(text) == (0.25, 120.0)
    assert at.pool_sample("") == (None, None)
