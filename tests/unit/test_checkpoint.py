"""Single-process checkpoints (no process group: DCP ``no_dist``): bitwise round trips, atomic directories,
pruning, verification on resume (flipped byte, missing file, partial dirs), JSON packing and RNG states."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from conftest import scaled
from hypothesis import strategies as st

from reference_trainer import checkpoint
from reference_trainer.checkpoint import (CheckpointError, find_latest, load, pack_json, rng_state, save,
                                          set_rng_state, unpack_json)


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"layers": {"0": {"weight": torch.randn(4, 3, generator=g),
                                   "bias": torch.randn(3, generator=g).to(torch.bfloat16)}},
                  "embed": torch.randint(-2**40, 2**40, (5,), generator=g, dtype=torch.int64)},
        "optim": {"state": {0: {"exp_avg": torch.randn(4, 3, generator=g), "step": torch.tensor(float(seed))},
                            1: {"exp_avg": torch.randn(3, generator=g), "step": torch.tensor(float(seed))}},
                  "param_groups": pack_json([{"lr": 1e-3, "params": [0, 1]}])},
        "mask": torch.randint(0, 256, (7,), generator=g, dtype=torch.int64).to(torch.uint8),
        "layers_list": [torch.randn(2, generator=g), torch.randn(1, generator=g)],
    }


def _zeros_like(state):
    if isinstance(state, dict):
        return {k: _zeros_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_zeros_like(v) for v in state]
    return torch.zeros_like(state)


def _assert_bitwise(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_bitwise(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_bitwise(x, y)
    else:
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8) if a.dim() else a.reshape(1).view(torch.uint8),
                           b.view(torch.uint8) if b.dim() else b.reshape(1).view(torch.uint8))


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_round_trip_is_bitwise_and_in_place(tmp_path):
    original = _state(3)
    path = save(tmp_path, 7, original)
    assert path == tmp_path / "step-00000007" and _steps(tmp_path) == ["step-00000007"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 7 and manifest["world_size"] == 1 and manifest["torch_version"] == torch.__version__
    assert ".metadata" in manifest["files"] and all(len(f["sha256"]) == 64 for f in manifest["files"].values())
    target = _zeros_like(original)
    weight = target["model"]["layers"]["0"]["weight"]
    assert find_latest(tmp_path) == (path, 7)
    assert load(path, target) == 7
    _assert_bitwise(target, original)
    assert target["model"]["layers"]["0"]["weight"] is weight  # loaded in place
    assert unpack_json(target["optim"]["param_groups"]) == [{"lr": 1e-3, "params": [0, 1]}]


def test_keep_prunes_old_checkpoints_and_resave_replaces(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step, _state(step))
    assert _steps(tmp_path) == ["step-00000002", "step-00000003"]
    save(tmp_path, 4, _state(4), keep=1)
    assert _steps(tmp_path) == ["step-00000004"]
    save(tmp_path, 4, _state(40), keep=1)  # the same step again: replaced, not refused
    target = _zeros_like(_state(0))
    load(tmp_path / "step-00000004", target)
    _assert_bitwise(target, _state(40))
    assert _steps(tmp_path) == ["step-00000004"]


def _corrupt_shard(path: Path) -> str:
    shard = next(p for p in path.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    return shard.name


def test_flipped_byte_is_refused_and_the_older_checkpoint_used(tmp_path, capsys):
    old, new = save(tmp_path, 5, _state(5)), save(tmp_path, 10, _state(10))
    name = _corrupt_shard(new)
    assert find_latest(tmp_path) == (old, 5)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert lines == [f"warning: checkpoint {new} refused: file {name}: sha256 mismatch; using {old}"]
    target = _zeros_like(_state(0))
    assert load(old, target) == 5
    _assert_bitwise(target, _state(5))


def test_missing_file_and_truncation_are_refused(tmp_path, capsys):
    first = save(tmp_path, 1, _state(1))
    second = save(tmp_path, 2, _state(2))
    (second / ".metadata").unlink()
    assert find_latest(tmp_path) == (first, 1)
    shard = next(p for p in first.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(CheckpointError) as refused:  # none verifies: starting over would overwrite them
        find_latest(tmp_path)
    assert str(refused.value).startswith(f"every checkpoint in {tmp_path} failed verification (step-00000002, "
                                         "step-00000001; the warnings above say why): none can be resumed")
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert err[0] == f"warning: checkpoint {second} refused: file .metadata: missing; using {first}"
    assert f"warning: checkpoint {first} refused: file {shard.name}: size" in err[-1] and err[-1].endswith("none")
    with pytest.raises(CheckpointError, match=r"step-00000001 refused: file __0_0\.distcp: size"):
        load(first, _zeros_like(_state(0)))


def test_partial_checkpoints_are_ignored_with_a_warning(tmp_path, capsys):
    good = save(tmp_path, 3, _state(3))
    no_manifest = save(tmp_path, 4, _state(4), keep=5)
    (no_manifest / "manifest.json").unlink()
    bad_manifest = save(tmp_path, 6, _state(6), keep=5)
    (bad_manifest / "manifest.json").write_text("{not json")
    leftover = tmp_path / ".tmp-step-00000009-deadbeef"  # a crash mid-save leaves only this
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"half")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert find_latest(tmp_path) == (good, 3)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(err) == 3 and all(line.endswith(f"; using {good}") for line in err)
    assert any(str(leftover) in line and "partial" in line for line in err)
    assert any(str(no_manifest) in line and "missing manifest.json" in line for line in err)
    assert any(str(bad_manifest) in line and "invalid manifest.json" in line for line in err)
    os.utime(leftover, (0, 0))  # older than the next save: it cleans the leftover up
    save(tmp_path, 11, _state(11), keep=5)
    assert not leftover.exists() and (tmp_path / "notes.txt").exists()
    assert (no_manifest).exists()  # a step dir without a manifest is not ours to delete



def test_a_manifest_nested_deeper_than_json_parses_is_skipped_like_any_invalid_one(tmp_path, capsys):
    """``[[[[...`` raises RecursionError, not ValueError, in ``json.loads``: it refused the whole resume before."""
    good = save(tmp_path, 4, _state(4))
    deep = save(tmp_path, 5, _state(5), keep=5)
    (deep / "manifest.json").write_text("[" * 100_000)
    assert find_latest(tmp_path) == (good, 4)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert err == [f"warning: checkpoint {deep} refused: invalid manifest.json: nested too deeply; using {good}"]

def test_a_manifest_whose_step_is_text_names_it_as_text(tmp_path, capsys):
    """A hand-edited ``"step": "5"`` read "records step 5, not 5"."""
    good = save(tmp_path, 4, _state(4))
    edited = save(tmp_path, 5, _state(5), keep=5)
    manifest = json.loads((edited / "manifest.json").read_text())
    (edited / "manifest.json").write_text(json.dumps({**manifest, "step": "5"}))
    assert find_latest(tmp_path) == (good, 4)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert err == [f"warning: checkpoint {edited} refused: manifest.json records step '5', not 5 (its folder's "
                   f"name); using {good}"]


def test_a_checkpoint_dcp_cannot_read_is_refused_and_the_one_before_it_loaded(tmp_path, capsys):
    """A shard deleted and taken out of the manifest by hand verifies (every listed file is there, hashes right)
    but DCP cannot read it: the resume refuses it in one warning and loads the checkpoint before, bitwise; with
    none before, one error naming both."""
    from reference_trainer.checkpoint import load_latest

    good = save(tmp_path, 4, _state(4))
    edited = save(tmp_path, 5, _state(5), keep=5)
    manifest = json.loads((edited / "manifest.json").read_text())
    shard = next(name for name in manifest["files"] if name.endswith(".distcp"))
    (edited / shard).unlink()
    del manifest["files"][shard]
    (edited / "manifest.json").write_text(json.dumps(manifest))
    assert find_latest(tmp_path) == (edited, 5)  # it verifies
    state = _state(0)
    assert load_latest(tmp_path, state) == (good, 4)
    assert torch.equal(state["model"]["layers"]["0"]["weight"], _state(4)["model"]["layers"]["0"]["weight"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(err) == 1 and err[0].startswith(f"warning: checkpoint {edited} refused: DCP load failed: rank 0: ")
    assert err[0].endswith(f"; using {good}")
    import shutil

    shutil.rmtree(good)
    with pytest.raises(CheckpointError, match=r"DCP load failed: .*; no earlier checkpoint in .* verifies: none can "
                                              r"be resumed"):
        load_latest(tmp_path, _state(0))
    assert capsys.readouterr().err.strip().endswith("; using none")


def test_paths_that_are_not_checkpoint_dirs_are_refused(tmp_path):
    afile = tmp_path / "ckpt"
    afile.write_text("x")
    with pytest.raises(CheckpointError, match=r"^checkpoint directory .*ckpt: exists and is not a directory$"):
        save(afile, 1, _state())
    with pytest.raises(CheckpointError, match="not a directory"):
        find_latest(afile)
    assert find_latest(tmp_path / "absent") is None
    (tmp_path / "step-00000002").write_text("a file in the way")
    with pytest.raises(CheckpointError, match=r"step-00000002: exists and is not a checkpoint directory"):
        save(tmp_path, 2, _state())
    (tmp_path / "step-00000003").mkdir()
    with pytest.raises(CheckpointError, match=r"step-00000003: exists and is not a checkpoint directory"):
        save(tmp_path, 3, _state())
    assert (tmp_path / "step-00000002").read_text() == "a file in the way"


@pytest.mark.parametrize("bad, what", [({"x": 3}, "x is a int"), ({"a": {"b": (torch.zeros(1),)}}, "a.b is a tuple"),
                                       ({"l": []}, "empty list"), ({"a.b": torch.zeros(1), "a": {"b": torch.ones(1)}},
                                                                   "flatten to the key 'a.b'")])
def test_non_tensor_leaves_are_refused(tmp_path, bad, what):
    with pytest.raises(CheckpointError, match=what):
        save(tmp_path, 1, bad)
    assert list(tmp_path.iterdir()) == []


def test_load_errors_are_one_line(tmp_path):
    path = save(tmp_path, 1, {"a": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"DCP load failed: .*Missing key in checkpoint state_dict: b") as exc:
        load(path, {"b": torch.zeros(2)})
    assert "\n" not in str(exc.value)
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, "world_size": 4}))
    with pytest.raises(CheckpointError, match=r"saved by 4 ranks, this job has 1$"):
        load(path, {"a": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="refused: missing or not a directory"):
        load(tmp_path / "nope", {"a": torch.zeros(2)})


def test_pack_json_fixed_size_and_errors():
    t = pack_json({"a": [1, 2.5, None, "é"]}, size=64)
    assert t.dtype == torch.uint8 and t.shape == (64,) and unpack_json(t) == {"a": [1, 2.5, None, "é"]}
    with pytest.raises(CheckpointError, match="do not fit"):
        pack_json("x" * 10, size=4)
    with pytest.raises(CheckpointError, match="not JSON-serialisable"):
        pack_json(float("nan"))
    with pytest.raises(CheckpointError, match="not JSON-serialisable"):
        pack_json(object())
    with pytest.raises(CheckpointError, match="1-d uint8"):
        unpack_json(torch.zeros(3))


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                     | st.text(), lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner), max_leaves=20)


@pytest.mark.slow
@given(_json)
def test_pack_json_round_trip(obj):
    assert unpack_json(pack_json(obj)) == obj


_dtypes = st.sampled_from([torch.float32, torch.int64, torch.uint8, torch.bfloat16, torch.float64, torch.bool])


@settings(max_examples=scaled(15))
@given(st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True),
                       st.tuples(_dtypes, st.lists(st.integers(0, 4), max_size=3), st.integers(0, 2**31)),
                       min_size=1, max_size=5))
def test_random_tensor_dicts_round_trip(tmp_path_factory, specs):
    state = {}
    for name, (dtype, shape, seed) in specs.items():
        raw = torch.randint(0, 256, (int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size(),),
                            generator=torch.Generator().manual_seed(seed), dtype=torch.int64).to(torch.uint8)
        t = raw.view(dtype).reshape(shape) if dtype != torch.bool else (raw % 2).bool().reshape(shape)
        state[name] = {"t": t}  # any bit pattern, NaN payloads included
    root = tmp_path_factory.mktemp("prop")
    path = save(root, 0, state)
    target = _zeros_like(state)
    assert load(path, target) == 0
    _assert_bitwise(target, state)


def _draws() -> tuple:
    return torch.rand(5).tolist(), [random.random() for _ in range(5)], np.random.rand(5).tolist()


def test_rng_state_round_trip_through_a_checkpoint(tmp_path):
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    random.gauss(0, 1), np.random.standard_normal()  # cached gaussians are part of the state too
    state = rng_state()
    assert all(t.dtype == torch.uint8 for t in state.values())
    expected = _draws()
    set_rng_state(state)
    assert _draws() == expected
    path = save(tmp_path, 1, {"rank0": {"rng": state}})
    _draws(), _draws()
    target = {"rank0": {"rng": rng_state()}}  # a template of the same shapes: loaded in place
    load(path, target)
    set_rng_state(target["rank0"]["rng"])
    assert _draws() == expected
    with pytest.raises(CheckpointError, match="missing"):
        set_rng_state({"torch": state["torch"]})


def test_a_crash_mid_save_leaves_only_a_temporary_dir(tmp_path, monkeypatch, capsys):
    import torch.distributed.checkpoint as dcp

    good = save(tmp_path, 1, _state(1))
    real_save = dcp.save

    def crash(state, checkpoint_id):
        real_save(state, checkpoint_id=checkpoint_id)
        (Path(checkpoint_id) / ".metadata").write_bytes(b"torn")
        raise KeyboardInterrupt  # the process dies before rank 0 writes the manifest

    monkeypatch.setattr(dcp, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, 2, _state(2))
    monkeypatch.undo()
    leftover = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-step-00000002-")]
    assert len(leftover) == 1 and _steps(tmp_path) == sorted(["step-00000001", leftover[0].name])
    assert find_latest(tmp_path) == (good, 1)
    assert f"warning: checkpoint {leftover[0]} refused: partial" in capsys.readouterr().err
    os.utime(leftover[0], (0, 0))
    save(tmp_path, 2, _state(2))
    assert _steps(tmp_path) == ["step-00000001", "step-00000002"]


def test_resaving_an_older_step_never_prunes_the_new_checkpoint(tmp_path):
    save(tmp_path, 5, _state(5))
    _corrupt_shard(save(tmp_path, 10, _state(10)))  # resume falls back to 5 and trains on
    assert find_latest(tmp_path)[1] == 5
    assert save(tmp_path, 6, _state(6), keep=1).exists()
    assert _steps(tmp_path) == ["step-00000006"] and find_latest(tmp_path)[1] == 6


def test_a_crash_while_retention_deletes_leaves_only_a_temporary_dir(tmp_path, monkeypatch):
    """Retention renames an old checkpoint to a ``.tmp-*`` name before deleting it: a kill mid-deletion leaves a
    directory the next save sweeps, never a partial ``step-*`` one that no retention would count or remove."""
    save(tmp_path, 1, _state(1))
    save(tmp_path, 2, _state(2))
    real_rmtree = checkpoint.shutil.rmtree

    def crash(path, *args, **kwargs):
        if not Path(path).is_dir():
            return real_rmtree(path, *args, **kwargs)
        (Path(path) / checkpoint.MANIFEST).unlink()  # part of it deleted, then the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.shutil, "rmtree", crash)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, 3, _state(3))
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real_rmtree)
    leftover = [p.name for p in tmp_path.iterdir() if not p.name.startswith("step-")]
    assert _steps(tmp_path) == sorted(["step-00000002", "step-00000003", *leftover])
    assert len(leftover) == 1 and leftover[0].startswith(".tmp-step-00000001-")
    os.utime(tmp_path / leftover[0], (0, 0))  # older than the next save (a restart comes seconds later)
    save(tmp_path, 4, _state(4))
    assert _steps(tmp_path) == ["step-00000003", "step-00000004"]
