import pytest

from lightllm.common.autotuner import (
    AutotuneKernelType,
    autotune_warmup,
    current_warmup_kernel_type,
    is_autotune_warmup,
    is_tuning,
)

GENERAL = AutotuneKernelType.GENERAL
DECODE = AutotuneKernelType.DECODE_ATTENTION


def test_scopes_nest_and_restore():
    assert current_warmup_kernel_type() is None and not is_autotune_warmup()
    with autotune_warmup(GENERAL):
        assert current_warmup_kernel_type() is GENERAL and is_autotune_warmup()
        with autotune_warmup(DECODE):
            assert current_warmup_kernel_type() is DECODE
            with autotune_warmup(GENERAL):
                assert current_warmup_kernel_type() is GENERAL
            assert current_warmup_kernel_type() is DECODE
        assert current_warmup_kernel_type() is GENERAL
    assert current_warmup_kernel_type() is None and not is_autotune_warmup()


def test_scope_restores_outer_phase_on_exception():
    with autotune_warmup(GENERAL):
        with pytest.raises(ZeroDivisionError):
            with autotune_warmup(DECODE):
                1 / 0
        assert current_warmup_kernel_type() is GENERAL
    assert current_warmup_kernel_type() is None


def test_scope_rejects_non_kernel_type():
    with pytest.raises(TypeError, match="AutotuneKernelType"):
        with autotune_warmup("decode_attention"):
            pass
    assert current_warmup_kernel_type() is None


@pytest.mark.parametrize(
    "level, phase, expected",
    [("0", DECODE, False), ("1", DECODE, True), ("2", DECODE, True), ("3", DECODE, False), ("1", GENERAL, False)],
)
def test_is_tuning_only_in_own_scope_at_searching_levels(monkeypatch, level, phase, expected):
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", level)
    assert not is_tuning(DECODE)
    with autotune_warmup(phase):
        assert is_tuning(DECODE) == expected
        assert is_tuning(GENERAL) == (phase is GENERAL and level in ("1", "2"))
