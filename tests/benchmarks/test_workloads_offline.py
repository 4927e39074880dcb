"""Workload pieces that need no server: GSM8K answers, the role set, the task programs."""

from __future__ import annotations

from benchmarks.workloads.tasks import extract_gsm8k_answer, load_gsm8k, normalize_number


def test_gsm8k_answers():
    assert extract_gsm8k_answer("so 3 + 4 = 7. The answer is 1,234.") == "1234"
    assert extract_gsm8k_answer("We get $18 in total") == "18"
    assert extract_gsm8k_answer("no number") == ""
    assert normalize_number("2.50") == "2.5"
    samples = load_gsm8k(2)
    assert samples[0].reference == "18" and samples[1].reference == "3"


def test_the_role_set_splits_24_distinct_roles_and_draws_them_per_sample():
    from benchmarks.workloads.role_set import DEV, HELDOUT, draw

    names = [r.name for r in DEV + HELDOUT]
    assert len(DEV) == len(HELDOUT) == 12 and len(set(names)) == 24
    assert not {r.system for r in DEV} & {r.system for r in HELDOUT}
    lengths = sorted(len(r.system) for r in HELDOUT)
    assert lengths[0] < 40 and lengths[-1] > 200  # one line to a paragraph in each half
    first = draw("heldout", "gsm8k/3", 4)
    assert first == draw("heldout", "gsm8k/3", 4) and len(set(first)) == 4 and set(first) <= set(HELDOUT)
    assert {draw("dev", f"s/{i}", 4) for i in range(20)} != {draw("dev", "s/0", 4)}  # roles rotate over samples


def test_a_frontier_program_on_a_split_reads_only_that_splits_roles_and_a_longer_document():
    from benchmarks.frontier import task_spec
    from benchmarks.workloads.role_set import HELDOUT

    spec = task_spec("retrieval", 0, "heldout", 68)
    sample = spec.load(1, 0)[0]
    assert len(sample.facts) == 68 and len({f.key for f in sample.facts}) == 68
    calls = list(spec.program(sample, lambda text: [ord(c) for c in text], 8))
    assert {c.agent for c in calls} <= {r.name for r in HELDOUT} and len({c.agent for c in calls}) == 4
    gsm = task_spec("gsm8k", 0, "dev")
    program = gsm.program(gsm.load(1, 0)[0], lambda text: [ord(c) for c in text], 8)
    agents = [next(program).agent] + [program.send([1, 2]).agent for _ in range(3)]
    assert len(set(agents)) == 4 and "final" not in agents


def test_the_roles_study_reads_each_part_where_the_frontier_writes_it(tmp_path):
    from benchmarks import frontier, roles_study

    for split in ("dev", "heldout"):
        for task in roles_study.TASKS:
            args = frontier.parse_args(roles_study.part_argv(task, split, tmp_path, 16))
            written = tmp_path / f"frontier_{args.task}{args.tag}.json"
            assert roles_study.part_path(tmp_path, task, split) == written and args.roles == split
            assert "default" in args.arms or split == "dev"
