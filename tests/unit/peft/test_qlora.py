"""peft=qlora's knobs: the bitsandbytes config it loads with (the CPU gets device_map cpu), and
a CPU run without bitsandbytes is refused with the package to install. Training, saving,
resuming and the estimate on CPU: tests/cpu_kernels/test_qlora.py."""

from __future__ import annotations

import types

import torch

from memlab import _guards
from memlab.config import Platform
from memlab.peft.qlora import QLora


def _ctx(device: str, platform: Platform):
    return types.SimpleNamespace(is_cuda=device == "cuda", platform=platform, device=device)


def test_cpu_loads_on_the_cpu_and_cuda_as_before():
    q = QLora(compute_dtype="float32")
    cpu = q.load_kwargs(_ctx("cpu", Platform()))
    assert cpu["device_map"] == {"": "cpu"}
    cfg = cpu["quantization_config"]
    assert cfg.load_in_4bit and cfg.bnb_4bit_quant_type == "nf4"
    assert cfg.bnb_4bit_compute_dtype == torch.float32 and cfg.bnb_4bit_use_double_quant
    cuda = q.load_kwargs(_ctx("cuda", Platform.cuda_machine()))
    assert "device_map" not in cuda
    assert QLora(bits=8).load_kwargs(_ctx("cpu", Platform()))["quantization_config"].load_in_8bit


def test_without_bitsandbytes_the_error_names_the_package(monkeypatch):
    monkeypatch.setattr(_guards, "has", lambda m: False)
    errs = QLora().validate(_ctx("cpu", Platform()))
    assert len(errs) == 1 and "pip install bitsandbytes" in errs[0] and "peft=lora" in errs[0]
    assert QLora().validate(_ctx("cpu", Platform(assume_installed=frozenset({"bitsandbytes"})))
                            ) == []
    errs = QLora().validate(_ctx("cuda", Platform(cuda=True)))
    assert len(errs) == 1 and "pip install 'memlab[gpu]'" in errs[0]
