"""Whole GRPO iterations (rollout + reward + train + sync) with long-tailed response lengths:
synchronous, one step off and continuous generation, in one run (issue 40's benchmark, item 5).

Every arm is the same training job (examples/demo.yaml's task and tokenizer, its model made larger
with ``--hidden``/``--layers`` so that training takes a real share of the iteration, random weights,
one trainer process with one thread, its engine in a process of its own with one thread:
rollout.embedded_process; with ``--engine sglang`` the real SGLang engine on CPU, colocated) and
differs only in its schedule:

- sync:        train.max_staleness=0: generate the batch, then train on it;
- one-off:     train.max_staleness=1: the engine generates iteration k+1's batch while the trainer
               trains iteration k (``GroupProducer``);
- continuous:  rollout.partial.enabled with rollout.partial.overlap: a pool of twice the batch's groups
               advanced in segments of ``--segment`` tokens, each iteration's first round submitted
               before it trains, so the engine generates while the trainer trains (training/partial.py).

Response lengths. A random model does not stop where a long-tailed distribution says, so each prompt
draws its responses' length from a lognormal (median ``--median`` tokens, sigma ``--sigma``, capped
at ``--max-new-tokens``; seeded by the prompt's text, the same in every arm) and this script, in the
trainer's process, gives every request that budget (what is left of it for a continued response) and
marks a response that reaches it finished by "stop": the engines' stop token stands in for it. The
engines, the trainer and the loop are the real ones; only the lengths are imposed.

Reported: each arm's mean seconds per phase and per iteration (the first ``--warmup`` iterations and
the last, with its evaluation, left out; evaluation time subtracted), and the ratios continuous /
sync, continuous / one-off and one-off / sync. Timings on a shared machine are distorted by whatever
else runs there: read the ratios of arms measured back to back.

Arms beyond the three: ``cont-1req`` (``rollout.partial.one_request``: a round as one request, the
embedded engine prefilling its ragged prompts apart and decoding them as one batch), and with
``--engine sglang`` ``cont-kv`` (``rollout.partial.keep_kv``: weight loads keep SGLang's prefix cache,
so continued requests read their prefix's KV) and ``cont-kv-1req`` (both). ``--keep DIR`` keeps each
run's metrics and a trace of its rounds (rows, continued rows, waits, SGLang's ``cached_tokens``).

Measured with segments of 24 (the default since; 2026-11-28, after the clean-clone test run, nothing
else running on the 2 cores; lengths p50 21, p99 192, p99/p50 9.1; train.max_staleness 8 as the
overlap's validation asks for K=24; seconds per iteration, ratio to sync of the arms run together):

| engine, run (repeats) | sync | one-off | continuous | cont-1req | cont-kv-1req | best/sync | best/one-off |
|---|---|---|---|---|---|---|---|
| engine process, C (1) | 1.706 | - | 0.813 (0.477) | 0.892 (0.523) | - | 0.477 | - |
| engine process, D (3) | 1.550 | 0.950 | 0.768 (0.496) | - | - | 0.496 | 0.809 |
| SGLang on CPU, E (1) | 2.404 | 1.673 | 1.327 (0.552) | 1.358 (0.565) | 1.202 (0.500) | 0.500 | 0.718 |
| SGLang on CPU, F (2) | 2.638 | 1.749 | - | - | 1.247 (0.473) | 0.473 | 0.713 |

With K=24 a round (one per iteration; measured staleness max 5 on the engine process) fits inside
the train phase, so the iteration is the trainer's: continuous / sync <= 0.5 on both engines (engine
process: plain continuous; SGLang: with rollout.partial.keep_kv and rollout.partial.one_request,
where kept KV now pays: 0.457 vs 0.604 s of rollout in E, twice the rounds per response re-reading
their prefixes). The earlier runs below, with segments of 48, were measured beside other work:

Measured (2026-11-28, 2 shared cores, segments of 48: lengths p50 21, p99 192, p99/p50 9.1), seconds per
iteration, ratios per repeat:

| engine, run (n) | sync | one-off | continuous | cont-1req | cont-kv | cont-kv-1req | best/sync | /one-off |
|---|---|---|---|---|---|---|---|---|
| engine process (2) | 1.179 | 0.734 | 0.669 (0.560, 0.575) | 0.626 (0.529, 0.531) | - | - | 0.530 | 0.853 |
| SGLang on CPU, A (1) | 1.919 | 1.277 | 1.237 (0.645) | - | 1.248 (0.651) | 0.945 (0.492) | 0.492 | 0.740 |
| SGLang on CPU, B (2) | 1.799 | 1.325 | - | 0.975 (0.517, 0.567) | - | 1.004 (0.530, 0.587) | 0.542 | 0.736 |

(A third SGLang run, ``sync one-off cont-1req cont-kv-1req`` x 2, measured while another helper's
processes ran outside the shared lock, is left out: its one-off / sync was 0.98 and the train phase of
every overlapped arm doubled.)

Where the time goes (``--keep`` traces; one thread, idle core, this model). Engine process: the
trainer's floor is train 0.49 + reward/advantages/sync 0.02 s (0.43 of sync); a round (64 new rows
of at most K=48 tokens and ~5 continued rows) costs the engine about 0.63 s, so the next ``take``
waits 0.12-0.18 s for it. Its parts, timed alone: the 64 new rows 0.55 s; the continued rows as a
second request, after them, 0.23 s (1 row) to 0.49 s (8 rows) of K decode steps at ~5 ms each; their
prefix recompute (prefill) only 0.01-0.08 s, so keeping KV across rounds would save little there.
One ragged batch (``cont-1req``) takes the continued rows' steps along with the new rows' (0.65 s
for 64 + 1, but 1.0 s for 64 + 8: the new rows' KV padded to the continued prefixes makes each step
copy more): 0.04 s per iteration. SGLang: its round runs 0.72 s per request, and the round submitted
ahead is drained before each sync (its weight load waits for the generation in flight: 0.14-0.15 s
there); with kept KV the continued requests read 2642 of 8487 prompt tokens from the cache (737 when
flushed; B: 2536 against 712) but that prefill was not the cost (A: 1.248 vs 1.237 s; B: 1.004 vs
0.975 s, within the noise); one request lets SGLang's continuous batching decode the continued rows
with the new ones (A 0.945 s, B 0.975 s). What is left on SGLang is the round itself: 0.94-1.0 s of
generation (48 steps over ~68 rows, ~19 ms a step on CPU) against a 0.48 s train phase, so the
trainer waits 0.42-0.49 s for it before the sync (drained: SGLang's weight load waits for it); an
in-place pause across the update would not shorten that, the next take needs the round anyway.
Why the engine process stays above 0.5: the iteration cannot drop below the trainer's 0.50 s and the
round is longer than that; ``--segment 32`` (``cont-1req``, two repeats, disturbed: the trainer
slowed to 0.69 s beside the engine) gave 0.625, no better. Before new and continued responses went as
two requests (training/partial.py), padding the new ones to the continued prefixes made a round cost
1.2 s and continuous / sync 0.79.

    python bench/partial_iterations.py                      # ~7 minutes on 2 cores
    python bench/partial_iterations.py --engine sglang      # the real SGLang engine on CPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path
from statistics import mean, median

REPO = Path(__file__).resolve().parent.parent
PHASES = ("rollout", "reward", "advantages", "train", "sync")
ENGINES = {
    "embedded": ["rollout.embedded_process=true", "rollout.embedded_process_threads=1"],
    "sglang": ["rollout.engine=sglang"],
}


def arms(args: argparse.Namespace) -> dict[str, list[str]]:
    staleness = max(1, -(-args.max_new_tokens // args.segment))  # the overlap's validation
    continuous = [
        "rollout.partial.enabled=true",
        "rollout.partial.overlap=true",
        f"train.max_staleness={staleness}",
        f"rollout.partial.segment_tokens={args.segment}",
        f"rollout.partial.groups_in_flight={args.pool}",
    ]
    one, kv = "rollout.partial.one_request=true", "rollout.partial.keep_kv=true"
    out = {
        "sync": ["train.max_staleness=0"],
        "one-off": ["train.max_staleness=1"],
        "continuous": continuous,
        "cont-1req": [*continuous, one],
    }
    if args.engine == "sglang":  # continued prefixes' KV kept across weight updates
        out |= {"cont-kv": [*continuous, kv], "cont-kv-1req": [*continuous, kv, one]}
    return out


def drawn_length(text: str, args: argparse.Namespace) -> int:
    rng = random.Random(zlib.crc32(text.encode()))
    return max(1, min(args.max_new_tokens, round(math.exp(rng.gauss(math.log(args.median), args.sigma)))))


def impose_lengths(args: argparse.Namespace) -> None:
    """Worker side: every rollout request of this process gets its prompts' drawn lengths (see the
    module docstring). A continued response's record is its prompt's with the tokens so far appended
    (training/partial.py), so the tokens so far are its ids beyond the shortest seen for that text."""
    import dataclasses

    from grpo_megatron.training.phases.rollout import Rollout

    prompt_len: dict[str, int] = {}
    targets_of: dict[int, list[tuple[int, int]]] = {}  # id(PendingRollout) -> (length, done) per prompt
    submit, collect = Rollout.submit, Rollout.collect

    def bench_submit(self, records, params):  # type: ignore[no-untyped-def]
        targets = []
        for r in records:
            prompt_len[r.prompt] = min(prompt_len.get(r.prompt, len(r.prompt_ids)), len(r.prompt_ids))
            targets.append((drawn_length(r.prompt, args), len(r.prompt_ids) - prompt_len[r.prompt]))
        limits = params.budgets(len(records))
        budgets = tuple(
            max(1, min(limit, want - done)) for limit, (want, done) in zip(limits, targets, strict=True)
        )
        params = dataclasses.replace(params, max_new_tokens=max(budgets), max_new_tokens_each=budgets)
        pending = submit(self, records, params)
        targets_of[id(pending)] = targets
        return pending

    def bench_collect(self, pending, *, payload="everywhere"):  # type: ignore[no-untyped-def]
        out = collect(self, pending, payload=payload)
        for group, (want, done) in zip(out, targets_of.pop(id(pending)), strict=True):
            for c in group:
                if c.finish_reason == "length" and done + c.num_tokens >= want:
                    c.finish_reason = "stop"
        return out

    Rollout.submit, Rollout.collect = bench_submit, bench_collect  # type: ignore[method-assign]


def trace_rounds(path: Path) -> None:
    """Worker side, ``--trace``: one JSON line per event of the continuous loop (a round submitted: its
    rows and prefix tokens; a round collected: the seconds waited, and where, ``take`` or
    ``before_sync``'s drain: the source's own trace, ``GRPO_ROUND_TRACE``; on SGLang each generate
    call's span in its thread and its prompts' ``cached_tokens``)."""
    import time

    os.environ["GRPO_ROUND_TRACE"] = str(path)  # training/sources.py: PartialRollouts(trace=...)

    def log(**fields: object) -> None:
        with open(path, "a") as out:
            out.write(json.dumps({"t": time.perf_counter(), **fields}) + "\n")

    try:
        from grpo_megatron.rollout.sglang import engine as sglang_engine
        from grpo_megatron.rollout.sglang import protocol
    except ImportError:
        return
    completions, generate = protocol.completions, sglang_engine.SGLangEngine._generate

    def traced_completions(  # type: ignore[no-untyped-def]
        outputs, request, n, layout=None, *, aborted_ok=False
    ):
        metas = [o["meta_info"] for o in outputs]
        log(
            event="sglang_outputs",
            rows=len(metas),
            prompt_tokens=sum(m.get("prompt_tokens", 0) for m in metas),
            cached_tokens=sum(m.get("cached_tokens", 0) for m in metas),
        )
        return completions(outputs, request, n, layout, aborted_ok=aborted_ok)

    def traced_generate(self, servers, prompts, params):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        out = generate(self, servers, prompts, params)
        log(event="sglang_generate", start=start, s=time.perf_counter() - start, rows=len(prompts))
        return out

    protocol.completions = traced_completions
    sglang_engine.SGLangEngine._generate = traced_generate  # type: ignore[method-assign]


def decode_step_cost(args: argparse.Namespace) -> dict[int, float]:
    """Seconds per decode step of the arms' model on this CPU's embedded engine (one thread), by
    active rows: whether waiting for a long-tailed batch's last rows costs little (cost ~ rows) or
    much of a full step (a fixed cost per step, where cutting the tail pays)."""
    import time

    import torch

    from grpo_megatron.rollout.embedded import EmbeddedEngine
    from grpo_megatron.rollout.engine import SamplingParams

    torch.set_num_threads(1)
    hf = json.loads((REPO / "examples" / "demo" / "config.json").read_text())
    hf |= {
        "hidden_size": args.hidden,
        "intermediate_size": 2 * args.hidden,
        "moe_intermediate_size": 2 * args.hidden,
        "num_hidden_layers": args.layers,
        "max_position_embeddings": 16 + args.max_new_tokens + 8,
    }
    torch.manual_seed(0)
    engine = EmbeddedEngine(hf, device="cpu", dtype=torch.float32)
    expected = sorted(engine.expected_tensors().items())
    weights = [(n, 0.05 * torch.randn(shape, dtype=dtype)) for n, (shape, dtype) in expected]
    engine.update_weights(weights, version=1, last=True)
    cost = {}
    for rows in (1, 8, args.prompts * args.samples):
        prompts = [[3 + (i % 20)] * 12 for i in range(rows)]
        times = []
        for steps in (2, 34):  # the difference: 32 decode steps, prefill cancelled out
            params = SamplingParams(n=1, max_new_tokens=steps, seed=0, stop_token_ids=())
            start = time.perf_counter()
            engine.generate(prompts, params)
            times.append(time.perf_counter() - start)
        cost[rows] = (times[1] - times[0]) / 32
    return cost


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_arm(run_dir: Path, name: str, args: argparse.Namespace) -> list[dict[str, float]]:
    """One training run; its metrics.jsonl records of the iterations after the run's first."""
    context = 16 + args.max_new_tokens + 8
    overrides = [
        "parallel.ep=1",
        "parallel.backend=gloo",
        "logging.wandb_mode=disabled",
        "logging.progress_bar=false",
        f"logging.run_dir={run_dir}",
        *ENGINES[args.engine],
        *arms(args)[name],
        f"train.iterations={args.iterations}",
        f"train.prompts_per_iteration={args.prompts}",
        f"rollout.n_samples_per_prompt={args.samples}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"train.micro_batch_size={args.prompts * args.samples}",
        "algorithm.off_policy.correction=icepop",
        f"model.hf_overrides.hidden_size={args.hidden}",
        f"model.hf_overrides.intermediate_size={2 * args.hidden}",
        f"model.hf_overrides.moe_intermediate_size={2 * args.hidden}",
        f"model.hf_overrides.num_hidden_layers={args.layers}",
        f"model.hf_overrides.max_position_embeddings={context}",
        "data.num_train_prompts=4096",
        "data.num_eval_prompts=4",
        "rollout.probe_interval=100000",
        "checkpoint.save_interval=0",
    ]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TORCH_COMPILE_DISABLE="1",
        WANDB_SILENT="true",
        PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    )
    lengths = [
        "--median",
        str(args.median),
        "--sigma",
        str(args.sigma),
        "--max-new-tokens",
        str(args.max_new_tokens),
    ]
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        lengths += ["--trace", str(args.keep / f"{run_dir.name}.trace.jsonl")]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(Path(__file__).resolve()),
        "--worker",
        *lengths,
        "--",
        "train",
        str(REPO / "examples" / "demo.yaml"),
        *overrides,
    ]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    if done.returncode != 0:
        raise SystemExit(f"the {name} run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    if args.keep is not None:  # every iteration's metrics, for a closer look
        args.keep.mkdir(parents=True, exist_ok=True)
        (args.keep / f"{run_dir.name}.jsonl").write_text("\n".join(lines) + "\n")
    records = [json.loads(line) for line in lines if line.strip()]
    return [r for r in records if r["iteration"] >= 1]


def summarize(records: list[dict[str, float]], warmup: int) -> dict[str, float]:
    """Mean seconds per phase and per iteration (without its evaluation) over the steady iterations."""
    steady = records[warmup:-1]
    if not steady:
        raise SystemExit(f"no steady iterations: raise --iterations above --warmup + 1 ({warmup + 1})")
    out = {p: mean(r.get(f"time/{p}") or 0.0 for r in steady) for p in PHASES}
    out["iteration"] = mean(r["time/iteration"] - (r.get("time/eval") or 0.0) for r in steady)
    out["response_len"] = mean(r["response_len/mean"] for r in steady)
    out["staleness_max"] = max(
        r.get("partial/staleness/max", r.get("async/staleness/max", 0.0)) for r in steady
    )
    out["segments"] = mean(r.get("partial/segments", 0.0) for r in steady)
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=sorted(ENGINES), default="embedded")
    parser.add_argument("--iterations", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--median", type=float, default=20.0, help="median response length (tokens)")
    parser.add_argument("--sigma", type=float, default=1.1, help="lognormal sigma")
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--segment", type=int, default=24, help="rollout.partial.segment_tokens")
    parser.add_argument(
        "--pool", type=int, default=0, help="rollout.partial.groups_in_flight (0: 2 x --prompts)"
    )
    parser.add_argument("--hidden", type=int, default=256, help="the model's hidden size (training's share)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each arm, interleaved (default 1)")
    parser.add_argument("--only", nargs="*", default=None, help="arms to run (default all)")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="a folder for each run's metrics.jsonl and trace of its rounds",
    )
    parser.add_argument("--trace", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> int:
    if "--worker" in sys.argv:  # one arm's training process, under torchrun
        split = sys.argv.index("--")
        worker = parse(sys.argv[1:split])
        impose_lengths(worker)
        if worker.trace is not None:
            trace_rounds(worker.trace)
        from grpo_megatron.cli import main as cli

        return cli(sys.argv[split + 1 :])
    args = parse()
    texts = [f"{a}+{b}=" for a in range(100, 400) for b in range(100, 110)]
    drawn = sorted(drawn_length(t, args) for t in texts)
    p50, p99 = median(drawn), drawn[int(0.99 * len(drawn))]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in args.only or arms(args)}
    with tempfile.TemporaryDirectory(prefix="bench-partial-") as tmp:
        for repeat in range(args.repeats):  # arms interleaved: a shared machine's load hits each alike
            for name in runs:
                runs[name].append(summarize(run_arm(Path(tmp) / f"{name}-{repeat}", name, args), args.warmup))
    result = {name: {k: mean(s[k] for s in rs) for k in rs[0]} for name, rs in runs.items()}
    columns = (*PHASES, "iteration", "response_len", "segments")
    print(
        f"lengths per prompt: lognormal median {args.median:g} sigma {args.sigma:g} cap "
        f"{args.max_new_tokens}: p50 {p50:g}, p99 {p99:g} (p99/p50 {p99 / p50:.1f}); engine "
        f"{args.engine}; {args.prompts} prompts x {args.samples}; segments of {args.segment}; "
        f"hidden {args.hidden}, {args.layers} layers"
    )
    print(f"{'seconds':<14}" + "".join(f"{c:>13}" for c in columns))
    for name, row in result.items():
        print(f"{name:<14}" + "".join(f"{row[c]:>13.3f}" for c in columns))
    pairs = [
        ("one-off", "sync"),
        *((a, b) for a in result if a.startswith("cont") for b in ("sync", "one-off")),
    ]
    ratios = {
        f"{a} / {b}": result[a]["iteration"] / result[b]["iteration"]
        for a, b in pairs
        if a in result and b in result
    }
    print("iteration time " + "; ".join(f"{k} = {v:.3f}" for k, v in ratios.items()))
    if args.engine == "embedded":
        cost = decode_step_cost(args)
        print(
            "embedded engine decode step, ms by active rows: "
            + ", ".join(f"{r}: {1e3 * s:.2f}" for r, s in cost.items())
        )
        steps = {str(r): 1e3 * s for r, s in cost.items()}
    else:
        steps = {}
    if args.out is not None:
        saved = {
            "ratios": ratios,
            **result,
            "decode_step_ms": steps,
            "lengths": {"p50": p50, "p99": p99},
            "args": {k: str(v) for k, v in vars(args).items()},
        }
        args.out.write_text(json.dumps(saved, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
