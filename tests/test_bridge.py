"""Weight bridge: HF safetensors -> megatron (any layout) -> HF is bit-exact, key for key, for every
supported architecture; megatron's logits match transformers' on the loaded weights.

Tiny random models are made by transformers itself from configs and saved with save_pretrained
(fp32 safetensors), so names and shapes are compared against transformers' own files. Real
megatron-core on gloo through torch.distributed.run; several cases share one launch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from grpo_megatron.bridge.safetensors_writer import SafetensorsWriter
from grpo_megatron.bridge.transforms import read_shard, to_hf
from grpo_megatron.models.registry import UnsupportedModelError, get_adapter
from grpo_megatron.models.weight_rules import QKVGroups, qkv
from tests.helpers.dist import REPO_ROOT, free_port, run_distributed
from tests.helpers.tiny_configs import TINY_CONFIGS
from tests.helpers.weights import dict_reader
from tests.workers.bridge_workers import EXAMPLE, batch_tokens, reference_kwargs, save_tiny_model

LOGIT_TOL = 1e-4  # fp32
BUCKET_BYTES = 20_000  # small, so every export spans several buckets


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, torch.Tensor]]]:
    root = tmp_path_factory.mktemp("hf")
    refs = {mt: save_tiny_model(mt, root / mt, seed=i) for i, mt in enumerate(TINY_CONFIGS)}
    return root, refs


def _check(results: dict, *, logits: bool) -> None:
    failures = []
    for case, r in results.items():
        for key in ("missing", "extra", "shape_diff", "not_exact"):
            if r[key]:
                failures.append(f"{case}: {key} {r[key][:4]}")
        if r["order_dupes"] or r["buckets"] < 2:
            failures.append(f"{case}: {r['order_dupes']} duplicate names, {r['buckets']} buckets")
        diffs = ("logprob_diff", "logit_diff") if logits else ("logprob_diff",)
        failures += [f"{case}: {k}={r[k]:.3g} > {LOGIT_TOL}" for k in diffs if not r[k] <= LOGIT_TOL]
    assert not failures, "\n".join(failures)


def _cases(root: Path, refs: dict, layouts: dict[str, tuple[list[str], list[str]]]) -> tuple[dict, dict]:
    cases, case_refs = {}, {}
    for layout, (model_types, overrides) in layouts.items():
        for mt in model_types:
            cases[f"{mt} {layout}"] = (str(root / mt), overrides)
            case_refs[f"{mt} {layout}"] = refs[mt]
    return cases, case_refs


@pytest.mark.launches
def test_every_architecture_round_trips_exactly_at_world_1(tiny) -> None:
    root, refs = tiny
    cases, case_refs = _cases(root, refs, {"world1": (list(TINY_CONFIGS), [])})
    (results,) = run_distributed(
        "tests.workers.bridge_workers:roundtrip",
        1,
        timeout_s=240,
        cases=cases,
        refs=case_refs,
        bucket_bytes=BUCKET_BYTES,
    )
    _check(results, logits=True)


MOE = ["qwen3_moe", "deepseek_v3"]
TWO_RANKS = {
    "TP2": (list(TINY_CONFIGS), ["parallel.tp=2"]),
    "EP2": ([*MOE, "mixtral"], ["parallel.ep=2"]),
    "PP2": ([*MOE, "qwen3"], ["parallel.pp=2"]),  # qwen3: tied embeddings split over two stages
    "TP2 ETP1 EP2": (["qwen3_moe"], ["parallel.tp=2", "parallel.etp=1", "parallel.ep=2"]),
}


@pytest.mark.launches
def test_two_rank_layouts_round_trip_exactly(tiny) -> None:
    root, refs = tiny
    cases, case_refs = _cases(root, refs, TWO_RANKS)
    per_rank = run_distributed(
        "tests.workers.bridge_workers:roundtrip",
        2,
        timeout_s=420,
        cases=cases,
        refs=case_refs,
        bucket_bytes=BUCKET_BYTES,
    )
    _check(per_rank[0], logits=False)
    failures = [
        f"rank 1 {c}: {r['logprob_diff']:.3g}"
        for c, r in per_rank[1].items()
        if not r["logprob_diff"] <= LOGIT_TOL
    ]
    assert not failures


@pytest.mark.launches
def test_tp2_ep2_round_trips_exactly_and_writes_a_loadable_model(tiny, tmp_path: Path) -> None:
    root, refs = tiny
    cases, case_refs = _cases(root, refs, {"TP2xEP2": (MOE, ["parallel.tp=2", "parallel.ep=2"])})
    written = tmp_path / "exported"
    per_rank = run_distributed(
        "tests.workers.bridge_workers:roundtrip",
        4,
        timeout_s=420,
        cases=cases,
        refs=case_refs,
        bucket_bytes=BUCKET_BYTES,
        write_dirs={"deepseek_v3 TP2xEP2": str(written)},
    )
    _check(per_rank[0], logits=False)
    assert all(r["logprob_diff"] <= LOGIT_TOL for rank in per_rank for r in rank.values())

    # The writer's output (sharded files, index, config.json) is a model transformers loads as is.
    from transformers import AutoModelForCausalLM

    assert (
        len(list(written.glob("model-*-of-*.safetensors"))) == per_rank[0]["deepseek_v3 TP2xEP2"]["buckets"]
    )
    model = AutoModelForCausalLM.from_pretrained(written, **reference_kwargs("deepseek_v3")).eval()
    with torch.no_grad():
        logits = model(batch_tokens()).logits
    # Bit equality holds: transformers with the reference's own kernels (reference_kwargs), same weights.
    assert torch.equal(logits, refs["deepseek_v3"]["logits"])


def _broken_copy(src: Path, dst: Path, edit) -> str:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


@pytest.mark.launches
def test_broken_checkpoints_fail_naming_key_and_file(tiny, tmp_path: Path) -> None:
    root, _ = tiny
    src = root / "qwen3_moe"
    key = "model.layers.1.mlp.experts.2.up_proj.weight"
    missing = _broken_copy(src, tmp_path / "missing", lambda t: t.pop(key))
    reshaped = _broken_copy(src, tmp_path / "reshaped", lambda t: t.update({key: t[key][:-1].clone()}))
    no_shard = tmp_path / "no_shard"
    shutil.copytree(src, no_shard)
    keys = list(load_file(src / "model.safetensors"))
    (no_shard / "model.safetensors").rename(no_shard / "model-00001-of-00002.safetensors")
    weight_map = {
        k: "model-00002-of-00002.safetensors" if k == key else "model-00001-of-00002.safetensors"
        for k in keys
    }
    (no_shard / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    (errors,) = run_distributed(
        "tests.workers.bridge_workers:load_errors",
        1,
        timeout_s=180,
        cases={
            "missing": (missing, str(src)),
            "reshaped": (reshaped, str(src)),
            "no_shard": (str(no_shard), str(src)),
        },
    )
    assert errors["missing"].startswith("CheckpointError") and key in errors["missing"], errors["missing"]
    assert "missing" in errors["missing"]
    assert (
        key in errors["reshaped"]
        and "model.safetensors" in errors["reshaped"]
        and "[31, 64]" in errors["reshaped"]
    )
    assert "model-00002-of-00002.safetensors" in errors["no_shard"] and "does not exist" in errors["no_shard"]


def test_unsupported_model_type_names_it() -> None:
    with pytest.raises(UnsupportedModelError, match="'llama'.*supported: deepseek_v3"):
        get_adapter({"model_type": "llama"})


def test_qkv_transform_groups_heads_per_query_group() -> None:
    # 4 query heads in 2 groups of head width 1: fused rows are [q0 q1 k0 v0 | q2 q3 k1 v1].
    rule = qkv("qkv", "q", "k", "v", QKVGroups(heads=4, groups=2, head_dim=1))
    hf = {
        "q": torch.tensor([[0.0], [1.0], [2.0], [3.0]]),
        "k": torch.tensor([[10.0], [11.0]]),
        "v": torch.tensor([[20.0], [21.0]]),
    }
    full = read_shard(rule, dict_reader(hf), (8, 1), 0, 1, 0)
    assert full[:, 0].tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    shard1 = read_shard(rule, dict_reader(hf), (8, 1), 0, 2, 1)  # TP rank 1 of 2: the second group
    assert shard1[:, 0].tolist() == [2, 3, 11, 21]
    assert all(torch.equal(t, hf[n]) for n, t in to_hf(rule, full))


def test_writer_leaves_nothing_at_the_output_when_the_export_fails(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"), SafetensorsWriter(out, {"model_type": "qwen3"}) as writer:
        writer([("a", torch.zeros(2))])
        raise RuntimeError("boom")
    assert not out.exists() and list(tmp_path.iterdir()) == []
    with SafetensorsWriter(out, {"model_type": "qwen3"}) as writer:
        writer([("a", torch.zeros(2))])
        writer([("b", torch.ones(3))])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {
        "a": "model-00001-of-00002.safetensors",
        "b": "model-00002-of-00002.safetensors",
    }
    assert torch.equal(load_file(out / "model-00002-of-00002.safetensors")["b"], torch.ones(3))
    assert json.loads((out / "config.json").read_text()) == {"model_type": "qwen3"}


def _cli(args: list[str], world_size: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_COMPILE_DISABLE="1", MASTER_PORT=str(free_port()))
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world_size)]
        if world_size > 1
        else []
    )
    return subprocess.run(
        [sys.executable, *launcher, "-m", "grpo_megatron", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.launches
def test_verify_command_passes_at_tp2_and_fails_over_tolerance(tiny) -> None:
    root, _ = tiny
    hf_path = f"model.hf_path={root / 'qwen3_moe'}"
    ok = _cli(["verify", str(EXAMPLE), hf_path, "parallel.tp=2"], world_size=2)
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-3000:]
    assert "tp=2" in ok.stdout and "OK" in ok.stdout, ok.stdout
    strict = _cli(["verify", str(EXAMPLE), hf_path, "--tol", "1e-12"], world_size=1)
    assert strict.returncode == 1 and "FAILED" in strict.stdout, strict.stdout + strict.stderr[-3000:]
