"""The GPU path's launch-time choices, checked on CPU: which GPU a rank takes, the process groups'
timeout against the hang watchdog's, NCCL's dump settings, the data-build wait, the torch API
floor of the collectives, and a stop vote that never blocks the host on a silent step."""

from __future__ import annotations

import ast
import dataclasses
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nanotrain.config import ConfigError, load_config, validate
from nanotrain.config.schema import TrainingArgs
from nanotrain.config.validate import MAX_COLLECTIVE_TIMEOUT_S
from nanotrain.data import build
from nanotrain.parallel import accelerator
from nanotrain.parallel.observe.hang_record import HANG_RECORD
from nanotrain.parallel.parallel_context import ParallelContext
from nanotrain.parallel.pipeline_parallel import TensorPointer
from nanotrain.rehearse.stand_in import MetaAccelerator, kernel_stubs
from nanotrain.rehearse.tracker import DeviceTracker, watch_tensor_factories
from nanotrain.runtime.hang import HangWatchdog, fr_buffer_var, nccl_debug_env
from nanotrain.training import step
from nanotrain.training.builder import build_parallel_context, hang_timeouts
from nanotrain.training.stop_vote import StopVote, TrainingDiverged

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
ONE_RANK = ["parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=1"]


@pytest.fixture
def gpus(monkeypatch):
    """``torch.cuda`` with ``n`` visible GPUs (none exists here); records ``set_device``."""
    chosen = []

    def visible(n: int) -> list:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
        return chosen

    return visible


@pytest.mark.parametrize(
    "local_world, local_rank, visible, index",
    [
        (4, 2, 4, 2),  # every rank sees the node's GPUs: its own by LOCAL_RANK
        (4, 2, 1, 0),  # each rank sees exactly one (bound per task)
        (1, 0, 8, 0),  # one rank on the node: no other rank can share its GPU
    ],
)
def test_rank_picks_its_gpu(gpus, monkeypatch, local_world, local_rank, visible, index):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    chosen = gpus(visible)
    assert ParallelContext._select_device() == torch.device("cuda", index)
    assert chosen == [index]


def test_a_subset_of_gpus_per_rank_is_refused(gpus, monkeypatch):
    """4 ranks on the node, 2 GPUs visible to each (a per-task binding): ranks 0 and 2 would
    both take index 0, i.e. the same physical GPU."""
    for key, value in {
        "LOCAL_WORLD_SIZE": "4",
        "LOCAL_RANK": "2",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "SLURM_STEP_GPUS": "0,1",
        "SLURM_LOCALID": "2",
    }.items():
        monkeypatch.setenv(key, value)
    chosen = gpus(2)
    with pytest.raises(RuntimeError) as err:
        ParallelContext._select_device()
    message = str(err.value)
    for part in (
        "LOCAL_RANK=2",
        "LOCAL_WORLD_SIZE=4",
        "device_count()=2",
        "CUDA_VISIBLE_DEVICES=0,1",
        "SLURM_STEP_GPUS=0,1",
        "SLURM_LOCALID=2",
        "Fix:",
    ):
        assert part in message, message
    assert chosen == []


# ------------------------------------------------------------- timeouts: groups outlast the watchdog
@pytest.fixture
def world_of_one():
    """A one-rank gloo world in this process, on an in-memory store (no port, no rendezvous)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_groups_time_out_after_the_hang_watchdog(world_of_one, monkeypatch, tmp_path):
    """NCCL aborts the process at the groups' timeout (no report, no requeue): the watchdog, at
    collective_timeout_s, must come first, by more than its polling and the time the host runs
    ahead of a collective it enqueued."""
    given = []
    new_group = dist.new_group
    monkeypatch.setattr(dist, "new_group", lambda *a, **kw: given.append(kw["timeout"]) or new_group(*a, **kw))
    config = load_config(TINY, ONE_RANK + ["training.collective_timeout_s=30"])
    pc = build_parallel_context(config)
    try:
        watchdog = HangWatchdog(tmp_path, 0, 1, hang_timeouts(config.training.collective_timeout_s)[0])
        assert watchdog.timeout_s == 30.0  # what a rank gives it (ending.hang_watchdog): the setting itself
        assert pc.timeout.total_seconds() >= watchdog.timeout_s + 1.0 + 60, pc.timeout  # poll <= 1 s
        assert given and set(given) == {pc.timeout}
        build.wait_for_builders()  # the data-build wait on the default group's own store
    finally:
        pc.destroy()


def test_timeout_rule_holds_over_what_validation_allows():
    lowest = next(f for f in dataclasses.fields(TrainingArgs) if f.name == "collective_timeout_s").metadata["min"]
    for setting in (lowest, 600.0, MAX_COLLECTIVE_TIMEOUT_S):
        watchdog_s, groups_s = hang_timeouts(setting)
        assert watchdog_s == setting and groups_s >= max(setting + 120, 1.2 * setting)
        assert timedelta(seconds=groups_s).total_seconds() == groups_s  # torch takes a timedelta
        assert groups_s * 1e9 < 2**63  # and counts it in int64 nanoseconds (steady_clock)
    validate(load_config(TINY, [f"training.collective_timeout_s={MAX_COLLECTIVE_TIMEOUT_S}"]))
    with pytest.raises(ConfigError, match="training.collective_timeout_s"):
        validate(load_config(TINY, [f"training.collective_timeout_s={MAX_COLLECTIVE_TIMEOUT_S * 2}"]))


def test_nccl_dumps_into_the_run_directory(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    environ: dict = {}
    nccl_debug_env(tmp_path, environ)
    # the buffer under the installed torch's name (2.13: TORCH_FR_BUFFER_SIZE; the old one would
    # warn "deprecated"), the file prefix under both names (newer torch reads TORCH_FR_* first)
    prefix = str(tmp_path / "hang" / "nccl_trace_rank_")
    assert environ == {
        fr_buffer_var(): "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
    }
    assert (tmp_path / "hang").is_dir()
    mine = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "500", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "fr_")}
    nccl_debug_env(tmp_path, mine)  # the user's settings win, under the other name too
    assert mine[fr_buffer_var()] == "500" and mine["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "fr_")


# ----------------------------------------------------- the data-build wait is no collective
def test_data_build_waits_on_the_store_not_in_a_collective(monkeypatch, tmp_path):
    met = []
    monkeypatch.setattr(dist, "barrier", lambda *a, **kw: met.append("collective"))
    monkeypatch.setattr(build, "wait_for_builders", lambda: met.append("store"))
    config = load_config(TINY)
    out = build.prepare_dataset(
        config.data, seq_len=8, cache_dir=str(tmp_path), builder=False, needs_data=False, barrier=dist.barrier
    )  # as the trainer hands it in
    assert out is None and met == ["store"]


class _TimedStore:
    """A store that records the timeout of every wait (and has no default one to fall back on)."""

    def __init__(self):
        self.store, self.timeouts = dist.HashStore(), []

    def add(self, key, value):
        return self.store.add(key, value)

    def set(self, key, value):
        self.store.set(key, value)

    def wait(self, keys, timeout):
        self.timeouts.append(timeout)
        self.store.wait(keys, timeout)


def test_wait_for_builders_meets_every_rank_each_time():
    """Two ranks (threads) meet twice: no one leaves a meeting before the builder arrived, and
    each wait has the data build's own long timeout, not the process groups'."""
    store, log = _TimedStore(), []

    def rank(r: int) -> None:
        for n in range(2):
            if r == 0:
                log.append(f"built {n}")
            build.wait_for_builders(store, 2)
            if r == 1:
                log.append(f"loaded {n}")

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert len(log) == 4 and all(log.index(f"built {n}") < log.index(f"loaded {n}") for n in (0, 1)), log
    assert store.timeouts == [build.DATA_BUILD_TIMEOUT] * 4


# ------------------------------------------- torch >= 2.4: no keyword that only 2.6 has
TORCH_2_6_KEYWORDS = {"group_src", "group_dst", "group_peer"}  # the group-rank arguments of 2.6


def _calls_into_torch_distributed(tree: ast.AST):
    """Every call of a torch.distributed function in ``tree``: ``dist.f(...)`` under any alias
    of the module, ``torch.distributed.f(...)``, and names imported from it."""
    modules, names = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            modules |= {a.asname or a.name for a in node.names if a.name == "distributed"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            names |= {a.asname or a.name for a in node.names}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in names:
            yield node
        elif isinstance(f, ast.Attribute):
            owner = ast.unparse(f.value)
            if owner in modules or owner == "torch.distributed" or owner.startswith("torch.distributed."):
                yield node


def test_no_call_into_torch_distributed_needs_torch_2_6():
    """pyproject says torch >= 2.4: group_src / group_dst / group_peer came in 2.6 (a TypeError
    in step 1 of every pp > 1 run on 2.4 and 2.5). Global ranks work on every version."""
    found = []
    for path in sorted((ROOT / "nanotrain").rglob("*.py")):
        text = path.read_text()
        if not any(k in text for k in TORCH_2_6_KEYWORDS):  # the rest cannot pass one (parsing is slow)
            continue
        for call in _calls_into_torch_distributed(ast.parse(text, str(path))):
            bad = TORCH_2_6_KEYWORDS & {k.arg for k in call.keywords}
            if bad:
                found.append(f"{path.relative_to(ROOT)}:{call.lineno}: {ast.unparse(call.func)}({', '.join(bad)}=...)")
    assert not found, "\n".join(found)


def test_pp_loss_broadcast_runs_on_torch_2_4_signatures(monkeypatch):
    """The training step's loss broadcast over pp (``group_src`` = the last stage) reaches torch
    as 2.4's ``broadcast(tensor, src, group)``: the global rank of that stage."""
    sent = []

    def broadcast_2_4(tensor, src=None, group=None, async_op=False):  # torch 2.4's parameters
        sent.append((src, group))

    pp_group = object()
    global_of = {0: 3, 1: 7}  # this pp group holds global ranks 3 and 7
    monkeypatch.setattr(dist, "broadcast", broadcast_2_4)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, r: global_of[r] if group is pp_group else None)
    monkeypatch.setattr(HANG_RECORD, "group", HANG_RECORD.group)  # restored afterwards
    monkeypatch.setattr(HANG_RECORD, "collective", HANG_RECORD.collective)
    pc = type("PC", (), {"pp_size": 2, "pp_pg": pp_group, "device": torch.device("cpu")})()
    value = step.reduce_loss(TensorPointer(group_rank=1), pc)  # a first stage: the loss is on the last
    assert sent == [(7, pp_group)] and value.dtype == torch.float64


# ---------------------------------------------- the stop vote: no host sync on a silent step
class CountingStandIn(MetaAccelerator):
    """The rehearsal's meta stand-in for CUDA (the stop vote takes its GPU branch), counting the
    waits on its events."""

    def __init__(self):
        super().__init__()
        self.synchronized = 0

    def Event(self, enable_timing: bool = False):  # noqa: N802
        stand_in, event = self, super().Event(enable_timing)

        def synchronize():
            stand_in.synchronized += 1

        event.synchronize = synchronize
        return event


def test_silent_steps_of_the_stop_vote_never_block_the_host():
    """Recorded by the rehearsal's tracker: blocking copies either way, ``item()``/``tolist()``
    of a device tensor and ``torch.tensor(data, device=...)``."""
    stand_in, meta = CountingStandIn(), torch.device("meta")
    loss, grad_norm = torch.empty((), device=meta), torch.empty((), device=meta)
    with accelerator.standing_in(stand_in), kernel_stubs():
        vote = StopVote(lambda: 0, meta)
        syncs = DeviceTracker(meta)
        with syncs, watch_tensor_factories(syncs):
            for step_ in (1, 2, 3):
                vote.post(step_, loss, grad_norm)
                assert vote.settle(latest=False) == 0  # the previous step's vote
    blocking = [kind for window in syncs.syncs.values() for kind in window]
    assert blocking == [], blocking
    assert syncs.async_copies == ["meta -> cpu"] * 3  # each vote's flags, behind its all-reduce
    assert stand_in.synchronized == 2 and vote.last_settled == (2, False)  # one event per read vote


def test_stop_vote_on_the_cpu_reads_what_it_posted():
    vote = StopVote(lambda: 2, torch.device("cpu"))
    vote.post(1, torch.tensor(1.5), torch.tensor(0.5), writing=True)
    assert vote.settle(latest=True) == 2 and vote.last_settled == (1, True)
    vote.post(2, torch.tensor(float("nan")), torch.tensor(0.5))
    with pytest.raises(TrainingDiverged, match="step 2"):
        vote.settle(latest=True)
