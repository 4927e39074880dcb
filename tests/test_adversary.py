"""The adversarial checks (``benchmarks.adversary``): hostile guard files at launch and a guard file written beside
a planted symlink (no server); the short form of the attacks against one live server, whose every verdict must
hold, and a hostile pool file made from that server's own pool file, launched for real (``server``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import adversary, adversary_files
from tests.servers import ADVERSARY_KEY, adversary_launch


@pytest.fixture(scope="module")
def hostile(tmp_path_factory, model_path) -> dict:
    return adversary_files.hostile_files(tmp_path_factory.mktemp("hostile"), model_path)


@pytest.mark.parametrize("case", sorted(adversary_files.GUARD_CASES))
def test_a_hostile_guard_file_stops_the_launch_naming_the_file(hostile, case):
    got = hostile["guard"][case]
    assert got["ok"], got


def test_a_guard_file_write_follows_no_planted_symlink_and_is_private(hostile):
    assert hostile["guard_write"]["ok"], hostile["guard_write"]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, server_pool, model_path) -> dict:
    from transformers import AutoTokenizer

    # The suite may have started this server already, while the tests that need none ran (tests/conftest.py).
    server = server_pool("adversary", **adversary_launch(tmp_path_factory.getbasetemp()))
    return adversary.run(server.url, ADVERSARY_KEY, AutoTokenizer.from_pretrained(model_path), form="short")


VERDICTS = ["verify_keys", "sampling_not_error", "pin_bounds", "forged_workflow", "long_chats", "pins_survive_flood",
            "metrics_bounded", "no_secret_in_any_answer", "no_5xx", "nothing_lost"]


@pytest.mark.server
@pytest.mark.parametrize("verdict", VERDICTS)
def test_short_adversary_verdict_holds(short_run, verdict):
    assert set(short_run["verdicts"]) == set(VERDICTS)
    detail = short_run["attacks"].get(verdict) or short_run["attacks"]["name_flood"]
    if verdict in ("no_secret_in_any_answer", "no_5xx", "nothing_lost"):
        detail = {"secrets": short_run["secrets"], "totals": short_run["totals"], "statuses": short_run["statuses"]}
    assert short_run["verdicts"][verdict] is True, json.dumps(detail, default=str)[:3000]


@pytest.mark.server
def test_a_pool_file_of_other_shapes_stops_the_launch_naming_the_file(short_run, tmp_path, model_path):
    assert short_run["saved_pool"], "the adversary's server wrote no pool file"
    path = tmp_path / "pool-wrong_shapes.pt"
    adversary_files.pool_cases(Path(short_run["saved_pool"]))["wrong_shapes"](path)
    got = adversary_files.judged(path, adversary_files.launch_refused(model_path, path))
    assert got["ok"], got
