"""The GPU install path is the set the GPU check ran: requirements/gpu.txt equals the carry's list
(tools/gpu_carry.txt resolved against the lock, what bench/gpu_check.sh brings to the GPU machine),
pyproject's ``gpu`` extra pins the same versions, and the install page names them."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
GPU_REQUIREMENTS = REPO / "requirements" / "gpu.txt"
spec = importlib.util.spec_from_file_location("build_gpu_carry", REPO / "tools" / "build_gpu_carry.py")
assert spec is not None and spec.loader is not None
carry = importlib.util.module_from_spec(spec)
spec.loader.exec_module(carry)


def carry_pins() -> dict[str, str]:
    return carry.resolve(carry.read_pins(carry.LIST), carry.read_pins(carry.LOCK))


def test_gpu_requirements_are_the_carry_list_resolved() -> None:
    listed = carry.read_pins(GPU_REQUIREMENTS)
    pins = carry_pins()
    extra = sorted(f"{n}=={v}" for n, v in listed.items() if pins.get(n) != v)
    missing = sorted(f"{n}=={v}" for n, v in pins.items() if listed.get(n) != v)
    assert not extra and not missing, (
        f"requirements/gpu.txt differs from tools/gpu_carry.txt resolved against requirements.lock: "
        f"only in gpu.txt {extra}, only in the carry {missing}; write the carry's pins into gpu.txt"
    )


def test_the_gpu_extra_pins_what_ran() -> None:
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    pins = carry_pins()
    for requirement in extra:
        name, sep, version = requirement.partition("==")
        ran = pins.get(carry.normalise(name))
        assert sep, (
            f"pyproject's gpu extra: {requirement!r} must pin an exact version (==), as the GPU check ran"
        )
        assert ran == version, f"pyproject's gpu extra pins {requirement}, the GPU check ran {name}=={ran}"
    assert {carry.normalise(r.partition("==")[0]) for r in extra} >= {"sglang", "sglang-kernel"}


def test_the_install_page_names_the_versions_that_ran() -> None:
    page = (REPO / "docs" / "getting-started" / "gpu.md").read_text()
    pins = carry_pins()
    for name, shown in (
        ("sglang", "SGLang"),
        ("megatron-core", "megatron-core"),
        ("transformers", "transformers"),
    ):
        assert re.search(rf"{shown} {re.escape(pins[name])}\b", page), (
            f"docs/getting-started/gpu.md: {shown} {pins[name]}"
        )
    assert "pip install --no-deps -e . -r requirements/gpu.txt" in page
