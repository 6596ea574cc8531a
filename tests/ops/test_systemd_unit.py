"""The shipped systemd unit passes `systemd-analyze verify`, carries the hardening and notify
settings operators rely on, and the example config is one the daemon accepts."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)  # a hang fails this test instead of the suite

SYSTEMD = Path(__file__).resolve().parents[2] / "systemd"


def unit_settings(path: Path) -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("systemd-analyze is missing and cannot be installed without root and apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=False, env=env, timeout=300,
                   capture_output=True)
    subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "systemd"],
                   check=True, env=env, timeout=600, capture_output=True)
    found = shutil.which("systemd-analyze")
    if not found:
        pytest.skip("installing systemd did not provide systemd-analyze")
    return found


UNITS = ("sluiced.service", "sluiced-rank.service")


@pytest.mark.parametrize("name", UNITS)
def test_unit_passes_systemd_analyze_verify(tmp_path, name) -> None:
    analyze = systemd_analyze()
    sluiced = Path(sys.executable).with_name("sluiced")
    assert sluiced.exists(), "the sluiced console script is not installed"
    unit = tmp_path / name
    unit.write_text((SYSTEMD / name).read_text().replace("/usr/bin/sluiced", str(sluiced)))
    done = subprocess.run([analyze, "verify", "--man=no", str(unit)], capture_output=True,
                          text=True, timeout=120)
    complaints = [line for line in (done.stdout + done.stderr).splitlines()
                  if name in line]
    assert done.returncode == 0 and not complaints, done.stdout + done.stderr


def test_unit_is_notify_type_with_watchdog_restart_and_hardening() -> None:
    service = unit_settings(SYSTEMD / "sluiced.service")["Service"]
    expected = {
        "Type": "notify", "NotifyAccess": "main", "Restart": "on-failure",
        "NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes",
        "ProtectHome": "yes", "ProtectKernelTunables": "yes", "ProtectControlGroups": "yes",
        "RestrictSUIDSGID": "yes", "RuntimeDirectory": "sluice", "User": "sluice",
        "KillMode": "mixed",  # the worker keeps stepping while the daemon drains
    }
    for key, value in expected.items():
        assert service.get(key) == [value], key
    assert int(service["WatchdogSec"][0]) > 0
    assert service["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert service["ExecStart"][0].split()[:2] == ["/usr/bin/sluiced", "serve"]
    assert service["CapabilityBoundingSet"] == [""]


def test_rank_unit_runs_a_joining_rank_that_comes_back_unless_refused() -> None:
    service = unit_settings(SYSTEMD / "sluiced-rank.service")["Service"]
    words = service["ExecStart"][0].split()
    assert words[:2] == ["/usr/bin/sluiced", "worker"] and "--join" in words
    assert words[words.index("--secret-key-file") + 1] == "%d/sluice_rank_secret_key"
    assert service["Restart"] == ["always"]
    assert "77" in service["RestartPreventExitStatus"][0].split()  # EX_NOPERM: refused
    assert service["User"] == ["sluice"] and service["CapabilityBoundingSet"] == [""]


def test_example_config_is_accepted_by_the_daemon() -> None:
    from sluice.actors.scheduler import SchedulerConfig
    from sluice.daemon.config import load_config

    config = load_config(SYSTEMD / "sluiced.toml")
    assert config.control_address == "ipc:///run/sluice/control.sock"
    assert config.metrics_port == 9464
    assert config.http.listen == "127.0.0.1:8000"  # the OpenAI-compatible front
    assert config.usage.path == "/var/lib/sluice/usage.jsonl"  # under the unit's StateDirectory
    tenants = SchedulerConfig.from_dict({**config.scheduler, "kv_blocks": 64}).tenants
    assert tenants["interactive"].weight == 4.0 and tenants["batch"].max_running == 16


def test_sysusers_creates_the_unit_user() -> None:
    entries = [line.split() for line in (SYSTEMD / "sluiced.sysusers").read_text().splitlines()
               if line and not line.startswith("#")]
    assert ["u", "sluice"] in [entry[:2] for entry in entries]


@pytest.mark.parametrize("name", UNITS)
def test_unit_scores_at_most_2_in_systemd_analyze_security(tmp_path, name) -> None:
    analyze = systemd_analyze()
    usage = subprocess.run([analyze, "security", "--help"], capture_output=True, text=True,
                           timeout=60)
    if "--offline" not in usage.stdout:
        pytest.skip("this systemd-analyze cannot score a unit file offline (--offline needs "
                    "systemd 250 or later)")
    unit = tmp_path / name
    unit.write_text((SYSTEMD / name).read_text())
    done = subprocess.run([analyze, "security", "--offline=true", "--no-pager", str(unit)],
                          capture_output=True, text=True, timeout=120)
    found = re.search(rf"Overall exposure level for {re.escape(name)}: ([0-9.]+)", done.stdout)
    assert found, done.stdout + done.stderr
    assert float(found.group(1)) <= 2.0, done.stdout


def test_unit_sandbox_settings_that_torch_and_triton_allow() -> None:
    sections = unit_settings(SYSTEMD / "sluiced.service")
    service = sections["Service"]
    assert service["SystemCallFilter"] == ["@system-service", "~@privileged"]
    assert service["SystemCallErrorNumber"] == ["EPERM"]
    assert service["DevicePolicy"] == ["closed"]
    assert {"char-nvidia-frontend rw", "char-nvidia-uvm rw"} <= set(service["DeviceAllow"])
    assert service["ProtectProc"] == ["invisible"]
    assert service["RemoveIPC"] == ["yes"] and service["PrivateMounts"] == ["yes"]
    for bound in ("MemoryHigh", "MemoryMax", "TasksMax"):
        assert service[bound], bound
    # Triton and torch JIT-compile into writable+executable memory
    assert service.get("MemoryDenyWriteExecute", ["no"]) == ["no"]
    assert int(sections["Unit"]["StartLimitBurst"][0]) > 0
    assert int(sections["Unit"]["StartLimitIntervalSec"][0]) > 0
    assert "78" in service["RestartPreventExitStatus"][0].split()
    assert service["LoadCredential"] == ["sluice:/etc/sluice/credentials"]


def test_runtime_directory_mode_of_the_unit_passes_the_daemons_check(tmp_path,
                                                                     monkeypatch) -> None:
    from sluice.daemon.config import runtime_dir

    service = unit_settings(SYSTEMD / "sluiced.service")["Service"]
    mode = int(service["RuntimeDirectoryMode"][0], 8)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / service["RuntimeDirectory"][0]).mkdir()
    os.chmod(tmp_path / service["RuntimeDirectory"][0], mode)
    assert runtime_dir() == tmp_path / "sluice"


def systemd_can_run_units() -> str | None:
    """Why a unit cannot be started here, or None when it can."""
    if not Path("/run/systemd/system").is_dir():
        return "systemd is not PID 1 on this machine, so no unit can be started"
    if os.geteuid() != 0:
        return "starting a system unit needs root"
    if not shutil.which("systemd-run"):
        return "systemd-run is missing"
    return None


def test_sluiced_reaches_ready_under_the_units_sandbox(tmp_path) -> None:
    """The shipped [Service] sandboxing, with the null executor, as a transient unit."""
    reason = systemd_can_run_units()
    if reason:
        pytest.skip(reason)
    sluiced = Path(sys.executable).with_name("sluiced")
    service = unit_settings(SYSTEMD / "sluiced.service")["Service"]
    skipped = {"ExecStart", "ExecReload", "User", "Group", "LoadCredential", "Environment",
               "StateDirectory", "CacheDirectory", "ProtectHome"}  # the venv may be in /root
    properties = [f"--property={key}={value}" for key, values in service.items()
                  if key not in skipped for value in values]
    name = f"sluiced-test-{os.getpid()}"
    control = f"ipc:///run/{service['RuntimeDirectory'][0]}/control.sock"
    start = subprocess.run(
        ["systemd-run", f"--unit={name}", *properties,
         "--property=Environment=XDG_RUNTIME_DIR=/run", str(sluiced), "serve",
         "--executor", "null", "--listen", "tcp://127.0.0.1:0", "--control", control],
        capture_output=True, text=True, timeout=120)
    try:
        assert start.returncode == 0, start.stderr  # Type=notify: returns once READY=1 came
        state = subprocess.run(["systemctl", "show", "-p", "ActiveState", "--value", name],
                               capture_output=True, text=True, timeout=30).stdout.strip()
        assert state == "active"
        from sluice.ipc.control import fetch_status_sync

        report = fetch_status_sync(control, check_invariants=True)
        assert report.invariant_errors == () and report.kv.used_blocks == 0
    finally:
        subprocess.run(["systemctl", "stop", name], capture_output=True, timeout=120)
