"""rollout/placement.py: the one decision of engine width, engine EP, engine ranks and each phase's
memory, and ColocatedMemory moving a real trainer state (torch module + Adam) by its phases."""

from __future__ import annotations

import itertools

import pytest
import torch

from grpo_megatron.planner.dry_run import all_groups
from grpo_megatron.planner.model_states import Layout
from grpo_megatron.rollout.config import RolloutConfig, SGLangConfig
from grpo_megatron.rollout.placement import (
    ENGINE_TAGS,
    PHASES,
    TRAINER_PARTS,
    decide_placement,
    embedded_engines,
)
from grpo_megatron.training.offload import ColocatedMemory
from grpo_megatron.training.policy import Policy

MOE = {"num_experts": 128, "num_experts_per_tok": 8}
DENSE = {"model_type": "qwen2"}


def place(
    hf=MOE,
    world=32,
    gpus=8,
    tp=4,
    pp=1,
    cp=1,
    offload=False,
    staleness=0,
    engine_tp=0,
    engine_ep=0,
    **rollout,
):
    sglang = SGLangConfig(tp=engine_tp, ep=engine_ep)
    rollout_cfg = RolloutConfig(engine="sglang", sglang=sglang, **rollout)
    return decide_placement(
        rollout_cfg,
        offload_trainer=offload,
        world_size=world,
        max_staleness=staleness,
        gpus_per_node=gpus,
        tp=tp,
        pp=pp,
        cp=cp,
        hf=hf,
    )


def test_engine_width_comes_from_sglang_tp_else_from_placement() -> None:
    per_node = place(placement="per_node")
    assert per_node.gpus_per_engine == 8 and per_node.engines == tuple(
        tuple(range(s, s + 8)) for s in range(0, 32, 8)
    )
    assert [per_node.nodes(i) for i in range(4)] == [(0,), (1,), (2,), (3,)]
    replica = place(placement="per_dp_rank", tp=2, pp=2)
    assert (
        replica.gpus_per_engine == 4
        and len(replica.engines) == 8
        and "tp x pp x cp = 4" in replica.why["width"]
    )
    wide = place(engine_tp=16, placement="per_node")  # set explicitly: wins over the placement
    assert wide.gpus_per_engine == 16 and wide.nodes(1) == (2, 3) and wide.engine_of(17) == 1
    for bad in (3, 12):
        choices = r"\[1, 2, 4, 8, 16, 32\]"
        with pytest.raises(
            ValueError, match=rf"rollout.sglang.tp={bad}.*set rollout.sglang.tp to one of {choices}"
        ):
            place(engine_tp=bad)


def test_engine_ep_defaults_to_the_width_for_moe_and_1_for_dense() -> None:
    assert place(placement="per_node").engine_ep == 8  # 8 divides 128 experts
    assert place(hf={"num_experts": 4}, engine_tp=16).engine_ep == 4  # the largest common divisor
    assert place(hf=DENSE, placement="per_node").engine_ep == 1
    assert place(placement="per_node", engine_ep=2).engine_ep == 2
    with pytest.raises(ValueError, match="must divide the engine's 8 GPUs; set rollout.sglang.ep"):
        place(placement="per_node", engine_ep=3)
    with pytest.raises(ValueError, match="must divide the model's 0 routed experts; set rollout.sglang.ep"):
        place(hf=DENSE, placement="per_node", engine_ep=2)


@pytest.mark.parametrize(
    ("tp", "pp", "cp", "world"), [(1, 1, 1, 4), (2, 1, 1, 8), (2, 2, 1, 16), (2, 1, 2, 16), (4, 2, 2, 32)]
)
def test_embedded_engines_are_the_ranks_with_tp_cp_pp_rank_0(tp: int, pp: int, cp: int, world: int) -> None:
    """per_dp_rank against megatron's own RankGenerator (the groups the job is built from)."""
    from grpo_megatron.distributed.config import ParallelConfig

    layout = Layout.from_config(ParallelConfig(tp=tp, pp=pp, cp=cp), world)
    groups = all_groups(layout)
    first = {kind: {g[0] for g in groups[kind]} for kind in ("tp", "cp", "pp")}
    expected = [r for r in range(world) if all(r in first[k] for k in first)]
    assert embedded_engines("per_dp_rank", world, 8, tp, pp, cp) == expected


def test_each_phase_holds_what_the_placement_says() -> None:
    everything = TRAINER_PARTS, frozenset(ENGINE_TAGS)
    colocated = place(placement="per_node").phases()
    assert (colocated["start-up"].trainer, colocated["start-up"].engine) == (
        frozenset(),
        frozenset(ENGINE_TAGS),
    )
    assert colocated["train"].engine == frozenset() and colocated["train"].trainer == TRAINER_PARTS
    assert (colocated["rollout"].trainer, colocated["rollout"].engine) == everything
    assert colocated["sync"].engine == {"weights"} and colocated["save"] == colocated["rollout"]
    offloaded = place(placement="per_node", offload=True).phases()
    assert offloaded["rollout"].trainer == frozenset() and offloaded["sync"].trainer == {"params"}
    assert offloaded["save"].trainer == {"params", "optimizer"} and offloaded["save"].engine == {"weights"}
    embedded = decide_placement(
        RolloutConfig(),
        offload_trainer=False,
        max_staleness=0,
        world_size=4,
        gpus_per_node=4,
        tp=1,
        pp=1,
        cp=1,
        hf=MOE,
    ).phases()
    assert all((o.trainer, o.engine) == everything for o in embedded.values())  # nothing moves
    overlapped = place(placement="per_node", staleness=1)  # the engines generate while the trainer trains
    assert not overlapped.swaps_engine_memory and "max_staleness=1" in overlapped.why["memory"]
    held = overlapped.phases()
    assert all((o.trainer, o.engine) == everything for p, o in held.items() if p != "start-up")
    # Issue 51 item 3: the engines start beside an offloaded trainer here too, so that SGLang sizes the KV
    # pool `plan` counts; nothing moves afterwards.
    assert (held["start-up"].trainer, held["start-up"].engine) == (frozenset(), frozenset(ENGINE_TAGS))


def test_engines_that_never_swap_start_beside_an_offloaded_trainer() -> None:
    """Issue 51 item 3 (train.max_staleness > 0, partial overlap): SGLang sizes its KV pool from the
    memory free as it starts, so the trainer's state is out while it starts and back before training;
    then no phase moves anything."""
    policy, (weight, _) = _policy()
    before = weight.detach().clone()
    seen: list[tuple] = []
    fleet = EngineMemory(seen)
    memory = ColocatedMemory(policy, None, place(placement="per_node", staleness=1).phases())
    memory.start_engines(lambda: seen.append(("engines start", weight.untyped_storage().nbytes())) or fleet)
    assert seen == [("engines start", 0)]  # the trainer's parameters were out as the engines started
    assert weight.untyped_storage().nbytes() > 0 and torch.equal(weight, before)
    for phase in ("rollout", "train", "sync", "probe", "save", "train"):
        memory.enter(phase)
    assert seen == [("engines start", 0)]  # afterwards nothing moves: both stay resident


class EngineMemory:
    """The fleet's two memory calls, recorded (what RolloutFleet forwards to its engine)."""

    def __init__(self, calls: list | None = None) -> None:
        self.calls: list[tuple[str, tuple[str, ...]]] = [] if calls is None else calls

    def release_memory(self, tags) -> None:
        self.calls.append(("release", tuple(tags)))

    def resume_memory(self, tags) -> None:
        self.calls.append(("resume", tuple(tags)))


def _policy() -> tuple[Policy, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    return Policy(model=model, optimizer=optimizer, spec=None), [model.weight, model.weight.grad]  # type: ignore[arg-type,list-item]


@pytest.mark.parametrize("offload", [False, True])
def test_colocated_memory_moves_by_the_phases_in_the_trainers_order(offload: bool) -> None:
    policy, (weight, grad) = _policy()
    before = weight.detach().clone()
    memory = ColocatedMemory(policy, None, place(placement="per_node", offload=offload).phases())
    fleet = EngineMemory()
    seen = {}

    def build() -> EngineMemory:
        seen["trainer bytes while the engines start"] = (
            weight.untyped_storage().nbytes() + grad.untyped_storage().nbytes()
        )
        return fleet

    assert memory.start_engines(build) is fleet
    assert seen["trainer bytes while the engines start"] == 0  # the trainer's state was in host memory
    assert fleet.calls == [("release", ENGINE_TAGS)] and torch.equal(weight, before)  # back for training
    fleet.calls.clear()
    memory.before_sync()  # the run's first sync, as train() calls it
    memory.engines_serve()
    memory.after_sync()
    memory.to_trainer()
    assert fleet.calls == [
        ("resume", ("weights",)),
        ("resume", ("kv_cache", "cuda_graph")),
        ("release", ENGINE_TAGS),
    ]
    assert weight.untyped_storage().nbytes() > 0 and grad.untyped_storage().nbytes() > 0
    memory.before_sync()
    memory.after_sync()
    fleet.calls.clear()
    with memory.trainer_visit():  # a checkpoint save after the sync
        saved = {
            "params": weight.untyped_storage().nbytes() > 0,
            "grads": grad.untyped_storage().nbytes() > 0,
        }
    assert saved == {"params": True, "grads": not offload}  # a save reads no gradients
    if offload:
        assert fleet.calls == [
            ("release", ("kv_cache", "cuda_graph")),
            ("resume", ("kv_cache", "cuda_graph")),
        ]
        assert weight.untyped_storage().nbytes() == 0  # gone again with the rollout phase
    else:
        assert fleet.calls == []  # the rollout phase's memory is the save's: nothing moves
    memory.trainer_back()
    assert torch.equal(weight, before)


SWAPPING = {
    "colocated SGLang": place(placement="per_node").phases(),
    "colocated SGLang, trainer offloaded": place(placement="per_node", offload=True).phases(),
    "embedded, trainer offloaded": decide_placement(
        RolloutConfig(),
        offload_trainer=True,
        max_staleness=0,
        world_size=4,
        gpus_per_node=4,
        tp=1,
        pp=1,
        cp=1,
        hf=MOE,
    ).phases(),
}


@pytest.mark.parametrize("name", list(SWAPPING))
def test_the_trainers_cache_goes_back_before_the_engines_start_and_before_every_resume(name: str) -> None:
    """Issue 36 item 1: every resume of engine memory, from every phase to every other one the placement
    has, comes right after the trainer's cached device blocks went back to the driver, once the trainer's
    state is where the new phase wants it (on CPU the release is a no-op; here it is recorded)."""
    phases = SWAPPING[name]
    policy, (weight, _) = _policy()
    calls: list[tuple] = []

    def release_cache() -> dict[str, float]:
        calls.append(("release_cache", weight.untyped_storage().nbytes() > 0))
        return {}

    fleet = EngineMemory(calls)
    memory = ColocatedMemory(policy, None, phases, release_cache=release_cache)
    memory.start_engines(lambda: calls.append(("engines start",)) or fleet)
    assert calls[:2] == [("release_cache", "params" in phases["start-up"].trainer), ("engines start",)]
    resumes = 0
    for before, after in itertools.permutations([p for p in PHASES if p != "start-up"], 2):
        memory.enter(before)
        calls.clear()
        memory.enter(after)
        for i, call in enumerate(calls):
            if call[0] == "resume":
                resumes += 1
                released = ("release_cache", "params" in phases[after].trainer)
                assert i > 0 and calls[i - 1] == released, (before, after, calls)
    assert resumes > 0


def test_every_memory_phase_returns_its_metrics_and_no_engine_resume_goes_unreported() -> None:
    """Issue 51 item 1: ``offload/cached_free_bytes`` was returned only by ``enter``; the sync and probe
    phases (``before_sync``, ``engines_serve``) and a save's ``visit`` dropped it, so the GPU check's
    cached-blocks criterion never saw a value. Every phase returns (a visit yields) its metrics, the
    sync merges them, and the worst resume since the last metrics row is ``take_cached_at_resume``'s,
    whoever moved the memory; on CPU the measure is 0 (nothing cached), present all the same."""
    from grpo_megatron.training.offload import CACHED_KEY, merge_memory_metrics, release_device_cache

    assert release_device_cache() == {CACHED_KEY: 0.0}
    policy, _ = _policy()
    measured = iter([1.0, 5.0, 2.0, 3.0, 4.0, 9.0])
    memory = ColocatedMemory(
        policy,
        None,
        place(placement="per_node", offload=True).phases(),
        release_cache=lambda: {CACHED_KEY: next(measured)},
    )
    memory.start_engines(EngineMemory)  # measures 1.0 before the engines start (no resume)
    assert memory.take_cached_at_resume() == {}
    sync, probe, rollout = memory.before_sync(), memory.engines_serve(), memory.after_sync()
    assert (
        sync[CACHED_KEY] == 5.0 and sync["offload/bytes_moved"] > 0
    )  # weights resumed; grads + optimizer out
    assert probe[CACHED_KEY] == 2.0 and CACHED_KEY not in rollout  # caches back in the probe: none left after
    assert rollout["offload/bytes_moved"] > 0  # the parameters out
    merged = merge_memory_metrics(sync, probe, rollout)
    assert merged[CACHED_KEY] == 5.0
    assert merged["offload/bytes_moved"] == sync["offload/bytes_moved"] + rollout["offload/bytes_moved"]
    with memory.trainer_visit() as moved:  # a checkpoint save after the row was written
        assert (
            CACHED_KEY not in moved and moved["offload/onload_seconds"] >= 0
        )  # in: caches released, state back
    assert moved[CACHED_KEY] == 3.0 and moved["offload/bytes_moved"] > 0  # out: state leaves, caches resume
    assert memory.take_cached_at_resume() == {CACHED_KEY: 5.0}  # the worst of sync, probe and the save's
    assert memory.take_cached_at_resume() == {}
    memory.to_trainer()
    with memory.visit("train") as moved:
        pass
    assert moved == {}  # a visit of the phase it is in moves nothing


@pytest.mark.parametrize("offload", [False, True])
def test_the_start_up_offloads_pinned_host_buffers_are_unpinned_unless_an_offload_reuses_them(
    offload: bool,
) -> None:
    """Issue 51 item 9: the start-up phase offloads the whole trainer into pinned host buffers (on a
    GPU); back on the device, freed, they stayed pinned in torch's pinned-memory cache for the run. Where
    no later phase offloads (``train.offload_trainer=false``) the cache is emptied once every part is
    back; an offloading job keeps it for its next offload. (On CPU nothing is pinned: the call is
    recorded here; tests/test_gpu.py measures the pinned bytes on a GPU.)"""
    policy, (weight, grad) = _policy()
    calls: list[tuple[str, bool]] = []
    memory = ColocatedMemory(
        policy,
        None,
        place(placement="per_node", offload=offload).phases(),
        release_host_cache=lambda: calls.append(("unpin", weight.untyped_storage().nbytes() > 0)),
    )

    def build() -> EngineMemory:
        calls.append(("engines start", weight.untyped_storage().nbytes() > 0))
        return EngineMemory()

    memory.start_engines(build)
    expected = [("engines start", False)] + ([] if offload else [("unpin", True)])
    assert calls == expected


def test_an_engine_restarts_beside_an_offloaded_trainer_whatever_the_phase() -> None:
    """Issue 51 item 2: ``restart_visit`` (the recovery's ``starting``) takes the trainer's state off the
    device and gives its cached blocks back before the engine restarts (SGLang sizes its KV pool from
    the memory free then), whatever the phase of the moment, then brings the state back as it was."""
    policy, (weight, _) = _policy()
    before = weight.detach().clone()
    calls: list[tuple] = []
    memory = ColocatedMemory(
        policy,
        None,
        place(placement="per_node").phases(),
        release_cache=lambda: calls.append(("release_cache", weight.untyped_storage().nbytes())) or {},
    )
    memory.start_engines(lambda: EngineMemory(calls))
    for phase in ("rollout", "sync"):
        memory.enter(phase)
        calls.clear()
        with memory.restart_visit() as moved:
            calls.append(("engine restarts", weight.untyped_storage().nbytes()))
        assert calls[-2:] == [("release_cache", 0), ("engine restarts", 0)]
        assert moved["offload/onload_seconds"] >= 0 and torch.equal(weight, before)
        assert memory.phase == phase and not memory.offloaded
