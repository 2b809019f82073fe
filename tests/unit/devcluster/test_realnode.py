"""The real node's configuration (rlenergy_dev.devcluster.realnode) and the kubelet's certificate.

The node itself runs in tests/e2e/test_real_node.py; these check what is written for it."""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from cryptography.x509.oid import NameOID
from rlenergy_dev.devcluster import process, realnode
from rlenergy_dev.devcluster.certs import client_cert, generate_pki
from rlenergy_dev.devcluster.errors import DevClusterError, MissingBinaryError

from rlenergy.api import tls


def test_containerd_config_keeps_everything_under_its_folder(tmp_path: Path) -> None:
    cfg = tomllib.loads(realnode.containerd_config(tmp_path, tmp_path / "shim", tmp_path / "w"))
    assert cfg["version"] == 4
    assert cfg["root"] == str(tmp_path / "root") and cfg["state"] == str(tmp_path / "state")
    assert cfg["imports"] == []
    plugins = cfg["plugins"]
    assert plugins["io.containerd.server.v1.grpc"]["address"] == str(tmp_path / "containerd.sock")
    assert plugins["io.containerd.server.v1.ttrpc"]["address"] == str(
        tmp_path / "containerd.sock.ttrpc"
    )
    assert plugins["io.containerd.nri.v1.nri"]["disable"] is True  # its socket is machine-wide
    assert plugins["io.containerd.cri.v1.images"]["pinned_images"]["sandbox"] == (
        realnode.PAUSE_IMAGE
    )
    assert plugins["io.containerd.grpc.v1.cri"]["stream_server_address"] == "127.0.0.1"
    rt = plugins["io.containerd.cri.v1.runtime"]
    assert rt["restrict_oom_score_adj"] is True
    assert rt["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"] is False
    assert rt["cni"]["conf_dir"] == str(tmp_path / "cni")
    assert rt["cni"]["bin_dirs"] == [str(realnode.CNI_BIN_DIR)]
    assert plugins["io.containerd.internal.v1.opt"]["path"] == str(tmp_path / "opt")
    # Nothing of the config names a path outside the folder but the binaries, CNI and CDI dirs.
    text = realnode.containerd_config(tmp_path, tmp_path / "shim", tmp_path / "w")
    for path in (s.strip("'") for s in text.split() if s.startswith("'/")):
        assert path.startswith(
            (str(tmp_path), str(realnode.CNI_BIN_DIR), "/etc/cdi", "/var/run/cdi")
        ), path


def test_containerd_runs_the_toolkit_as_handler_nvidia_with_runc_the_default(
    tmp_path: Path,
) -> None:
    wrapper = tmp_path / "toolkit" / "nvidia-container-runtime"
    shim = tmp_path / "bin" / "containerd-shim-runc-v2"
    cfg = tomllib.loads(realnode.containerd_config(tmp_path, shim, wrapper))
    rt = cfg["plugins"]["io.containerd.cri.v1.runtime"]
    ctd = rt["containerd"]
    assert ctd["default_runtime_name"] == "runc"
    runc, nvidia = ctd["runtimes"]["runc"], ctd["runtimes"][realnode.NVIDIA_HANDLER]
    assert realnode.NVIDIA_HANDLER == "nvidia"
    assert runc["runtime_type"] == nvidia["runtime_type"] == "io.containerd.runc.v2"
    assert runc["runtime_path"] == nvidia["runtime_path"] == str(shim)
    assert "BinaryName" not in runc["options"]
    assert nvidia["options"]["BinaryName"] == str(wrapper)
    # One runc root: both handlers' containers are the same runc's to list and kill.
    assert runc["options"]["Root"] == nvidia["options"]["Root"] == str(tmp_path / "runc")
    # CDI (always on in containerd >= 2.4) reads the folders the stand-in spec is written to.
    assert rt["cdi_spec_dirs"] == ["/etc/cdi", "/var/run/cdi"]
    assert realnode.CDI_SPEC_FILE.parent.as_posix() in rt["cdi_spec_dirs"]


def test_toolkit_config_is_cdi_mode_over_runc(tmp_path: Path) -> None:
    cfg = tomllib.loads(realnode.toolkit_config(Path("/usr/sbin/runc"), tmp_path / "ncr.log"))
    rt = cfg["nvidia-container-runtime"]
    assert rt["mode"] == "cdi"
    assert rt["runtimes"] == ["/usr/sbin/runc"]
    assert rt["debug"] == str(tmp_path / "ncr.log")
    cdi = rt["modes"]["cdi"]
    assert cdi["default-kind"] == "nvidia.com/gpu"
    assert cdi["spec-dirs"] == ["/etc/cdi", "/var/run/cdi"]
    assert realnode.CDI_SPEC_FILE.parent in realnode.CDI_SPEC_DIRS
    # The agent asks for its GPUs by NVIDIA_VISIBLE_DEVICES=all, as an unprivileged container.
    assert cfg["accept-nvidia-visible-devices-envvar-when-unprivileged"] is True


def test_runtime_wrapper_passes_the_config_and_every_argument(tmp_path: Path) -> None:
    script = realnode.nvidia_runtime_wrapper(Path("/bin/echo"), tmp_path / "config.toml")
    wrapper = tmp_path / "w"
    wrapper.write_text(script)
    wrapper.chmod(0o755)
    out = subprocess.run(
        [str(wrapper), "--root", "/x y", "create"], capture_output=True, text=True, check=True
    )
    assert out.stdout == "--root /x y create\n"
    env = subprocess.run(
        ["sh", "-c", script.replace("/bin/echo", "/usr/bin/env")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert f"NVIDIA_CTK_CONFIG_FILE_PATH={tmp_path / 'config.toml'}" in env.stdout.splitlines()


def test_cdi_spec_of_the_standin_gpus() -> None:
    lib, state = Path("/b/libnvidia-ml.so.1"), Path("/w/nvml/nvml.state")
    spec = realnode.cdi_spec(lib, state, ["GPU-a-00", "GPU-a-01"])
    assert spec["kind"] == "nvidia.com/gpu"
    assert [d["name"] for d in spec["devices"]] == ["GPU-a-00", "GPU-a-01", "all"]
    devices = {d["name"]: d["containerEdits"] for d in spec["devices"]}
    assert devices["GPU-a-01"] == {"env": ["RLENERGY_NVML_STANDIN_GPU_1=GPU-a-01"]}
    assert devices["all"]["env"] == [
        "RLENERGY_NVML_STANDIN_GPU_0=GPU-a-00",
        "RLENERGY_NVML_STANDIN_GPU_1=GPU-a-01",
    ]
    common = spec["containerEdits"]
    mounts = {m["containerPath"]: m for m in common["mounts"]}
    assert mounts[realnode.CONTAINER_NVML_LIB]["hostPath"] == str(lib)
    assert "ro" in mounts[realnode.CONTAINER_NVML_LIB]["options"]
    assert mounts[realnode.CONTAINER_STATE_DIR]["hostPath"] == "/w/nvml"
    assert "rw" in mounts[realnode.CONTAINER_STATE_DIR]["options"]
    assert common["env"] == [
        f"RLENERGY_NVML_STANDIN_STATE={realnode.CONTAINER_STATE_DIR}/nvml.state"
    ]
    assert realnode.CONTAINER_NVML_LIB.endswith("-linux-gnu/libnvidia-ml.so.1")
    # The same devices and edits under the kind of NVIDIA's device plugin's cdi-cri answers.
    plugin = realnode.cdi_spec(
        lib, state, ["GPU-a-00", "GPU-a-01"], realnode.DEVICE_PLUGIN_CDI_KIND
    )
    assert plugin["kind"] == "k8s.device-plugin.nvidia.com/gpu"
    assert {k: v for k, v in plugin.items() if k != "kind"} == {
        k: v for k, v in spec.items() if k != "kind"
    }


@pytest.mark.parametrize("uuids", [[], ["GPU-1", "GPU-1"], ["GPU 1"], ["GPU-1-"], ["all"]])
def test_cdi_spec_refuses_uuids_cdi_cannot_name(uuids: list[str]) -> None:
    with pytest.raises(ValueError, match="UUID"):
        realnode.cdi_spec(Path("/l"), Path("/s/state"), uuids)


def test_kubelet_config_for_this_host(tmp_path: Path) -> None:
    taint = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    cfg = realnode.kubelet_config(
        runtime_socket=tmp_path / "c.sock",
        port=1234,
        healthz_port=1235,
        client_ca=tmp_path / "ca.crt",
        taints=[taint],
    )
    assert cfg["kind"] == "KubeletConfiguration"
    assert cfg["failCgroupV1"] is False and cfg["cgroupDriver"] == "cgroupfs"
    assert cfg["address"] == cfg["healthzBindAddress"] == "127.0.0.1"
    assert cfg["readOnlyPort"] == 0
    assert cfg["containerRuntimeEndpoint"] == f"unix://{tmp_path / 'c.sock'}"
    assert cfg["authentication"]["anonymous"]["enabled"] is False
    assert cfg["registerWithTaints"] == [taint]


def test_cni_config_is_loopback_only() -> None:
    assert [p["type"] for p in realnode.CNI_CONFIG["plugins"]] == ["loopback"]


NET = realnode.PodNetwork(bridge="rle0", subnet="10.88.0.0/24", gateway="10.88.0.1")


def test_bridge_cni_config_gives_pods_the_subnet_with_the_node_as_gateway(
    tmp_path: Path,
) -> None:
    conf = realnode.bridge_cni_config(NET, tmp_path / "ipam")
    (plugin,) = conf["plugins"]
    assert plugin["type"] == "bridge" and plugin["bridge"] == "rle0"
    assert plugin["isGateway"] is True and plugin["ipMasq"] is False
    ipam = plugin["ipam"]
    assert ipam["type"] == "host-local"
    assert ipam["ranges"] == [[{"subnet": "10.88.0.0/24", "gateway": "10.88.0.1"}]]
    assert ipam["dataDir"] == str(tmp_path / "ipam")  # never the machine-wide folder


@pytest.mark.parametrize(
    ("bridge", "subnet", "gateway", "match"),
    [
        ("rle0", "10.88.0.0/24", "10.89.0.1", "not in the pod subnet"),
        ("rle0", "10.88.0.1/24", "10.88.0.1", "host bits"),
        ("", "10.88.0.0/24", "10.88.0.1", "1 to 15"),
        ("a-bridge-name-too-long", "10.88.0.0/24", "10.88.0.1", "1 to 15"),
    ],
)
def test_pod_network_refuses_what_cannot_be_made(
    bridge: str, subnet: str, gateway: str, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        realnode.PodNetwork(bridge=bridge, subnet=subnet, gateway=gateway)


def test_node_ip_is_the_gateway_with_a_pod_network_else_loopback(tmp_path: Path) -> None:
    def spawn(name: str, argv: object) -> process.ProcessRecord:
        raise AssertionError(f"nothing is started here: {name}")

    def node(net: realnode.PodNetwork | None) -> realnode.RealNode:
        bins = realnode.NodeBinaries(*(tmp_path / n for n in "abcdefg"))
        return realnode.RealNode(tmp_path, bins, spawn, {}, pod_network=net)

    assert node(None).node_ip == "127.0.0.1"
    assert node(None).addresses == realnode.ADDRESSES
    assert node(NET).node_ip == "10.88.0.1"
    assert {"type": "InternalIP", "address": "10.88.0.1"} in node(NET).addresses
    assert NET.prefix_len == 24


def test_kubelet_listens_on_the_node_ip(tmp_path: Path) -> None:
    cfg = realnode.kubelet_config(
        runtime_socket=tmp_path / "c.sock",
        port=1234,
        healthz_port=1235,
        client_ca=tmp_path / "ca.crt",
        address="10.88.0.1",
    )
    assert cfg["address"] == "10.88.0.1"  # the API server dials the InternalIP for logs
    assert cfg["healthzBindAddress"] == "127.0.0.1"


def test_kubelet_client_certificate_names_the_node() -> None:
    pki = generate_pki()
    pair = client_cert(pki, "system:node:realnode", ("system:nodes",))
    cert = tls.load_cert(pair.cert_pem)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == (
        "system:node:realnode"
    )
    assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == (
        "system:nodes"
    )
    assert cert.issuer == tls.load_cert(pki.client_ca.cert_pem).subject


def test_missing_kubelet_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(MissingBinaryError, match="make bins"):
        realnode.resolve_node_binaries(tmp_path)


def test_missing_nvidia_binaries_name_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("kubelet", "containerd", "containerd-shim-runc-v2", "ctr"):
        (bin_dir / name).write_text("")
        (bin_dir / name).chmod(0o755)
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "pause.oci.tar").write_text("")
    (tmp_path / "cni").mkdir()
    for plugin in ("loopback", "bridge", "host-local"):
        (tmp_path / "cni" / plugin).write_text("")
        (tmp_path / "cni" / plugin).chmod(0o755)
    monkeypatch.setattr(realnode, "CNI_BIN_DIR", tmp_path / "cni")
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    with pytest.raises(MissingBinaryError, match="nvidia-container-runtime.*make bins"):
        realnode.resolve_node_binaries(bin_dir)
    (bin_dir / "nvidia-container-runtime").write_text("")
    (bin_dir / "nvidia-container-runtime").chmod(0o755)
    with pytest.raises(MissingBinaryError, match="nvidia-device-plugin.*make bins"):
        realnode.resolve_node_binaries(bin_dir)
    (bin_dir / "nvidia-device-plugin").write_text("")
    (bin_dir / "nvidia-device-plugin").chmod(0o755)
    bins = realnode.resolve_node_binaries(bin_dir)
    assert bins.nvidia_runtime == bin_dir / "nvidia-container-runtime"
    assert bins.device_plugin == bin_dir / "nvidia-device-plugin"
    assert bins.containerd == bin_dir / "containerd" and bins.ctr == bin_dir / "ctr"
    assert bins.shim == bin_dir / "containerd-shim-runc-v2"
    assert bins.runc == Path("/usr/bin/runc")


def test_unmount_under_touches_nothing_outside(tmp_path: Path) -> None:
    assert realnode.unmount_under(tmp_path) == []


def _node_with_spawn(
    tmp_path: Path,
) -> tuple[realnode.RealNode, dict[int, subprocess.Popen[bytes]]]:
    popens: dict[int, subprocess.Popen[bytes]] = {}

    def spawn(name: str, argv: list[str]) -> process.ProcessRecord:
        proc, rec = process.spawn(name, argv, tmp_path / f"{name}.log")
        popens[proc.pid] = proc
        return rec

    bins = realnode.NodeBinaries(*(tmp_path / n for n in "abcdefg"))
    return realnode.RealNode(tmp_path / "node", bins, spawn, popens), popens


def test_restart_kubelet_runs_the_same_command_line_again(tmp_path: Path) -> None:
    node, popens = _node_with_spawn(tmp_path)
    with pytest.raises(DevClusterError, match="never started"):
        node.restart_kubelet()
    node.kubelet = node._spawn("kubelet", ["sleep", "60"])
    old = node.kubelet
    try:
        stopped_s = node.restart_kubelet(down_s=0.2, grace=5.0)
        assert node.kubelet.pid != old.pid and node.kubelet.argv == old.argv
        assert popens[old.pid].poll() is not None and popens[node.kubelet.pid].poll() is None
        assert 0 <= stopped_s < 5.0
        assert (tmp_path / "kubelet.log").read_text().count("$ sleep 60") == 2
    finally:
        process.terminate(node.processes, popens, grace=1.0)


def test_the_machine_lock_fails_at_once_or_waits_for_its_holder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fcntl
    import threading

    monkeypatch.setattr(realnode, "LOCK_FILE", tmp_path / "realnode.lock")
    holder = open(realnode.LOCK_FILE, "a+")  # noqa: SIM115 - released below
    fcntl.flock(holder, fcntl.LOCK_EX)
    holder.write("pid 1 workdir /elsewhere\n")
    holder.flush()
    node, _ = _node_with_spawn(tmp_path)
    monkeypatch.delenv(realnode.LOCK_WAIT_ENV, raising=False)
    with pytest.raises(
        DevClusterError, match=f"held by pid 1 workdir /elsewhere.*{realnode.LOCK_WAIT_ENV}"
    ):
        node.acquire()
    monkeypatch.setenv(realnode.LOCK_WAIT_ENV, "30")
    threading.Timer(0.5, lambda: (fcntl.flock(holder, fcntl.LOCK_UN), holder.close())).start()
    node.acquire()  # the holder lets go while it waits
    assert realnode.LOCK_FILE.read_text().startswith(f"pid {os.getpid()} ")
    node.release()
