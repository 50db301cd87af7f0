"""engine/precision.py: bf16/fp16 autocast on a CPU without native bf16 warns once."""

from __future__ import annotations

import pytest
import torch

from ironloop.engine import precision
from ironloop.engine.precision import cpu_has_native_bf16, resolve_precision

X86_OLD = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 avx512f avx512bw\n"
X86_BF16 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def test_native_bf16_is_read_from_the_cpu_flags():
    assert not cpu_has_native_bf16(X86_OLD)  # AVX512 alone is not bf16 arithmetic
    assert cpu_has_native_bf16(X86_BF16) and cpu_has_native_bf16(ARM_BF16)


def test_explicit_bf16_on_an_emulating_cpu_warns_once(monkeypatch, capsys):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    precision._warn_emulated.cache_clear()
    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu) == "fp32"
    assert resolve_precision("bf16", cpu) == "bf16"  # honoured, with a warning
    resolve_precision("bf16", cpu)
    err = capsys.readouterr().err
    assert err.count("warning: train.precision=bf16") == 1 and "fp32" in err
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    precision._warn_emulated.cache_clear()
    resolve_precision("bf16", cpu)
    assert capsys.readouterr().err == ""
    resolve_precision("fp16", cpu)  # fp16 is emulated on any CPU
    err = capsys.readouterr().err
    assert "warning: train.precision=fp16 on a CPU" in err and "use train.precision=fp32" in err
    resolve_precision("fp16", torch.device("meta"))  # not a CPU: no word
    assert capsys.readouterr().err == ""


def test_the_device_name_resolves_to_what_this_machine_has(monkeypatch):
    from ironloop.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert precision.resolve_device("auto") == torch.device("cpu")
    assert precision.resolve_device("cpu", 3) == torch.device("cpu")
    # the whole message: what is wrong and the settings that fix it
    with pytest.raises(ConfigError) as cuda:
        precision.resolve_device("cuda")
    assert str(cuda.value) == ("run.device='cuda' but torch sees no CUDA device; use "
                               "run.device=cpu or auto, or install a CUDA build of torch")
    with pytest.raises(ConfigError) as mps:
        precision.resolve_device("mps")
    assert str(mps.value) == "run.device='mps' but MPS is not available; use run.device=cpu or auto"
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert precision.resolve_device("auto") == torch.device("mps")
    assert precision.resolve_device("mps") == torch.device("mps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert precision.resolve_device("auto", 2) == torch.device("cuda", 2)
    assert precision.resolve_device("cuda", 1) == torch.device("cuda", 1)


def test_auto_precision_is_bf16_only_on_a_cuda_device_that_supports_it(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert resolve_precision("auto", cuda) == "bf16"
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert resolve_precision("auto", cuda) == "fp32"
    assert resolve_precision("fp16", cuda) == "fp16"


def test_a_worker_rank_does_not_repeat_the_emulation_warning(monkeypatch, capsys):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    precision._warn_emulated.cache_clear()
    resolve_precision("bf16", torch.device("cpu"), is_main=False)
    assert capsys.readouterr().err == ""


def test_autocast_and_loss_scaling_follow_the_precision():
    cpu = torch.device("cpu")
    with precision.autocast("bf16", cpu):
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    with precision.autocast("fp16", cpu):
        assert torch.get_autocast_dtype("cpu") == torch.float16
    with precision.autocast("fp32", cpu):
        assert not torch.is_autocast_enabled("cpu")
    assert precision.grad_scaler("bf16", cpu) is None and precision.grad_scaler("fp32", cpu) is None
    assert isinstance(precision.grad_scaler("fp16", cpu), torch.amp.GradScaler)


def test_without_proc_cpuinfo_only_apple_silicon_has_native_bf16(monkeypatch):
    from pathlib import Path

    def missing(self, *a, **k):
        raise OSError("no /proc")

    monkeypatch.setattr(Path, "read_text", missing)
    monkeypatch.setattr(precision, "_machine", lambda: "arm64")
    monkeypatch.setattr(precision.sys, "platform", "darwin")
    assert cpu_has_native_bf16() is True
    monkeypatch.setattr(precision, "_machine", lambda: "x86_64")
    assert cpu_has_native_bf16() is False
    monkeypatch.setattr(precision, "_machine", lambda: "arm64")
    monkeypatch.setattr(precision.sys, "platform", "linux")
    assert cpu_has_native_bf16() is False


def test_the_cpu_flags_are_read_from_proc_cpuinfo_even_with_bytes_that_are_not_utf8(
        tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_bytes(b"model name\t: Xeon \xff\xfe\nflags\t\t: fpu avx512_bf16\n")
    real = precision.Path
    monkeypatch.setattr(precision, "Path", lambda p: real(cpuinfo) if p == "/proc/cpuinfo"
                        else real(p))
    assert cpu_has_native_bf16() is True
    cpuinfo.write_bytes(b"flags\t\t: fpu avx2 \xff\n")
    assert cpu_has_native_bf16() is False
    # no /proc (macOS): Apple silicon has bf16
    monkeypatch.setattr(precision, "Path", lambda p: real(tmp_path / "none"))
    monkeypatch.setattr(precision.sys, "platform", "darwin")
    monkeypatch.setattr(precision, "_machine", lambda: "arm64")
    assert cpu_has_native_bf16() is True
    monkeypatch.setattr(precision, "_machine", lambda: "x86_64")
    assert cpu_has_native_bf16() is False
    monkeypatch.setattr(precision.sys, "platform", "win32")
    monkeypatch.setattr(precision, "_machine", lambda: "arm64")
    assert cpu_has_native_bf16() is False
