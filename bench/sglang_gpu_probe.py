"""SGLang's own engine on one GPU, without the project's adapter: does it start with the settings of
../shared/GUIDE.md section 10, and what do its calls cost? (The floor the adapter is measured against.)
With ``--device cpu`` the same steps run on SGLang's CPU engine (the tiny model; no routed experts,
which need pinned memory, and no memory saver, which needs libcuda).

A random Qwen3-MoE (the gpu_check table's 0.43B slice, or ``--tiny``) is written to disk in bf16 by
transformers; the engine starts from it (triton attention and MoE, pytorch sampling, no grammar
backend), generates with logprobs and routed experts, scores, takes one weight version as flattened
buckets through CUDA IPC, releases and resumes its memory. Each step's seconds and the device
memory are printed and written as JSON.

    python bench/sglang_gpu_probe.py --json out.json [--tiny] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
GPU_SERVER_ARGS = {
    # The GPU machine's carry has SGLang's sm90 kernels only (no FA3, no flashinfer kernels): GUIDE section 10.
    "attention_backend": "triton",
    "sampling_backend": "pytorch",
    "moe_runner_backend": "triton",
    "grammar_backend": "none",
    "mem_fraction_static": 0.3,
    "enable_memory_saver": True,
    "enable_return_routed_experts": True,
}
COMMON_SERVER_ARGS = {"skip_tokenizer_init": True, "log_level": "warning", "random_seed": 0}


def model_config(tiny: bool) -> dict:
    cfg = json.loads((REPO / "examples" / "tiny_moe" / "config.json").read_text())
    if not tiny:
        cfg |= {
            "hidden_size": 1024,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "head_dim": 128,
            "num_key_value_heads": 4,
            "num_experts": 32,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 512,
            "intermediate_size": 512,
        }
    cfg["torch_dtype"] = "bfloat16"
    return cfg


def gib() -> str:
    if not torch.cuda.is_available():
        import psutil

        return f"{psutil.Process().memory_info().rss / 2**30:.2f} GiB RSS of this process"
    free, total = torch.cuda.mem_get_info()
    return f"{(total - free) / 2**30:.2f} GiB used of {total / 2**30:.0f}"


def server_args(device: str) -> dict:
    if device == "cuda":
        return GPU_SERVER_ARGS | COMMON_SERVER_ARGS
    import os

    from grpo_megatron.rollout.sglang.launch import CPU_SERVER_ARGS

    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # read when sglang is imported, here and in its children
    return CPU_SERVER_ARGS | COMMON_SERVER_ARGS


class Probe:
    """The probe's steps on one engine; each step's seconds, device memory and figures go to ``out``."""

    def __init__(self, args: argparse.Namespace, folder: str) -> None:
        self.args, self.folder, self.device = args, folder, args.device
        self.engine_args = server_args(self.device)
        self.routes = bool(self.engine_args.get("enable_return_routed_experts"))
        name = torch.cuda.get_device_name(0) if self.device == "cuda" else "CPU"
        self.out: dict[str, Any] = {"device": name, "steps": {}, "routes_expected": self.routes}
        self.engine: Any = None

    def step(self, name: str, t0: float, **extra: object) -> None:
        self.out["steps"][name] = {"seconds": round(time.perf_counter() - t0, 3), "memory": gib(), **extra}
        print(f"[probe] {name}: {self.out['steps'][name]}", flush=True)
        self.args.json.write_text(json.dumps(self.out, indent=1))

    def write_model(self) -> None:
        import transformers

        t0 = time.perf_counter()
        config = transformers.AutoConfig.for_model(**model_config(self.args.tiny))
        torch.manual_seed(0)
        with torch.device(
            self.device
        ):  # initialised where it runs: a 0.43B model in seconds, not 20 s on the host
            self.hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
        self.hf.save_pretrained(self.folder)
        self.step("write_model", t0, parameters=sum(p.numel() for p in self.hf.parameters()))

    def start(self) -> None:
        import sglang

        from grpo_megatron.rollout.sglang import compat

        self.out["sglang"] = sglang.__version__
        t0 = time.perf_counter()
        with compat.child_environment():
            self.engine = sglang.Engine(model_path=self.folder, dtype="bfloat16", **self.engine_args)
        self.step("engine_start", t0)

    def generate(self) -> list[int]:
        """Sampled rollouts, twice (the first pays kernel warm-up); one prompt + response for scoring."""
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, 64, (16,), generator=g).tolist() for _ in range(self.args.prompts)]
        params = {
            "temperature": 1.0,
            "max_new_tokens": self.args.max_new_tokens,
            "n": self.args.n,
            "ignore_eos": True,
        }
        for name in ("generate_first", "generate"):
            t0 = time.perf_counter()
            res = self.engine.generate(
                input_ids=prompts,
                sampling_params=params,
                return_logprob=True,
                return_routed_experts=self.routes,
            )
            tokens = sum(len(r["output_ids"]) for r in res)
            routed = bool(res[0]["meta_info"].get("routed_experts"))
            self.step(
                name,
                t0,
                tokens=tokens,
                tokens_per_s=round(tokens / (time.perf_counter() - t0)),
                routed=routed,
            )
        return prompts[0] + res[0]["output_ids"]

    def score(self, seq: list[int]) -> torch.Tensor:
        scored = self.engine.generate(
            input_ids=[seq],
            sampling_params={"max_new_tokens": 1, "temperature": 0.0},
            return_logprob=True,
            logprob_start_len=0,
        )
        return torch.tensor([lp for lp, _, _ in scored[0]["meta_info"]["input_token_logprobs"][1:]])

    def score_against_transformers(self, seq: list[int]) -> torch.Tensor:
        t0 = time.perf_counter()
        got = self.score(seq)
        ids = torch.tensor([seq], device=self.device)
        with torch.no_grad():
            logits = self.hf(ids).logits.float()[0, :-1]
        want = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
        self.step("score", t0, max_abs_vs_hf=float((got - want.cpu()).abs().max()))
        return got

    def sync(self, seq: list[int], before: torch.Tensor) -> None:
        """The checkpoint's own tensors (per-expert names, as the engine loaded them) as flattened
        buckets of 64 through CUDA IPC (CPU: shared memory), twice; the scores must not move."""
        from safetensors.torch import load_file
        from sglang.srt.utils.common import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        files = sorted(Path(self.folder).glob("*.safetensors"))
        named = [kv for f in files for kv in load_file(f, device=self.device).items()]
        total = sum(t.numel() * t.element_size() for _, t in named)
        sessions = callable(getattr(self.engine, "begin_weight_update", None))  # SGLang >= 0.5.21
        for name in ("sync_first", "sync"):
            t0 = time.perf_counter()
            if sessions:
                self.engine.begin_weight_update()
            for lo in range(0, len(named), 64):
                bucket = FlattenedTensorBucket(named_tensors=named[lo : lo + 64])
                payload = {
                    "flattened_tensor": bucket.get_flattened_tensor(),
                    "metadata": bucket.get_metadata(),
                }
                self.engine.update_weights_from_tensor(
                    [MultiprocessingSerializer.serialize(payload, output_str=True)],
                    load_format="flattened_bucket",
                    flush_cache=False,
                )
            if sessions:
                self.engine.end_weight_update()
            self.engine.flush_cache()
            if self.device == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            self.step(
                name, t0, bytes=total, tensors=len(named), gb_per_s=float(f"{total / seconds / 1e9:.4g}")
            )
        self.out["resync_max_abs"] = float((self.score(seq) - before).abs().max())
        change = self.out["resync_max_abs"]
        print(f"[probe] score after re-sending the same weights: max |change| {change:.1e}", flush=True)

    def memory(self) -> None:
        for name in ("release", "resume"):
            t0 = time.perf_counter()
            getattr(self.engine, f"{name}_memory_occupation")()
            self.step(name, t0)

    def shutdown(self) -> None:
        if self.engine is not None:
            t0 = time.perf_counter()
            self.engine.shutdown()
            self.step("shutdown", t0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    from grpo_megatron.rollout.sglang import compat

    compat.install()
    with tempfile.TemporaryDirectory(prefix="sglang_probe_") as folder:
        probe = Probe(args, folder)
        probe.write_model()
        try:
            probe.start()
            seq = probe.generate()
            probe.sync(seq, probe.score_against_transformers(seq))
            probe.memory()
        finally:
            probe.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
