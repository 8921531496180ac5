"""The GPU payload's parts that run without a GPU (``scripts/gpu_payload.py``).

* The fat-binary cut, on fat binaries this test lays out itself (in an ELF64
  file it writes), against what it put there: per fat binary the sm_90
  cubins in their order, else the newest PTX for an older architecture, else
  everything; sizes rewritten, the rest of each body zeroed, every other byte
  of the file the same. And on a shared library nvcc builds for sm_75, sm_90
  and compute_80 PTX: only the sm_90 cubin is left.
* The manifest: a payload whose archive, recipe, format or manifest is off is
  refused in one line that names the fix; a good one unpacks, once, and is
  reused from the unpacked copy when the payload itself did not travel; the
  uncut compiled ops replace the cut ones only when their hashes hold.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_payload.py"


@pytest.fixture(scope="module")
def payload_module():
    spec = importlib.util.spec_from_file_location("gpu_payload", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_payload"] = module
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- fat binaries


def entry(kind: int, arch: int, payload: bytes) -> bytes:
    """One fat-binary entry: a 64-byte header (kind, version, header size,
    payload size, ..., arch at byte 28), then the payload."""
    header = bytearray(64)
    struct.pack_into("<HHIQ", header, 0, kind, 0x0101, 64, len(payload))
    struct.pack_into("<I", header, 28, arch)
    struct.pack_into("<Q", header, 40, 0x11)
    return bytes(header) + payload


def fat_binary(entries: list[bytes]) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def elf_with_section(name: str, contents: bytes, rng: random.Random) -> tuple[bytes, int]:
    """A minimal ELF64: a .text section of random bytes, ``name`` holding
    ``contents``, and the section names; returns the file and the section's
    offset."""
    text = bytes(rng.randrange(256) for _ in range(200))
    names = b"\0.text\0" + name.encode() + b"\0.shstrtab\0"
    text_at = 64
    section_at = text_at + len(text) + (-len(text) % 8)
    names_at = section_at + len(contents)
    headers_at = names_at + len(names) + (-len(names) % 8)
    out = bytearray(headers_at + 4 * 64)
    out[:4] = b"\x7fELF"
    out[4], out[5], out[6] = 2, 1, 1
    struct.pack_into("<Q", out, 0x28, headers_at)
    struct.pack_into("<HHH", out, 0x3A, 64, 4, 3)
    out[text_at:text_at + len(text)] = text
    out[section_at:section_at + len(contents)] = contents
    out[names_at:names_at + len(names)] = names
    for index, (name_offset, offset, size) in enumerate(
        [(0, 0, 0), (1, text_at, len(text)), (7, section_at, len(contents)),
         (8 + len(name), names_at, len(names))]
    ):
        struct.pack_into("<IIQQQQ", out, headers_at + index * 64, name_offset, 1, 0, 0, offset, size)
    return bytes(out), section_at


def test_cut_keeps_the_hopper_code_of_each_fat_binary(payload_module):
    rng = random.Random()

    def blob() -> bytes:
        return bytes(rng.randrange(256) for _ in range(rng.choice([16, 40, 96])))

    ELF, PTX = 2, 1
    # (entries, the indices the cut must keep)
    layouts = [
        ([(ELF, 75), (ELF, 90), (PTX, 80), (ELF, 90), (ELF, 100)], [1, 3]),  # sm_90 cubins, in order
        ([(ELF, 80), (PTX, 75), (PTX, 86), (PTX, 100)], [2]),  # no sm_90 cubin: the newest older PTX
        ([(ELF, 100), (ELF, 120)], [0, 1]),  # nothing Hopper runs: left whole
        ([(PTX, 90), (ELF, 90)], [1]),  # a cubin wins over PTX
    ]
    fats, kept = [], []
    for kinds, keep in layouts:
        entries = [entry(kind, arch, blob()) for kind, arch in kinds]
        fats.append(fat_binary(entries))
        kept.append([entries[i] for i in keep])
    padded = [f + bytes(-len(f) % 8) for f in fats]
    section = b"".join(p + bytes(8) for p in padded)  # zero padding between fat binaries, as nvcc lays them out
    original, section_at = elf_with_section(".nv_fatbin", section, rng)

    data = bytearray(original)
    stats = payload_module.cut_fat_binaries(data, 90)

    assert len(data) == len(original)
    assert stats["fat_binaries"] == 4 and stats["without_code_for_arch"] == 1
    assert stats["kept"] == sum(len(k) for k in kept)
    at = section_at
    changed = bytearray(len(original))
    for fat, pad, keep in zip(fats, padded, kept):
        body = b"".join(keep)
        assert struct.unpack_from("<Q", data, at + 8)[0] == len(body)
        assert data[at + 16:at + 16 + len(body)] == body
        assert not any(data[at + 16 + len(body):at + len(fat)])
        changed[at + 8:at + len(fat)] = b"\1" * (len(fat) - 8)
        at += len(pad) + 8
    # Every byte outside the fat binaries' size fields and bodies is the same.
    assert all(a == b for a, b, c in zip(data, original, changed) if not c)
    # The cut file parses back to the kept entries alone.
    parsed = payload_module.fat_binaries(data, *payload_module.elf_section(data, ".nv_fatbin"))
    assert [[(e.kind, e.arch) for e in fat.entries] for fat in parsed] == [
        [layout[0][i] for i in layout[1]] for layout in layouts
    ]


def test_cut_refuses_a_malformed_fat_binary(payload_module):
    bad = fat_binary([entry(2, 90, b"x" * 32)])
    bad = bad[:16] + struct.pack("<H", 7) + bad[18:]  # an entry kind that is neither PTX nor ELF
    data, _ = elf_with_section(".nv_fatbin", bad + bytes(-len(bad) % 8), random.Random(0))
    with pytest.raises(SystemExit, match="malformed fat-binary entry"):
        payload_module.cut_fat_binaries(bytearray(data), 90)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build a real fat binary")
def test_cut_of_a_library_nvcc_built(payload_module, tmp_path):
    source = tmp_path / "k.cu"
    source.write_text("__global__ void scale(float *x, float a) { x[threadIdx.x] *= a; }\n"
                      "extern \"C\" void launch(float *x) { scale<<<1, 32>>>(x, 2.0f); }\n")
    library = tmp_path / "libk.so"
    subprocess.run(["nvcc", "-shared", "-Xcompiler", "-fPIC", "-o", str(library), str(source),
                    "-gencode", "arch=compute_75,code=sm_75", "-gencode", "arch=compute_90,code=sm_90",
                    "-gencode", "arch=compute_80,code=compute_80"], check=True, capture_output=True)
    data = bytearray(library.read_bytes())
    section = payload_module.elf_section(data, ".nv_fatbin")
    before = [[(e.kind, e.arch) for e in fat.entries] for fat in payload_module.fat_binaries(data, *section)]
    # Ours (the kernel above) and the CUDA runtime's, each with an sm_90 cubin.
    assert [(1, 80), (2, 75), (2, 90)] in [sorted(entries) for entries in before]
    assert all((2, 90) in entries for entries in before)
    payload_module.cut_fat_binaries(data, 90)
    after = [[(e.kind, e.arch) for e in fat.entries] for fat in payload_module.fat_binaries(data, *section)]
    assert after == [[(2, 90)]] * len(before)
    assert payload_module.elf_section(data, ".nv_fatbin") == section


# --------------------------------------------------------------------------- manifest, unpack


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT)


def make_payload(module, folder: Path, files: dict[str, bytes]) -> dict:
    """A payload of ``files`` (under site/), with this checkout's recipe."""
    stage = folder / "stage"
    for name, data in files.items():
        (stage / "site" / name).parent.mkdir(parents=True, exist_ok=True)
        (stage / "site" / name).write_bytes(data)
    archive = folder / "payload.tar.xz"
    subprocess.run(["tar", "-C", str(stage), "-cJf", str(archive), "site"], check=True)
    shutil.rmtree(stage)
    spec = module.recipe(module.PYTHON_VERSION, module.GLIBC, False, module.image_packages(None))
    manifest = {"format": module.FORMAT, "recipe_sha256": module.recipe_key(spec), "recipe": spec,
                "archive": archive.name, "sha256": module.sha256_file(archive), "bytes": archive.stat().st_size,
                "unpacked_bytes": sum(map(len, files.values())), "built": "2026-11-27T00:00Z", "revision": "test"}
    (folder / "MANIFEST.json").write_text(json.dumps(manifest))
    return manifest


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_unpack_checks_the_manifest_and_names_the_fix(payload_module, tmp_path):
    contents = {"vllm/__init__.py": b"__version__ = '0.32.0'\n", "vllm/_C_stable_libtorch.abi3.so": random.randbytes(999)}
    payload, dest = tmp_path / "payload", tmp_path / "dest"
    payload.mkdir()
    manifest = make_payload(payload_module, payload, contents)

    missing = one_line_error(run_script("unpack", str(dest), "--payload", str(tmp_path / "nowhere")))
    assert "no GPU payload" in missing and "gpu_payload.py build" in missing

    good = run_script("unpack", str(dest), "--payload", str(payload))
    assert good.returncode == 0, good.stderr
    for name, data in contents.items():
        assert (dest / "site" / name).read_bytes() == data
    again = run_script("unpack", str(dest), "--payload", str(payload))
    assert again.returncode == 0 and "unpacked there already" in again.stdout

    archive = payload / "payload.tar.xz"
    intact = archive.read_bytes()
    archive.write_bytes(intact[:-1] + bytes([intact[-1] ^ 1]))
    corrupt = one_line_error(run_script("unpack", str(tmp_path / "d2"), "--payload", str(payload)))
    assert "differs from MANIFEST.json" in corrupt
    archive.write_bytes(intact)

    stale = {**manifest, "recipe_sha256": "0" * 64, "recipe": {**manifest["recipe"], "vllm": "0.31.0"}}
    (payload / "MANIFEST.json").write_text(json.dumps(stale))
    line = one_line_error(run_script("unpack", str(tmp_path / "d3"), "--payload", str(payload)))
    assert "stale" in line and "vllm" in line and "gpu_payload.py build" in line

    (payload / "MANIFEST.json").write_text(json.dumps({**manifest, "format": payload_module.FORMAT - 1}))
    assert "format" in one_line_error(run_script("unpack", str(tmp_path / "d4"), "--payload", str(payload)))


def test_uncut_ops_replace_the_cut_ones_after_a_first_run(payload_module, tmp_path):
    """The fallback: a first run unpacks the payload, a second one brings
    only the uncut ops (the payload does not travel again)."""
    payload, dest, original = tmp_path / "payload", tmp_path / "dest", tmp_path / "original"
    payload.mkdir()
    original.mkdir()
    path = payload_module.CUT[0]
    make_payload(payload_module, payload, {path: b"cut"})
    assert run_script("unpack", str(dest), "--payload", str(payload)).returncode == 0

    uncut = random.randbytes(5000)
    packed = original / "ops.xz"
    packed.write_bytes(subprocess.run(["xz", "-c"], input=uncut, capture_output=True, check=True).stdout)
    manifest = {"format": payload_module.FORMAT, "vllm": payload_module.VLLM_VERSION, "path": path,
                "archive": packed.name, "sha256": payload_module.sha256_file(packed), "bytes": packed.stat().st_size,
                "unpacked_sha256": hashlib.sha256(uncut).hexdigest()}
    (original / "MANIFEST.json").write_text(json.dumps(manifest))

    nowhere = str(tmp_path / "not-carried")
    (original / "MANIFEST.json").write_text(json.dumps({**manifest, "unpacked_sha256": "0" * 64}))
    assert "does not unpack" in one_line_error(
        run_script("unpack", str(dest), "--payload", nowhere, "--original-c", str(original)))
    assert (dest / "site" / path).read_bytes() == b"cut"
    (original / "MANIFEST.json").write_text(json.dumps({**manifest, "vllm": "0.31.0"}))
    assert "rebuild" in one_line_error(
        run_script("unpack", str(dest), "--payload", nowhere, "--original-c", str(original)))

    (original / "MANIFEST.json").write_text(json.dumps(manifest))
    result = run_script("unpack", str(dest), "--payload", nowhere, "--original-c", str(original))
    assert result.returncode == 0, result.stderr
    assert "unpacked there before" in result.stdout
    assert (dest / "site" / path).read_bytes() == uncut
