"""The ranks' agreement before the first collective (``reference_trainer.startup.verdict``); the launches themselves:
tests/integration/test_trainer.py."""

from __future__ import annotations

from reference_trainer.recipes import recipe
from reference_trainer.startup import fingerprint, verdict
from reference_trainer.train import FLAG_NAMES, parse_args


def test_ranks_with_the_same_flags_agree():
    config = fingerprint(recipe("glm_moe_debug"))
    assert verdict({0: {"config": config}, 1: {"config": config}}, FLAG_NAMES) is None


def test_the_lowest_rank_with_an_error_is_reported_with_its_rank():
    config = fingerprint(recipe("glm_moe_debug"))
    reports = {0: {"config": config}, 1: {"error": "--lr must be > 0"}, 2: {"error": "--seed x"}}
    assert verdict(reports, FLAG_NAMES) == "rank 1: --lr must be > 0"
    assert verdict({0: {"error": "--lr must be > 0"}, 1: {"error": "--lr must be > 0"}}, FLAG_NAMES) == \
        "--lr must be > 0"


def test_different_flags_name_the_flag_and_both_values():
    one, _ = parse_args(["--seed", "1", "--data", "a.txt"])
    other, _ = parse_args(["--seed", "1", "--data", "b.txt"])
    line = verdict({0: {"config": fingerprint(one)}, 1: {"config": fingerprint(one)},
                    2: {"config": fingerprint(other)}}, FLAG_NAMES)
    assert line.startswith('the ranks were launched with different flags: --data is "a.txt" on rank 0 and "b.txt" '
                           "on rank 2"), line
    bench, _ = parse_args(["--recipe", "glm_moe_bench"])
    line = verdict({0: {"config": fingerprint(one)}, 1: {"config": fingerprint(bench)}}, FLAG_NAMES)
    assert "--recipe" in line and "rank 1" in line


def test_a_field_no_flag_sets_is_named_as_the_recipes():
    config = fingerprint(recipe("glm_moe_debug"))
    unnamed = sorted(set(config) - set(FLAG_NAMES))
    assert unnamed == ["weight_decay"]  # every other field has its flag; a new field must be named or listed here
    changed = {**config, "weight_decay": 0.5}
    assert "the recipe's weight_decay is 0.0 on rank 0 and 0.5 on rank 1" in verdict(
        {0: {"config": config}, 1: {"config": changed}}, FLAG_NAMES)


def test_a_run_takes_one_intra_op_thread_unless_omp_num_threads_says_otherwise(monkeypatch):
    """As torchrun gives its workers: a one-process run computes as every rank of a launch does."""
    import torch

    from reference_trainer.startup import one_thread_unless_told

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        one_thread_unless_told()
        assert torch.get_num_threads() == 2
        monkeypatch.delenv("OMP_NUM_THREADS")
        one_thread_unless_told()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
