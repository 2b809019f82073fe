"""Smoke tests of the image archives from ``make images``: ``make test-images``.

Each archive is unpacked with umoci; its entry point runs in a chroot of the unpacked root
filesystem as the image's user (``--help``, a short ``--backend sim`` run, the stand-in NVML copied
in where the NVIDIA container toolkit would inject the real one); the config (user, entry point,
labels) is read with skopeo. Needs root, umoci, skopeo and the archives under build/images/.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest
import rlenergy_dev

pytestmark = pytest.mark.images

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "build" / "images"
NAMES = {"operator": "rl-energy-operator", "agent": "rl-energy-agent"}
SIZE_LIMIT_MB = {"operator": 200, "agent": 250}
ENTRYPOINT = {
    "operator": ["/usr/local/bin/rlenergy-operator"],
    "agent": ["/usr/local/bin/rlenergy-agent"],
}
USER = {"operator": "65532:65532", "agent": "0:0"}
VERSION = rlenergy_dev.project_version()


@dataclasses.dataclass
class Unpacked:
    key: str
    archive: Path
    rootfs: Path
    config: dict[str, object]
    record: dict[str, object]

    @property
    def env(self) -> dict[str, str]:
        env = dict(e.split("=", 1) for e in self.config["config"]["Env"])  # type: ignore[index]
        return env


def _require_tools() -> None:
    if os.geteuid() != 0:
        pytest.fail("the image smoke test needs root (chroot): run `sudo make test-images`")
    for tool in ("umoci", "skopeo", "chroot"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} not found: run `make images` (installs mmdebstrap, umoci, skopeo)")


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Unpacked]]:
    _require_tools()
    out: dict[str, Unpacked] = {}
    for key, name in NAMES.items():
        archive = OUT / f"{name}.oci.tar"
        if not archive.exists():
            pytest.fail(f"{archive} missing: run `make images`")
        work = tmp_path_factory.mktemp(key)
        layout = work / "layout"
        layout.mkdir()
        subprocess.run(["tar", "-xf", archive, "-C", layout], check=True)
        index = json.loads((layout / "index.json").read_text())
        (desc,) = index["manifests"]
        tag = desc["annotations"]["org.opencontainers.image.ref.name"]
        subprocess.run(
            ["umoci", "unpack", "--image", f"{layout}:{tag}", work / "bundle"],
            check=True,
            capture_output=True,
        )
        config = json.loads(
            subprocess.run(
                ["skopeo", "inspect", "--config", f"oci-archive:{archive}"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        )
        record = json.loads((OUT / f"{name}.json").read_text())
        out[key] = Unpacked(key, archive, work / "bundle" / "rootfs", config, record)
    yield out


def chroot(
    image: Unpacked,
    cmd: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    user: str | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["chroot", f"--userspec={user or USER[image.key]}", str(image.rootfs), *cmd],
        env={**image.env, "HOME": "/tmp", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class Running:
    """The agent in a chroot until SIGTERM; reads its ready line."""

    def __init__(self, image: Unpacked, args: Sequence[str], env: Mapping[str, str]) -> None:
        self.proc = subprocess.Popen(
            [
                "chroot",
                f"--userspec={USER[image.key]}",
                str(image.rootfs),
                *ENTRYPOINT[image.key],
                *args,
            ],
            env={**image.env, "HOME": "/tmp", **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def ready(self, timeout: float = 60) -> dict[str, object]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith("{"):
                return json.loads(line)  # type: ignore[no-any-return]
        self.proc.kill()
        _out, err = self.proc.communicate()
        raise AssertionError(f"agent never ready (rc {self.proc.returncode}):\n{err[-3000:]}")

    def stop(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGTERM)
        try:
            _out, err = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _out, err = self.proc.communicate()
        return self.proc.returncode, err


def metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()  # type: ignore[no-any-return]


AGENT_ENV = {"RLENERGY_AGENT_KUBE": "false", "RLENERGY_AGENT_SIM_GPUS": "2"}
AGENT_ARGS = [
    "--node",
    "smoke",
    "--metrics-port",
    "0",
    "--state-dir",
    "/tmp/state",
    "--socket",
    "/tmp/agent.sock",
]


# ----- config ------------------------------------------------------------------------------
@pytest.mark.parametrize("key", list(NAMES))
def test_config_user_entrypoint_labels(images: dict[str, Unpacked], key: str) -> None:
    image = images[key]
    cfg = image.config["config"]
    assert cfg["User"] == USER[key]  # type: ignore[index]
    assert cfg["Entrypoint"] == ENTRYPOINT[key]  # type: ignore[index]
    assert not cfg.get("Cmd")  # type: ignore[union-attr]
    labels = cfg["Labels"]  # type: ignore[index]
    assert (
        labels["org.opencontainers.image.source"]
        == "https://github.com/rl-energy/rl-energy-operator"
    )
    assert labels["org.opencontainers.image.version"] == VERSION
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert image.config["architecture"] == "amd64" and image.config["os"] == "linux"
    # Two layers: the Debian base (shared by both images) and the application.
    assert len(image.config["rootfs"]["diff_ids"]) == 2  # type: ignore[index]
    # umoci reads the same config from the layout.
    stat = subprocess.run(
        ["umoci", "stat", "--json", "--image", f"{image.rootfs.parents[1] / 'layout'}:{VERSION}"],
        check=True,
        capture_output=True,
        text=True,
    )
    assert len(json.loads(stat.stdout)["history"]) == 2


def test_base_layer_shared(images: dict[str, Unpacked]) -> None:
    op, ag = (images[k].config["rootfs"]["diff_ids"] for k in ("operator", "agent"))  # type: ignore[index]
    assert op[0] == ag[0]


def test_operator_user_exists(images: dict[str, Unpacked]) -> None:
    passwd = (images["operator"].rootfs / "etc/passwd").read_text()
    assert "rlenergy:x:65532:65532:" in passwd


# ----- entry points -------------------------------------------------------------------------
@pytest.mark.parametrize("key", list(NAMES))
def test_help(images: dict[str, Unpacked], key: str) -> None:
    res = chroot(images[key], [*ENTRYPOINT[key], "--help"])
    assert res.returncode == 0, res.stderr
    assert "usage" in res.stdout.lower()


def test_agent_sim_backend(images: dict[str, Unpacked]) -> None:
    image = images["agent"]
    agent = Running(image, [*AGENT_ARGS, "--backend", "sim"], AGENT_ENV)
    try:
        ready = agent.ready()
        assert ready["ready"] is True
        text = metrics(int(ready["metricsPort"]))  # type: ignore[call-overload]
        assert "GPU-sim-smoke-00" in text and "GPU-sim-smoke-01" in text
        assert "rlenergy_agent_" in text
    finally:
        rc, err = agent.stop()
    assert rc == 0, err[-3000:]


def test_agent_without_nvml_names_the_toolkit(images: dict[str, Unpacked]) -> None:
    image = images["agent"]
    shipped = [p for p in image.rootfs.rglob("libnvidia-ml*")]
    assert not shipped, f"the agent image must not ship libnvidia-ml: {shipped}"
    res = chroot(image, [*ENTRYPOINT["agent"], *AGENT_ARGS, "--backend", "nvml"], env=AGENT_ENV)
    assert res.returncode == 3, res.stderr[-3000:]
    assert "NVIDIA container toolkit" in res.stderr


def test_agent_standin_nvml(images: dict[str, Unpacked], tmp_path: Path) -> None:
    """The stand-in libnvidia-ml copied where the toolkit would inject the real one."""
    if shutil.which("gcc") is None:
        pytest.fail(
            "gcc missing: cannot build the stand-in libnvidia-ml; run `apt-get install -y gcc`"
        )
    from rlenergy_dev import standin

    from rlenergy.gpu import models

    image = images["agent"]
    lib_dir = standin.build_library(tmp_path / "standin")
    inject = image.rootfs / "usr/local/nvidia/lib64"
    inject.mkdir(parents=True, exist_ok=True)
    shutil.copy2(lib_dir / "libnvidia-ml.so.1", inject / "libnvidia-ml.so.1")
    sku = models.get_sku("h100-sxm")
    uuids = ["GPU-standin-0000", "GPU-standin-0001"]
    driver = standin.StandinDriver(image.rootfs / "tmp/standin.state", [(u, sku) for u in uuids])
    driver.start()
    env = {
        **AGENT_ENV,
        standin.STATE_ENV: "/tmp/standin.state",
        "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64",
    }
    agent = Running(image, [*AGENT_ARGS, "--backend", "nvml"], env)
    try:
        ready = agent.ready()
        text = metrics(int(ready["metricsPort"]))  # type: ignore[call-overload]
        for u in uuids:
            assert u in text
        assert driver.state.init_count >= 1
    finally:
        rc, err = agent.stop()
        driver.close()
        shutil.rmtree(image.rootfs / "usr/local/nvidia")
    assert rc == 0, err[-3000:]


def test_operator_self_check(images: dict[str, Unpacked]) -> None:
    """As the non-root user: the handlers import, CRDs generate, kopf starts and asks for a login."""
    image = images["operator"]
    res = chroot(
        image,
        [
            "/usr/bin/python3",
            "-c",
            "import rlenergy_operator.handlers, rlenergy_operator.kube, rlenergy_operator.jobloop",
        ],
    )
    assert res.returncode == 0, res.stderr
    res = chroot(image, ["/usr/local/bin/rlenergy-crdgen", "--out", "/tmp/crds"])
    assert res.returncode == 0, res.stderr
    for crd in (ROOT / "crds").glob("*.yaml"):
        assert (image.rootfs / "tmp/crds" / crd.name).read_text() == crd.read_text(), crd.name
    res = chroot(
        image, [*ENTRYPOINT["operator"], "--standalone", "--namespace", "smoke"], timeout=120
    )
    assert res.returncode != 0
    assert "LoginError" in res.stderr or "credentials" in res.stderr, res.stderr[-3000:]
    assert "ModuleNotFoundError" not in res.stderr and "ImportError" not in res.stderr


# ----- sizes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("key", list(NAMES))
def test_size(images: dict[str, Unpacked], key: str) -> None:
    record = images[key].record
    mb = int(record["uncompressed_bytes"]) / 1e6  # type: ignore[call-overload]
    compressed = int(record["compressed_layers_bytes"]) / 1e6  # type: ignore[call-overload]
    print(f"{NAMES[key]}: {mb:.1f} MB uncompressed, {compressed:.1f} MB compressed layers")
    assert mb < SIZE_LIMIT_MB[key], (
        f"{NAMES[key]} is {mb:.1f} MB (target < {SIZE_LIMIT_MB[key]} MB)"
    )
