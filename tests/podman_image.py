"""The SpecSplit image built as deploy/container/build.sh builds it, in a podman of its own (a
storage root, run root and network directory under one temporary folder, so everything it made
goes with that folder), for tests/test_kubernetes.py.

No registry is reachable here: the base is Debian bookworm with python3, made by mmdebstrap and
`podman import`ed (the tarball is kept under ~/.cache/specsplit/containers); the third-party
wheels are kept there too, keyed by the dependencies, the Python and pip's configuration; the
project's wheel is built from the working tree every time.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("SPECSPLIT_CACHE_DIR") or "~/.cache/specsplit").expanduser() / "containers"
BASE_TAG = "localhost/specsplit-test-base:bookworm"
SOURCE = ("pyproject.toml", "README.md", "LICENSE", "specsplit", "brokers", "schemas")
# podman as measured on this kind of machine (../shared/CONTAINERS.md): runc, lowered ulimits;
# every directory of its own (the state in tmp_dir is per podman: one shared with the machine's
# podman would let this one's cleanup lose the other's containers)
CONF = """[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
tmp_dir = "{root}/tmp"
static_dir = "{root}/storage/libpod"
volume_path = "{root}/storage/volumes"
[network]
network_config_dir = "{root}/net"
"""


def missing_tools() -> str | None:
    """Why the image cannot be built here (None: it can)."""
    for tool in ("podman", "runc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (ops/test.sh installs podman and runc with apt as root)"
    if not base_tarball().is_file() and shutil.which("mmdebstrap") is None:
        return "no base image and no mmdebstrap to make one (ops/test.sh installs it)"
    return None


@dataclass
class Podman:
    """podman on a storage of its own under ``root``; ``cmd`` is the argv prefix."""

    root: Path
    cmd: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        (self.root / "net").mkdir(parents=True, exist_ok=True)
        conf = self.root / "containers.conf"
        conf.write_text(CONF.format(root=self.root))
        os.environ["CONTAINERS_CONF"] = str(conf)  # read by every podman below (and podman_play)
        self.cmd = ["podman", "--root", str(self.root / "storage"), "--runroot", str(self.root / "run")]

    def __call__(self, *args: str, timeout: float = 300, check: bool = True, **kw) -> subprocess.CompletedProcess:
        res = subprocess.run([*self.cmd, *args], capture_output=True, text=True, timeout=timeout, check=False, **kw)
        if check and res.returncode:
            raise RuntimeError(f"podman {' '.join(args[:3])} failed ({res.returncode}):\n{res.stderr[-3000:]}")
        return res

    def reset(self) -> None:
        """Remove everything this podman made: pods, containers, images, volumes, secrets, networks."""
        try:
            for args in (("pod", "rm", "--all", "--force", "--time", "5"), ("rm", "--all", "--force", "--time", "5"),
                         ("rmi", "--all", "--force"), ("volume", "rm", "--all", "--force"),
                         ("network", "prune", "--force")):
                self(*args, check=False, timeout=300)
            for name in self("secret", "ls", "--format", "{{.Name}}", check=False).stdout.split():
                self("secret", "rm", name, check=False)
        finally:
            os.environ.pop("CONTAINERS_CONF", None)
            subprocess.run(["umount", "-R", str(self.root / "storage" / "overlay")], capture_output=True, timeout=60,
                           check=False)
            shutil.rmtree(self.root, ignore_errors=True)


def base_tarball() -> Path:
    return CACHE / "debian-bookworm-python3.tar"


def base_image(podman: Podman) -> str:
    """``BASE_TAG``: Debian bookworm minbase with python3 (3.11, the torch wheel's ABI)."""
    tar = base_tarball()
    if not tar.is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = tar.with_name(f"{tar.stem}.partial.tar")  # mmdebstrap picks its format by the suffix
        subprocess.run(["mmdebstrap", "--variant=minbase", "--include=python3",
                        "--aptopt=Acquire::Check-Valid-Until \"false\"", "bookworm", str(tmp)],
                       check=True, capture_output=True, timeout=900)
        tmp.rename(tar)
    podman("import", "--quiet", "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           str(tar), BASE_TAG, timeout=300)
    return BASE_TAG


def _dependencies() -> list[str]:
    import tomllib

    return sorted(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]) + ["pip"]


def third_party_wheels() -> Path:
    """Wheels of every dependency (and pip), as this machine's pip resolves them; kept."""
    deps = _dependencies()
    pip_conf = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                              timeout=60, check=False).stdout
    key = hashlib.sha256("\n".join([*deps, sys.version, sys.platform, pip_conf]).encode()).hexdigest()[:16]
    out = CACHE / f"wheels-{key}"
    if not out.is_dir():
        tmp = Path(f"{out}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check",
                        "--wheel-dir", str(tmp), *deps], check=True, capture_output=True, timeout=900)
        sha256sums(tmp)
        tmp.rename(out)
    return out


def sha256sums(folder: Path) -> None:
    """``folder``/SHA256SUMS of its wheels, as deploy/container/build.sh writes it (`sha256sum`)."""
    lines = []
    for whl in sorted(folder.glob("*.whl")):
        digest = hashlib.sha256()
        with open(whl, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        lines.append(f"{digest.hexdigest()}  {whl.name}\n")
    tmp = folder / f".SHA256SUMS.{os.getpid()}"  # whole or absent: another run may read the kept folder
    tmp.write_text("".join(lines))
    os.replace(tmp, folder / "SHA256SUMS")


def project_wheel(dest: Path, marker: str | None = None) -> None:
    """The project's wheel from the working tree into ``dest`` (emptied first), with its
    SHA256SUMS; ``marker``: a line appended to specsplit/__init__.py first (a code change)."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    source = dest.parent / "source"  # what setuptools reads, copied: no build/ left over from earlier builds
    shutil.rmtree(source, ignore_errors=True)
    source.mkdir()
    for name in SOURCE:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, source / name)
    if marker:
        with open(source / "specsplit" / "__init__.py", "a") as f:
            f.write(f"\n{marker}\n")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--disable-pip-version-check",
                    "--no-build-isolation", "--wheel-dir", str(dest), str(source)],
                   check=True, capture_output=True, timeout=600)
    shutil.rmtree(source)
    sha256sums(dest)


def build_context(dest: Path, marker: str | None = None) -> Path:
    """The build context deploy/container/build.sh would send: build/wheels (the dependencies,
    with their SHA256SUMS: computed once, kept with them), build/project (the project's wheel from
    the working tree; ``marker``: see project_wheel) and deploy/container."""
    kept = third_party_wheels()
    if not (kept / "SHA256SUMS").is_file():  # kept by an earlier version of this file
        sha256sums(kept)
    wheels = dest / "build" / "wheels"
    wheels.mkdir(parents=True)
    for f in [*kept.glob("*.whl"), kept / "SHA256SUMS"]:
        os.link(f, wheels / f.name)
    project_wheel(dest / "build" / "project", marker)
    shutil.copytree(REPO / "deploy" / "container", dest / "deploy" / "container")
    return dest


@dataclass(frozen=True)
class Built:
    tag: str
    build_s: float
    size_bytes: int


def build_image(podman: Podman, context: Path, tag: str) -> Built:
    base = base_image(podman)
    t0 = time.monotonic()
    podman("build", "--quiet", "--build-arg", f"BASE={base}", "-f", str(REPO / "Containerfile"), "-t", tag,
           str(context), timeout=900)
    build_s = time.monotonic() - t0
    size = int(podman("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip())
    return Built(tag, build_s, size)


def layer_files(podman: Podman, tag: str):
    """(layer index, path, size, first 64 KiB of a small regular file or b"") of every entry in
    every layer of ``tag``, base layer first. With overlay storage (this podman's) each layer is a
    directory of the files it adds (a deletion: a whiteout device), read in place; otherwise the
    layers are streamed from `podman save` (docker-archive: one tar per layer), which tars every
    byte of the image for this."""
    driver = json.loads(podman("image", "inspect", "--format", "{{json .GraphDriver}}", tag).stdout)
    data = driver.get("Data") or {}
    if driver.get("Name") != "overlay" or not data.get("UpperDir"):
        yield from _saved_layer_files(podman, tag)
        return
    lower = [d for d in (data.get("LowerDir") or "").split(":") if d]  # the topmost lower layer first
    for index, diff in enumerate([*reversed(lower), data["UpperDir"]]):
        for folder, dirs, files in os.walk(diff):
            for name in dirs + files:
                path = os.path.join(folder, name)
                st = os.lstat(path)
                head = b""
                if stat.S_ISREG(st.st_mode) and st.st_size <= 1 << 20:
                    with open(path, "rb") as f:
                        head = f.read(1 << 16)
                yield index, os.path.relpath(path, diff), st.st_size if stat.S_ISREG(st.st_mode) else 0, head


def _saved_layer_files(podman: Podman, tag: str):
    proc = subprocess.Popen([*podman.cmd, "save", "--format", "docker-archive", tag], stdout=subprocess.PIPE)
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as outer:
            index = 0
            for member in outer:
                if not (member.isreg() and member.name.endswith(".tar")):  # a link: a layer listed twice
                    continue
                with tarfile.open(fileobj=outer.extractfile(member), mode="r|") as layer:
                    for f in layer:
                        head = b""
                        if f.isreg() and f.size <= 1 << 20:
                            head = layer.extractfile(f).read(1 << 16)
                        yield index, f.name, f.size, head
                index += 1
    finally:
        proc.stdout.close()
        if proc.wait(timeout=120):
            raise RuntimeError(f"podman save {tag} failed ({proc.returncode})")
