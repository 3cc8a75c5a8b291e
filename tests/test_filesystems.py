"""paramserver.filesystems: plain paths, file:// and s3:// URLs to one Location; missing extras and bad
options refused with the URL named."""

import os

import pytest

from paramserver.filesystems import MissingStorageExtra, locate, parse_storage_options


def test_a_plain_path_is_made_absolute_and_file_urls_are_local(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    relative = locate("ckpt/run")
    assert relative.is_local and relative.path == str(tmp_path / "ckpt" / "run") == relative.url
    assert locate(f"file://{tmp_path}/x").path == str(tmp_path / "x")
    assert locate(relative) is relative


def test_join_parent_and_files_on_a_local_location(tmp_path):
    root = locate(tmp_path)
    root.fs.makedirs(root.join("a").path, exist_ok=True)
    with root.join("a", "b.txt").open("wb") as file:
        file.write(b"x")
    assert root.join("a", "b.txt").exists()
    assert root.join("a", "b.txt").parent().path == str(tmp_path / "a")
    assert root.join("a", "b.txt").name == "b.txt"


def test_an_s3_url_reaches_the_store_through_the_environment(s3):
    location = locate(f"s3://{s3.bucket}/prefix")
    assert not location.is_local and location.path == f"{s3.bucket}/prefix"
    with location.join("part-0").open("wb") as file:
        file.write(b"bytes")
    assert locate(f"s3://{s3.bucket}/prefix/part-0").open().read() == b"bytes"
    assert location.join("part-0").url == f"s3://{s3.bucket}/prefix/part-0"


def test_storage_options_are_json_objects():
    assert parse_storage_options(None) == {} and parse_storage_options('{"anon": true}') == {"anon": True}
    with pytest.raises(ValueError, match="--storage-options must be a JSON object"):
        parse_storage_options("[1]")
    with pytest.raises(ValueError, match="--storage-options must be a JSON object"):
        parse_storage_options("{anon")


def test_unknown_protocols_empty_names_and_missing_extras_are_named():
    with pytest.raises(ValueError, match="nope://b/x: unknown storage protocol 'nope'"):
        locate("nope://b/x")
    with pytest.raises(ValueError, match="empty path"):
        locate("")
    # A protocol whose package is surely absent: fsspec knows it, its implementation is not installed.
    with pytest.raises(MissingStorageExtra, match=r"oci://bucket/x: the oci:// protocol needs a package"):
        locate("oci://bucket/x")
