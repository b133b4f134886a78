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

Beyond the bytes: a version's loads run inside SGLang's weight-update session (``begin_weight_update``
... ``end_weight_update``, which 0.5.23 requires), and every request body we send (HTTP and the
distributed-update metadata) carries only fields SGLang's own request structs declare, to endpoints
its HTTP server has. Those structs live in ``sglang.srt.managers.io_struct``, which cannot be imported
on CPU: it imports ``torchvision`` (via ``sglang.srt.configs`` -> ``multimodal/internvl_utils.py``),
and PyPI's torchvision is a CUDA build that fails beside the CPU torch. So their fields are read from
the installed source with ``ast`` (the installed version's declarations, not a copy of them).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from grpo_megatron.rollout.config import RolloutConfig, SGLangConfig
from grpo_megatron.rollout.engine import SamplingParams
from grpo_megatron.rollout.sglang.engine import SGLangEngine
from grpo_megatron.rollout.sglang.ipc import (
    flattened_bucket_payloads,
)
from grpo_megatron.rollout.sglang.launch import EngineLaunch, SGLangUnavailableError, import_sglang
from grpo_megatron.rollout.sglang.nccl import (
    WEIGHT_GROUP_NAME,
    SGLangHttpClient,
    distributed_update_body,
    init_trainer_weight_group,
)
from grpo_megatron.rollout.sglang.weights import (
    aligned_order,
    flattened_bucket,
)
from tests.helpers.dist import free_port, run_distributed

pytestmark = pytest.mark.launches  # every test here: a job, the real engine or ranks of their own

try:
    sglang, FlattenedTensorBucket, MultiprocessingSerializer = import_sglang()
    SGLANG_DIR = Path(sglang.__file__).parent
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
    # Both sides done before either tears its group down: a rank that exits while gloo still serves
    # the other's last receive aborts ("terminate called without an active exception").
    torch.distributed.barrier(group=group)
    torch.distributed.destroy_process_group(group)
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
        self.session_open = False

    # SGLang 0.5.23's scheduler: loads only inside a session, one session at a time, (success, message).
    def begin_weight_update(self, selector: str = "all"):
        self.calls.append(("begin", None))
        if self.session_open:
            return False, "a weight-update session is already open"
        self.session_open = True
        return True, "Success"

    def end_weight_update(self):
        self.calls.append(("end", None))
        if not self.session_open:
            return False, "no weight-update session is open"
        self.session_open = False
        return True, "Success"

    def update_weights_from_tensor(self, payloads, load_format=None, flush_cache=True):
        assert load_format == "flattened_bucket" and len(payloads) == self.tp_size
        if not self.session_open:
            return (
                False,
                "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()",
            )
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
        RolloutConfig(engine="sglang", sglang=SGLangConfig(tp=2)),
        str(hf_dir),
        EngineLaunch(device="cpu"),
        servers=[stub],
    )
    for i, bucket in enumerate(stream):
        engine.update_weights(bucket, version=1, last=i == len(stream) - 1)
    assert engine.weight_version == 1
    flat = [kv for b in stream for kv in b]
    for rank in range(2):
        assert not _differences(flat, stub.weights[rank]), f"TP rank {rank}"
    # One session around the version's loads; the cache is flushed once, with the last bucket.
    assert [what for what, _ in stub.calls] == ["begin", *["update"] * len(stream), "end"]
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
    # A version abandoned half-way leaves its session open: the next version loads in it and closes it.
    engine.update_weights(stream[0], version=3, last=False)
    with pytest.raises(ValueError, match=f"{name}: shape"):
        engine.update_weights([(name, t[:1])], version=3, last=False)
    assert stub.session_open
    for i, bucket in enumerate(stream):
        engine.update_weights(bucket, version=3, last=i == len(stream) - 1)
    assert engine.weight_version == 3 and not stub.session_open
    completions = engine.generate([[1, 2], [3]], SamplingParams(n=2, seed=3))
    assert [[c.token_ids for c in group] for group in completions] == [[[5], [5]], [[5], [5]]]
    seeds = [s for what, s in stub.calls if what == "generate"]
    assert seeds[0] == seeds[1][:2] and len(set(seeds[1])) == 4  # seeded: reproducible, distinct per sample


# ----------------------------------------------------------------------------------------------------
# Request bodies against SGLang's declared request structs and endpoints (read from its source)


def _struct_fields(class_name: str) -> set[str]:
    """Field names SGLang's ``io_struct.<class_name>`` declares (its own and its bases' in the file)."""
    tree = ast.parse((SGLANG_DIR / "srt" / "managers" / "io_struct.py").read_text())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    assert class_name in classes, (
        f"sglang's io_struct has no {class_name}: the adapter targets another release"
    )
    fields: set[str] = set()
    todo = [classes[class_name]]
    while todo:
        node = todo.pop()
        fields |= {
            s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
        }
        todo += [classes[b.id] for b in node.bases if isinstance(b, ast.Name) and b.id in classes]
    return fields


def _http_endpoints() -> set[str]:
    source = (SGLANG_DIR / "srt" / "entrypoints" / "http_server.py").read_text()
    return set(re.findall(r'@app\.(?:post|get|api_route)\(\s*"(/[^"]+)"', source))


class RecordingClient(SGLangHttpClient):
    """Our HTTP client with the transport replaced by a record of (path, body)."""

    def __init__(self) -> None:
        super().__init__("http://recorded", timeout_s=1)
        self.sent: list[tuple[str, dict | None]] = []

    def _call(self, path, body=None, timeout_s=None):
        self.sent.append((path, body))
        return {"tp_size": 2} if path == "/get_server_info" else {"success": True}


# endpoint -> SGLang's request struct its body is parsed into (http_server.py's handlers)
REQUEST_STRUCTS = {
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/generate": "GenerateReqInput",
}


def test_every_http_request_goes_to_an_sglang_endpoint_with_declared_fields(exported) -> None:
    _, buckets = exported
    ordered = aligned_order(buckets["bfloat16"][0])
    client = RecordingClient()
    client.healthy()
    client.tp_size()
    client.generate(input_ids=[[1, 2]], sampling_params=[{"max_new_tokens": 1}], return_logprob=True)
    client.flush_cache()
    client.release_memory_occupation(["weights"])
    client.resume_memory_occupation(None)
    client.init_weights_update_group(
        master_address="h",
        master_port=1,
        rank_offset=1,
        world_size=3,
        group_name=WEIGHT_GROUP_NAME,
        backend="nccl",
    )
    client.begin_weight_update()
    client.update_weights_from_distributed(
        **distributed_update_body(ordered, group_name=WEIGHT_GROUP_NAME, flush_cache=True, weight_version="3")
    )
    client.end_weight_update()
    client.destroy_weights_update_group(WEIGHT_GROUP_NAME)
    endpoints = _http_endpoints()
    for path, body in client.sent:
        assert path in endpoints, f"{path}: SGLang {SGLANG_DIR} serves no such endpoint"
        if body:
            unknown = set(body) - _struct_fields(REQUEST_STRUCTS[path])
            assert not unknown, (
                f"{path} sends {sorted(unknown)}, which {REQUEST_STRUCTS[path]} does not declare"
            )


def test_distributed_update_metadata_lays_out_the_senders_bytes_in_sglangs_receiver(exported) -> None:
    """The names/dtypes/shapes of ``/update_weights_from_distributed``: dtype strings SGLang resolves
    with ``getattr(torch, ...)``, plain int lists, and ``FlattenedTensorBucket.empty`` (the receiver
    of ``load_format="flattened_bucket"``) laying out exactly the bytes our flat tensor holds."""
    import json

    _, buckets = exported
    for dtype, stream in buckets.items():
        for i, bucket in enumerate(stream):
            ordered = aligned_order(bucket)
            body = json.loads(
                json.dumps(
                    distributed_update_body(ordered, group_name=GROUP, flush_cache=False, weight_version=None)
                )
            )  # what travels is JSON
            assert body["load_format"] == "flattened_bucket" and "weight_version" not in body
            assert [getattr(torch, d) for d in body["dtypes"]] == [t.dtype for _, t in ordered]
            flat = flattened_bucket(ordered, FlattenedTensorBucket, "cpu").get_flattened_tensor()
            into = FlattenedTensorBucket.empty(body["names"], body["dtypes"], body["shapes"], "cpu")
            assert into.get_flattened_tensor().numel() == flat.numel(), f"{dtype} bucket {i}: sizes differ"
            into.get_flattened_tensor().copy_(flat)
            assert not _differences(ordered, into.reconstruct_tensors()), f"{dtype} bucket {i}"


def test_per_gpu_payloads_and_an_empty_one_survive_sglangs_tensor_path(exported) -> None:
    """The colocated engine's GPUs each send their own payload (``rank_payload``); a GPU with nothing
    in a round sends a payload without tensors, which SGLang's updater turns into no tensors."""
    from grpo_megatron.rollout.sglang.ipc import rank_payload

    _, buckets = exported
    bucket = buckets["bfloat16"][0]
    classes = (FlattenedTensorBucket, MultiprocessingSerializer)
    payloads = [
        rank_payload(bucket[:1], classes),
        rank_payload([], classes),
        rank_payload(bucket[1:], classes),
    ]
    assert not _differences(bucket[:1], _sglang_load(payloads, 0))
    assert _sglang_load(payloads, 1) == []
    assert not _differences(bucket[1:], _sglang_load(payloads, 2))
