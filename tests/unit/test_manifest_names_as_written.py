"""A manifest line's name is read exactly as sha256sum wrote it.

``sha256sum`` writes ``<digest>  <name>`` (text mode) or ``<digest> *<name>``
(binary mode) and keeps the name's own spaces. A name that begins or ends with a space
is not a name distcache accepts, and it must be refused, not read as the file without
the space: ``<digest>   x`` lists the file `` x``, and reading it as ``x`` would fetch
and verify another file under the digest of this one.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from distcache.artifact import parse_checksums, read_manifest
from distcache.errors import ArtifactNameError, ManifestError

SHA = "ab" * 32


@pytest.mark.parametrize(("line", "name"), [
    (f"{SHA}   x", " x"),
    (f"{SHA}  x ", "x "),
    (f"{SHA} * x", " x"),
    (f"{SHA}  *x", "*x"),
    (f"{SHA}    dir/x", "  dir/x"),
    (f"{SHA}  dir/x\t", "dir/x\t"),
])
def test_a_name_with_its_own_spaces_is_refused_not_read_as_another(line: str,
                                                                   name: str) -> None:
    with pytest.raises(ArtifactNameError) as caught:
        parse_checksums(f"{SHA}  ok\n{line}\n", source="m.txt")
    assert caught.value.line == 2
    assert caught.value.name == name
    assert caught.value.message.startswith("m.txt:2: ")


@pytest.mark.parametrize("line", [f"{SHA}  x", f"{SHA} *x", f"{SHA} x", f"{SHA}\tx",
                                  f"{SHA}\t*x", f"  {SHA}  x", f"{SHA}  x\r",
                                  f"{SHA.upper()}  x"])
def test_the_separators_sha256sum_and_editors_write_still_read(line: str) -> None:
    assert [(a.name, a.sha256) for a in parse_checksums(line)] == [("x", SHA)]


@pytest.mark.parametrize("line", [f"{SHA}  ", f"{SHA} *", f"{SHA}\u3000x", f"{SHA}x  y",
                                  f"{SHA[:-1]}  x", f"{SHA}"])
def test_a_line_without_both_fields_is_a_manifest_error(line: str) -> None:
    with pytest.raises(ManifestError) as caught:
        parse_checksums(line)
    assert caught.value.line == 1


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="no sha256sum on PATH")
@pytest.mark.parametrize("mode", ["--text", "--binary"])
def test_what_sha256sum_writes_reads_back_or_is_refused(tmp_path: Path, mode: str) -> None:
    for name, data in (("plain.cubin", b"1"), ("a b.cubin", b"2"), ("x", b"3"),
                       (" x", b"4"), ("x ", b"5")):
        (tmp_path / name).write_bytes(data)
    listed = {}
    for name in ("plain.cubin", "a b.cubin", "x"):
        out = subprocess.run(["sha256sum", mode, name], cwd=tmp_path, check=True,
                             capture_output=True, text=True).stdout
        listed[name] = out
    manifest = tmp_path / "m.txt"
    manifest.write_text("".join(listed.values()))
    read = {a.name: a.sha256 for a in read_manifest(manifest)}
    assert read == {name: line[:64] for name, line in listed.items()}
    for spaced in (" x", "x "):
        line = subprocess.run(["sha256sum", mode, spaced], cwd=tmp_path, check=True,
                              capture_output=True, text=True).stdout
        manifest.write_text(listed["x"] + line)
        with pytest.raises(ArtifactNameError) as caught:
            read_manifest(manifest)
        assert caught.value.name == spaced and caught.value.line == 2
