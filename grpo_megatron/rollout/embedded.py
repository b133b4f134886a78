"""The embedded rollout engine: a transformers model of the policy's architecture, in this process.

The default engine on CPU (and usable on one GPU for small runs). It samples every prompt x n row of
a ``generate`` call together (left-padded, with an attention mask and a KV cache; each prompt's
prefill runs once and its cache is repeated for its n rows; rows that finish leave the batch), with
a ``torch.Generator`` of its own so the trainer's global RNG stream is never touched. Logprobs follow the trainer's convention (``rollout/engine.py``): ``log_softmax(logits / T)``
at the sampled token, over the truncated distribution where top-k / top-p / min-p truncate it
(``algorithm/truncation.py``, as the trainer's passes compute them).

Weights arrive under Hugging Face *checkpoint* names (``mlp.experts.3.gate_proj.weight``), while
transformers 5 keeps MoE experts fused in memory (``mlp.experts.gate_up_proj [E, 2I, H]``). Rather
than a hand-written table per architecture, ``checkpoint_views`` traces transformers' own save-time
conversion (``revert_weight_conversion``, what ``save_pretrained`` runs) on tensors of element
indices: each checkpoint tensor turns out to be a strided view of one live tensor, and that view is
where an incoming tensor is copied. The plan is checked to cover every live element exactly once.

Shape legend: R rows (prompts x samples), L padded length, V vocabulary.
"""

from __future__ import annotations

import inspect
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from grpo_megatron.algorithm.truncation import keep_mask, truncated_logprobs
from grpo_megatron.rollout.engine import (
    Bucket,
    Completion,
    Manifest,
    MemoryTag,
    RolloutEngine,
    SamplingParams,
)
from grpo_megatron.rollout.hf_routes import ROUTER_CLASSES, RouteRecorder

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# A live tensor's id lives in the high bits of a traced index, its element offset in the low ones.
_ID_SHIFT = 40


@dataclass(frozen=True)
class CheckpointView:
    """Where one checkpoint-named tensor lives in the model: a strided view of a live tensor."""

    live_name: str
    """state_dict key of the live parameter or buffer."""
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def of(self, live: torch.Tensor) -> torch.Tensor:
        return live.as_strided(self.shape, self.stride, live.storage_offset() + self.offset)


def _trace_group(model: PreTrainedModel, live: Mapping[str, torch.Tensor], ids: Mapping[str, int]) -> dict:
    index_sd = {
        name: (ids[name] << _ID_SHIFT) + torch.arange(t.numel(), dtype=torch.int64).view(t.shape)
        for name, t in live.items()
    }
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4.x: in-memory names are the checkpoint names
        return index_sd
    return revert_weight_conversion(model, index_sd)


def checkpoint_views(model: PreTrainedModel) -> dict[str, CheckpointView]:
    """Map every Hugging Face checkpoint name of ``model`` (as ``save_pretrained`` writes it, plus
    tied aliases such as ``lm_head.weight``) to the view of the live tensor it is stored in.

    Traced layer by layer (the conversions never mix layers), so the int64 index tensors cost at most
    8 bytes per element of one layer. Raises if the conversion is not a plain rearrangement of
    elements (then the engine cannot load checkpoint names in place).
    """
    state = model.state_dict()
    # Tied tensors share a storage: one id, so their checkpoint names become aliases of one view.
    by_storage: dict[int, str] = {}
    canonical: dict[str, str] = {}
    for name, t in state.items():
        canonical[name] = by_storage.setdefault(t.untyped_storage().data_ptr(), name)
    id_of_live = {live: i for i, live in enumerate(by_storage.values())}
    ids = {name: id_of_live[canonical[name]] for name in state}
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in state.items():
        match = re.search(r"\.layers\.(\d+)\.", name)
        groups.setdefault(match.group(1) if match else "", {})[name] = t
    live_of_id = {i: live for live, i in id_of_live.items()}

    views: dict[str, CheckpointView] = {}
    for group in groups.values():
        for ckpt_name, idx in _trace_group(model, group, ids).items():
            views[ckpt_name] = _view_from_indices(ckpt_name, idx, live_of_id, state)
    _check_coverage(views, state, canonical)
    return views


def _view_from_indices(
    ckpt_name: str, idx: torch.Tensor, live_of_id: Mapping[int, str], state: Mapping[str, torch.Tensor]
) -> CheckpointView:
    flat = idx.reshape(-1)
    tensor_ids = torch.unique(flat >> _ID_SHIFT)
    if tensor_ids.numel() != 1:
        raise NotImplementedError(
            f"{ckpt_name}: transformers builds it from {tensor_ids.numel()} live tensors; the embedded "
            "engine only loads checkpoint tensors that are views of one live tensor"
        )
    live_name = live_of_id[int(tensor_ids[0])]
    local = idx - (int(tensor_ids[0]) << _ID_SHIFT)
    offset = int(local.reshape(-1)[0]) if local.numel() else 0
    stride = []
    for dim, size in enumerate(local.shape):
        delta = local.narrow(dim, 1, 1) - local.narrow(dim, 0, 1) if size > 1 else None
        stride.append(int(delta.reshape(-1)[0]) if delta is not None else 1)
    # The indices a strided view with these parameters would hold: must be exactly the traced ones.
    expected = torch.full(local.shape, offset, dtype=torch.int64)
    for dim, (size, step) in enumerate(zip(local.shape, stride, strict=True)):
        shape = [1] * local.dim()
        shape[dim] = size
        expected = expected + torch.arange(size, dtype=torch.int64).view(shape) * step
    if local.numel() and (
        not torch.equal(expected, local)
        or int(local.min()) < 0
        or int(local.max()) >= state[live_name].numel()
    ):
        raise NotImplementedError(f"{ckpt_name}: not a strided view of {live_name}; cannot load it in place")
    return CheckpointView(live_name, tuple(local.shape), tuple(stride), offset)


def _check_coverage(
    views: Mapping[str, CheckpointView], state: Mapping[str, torch.Tensor], canonical: Mapping[str, str]
) -> None:
    """Every live element must be written by exactly one view (aliases count once)."""
    hits = {
        name: torch.zeros(t.numel(), dtype=torch.int32)
        for name, t in state.items()
        if canonical[name] == name
    }
    for view in set(views.values()):
        view.of(hits[view.live_name]).add_(1)
    bad = sorted(name for name, h in hits.items() if not bool((h == 1).all()))
    if bad:
        raise NotImplementedError(
            f"checkpoint names do not cover these live tensors exactly once: {bad[:5]}; the embedded engine "
            "cannot load this architecture by name"
        )


def alias_groups(views: Mapping[str, CheckpointView]) -> list[list[str]]:
    """Checkpoint names grouped by the view they write (a group of two = tied weights)."""
    groups: dict[CheckpointView, list[str]] = {}
    for name, view in views.items():
        groups.setdefault(view, []).append(name)
    return list(groups.values())


def _supports_experts_implementation(model_cls: object) -> bool:
    probe = getattr(model_cls, "_can_set_experts_implementation", None)
    return bool(probe()) if callable(probe) else False


def sample_next(
    logits_rv: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return ``(token_r, logprob_r)``.

    The logprob is ``log_softmax(logits / T)`` at the token (the trainer's convention); with top-k,
    top-p or min-p (``SamplingParams.truncation``) the token is sampled from the truncated,
    renormalised distribution and its logprob is that distribution's (``algorithm/truncation.py``),
    which the trainer's passes compute too. Greedy: the argmax, with the full distribution's logprob.
    """
    scaled_rv = logits_rv.float() / params.temperature
    truncation = params.truncation
    if params.greedy or not truncation.active:
        logprobs_rv = torch.log_softmax(scaled_rv, dim=-1)
        if params.greedy:
            token_r = logits_rv.argmax(dim=-1)
        else:
            token_r = torch.multinomial(logprobs_rv.exp(), 1, generator=generator)[:, 0]
        return token_r, logprobs_rv.gather(-1, token_r[:, None])[:, 0]
    kept_rv = scaled_rv.masked_fill(~keep_mask(scaled_rv, truncation), float("-inf"))
    token_r = torch.multinomial(torch.softmax(kept_rv, dim=-1), 1, generator=generator)[:, 0]
    return token_r, truncated_logprobs(scaled_rv, token_r, truncation)


class EmbeddedEngine(RolloutEngine):
    """A transformers ``AutoModelForCausalLM`` of the HF config ``hf``, fed by ``update_weights``.

    ``device``: where the model runs ("cpu" or a CUDA device). ``dtype``: its parameter dtype; the
    weight stream must arrive in it (the fleet exports in this dtype). ``tokenizer``: needed only for
    stop strings. ``max_batch_rows``: rows decoded together (0 = all rows of a call at once).
    ``record_routes``: whether ``generate`` may report each response's MoE routes
    (``Completion.routed_experts``; routing replay r3 needs them): it does for requests that ask
    (``SamplingParams.routes``); ``score_with_routes`` records them either way.
    Weights start randomly initialised (without touching the global RNG) until the first update.
    """

    def __init__(
        self,
        hf: Mapping[str, Any],
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        tokenizer: Any = None,
        max_batch_rows: int = 0,
        record_routes: bool = True,
    ) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        self.device = torch.device(device)
        self.dtype = dtype
        self.tokenizer = tokenizer
        self.max_batch_rows = max_batch_rows
        self.record_routes = record_routes
        self.interrupted = False
        """Set by ``interrupt`` (another thread): generation ends after its current step (issue 51)."""
        config = AutoConfig.for_model(**dict(hf))
        # transformers annotates this lookup as a pair of classes; it returns the model class.
        model_cls = AutoModelForCausalLM._model_mapping[type(config)]
        kwargs: dict[str, Any] = {"dtype": dtype}
        if _supports_experts_implementation(model_cls):
            # transformers' default grouped/batched expert kernels were ~30x slower than the plain
            # per-expert loop on CPU (GUIDE); on GPU its default is the fast one.
            kwargs["experts_implementation"] = "eager" if self.device.type == "cpu" else "grouped_mm"
        # What the model was built with (kernel choices included): a transformers model built with the
        # same arguments runs the same kernels, so its outputs on the same weights are bit-identical.
        self.model_kwargs: dict[str, Any] = dict(kwargs)
        with torch.random.fork_rng(devices=[]):  # random init must not advance the trainer's RNG
            model = AutoModelForCausalLM.from_config(config, **self.model_kwargs)
        self.model = model.to(self.device).eval().requires_grad_(False)
        # MoE models report each token's experts (Completion.routed_experts) for routing replay.
        self.routes = (
            RouteRecorder(self.model, config.model_type) if config.model_type in ROUTER_CLASSES else None
        )
        self.pad_token_id = int(hf.get("pad_token_id") or 0)
        # transformers renamed forward's `past_key_values` to `cache` (the old name warns since 5.2x).
        forward_args = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_args else "past_key_values"
        self.views = checkpoint_views(self.model)
        self._aliases = alias_groups(self.views)
        live = self.model.state_dict()
        self._expected = {name: (view.shape, live[view.live_name].dtype) for name, view in self.views.items()}
        self._targets: dict[str, torch.Tensor] | None = (
            None  # views into the live weights (see _live_targets)
        )
        self._staged: dict[str, torch.Tensor] = {}
        self._staged_version: int | None = None
        self._direct_version: int | None = None  # a version whose manifest was accepted: loaded in place
        self._direct_names: set[str] = set()  # names of that manifest not loaded yet
        self._accepted_manifest: Manifest | None = None  # the last manifest accepted, and its names
        self._accepted_names: frozenset[str] = frozenset()
        self._weights_on_host = False
        self.weight_version = -1

    # ----------------------------------------------------------------------------------- weights

    def expected_tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Checkpoint name -> (shape, dtype) of every tensor ``update_weights`` accepts."""
        return dict(self._expected)

    def _live_targets(self) -> dict[str, torch.Tensor]:
        """Checkpoint name -> the view of the live weights it is copied into. Made once per placement
        of the weights (moving the model to host and back makes new tensors): a sync then costs one
        copy per tensor and no per-tensor lookups."""
        if self._targets is None:
            live = self.model.state_dict()
            self._targets = {name: view.of(live[view.live_name]) for name, view in self.views.items()}
        return self._targets

    def update_weights(self, bucket: Bucket, *, version: int, last: bool) -> None:
        """After ``check_manifest`` accepted ``version``: copy each tensor straight into the live
        weights (one copy per byte; the weights are partial, ``weight_version`` -1, until ``last``).
        Otherwise stage ``bucket`` (kept by reference) and on ``last`` validate everything staged
        for ``version`` and only then copy it into the model."""
        if self._direct_version == version:
            self._load_in_place(bucket, version, last)
            return
        if self._staged_version != version:
            self._staged, self._staged_version = {}, version  # a new version drops a stale partial one
        repeated = [name for name, _ in bucket if name in self._staged]
        self._staged.update(bucket)
        if repeated:
            self._discard_staged()
            raise ValueError(f"weight update v{version}: tensors sent twice: {sorted(repeated)[:10]}")
        if not last:
            return
        staged, self._staged = self._staged, {}
        self._staged_version = None
        problems = self._validate({name: (tuple(t.shape), t.dtype) for name, t in staged.items()})
        if problems:
            raise ValueError(
                f"weight update v{version} rejected, the engine keeps v{self.weight_version}: "
                + "; ".join(problems)
            )
        self._copy_into_live(staged.items())
        self.weight_version = version
        self.flush_cache()

    def check_manifest(self, manifest: Manifest, version: int) -> list[str]:
        """Every problem of an update made of exactly ``manifest``'s tensors (empty = accepted, and the
        buckets of ``version`` are then loaded in place as they arrive). The verdict depends only on
        the manifest and the model's layout, so the manifest last accepted (the fleet passes the
        same one every sync) is accepted again without another look."""
        if manifest is self._accepted_manifest:
            self._discard_staged()
            self._direct_version, self._direct_names = version, set(self._accepted_names)
            return []
        meta = {name: (tuple(shape), dtype) for name, shape, dtype in manifest}
        counts = Counter(name for name, _, _ in manifest)
        repeated = sorted(name for name, n in counts.items() if n > 1)
        problems = self._validate(meta)
        if repeated:
            problems.insert(0, f"tensors listed twice {repeated[:10]}")
        if problems:
            return [
                f"weight update v{version} rejected, the engine keeps v{self.weight_version}: "
                + "; ".join(problems)
            ]
        self._discard_staged()
        self._direct_version, self._direct_names = version, set(meta)
        self._accepted_manifest, self._accepted_names = manifest, frozenset(meta)
        return []

    def _load_in_place(self, bucket: Bucket, version: int, last: bool) -> None:
        """One bucket of an accepted manifest into the live weights; ``last`` commits ``version``."""
        self.weight_version = -1  # partial from the first byte on, until the last bucket is in
        try:
            stray = [name for name, _ in bucket if name not in self._direct_names]
            if stray:
                raise ValueError(
                    f"weight update v{version}: tensors outside its manifest or sent twice: {stray[:10]}"
                )
            self._direct_names.difference_update(name for name, _ in bucket)
            self._copy_into_live(bucket)
            if last and self._direct_names:
                raise ValueError(
                    f"weight update v{version}: the stream ended without {sorted(self._direct_names)[:10]} "
                    f"({len(self._direct_names)} in all) of its manifest"
                )
        except Exception:
            self._direct_version = None  # the weights stay partial (version -1) until a full update
            raise
        if last:
            self._direct_version = None
            self.weight_version = version
            self.flush_cache()

    def load_target(self, name: str) -> torch.Tensor | None:
        """The live view ``name`` is loaded into, during an accepted in-place update (else None)."""
        if self._direct_version is None:
            return None
        self.weight_version = -1  # the transport writes the live weights from here on
        return self._live_targets().get(name)

    def _copy_into_live(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        targets = self._live_targets()
        with torch.no_grad():
            for name, tensor in tensors:
                target = targets[name]
                if tensor is not target:  # the transport may have received it in place already
                    target.copy_(tensor, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # borrowed tensors may be reused once this returns

    def abort_update(self, version: int) -> None:
        if self._staged_version == version:
            self._discard_staged()
        if self._direct_version == version:
            self._direct_version = None

    def _discard_staged(self) -> None:
        self._staged, self._staged_version = {}, None

    def _validate(self, staged: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> list[str]:
        """Every problem of a complete update of these tensors (name -> shape, dtype), each naming its
        tensors (empty = good)."""
        expected = self._expected
        problems = []
        unexpected = sorted(set(staged) - set(expected))
        if unexpected:
            problems.append(f"unexpected names {unexpected[:10]} ({len(unexpected)} in all)")
        # Tied weights (lm_head.weight with embed_tokens.weight) need only one name of their group.
        missing = sorted(
            g[0] if len(g) == 1 else " or ".join(g) for g in self._aliases if not set(g) & set(staged)
        )
        if missing:
            problems.append(f"missing {missing[:10]} ({len(missing)} in all)")
        wrong_shape = [
            f"{n} {shape} != {expected[n][0]}"
            for n, (shape, _) in sorted(staged.items())
            if n in expected and shape != expected[n][0]
        ]
        if wrong_shape:
            problems.append(f"wrong shapes {wrong_shape[:10]} ({len(wrong_shape)} in all)")
        wrong_dtype = [
            f"{n} {dtype} != {expected[n][1]}"
            for n, (_, dtype) in sorted(staged.items())
            if n in expected and not _widens_exactly(dtype, expected[n][1])
        ]
        if wrong_dtype:
            problems.append(
                f"wrong dtypes {wrong_dtype[:10]} ({len(wrong_dtype)} in all): export in the engine's dtype "
                "(or a narrower float it widens exactly)"
            )
        return problems

    # -------------------------------------------------------------------------------- generation

    def interrupt(self, cut: bool = True) -> None:
        """Cut the generation short from another thread (a preemption signal's watcher: the batch will
        be dropped): every row ends after the step it is at, each still with at least one token, and
        later generations of this engine end after their first step, until ``interrupt(False)``."""
        self.interrupted = cut

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        if params.stop_strings and self.tokenizer is None:
            raise ValueError(
                "SamplingParams.stop_strings needs a tokenizer: pass tokenizer= to the engine (the fleet "
                "passes the one given to RolloutFleet.build)"
            )
        if any(len(p) == 0 for p in prompts):
            raise ValueError("generate: every prompt needs at least one token")
        self._require_weights_on_device()
        generator = torch.Generator(device=self.device)
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()  # fresh entropy, still not the global RNG
        n = params.n
        limits = [b for b in params.budgets(len(prompts)) for _ in range(n)]  # each row's max_new_tokens
        if self.max_batch_rows and self.max_batch_rows < n:  # one prompt's samples do not fit one batch
            rows = [list(p) for p in prompts for _ in range(n)]
            units = [
                (rows[s : s + self.max_batch_rows], 1, limits[s : s + self.max_batch_rows])
                for s in range(0, len(rows), self.max_batch_rows)
            ]
        else:  # whole prompts per batch, each prompt's prefill computed once for its n samples
            per = max(1, self.max_batch_rows // n if self.max_batch_rows else len(prompts))
            units = [
                ([list(p) for p in prompts[s : s + per]], n, limits[s * n : (s + per) * n])
                for s in range(0, len(prompts), per)
            ]
        done: list[Completion] = []
        for unique, repeats, unit_limits in units:
            done.extend(self._generate_rows(unique, repeats, params, generator, unit_limits))
        return [done[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _generate_rows(
        self,
        prompts: list[list[int]],
        repeats: int,
        params: SamplingParams,
        generator: torch.Generator,
        limits: list[int],
    ) -> list[Completion]:
        """Each of ``prompts`` sampled ``repeats`` times (rows prompt-major), row ``r`` at most
        ``limits[r]`` tokens. The prompts' prefill runs once per prompt, then its KV cache, mask and
        positions are repeated for the prompt's rows; each step keeps its tokens and logprobs as
        tensors of the rows still active, turned into lists once at the end (no per-row Python per
        step unless stop strings need the text). A row leaves the batch at a stop or at its limit."""
        from transformers import DynamicCache

        n_rows = len(prompts) * repeats
        inputs_rl, mask_rl, positions_rl = self._left_padded(prompts)
        cache = DynamicCache(config=self.model.config)
        stop_ids = torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long, device=self.device)
        recorder = self.routes if self.record_routes and params.routes else None
        routes = (
            _StepRoutes(recorder, n_rows, repeats, params.max_new_tokens) if recorder is not None else None
        )
        texts = _StopStrings(self.tokenizer, params.stop_strings, n_rows) if params.stop_strings else None
        steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (rows, token, logprob) per step
        stopped_r = torch.zeros(n_rows, dtype=torch.bool, device=self.device)
        active = torch.arange(n_rows, device=self.device)  # original row of each batch row
        last_step_r = torch.tensor(limits, dtype=torch.long, device=self.device) - 1  # a row's last step
        steps_total = max(limits)
        if self.routes is not None and recorder is None:
            self.routes.active = False  # routing replay is off: no route is copied out of the routers
        ragged = None
        if params.ragged_prefill and repeats == 1 and routes is None:
            ragged = self._ragged_prefill(prompts, cache)
        if ragged is not None:
            first_logits, mask_rl, positions_rl, active = ragged
        try:
            for step in range(steps_total):
                if ragged is not None and step == 0:
                    logits = first_logits
                else:
                    logits = self.model(
                        input_ids=inputs_rl,
                        attention_mask=mask_rl,
                        position_ids=positions_rl,
                        use_cache=True,
                        **{self._cache_kwarg: cache},
                        logits_to_keep=1,
                    ).logits[:, -1]
                if step == 0 and repeats > 1:  # one prefill per prompt: its rows share it
                    logits = logits.repeat_interleave(repeats, dim=0)
                    cache.batch_repeat_interleave(repeats)
                    mask_rl, positions_rl = (
                        mask_rl.repeat_interleave(repeats, 0),
                        positions_rl.repeat_interleave(repeats, 0),
                    )
                if routes is not None:
                    routes.add(step, active)
                token_r, logprob_r = sample_next(logits, params, generator)
                steps.append((active, token_r, logprob_r))
                stop_r = (
                    torch.isin(token_r, stop_ids)
                    if stop_ids.numel()
                    else torch.zeros_like(token_r, dtype=torch.bool)
                )
                if texts is not None:
                    stop_r |= texts.add(active, token_r)
                stopped_r[active[stop_r]] = True
                leave_r = stop_r | (last_step_r[active] == step)  # stopped, or at its limit ("length")
                if step == steps_total - 1 or bool(leave_r.all()) or self.interrupted:
                    break
                positions_rl = positions_rl[:, -1:] + 1
                mask_rl = torch.cat([mask_rl, torch.ones_like(mask_rl[:, :1])], dim=1)
                inputs_rl = token_r[:, None]
                if bool(leave_r.any()):  # finished rows leave the batch (and the KV cache)
                    keep_idx = (~leave_r).nonzero()[:, 0]
                    cache.batch_select_indices(keep_idx)
                    active, mask_rl = active[keep_idx], mask_rl[keep_idx]
                    positions_rl, inputs_rl = positions_rl[keep_idx], inputs_rl[keep_idx]
        finally:
            if self.routes is not None:
                self.routes.active = True
        return _completions(
            steps, stopped_r, n_rows, routes, [len(r) for r in prompts for _ in range(repeats)]
        )

    def _left_padded(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, mask, positions) of ``prompts`` left-padded on the device: every row's last prompt
        token sits in the last column."""
        length = max(len(r) for r in prompts)
        mask_pl = torch.zeros((len(prompts), length), dtype=torch.long)
        tokens_pl = torch.full((len(prompts), length), self.pad_token_id, dtype=torch.long)
        for i, r in enumerate(prompts):
            tokens_pl[i, length - len(r) :] = torch.tensor(r)
            mask_pl[i, length - len(r) :] = 1
        inputs_rl, mask_rl = tokens_pl.to(self.device), mask_pl.to(self.device)
        return inputs_rl, mask_rl, (mask_rl.cumsum(-1) - 1).clamp(min=0)

    def _ragged_prefill(
        self, prompts: list[list[int]], cache: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``SamplingParams.ragged_prefill``: the prompts prefilled in batches of similar lengths (by
        length; a new batch where a prompt is over twice its batch's shortest), their KV left-padded
        to the longest and written into ``cache``: (first logits, mask, positions, original row of
        each batch row), rows in length order. None where one batch holds them all (the plain path)."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        batches, start = [], 0
        for j in range(1, len(order) + 1):
            if j == len(order) or len(prompts[order[j]]) > 2 * len(prompts[order[start]]):
                batches.append(order[start:j])
                start = j
        if len(batches) == 1:
            return None
        from transformers import DynamicCache

        length = len(prompts[order[-1]])
        logits, masks, kv = [], [], []
        for rows in batches:
            mask = torch.zeros((len(rows), length), dtype=torch.long)
            tokens = torch.full((len(rows), length), self.pad_token_id, dtype=torch.long)
            for i, r in enumerate(rows):
                tokens[i, length - len(prompts[r]) :] = torch.tensor(prompts[r])
                mask[i, length - len(prompts[r]) :] = 1
            own = max(len(prompts[r]) for r in rows)  # this batch's columns: the rest is padding only
            mask_rl = mask[:, length - own :].to(self.device)
            tokens_rl = tokens[:, length - own :].to(self.device)
            part = DynamicCache(config=self.model.config)
            logits.append(
                self.model(
                    input_ids=tokens_rl,
                    attention_mask=mask_rl,
                    position_ids=(mask_rl.cumsum(-1) - 1).clamp(min=0),
                    use_cache=True,
                    **{self._cache_kwarg: part},
                    logits_to_keep=1,
                ).logits[:, -1]
            )
            masks.append(mask.to(self.device))
            layers: list[Any] = list(part.layers)  # full-attention layers (DynamicLayer): keys, values
            kv.append([(layer.keys, layer.values) for layer in layers])
        for index in range(len(kv[0])):  # each layer's keys and values, left-padded to ``length``, stacked
            padded = [_left_pad(*part[index], length) for part in kv]
            keys, values = zip(*padded, strict=True)
            cache.update(torch.cat(keys), torch.cat(values), index)
        mask_rl = torch.cat(masks)
        positions_rl = (mask_rl.cumsum(-1) - 1).clamp(min=0)
        rows_r = torch.tensor([r for b in batches for r in b], device=self.device)
        return torch.cat(logits), mask_rl, positions_rl, rows_r

    def score(
        self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], temperature: float
    ) -> list[list[float]]:
        """Teacher-forced ``log_softmax(logits / T)`` of each token after its prompt (right padding)."""
        return self.score_with_routes(sequences, prompt_lens, temperature)[0]

    @torch.no_grad()
    def score_with_routes(
        self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], temperature: float
    ) -> tuple[list[list[float]], list[torch.Tensor] | None]:
        """``score`` and, for an MoE model, each sequence's routes ``[M, len(seq) - 1, K]`` (the
        layout of ``Completion.routed_experts``: every token but the last is an input)."""
        if len(sequences) != len(prompt_lens):
            raise ValueError(f"score: {len(sequences)} sequences but {len(prompt_lens)} prompt lengths")
        for i, (seq, p) in enumerate(zip(sequences, prompt_lens, strict=True)):
            if not 1 <= p <= len(seq):
                raise ValueError(f"score: sequence {i} has prompt_len={p} outside [1, {len(seq)}]")
        self._require_weights_on_device()
        length = max(len(s) for s in sequences)
        tokens_rl = torch.full((len(sequences), length), self.pad_token_id, dtype=torch.long)
        mask_rl = torch.zeros_like(tokens_rl)
        for i, s in enumerate(sequences):
            tokens_rl[i, : len(s)] = torch.tensor(list(s))
            mask_rl[i, : len(s)] = 1
        tokens_rl, mask_rl = tokens_rl.to(self.device), mask_rl.to(self.device)
        logits_rlv = self.model(input_ids=tokens_rl, attention_mask=mask_rl, use_cache=False).logits
        logprobs_rl = torch.log_softmax(logits_rlv[:, :-1].float() / temperature, dim=-1)
        logprobs_rl = logprobs_rl.gather(-1, tokens_rl[:, 1:, None])[..., 0].cpu()
        pairs = enumerate(zip(sequences, prompt_lens, strict=True))
        logprobs = [logprobs_rl[i, p - 1 : len(s) - 1].tolist() for i, (s, p) in pairs]
        if self.routes is None:
            return logprobs, None
        routes_mrlk = self.routes.take().unflatten(1, (len(sequences), length))
        return logprobs, [routes_mrlk[:, i, : len(s) - 1].clone() for i, s in enumerate(sequences)]

    # ----------------------------------------------------------------------------------- memory

    def _require_weights_on_device(self) -> None:
        if self._weights_on_host:
            raise RuntimeError(
                "the embedded engine's weights are released: call resume_memory(['weights']) first"
            )

    def release_memory(self, tags: Sequence[MemoryTag] | None = None) -> None:
        """On a GPU, "weights" moves the model to host memory; the KV cache lives only inside a
        ``generate`` call, so "kv_cache" just returns cached blocks to the driver. On CPU: nothing."""
        if self.device.type != "cuda":
            return
        if tags is None or "weights" in tags:
            self.model.to("cpu")
            self._weights_on_host, self._targets = True, None
        torch.cuda.empty_cache()

    def resume_memory(self, tags: Sequence[MemoryTag] | None = None) -> None:
        if self.device.type != "cuda":
            return
        if (tags is None or "weights" in tags) and self._weights_on_host:
            self.model.to(self.device)
            self._weights_on_host, self._targets = False, None

    def shutdown(self) -> None:
        self._discard_staged()
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _left_pad(keys: torch.Tensor, values: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's ``[rows, heads, L, dim]`` keys and values with zeros before them up to ``length``."""
    pad = (0, 0, length - keys.shape[-2], 0)
    return torch.nn.functional.pad(keys, pad), torch.nn.functional.pad(values, pad)


class _StepRoutes:
    """The routes of the fed tokens during one ``_generate_rows`` call: the (left-padded) prompts'
    from the prefill (one per prompt, repeated for its rows), then one response token per active row
    and step, written with one indexed copy per step (not one op per row: at hundreds of rows that
    Python loop cost more than the decoding step itself on a GPU)."""

    def __init__(self, recorder: RouteRecorder, n_rows: int, repeats: int, max_new_tokens: int) -> None:
        self.recorder, self.n_rows, self.repeats, self.max_new_tokens = (
            recorder,
            n_rows,
            repeats,
            max_new_tokens,
        )
        self.prompt_mrlk: torch.Tensor | None = None
        self.response_mrtk: torch.Tensor | None = None

    def add(self, step: int, active: torch.Tensor) -> None:
        taken_mnk = self.recorder.take()
        if step == 0:
            prompt_mplk = taken_mnk.unflatten(1, (self.n_rows // self.repeats, -1))
            self.prompt_mrlk = prompt_mplk.repeat_interleave(self.repeats, dim=1)
            m, _, _, k = self.prompt_mrlk.shape
            self.response_mrtk = taken_mnk.new_full((m, self.n_rows, max(self.max_new_tokens - 1, 0), k), -1)
        else:  # the token fed at this step is each active row's response token step - 1
            assert self.response_mrtk is not None
            self.response_mrtk[:, active.cpu(), step - 1] = taken_mnk

    def row(self, i: int, prompt_len: int, fed: int) -> torch.Tensor:
        """Row ``i``'s routes: its prompt (the last columns: left padding), then its fed response tokens."""
        assert self.prompt_mrlk is not None and self.response_mrtk is not None
        prompt_mlk = self.prompt_mrlk[:, i, self.prompt_mrlk.shape[2] - prompt_len :]
        return torch.cat([prompt_mlk, self.response_mrtk[:, i, :fed]], dim=1)


class _StopStrings:
    """Each row's decoded response so far, for ``SamplingParams.stop_strings`` (per-row Python: only
    when stop strings are asked for)."""

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str], n_rows: int) -> None:
        self.tokenizer, self.stop_strings = tokenizer, tuple(stop_strings)
        self.tokens: list[list[int]] = [[] for _ in range(n_rows)]

    def add(self, active: torch.Tensor, token_r: torch.Tensor) -> torch.Tensor:
        """Append each active row's token; which rows' text now holds a stop string."""
        hits = []
        for row, token in zip(active.tolist(), token_r.tolist(), strict=True):
            self.tokens[row].append(token)
            text = self.tokenizer.decode(self.tokens[row])
            hits.append(any(s in text for s in self.stop_strings))
        return torch.tensor(hits, dtype=torch.bool, device=token_r.device)


def _completions(
    steps: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    stopped_r: torch.Tensor,
    n_rows: int,
    routes: _StepRoutes | None,
    prompt_lens: Sequence[int],
) -> list[Completion]:
    """One Completion per row from the steps' (active rows, tokens, logprobs): a row is active from
    the first step until it stops, so its response is the first ``count`` steps' entries."""
    n_steps = len(steps)
    device = stopped_r.device
    tokens_rt = torch.zeros((n_rows, n_steps), dtype=torch.long, device=device)
    logprobs_rt = torch.zeros((n_rows, n_steps), dtype=torch.float32, device=device)
    count_r = torch.zeros(n_rows, dtype=torch.long, device=device)
    for step, (rows_a, token_a, logprob_a) in enumerate(steps):
        tokens_rt[rows_a, step] = token_a
        logprobs_rt[rows_a, step] = logprob_a.float()
        count_r[rows_a] += 1
    tokens, logprobs = tokens_rt.tolist(), logprobs_rt.tolist()
    counts, stopped = count_r.tolist(), stopped_r.tolist()
    out = []
    for i in range(n_rows):
        c = counts[i]
        routed = routes.row(i, prompt_lens[i], c - 1) if routes is not None else None
        out.append(Completion(tokens[i][:c], logprobs[i][:c], "stop" if stopped[i] else "length", routed))
    return out


def _widens_exactly(sent: torch.dtype, live: torch.dtype) -> bool:
    """Whether a tensor of dtype ``sent`` can be copied into one of dtype ``live`` without loss: the
    same dtype, or a narrower float that ``live`` represents exactly (bf16 or fp16 into fp32). The
    export sends one dtype, but transformers keeps some tensors of a bf16 model in fp32 (DeepSeek-V3's
    router weight and score-correction bias, its ``_keep_in_fp32_modules_strict``)."""
    if sent == live:
        return True
    return (
        sent.is_floating_point
        and live.is_floating_point
        and sent.itemsize < live.itemsize
        and torch.promote_types(sent, live) == live
    )
