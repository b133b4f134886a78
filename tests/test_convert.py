"""grpo-megatron convert: HF -> megatron (EP2, 2 ranks) -> HF (TP2, 2 ranks) is bit-exact, key for
key, and loads with transformers; bad input fails naming the path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_megatron.commands.convert import ConvertError, hf_to_mcore, mcore_to_hf, parse
from tests.helpers.dist import REPO_ROOT
from tests.helpers.runs import cli
from tests.helpers.weights import read_tensors


def _save_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3} | {c: i + 4 for i, c in enumerate("0123456789+=")}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(directory)


@pytest.mark.launches
def test_hf_to_mcore_at_ep2_then_back_at_tp2_is_exact(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from tests.workers.bridge_workers import save_tiny_model

    src, mcore, hf_out = tmp_path / "src", tmp_path / "mcore", tmp_path / "hf"
    save_tiny_model("qwen3_moe", src)
    _save_tokenizer(src)

    to_mcore = cli(["convert", "hf-to-mcore", "--hf", str(src), "--out", str(mcore), "--ep", "2"], 2)
    assert to_mcore.returncode == 0, to_mcore.stdout[-2000:] + to_mcore.stderr[-4000:]
    assert (mcore / "grpo_checkpoint.json").is_file() and (mcore / "config.json").is_file()
    assert (mcore / "tokenizer.json").is_file()
    assert not list(tmp_path.glob("*.tmp-*")), "temporary directories left behind"

    to_hf = cli(["convert", "mcore-to-hf", "--ckpt", str(mcore), "--out", str(hf_out), "--tp", "2"], 2)
    assert to_hf.returncode == 0, to_hf.stdout[-2000:] + to_hf.stderr[-4000:]

    expected, got = read_tensors(src), read_tensors(hf_out)
    assert sorted(got) == sorted(expected)
    different = [
        k for k in expected if got[k].dtype != expected[k].dtype or not torch.equal(got[k], expected[k])
    ]
    assert not different, different[:5]
    assert (hf_out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    model = AutoModelForCausalLM.from_pretrained(hf_out, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tokens = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():  # the same class, default kernels and bit-equal weights: bit-equal logits
        assert torch.equal(model(tokens).logits, reference(tokens).logits)


def test_bad_input_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    with pytest.raises(ConvertError, match=f"--hf {missing}: no such directory"):
        hf_to_mcore(parse(["hf-to-mcore", "--hf", str(missing), "--out", str(tmp_path / "o")]))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConvertError, match=f"--hf {empty}: no config.json"):
        hf_to_mcore(parse(["hf-to-mcore", "--hf", str(empty), "--out", str(tmp_path / "o")]))
    with pytest.raises(ConvertError, match=f"--ckpt {missing}: no such directory"):
        mcore_to_hf(parse(["mcore-to-hf", "--ckpt", str(missing), "--out", str(tmp_path / "o")]))
    with pytest.raises(ConvertError, match=f"{empty} has no grpo_checkpoint.json"):
        mcore_to_hf(parse(["mcore-to-hf", "--ckpt", str(empty), "--out", str(tmp_path / "o")]))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    (empty / "config.json").write_text("{}")
    with pytest.raises(ConvertError, match="--out .*full exists and is not empty"):
        hf_to_mcore(parse(["hf-to-mcore", "--hf", str(empty), "--out", str(tmp_path / "full")]))


def test_cli_help_lists_convert_and_stays_light() -> None:
    script = (
        "import sys; from grpo_megatron.cli import build_parser; build_parser(); "
        "assert 'torch' not in sys.modules and 'megatron' not in sys.modules, 'heavy import'"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    from grpo_megatron.cli import build_parser

    args = build_parser().parse_args(["convert", "mcore-to-hf", "--ckpt", "c", "--out", "o", "--tp", "2"])
    assert (args.direction, args.tp, args.hf_config) == ("mcore-to-hf", 2, None)
