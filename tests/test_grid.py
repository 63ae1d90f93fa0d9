"""RankGrid arithmetic, checked against numpy reshape/transpose (a different computation)."""

import time

import numpy as np
import pytest

from nanotrain.parallel.grid import AXES, Coords, RankGrid

SHAPES = [  # (tp, cp, dp, pp, ep)
    (1, 1, 1, 1, 1),
    (2, 1, 4, 2, 1),  # the 16-GPU 3D example
    (4, 1, 1, 1, 1),
    (1, 1, 1, 4, 1),
    (2, 2, 2, 2, 2),
    (3, 1, 5, 2, 1),
    (1, 3, 2, 1, 2),
    (2, 2, 1, 3, 1),
    (8, 2, 16, 8, 2),  # 4096 ranks
]


def _grid(shape):
    tp, cp, dp, pp, ep = shape
    return RankGrid(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep)


def _reference_groups(shape, axes):
    """Groups by numpy: move the group's axes last and flatten them."""
    tp, cp, dp, pp, ep = shape
    mat = np.arange(tp * cp * dp * pp * ep).reshape(ep, pp, dp, cp, tp)
    idx = [AXES.index(a) for a in axes]
    rest = [i for i in range(5) if i not in idx]
    moved = mat.transpose(rest + idx)
    size = int(np.prod([mat.shape[i] for i in idx])) if idx else 1
    groups = [tuple(sorted(int(x) for x in row)) for row in moved.reshape(-1, size)]
    return sorted(groups)


GROUP_AXES = {
    "tp": ("tp",),
    "cp": ("cp",),
    "dp": ("dp",),
    "pp": ("pp",),
    "ep": ("ep",),
    "dp_cp": ("dp", "cp"),
    "mp": ("ep", "pp", "tp"),
    "world": AXES,
    "tp_ep": ("ep", "tp"),
    "cp_tp": ("cp", "tp"),
}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "tp{}cp{}dp{}pp{}ep{}".format(*s))
def test_groups_match_numpy(shape):
    g = _grid(shape)
    world = int(np.prod(shape))
    assert g.world_size == world
    for name, axes in GROUP_AXES.items():
        groups = g.groups(name)
        assert groups == _reference_groups(shape, axes), name
        size = int(np.prod([getattr(g, a) for a in axes]))
        assert all(len(grp) == size for grp in groups)
        flat = [r for grp in groups for r in grp]
        assert sorted(flat) == list(range(world)), f"{name} groups do not partition the world"
        assert all(list(grp) == sorted(grp) for grp in groups)
    if world <= 64:
        for r in range(world):
            for name in GROUP_AXES:
                grp = g.group_of(name, r)
                assert r in grp and grp in g.groups(name)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "tp{}cp{}dp{}pp{}ep{}".format(*s))
def test_coords_match_numpy_and_roundtrip(shape):
    g = _grid(shape)
    tp, cp, dp, pp, ep = shape
    mat = np.arange(g.world_size).reshape(ep, pp, dp, cp, tp)
    for idx in np.ndindex(mat.shape):
        r = int(mat[idx])
        c = g.coords(r)
        assert tuple(c) == idx
        assert g.rank(**c._asdict()) == r
        assert g.rank(ep=idx[0], pp=idx[1], dp=idx[2], cp=idx[3], tp=idx[4]) == r


def test_tp_fastest_and_16_rank_layout():
    g = RankGrid(tp=2, pp=2, dp=4)
    assert g.groups("tp")[:3] == [(0, 1), (2, 3), (4, 5)]
    assert g.groups("dp") == [(0, 2, 4, 6), (1, 3, 5, 7), (8, 10, 12, 14), (9, 11, 13, 15)]
    assert g.groups("pp")[:2] == [(0, 8), (1, 9)]
    assert g.group_of("pp", 13) == (5, 13)
    assert g.coords(13) == Coords(ep=0, pp=1, dp=2, cp=0, tp=1)
    assert g.groups("world") == [tuple(range(16))]
    assert g.groups("dp_cp") == g.groups("dp")  # cp == 1
    assert g.groups("mp") == [(0, 1, 8, 9), (2, 3, 10, 11), (4, 5, 12, 13), (6, 7, 14, 15)]


def test_4096_ranks_is_fast():
    g = RankGrid(tp=8, pp=8, dp=16, cp=2, ep=2)
    assert g.world_size == 4096
    t0 = time.process_time()
    for name in ("tp", "cp", "dp", "pp", "ep", "dp_cp", "mp", "world"):
        g.groups(name)
    coords = [g.coords(r) for r in range(4096)]
    elapsed = time.process_time() - t0
    assert elapsed < 1.0, elapsed  # CPU seconds: another process's load does not count
    assert g.rank(**coords[4095]._asdict()) == 4095
    assert g.coords(4095) == Coords(1, 7, 15, 1, 7)


def test_group_index_is_torch_group_rank():
    """Ascending group tuples: the index of a rank equals its coordinate along a single axis."""
    g = RankGrid(tp=2, cp=3, dp=2, pp=2, ep=2)
    for r in range(g.world_size):
        c = g.coords(r)._asdict()
        for ax in AXES:
            assert g.group_of(ax, r).index(r) == c[ax]


def test_summary():
    s = RankGrid(tp=2, pp=2, dp=4).summary()
    assert "world=16" in s and "[0,1]" in s and "[0,2,4,6]" in s
    big = RankGrid(tp=8, pp=8, dp=16, cp=2, ep=2).summary()
    assert "world=4096" in big and "512 groups of 8" in big and "[0," not in big


@pytest.mark.parametrize("kwargs", [dict(tp=0), dict(dp=-1), dict(pp=1.5), dict(cp=True), dict(ep="2")])
def test_bad_sizes(kwargs):
    with pytest.raises(ValueError, match=r">= 1"):
        RankGrid(**kwargs)


def test_bad_ranks_coords_and_names():
    g = RankGrid(tp=2, dp=2)
    for bad in (-1, 4, 2.0, None):
        with pytest.raises(ValueError, match=r"\[0, 4\)"):
            g.coords(bad)
    with pytest.raises(ValueError, match=r"tp coordinate .*\[0, 2\)"):
        g.rank(tp=2)
    with pytest.raises(ValueError, match="pp coordinate"):
        g.rank(pp=1)
    with pytest.raises(TypeError):
        g.rank(0, 0, 0, 0, 0)  # keyword-only: positional order is too easy to get wrong
    for bad in ("xp", "dp_dp", "", "tp_", "TP"):
        with pytest.raises(ValueError, match="unknown group"):
            g.groups(bad)
    assert g.coords(np.int64(3)) == Coords(0, 0, 1, 0, 1)  # numpy ints are accepted
