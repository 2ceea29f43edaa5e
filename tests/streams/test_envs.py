"""Environment flags: one parser for every boolean, read when used, errors that name the variable."""

from __future__ import annotations

import pytest

from sglang_lite import envs


@pytest.mark.parametrize(
    "raw,value",
    [
        ("true", True),
        ("1", True),
        ("YES", True),
        ("False", False),
        ("0", False),
        ("no", False),
        ("", False),
    ],
)
def test_boolean_words(monkeypatch, raw, value):
    monkeypatch.setenv("SGLANG_ALT_STREAM", raw)
    assert envs.SGLANG_ALT_STREAM.get() is value


def test_unset_gives_default_and_none_means_platform_default(monkeypatch):
    monkeypatch.delenv("SGLANG_QK_NORM_ALT_STREAM", raising=False)
    monkeypatch.delenv("SGLANG_GDN_QKVZ_BA_ALT_STREAM", raising=False)
    assert envs.SGLANG_QK_NORM_ALT_STREAM.get() is None
    assert envs.SGLANG_GDN_QKVZ_BA_ALT_STREAM.get() is False


def test_read_at_use_not_at_import(monkeypatch):
    monkeypatch.setenv("SGLANG_GDN_QKVZ_BA_ALT_STREAM", "yes")
    assert envs.SGLANG_GDN_QKVZ_BA_ALT_STREAM.get() is True
    monkeypatch.setenv("SGLANG_GDN_QKVZ_BA_ALT_STREAM", "no")
    assert envs.SGLANG_GDN_QKVZ_BA_ALT_STREAM.get() is False


@pytest.mark.parametrize(
    "flag", [envs.SGLANG_ALT_STREAM, envs.SGLANG_QK_NORM_ALT_STREAM, envs.SGLANG_ALT_STREAM_EAGER]
)
def test_bad_boolean_names_the_variable(monkeypatch, flag):
    monkeypatch.setenv(flag.name, "maybe")
    with pytest.raises(ValueError, match=f"{flag.name}='maybe' is not a boolean"):
        flag.get()


def test_int_and_choice(monkeypatch):
    monkeypatch.setenv("SGLANG_GDN_ALT_STREAM_MAX_TOKENS", "12")
    assert envs.SGLANG_GDN_ALT_STREAM_MAX_TOKENS.get() == 12
    monkeypatch.setenv("SGLANG_GDN_ALT_STREAM_MAX_TOKENS", "lots")
    with pytest.raises(
        ValueError, match="SGLANG_GDN_ALT_STREAM_MAX_TOKENS='lots' is not an integer"
    ):
        envs.SGLANG_GDN_ALT_STREAM_MAX_TOKENS.get()
    monkeypatch.setenv("SGLANG_KERNEL_BACKEND", "cuda")
    with pytest.raises(ValueError, match="SGLANG_KERNEL_BACKEND='cuda' must be one of"):
        envs.SGLANG_KERNEL_BACKEND.get()
