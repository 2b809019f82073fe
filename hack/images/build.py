#!/usr/bin/env python3
"""Build the operator and node-agent OCI images without a container engine.

Recipe, per image:

1. a Debian bookworm root filesystem made by ``mmdebstrap --variant=minbase`` with Debian's
   ``python3`` (3.11), cached under ``build/images/cache/`` keyed by the package list and mirrors;
   documentation, man pages, locales, apt lists and logs are left out or removed (copyright files
   stay), which is the first layer (identical for both images);
2. the project's wheel and its pinned dependencies (``hack/images/requirements-<image>.txt``,
   exact versions and sha256 hashes, made by ``lock``) installed with ``pip --target`` into
   ``/usr/local/lib/python3.11/dist-packages``, byte-compiled by the image's own Python, console
   scripts in ``/usr/local/bin``; a non-root user ``rlenergy`` (65532); the second layer;
3. packed with ``umoci`` (layers, config: user, entry point, environment, OCI labels) into an OCI
   image layout and tarred into ``build/images/<image>.oci.tar`` (an ``oci-archive``).

Reproducible: every timestamp is ``SOURCE_DATE_EPOCH`` (default: the commit time of the last
commit that touched an input), file mtimes are clamped to it, byte-code is hash-based, the archive
tar is sorted with fixed owners. Cached: an image whose inputs (base key, wheel hash, lock file,
this script, settings) hash to the key stored beside its archive is not rebuilt. The agent image
does not ship libnvidia-ml: the NVIDIA container toolkit injects it on GPU nodes.

Usage: ``python hack/images/build.py build [operator|agent ...]`` (``make images``),
``python hack/images/build.py lock`` (``make images-lock``). Needs root, mmdebstrap, umoci.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from collections.abc import Iterable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
RECIPE_VERSION = "1"
"""Bump to invalidate every cached image and base after a change of recipe outside this file."""

SUITE = "bookworm"
MIRRORS = (
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
)
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
"""Debian's archive keys (package debian-archive-keyring; needed on non-Debian build hosts)."""
BASE_PACKAGES = ("python3", "tzdata")
"""Debian packages on top of minbase. No ca-certificates: in-cluster clients trust the service
account's ca.crt and requests/kubernetes use certifi's bundle."""
HOOK_DIR = "/usr/share/mmdebstrap/hooks/merged-usr"
"""mmdebstrap's merged-/usr hook: installs usr-is-merged, so apt never pulls in usrmerge, whose
perl dependencies (56 MB) a runtime image does not need."""
DPKG_EXCLUDES = (
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
    "path-exclude=/usr/share/lintian/*",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
)
SITE = "usr/local/lib/python3.11/dist-packages"
"""Where the wheels go: on the sys.path of Debian's python3, outside dpkg's own dist-packages."""
PY_TAGS = ("--python-version", "3.11", "--implementation", "cp")
ABIS = ("cp311", "abi3", "none")
GLIBC_MINOR = 36
"""bookworm's glibc is 2.36: only wheels for manylinux_2_36 and older run on it."""
NONROOT_UID = 65532
SOURCE_URL = "https://github.com/rl-energy/rl-energy-operator"
LICENSE = "Apache-2.0"
INPUT_PATHS = ("rlenergy", "operator", "agent", "pyproject.toml", "README.md", "hack/images")
"""What the image is made of: SOURCE_DATE_EPOCH and the revision label come from the last
commit that touched one of these, so an unrelated commit keeps the cached image."""
PRUNE = ("kubernetes/aio",)
"""Removed from the installed tree: kubernetes >= 36.0.1 ships a second, asyncio copy of the
client (68 MB installed with 37.0.2) that nothing imports; the operator and the agent use the
synchronous client."""
KUBERNETES_APIS = (
    "admissionregistration_v1_api",
    "apps_v1_api",
    "authentication_v1_api",
    "certificates_v1_api",
    "core_v1_api",
    "custom_objects_api",
)
"""The modules of ``kubernetes/client/api`` kept in the images: those of the API classes the
operator and the agent use (``AdmissionregistrationV1Api``, ``AppsV1Api``,
``AuthenticationV1Api``, ``CertificatesV1Api``, ``CoreV1Api``, ``CustomObjectsApi``). The client
(>= 37) imports an API module only when its class is first used, so the other 61 modules are
removed. ``tests/unit/test_image_prune.py`` fails when a component uses an API class not kept
here."""


@dataclasses.dataclass(frozen=True)
class Image:
    """One image: what it installs and how it starts."""

    key: str
    name: str
    extra: str
    entrypoint: tuple[str, ...]
    user: str
    title: str
    description: str
    ports: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    """Dependencies of the client libraries that this image never imports, left out: those of
    kubernetes' asyncio client (``PRUNE``), and in the agent those of aiohttp (only kopf, in the
    operator, uses it). The package's own dependencies are all imported (``pyproject.toml``)."""

    @property
    def lock_file(self) -> Path:
        """The pinned requirements (``lock``)."""
        return HERE / f"requirements-{self.key}.txt"


IMAGES = {
    "operator": Image(
        key="operator",
        name="rl-energy-operator",
        extra="operator",
        entrypoint=("/usr/local/bin/rlenergy-operator",),
        user=f"{NONROOT_UID}:{NONROOT_UID}",
        title="rl-energy operator",
        description="Kubernetes operator that cuts the GPU energy of RL post-training.",
        exclude=("aiohttp-retry",),
    ),
    "agent": Image(
        key="agent",
        name="rl-energy-agent",
        extra="agent",
        entrypoint=("/usr/local/bin/rlenergy-agent",),
        user="0:0",
        title="rl-energy node agent",
        description="rl-energy node agent: GPU clocks and energy through NVML. libnvidia-ml is "
        "not shipped: the NVIDIA container toolkit injects it on GPU nodes.",
        ports=("9464/tcp",),
        # aiohttp and its family: only kubernetes.aio (pruned) and kopf use them (multidict
        # stays: grpclib, the PodResources client, imports it).
        exclude=(
            "aiohttp-retry",
            "aiohttp",
            "aiohappyeyeballs",
            "aiosignal",
            "attrs",
            "frozenlist",
            "propcache",
            "yarl",
        ),
    ),
}


def log(msg: str) -> None:
    """Progress on stderr."""
    print(f"[images] {msg}", file=sys.stderr, flush=True)


def run(cmd: Sequence[str | Path], **kw: object) -> subprocess.CompletedProcess[str]:
    """Run a command, failing loudly."""
    return subprocess.run([str(c) for c in cmd], check=True, text=True, **kw)  # type: ignore[call-overload, no-any-return]


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def digest(*parts: object) -> str:
    """Hex sha256 of the JSON of ``parts``."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def project_version() -> str:
    """``project.version`` of pyproject.toml."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return str(tomllib.load(f)["project"]["version"])


def git(*args: str) -> str:
    """Output of a git command in the checkout ('' when git or the repo is missing)."""
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return ""
    return out.stdout.strip()


def source_date_epoch() -> int:
    """SOURCE_DATE_EPOCH, else the commit time of the last commit touching an input."""
    if os.environ.get("SOURCE_DATE_EPOCH"):
        return int(os.environ["SOURCE_DATE_EPOCH"])
    stamp = git("log", "-1", "--format=%ct", "--", *INPUT_PATHS)
    return int(stamp) if stamp else 0


def revision() -> str:
    """The last commit touching an input (the revision label)."""
    return git("log", "-1", "--format=%H", "--", *INPUT_PATHS) or "unknown"


def pip_env() -> dict[str, str]:
    """pip's environment: PyPI only (no machine-local find-links), no version nag."""
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_FIND_LINKS", "PIP_NO_INDEX")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def platform_args() -> list[str]:
    """pip flags selecting wheels that run on bookworm's CPython 3.11 (x86_64)."""
    args = ["--only-binary=:all:", *PY_TAGS]
    for abi in ABIS:
        args += ["--abi", abi]
    for minor in range(GLIBC_MINOR, 16, -1):
        args += ["--platform", f"manylinux_2_{minor}_x86_64"]
    for legacy in ("manylinux2014", "manylinux2010", "manylinux1"):
        args += ["--platform", f"{legacy}_x86_64"]
    return args


def build_wheel(dest: Path, sde: int) -> Path:
    """Build the project's wheel (hatchling honours SOURCE_DATE_EPOCH: same bytes each time)."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        env = pip_env() | {"SOURCE_DATE_EPOCH": str(sde)}
        run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp, str(ROOT)],
            env=env,
        )
        (wheel,) = Path(tmp).glob("*.whl")
        dest.mkdir(parents=True, exist_ok=True)
        for old in dest.glob("*.whl"):
            old.unlink()
        return Path(shutil.move(wheel, dest / wheel.name))


# ----- lock -------------------------------------------------------------------------------
def lock(images: Iterable[Image], work: Path) -> None:
    """Resolve each image's dependencies for bookworm and write name==version plus hashes."""
    wheel = build_wheel(work / "wheel", source_date_epoch())
    constraints = HERE / "constraints.txt"
    for image in images:
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "report.json"
            run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "install",
                    "-q",
                    "--dry-run",
                    "--ignore-installed",
                    "--report",
                    report,
                    "--target",
                    Path(tmp) / "t",
                    *platform_args(),
                    "-c",
                    constraints,
                    f"{wheel}[{image.extra}]",
                ],
                env=pip_env(),
            )
            data = json.loads(report.read_text())
        lines = [
            f"# Pinned dependencies of the {image.name} image (bookworm, CPython 3.11, x86_64).",
            "# Generated by `make images-lock` (hack/images/build.py lock): do not edit.",
            f"# Left out (never imported by the {image.key}): {', '.join(image.exclude)}.",
        ]
        for item in sorted(data["install"], key=lambda i: i["metadata"]["name"].lower()):
            name = item["metadata"]["name"]
            if name == "rl-energy-operator":
                continue
            if canonical(name) in {canonical(d) for d in image.exclude}:
                continue
            sha = item["download_info"]["archive_info"]["hashes"]["sha256"]
            lines.append(f"{canonical(name)}=={item['metadata']['version']} --hash=sha256:{sha}")
        image.lock_file.write_text("\n".join(lines) + "\n")
        log(f"wrote {image.lock_file.relative_to(ROOT)} ({len(lines) - 3} pins)")


def canonical(name: str) -> str:
    """PEP 503 normalised distribution name."""
    return name.lower().replace("_", "-").replace(".", "-")


# ----- base root filesystem ---------------------------------------------------------------
def base_key() -> str:
    """Cache key of the base root filesystem."""
    version = run(["mmdebstrap", "--version"], capture_output=True).stdout.strip()
    return digest(RECIPE_VERSION, SUITE, MIRRORS, BASE_PACKAGES, HOOK_DIR, DPKG_EXCLUDES, version)


def build_base(cache: Path, sde: int, *, force: bool) -> tuple[Path, str]:
    """The cached minbase tarball (built with mmdebstrap when missing)."""
    key = base_key()
    tar = cache / f"base-{key[:16]}.tar"
    if tar.exists() and not force:
        log(f"base root filesystem cached: {tar.relative_to(ROOT)}")
        return tar, key
    cache.mkdir(parents=True, exist_ok=True)
    for old in cache.glob("base-*.tar"):
        old.unlink()
    tmp = tar.with_suffix(".tmp.tar")
    start = time.monotonic()
    log(f"mmdebstrap --variant=minbase {SUITE} + {' '.join(BASE_PACKAGES)}")
    run(
        [
            "mmdebstrap",
            "--mode=root",
            "--variant=minbase",
            "--format=tar",
            "--quiet",
            "--architectures=amd64",
            f"--include={','.join(BASE_PACKAGES)}",
            *[f"--dpkgopt={o}" for o in DPKG_EXCLUDES],
            '--aptopt=Acquire::Retries "3"',
            *([f"--keyring={KEYRING}"] if Path(KEYRING).exists() else []),
            f"--hook-dir={HOOK_DIR}",
            SUITE,
            tmp,
            *MIRRORS,
        ],
        env=os.environ | {"SOURCE_DATE_EPOCH": str(sde)},
    )
    tmp.replace(tar)
    log(f"base built in {time.monotonic() - start:.0f} s")
    return tar, key


def slim(rootfs: Path) -> None:
    """Remove what a runtime image never uses and what differs between builds."""
    for rel in ("var/lib/apt/lists", "var/cache/apt", "var/cache/debconf", "var/log"):
        d = rootfs / rel
        if d.is_dir():
            for child in d.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
    for rel in ("var/cache/ldconfig/aux-cache", "etc/machine-id", "var/lib/dbus/machine-id"):
        p = rootfs / rel
        if p.is_file():
            p.unlink()
    for doc in (rootfs / "usr/share/doc").glob("*"):
        if doc.is_dir() and not doc.is_symlink():
            for f in doc.rglob("*"):
                if f.is_file() and f.name != "copyright":
                    f.unlink()
    (rootfs / "etc/machine-id").write_text("")
    # Python's own byte-code of files the image never changes is fine; caches of pip are not.
    for p in rootfs.glob("root/.cache"):
        shutil.rmtree(p)


def clamp_mtimes(rootfs: Path, sde: int) -> None:
    """Set every mtime newer than ``sde`` to ``sde`` (tar --clamp-mtime), symlinks included."""
    for dirpath, dirnames, filenames in os.walk(rootfs):
        for name in (*dirnames, *filenames):
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if st.st_mtime > sde:
                os.utime(p, (sde, sde), follow_symlinks=False)
    if os.lstat(rootfs).st_mtime > sde:
        os.utime(rootfs, (sde, sde))


# ----- application layer ------------------------------------------------------------------
def install_app(rootfs: Path, image: Image, wheel: Path, sde: int) -> None:
    """pip --target the pinned dependencies and the wheel; console scripts; users."""
    site = rootfs / SITE
    site.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text(
            image.lock_file.read_text()
            + f"rl-energy-operator @ {wheel.as_uri()} --hash=sha256:{sha256_file(wheel)}\n"
        )
        target = Path(tmp) / "site"
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--no-compile",
                "--require-hashes",
                "--target",
                target,
                *platform_args(),
                "-r",
                req,
            ],
            env=pip_env() | {"SOURCE_DATE_EPOCH": str(sde)},
        )
        bindir = rootfs / "usr/local/bin"
        bindir.mkdir(parents=True, exist_ok=True)
        for script in sorted((target / "bin").iterdir()):
            lines = script.read_text().splitlines(keepends=True)
            if lines and lines[0].startswith("#!"):
                lines[0] = "#!/usr/bin/python3\n"
            out = bindir / script.name
            out.write_text("".join(lines))
            out.chmod(0o755)
        shutil.rmtree(target / "bin")
        for item in sorted(target.iterdir()):
            shutil.move(item, site / item.name)
    for rel in PRUNE:
        if (site / rel).exists():
            shutil.rmtree(site / rel)
    for module in sorted((site / "kubernetes/client/api").glob("*_api.py")):
        if module.stem not in KUBERNETES_APIS:
            module.unlink()
    # direct_url.json records the build folder's path: not part of a reproducible image.
    for p in site.glob("*.dist-info/direct_url.json"):
        p.unlink()
    # Hash-based byte-code by the image's own interpreter (no mtimes in the .pyc files).
    run(
        [
            "chroot",
            rootfs,
            "/usr/bin/python3",
            "-m",
            "compileall",
            "-q",
            "-j",
            "1",
            "--invalidation-mode",
            "unchecked-hash",
            f"/{SITE}",
        ],
        env={
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
            "SOURCE_DATE_EPOCH": str(sde),
            "LC_ALL": "C.UTF-8",
        },
    )
    days = sde // 86400
    uid = NONROOT_UID
    with open(rootfs / "etc/passwd", "a") as f:
        f.write(f"rlenergy:x:{uid}:{uid}:rl-energy:/nonexistent:/usr/sbin/nologin\n")
    with open(rootfs / "etc/group", "a") as f:
        f.write(f"rlenergy:x:{uid}:\n")
    with open(rootfs / "etc/shadow", "a") as f:
        f.write(f"rlenergy:!:{days}::::::\n")
    for rel in ("var/lib/rlenergy", "var/run/rlenergy"):
        (rootfs / rel).mkdir(parents=True, exist_ok=True)
    if image.key == "operator":
        os.chown(rootfs / "var/lib/rlenergy", uid, uid)


def du_bytes(path: Path) -> int:
    """Apparent size of a tree: regular files' bytes (hard links once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total


def iso(sde: int) -> str:
    """RFC 3339 UTC time of an epoch."""
    return dt.datetime.fromtimestamp(sde, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def tar_layout(layout: Path, out: Path, sde: int) -> None:
    """Tar an OCI layout reproducibly (sorted names, fixed owners and mtimes): an oci-archive."""
    tmp = out.with_suffix(".tmp")

    def entry(path: Path, arcname: str) -> tarfile.TarInfo:
        info = tarfile.TarInfo(arcname)
        info.mtime = sde
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        if path.is_dir():
            info.type = tarfile.DIRTYPE
            info.mode = 0o755
        else:
            info.size = path.stat().st_size
            info.mode = 0o644
        return info

    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tf:
        paths = sorted(layout.rglob("*"), key=lambda p: p.relative_to(layout).as_posix())
        for path in paths:
            info = entry(path, path.relative_to(layout).as_posix())
            if info.isdir():
                tf.addfile(info)
            else:
                with open(path, "rb") as f:
                    tf.addfile(info, f)
    tmp.replace(out)


def build_image(
    image: Image,
    *,
    out: Path,
    base_tar: Path,
    wheel: Path,
    key: str,
    sde: int,
    repo: str,
    tag: str,
    rev: str,
) -> dict[str, object]:
    """Build one image into ``out/<name>.oci.tar``; returns its size record."""
    work = out / "work" / image.key
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    layout, bundle = work / "layout", work / "bundle"
    ref = f"{layout}:build"
    created = iso(sde)
    run(["umoci", "init", "--layout", layout])
    run(["umoci", "new", "--image", ref])
    run(["umoci", "unpack", "--image", ref, bundle], stdout=subprocess.DEVNULL)
    rootfs = bundle / "rootfs"
    log(f"{image.name}: base layer")
    run(["tar", "-xf", base_tar, "-C", rootfs, "--numeric-owner", "--xattrs"])
    slim(rootfs)
    clamp_mtimes(rootfs, sde)
    base_bytes = du_bytes(rootfs)
    run(
        [
            "umoci",
            "repack",
            "--image",
            ref,
            "--refresh-bundle",
            "--history.created",
            created,
            "--history.created_by",
            f"mmdebstrap --variant=minbase {SUITE} --include={','.join(BASE_PACKAGES)}",
            "--history.author",
            "hack/images/build.py",
            bundle,
        ]
    )
    log(f"{image.name}: application layer (pip --target, compileall)")
    install_app(rootfs, image, wheel, sde)
    clamp_mtimes(rootfs, sde)
    total_bytes = du_bytes(rootfs)
    run(
        [
            "umoci",
            "repack",
            "--image",
            ref,
            "--history.created",
            created,
            "--history.created_by",
            f"pip install --no-deps --require-hashes -r hack/images/{image.lock_file.name} "
            f"rl-energy-operator[{image.extra}]=={tag}",
            "--history.author",
            "hack/images/build.py",
            bundle,
        ]
    )
    labels = {
        "org.opencontainers.image.title": image.title,
        "org.opencontainers.image.description": image.description,
        "org.opencontainers.image.source": SOURCE_URL,
        "org.opencontainers.image.url": SOURCE_URL,
        "org.opencontainers.image.version": tag,
        "org.opencontainers.image.revision": rev,
        "org.opencontainers.image.licenses": LICENSE,
        "org.opencontainers.image.created": created,
        "org.opencontainers.image.vendor": "rl-energy",
        "org.opencontainers.image.base.name": f"debian:{SUITE} (mmdebstrap minbase)",
    }
    cfg = [
        "umoci",
        "config",
        "--image",
        ref,
        "--no-history",
        "--created",
        created,
        "--author",
        "rl-energy",
        "--os",
        "linux",
        "--architecture",
        "amd64",
        "--config.user",
        image.user,
        "--config.workingdir",
        "/",
        "--clear=config.cmd",
        "--clear=config.entrypoint",
        "--clear=config.env",
        "--config.env",
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "--config.env",
        "PYTHONUNBUFFERED=1",
        "--config.env",
        "PYTHONDONTWRITEBYTECODE=1",
        "--config.env",
        "LANG=C.UTF-8",
    ]
    for part in image.entrypoint:
        cfg += ["--config.entrypoint", part]
    for port in image.ports:
        cfg += ["--config.exposedports", port]
    for k, v in labels.items():
        cfg += ["--config.label", f"{k}={v}", "--manifest.annotation", f"{k}={v}"]
    run([*cfg, "--tag", tag])
    run(["umoci", "rm", "--image", ref])
    run(["umoci", "gc", "--layout", layout])
    index_path = layout / "index.json"
    index = json.loads(index_path.read_text())
    (manifest,) = index["manifests"]
    manifest["annotations"] = {
        "org.opencontainers.image.ref.name": tag,
        "io.containerd.image.name": f"{repo}/{image.name}:{tag}",
    }
    index_path.write_text(json.dumps(index, separators=(",", ":"), sort_keys=True))
    archive = out / f"{image.name}.oci.tar"
    tar_layout(layout, archive, sde)
    mdesc = json.loads((layout / "blobs/sha256" / manifest["digest"].split(":")[1]).read_text())
    compressed = sum(int(layer["size"]) for layer in mdesc["layers"])
    packages = run(
        ["dpkg-query", f"--admindir={rootfs}/var/lib/dpkg", "-W", "-f", "${Package} ${Version}\n"],
        capture_output=True,
    ).stdout
    pins = [ln.split()[0] for ln in image.lock_file.read_text().splitlines() if "==" in ln]
    (out / f"{image.name}.packages.txt").write_text(
        "# Debian packages\n" + packages + "# Python distributions\n" + "\n".join(pins) + "\n"
    )
    record = {
        "image": f"{repo}/{image.name}:{tag}",
        "archive": str(archive.relative_to(ROOT)),
        "manifest_digest": manifest["digest"],
        "uncompressed_bytes": total_bytes,
        "base_layer_uncompressed_bytes": base_bytes,
        "compressed_layers_bytes": compressed,
        "archive_bytes": archive.stat().st_size,
        "source_date_epoch": sde,
        "revision": rev,
    }
    (out / f"{image.name}.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / f"{image.name}.key").write_text(key + "\n")
    shutil.rmtree(work)
    return record


def build(names: Sequence[str], *, out: Path, repo: str, tag: str, force: bool) -> int:
    """Build the named images (cached); prints a size table."""
    if os.geteuid() != 0:
        log("needs root (mmdebstrap --mode=root, chroot, file ownership)")
        return 2
    for tool in ("mmdebstrap", "umoci", "tar", "chroot", "dpkg-query"):
        if shutil.which(tool) is None:
            log(f"{tool} not found: run hack/build-images.sh (installs the Debian packages)")
            return 2
    start = time.monotonic()
    sde = source_date_epoch()
    rev = revision()
    out.mkdir(parents=True, exist_ok=True)
    cache = out / "cache"
    wheel = build_wheel(cache / "wheel", sde)
    wheel_sha = sha256_file(wheel)
    base_tar, bkey = build_base(cache, sde, force=force)
    script_sha = sha256_file(Path(__file__))
    records = []
    for name in names:
        image = IMAGES[name]
        key = digest(
            RECIPE_VERSION,
            bkey,
            wheel_sha,
            image.lock_file.read_text(),
            script_sha,
            dataclasses.asdict(image),
            sde,
            rev,
            repo,
            tag,
        )
        archive = out / f"{image.name}.oci.tar"
        key_file = out / f"{image.name}.key"
        record_file = out / f"{image.name}.json"
        if (
            not force
            and archive.exists()
            and record_file.exists()
            and key_file.exists()
            and key_file.read_text().strip() == key
        ):
            log(f"{image.name}: up to date ({archive.relative_to(ROOT)})")
            records.append(json.loads(record_file.read_text()))
            continue
        t0 = time.monotonic()
        records.append(
            build_image(
                image,
                out=out,
                base_tar=base_tar,
                wheel=wheel,
                key=key,
                sde=sde,
                repo=repo,
                tag=tag,
                rev=rev,
            )
        )
        log(f"{image.name}: built in {time.monotonic() - t0:.0f} s")
    print(f"{'image':<48} {'uncompressed':>12} {'compressed':>10}  manifest")
    for r in records:
        print(
            f"{r['image']:<48} {int(r['uncompressed_bytes']) / 1e6:>9.1f} MB"  # type: ignore[call-overload]
            f" {int(r['compressed_layers_bytes']) / 1e6:>7.1f} MB  {r['manifest_digest']}"  # type: ignore[call-overload]
        )
    log(f"done in {time.monotonic() - start:.0f} s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``build`` (default) or ``lock``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("build", "lock"), nargs="?", default="build")
    parser.add_argument("images", nargs="*", default=[], help="operator, agent (default: both)")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "images")
    parser.add_argument(
        "--repo",
        default=os.environ.get("IMAGE_REPO", "ghcr.io/rl-energy"),
        help="registry/namespace of the image names (env IMAGE_REPO)",
    )
    parser.add_argument(
        "--tag", default=os.environ.get("IMAGE_TAG", ""), help="default: project version"
    )
    parser.add_argument(
        "--force", action="store_true", default=os.environ.get("FORCE", "") not in ("", "0")
    )
    args = parser.parse_args(argv)
    names = args.images or list(IMAGES)
    unknown = sorted(set(names) - set(IMAGES))
    if unknown:
        parser.error(f"unknown image(s) {unknown}: choose from {sorted(IMAGES)}")
    if args.command == "lock":
        lock([IMAGES[n] for n in names], args.out / "cache")
        return 0
    return build(
        names,
        out=args.out.resolve(),
        repo=args.repo,
        tag=args.tag or project_version(),
        force=args.force,
    )


if __name__ == "__main__":
    sys.exit(main())
