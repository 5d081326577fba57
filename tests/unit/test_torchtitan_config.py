"""The torchtitan integration without torchtitan: the module imports (torchtitan blocked), its ``[bagualu2]`` config
refuses bad values in one line naming the field, and the op map reads a torchtitan-shaped decoder."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from bagualu2.integrations.torchtitan import Bagualu2Config, JobConfig, op_map


def one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text and text
    return text


@pytest.mark.launch
def test_the_module_imports_without_torchtitan():
    code = ("import sys; sys.modules['torchtitan'] = None\n"
            "from bagualu2.integrations import torchtitan as t\n"
            "assert t.JobConfig().bagualu2.policy == 'flexible'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("field, value, message", [
    ("policy", "greedy", "bagualu2.policy must be one of flexible, static-over, static-under, off"),
    ("memory_cap_mib", -1, "bagualu2.memory_cap_mib must be a number >= 0"),
    ("memory_cap_mib", "8", "bagualu2.memory_cap_mib must be a number >= 0"),
    ("memory_cap_mib", float("inf"), "bagualu2.memory_cap_mib must be a number >= 0 and <= 1073741824"),
    ("memory_cap_mib", 1e305, "bagualu2.memory_cap_mib must be a number >= 0 and <= 1073741824"),
    ("memory_cap_mib", float("nan"), "bagualu2.memory_cap_mib must be a number >= 0"),
    ("downgrade", "full", "bagualu2.downgrade must be graded or paper"),
    ("quantize", "no", "bagualu2.quantize must be true or false"),
    ("report_path", 3, "bagualu2.report_path must be a path string"),
])
def test_bad_values_are_one_line_naming_the_field(field, value, message):
    with pytest.raises(ValueError) as excinfo:
        Bagualu2Config(**{field: value})
    assert message in one_line(excinfo)


def test_the_cap_in_bytes():
    assert Bagualu2Config(memory_cap_mib=1.5).cap_bytes == 3 << 19
    assert Bagualu2Config().cap_bytes is None and Bagualu2Config(memory_cap_mib=4, policy="off").cap_bytes is None
    assert JobConfig().bagualu2 == Bagualu2Config()


class _Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(4, 4)


class _Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(4, 4, 4))


class _FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)


class _MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router, self.experts, self.shared_experts = _Router(), _Experts(), _FeedForward()


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wkv_a, self.kv_norm, self.wkv_b, self.wo = (nn.Linear(4, 4), nn.Linear(4, 4), nn.LayerNorm(4),
                                                                  nn.Linear(4, 4), nn.Linear(4, 4))


class _Block(nn.Module):
    def __init__(self, moe: bool):
        super().__init__()
        self.attention_norm, self.attention, self.ffn_norm = nn.LayerNorm(4), _Attention(), nn.LayerNorm(4)
        if moe:
            self.moe = _MoE()
        else:
            self.feed_forward = _FeedForward()


def test_the_op_map_of_a_stage_part():
    part = nn.Module()
    part.layers = nn.ModuleDict({"2": _Block(moe=False), "3": _Block(moe=True)})  # global layer ids, as after a split
    labels = op_map(part)
    assert labels["layers.2.attention_norm"] == "norm1" and labels["layers.3.ffn_norm"] == "norm2"
    assert labels["layers.3.attention"] == "core_attn" and labels["layers.3.attention.wkv_a"] == "qkv"
    assert labels["layers.3.attention.wo"] == "attn_out" and "layers.3.attention.kv_norm" not in labels
    assert labels["layers.3.moe"] == "moe" and labels["layers.3.moe.router"] == "router"
    assert labels["layers.3.moe.experts"] == "dispatch"
    assert labels["layers.3.moe.shared_experts.w1"] == labels["layers.3.moe.shared_experts.w3"] == "shared_fc1"
    assert labels["layers.2.feed_forward.w2"] == "mlp_fc2"


def test_a_model_that_is_not_a_torchtitan_decoder():
    with pytest.raises(ValueError) as excinfo:
        op_map(nn.Sequential(nn.Linear(2, 2)))
    assert "has no ModuleDict 'layers'" in one_line(excinfo)


def _converter(*, ep: int = 1, tp: int = 1, report_path: str = "", schedule: str = "1F1B", csv: str = "",
               section=None, microbatch_size=1, config_file=None):
    from types import SimpleNamespace

    from bagualu2.integrations.torchtitan import Bagualu2Converter

    job = SimpleNamespace(bagualu2=Bagualu2Config(memory_cap_mib=8, report_path=report_path) if section is None
                          else section,
                          activation_checkpoint=SimpleNamespace(mode="none"),
                          parallelism=SimpleNamespace(pipeline_parallel_schedule=schedule,
                                                      pipeline_parallel_schedule_csv=csv,
                                                      pipeline_parallel_microbatch_size=microbatch_size),
                          training=SimpleNamespace(local_batch_size=4),
                          model=SimpleNamespace(name="llama3", flavor="debugmodel"),
                          job=SimpleNamespace(config_file=config_file))
    dims = SimpleNamespace(tp_enabled=tp > 1, cp_enabled=False, ep_enabled=ep > 1, ep=ep, tp=tp, cp=1,
                           pp_enabled=True)
    return Bagualu2Converter(job, dims)


def _decoder(grouped: bool):
    part = nn.Module()
    part.layers = nn.ModuleDict({"0": _Block(moe=True)})
    part.layers["0"].moe.experts.use_grouped_mm = grouped
    return part


def test_expert_parallelism_needs_the_grouped_gemm_experts():
    with pytest.raises(ValueError) as excinfo:
        _converter(ep=2).convert(_decoder(grouped=False))
    assert "needs torchtitan's grouped-GEMM experts (moe_args.use_grouped_mm" in one_line(excinfo)
    _converter(ep=2).convert(_decoder(grouped=True))  # accepted: its hooks go on
    _converter(ep=1).convert(_decoder(grouped=False))  # without expert parallelism the loop is fine


def test_tensor_parallelism_is_refused_in_one_line():
    with pytest.raises(ValueError) as excinfo:
        _converter(tp=2)
    assert one_line(excinfo).startswith("parallelism.tensor_parallel_degree and "
                                        "parallelism.context_parallel_degree must be 1")
    assert one_line(excinfo).endswith("got 2 and 1")


def test_a_model_without_moe_layers_names_the_model_and_what_runs():
    part = nn.Module()
    part.layers = nn.ModuleDict({"0": _Block(moe=False)})
    with pytest.raises(ValueError) as excinfo:
        _converter().convert(part)
    assert one_line(excinfo).startswith("model.name / model.flavor llama3 / debugmodel: Module has no MoE layer")
    assert "runs the MoE flavors of deepseek_v3, qwen3, llama4, gpt_oss" in one_line(excinfo)


def test_report_paths_every_rank_can_write_are_checked_before_training(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError) as excinfo:  # two ranks would overwrite one file
        _converter(report_path=str(tmp_path / "report.json"))
    assert "must contain {rank} when 2 ranks run" in one_line(excinfo)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError) as excinfo:
        _converter(report_path=str(tmp_path / "afile" / "r{rank}.json"))
    assert "cannot write in" in one_line(excinfo)
    (tmp_path / "r0.json").mkdir()
    with pytest.raises(ValueError) as excinfo:
        _converter(report_path=str(tmp_path / "r{rank}.json"))
    assert "exists and is a directory" in one_line(excinfo)
    _converter(report_path=str(tmp_path / "new" / "deeper" / "r{rank}.json"))  # a folder that can be made is fine
    assert not (tmp_path / "new").exists()  # made by the report's first write: a run refused later leaves nothing
    from bagualu2.integrations.torchtitan_stage import read_report, write_report

    assert write_report(str(tmp_path / "new" / "deeper" / "r{rank}.json"), 0, 1, [], fresh=True)
    assert read_report(next((tmp_path / "new" / "deeper").iterdir()))["step_numbers"] == [1]
    with pytest.raises(ValueError) as excinfo:
        _converter(report_path=str(tmp_path / "afile" / "new" / "r{rank}.json"))
    assert "cannot write in" in one_line(excinfo) and "is not a folder" in one_line(excinfo)
    _converter(schedule="1f1b")  # torch matches schedule names in any case


def test_a_report_never_replaces_a_link_and_is_written_with_the_umask(tmp_path):
    from bagualu2.integrations.torchtitan_stage import UMASK, read_report, write_report

    target = tmp_path / "elsewhere.jsonl"
    target.write_text("{}")
    (tmp_path / "link.jsonl").symlink_to(target)
    with pytest.raises(ValueError) as excinfo:
        write_report(str(tmp_path / "link.jsonl"), 0, 1, [], fresh=True)
    assert "exists and is a symlink" in one_line(excinfo) and target.read_text() == "{}"
    report = tmp_path / "r.jsonl"
    report.write_text("an earlier run's report\n")
    write_report(str(report), 0, 1, [{"forward": 0}], fresh=True)  # the run's first step replaces it
    assert report.stat().st_mode & 0o777 == 0o666 & ~UMASK
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    write_report(str(report), 0, 2, [{"forward": 0}, {"forward": 1}], fresh=False)  # then one line per step
    assert len(report.read_text().splitlines()) == 2
    with open(report, "a") as out:
        out.write('{"stage": 0, "st')  # a run stopped mid-write
    assert read_report(report) == {"stage": 0, "steps": [[{"forward": 0}], [{"forward": 0}, {"forward": 1}]],
                                   "step_numbers": [1, 2]}
    report.write_text("not json\n" + report.read_text())
    with pytest.raises(ValueError, match="line 1: not a report line"):
        read_report(report)


def test_a_report_path_naming_a_folder_and_a_schedule_from_a_file_are_refused(tmp_path):
    with pytest.raises(ValueError) as excinfo:
        _converter(report_path=str(tmp_path) + "/")
    assert "must name a file" in one_line(excinfo)
    with pytest.raises(ValueError) as excinfo:
        _converter(csv=str(tmp_path / "schedule.csv"))
    assert "pipeline_parallel_schedule_csv must be empty" in one_line(excinfo)


def test_a_model_converted_twice_is_refused():
    converter, model = _converter(), _decoder(grouped=False)
    converter.convert(model)
    with pytest.raises(ValueError) as excinfo:
        _converter().convert(model)
    assert "converted by bagualu2 already" in one_line(excinfo)


def test_a_bagualu2_section_from_elsewhere_is_checked_field_by_field(tmp_path):
    from bagualu2.integrations.torchtitan_stage import read_report

    assert _converter(section={"memory_cap_mib": 8}).config == Bagualu2Config(memory_cap_mib=8)
    for section, message in (({"memory_cap": 8}, "bagualu2 has no field memory_cap; fields: "),
                             (8, "bagualu2 section must be a Bagualu2Config or a mapping"),
                             ("flexible", "bagualu2 section must be a Bagualu2Config or a mapping")):
        with pytest.raises(ValueError) as excinfo:
            _converter(section=section)
        assert message in one_line(excinfo)
    for field, value, message in (("policy", "x", "bagualu2.policy must be one of"),  # changed after it was built
                                  ("memory_cap_mib", float("nan"), "bagualu2.memory_cap_mib must be a number"),
                                  ("memory_cap_mib", -5.0, "bagualu2.memory_cap_mib must be a number"),
                                  ("downgrade", "bogus", "bagualu2.downgrade must be graded or paper"),
                                  ("quantize", "no", "bagualu2.quantize must be true or false"),
                                  ("report_path", 5, "bagualu2.report_path must be a path string")):
        section = Bagualu2Config(memory_cap_mib=8)
        setattr(section, field, value)
        with pytest.raises(ValueError) as excinfo:
            _converter(section=section)
        assert message in one_line(excinfo)
    with pytest.raises(ValueError) as excinfo:
        _converter(microbatch_size=0)
    assert "parallelism.pipeline_parallel_microbatch_size must be an integer >= 1" in one_line(excinfo)
    with pytest.raises(ValueError) as excinfo:
        _converter(report_path=str(tmp_path / "r\0.json"))
    assert "without NUL characters" in one_line(excinfo)
    for path, message in ((tmp_path / "missing.jsonl", "cannot read it"), (tmp_path, "cannot read it"),
                          (None, "path must be a report file's path")):
        with pytest.raises(ValueError) as excinfo:
            read_report(path)
        assert message in one_line(excinfo)


def test_a_report_path_is_checked_as_the_system_sees_it(tmp_path, monkeypatch):
    """A read-only report is not replaced, the system's own reason is named, ``~`` is the home folder, a name of
    blanks names no file; a rewritten report keeps its mode."""
    from bagualu2.integrations.torchtitan_stage import check_report_path, report_file, write_report

    monkeypatch.setenv("RANK", "0")
    read_only = tmp_path / "ro.jsonl"
    read_only.write_text("")
    read_only.chmod(0o444)
    with pytest.raises(ValueError) as excinfo:
        check_report_path(str(read_only), 1)
    assert one_line(excinfo).endswith("is read-only (not replaced)")
    with pytest.raises(ValueError) as excinfo:
        check_report_path(str(tmp_path / ("x" * 300 + ".jsonl")), 1)
    assert one_line(excinfo).endswith("File name too long")
    with pytest.raises(ValueError, match="must name a file"):
        check_report_path(str(tmp_path / "   "), 1)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert report_file("~/r{rank}.jsonl", 0) == str(tmp_path / "r0.jsonl")
    private = tmp_path / "private.jsonl"
    private.write_text("")
    private.chmod(0o640)  # not what any umask gives a new file
    write_report(str(private), 0, 1, [], fresh=True)
    assert private.stat().st_mode & 0o7777 == 0o640


def test_a_report_path_with_its_stage_is_checked_for_every_stage_before_the_first_step(tmp_path, monkeypatch):
    """``{stage}`` names the pipeline stage a rank runs: the check before training looks at the file of every
    stage, not stage 0's only (a later stage's read-only file was replaced, a folder in its way failed mid-run)."""
    from bagualu2.integrations.torchtitan_stage import check_report_path

    monkeypatch.setenv("RANK", "1")
    pattern = str(tmp_path / "r{rank}.s{stage}.jsonl")
    check_report_path(pattern, 2, stages=2)
    (tmp_path / "r1.s1.jsonl").mkdir()
    with pytest.raises(ValueError) as excinfo:
        check_report_path(pattern, 2, stages=2)
    assert "r1.s1.jsonl" in one_line(excinfo) and "is a directory" in one_line(excinfo)
    check_report_path(pattern, 2, stages=1)  # no pipeline: stage 0 only
    (tmp_path / "s1").write_text("a file where stage 1's folder goes")
    with pytest.raises(ValueError) as excinfo:
        check_report_path(str(tmp_path / "s{stage}" / "r{rank}.jsonl"), 2, stages=2)
    assert "is not a folder" in one_line(excinfo)
    read_only = tmp_path / "ro1.s1.jsonl"
    read_only.write_text("")
    read_only.chmod(0o444)
    with pytest.raises(ValueError) as excinfo:
        check_report_path(str(tmp_path / "ro{rank}.s{stage}.jsonl"), 2, stages=2)
    assert one_line(excinfo).endswith("is read-only (not replaced)")


def test_a_resumed_report_keeps_only_its_own_stages_earlier_steps(tmp_path):
    """A launch of another layout left stage 1's lines in this rank's file: the resumed stage 0 keeps its own."""
    import json

    from bagualu2.integrations.torchtitan_stage import read_report, write_report

    report = tmp_path / "r.jsonl"
    report.write_text("".join(json.dumps({"stage": stage, "step": step, "rows": []}) + "\n"
                              for stage, step in [(1, 1), (1, 2), (0, 1), (0, 2), (0, 3)]))
    write_report(str(report), 0, 3, [{"forward": 0}], fresh=True)
    assert read_report(report) == {"stage": 0, "steps": [[], [], [{"forward": 0}]], "step_numbers": [1, 2, 3]}


def test_a_scalar_bagualu2_in_the_toml_file_is_refused(tmp_path):
    """torchtitan's parser replaces ``bagualu2 = 5`` by the section's defaults (no cap) without a word."""
    for text, fine in (("bagualu2 = 5\n", False), ("bagualu2 = true\n", False),
                       ("[bagualu2]\nmemory_cap_mib = 8\n", True), ("[job]\ndump_folder = 'x'\n", True)):
        path = tmp_path / "job.toml"
        path.write_text(text)
        if fine:
            _converter(config_file=str(path))
            continue
        with pytest.raises(ValueError) as excinfo:
            _converter(config_file=str(path))
        assert one_line(excinfo).startswith(f"{path}: bagualu2 must be a table ([bagualu2] with its fields below it)")


def test_a_section_the_converter_list_leaves_unread_is_named():
    """A ``[bagualu2]`` section provisions nothing unless ``model.converters`` lists ``bagualu2``: a section that
    sets a field without it is one warning naming the fields (torchtitan's log, when its metrics are built)."""
    from types import SimpleNamespace

    from bagualu2.integrations.torchtitan import unlisted_section

    def job(section, *converters):
        return SimpleNamespace(bagualu2=section, model=SimpleNamespace(converters=list(converters)))

    message = unlisted_section(job(Bagualu2Config(memory_cap_mib=96, policy="static-over"), "float8"))
    assert message == ("bagualu2: the [bagualu2] section sets policy, memory_cap_mib, but model.converters (float8) "
                       "does not list bagualu2, so nothing is provisioned; add --model.converters bagualu2")
    assert "model.converters (none)" in unlisted_section(job(Bagualu2Config(quantize=False)))
    spelt = SimpleNamespace(bagualu2=Bagualu2Config(memory_cap_mib=8), model=SimpleNamespace(converters="bagualu2x"))
    assert "model.converters (bagualu2x) does not list" in unlisted_section(spelt)
    spelt.model.converters = "float8, bagualu2"
    assert unlisted_section(spelt) is None
    assert "has no field memory_cap" in unlisted_section(job({"memory_cap": 8}))
    for quiet in (job(Bagualu2Config(memory_cap_mib=96), "bagualu2"), job(Bagualu2Config()),
                  SimpleNamespace(model=SimpleNamespace(converters=[]))):
        assert unlisted_section(quiet) is None
