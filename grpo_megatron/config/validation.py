"""Validating a job config: every section's own rules, then the rules that span sections or need
the model's config.json, and the start-up checks of the files a job reads and writes.

All of it runs before any process group exists, so a bad config fails in a second.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from grpo_megatron.config.job import ConfigError, JobConfig
from grpo_megatron.config.loop_rules import async_errors, off_policy_errors
from grpo_megatron.distributed.bootstrap import job_backend
from grpo_megatron.distributed.config import ParallelConfig
from grpo_megatron.models.config import (
    EXPERT_COUNT_KEYS,
    SUPPORTED_MODEL_TYPES,
    ModelConfig,
    display_path,
    num_routed_experts,
)

# ----------------------------------------------------------------------------------------------------
# Validation: every section's own rules, then the rules that span sections or need config.json.


def validate(cfg: JobConfig, world_size: int) -> None:
    """Check `cfg` for a job of `world_size` ranks; raise one ConfigError listing every problem.

    Runs before any process group exists, so a bad layout fails in a second, not after a cluster
    allocation and a model load.
    """
    errors: list[str] = []
    # Later rules assume each section's own values are sane: they skip sections that failed.
    failed: set[str] = set()
    for f in dataclasses.fields(cfg):
        try:
            getattr(cfg, f.name).validate()
        except ValueError as e:
            errors.extend(e.errors if isinstance(e, ConfigError) else str(e).splitlines())
            failed.add(f.name)

    parallel = cfg.parallel
    layout_errors = [] if "parallel" in failed else parallel.layout_errors(world_size)
    errors.extend(layout_errors)

    hf_config = None
    if cfg.model.hf_path:  # an empty one was reported by ModelConfig.validate()
        try:
            hf_config = cfg.model.load_hf_config()
        except ValueError as e:
            errors.append(str(e))
    if hf_config is not None and "parallel" not in failed:
        errors.extend(model_layout_errors(cfg.model, hf_config, parallel))

    if not layout_errors and not failed & {"parallel", "train", "rollout"}:
        errors.extend(batch_layout_errors(cfg, parallel.resolve(world_size)))
    if not failed & {"algorithm", "rollout"}:
        errors.extend(overlong_errors(cfg))
    if not failed & {"algorithm", "rollout", "train"}:
        errors.extend(async_errors(cfg))
    if not failed & {"algorithm", "train"}:
        errors.extend(off_policy_errors(cfg))
    if hf_config is not None and not failed & {"algorithm", "rollout", "model", "parallel", "train"}:
        errors.extend(routing_replay_errors(cfg, hf_config))
    if hf_config is not None and not failed & {"rollout", "data"}:
        errors.extend(context_length_errors(cfg, hf_config))
    if hf_config is not None and not failed & {"rollout", "model", "parallel"}:
        errors.extend(sglang_rotary_errors(cfg, hf_config))
    if not failed & {"rollout", "model", "parallel"}:
        errors.extend(sglang_cpu_errors(cfg))
    if not failed & {"rollout", "model", "parallel", "train"}:
        errors.extend(true_on_policy_errors(cfg))

    if errors:
        raise ConfigError(errors)


def model_layout_errors(model: ModelConfig, hf_config: dict[str, Any], parallel: ParallelConfig) -> list[str]:
    """Rules between the parallel layout and the model architecture in `hf_config`."""
    errors: list[str] = []

    def source(key: str) -> str:
        return "model.hf_overrides" if key in model.hf_overrides else display_path(model.config_json_path())

    model_type = hf_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        errors.append(
            f"model_type={model_type!r} (from {source('model_type')}) is not supported: the supported "
            f"model types are {', '.join(SUPPORTED_MODEL_TYPES)}; point model.hf_path at one of those"
        )

    def int_key(key: str, default: int | None = None) -> int | None:
        value = hf_config.get(key)
        if value is None:
            value = default
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        errors.append(
            f"model {key}={value!r} (from {source(key)}) must be a positive integer; "
            f"fix config.json or set model.hf_overrides.{key}"
        )
        return None

    tp, pp, ep = parallel.tp, parallel.pp, parallel.ep
    heads = int_key("num_attention_heads")
    kv_heads = int_key("num_key_value_heads", heads) if heads else None
    if heads and kv_heads:
        good_tp = sorted(t for t in _divisors(heads) if t % kv_heads == 0 or kv_heads % t == 0)
        choose = f"choose parallel.tp in {{{', '.join(map(str, good_tp))}}}"
        if heads % tp:
            errors.append(
                f"parallel.tp={tp} does not divide model num_attention_heads={heads} "
                f"(from {source('num_attention_heads')}): {choose}"
            )
        elif tp % kv_heads and kv_heads % tp:
            errors.append(
                f"parallel.tp={tp} neither divides model num_key_value_heads={kv_heads} (from "
                f"{source('num_key_value_heads')}) nor is a multiple of it (KV heads replicated): {choose}"
            )

    layers = int_key("num_hidden_layers")
    if layers and layers % pp:
        errors.append(
            f"parallel.pp={pp} does not divide model num_hidden_layers={layers} "
            f"(from {source('num_hidden_layers')}): choose parallel.pp in {{{', '.join(map(str, _divisors(layers)))}}}"
        )

    if parallel.cp > 1 and model_type == "deepseek_v3" and model.transformer_impl != "transformer_engine":
        errors.append(
            f"parallel.cp={parallel.cp} with multi-latent attention (model_type deepseek_v3) needs "
            "TransformerEngine: the local attention's context parallelism is checked for standard "
            "attention only; set parallel.cp=1 or model.transformer_impl=transformer_engine"
        )

    experts = num_routed_experts(hf_config)
    if experts == 0:
        if ep > 1:
            errors.append(
                f"parallel.ep={ep} but the model is dense (none of {', '.join(EXPERT_COUNT_KEYS)} is set "
                f"in {display_path(model.config_json_path())} or model.hf_overrides): set parallel.ep=1"
            )
        if parallel.etp not in (None, tp):
            errors.append(f"parallel.etp={parallel.etp} but the model is dense: remove parallel.etp")
    else:
        key = next(k for k in EXPERT_COUNT_KEYS if hf_config.get(k))
        if experts % ep:
            errors.append(
                f"parallel.ep={ep} does not divide the model's {key}={experts} (from {source(key)}): "
                f"choose parallel.ep in {{{', '.join(map(str, _divisors(experts)))}}}"
            )
        if tp > 1 and parallel.sequence_parallel is False:
            errors.append(
                f"parallel.sequence_parallel=false with parallel.tp={tp} on an MoE model: megatron-core "
                "needs sequence parallelism for MoE with TP > 1; set parallel.sequence_parallel=true or null"
            )
        if pp > 1 and model.moe_token_dispatcher == "allgather":
            errors.append(
                f"model.moe_token_dispatcher=allgather with parallel.pp={pp}: megatron-core's allgather "
                "dispatcher needs fixed sequence lengths, but pipelined micro-batches vary in length; "
                "set model.moe_token_dispatcher=alltoall"
            )
    return errors


def batch_layout_errors(cfg: JobConfig, parallel: ParallelConfig) -> list[str]:
    """Rules between batch sizes and a resolved parallel layout."""
    assert parallel.dp is not None, "batch_layout_errors takes a resolved layout (ParallelConfig.resolve)"
    if parallel.cp > 1 and not cfg.train.packing:
        return [
            f"parallel.cp={parallel.cp} needs train.packing=true: context parallelism splits packed "
            "sequences over the CP ranks (training/forward_backward.py); set train.packing=true or parallel.cp=1"
        ]
    samples = cfg.train.prompts_per_iteration * cfg.rollout.n_samples_per_prompt
    per_update = cfg.train.updates_per_iteration * parallel.dp
    if samples % per_update:
        return [
            f"train.prompts_per_iteration*rollout.n_samples_per_prompt={cfg.train.prompts_per_iteration}*"
            f"{cfg.rollout.n_samples_per_prompt}={samples} samples per iteration cannot be split into "
            f"train.updates_per_iteration={cfg.train.updates_per_iteration} mini-batches over "
            f"dp={parallel.dp} data-parallel ranks: make it a multiple of {per_update}"
        ]
    return []


def routing_replay_errors(cfg: JobConfig, hf_config: dict[str, Any]) -> list[str]:
    """Combinations algorithm.routing_replay cannot serve (see its docstring)."""
    mode = cfg.algorithm.routing_replay
    if mode == "off":
        return []
    where = f"algorithm.routing_replay={mode}"
    errors = []
    if num_routed_experts(hf_config) == 0:
        errors.append(
            f"{where} but the model is dense (no experts to route): set algorithm.routing_replay=off"
        )
    if cfg.parallel.cp > 1:
        errors.append(
            f"{where} with parallel.cp={cfg.parallel.cp}: routes are not split over context-parallel ranks "
            "yet; set parallel.cp=1"
        )
    if mode == "r3" and cfg.rollout.engine == "sglang" and not cfg.rollout.sglang.routed_experts:
        errors.append(
            f"{where} replays the engine's experts, but rollout.sglang.routed_experts=false asks SGLang not "
            "to report them: set rollout.sglang.routed_experts=true"
        )
    if mode == "r3" and cfg.rollout.engine == "sglang" and job_backend(cfg.parallel.backend) != "nccl":
        errors.append(
            f"{where} replays the engine's experts, but SGLang's CPU engine cannot report them (its route "
            "buffer is pinned memory, which needs CUDA): on CPU use rollout.engine=embedded, or "
            "algorithm.routing_replay=r2 or off"
        )
    if mode == "r2" and (cfg.train.updates_per_iteration < 2 or cfg.train.old_logprobs != "trainer"):
        errors.append(
            f"{where} replays the old-policy pass's experts in the training passes, which needs "
            f"train.updates_per_iteration > 1 (is {cfg.train.updates_per_iteration}) and "
            f"train.old_logprobs=trainer (is {cfg.train.old_logprobs}): with one update the training pass "
            "is the old-policy pass; use r3 or off"
        )
    if mode == "r2" and cfg.train.packing:
        errors.append(
            f"{where} with train.packing=true: the old-policy pass records its routes per padded row, and "
            "packed micro-batches are not unpacked for that yet; set train.packing=false, or use r3"
        )
    return errors


def context_length_errors(cfg: JobConfig, hf_config: dict[str, Any]) -> list[str]:
    """SGLang refuses a request whose prompt and ``max_new_tokens`` together exceed its context
    length (``context_length`` in rollout.sglang.server_args, else the model's
    ``max_position_embeddings``; SGLang's tokenizer manager, ``_validate_one_request``): the longest
    prompt and the longest response must fit, or the first rollout fails. The embedded engine and the
    trainer take any length (rotary positions)."""
    rollout = cfg.rollout
    given = rollout.sglang.server_args.get("context_length")
    context = given or hf_config.get("max_position_embeddings")
    if rollout.engine != "sglang" or context is None:
        return []
    response = rollout.response_budget
    total = cfg.data.max_prompt_tokens + response.tokens
    if total <= int(context):
        return []
    source = (
        "rollout.sglang.server_args.context_length"
        if given
        else f"max_position_embeddings in {cfg.model.hf_path}/config.json"
    )
    return [
        f"data.max_prompt_tokens={cfg.data.max_prompt_tokens} + {response.field}={response.tokens} = {total} tokens "
        f"exceeds the model's context of {int(context)} ({source}): SGLang refuses such a request; lower "
        f"{response.field} or data.max_prompt_tokens"
    ]


SGLANG_CUDA_ROTARY_HEAD_SIZES = (64, 128, 256, 512)
"""Head sizes SGLang's CUDA rotary embedding has a kernel for (``layers/rotary_embedding/base.py``,
0.5.17 and 0.5.23). Others take a fallback that cannot write the KV cache in the same pass, yet a
bf16 KV cache on CUDA always asks it to (``models/utils.py`` ``enable_fused_set_kv_buffer``): the
scheduler fails its first forward (``AssertionError: save kv cache is not supported for
fallback_rotary_embedding``; seen on an H200 with SGLang 0.5.17) and SGLang kills the rank."""


def sglang_rotary_errors(cfg: JobConfig, hf_config: dict[str, Any]) -> list[str]:
    """SGLang engines on CUDA with a bf16 KV cache need a head size SGLang's rotary kernel has
    (``SGLANG_CUDA_ROTARY_HEAD_SIZES``). MLA models (DeepSeek-V3) rotate ``qk_rope_head_dim`` with
    their own embedding and are not concerned; neither are CPU engines."""
    if (
        cfg.rollout.engine != "sglang"
        or job_backend(cfg.parallel.backend) != "nccl"
        or "kv_lora_rank" in hf_config
    ):
        return []
    kv_dtype = cfg.rollout.sglang.server_args.get("kv_cache_dtype", "auto")
    if cfg.model.dtype != "bfloat16" or kv_dtype not in ("auto", "bfloat16", "bf16"):
        return []
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]
    if head_dim in SGLANG_CUDA_ROTARY_HEAD_SIZES:
        return []
    source = (
        "model.hf_overrides.head_dim"
        if "head_dim" in cfg.model.hf_overrides
        else display_path(cfg.model.config_json_path())
    )
    return [
        f"head_dim={head_dim} ({source}) with rollout.engine=sglang on CUDA and a bfloat16 KV cache: SGLang's "
        f"CUDA rotary embedding writes the KV cache only for head sizes {', '.join(map(str, SGLANG_CUDA_ROTARY_HEAD_SIZES))} "
        "and its scheduler fails the first forward otherwise; use a model with one of them (a test model: "
        "model.hf_overrides.head_dim=64), or rollout.engine=embedded"
    ]


def sglang_cpu_errors(cfg: JobConfig) -> list[str]:
    """Colocated SGLang engines on CPU: the path SGLang takes on this CPU must serve ``model.dtype``
    (``rollout/sglang/cpu_path.py``: intel_amx, where the CPU has AMX, serves no fp32)."""
    r = cfg.rollout
    if r.engine != "sglang" or r.sglang.mode != "colocated" or job_backend(cfg.parallel.backend) != "gloo":
        return []
    from grpo_megatron.rollout.sglang.cpu_path import cpu_path_errors, sglang_cpu_path

    return cpu_path_errors(sglang_cpu_path(r.sglang.cpu_path), cfg.model.dtype)


def true_on_policy_errors(cfg: JobConfig) -> list[str]:
    """``rollout.true_on_policy``: what the policy engine (the trainer's model generating,
    training/policy_engine.py) and its bitwise agreement with the trainer need."""
    r, p = cfg.rollout, cfg.parallel
    if not r.true_on_policy:
        return []
    why = "rollout.true_on_policy=true (the trainer's own model generates, bitwise as it trains)"
    rules = [
        (
            r.engine == "embedded",
            "rollout.engine=sglang: SGLang's kernels are not the trainer's; set rollout.engine=embedded",
        ),
        (
            not r.embedded_process,
            "rollout.embedded_process=true: the policy engine is the trainer's model, in its "
            "process; set rollout.embedded_process=false",
        ),
        (
            cfg.train.max_staleness == 0 and not r.partial.enabled,
            "train.max_staleness > 0 or rollout.partial.enabled: the policy generates with the weights it "
            "trains, "
            "not one version behind; set train.max_staleness=0 and rollout.partial.enabled=false",
        ),
        (
            p.pp == 1 and p.cp == 1,
            f"parallel.pp={p.pp}, parallel.cp={p.cp}: decode steps run one stage on "
            "whole sequences; set parallel.pp=1 and parallel.cp=1",
        ),
        (
            p.tp <= 2,
            f"parallel.tp={p.tp}: a sum over more than two tensor-parallel ranks depends on its order; "
            "set parallel.tp to 1 or 2",
        ),
        (
            cfg.model.transformer_impl != "transformer_engine",
            "model.transformer_impl=transformer_engine: the batch-invariant attention is the local layer "
            "spec's; set model.transformer_impl=local",
        ),
        (
            not r.multiturn.enabled,
            "rollout.multiturn.enabled=true: a tool call ends on a stop string, which the "
            "policy engine does not match; set rollout.multiturn.enabled=false",
        ),
    ]
    return [f"{why}: {message}" for ok, message in rules if not ok]


def overlong_errors(cfg: JobConfig) -> list[str]:
    """DAPO's overlong ramp must fit inside the longest response the rollout can produce."""
    overlong = cfg.algorithm.overlong
    if not overlong.enabled or overlong.max_len is not None:
        return []  # an explicit max_len is checked against buffer_len by OverlongConfig itself
    if overlong.buffer_len >= cfg.rollout.max_new_tokens:
        return [
            f"algorithm.overlong.buffer_len={overlong.buffer_len} must be < rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens} (the ramp ends at the longest response): shrink the buffer "
            "(DAPO: 4096 of 20480) or raise max_new_tokens"
        ]
    return []


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ----------------------------------------------------------------------------------------------------
# Start-up checks of the files a job reads and writes: before any process group or model exists, so
# a typo fails in a second with one line instead of a rank's traceback minutes later.


def output_dirs(cfg: JobConfig, command: str) -> list[tuple[str, Path]]:
    """(config field, directory) of what ``command`` writes at its very end and never overwrites."""
    if command == "sft":
        return [("sft.output_dir", Path(cfg.sft.output_dir or Path(cfg.logging.run_dir) / "hf"))]
    if command in ("train", "check") and cfg.checkpoint.export_hf_dir:
        return [("checkpoint.export_hf_dir", Path(cfg.logging.run_dir) / cfg.checkpoint.export_hf_dir)]
    return []


def preflight_errors(cfg: JobConfig, command: str) -> list[str]:
    """Problems with the job's input and output paths: data files, the tokenizer and model
    directories (safetensors whole), an explicit resume checkpoint, and output directories that
    already hold files (found now, not after the last iteration)."""
    from grpo_megatron.data.tokenizer import tokenizer_files_problem
    from grpo_megatron.fileio import read_weight_map, safetensors_problem

    errors: list[str] = []
    data = cfg.data
    for name in ("train_path", "eval_path"):
        value = getattr(data, name)
        if value and not Path(value).is_file():
            errors.append(f"data.{name}={value}: no such file; check the path (relative to the config file)")
    tokenizer_dir = Path(data.tokenizer_path or cfg.model.hf_path)
    field = (
        f"data.tokenizer_path={data.tokenizer_path}"
        if data.tokenizer_path
        else (f"data.tokenizer_path (unset: model.hf_path={cfg.model.hf_path})")
    )
    tokenizer_problem = tokenizer_files_problem(tokenizer_dir)
    if tokenizer_problem:  # train and sft would stop on it after starting every rank
        errors.append(f"{field}: {tokenizer_problem}")
    model_dir = Path(cfg.model.hf_path)
    if model_dir.is_dir():
        for path in sorted(model_dir.glob("*.safetensors")):
            problem = safetensors_problem(path)
            if problem:
                errors.append(f"model.hf_path: {problem}")
        if (model_dir / "model.safetensors.index.json").is_file():
            try:
                read_weight_map(model_dir / "model.safetensors.index.json")
            except ValueError as exc:
                errors.append(f"model.hf_path: {exc}")
    replay = cfg.rollout.replay_dir
    if replay and command in ("train", "check") and not (Path(replay) / "dump.json").is_file():
        errors.append(
            f"rollout.replay_dir={replay}: no dump.json there; point it at a directory a run with "
            "rollout.dump_dir wrote (or leave it empty to generate)"
        )
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "none") and not Path(resume).exists():
        errors.append(f"checkpoint.resume={resume}: no such checkpoint; use auto, none or an existing path")
    for field_name, directory in output_dirs(cfg, command):
        if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
            errors.append(
                f"{field_name}: {directory} exists and is not empty, and is never overwritten: "
                f"choose a new {field_name} or move it aside (found before training, so nothing is lost)"
            )
    return errors
