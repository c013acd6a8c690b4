"""Thumbnails as files in one folder (worker.imaging.thumbnails.ThumbnailFolder, THUMBNAIL_DIR)."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from common.contracts import thumbnail_key
from common.settings import Settings
from worker.imaging.thumbnails import ThumbnailFolder, ThumbnailRefused, thumbnail_path, thumbnail_store

UUID = "0c6f1d9a-8a51-4b0e-9d3e-2f3f1c2b4a5d"


async def test_a_thumbnail_is_the_file_named_by_its_key_and_reads_back(tmp_path: Path) -> None:
    folder = ThumbnailFolder(tmp_path / "thumbs")
    await folder.put(UUID, b"first")
    await folder.put(UUID, b"second")  # a retried task overwrites its own
    assert (tmp_path / "thumbs" / f"{UUID}.jpg").read_bytes() == b"second"
    assert await folder.get(UUID) == b"second"
    assert await folder.get("no-such-thumbnail") is None
    assert os.listdir(tmp_path / "thumbs") == [f"{UUID}.jpg"]  # no temporary file left
    folder.discard([UUID, "no-such-thumbnail"])
    assert os.listdir(tmp_path / "thumbs") == []


async def test_a_reader_never_sees_half_a_thumbnail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bytes go to a temporary name in the same folder; the thumbnail's name appears only
    with the rename, whole. A write that fails leaves neither."""
    folder = ThumbnailFolder(tmp_path)
    seen: list[list[str]] = []
    real_replace = os.replace

    def replace(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
        seen.append(sorted(os.listdir(tmp_path)))
        assert Path(source).parent == Path(target).parent == tmp_path  # a rename within the folder
        assert Path(source).read_bytes() == b"x" * 100_000
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", replace)
    await folder.put(UUID, b"x" * 100_000)
    assert len(seen) == 1 and len(seen[0]) == 1 and seen[0][0].endswith(".tmp") and seen[0][0].startswith(".")
    assert await folder.get(UUID) == b"x" * 100_000

    def full(descriptor: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError) as raised:  # the whole store: waited out by the task (not a refusal)
        await folder.put("other", b"y")
    assert not isinstance(raised.value, ThumbnailRefused)
    assert os.listdir(tmp_path) == [f"{UUID}.jpg"]


@pytest.mark.parametrize("identifier", [
    "../../etc/passwd", "..", ".", "/abs/path", "a/../../b", "..\\..\\windows", "nul\x00byte", "%2e%2e%2f",
    "!2F..!2F", "caf\u00e9/\u2215\u2044", "", ".jpg", "x" * 80,
])
async def test_a_hostile_identifier_stays_in_the_folder(tmp_path: Path, identifier: str) -> None:
    inside = tmp_path / "thumbs"
    folder = ThumbnailFolder(inside)
    path = thumbnail_path(inside, identifier)
    assert path.parent == inside and path.name == thumbnail_key(identifier) and path.name.endswith(".jpg")
    await folder.put(identifier, b"jpeg")
    assert await folder.get(identifier) == b"jpeg"
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == [path]  # nothing anywhere else
    folder.discard([identifier])
    assert not path.exists()


async def test_distinct_identifiers_never_share_a_file(tmp_path: Path) -> None:
    folder = ThumbnailFolder(tmp_path)
    identifiers = ["a/b", "a!2Fb", "a%2Fb", "a_b", "A/B"]
    for n, identifier in enumerate(identifiers):
        await folder.put(identifier, bytes([n]))
    assert [await folder.get(identifier) for identifier in identifiers] == [bytes([n]) for n in range(5)]


async def test_a_name_too_long_for_the_file_system_is_that_urls_refusal(tmp_path: Path) -> None:
    folder = ThumbnailFolder(tmp_path)
    with pytest.raises(ThumbnailRefused, match="ENAMETOOLONG"):
        await folder.put("\u00e9" * 200, b"jpeg")  # 1,200 characters once escaped
    assert os.listdir(tmp_path) == []


async def test_the_setting_picks_the_folder(tmp_path: Path) -> None:
    settings = Settings.from_env({"THUMBNAIL_DIR": str(tmp_path / "t")})
    assert settings.thumbnail_dir == str(tmp_path / "t")
    assert Settings.from_env({}).thumbnail_dir is None  # the default: S3_BUCKET
    async with thumbnail_store(settings) as store:
        assert isinstance(store, ThumbnailFolder)
        await store.put(UUID, b"jpeg")
    assert (tmp_path / "t" / f"{UUID}.jpg").read_bytes() == b"jpeg"
