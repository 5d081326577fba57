"""Gantt charts of a simulated order: text rows match the timeline; the PNG is a PNG, written atomically."""

from __future__ import annotations


import pytest

from bagualu2.costmodel import Resource
from bagualu2.fusion import Chain, Chains, Event, Stage, Timeline, dp, simulate
from bagualu2.fusion.gantt import gantt_png, gantt_text

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
C, M, D, H = Resource.COMPUTE, Resource.COMM, Resource.D2H, Resource.H2D


def chains() -> Chains:
    def chain(kind: str, *stages: tuple[Resource, int]) -> Chain:
        return Chain(kind, tuple(Stage(f"{kind}{i}", r, d) for i, (r, d) in enumerate(stages)))

    return Chains(chain("F", (C, 400), (M, 200), (C, 300)), chain("B", (C, 500), (M, 250), (C, 350)),
                  chain("O", (D, 300), (D, 200)), chain("R", (H, 150), (C, 100)))


def timeline() -> Timeline:
    ch = chains()
    return simulate(dp.solve(ch), ch)


def rows(text: str) -> dict[str, str]:
    """Resource name -> the cells between the bars."""
    out = {}
    for line in text.splitlines():
        name, bar, rest = line.partition("|")
        if bar and name.strip() in {r.value for r in Resource}:
            assert rest.endswith("|")
            out[name.strip()] = rest[:-1]
    return out


def test_hand_made_timeline_exact_rows() -> None:
    events = (Event("F", 0, C, 0, 50), Event("B", 0, C, 50, 100), Event("O", 0, D, 20, 40),
              Event("R", 0, H, 0, 10), Event("B", 1, M, 70, 100))
    tl = Timeline(events, 100, {}, 0)
    text = gantt_text(tl, width=10)
    assert rows(text) == {"compute": "FFFFFBBBBB", "comm": ".......BBB", "d2h": "..OO......", "h2d": "R........."}
    assert text.splitlines()[0].startswith("makespan 0.000 ms")  # 100 ns
    assert "F forward (1 stage), B backward (2 stages), O offload (1 stage), R recovery (1 stage)" in text


@pytest.mark.parametrize("width", [1, 7, 40, 100, 333])
def test_rows_match_the_timeline(width: int) -> None:
    tl = timeline()
    text = gantt_text(tl, chains(), width=width)
    assert text == gantt_text(tl, chains(), width=width)  # deterministic
    cells = rows(text)
    assert list(cells) == [r.value for r in Resource]  # compute, comm, d2h, h2d, in that order
    total = tl.makespan_ns
    for resource in Resource:
        row = cells[resource.value]
        assert len(row) == width
        mine = [e for e in tl.events if e.resource is resource and e.end_ns > e.start_ns]
        for c, letter in enumerate(row):
            lo, hi = c * total / width, (c + 1) * total / width
            touching = [e for e in mine if e.start_ns < hi and e.end_ns > lo]
            if not touching:
                assert letter == "."
                continue
            assert letter in {e.chain for e in touching}
            inside = [e for e in touching if e.start_ns <= lo and e.end_ns >= hi]
            if inside:  # a cell covered by one stage shows that stage's chain
                assert letter == inside[0].chain
        for e in mine:  # every stage at least two cells long is visible
            if (e.end_ns - e.start_ns) * width >= 2 * total:
                assert e.chain in row[int(e.start_ns * width // total):int(-(-e.end_ns * width // total))]


def test_header_axis_and_legend() -> None:
    tl = timeline()
    lines = gantt_text(tl, chains(), width=80).splitlines()
    assert lines[0].startswith(f"makespan {tl.makespan_ns * 1e-6:.3f} ms")
    assert f"exposed mitigation {tl.exposed_mitigation_ns * 1e-6:.3f} ms" in lines[0]
    axis = lines[5]
    assert axis.startswith("ms") and axis.split()[1] == "0" and axis.split()[-1] == f"{tl.makespan_ns * 1e-6:.4g}"
    assert len(axis) <= len(lines[1])  # the axis fits under the rows
    counts = dict(zip("FBOR", chains().counts()))
    assert all(f"({counts[k]} stage{'' if counts[k] == 1 else 's'})" in lines[6] for k in "FBOR")


@pytest.mark.parametrize("width", [0, -3, 2.5, True])
def test_bad_width(width) -> None:
    with pytest.raises(ValueError, match="width"):
        gantt_text(timeline(), width=width)


def test_empty_timeline() -> None:
    assert rows(gantt_text(Timeline((), 0, {}, 0), width=5)) == {r.value: "....." for r in Resource}


@pytest.mark.slow
def test_png_written_atomically(tmp_path) -> None:
    target = tmp_path / "gantt.png"
    target.write_bytes(b"old")
    assert gantt_png(timeline(), target, title="test") == target
    data = target.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000
    assert [p.name for p in tmp_path.iterdir()] == ["gantt.png"]  # no temp files left
    gantt_png(Timeline((), 0, {}, 0), tmp_path / "empty.png")  # an empty timeline still draws
    assert (tmp_path / "empty.png").read_bytes().startswith(PNG_MAGIC)


def test_png_bad_path(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        gantt_png(timeline(), tmp_path / "missing" / "x.png")
    with pytest.raises(IsADirectoryError):
        gantt_png(timeline(), tmp_path)
    assert list(tmp_path.iterdir()) == []
