"""The settings tables of README.md and docs/service.md are the settings' own definitions."""

from __future__ import annotations

from pathlib import Path

import pytest

from service import settings_doc
from service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def test_tables_match_the_settings(capsys: pytest.CaptureFixture[str]) -> None:
    assert settings_doc.main(["--check"]) == 0, capsys.readouterr().err
    for rel in settings_doc.DOCS:
        text = (ROOT / rel).read_text(encoding="utf-8")
        for name in Settings.model_fields:
            assert f"| `QTTS_{name.upper()}` |" in text, (rel, name)


def test_check_fails_on_a_drifted_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    for rel in settings_doc.DOCS:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        text = (ROOT / rel).read_text(encoding="utf-8")
        (tmp_path / rel).write_text(text.replace("| `QTTS_QUEUE_SIZE` | `8` |",
                                                 "| `QTTS_QUEUE_SIZE` | `9` |"), encoding="utf-8")
    monkeypatch.setattr(settings_doc, "ROOT", tmp_path)
    assert settings_doc.main(["--check"]) == 1
    assert "README.md, docs/service.md" in capsys.readouterr().err
    assert settings_doc.main([]) == 0  # rewrites both
    assert settings_doc.main(["--check"]) == 0
    assert (tmp_path / "README.md").read_text(encoding="utf-8") == \
        (ROOT / "README.md").read_text(encoding="utf-8")


def test_missing_markers_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# no table\n", encoding="utf-8")
    (tmp_path / "docs" / "service.md").write_text("# none\n", encoding="utf-8")
    monkeypatch.setattr(settings_doc, "ROOT", tmp_path)
    assert settings_doc.main(["--check"]) == 2
    assert "README.md: the settings-table markers are missing" in capsys.readouterr().err
