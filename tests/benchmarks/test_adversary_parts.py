"""The adversarial run's readers, without a server: secrets found in any answer, the guard's series counted."""

from __future__ import annotations

from benchmarks import adversary_client, adversary_guard
from benchmarks.soak import Outcome


def test_a_secret_is_found_in_json_and_text_answers_and_nothing_else_is():
    watch = adversary_client.Watch()
    salt = watch.secret("salt")
    watch.http("fidelity", Outcome(200, {"per_scope": {f"(('{salt}', None, 'null'), 'judge')": {}}}))
    watch.http("metrics", Outcome(200, f'sglang_kvshare_guard_samples{{scope="x{salt}"}} 1.0\n'))
    watch.http("generate", Outcome(200, {"text": "a salt-free answer"}))
    assert [(leak["answer"], leak["secret"]) for leak in watch.leaks] == [("fidelity", "salt"), ("metrics", "salt")]
    assert watch.scanned == 3 and watch.totals()["requests"] == 3


def test_guard_series_count_per_scope_label_sets_and_this_runs_agent_names():
    text = "\n".join(['# HELP sglang_kvshare_guard_samples x', 'sglang_kvshare_guard_samples{scope="fl1-ab12"} 1.0',
                      'sglang_kvshare_guard_setting_head{scope="fl1-ab12"} -1.0',
                      'sglang_kvshare_guard_setting_head{scope="judge@0f3e"} 8.0',
                      'sglang_kvshare_guard_queue_jobs 0.0', 'sglang:num_requests_total 3.0'])
    got = adversary_guard._guard_series(text, "ab12")
    assert got == {"lines": 3, "scopes": 2, "agent_names": ["fl1-ab12"]}
    slots = "\n".join(f'sglang_kvshare_guard_top1{{slot="{i}",bound="{b}"}} 1.0' for i in range(3) for b in "ab")
    events = 'sglang_kvshare_guard_events_total{event="verified"} 4.0'
    assert adversary_guard._guard_series(slots + "\n" + events, "ab12") == {"lines": 7, "scopes": 3, "agent_names": []}


def test_the_report_section_counts_the_verdicts_and_names_each_failure():
    from benchmarks import report

    data = {"form": "short", "server_s": 61.0, "passed": False, "verdicts": {"no_5xx": True, "pin_bounds": False},
            "totals": {"requests": 9, "ok_2xx": 8, "client_4xx": 1, "server_5xx": 0, "lost": 0},
            "secrets": {"count": 3, "answers_scanned": 9, "leaks": []},
            "attacks": {"name_flood": {"flood_requests": 1100, "series": {"scopes": 4}, "series_cap": 32},
                        "long_chats": {"sizes": {"1000": {"auto_status": 400, "auto_s": 0.2, "stock_status": 400,
                                                          "short_delay_s": 0.01}}}}}
    text = report.render_adversary(data)
    assert "Verdicts: 1 of 2 pass; **FAIL**: `pin_bounds`." in text and "1000 messages: 400" in text
    assert report.BY_NAME["adversary"].optional
