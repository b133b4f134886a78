"""What is said to an SGLang engine and what it answers: the requests of a generation and of a scoring
call, and their outputs decoded into the interface's types (pure: no SGLang import, no I/O).

What SGLang does differently from the interface's conventions is written where it is handled:
greedy logprobs (``sampling_params_dict``), teacher-forced logprobs at temperature 1 and input ids
reported as 0 (``teacher_forced_logprobs``), stopping at the model's EOS, routes of every layer
(``decode_routed_experts``).
"""

from __future__ import annotations

import base64
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from grpo_megatron.rollout.engine import Completion, SamplingParams
from grpo_megatron.rollout.hf_routes import RouteLayout, route_dtype

_SEED_MODULUS = 2**63 - 1  # SGLang's sampling_seed is a signed int64


@dataclass
class Request:
    """One call of SGLang's ``generate`` (``sglang.Engine.generate`` or the HTTP ``/generate``), before it
    is split over the servers: one row per sequence (a prompt repeated ``n`` times for ``n`` samples)."""

    input_ids: list[list[int]]
    sampling_params: list[dict[str, Any]]
    options: dict[str, Any] = field(default_factory=dict)
    """The request's other fields: ``return_logprob``, ``logprob_start_len``, ``return_routed_experts``."""


def sample_seeds(seed: int | None, num_prompts: int, n: int, rng: random.Random) -> list[int]:
    """One sampling seed per (prompt, sample), prompt-major.

    SGLang seeds each token by (seed, position) only, so the ``n`` samples of a prompt must carry
    different seeds or they come out identical. A given ``seed`` fixes them all (reproducible
    calls); ``seed=None`` draws a fresh base from ``rng``. Seeds are only honoured by engines
    started with ``enable_deterministic_inference`` (else SGLang samples without them).
    """
    base = rng.randrange(_SEED_MODULUS) if seed is None else seed
    return [(base * 1_000_003 + i) % _SEED_MODULUS for i in range(num_prompts * n)]


def sampling_params_dict(
    params: SamplingParams, seed: int, max_new_tokens: int | None = None
) -> dict[str, Any]:
    """SGLang's sampling_params for one sample of ``params`` (``n`` is expanded by the caller), at most
    ``max_new_tokens`` tokens (its request's own: ``request_budgets``; None = ``params.max_new_tokens``).

    ``no_stop_trim`` keeps a matched stop string in the response, as the interface requires
    (stop tokens are kept by SGLang anyway). SGLang also stops at the model's own EOS tokens.
    Greedy is ``top_k=1``: SGLang then reports logprobs at temperature 1 (its greedy path skips the
    temperature), which equals the interface's convention only when ``temperature == 1``.
    """
    return {
        "max_new_tokens": params.max_new_tokens if max_new_tokens is None else max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": 1 if params.greedy else params.top_k,
        "stop_token_ids": list(params.stop_token_ids),
        "stop": list(params.stop_strings),
        "no_stop_trim": True,
        "sampling_seed": seed,
    }


def request_budgets(
    prompts: Sequence[Sequence[int]], params: SamplingParams, context: int | None
) -> list[int]:
    """Each prompt's ``max_new_tokens``: its own limit (``SamplingParams.budgets``), and at most what
    the engine's context leaves after it (``context - len(prompt)``; None = no bound). SGLang refuses
    a request whose input and ``max_new_tokens`` pass its context (``_validate_one_request`` in its
    tokenizer manager, unless it auto-truncates), and with it the whole batch; its scheduler then stops
    a response 2 tokens short of the context (``max_req_len - input_len - 1``, finish "length"). A
    prompt that fills the context keeps its limit: SGLang refuses it, naming its length."""
    limits = params.budgets(len(prompts))
    if context is None:
        return limits
    return [min(b, context - len(p)) if len(p) < context else b for p, b in zip(prompts, limits, strict=True)]


def generate_request(
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    rng: random.Random,
    *,
    routes_enabled: bool,
    context: int | None = None,
) -> Request:
    """The request for ``params.n`` samples of each prompt, with their logprobs, each prompt's at most
    ``request_budgets`` tokens (``context``: the tokens the engine takes in one sequence). Routed
    experts are asked for only when the request wants them (``params.routes``: the training rollouts
    of a job that replays them) and the engine was started to report them (``routes_enabled``); then
    for every input position (``routed_experts_start_len`` left at 0: replay covers the prompt too).
    SGLang ships them as text through its detokenizer (about 2 KB per token of a Qwen3-MoE), so
    nothing else asks."""
    seeds = sample_seeds(params.seed, len(prompts), params.n, rng)
    budgets = [b for b in request_budgets(prompts, params, context) for _ in range(params.n)]
    options: dict[str, Any] = {"return_logprob": True}
    if params.routes and routes_enabled:
        options["return_routed_experts"] = True
    return Request(
        [list(p) for p in prompts for _ in range(params.n)],
        [sampling_params_dict(params, s, b) for s, b in zip(seeds, budgets, strict=True)],
        options,
    )


def score_request(sequences: Sequence[Sequence[int]], temperature: float, *, routes: bool = False) -> Request:
    """The request for teacher-forced logprobs of every token of each sequence (no token generated),
    and with ``routes`` each sequence's routed experts (``score_routes``).

    SGLang 0.5.x computes prompt (input) logprobs from unscaled logits: only temperature 1 matches the
    interface's convention, any other is refused naming the fix."""
    if temperature != 1.0:
        raise ValueError(
            f"SGLang scores sequences at temperature 1 only (asked for {temperature}): run the "
            "mismatch probe at temperature 1.0 with the sglang engine"
        )
    ids = [list(s) for s in sequences]
    options: dict[str, Any] = {"return_logprob": True, "logprob_start_len": 0}
    if routes:
        options["return_routed_experts"] = True
    return Request(ids, [{"max_new_tokens": 0, "temperature": 1.0} for _ in ids], options)


def score_routes(output: Mapping[str, Any], length: int, layout: RouteLayout) -> torch.Tensor:
    """A scoring request's routed experts of a ``length``-token sequence, for the ``length - 1``
    positions a forward of it takes as input (``[moe_layers, length - 1, top_k]``, the
    ``Completion.routed_experts`` layout). SGLang reports rows ``[0, seqlen - 1)`` with ``seqlen`` the
    prompt plus the tokens its request produced (0.5.17 and 0.5.23,
    ``batch_result_processor.py:_maybe_collect_routed_experts``); a request of ``max_new_tokens=0``
    may count the one token its prefill samples, so ``length`` or ``length - 1`` rows: the first
    ``length - 1`` are kept."""
    encoded = output["meta_info"].get("routed_experts")
    if not encoded:
        raise RuntimeError(
            "SGLang returned no routed experts for a scoring request that asked for them "
            "(return_routed_experts): the engine must be started with enable_return_routed_experts"
        )
    for rows in (length, length - 1):
        try:
            routes = decode_routed_experts(encoded, rows, layout)
        except ValueError:
            continue
        if routes is not None:
            return routes[:, : length - 1].contiguous()
    ids = len(base64.b64decode(encoded)) // 4
    raise RuntimeError(
        f"SGLang returned {ids} routed expert ids for a scored {length}-token sequence: not {length} or "
        f"{length - 1} rows of top_k={layout.top_k} over the model's MoE layers"
    )


def decode_routed_experts(
    encoded: str | None, num_rows: int, layout: RouteLayout | None = None
) -> torch.Tensor | None:
    """SGLang's ``meta_info["routed_experts"]`` (base64 int32, ``[rows, layers, top_k]`` flattened)
    in the ``Completion.routed_experts`` layout ``[moe_layers, rows, top_k]``. Row ``i`` is the
    routing of the token at position ``i`` of prompt + response (the last sampled token is never
    fed, so ``num_rows = len(prompt) + len(response) - 1``). With ``layout``, a report that covers
    every layer (dense ones included) keeps only the MoE layers; without it, top_k is taken as the
    whole row (one layer)."""
    if not encoded:
        return None
    ids = torch.frombuffer(bytearray(base64.b64decode(encoded)), dtype=torch.int32)  # little-endian
    if num_rows <= 0 or ids.numel() % num_rows:
        raise ValueError(
            f"SGLang returned {ids.numel()} routed expert ids, not a multiple of {num_rows} tokens"
        )
    top_k = layout.top_k if layout is not None else ids.numel() // num_rows
    if (ids.numel() // num_rows) % top_k:
        raise ValueError(
            f"SGLang returned {ids.numel() // num_rows} expert ids per token, not a multiple of top_k={top_k}"
        )
    routes_mrk = ids.view(num_rows, -1, top_k).transpose(0, 1)
    if layout is not None:
        layers = routes_mrk.shape[0]
        if layers == layout.num_layers and layers != len(layout.moe_layers):
            routes_mrk = routes_mrk[list(layout.moe_layers)]
        elif layers != len(layout.moe_layers):
            raise ValueError(
                f"SGLang returned routes of {layers} layers; the model has {layout.num_layers} layers, "
                f"{len(layout.moe_layers)} of them MoE"
            )
        routes_mrk = routes_mrk.to(route_dtype(layout.num_experts))
    return routes_mrk.contiguous()


def completion_from_output(
    output: Mapping[str, Any], prompt_len: int, layout: RouteLayout | None = None, *, aborted_ok: bool = False
) -> Completion:
    """One SGLang generate output (``output_ids`` and ``meta_info``) as a ``Completion``; ``aborted_ok``:
    a request the adapter aborted (``SGLangEngine.interrupt``) is a "length" completion of what it had."""
    meta = output["meta_info"]
    token_ids = [int(t) for t in output["output_ids"]]
    entries = meta.get("output_token_logprobs") or []
    # Each entry is (logprob, token_id, text-or-None); the token ids must be the response's.
    if [int(e[1]) for e in entries] != token_ids:
        raise RuntimeError(
            f"SGLang's output_token_logprobs ({len(entries)} entries) do not match its output_ids "
            f"({len(token_ids)} tokens): was the engine asked for return_logprob=True?"
        )
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    if kind == "abort" and aborted_ok:
        return Completion(token_ids, [float(e[0]) for e in entries], "length", None)
    if kind not in ("stop", "length"):
        raise RuntimeError(f"SGLang ended a request with finish_reason={reason!r} (aborted or failed)")
    finish: Literal["stop", "length"] = "stop" if kind == "stop" else "length"
    routed = decode_routed_experts(meta.get("routed_experts"), prompt_len + len(token_ids) - 1, layout)
    cached = meta.get("cached_tokens")
    return Completion(
        token_ids,
        [float(e[0]) for e in entries],
        finish,
        routed,
        cached_tokens=None if cached is None else int(cached),
    )


def completions(
    outputs: Sequence[Mapping[str, Any]],
    request: Request,
    n: int,
    layout: RouteLayout | None = None,
    *,
    aborted_ok: bool = False,
) -> list[list[Completion]]:
    """A generate request's outputs (in request order) as ``[prompt][sample]`` completions."""
    flat = [
        completion_from_output(o, len(ids), layout, aborted_ok=aborted_ok)
        for o, ids in zip(outputs, request.input_ids, strict=True)
    ]
    return [flat[i : i + n] for i in range(0, len(flat), n)]


def teacher_forced_logprobs(
    output: Mapping[str, Any], sequence: Sequence[int], prompt_len: int, vocab_size: int | None = None
) -> list[float]:
    """Logprobs of ``sequence[prompt_len:]`` from a scoring request's ``input_token_logprobs``
    (``logprob_start_len=0``: entry ``i`` is token ``i`` given the tokens before it).

    SGLang (0.5.23, ``logprob_result_processor.py``) reports an input token id of ``vocab_size - 1``
    or more as 0 (a clip meant for image placeholders, one too wide); its logprob is still that
    token's, so such an entry matches its token when ``vocab_size`` is given."""
    entries = output["meta_info"].get("input_token_logprobs") or []

    def same(reported: int, token: int) -> bool:
        return reported == token or (vocab_size is not None and reported == 0 and token >= vocab_size - 1)

    matching = len(entries) == len(sequence) and all(
        same(int(e[1]), int(t)) for e, t in zip(entries, sequence, strict=True)
    )
    if not matching:
        raise RuntimeError(
            f"SGLang returned {len(entries)} input logprobs for a {len(sequence)}-token sequence "
            "(or other token ids): it must be scored from position 0 (logprob_start_len=0)"
        )
    return [float(e[0]) for e in entries[prompt_len:]]


def context_tokens(servers: Sequence[Any]) -> int | None:
    """The tokens a sequence may hold on every in-process server (``sglang.Engine``): its tokenizer
    manager's ``context_len`` less its reserved tokens (SGLang's own request check); None when no
    server says (HTTP clients)."""
    known = []
    for server in servers:
        manager = getattr(server, "tokenizer_manager", None)
        context = getattr(manager, "context_len", None)
        if isinstance(context, int):
            known.append(context - int(getattr(manager, "num_reserved_tokens", 0) or 0))
    return min(known) if known else None
