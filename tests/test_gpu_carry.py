"""The GPU carry (tools/build_gpu_carry.py): its list resolves against the lock, and a manifest is
checked against the list and the size bound a device call can carry."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("build_gpu_carry", REPO / "tools" / "build_gpu_carry.py")
carry = importlib.util.module_from_spec(spec)
spec.loader.exec_module(carry)


def test_the_list_resolves_against_the_lock_and_pins_what_the_gpu_machine_needs():
    pins = carry.resolve(carry.read_pins(carry.LIST), carry.read_pins(carry.LOCK))
    lock = carry.read_pins(carry.LOCK)
    # The newest SGLang built for the GPU machine's torch 2.11 (GUIDE section 10), and its kernels.
    assert pins["sglang"] == "0.5.17" and pins["sglang-kernel"] == "0.4.5"
    for name in ("megatron-core", "transformers", "math-verify"):
        assert pins[name] == lock[name], name  # the project's own dependencies follow the lock


@pytest.mark.launches
def test_check_passes_on_this_checkout():
    out = subprocess.run(
        [sys.executable, str(REPO / "tools" / "build_gpu_carry.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def manifest(size: int, **dists: str) -> str:
    return f"# gpu-carry.tar.xz: {size} bytes, sha256 0\n" + "".join(f"{n}=={v}\n" for n, v in dists.items())


def test_manifest_problems_name_the_pin_the_stranger_and_the_size():
    pins = {"sglang": "0.5.17", "sniffio": "1.3.1"}
    assert carry.check_manifest(manifest(10, sglang="0.5.17", sniffio="1.3.1"), pins) == []
    problems = carry.check_manifest(manifest(61 * 2**20, sglang="0.5.23", extra_pkg="1.0"), pins)
    assert any("61.0 MiB, over 60 MiB" in p for p in problems)
    assert "sglang==0.5.17 listed, the carry has 0.5.23" in problems
    assert "sniffio==1.3.1 listed, the carry has none" in problems
    assert any(p.startswith("extra-pkg==1.0 in the carry but not in") for p in problems)


def test_a_bad_list_line_names_file_and_line(tmp_path):
    bad = tmp_path / "list.txt"
    bad.write_text("# comment\nsglang 0.5.17\n")
    with pytest.raises(SystemExit, match=r"list.txt:2: expected 'name==version'"):
        carry.read_pins(bad)


def test_a_lock_pin_the_lock_lacks_is_named():
    with pytest.raises(SystemExit, match="no-such-package==lock"):
        carry.resolve({"no-such-package": "lock"}, {})
