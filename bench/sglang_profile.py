"""Where the milliseconds of one weight load and one generate call go, through the SGLang adapter
(``grpo_megatron/rollout/sglang/``) and on ``sglang.Engine`` directly (the floor), on SGLang's CPU engine.

One engine is started (the adapter's); the direct calls go to the same ``sglang.Engine`` object the
adapter drives, so both sides pay the same processes, model and settings. Each row is the median
over ``--repeats`` rounds after one warm-up round. Rows:

weight load (one version of ``--buckets`` buckets; every row per call unless it says per version)
- ``checks``: the adapter's bucket check (names, shapes, dtypes: ``WeightLoad.accept``);
- ``serialize``: one ``FlattenedTensorBucket`` + ``MultiprocessingSerializer`` payload, written into the
  transport's reused shared memory (``SharedStaging``); ``write, new file``: the same bytes written
  into a new shared-memory file instead (not serialized);
- ``begin`` / ``end``: ``begin_weight_update`` / ``end_weight_update`` round trips (0.5.21 on);
- ``load rpc``: ``update_weights_from_tensor(flush_cache=False)`` round trip: the tokenizer manager's
  writer lock, the scheduler's deserialization, ``load_weights``, the TP barrier, the reply;
- ``empty rpc``: the same with a one-byte payload (no tensor): the round trip's fixed part;
- ``idle wake``: ``empty rpc`` after the scheduler has been idle ``--idle-s`` (asleep in its poller);
- ``flush``: ``flush_cache()`` (on CPU it includes a ``gc.collect()`` of the scheduler's heap);
- ``release`` / ``resume``: the adapter's ``release_memory`` / ``resume_memory`` of every tag;
- ``adapter call`` / ``direct call``: one ``update_weights(bucket, last=False)`` / the same calls made
  on ``sglang.Engine`` with a payload made in the call; ``adapter version`` / ``direct version``: a
  whole version (every bucket, then the closing call).

generate (``--prompts`` x ``--samples``, ``--new-tokens``, temperature 1, logprobs)
- ``request``: building the request (``protocol.generate_request``);
- ``engine.generate``: SGLang's own call on that request (tokenizer manager, scheduler, detokenizer);
- ``decode``: the outputs into ``Completion``s (``protocol.completions``);
- ``adapter generate``: ``SGLangEngine.generate`` in all.

    python bench/sglang_profile.py            # the demo's model, fp32
    python bench/sglang_profile.py --hidden 512 --layers 8 --experts 8 --new-tokens 32   # ~400 MiB
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from sglang_cpu import buckets, save_model


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return (time.perf_counter() - start) * 1e3, out


class Rows:
    """Milliseconds per named row, over rounds."""

    def __init__(self) -> None:
        self.ms: dict[str, list[float]] = {}

    def add(self, name: str, ms: float) -> None:
        self.ms.setdefault(name, []).append(ms)

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        ms, out = timed(fn)
        self.add(name, ms)
        return out

    def run_timed(self, name: str, fn: Callable[[], Any]) -> float:
        ms, _ = timed(fn)
        self.add(name, ms)
        return ms

    def median(self, name: str) -> float:
        return statistics.median(self.ms[name])

    def print(self, title: str) -> None:
        print(f"\n{title}")
        print(f"  {'row':<26}{'median ms':>11}{'min ms':>10}{'n':>5}")
        for name, values in self.ms.items():
            print(f"  {name:<26}{statistics.median(values):>11.2f}{min(values):>10.2f}{len(values):>5}")


def ok(result: Any, what: str) -> None:
    from grpo_megatron.rollout.sglang.weights import raise_on_failure

    raise_on_failure(result, what)


def fresh_write(part: list, classes: Any) -> None:
    """The bucket written into a new shared-memory file (what ``serialize`` did before ``SharedStaging``);
    not serialized, so the file goes with the tensor."""
    from grpo_megatron.rollout.sglang.ipc import cpu_tensors_shared_by_name, shared_memory_bucket

    with cpu_tensors_shared_by_name(torch.device("cpu")):
        shared_memory_bucket(part, classes[0])


def profile_weights(adapter: Any, parts: list, rows: Rows, version: int, idle_s: float, record: bool) -> None:
    """One round: the adapter's version, then the same calls on the engine directly."""
    from grpo_megatron.rollout.sglang.ipc import SharedStaging, rank_payload

    engine = adapter.servers[0]
    classes = adapter.transport.sglang_classes
    staging = adapter.transport.staging if hasattr(adapter.transport, "staging") else SharedStaging()
    sink = rows if record else Rows()
    # The adapter, call by call.
    start = time.perf_counter()
    for part in parts:
        sink.run("adapter call", partial(adapter.update_weights, part, version=version, last=False))
    sink.run("adapter last call", lambda: adapter.update_weights([], version=version, last=True))
    sink.add("adapter version", (time.perf_counter() - start) * 1e3)
    # The same on sglang.Engine, each piece timed.
    start = time.perf_counter()
    ok(sink.run("begin", engine.begin_weight_update), "begin_weight_update")
    aside = 0.0  # the "write, new file" rows, left out of "direct version"
    for part in parts:
        aside += sink.run_timed("write, new file", partial(fresh_write, part, classes))
        call = time.perf_counter()
        payload = sink.run("serialize", partial(rank_payload, part, classes, "cpu", staging))
        load = partial(
            engine.update_weights_from_tensor, [payload], load_format="flattened_bucket", flush_cache=False
        )
        result = sink.run("load rpc", load)
        ok(result, "update_weights_from_tensor")
        sink.add("direct call", (time.perf_counter() - call) * 1e3)
    empty = rank_payload([], classes, "cpu")
    ok(
        sink.run(
            "empty rpc",
            lambda: engine.update_weights_from_tensor(
                [empty], load_format="flattened_bucket", flush_cache=False
            ),
        ),
        "empty",
    )
    ok(sink.run("end", engine.end_weight_update), "end_weight_update")
    sink.run("flush", engine.flush_cache)
    sink.add("direct version", (time.perf_counter() - start) * 1e3 - aside)
    sink.run("checks", lambda: adapter.load.accept(parts[0], version))
    adapter.load.loading = None
    time.sleep(idle_s)
    ok(engine.begin_weight_update(), "begin")
    time.sleep(idle_s)
    empty = rank_payload([], classes, "cpu")  # a payload opens once (its shared-memory file goes then)
    ok(
        sink.run(
            "idle wake",
            lambda: engine.update_weights_from_tensor(
                [empty], load_format="flattened_bucket", flush_cache=False
            ),
        ),
        "idle",
    )
    ok(engine.end_weight_update(), "end")
    sink.run("release (adapter)", adapter.release_memory)
    sink.run("resume (adapter)", adapter.resume_memory)


def profile_generate(adapter: Any, prompts: list, params: Any, rows: Rows, record: bool) -> int:
    import random

    from grpo_megatron.rollout.sglang import protocol

    engine = adapter.servers[0]
    sink = rows if record else Rows()
    request = sink.run(
        "request", lambda: protocol.generate_request(prompts, params, random.Random(0), routes_enabled=False)
    )
    engine.flush_cache()  # no prefix cached by the other call (untimed)
    outputs = sink.run(
        "engine.generate",
        lambda: engine.generate(
            input_ids=request.input_ids, sampling_params=request.sampling_params, **request.options
        ),
    )
    engine.flush_cache()
    out = sink.run("adapter generate", lambda: adapter.generate(prompts, params))
    sink.run("decode", lambda: protocol.completions(outputs, request, params.n))
    return sum(len(c.token_ids) for g in out for c in g)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--buckets", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--idle-s", type=float, default=1.5, help="idle time before the 'idle wake' row")
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="an extra sglang.Engine argument (rollout.sglang.server_args), e.g. sleep_on_idle=false",
    )
    args = parser.parse_args()

    from grpo_megatron.rollout.config import RolloutConfig, SGLangConfig
    from grpo_megatron.rollout.engine import SamplingParams
    from grpo_megatron.rollout.sglang.engine import SGLangEngine
    from grpo_megatron.rollout.sglang.launch import EngineLaunch

    extra = {k: json.loads(v) for k, v in (a.split("=", 1) for a in args.server_arg)}
    work = Path(tempfile.mkdtemp(prefix="sglang_profile_"))
    size = {"num_hidden_layers": args.layers, "num_experts": args.experts, "max_position_embeddings": 256}
    weights = save_model(work / "model", args.hidden, getattr(torch, args.dtype), **size)
    parts = buckets(weights, args.buckets)
    rollout = RolloutConfig(engine="sglang", sglang=SGLangConfig(server_args=extra))
    adapter = SGLangEngine(rollout, str(work / "model"), EngineLaunch(args.dtype, device="cpu"))
    gen = torch.Generator().manual_seed(0)
    prompts = [[1, *torch.randint(4, 24, (8,), generator=gen).tolist()] for _ in range(args.prompts)]
    params = SamplingParams(n=args.samples, temperature=1.0, max_new_tokens=args.new_tokens, seed=1)
    load, gen_rows = Rows(), Rows()
    try:
        for repeat in range(args.repeats + 1):
            profile_weights(adapter, parts, load, repeat, args.idle_s, record=repeat > 0)
            profile_generate(adapter, prompts, params, gen_rows, record=repeat > 0)
    finally:
        adapter.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    load.print(
        f"weight load: {nbytes / 2**20:.1f} MiB in {len(parts)} buckets (server args {extra or 'default'})"
    )
    print(
        f"  adapter call / direct call = {load.median('adapter call') / load.median('direct call'):.2f}; "
        f"adapter version / direct version = {load.median('adapter version') / load.median('direct version'):.2f}"
    )
    gen_rows.print(f"generate: {args.prompts} prompts x {args.samples} samples, {args.new_tokens} new tokens")
    print(
        f"  engine.generate / adapter generate = "
        f"{gen_rows.median('engine.generate') / gen_rows.median('adapter generate'):.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
