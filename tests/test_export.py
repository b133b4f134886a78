"""Export stream internals (bridge/export.py and its parts): HF tensors assembled straight from
TP/ETP slices (bridge/assemble.py) equal ``to_hf`` of the gathered tensor for every transform kind;
a destination other than rank 0, a cast on export and a reused plan on two real megatron-core ranks.

The bit-exact round trips of every architecture and layout are in test_bridge.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grpo_megatron.bridge.assemble import assemble_hf
from grpo_megatron.bridge.export_plan import MIN_ROUND_BYTES, MIN_ROUNDS, _schedule
from grpo_megatron.bridge.fp8 import Fp8Weights
from grpo_megatron.bridge.transforms import to_hf
from grpo_megatron.models.weight_rules import QKVGroups, copy, glu, qkv, vocab
from tests.helpers.dist import run_distributed
from tests.helpers.tiny_configs import tiny_hf_config

QKV = qkv("qkv", "q", "k", "v", QKVGroups(heads=4, groups=2, head_dim=3))
# (rule, canonical shape, split dim or None, GLU slices): every kind, split along 0, along 1 (the
# fallback that gathers first for kinds other than copy), unsplit, and QKV slices that cut a group.
CASES = [
    (copy("w", "W"), (8, 6), 0, False),
    (copy("w", "W"), (8, 6), 1, False),
    (copy("w", "W"), (8, 6), None, False),
    (copy("w", "W"), (8,), 0, False),
    (copy("w", "W"), (), None, False),
    (copy("w", "W"), (8, 6), 0, True),  # a GLU tensor exported as one HF tensor
    (glu("fc1", "gate", "up"), (8, 6), 0, True),
    (glu("fc1", "gate", "up"), (8, 6), None, True),
    (glu("fc1", "gate", "up"), (8, 8), 1, True),
    (glu("fc1", "gate", "up"), (12, 6), 0, False),  # slices straddling the gate/up boundary
    (vocab("emb", "E", 5), (8, 6), 0, False),  # the second slice is all padding
    (vocab("emb", "E", 2), (8, 6), 0, False),
    (vocab("emb", "E", 7), (8, 6), None, False),
    (vocab("emb", "E", 3), (8, 6), 1, False),
    (QKV, (24, 5), 0, False),
    (QKV, (24,), 0, False),  # a QKV bias
    (QKV, (24, 5), None, False),
    (QKV, (24, 4), 1, False),
    (qkv("qkv", "q", "k", "v", QKVGroups(heads=4, groups=1, head_dim=3)), (18, 4), 0, False),
]


def _slices(full: torch.Tensor, dim: int | None, glu_halves: bool, n: int) -> list[torch.Tensor]:
    """Rank r's slice as megatron holds it (GLU: the r-th slice of each half, stacked)."""
    if dim is None:
        return [full]
    halves = full.chunk(2, dim=dim) if glu_halves else (full,)
    return [torch.cat([h.chunk(n, dim=dim)[r] for h in halves], dim=dim) for r in range(n)]


@pytest.mark.parametrize(("rule", "shape", "dim", "glu_halves"), CASES)
def test_assemble_hf_equals_to_hf_of_the_gathered_tensor(rule, shape, dim, glu_halves) -> None:
    full = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)))
    for dtype in (torch.float32, torch.bfloat16):
        got = assemble_hf(rule, shape, dim, glu_halves, _slices(full, dim, glu_halves, 2), dtype)
        want = [(name, t.to(dtype)) for name, t in to_hf(rule, full)]
        assert [n for n, _ in got] == [n for n, _ in want]
        for (name, a), (_, b) in zip(got, want, strict=True):
            assert a.dtype == dtype and a.is_contiguous() and torch.equal(a, b), name
            assert a.untyped_storage().nbytes() == a.numel() * a.element_size(), f"{name} shares memory"


def test_rounds_are_a_sixteenth_of_a_large_export_but_hold_min_round_bytes() -> None:
    """A model of a few MB goes in one round (a round costs a wait whatever its size); a large one is
    still cut MIN_ROUNDS ways; a bucket's quarter still bounds a round (small sync buckets)."""
    mib = 1 << 20
    tiny = _schedule([1000] * 3700, 512 * mib)  # the demo's 3.7 MB
    assert [len(bucket) for bucket in tiny] == [1] and MIN_ROUND_BYTES > 3700 * 1000
    large = _schedule([mib] * 256, 512 * mib)  # 256 MiB: rounds of 16 MiB
    assert [len(bucket) for bucket in large] == [MIN_ROUNDS] and all(len(r) == 16 for r in large[0])
    small_buckets = _schedule([1000] * 100, 20_000)  # rounds of a quarter bucket, 5 items
    assert len(small_buckets) == 5 and all(len(r) == 5 for bucket in small_buckets for r in bucket)


@pytest.mark.launches
def test_stream_to_rank_1_with_a_cast_and_a_reused_plan(tmp_path: Path) -> None:
    hf_dir = tmp_path / "qwen3_moe"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(tiny_hf_config("qwen3_moe")))
    # DP2: both ranks hold every expert (expert-data-parallel copies): each is sent once, or not at all.
    layouts = {"TP2": ["parallel.tp=2"], "EP2": ["parallel.ep=2"], "PP2": ["parallel.pp=2"], "DP2": []}
    rank0, rank1 = run_distributed(
        "tests.workers.export_workers:stream_to_each_rank",
        2,
        timeout_s=300,
        hf_dir=str(hf_dir),
        layouts=layouts,
        bucket_bytes=20_000,
    )
    for layout in layouts:
        r0, r1 = rank0[layout], rank1[layout]
        assert r0["buckets"] >= 2 and r1["dst1_buckets"] == r0["buckets"], layout
        ref = r0["dst0"]
        # The same tensors whichever rank receives them; bf16 is the fp32 export cast.
        assert list(r1["dst1"]) == list(ref) and all(torch.equal(r1["dst1"][k], v) for k, v in ref.items())
        assert all(torch.equal(r1["dst1_bf16"][k], v.to(torch.bfloat16)) for k, v in ref.items())
        assert r1["owns_memory"], layout
        for planned in r1["dst1_planned"]:  # a reused plan streams the same tensors
            assert list(planned) == list(ref) and all(torch.equal(planned[k], v) for k, v in ref.items())
        # Quantized as it lands (FP8 engines): exactly the bf16 export's tensors through the quantizer,
        # weight then scales, in the plan's manifest's order, names, shapes and dtypes.
        fp8, want = r1["dst1_fp8"], Fp8Weights().quantize(r1["dst1_bf16"].items())
        assert [n for n, _ in fp8] == [n for n, _ in want], layout
        assert all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            for (_, a), (_, b) in zip(fp8, want, strict=True)
        )
        assert [[n, list(t.shape), str(t.dtype)] for n, t in fp8] == [list(e) for e in r1["fp8_manifest"]], (
            layout
        )
        assert sum(t.dtype == torch.float8_e4m3fn for _, t in fp8) > 10, layout


@pytest.mark.launches
def test_deepseek_v3_router_bias_reaches_the_engine_in_fp32_from_a_bf16_export(tmp_path: Path) -> None:
    hf_dir = tmp_path / "deepseek_v3"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(tiny_hf_config("deepseek_v3")))
    got, _ = run_distributed(
        "tests.workers.export_workers:router_bias_to_an_engine", 2, timeout_s=300, hf_dir=str(hf_dir)
    )
    assert got["trainer"] and got["exported"].keys() == got["trainer"].keys() == got["engine"].keys()
    for name, bias in got["trainer"].items():
        assert bias.dtype == torch.float32 and not torch.equal(
            bias, bias.to(torch.bfloat16).float()
        )  # bf16 would round it
        assert got["exported"][name].dtype == torch.float32 and torch.equal(got["exported"][name], bias), name
        assert got["engine"][name].dtype == torch.float32 and torch.equal(got["engine"][name], bias), name
