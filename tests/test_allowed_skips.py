"""The list of allowed skips: what it lets through and what it does not."""

from __future__ import annotations

from pathlib import Path

from tests.allowed_skips import ALLOWED_SKIPS, unlisted

ROOT = Path(__file__).resolve().parents[1]


def test_every_entry_names_an_existing_test_and_says_why() -> None:
    for entry in ALLOWED_SKIPS:
        path, _, name = entry.nodeid.partition("::")
        source = (ROOT / path).read_text()
        assert f"def {name.rstrip('*').split('[')[0]}(" in source, entry
        assert len(entry.why) > 30 and entry.reason, entry


def test_only_listed_reasons_pass() -> None:
    vnni = "tests/engine/test_gemm_i8.py::test_int8_prefill_is_close_to_the_plain_prefill"
    assert unlisted([(vnni, "no AVX512-VNNI: the talker keeps ggml's GEMM")]) == []
    # the same test skipping for another reason, or another test with the same reason, is not
    assert unlisted([(vnni, "libqtts_ops not built")]) == [(vnni, "libqtts_ops not built")]
    other = ("tests/engine/test_custom_ops.py::test_snake", "no AVX512-VNNI")
    assert unlisted([other]) == [other]
    isa = "tests/engine/test_custom_ops.py::test_other_isa_paths[avx2]"
    assert unlisted([(isa, "needs cc on x86-64")]) == []
