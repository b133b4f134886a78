"""Recipes: each validates at its intended world size and plans (fits) with the command line its
header documents; the copied HF configs have the published parameter counts; the data tools
convert local files into the JSONL the data module reads."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo_megatron.cli import main as cli_main
from grpo_megatron.planner.model_states import total_params
from tests.helpers.dist import REPO_ROOT

RECIPES = sorted((REPO_ROOT / "examples" / "recipes").glob("*.yaml"))

# Published total parameter counts (model cards / papers; DeepSeek-V3 without its MTP module).
PUBLISHED_PARAMS = {
    "deepseek_v3_671b": 671e9,
    "qwen3_30b_a3b": 30.5e9,
    "qwen3_30b_a3b_lora": 30.5e9,
    "r1_zero_qwen25_math_7b": 7.61e9,
    "countdown_qwen25_3b": 3.09e9,
}


def plan_line(recipe: Path) -> list[str]:
    """Arguments of the recipe's '# plan: grpo-megatron plan ...' header line."""
    for line in recipe.read_text().splitlines():
        if line.startswith("# plan: grpo-megatron plan "):
            return shlex.split(line.removeprefix("# plan: grpo-megatron plan "))
    raise AssertionError(f"{recipe.name} has no '# plan:' header line")


def test_every_recipe_is_listed() -> None:
    assert {r.stem for r in RECIPES} == set(PUBLISHED_PARAMS)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_validates_and_plans(recipe: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = plan_line(recipe)
    assert args[0] == str(recipe.relative_to(REPO_ROOT))
    args[0] = str(recipe)
    nodes = int(args[args.index("--nodes") + 1])
    gpus = int(args[args.index("--gpus-per-node") + 1])
    # The datasets are downloaded and prepared by tools/prepare_*.py, the tokenizer comes with the
    # downloaded checkpoint; `check` requires the files, so stand-ins take their place here (the layout
    # and batch rules are what this test checks).
    data = (yaml.safe_load(recipe.read_text()) or {}).get("data") or {}
    stand_ins = [f"data.tokenizer_path={REPO_ROOT / 'examples' / 'demo'}"]
    for key in ("train_path", "eval_path"):
        if data.get(key):
            (tmp_path / key).write_text("")
            stand_ins.append(f"data.{key}={tmp_path / key}")
    assert cli_main(["check", str(recipe), *stand_ins, "--world-size", str(nodes * gpus)]) == 0
    rc = cli_main(["plan", *args])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "FITS" in out


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_recipe_model_config_has_published_size(name: str) -> None:
    hf = json.loads((REPO_ROOT / "examples" / "recipes" / name / "config.json").read_text())
    assert total_params(hf) == pytest.approx(PUBLISHED_PARAMS[name], rel=0.01)


def _tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)


@pytest.mark.launches
def test_prepare_math(tmp_path: Path) -> None:
    # MATH's layout: one JSON file per problem, level as "Level N", answer inside \boxed{} of the solution
    src = tmp_path / "MATH" / "train" / "algebra"
    src.mkdir(parents=True)
    for i, (level, solution) in enumerate(
        [
            ("Level 2", r"so \boxed{4}."),
            ("Level 3", r"thus $\boxed{\frac{1}{2}}$"),
            ("Level 5", r"\boxed{x^{2}+1}"),
        ]
    ):
        (src / f"{i}.json").write_text(
            json.dumps({"problem": f"p{i}", "level": level, "type": "Algebra", "solution": solution})
        )
    out = tmp_path / "math.jsonl"
    result = _tool(
        "tools/prepare_math.py",
        "--input",
        str(tmp_path / "MATH"),
        "--levels",
        "3",
        "4",
        "5",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["prompt"], r["answer"], r["level"]) for r in rows] == [
        ("p1", r"\frac{1}{2}", 3),
        ("p2", "x^{2}+1", 5),
    ]
    assert rows[0]["subject"] == "Algebra"

    # DAPO-Math-17k style: chat-message prompt and reward_model.ground_truth, as JSONL
    dapo = tmp_path / "dapo.jsonl"
    dapo.write_text(
        json.dumps({"prompt": [{"role": "user", "content": "q?"}], "reward_model": {"ground_truth": "34"}})
        + "\n"
    )
    out2 = tmp_path / "dapo_out.jsonl"
    assert _tool("tools/prepare_math.py", "--input", str(dapo), "--out", str(out2)).returncode == 0
    assert json.loads(out2.read_text()) == {"prompt": "q?", "answer": "34", "source": str(dapo)}


@pytest.mark.launches
def test_prepare_countdown(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "countdown.parquet"
    pq.write_table(pa.table({"target": [24, 10, 7], "nums": [[3, 8, 1], [5, 2], [1, 6]]}), src)
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    result = _tool(
        "tools/prepare_countdown.py",
        "--input",
        str(src),
        "--out",
        str(train),
        "--eval-out",
        str(test),
        "--num-eval",
        "1",
    )
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for p in (train, test) for line in p.read_text().splitlines()]
    assert len(rows) == 3 and len(test.read_text().splitlines()) == 1
    row = next(r for r in rows if r["metadata"]["target"] == 24)
    assert row["answer"] == "24" and row["metadata"]["numbers"] == [3, 8, 1]
    assert "Using the numbers [3, 8, 1], create an equation that equals 24" in row["prompt"]
    assert row["prompt"].endswith("<think>")

    from grpo_megatron.rewards.base import RewardSample
    from grpo_megatron.rewards.countdown import countdown_reward

    sample = RewardSample(
        prompt=row["prompt"],
        response="</think> <answer>3 * 8 * 1</answer>",
        label=row["answer"],
        metadata=row["metadata"],
    )
    assert countdown_reward(sample) == 1.0


def _cluster(recipe: Path) -> tuple[int, int, str]:
    args = plan_line(recipe)
    return (
        int(args[args.index("--nodes") + 1]),
        int(args[args.index("--gpus-per-node") + 1]),
        args[args.index("--gpu") + 1],
    )


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_plan_line_is_only_its_cluster(recipe: Path) -> None:
    """The '# plan:' line names the cluster and nothing the YAML should say (engine width, EP, offload)."""
    args = plan_line(recipe)
    flags = [a for a in args[1:] if a.startswith("--")]
    assert sorted(flags) == ["--gpu", "--gpus-per-node", "--nodes"], args
    header = recipe.read_text().split("\n\n", 1)[0]
    for words in ("engine width", "engine EP", "offload"):
        assert words in header, f"{recipe.name}'s header does not say its {words}"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_runtime_placement_at_scale_is_the_plans(
    recipe: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """At the recipe's published scale, on torch's fake process group (as the dry run): the runtime's
    placement (rollout/placement.py from megatron's real parallel state), the SGLang layout and server
    arguments each engine rank would start with, what it would receive, and the memory phases
    ColocatedMemory would move by, are the ones `grpo-megatron plan` prints for the recipe."""
    import torch

    from grpo_megatron.config import load_config
    from grpo_megatron.planner import memory
    from grpo_megatron.planner.dry_run import fake_world, parallel_state_here
    from grpo_megatron.planner.model_states import Layout
    from grpo_megatron.rollout.placement import routed_experts, runtime_placement
    from grpo_megatron.rollout.sglang.launch import EngineLaunch, colocated_server_args
    from grpo_megatron.rollout.sglang.layout import layout_of
    from grpo_megatron.rollout.sglang.shards import rank_needs
    from grpo_megatron.training.job import engine_spec
    from grpo_megatron.training.offload import ColocatedMemory

    nodes, gpus, gpu = _cluster(recipe)
    world = nodes * gpus
    cfg = load_config(recipe)
    hf = cfg.model.load_hf_config()
    plan = memory.plan_memory(cfg, hf, world, memory.PlanOptions(gpus_per_node=gpus, gpu=memory.GPUS[gpu]))
    assert plan.fits
    planned = plan.placement
    assert planned.colocated_sglang  # every recipe runs colocated SGLang engines
    width, ep = planned.gpus_per_engine, planned.engine_ep
    layout = Layout.from_config(cfg.parallel, world)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(gpus))
    for rank in sorted({0, width - 1, min(gpus, width - 1), world - width, world - 1}):
        monkeypatch.setenv("LOCAL_RANK", str(rank % gpus))
        with fake_world(rank, world, layout):
            ps = parallel_state_here(rank, layout, torch.device("meta"))
            runtime = runtime_placement(engine_spec(cfg), ps, hf)
            here, _, _ = layout_of(runtime, ps)
        assert runtime == planned, rank
        assert here.members == planned.engines[planned.engine_of(rank)] and here.nnodes == len(
            planned.nodes(planned.engine_of(rank))
        )
        launch = EngineLaunch(
            cfg.model.dtype,
            base_gpu_id=here.base_gpu_id,
            tp_size=runtime.gpus_per_engine,
            ep_size=runtime.engine_ep,
            nnodes=here.nnodes,
            dist_init_addr="node0:1" if here.multi_node else None,
        )
        args = colocated_server_args(cfg.rollout, "/m", launch, hf, node_rank=here.node_rank)
        assert (args["tp_size"], args["ep_size"]) == (width, ep)
        needs = rank_needs(hf, width, ep, here.members.index(rank))
        assert (needs.count if needs is not None else routed_experts(hf)) == routed_experts(hf) // ep
        assert ColocatedMemory(None, None, runtime.phases()).phases == planned.phases()  # type: ignore[arg-type]
    nodes_of_last = planned.nodes(len(planned.engines) - 1)
    assert (
        cli_main(["plan", str(recipe), "--nodes", str(nodes), "--gpus-per-node", str(gpus), "--gpu", gpu])
        == 0
    )
    out = capsys.readouterr().out
    assert f"rollout: {len(planned.engines)} SGLang engine(s) x {width} GPU(s)" in out
    assert (
        f"engine EP {ep} " in out and f"train.offload_trainer={str(cfg.train.offload_trainer).lower()}" in out
    )
    last = planned.engines[-1]
    where = (
        f"node {nodes_of_last[0]}"
        if len(nodes_of_last) == 1
        else f"nodes {nodes_of_last[0]}-{nodes_of_last[-1]}"
    )
    assert f"ranks {last[0]}-{last[-1]} on {where}" in out
    for phase in ("start-up", "rollout", "train", "sync", "save"):
        assert phase in out
    assert "override" not in out and "FITS" in out


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_plans_at_most_90_percent_and_its_header_gives_that_peak(recipe: Path) -> None:
    """Recipes are promises (issue 36): each plans at <= 90% of its GPU (a plan FITS up to 95%,
    docs/planner.md), SGLang's runtime and the engines' replicated weights counted; the header's
    'Peak X GiB per GPU (Y%: ...' is the plan's."""
    import re

    from grpo_megatron.config import load_config
    from grpo_megatron.planner import memory

    nodes, gpus, gpu = _cluster(recipe)
    cfg = load_config(recipe)
    plan = memory.plan_memory(
        cfg,
        cfg.model.load_hf_config(),
        nodes * gpus,
        memory.PlanOptions(gpus_per_node=gpus, gpu=memory.GPUS[gpu]),
    )
    assert plan.fits and plan.peak_frac <= 0.90, (plan.peak_gib, plan.peak_frac)
    header = " ".join(line.lstrip("# ") for line in recipe.read_text().split("\n\n", 1)[0].splitlines())
    said = re.search(r"Peak (\d+\.\d) GiB per GPU \((\d+\.\d)%", header)
    assert said is not None, header
    assert (float(said[1]), float(said[2])) == (round(plan.peak_gib, 1), round(100 * plan.peak_frac, 1))


def test_asynchronous_colocated_plan_says_the_gpus_are_time_sliced(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """train.max_staleness=1 with colocated SGLang (issue 40): the runtime puts the engines on the
    trainer's GPUs, so `plan` says so and plans the step as time-sliced, not as engine GPUs of their own."""
    recipe = REPO_ROOT / "examples" / "recipes" / "countdown_qwen25_3b.yaml"
    args = plan_line(recipe)
    args[0] = str(recipe)
    times = "--phase-times=rollout=2,reward=0.5,train=1.5,sync=0.25"
    cli_main(["plan", args[0], "train.max_staleness=1", *args[1:], times])
    out = capsys.readouterr().out
    assert "the engines share the trainer's" in out and "time-sliced" in out, out[-2000:]
    assert "expected step: 4.25 s, as the synchronous colocated step" in out
    assert "of their own, " not in out


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_a_slurm_recipes_signal_lead_and_grace_cover_the_planned_stop(
    recipe: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 51 item 5: a recipe launched with sbatch passes ``--signal=B:USR1@lead`` and sets
    checkpoint.signal_grace_s, both at least what its ``plan`` prints (planner/preemption.py: one
    mini-batch of the update, the sync and the save), the grace below the lead."""
    import re

    from grpo_megatron.config import load_config

    header = recipe.read_text().split("\n\n", 1)[0]
    launch = re.search(r"sbatch --nodes \d+( --signal=B:USR1@(\d+))? launch/slurm/train.sbatch", header)
    if launch is None:
        pytest.skip(f"{recipe.name} is not launched with sbatch")
    assert launch[2] is not None, f"{recipe.name}: the sbatch line gives no --signal=B:USR1@<lead>"
    args = plan_line(recipe)
    cli_main(["plan", str(recipe), *args[1:]])
    out = capsys.readouterr().out
    planned = re.search(r"sbatch --signal=B:USR1@(\d+) .*?checkpoint.signal_grace_s=(\d+)", out, re.S)
    assert planned is not None, out[-2000:]
    lead, grace = int(launch[2]), load_config(recipe).checkpoint.signal_grace_s
    assert lead >= int(planned[1]) and int(planned[2]) <= grace < lead, (lead, grace, planned.groups())
