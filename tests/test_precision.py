"""engine/precision.py: bf16/fp16 autocast on a CPU without native bf16 warns once."""

from __future__ import annotations

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
