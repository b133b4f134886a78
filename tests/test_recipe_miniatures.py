"""Every recipe in examples/recipes/ trained end to end in miniature on 2 CPU processes.

Each test runs the recipe's own YAML with only sizes changed on the command line:
- the model: a tiny config of the recipe's ``model_type`` (tests/helpers/tiny_configs.py) with a
  byte-level BPE tokenizer trained offline on the miniature's own prompts, in a directory the test
  writes (``model.hf_path``), randomly initialised;
- the layout: the recipe's kinds of parallelism at 2 processes (``parallel.tp`` / ``parallel.ep``);
- the sizes: a few prompts and samples, a short ``rollout.max_new_tokens``, one reward worker.
The recipe's own data path runs first: its ``tools/prepare_*.py`` on a sample in the dataset's real
format (tests/data/: MATH's per-problem JSON files, DAPO-Math-17k rows written as Parquet, and
generated Countdown-Tasks-3to4 Parquet rows). Then 2 GRPO iterations with the recipe's reward,
algorithm and checkpoint settings, and (one recipe per model kind and layout) a resume that continues
to iteration 3 from the checkpoint.

What cannot run on CPU is swapped, and only that: ``rollout.engine=embedded`` (SGLang needs a GPU),
with it ``rollout.weight_dtype=model`` (FP8 engines are SGLang's), and ``logging.wandb_mode=disabled``
(no wandb service process on 2 shared cores).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from grpo_megatron.logging_utils.metrics import read_jsonl
from tests.helpers.dist import REPO_ROOT
from tests.helpers.runs import finish, launch
from tests.helpers.tiny_configs import tiny_hf_config

RECIPES = REPO_ROOT / "examples" / "recipes"
DATA = REPO_ROOT / "tests" / "data"

# Sizes only; the recipe's algorithm, reward and checkpoint sections stay as published.
SIZES = [
    "train.iterations=2",
    "train.prompts_per_iteration=2",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=8",
    "reward.num_workers=1",
    "rollout.engine=embedded",
    "rollout.weight_dtype=model",
    "logging.wandb_mode=disabled",
    "logging.progress_bar=false",
    "parallel.timeout_minutes=3",
]


def _tool(*args: str | Path) -> None:
    result = subprocess.run(
        [sys.executable, *map(str, args)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"{args}: {result.stdout}\n{result.stderr}"


def prepare_r1_zero(tmp: Path) -> list[str]:
    """The recipe's data line: MATH's train split, levels 3-5."""
    out = tmp / "math_l3to5.jsonl"
    _tool(
        "tools/prepare_math.py", "--input", DATA / "MATH" / "train", "--levels", "3", "4", "5", "--out", out
    )
    return [f"data.train_path={out}"]


def prepare_countdown(tmp: Path) -> list[str]:
    """Countdown-Tasks-3to4 as downloaded: Parquet with ``target`` and ``nums`` (3-4 numbers)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    nums = [[rng.randint(1, 99) for _ in range(rng.choice((3, 4)))] for _ in range(12)]
    targets = [rng.randint(1, 100) for _ in nums]
    src = tmp / "countdown.parquet"
    pq.write_table(pa.table({"target": targets, "nums": nums}), src)
    train, test = tmp / "countdown_train.jsonl", tmp / "countdown_test.jsonl"
    _tool("tools/prepare_countdown.py", "--input", src, "--out", train, "--eval-out", test, "--num-eval", "2")
    return [f"data.train_path={train}", f"data.eval_path={test}"]


def prepare_dapo(tmp: Path) -> list[str]:
    """DAPO-Math-17k as downloaded: Parquet rows with chat-message prompts and reward_model.ground_truth."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (DATA / "dapo_math_17k_sample.jsonl").read_text().splitlines()]
    src = tmp / "dapo-math-17k.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    out = tmp / "dapo_math_17k.jsonl"
    _tool("tools/prepare_math.py", "--input", src, "--out", out)
    return [f"data.train_path={out}"]


def prepare_math_any_level(tmp: Path) -> list[str]:
    """The DeepSeek-V3 recipe's data line: any local MATH-style files into math_train.jsonl."""
    out = tmp / "math_train.jsonl"
    _tool("tools/prepare_math.py", "--input", DATA / "MATH" / "train", "--out", out)
    return [f"data.train_path={out}"]


@dataclass(frozen=True)
class Miniature:
    recipe: str
    prepare: Callable[[Path], list[str]]
    layout: tuple[str, ...]
    """The recipe's kinds of parallelism at world size 2."""
    sizes: tuple[str, ...] = ()
    """Sizes this recipe needs beyond ``SIZES`` (e.g. enough samples for its mini-batch count)."""
    resumes: bool = True
    """Whether the test also resumes it to iteration 3. Off where another miniature resumes the same
    model kind and layout (a job start each, on a suite kept under 45 minutes)."""
    teacher: bool = False
    """A distillation recipe: a tiny teacher of its ``distill.teacher_path``'s ``model_type`` (random
    weights saved by transformers, the student's tokenizer) stands in for the teacher."""


MINIATURES = [
    Miniature("r1_zero_qwen25_math_7b", prepare_r1_zero, ("parallel.tp=2",)),
    Miniature(
        "countdown_qwen25_3b", prepare_countdown, ("parallel.tp=2",), resumes=False
    ),  # r1_zero's resume
    # 16 updates per iteration (DAPO's, R1-Zero's mini-batches): 4 prompts x 4 samples, one per update
    # DAPO's overlong buffer and the 10-iteration warm-up shrink with the lengths and the run.
    Miniature(  # resumed by its LoRA twin below (the same model and layout, adapters added)
        "qwen3_30b_a3b",
        prepare_dapo,
        ("parallel.tp=2", "parallel.ep=2"),
        ("train.prompts_per_iteration=4", "algorithm.overlong.buffer_len=2", "train.lr_warmup_iterations=1"),
        resumes=False,
    ),
    # The LoRA recipe: the same DAPO settings, adapters on attention and every expert (TP2 x EP2 here).
    Miniature(
        "qwen3_30b_a3b_lora",
        prepare_dapo,
        ("parallel.tp=2", "parallel.ep=2"),
        ("train.prompts_per_iteration=4", "algorithm.overlong.buffer_len=2", "train.lr_warmup_iterations=1"),
    ),
    # On-policy distillation: a dense Qwen3 student at TP2 learns from a Qwen3-MoE teacher built at its
    # layout (every expert split over the 2 TP ranks); the 10-iteration warm-up shrinks with the run.
    Miniature(
        "distill_qwen3_30b_a3b_to_8b",
        prepare_dapo,
        ("parallel.tp=2",),
        ("train.lr_warmup_iterations=1",),
        resumes=False,  # r1_zero resumes a dense model at TP2
        teacher=True,
    ),
    Miniature(
        "deepseek_v3_671b",
        prepare_math_any_level,
        ("parallel.tp=2", "parallel.ep=2"),
        ("train.prompts_per_iteration=4",),
    ),
]


def test_every_recipe_has_a_miniature() -> None:
    assert {m.recipe for m in MINIATURES} == {p.stem for p in RECIPES.glob("*.yaml")}


def tiny_model_dir(recipe: dict, recipe_dir: Path, prompt_files: list[Path], out: Path) -> Path:
    """A tiny config of the recipe model's ``model_type`` and a byte-level BPE tokenizer trained on
    the prepared prompts (wrapped in the recipe's template), so that prompts stay within the recipe's
    ``data.max_prompt_tokens`` as a real subword tokenizer keeps them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    model_type = json.loads((recipe_dir / "config.json").read_text())["model_type"]
    template = recipe["data"].get("template") or "{prompt}"
    texts = []
    for path in prompt_files:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            texts += [template.format(prompt=row["prompt"]), str(row["answer"])]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    special = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2: the tiny configs' pad, bos and eos
    trainer = trainers.BpeTrainer(
        vocab_size=640, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(texts * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    out.mkdir(parents=True)
    tokenizer.save_pretrained(out)
    config = tiny_hf_config(model_type, vocab_size=len(tokenizer), max_position_embeddings=4096)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def tiny_teacher_dir(recipe: dict, student_dir: Path, out: Path) -> Path:
    """A tiny model of the recipe's teacher's ``model_type``, random weights saved by transformers,
    with the student's tokenizer (a distillation teacher must share it)."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    teacher_config = RECIPES / recipe["distill"]["teacher_path"] / "config.json"
    model_type = json.loads(teacher_config.read_text())["model_type"]
    student = json.loads((student_dir / "config.json").read_text())
    config = tiny_hf_config(model_type, vocab_size=student["vocab_size"], max_position_embeddings=4096)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    model.save_pretrained(out, safe_serialization=True)
    for path in student_dir.iterdir():
        if path.name.startswith("tokenizer") or path.name == "special_tokens_map.json":
            shutil.copy(path, out / path.name)
    return out


def _leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    """``{"section.key": value}`` of every leaf of a YAML mapping; a list of mappings (reward
    components) is indexed, ``reward.components.0.name``."""
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            value = dict(enumerate(value))
        if isinstance(value, dict) and value:
            out |= _leaves(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def assert_only_overrides_changed(recipe: dict, resolved: dict, overrides: list[str]) -> None:
    """Every setting the recipe writes is in the run's resolved config, except the overridden ones."""
    overridden = {o.split("=", 1)[0] for o in overrides}
    got = _leaves(resolved)
    changed = {
        key: (want, got.get(key))
        for key, want in _leaves(recipe).items()
        if key not in overridden and got.get(key) != want
    }
    assert not changed, f"recipe settings not kept (recipe, run): {changed}"


@pytest.mark.launches
@pytest.mark.parametrize("mini", MINIATURES, ids=lambda m: m.recipe)
def test_recipe_miniature_trains_and_resumes(mini: Miniature, tmp_path: Path) -> None:
    recipe_path = RECIPES / f"{mini.recipe}.yaml"
    recipe = yaml.safe_load(recipe_path.read_text())
    data = mini.prepare(tmp_path)
    prompt_files = [Path(d.split("=", 1)[1]) for d in data]
    model = tiny_model_dir(recipe, RECIPES / mini.recipe, prompt_files, tmp_path / "model")
    run = tmp_path / "run"
    overrides = [*SIZES, *mini.sizes, *mini.layout, *data, f"model.hf_path={model}", f"logging.run_dir={run}"]
    if mini.teacher:
        overrides.append(f"distill.teacher_path={tiny_teacher_dir(recipe, model, tmp_path / 'teacher')}")

    out = finish(launch("train", overrides, config=recipe_path), timeout_s=600)
    records = read_jsonl(run / "metrics.jsonl")
    assert [r["iteration"] for r in records if r["iteration"] > 0] == [1, 2], out[-3000:]
    assert_only_overrides_changed(recipe, yaml.safe_load((run / "config.yaml").read_text()), overrides)
    for component in recipe["reward"]["components"]:  # the recipe's reward scored every iteration
        assert all(f"reward/{component['name']}" in r for r in records if r["iteration"] > 0), component
    if mini.teacher:  # the teacher scored every iteration's samples
        trained = [r for r in records if r["iteration"] > 0]
        assert all(r["distill/reverse_kl"] is not None and r["time/teacher_logprob"] > 0 for r in trained)
    latest = run / "checkpoints" / "latest"
    assert latest.read_text().strip().endswith("2"), "the last iteration is always saved"
    if not mini.resumes:
        return

    # Resume: the same command asked for one more iteration continues from the checkpoint.
    resume = [o for o in overrides if not o.startswith("train.iterations=")]
    out = finish(
        launch("train", [*resume, "train.iterations=3", "checkpoint.resume=auto"], config=recipe_path)
    )
    records = read_jsonl(run / "metrics.jsonl")
    assert [r["iteration"] for r in records if r["iteration"] > 0] == [1, 2, 3], out[-3000:]
    assert latest.read_text().strip().endswith("3")
