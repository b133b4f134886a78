"""Rollout dump and train-only replay (``rollout.dump_dir``, ``rollout.replay_dir``): what slime offers
as ``--save-debug-rollout-data`` and ``--load-debug-rollout-data`` / ``--debug-train-only``, for
debugging a loss spike without the engines.

The cut is the rollout phase's output: each iteration's scored groups as the loop takes them from its
``GroupSource`` (training/groups.py), after the reward phase (and DAPO's rounds) and before the
advantages phase. A dump holds exactly what the trainer consumes from there: the prompts' token ids,
each response's token ids, behaviour logprobs, loss mask, weight version (and, for partial rollouts,
each token's version: ``token_versions``) and, under
``algorithm.routing_replay=r3``, its engine routes; each response's reward; the rollout phase's
metrics (``reward/*``, ``dynamic_sampling/*``, ``async/staleness/*``). Advantages are not stored: the
advantages phase computes them from the rewards (a pure function of the rewards, the lengths and
``algorithm.*``), so a replay with the same ``algorithm.*`` trains on the same advantages bit for bit,
and a replay may also try another advantage estimator on the same responses.

On disk, under the dump directory (rank 0 writes, every file atomically, nothing pickled)::

    dump.json                     the run's identity: model config, tokenizer vocabulary, layout
    iteration-000001.safetensors  the tensors (flat token ids, logprobs, rewards, routes)
    iteration-000001.json         the metadata (groups, finish reasons, texts, metrics) and the
                                  safetensors file's sha256; written last: an iteration is whole
                                  when its JSON is there

Replay (``ReplaySource``) is the loop's other group source: ``take`` reads the iteration's files on
every rank instead of generating and scoring; no engine starts (training/job.py), no weight sync,
no held-out evaluation. On the same layout (parallel sizes) and config the replay's losses and
gradient norms equal the dumped run's bit for bit (tests/test_train.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from grpo_megatron.data import PromptRecord
from grpo_megatron.fileio import write_bytes_atomic, write_text_atomic
from grpo_megatron.rollout.engine import Completion
from grpo_megatron.training.phases.reward import Group

if TYPE_CHECKING:
    from grpo_megatron.distributed.bootstrap import ParallelState
    from grpo_megatron.rollout.fleet import RolloutFleet
    from grpo_megatron.training.groups import GroupSource, Produced
    from grpo_megatron.training.timing import Timer

FORMAT = 1
"""The dump format's version (``dump.json``'s ``format``)."""
IDENTITY = "dump.json"


def iteration_stem(iteration: int) -> str:
    return f"iteration-{iteration:06d}"


def run_identity(hf: Mapping[str, Any], vocab: Mapping[str, int], ps: ParallelState) -> dict[str, Any]:
    """What a replay must share with the dumped run: the model (a digest of its config.json), the
    tokenizer (a digest of its vocabulary) and the layout (parallel sizes)."""
    model = hashlib.sha256(json.dumps(dict(hf), sort_keys=True, default=str).encode()).hexdigest()
    tokens = hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()
    layout = {"world_size": ps.world_size, "tp": ps.tp, "pp": ps.pp, "cp": ps.cp, "ep": ps.ep, "dp": ps.dp}
    return {
        "format": FORMAT,
        "model_type": hf.get("model_type"),
        "model_config_sha256": model,
        "tokenizer_vocab_sha256": tokens,
        "vocab_size": len(vocab),
        "layout": layout,
    }


def _flat(rows: Sequence[Sequence[float]] | Sequence[Sequence[int]], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([x for row in rows for x in row], dtype=dtype)


def encode_groups(
    groups: Sequence[Group],
    metrics: Mapping[str, float],
    iteration: int,
    routes: Mapping[int, torch.Tensor] | None = None,
) -> tuple[dict, dict]:
    """One iteration's scored groups as (tensors, metadata): what ``decode_groups`` reads back. Every
    completion's tokens and logprobs must be here (rank 0's, after the rollout phase); ``routes``: the
    engine routes of completions (by index in group order) that hold theirs elsewhere."""
    completions = [c for g in groups for c in g.completions]
    for c in completions:
        if c.sizes is not None and len(c.token_ids) != c.sizes[0]:
            raise RuntimeError("rollout dump: a completion's tokens are not on rank 0")
    masked = [c.loss_mask for c in completions if c.loss_mask is not None]
    tensors = {
        "prompt_ids": _flat([g.record.prompt_ids for g in groups], torch.int64),
        "prompt_lengths": torch.tensor([len(g.record.prompt_ids) for g in groups], dtype=torch.int64),
        "group_sizes": torch.tensor([len(g.completions) for g in groups], dtype=torch.int64),
        "response_ids": _flat([c.token_ids for c in completions], torch.int64),
        "response_lengths": torch.tensor([len(c.token_ids) for c in completions], dtype=torch.int64),
        # float64: the engines' logprobs are Python floats; float64 gives them back exactly
        "logprobs": _flat([c.logprobs for c in completions], torch.float64),
        "rewards": torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float64),
        "weight_versions": torch.tensor([c.weight_version for c in completions], dtype=torch.int64),
        "has_loss_mask": torch.tensor([c.loss_mask is not None for c in completions], dtype=torch.int64),
        "loss_masks": _flat(masked, torch.int64),
    }
    if any(c.token_versions is not None for c in completions):  # partial rollouts: versions per token
        tensors["token_versions"] = _flat([c.versions for c in completions], torch.int64)
    for k, c in enumerate(completions):
        routed = (routes or {}).get(k, c.routed_experts)
        if routed is not None:
            tensors[f"routes.{k}"] = routed.contiguous()
    meta = {
        "format": FORMAT,
        "iteration": iteration,
        "records": [
            {"prompt": g.record.prompt, "answer": g.record.answer, "metadata": g.record.metadata}
            for g in groups
        ],
        "finish_reasons": [c.finish_reason for c in completions],
        "texts": [t for g in groups for t in g.texts],
        "metrics": dict(metrics),
    }
    return tensors, meta


def _split(flat: torch.Tensor, lengths: Sequence[int]) -> list[list]:
    return [t.tolist() for t in flat.split(list(lengths))]


def decode_groups(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], where: Path) -> list[Group]:
    """``encode_groups``'s output back as scored groups (every completion whole, on every rank);
    ValueError naming ``where`` when the tensors disagree with each other or with the metadata."""
    try:
        group_sizes = tensors["group_sizes"].tolist()
        n = sum(group_sizes)
        lengths = tensors["response_lengths"].tolist()
        checks = {
            "prompt_lengths": (len(tensors["prompt_lengths"]), len(group_sizes)),
            "prompt_ids": (len(tensors["prompt_ids"]), sum(tensors["prompt_lengths"].tolist())),
            "response_lengths": (len(lengths), n),
            "response_ids": (len(tensors["response_ids"]), sum(lengths)),
            "logprobs": (len(tensors["logprobs"]), sum(lengths)),
            "rewards": (len(tensors["rewards"]), n),
            "weight_versions": (len(tensors["weight_versions"]), n),
            "has_loss_mask": (len(tensors["has_loss_mask"]), n),
            "records": (len(meta["records"]), len(group_sizes)),
            "finish_reasons": (len(meta["finish_reasons"]), n),
            "texts": (len(meta["texts"]), n),
        }
        if "token_versions" in tensors:
            checks["token_versions"] = (len(tensors["token_versions"]), sum(lengths))
    except KeyError as exc:
        raise ValueError(
            f"{where}: no {exc} in the dump; it is damaged or not a rollout dump: dump that "
            "iteration again (rollout.dump_dir)"
        ) from None
    for name, (got, want) in checks.items():
        if got != want:
            raise ValueError(
                f"{where}: {name} has {got} entries where the dump's sizes say {want}; the file is "
                "damaged or was edited: dump that iteration again (rollout.dump_dir)"
            )
    masked = [k for k, m in enumerate(tensors["has_loss_mask"].tolist()) if m]
    masks = dict(zip(masked, _split(tensors["loss_masks"], [lengths[k] for k in masked]), strict=True))
    completions = [
        Completion(
            ids,
            lps,
            reason,
            routed_experts=tensors.get(f"routes.{k}"),
            loss_mask=masks.get(k),
            weight_version=int(version),
        )
        for k, (ids, lps, reason, version) in enumerate(
            zip(
                _split(tensors["response_ids"], lengths),
                _split(tensors["logprobs"], lengths),
                meta["finish_reasons"],
                tensors["weight_versions"].tolist(),
                strict=True,
            )
        )
    ]
    if "token_versions" in tensors:
        for c, versions in zip(completions, _split(tensors["token_versions"], lengths), strict=True):
            c.token_versions = versions
    rewards, texts = tensors["rewards"].tolist(), list(meta["texts"])
    prompts = _split(tensors["prompt_ids"], tensors["prompt_lengths"].tolist())
    groups, k = [], 0
    for r, prompt_ids, size in zip(meta["records"], prompts, group_sizes, strict=True):
        record = PromptRecord(r["prompt"], r["answer"], dict(r["metadata"]), tuple(prompt_ids))
        groups.append(Group(record, completions[k : k + size], rewards[k : k + size], texts[k : k + size]))
        k += size
    return groups


@dataclass
class RolloutDump:
    """Writes each iteration's scored groups under ``directory`` (rank 0; every rank calls ``write``:
    under r3 the engines' routes travel to rank 0 for it)."""

    directory: Path
    identity: dict[str, Any]
    ps: ParallelState

    def start(self) -> None:
        """Rank 0: the directory and its ``dump.json`` (a resumed run writes into its own dump again;
        a dump of another run is refused, naming both)."""
        if self.ps.rank != 0:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / IDENTITY
        if path.is_file():
            check_identity(read_json(path), self.identity, path, fix="choose a new rollout.dump_dir")
        else:
            write_text_atomic(path, json.dumps(self.identity, indent=1) + "\n")

    def write(self, iteration: int, produced: Produced, fleet: RolloutFleet) -> None:
        """Collective: iteration ``iteration``'s groups and rollout metrics into the dump."""
        completions = [c for g in produced.groups for c in g.completions]
        held = [c.route_id for c in completions if c.route_id is not None]
        # the routes stay held for the advantages phase (release=()); rank 0 gets a copy
        routes = fleet.deliver_routes({rid: [0] for rid in held}, release=()) if held else {}
        if self.ps.rank != 0:
            return
        by_index = {k: routes[c.route_id] for k, c in enumerate(completions) if c.route_id in routes}
        write_iteration(self.directory, iteration, produced.groups, produced.metrics, by_index)


def write_iteration(
    directory: Path,
    iteration: int,
    groups: Sequence[Group],
    metrics: Mapping[str, float],
    routes: Mapping[int, torch.Tensor] | None = None,
) -> None:
    """One iteration's files (``encode_groups``), each atomically: the safetensors first, then the JSON
    that records its sha256 (an iteration is whole once its JSON is there)."""
    from safetensors.torch import save

    tensors, meta = encode_groups(groups, metrics, iteration, routes)
    data = save(tensors)
    stem = directory / iteration_stem(iteration)
    write_bytes_atomic(stem.with_suffix(".safetensors"), data)
    meta["safetensors_sha256"] = hashlib.sha256(data).hexdigest()
    write_text_atomic(stem.with_suffix(".json"), json.dumps(meta) + "\n")


def read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"{path} is not readable JSON ({exc}); dump that run again (rollout.dump_dir)"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} is not a JSON object; dump that run again (rollout.dump_dir)")
    return value


def check_identity(dumped: Mapping[str, Any], here: Mapping[str, Any], path: Path, *, fix: str) -> None:
    """ValueError naming ``path``, each field that differs and ``fix`` when the dump was made by
    another model, tokenizer, layout or format."""
    names = {
        "format": "dump format",
        "model_config_sha256": "model (config.json)",
        "tokenizer_vocab_sha256": "tokenizer (vocabulary)",
        "layout": "layout (parallel sizes)",
    }
    differ = [
        f"{what}: dump {dumped.get(key)!r}, this run {here[key]!r}"
        for key, what in names.items()
        if dumped.get(key) != here[key]
    ]
    if differ:
        raise ValueError(
            f"{path}: the rollout dump was made by another run: " + "; ".join(differ) + f". {fix}"
        )


class ReplaySource:
    """The replay ``GroupSource`` (rollout.replay_dir): each iteration's scored groups read from a
    dump on every rank; the engines are never asked (there are none)."""

    drops_batches = True
    """A batch read again on resume is the same: a signal before the update may drop it."""

    def __init__(self, directory: Path, identity: dict[str, Any], last_iteration: int) -> None:
        self.directory = directory
        self.identity = identity
        self.last_iteration = last_iteration

    def start(self, version: int) -> None:
        """Checks the dump before the first iteration: its identity, and every iteration file this run
        will read (``version`` + 1 .. train.iterations)."""
        path = self.directory / IDENTITY
        if not path.is_file():
            raise ValueError(
                f"rollout.replay_dir={self.directory}: no {IDENTITY}; point it at a directory a run "
                "with rollout.dump_dir wrote"
            )
        fix = "replay with the dumped run's model.hf_path, tokenizer and parallel.* sizes (same world size)"
        check_identity(read_json(path), self.identity, path, fix=fix)
        for it in range(version + 1, self.last_iteration + 1):
            stem = self.directory / iteration_stem(it)
            for suffix in (".json", ".safetensors"):
                if not stem.with_suffix(suffix).is_file():
                    raise ValueError(
                        f"rollout.replay_dir: {stem.with_suffix(suffix)} is missing: the dump holds no iteration "
                        f"{it}; set train.iterations={it - 1} (the last iteration dumped whole), or dump a run "
                        "that reaches it"
                    )

    def take(self, iteration: int, timer: Timer) -> Produced:
        from grpo_megatron.training.groups import Produced

        with timer("rollout"):  # the read stands in for the rollout and reward phases
            groups, metrics = read_iteration(self.directory, iteration)
        return Produced(groups, metrics)

    def before_sync(self) -> dict[str, float]:
        return {}  # no engine generates

    def after_sync(self, version: int) -> None:
        return None

    def state_dict(self) -> dict[str, Any] | None:
        return None


def read_iteration(directory: Path, iteration: int) -> tuple[list[Group], dict[str, float]]:
    """Iteration ``iteration``'s scored groups and rollout metrics from a dump; ValueError naming the
    file and the fix when it is missing, damaged or inconsistent."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    stem = directory / iteration_stem(iteration)
    meta_path, tensor_path = stem.with_suffix(".json"), stem.with_suffix(".safetensors")
    for path in (meta_path, tensor_path):
        if not path.is_file():
            raise ValueError(
                f"rollout.replay_dir: {path} is missing: the dump holds no iteration {iteration}; "
                f"set train.iterations={iteration - 1}, or dump a run that reaches it"
            )
    meta = read_json(meta_path)
    data = tensor_path.read_bytes()
    if hashlib.sha256(data).hexdigest() != meta.get("safetensors_sha256"):
        raise ValueError(
            f"{tensor_path} does not match the sha256 that {meta_path.name} records: it is damaged "
            "or from another dump; dump that iteration again (rollout.dump_dir)"
        )
    if meta.get("iteration") != iteration:
        raise ValueError(
            f"{meta_path} holds iteration {meta.get('iteration')}, not {iteration}: the dump's files "
            "were renamed; dump that run again (rollout.dump_dir)"
        )
    try:
        tensors = load(data)
    except SafetensorError as exc:
        raise ValueError(f"{tensor_path} is not a readable safetensors file ({exc}); dump it again") from None
    return decode_groups(tensors, meta, tensor_path), {
        k: float(v) for k, v in meta.get("metrics", {}).items()
    }


class DumpingSource:
    """A ``GroupSource`` whose every batch is also written to a ``RolloutDump`` as the loop takes it
    (rollout.dump_dir): the synchronous or asynchronous source inside, unchanged."""

    @property
    def drops_batches(self) -> bool:
        """As the source inside (a dropped batch's dump is written again when it is redone)."""
        return bool(getattr(self.inner, "drops_batches", False))

    def __init__(self, inner: GroupSource, dump: RolloutDump, fleet: RolloutFleet) -> None:
        self.inner = inner
        self.dump = dump
        self.fleet = fleet

    def start(self, version: int) -> None:
        self.dump.start()
        self.inner.start(version)

    def take(self, iteration: int, timer: Timer) -> Produced:
        produced = self.inner.take(iteration, timer)
        with timer("dump"):
            self.dump.write(iteration, produced, self.fleet)
        return produced

    def before_sync(self) -> dict[str, float]:
        return self.inner.before_sync()

    def after_sync(self, version: int) -> None:
        self.inner.after_sync(version)

    def state_dict(self) -> dict[str, Any] | None:
        return self.inner.state_dict()
