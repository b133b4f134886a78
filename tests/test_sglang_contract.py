"""Contract test of the SGLang weight data path, against SGLang's own classes (runs wherever
``sglang`` is importable; on CPU ``pip install --no-deps sglang`` plus its pure-Python imports is
enough; skipped elsewhere).

What travels is our real export: a tiny random Qwen3-MoE saved by transformers, loaded into
megatron-core at world size 1 and streamed by ``bridge/export.export_hf_stream`` (fp32 and bf16
casts). Each bucket goes:
- colocated: ``flattened_bucket_payloads`` -> SGLang's ``normalize_serialized_named_tensor_payloads``
  (what ``Engine.update_weights_from_tensor`` does) -> ``MultiprocessingSerializer.deserialize`` of
  each TP rank's own payload (SGLang's scheduler) -> ``FlattenedTensorBucket(...).reconstruct_tensors``
  (SGLang's weight updater);
- disaggregated: our trainer-side group + ``torch.distributed.broadcast`` of the flat bytes, received
  by SGLang's ``init_custom_process_group`` + ``FlattenedTensorBucket.empty`` on another process
  (gloo instead of NCCL).
and must come back with the same names, shapes, dtypes and values.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grpo_megatron.rollout.config import RolloutConfig
from grpo_megatron.rollout.engine import SamplingParams
from grpo_megatron.rollout.sglang_engine import (
    SGLangEngine,
    SGLangUnavailableError,
    aligned_order,
    distributed_update_body,
    flattened_bucket,
    flattened_bucket_payloads,
    import_sglang,
    init_trainer_weight_group,
)
from tests.helpers.dist import free_port, run_distributed

try:
    _, FlattenedTensorBucket, MultiprocessingSerializer = import_sglang()
except SGLangUnavailableError as e:
    pytestmark = pytest.mark.skip(
        reason=f"the SGLang contract needs sglang importable (pip install --no-deps sglang and its "
        f"pure-Python imports; see tests/test_sglang_adapter.py for what runs without it): {e}"
    )

BUCKET_BYTES = 30_000  # several buckets for the tiny model
GROUP = "contract_weights"


def export_buckets(hf_dir: str, dtype: str) -> list[list[tuple[str, torch.Tensor]]]:
    """(worker, world size 1) the export stream of the HF model at ``hf_dir``, as buckets."""
    from grpo_megatron.bridge.export import export_hf_stream
    from grpo_megatron.bridge.hf_loader import load_hf_weights
    from tests.workers.bridge_workers import _build

    model, _, ps, hf = _build(hf_dir, [])
    load_hf_weights(model, ps, hf_dir, hf)
    return list(export_hf_stream(model, ps, hf, bucket_bytes=BUCKET_BYTES, dtype=getattr(torch, dtype)))


def broadcast_worker(port: int, buckets: list[list[tuple[str, torch.Tensor]]]) -> list[dict]:
    """(worker, 2 ranks) rank 0 = our trainer side, rank 1 = SGLang's receiving side, over gloo."""
    import os

    from sglang.srt.utils.common import init_custom_process_group

    rank = int(os.environ["RANK"])
    if rank == 0:
        group = init_trainer_weight_group("127.0.0.1", port, 2, GROUP, backend="gloo", timeout_s=120)
    else:
        group = init_custom_process_group(
            backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=1, group_name=GROUP
        )
    received = []
    for bucket in buckets:
        ordered = aligned_order(bucket)
        body = distributed_update_body(ordered, group_name=GROUP, flush_cache=True, weight_version="1")
        if rank == 0:
            flat = flattened_bucket(ordered, FlattenedTensorBucket, "cpu").get_flattened_tensor()
            torch.distributed.broadcast(flat, src=0, group=group)
        else:
            # What SGLang's weight updater does with the request body (load_format=flattened_bucket).
            into = FlattenedTensorBucket.empty(body["names"], body["dtypes"], body["shapes"], "cpu")
            torch.distributed.broadcast(into.get_flattened_tensor(), src=0, group=group)
            received.append({name: t.clone() for name, t in into.reconstruct_tensors()})
    return received


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list]]:
    """The tiny Qwen3-MoE's directory and its export buckets at fp32 and bf16 (one launch each)."""
    from tests.workers.bridge_workers import save_tiny_model

    hf_dir = tmp_path_factory.mktemp("hf") / "qwen3_moe"
    save_tiny_model("qwen3_moe", hf_dir, seed=0)
    buckets = {}
    for dtype in ("float32", "bfloat16"):
        (buckets[dtype],) = run_distributed(
            "tests.test_sglang_contract:export_buckets", 1, timeout_s=240, hf_dir=str(hf_dir), dtype=dtype
        )
    return hf_dir, buckets


def _sglang_load(payloads: list, tp_rank: int) -> list[tuple[str, torch.Tensor]]:
    """SGLang's receiving side of ``update_weights_from_tensor(load_format="flattened_bucket")``."""
    from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    per_rank = normalize_serialized_named_tensor_payloads(payloads)
    data = MultiprocessingSerializer.deserialize(per_rank[tp_rank])
    metadata = [
        FlattenedTensorMetadata(m.name, m.shape, m.dtype, m.start_idx, m.end_idx, m.numel)
        for m in data["metadata"]
    ]
    return FlattenedTensorBucket(
        flattened_tensor=data["flattened_tensor"], metadata=metadata
    ).reconstruct_tensors()


def _differences(
    sent: list[tuple[str, torch.Tensor]], got: list[tuple[str, torch.Tensor]] | dict
) -> list[str]:
    got = dict(got)
    problems = [f"{n}: missing" for n, _ in sent if n not in got] + [
        f"{n}: extra" for n in got if n not in dict(sent)
    ]
    for name, t in sent:
        if name in got:
            g = got[name]
            if g.shape != t.shape or g.dtype != t.dtype or not torch.equal(g, t):
                problems.append(f"{name}: sent {tuple(t.shape)} {t.dtype}, got {tuple(g.shape)} {g.dtype}")
    return problems


def test_exported_buckets_survive_sglangs_tensor_path_at_every_tp_rank(exported) -> None:
    hf_dir, buckets = exported
    from safetensors.torch import load_file

    saved = load_file(str(hf_dir / "model.safetensors"))
    for dtype, stream in buckets.items():
        assert len(stream) >= 2, f"{dtype}: {len(stream)} bucket(s); the test wants several"
        names = [n for bucket in stream for n, _ in bucket]
        assert sorted(names) == sorted(saved), f"{dtype}: the export does not carry the checkpoint's names"
        for i, bucket in enumerate(stream):
            payloads = flattened_bucket_payloads(
                bucket, 2, (FlattenedTensorBucket, MultiprocessingSerializer)
            )
            assert len(payloads) == 2 and all(isinstance(p, str) for p in payloads)
            for tp_rank in range(2):
                problems = _differences(bucket, _sglang_load(payloads, tp_rank))
                assert not problems, f"{dtype} bucket {i} TP rank {tp_rank}: {problems[:5]}"


def test_a_bucket_of_mixed_dtypes_and_odd_sizes_survives(exported) -> None:
    """One bucket with bf16 tensors of odd element counts before fp32/int64 ones: without the
    aligned order the fp32 slice would start at an odd byte offset."""
    _, buckets = exported
    g = torch.Generator().manual_seed(0)
    bucket = [
        ("a.bf16_odd", torch.randn(3, 5, generator=g).bfloat16()),
        ("b.fp32", torch.randn(7, generator=g)),
        ("c.bf16_one", torch.randn(1, generator=g).bfloat16()),
        ("d.fp64", torch.randn(2, 3, generator=g).double()),
        ("e.fp16", torch.randn(9, generator=g).half()),
        *buckets["bfloat16"][0][:2],
    ]
    payloads = flattened_bucket_payloads(bucket, 1, (FlattenedTensorBucket, MultiprocessingSerializer))
    assert not _differences(bucket, _sglang_load(payloads, 0))


def test_exported_buckets_survive_the_broadcast_path_into_sglangs_receiver(exported) -> None:
    _, buckets = exported
    stream = buckets["bfloat16"]
    _, received = run_distributed(
        "tests.test_sglang_contract:broadcast_worker", 2, timeout_s=180, port=free_port(), buckets=stream
    )
    assert len(received) == len(stream)
    for i, (bucket, got) in enumerate(zip(stream, received, strict=True)):
        assert not _differences(bucket, got), f"bucket {i}: {_differences(bucket, got)[:5]}"


class LoadingEngine:
    """Stand-in for an ``sglang.Engine`` (which needs a GPU) with SGLang's own receiving code in
    ``update_weights_from_tensor``: every TP rank loads its payload into a name -> tensor dict."""

    def __init__(self, tp_size: int):
        self.tp_size = tp_size
        self.weights: list[dict[str, torch.Tensor]] = [{} for _ in range(tp_size)]
        self.calls: list[tuple[str, object]] = []

    def update_weights_from_tensor(self, payloads, load_format=None, flush_cache=True):
        assert load_format == "flattened_bucket" and len(payloads) == self.tp_size
        for rank in range(self.tp_size):
            self.weights[rank].update((n, t.clone()) for n, t in _sglang_load(payloads, rank))
        self.calls.append(("update", flush_cache))
        return True, "Success"

    def generate(self, input_ids, sampling_params, **kwargs):
        self.calls.append(("generate", [sp["sampling_seed"] for sp in sampling_params]))
        return [
            {
                "output_ids": [5],
                "meta_info": {
                    "output_token_logprobs": [(-0.5, 5, None)],
                    "finish_reason": {"type": "length"},
                },
            }
            for _ in input_ids
        ]

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", tags))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", tags))

    def flush_cache(self):
        self.calls.append(("flush", None))

    def shutdown(self):
        self.calls.append(("shutdown", None))


def test_engine_streams_a_version_and_refuses_bad_or_partial_ones(exported) -> None:
    hf_dir, buckets = exported
    stream = buckets["float32"]
    stub = LoadingEngine(tp_size=2)
    engine = SGLangEngine(
        RolloutConfig(engine="sglang", sglang_tp=2), str(hf_dir), device="cpu", servers=[stub]
    )
    for i, bucket in enumerate(stream):
        engine.update_weights(bucket, version=1, last=i == len(stream) - 1)
    assert engine.weight_version == 1
    flat = [kv for b in stream for kv in b]
    for rank in range(2):
        assert not _differences(flat, stub.weights[rank]), f"TP rank {rank}"
    # The cache is flushed once, with the last bucket.
    assert [flush for what, flush in stub.calls if what == "update"] == [False] * (len(stream) - 1) + [True]

    # A misshapen tensor in the first bucket: refused before anything is sent, version 1 still served.
    name, t = stream[0][0]
    sent_before = len(stub.calls)
    with pytest.raises(ValueError, match=f"{name}: shape"):
        engine.update_weights([(name, t[:1])], version=2, last=False)
    assert len(stub.calls) == sent_before and engine.weight_version == 1
    engine.generate([[1, 2]], SamplingParams(n=2, seed=3))

    # A version that leaves tensors out: loud, and the engine refuses to generate until a full one.
    with pytest.raises(RuntimeError, match="ended without"):
        engine.update_weights(stream[0], version=2, last=True)
    with pytest.raises(RuntimeError, match="incomplete"):
        engine.generate([[1, 2]], SamplingParams(n=2))
    for i, bucket in enumerate(stream):
        engine.update_weights(bucket, version=3, last=i == len(stream) - 1)
    assert engine.weight_version == 3
    completions = engine.generate([[1, 2], [3]], SamplingParams(n=2, seed=3))
    assert [[c.token_ids for c in group] for group in completions] == [[[5], [5]], [[5], [5]]]
    seeds = [s for what, s in stub.calls if what == "generate"]
    assert seeds[0] == seeds[1][:2] and len(set(seeds[1])) == 4  # seeded: reproducible, distinct per sample
