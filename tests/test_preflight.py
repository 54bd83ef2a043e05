"""launch/npu_preflight.sh on CPU: --help, --dry-run, a machine without hccn_tool, and the checks
against stand-in `npu-smi` / `hccn_tool` printing what ROLL's guide shows (one line per check,
exit 1 naming what failed)."""
from __future__ import annotations

import os
import subprocess

from tests.util import ROOT

SCRIPT = str(ROOT / "launch" / "npu_preflight.sh")

NPU_SMI = r'''#!/bin/sh
if [ "$1 $2" = "info -l" ]; then echo "        Total Count                    : 2"; exit 0; fi
cat <<'T'
+------------------------------------------------------------------------------------------------+
| npu-smi 25.2.0                   Version: 25.2.0                                               |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 95.7        35                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3392 / 65536         |
+===========================+===============+====================================================+
T
echo "| 1     910B3               | ${FAKE_HEALTH1:-OK}            | 95.7        35                0    / 0             |"
echo "| 0                         | 0000:C2:00.0  | 0           0    / 0          3392 / 65536         |"
'''

HCCN = r'''#!/bin/sh
i=$2
case "$3" in
  -link) if [ "$i" = "${FAKE_DOWN:-x}" ]; then echo "link status: DOWN"; else echo "link status: UP"; fi ;;
  -tls) echo "dev_id:$i, tls switch[${FAKE_TLS:-0}]"; [ "$i" = 1 ] && [ -n "${FAKE_TLS1:-}" ] && echo "dev_id:1, tls switch[$FAKE_TLS1]" ;;
  -ip) echo "ipaddr:192.168.1.$((10 + i))"; echo "netmask:255.255.255.0" ;;
  -ping) if [ "$6" = "${FAKE_UNREACHABLE:-x}" ]; then echo "3 packets transmitted, 0 received, 100.00% packet loss";
         else echo "3 packets transmitted, 3 received, 0.00% packet loss"; fi ;;
esac
'''


def _tools(tmp_path, cann="9.1.0"):
    bin_ = tmp_path / "bin"
    bin_.mkdir(parents=True)
    for name, text in (("npu-smi", NPU_SMI), ("hccn_tool", HCCN)):
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    home = tmp_path / "Ascend"
    (home / "ascend-toolkit" / "latest" / "aarch64-linux").mkdir(parents=True)
    (home / "ascend-toolkit" / "latest" / "aarch64-linux" / "ascend_toolkit_install.info").write_text(
        f"package_name=Ascend-cann-toolkit\nversion={cann}\n")
    (home / "driver").mkdir()
    (home / "driver" / "version.info").write_text("Version=25.2.0\n")
    return bin_, home


def _run(args, path, **env):
    e = dict(os.environ, PATH=path, **env)
    return subprocess.run(["bash", SCRIPT, *args], env=e, capture_output=True, text=True, timeout=60)


def test_help_and_dry_run_print_without_running_anything():
    p = _run(["--help"], os.environ["PATH"])
    assert p.returncode == 0 and "--peer" in p.stdout and "hccn_tool" in p.stdout, p.stderr
    p = _run(["--dry-run", "--peer", "192.168.2.10"], os.environ["PATH"])
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "npu-smi info"
    for i in range(8):  # a dry run draws 8 devices unless told
        for cmd in (f"hccn_tool -i {i} -link -g", f"hccn_tool -i {i} -tls -g", f"hccn_tool -i {i} -ip -g",
                    f"hccn_tool -i {i} -ping -g address 192.168.2.10"):
            assert cmd in lines, cmd
    assert any("ascend_toolkit_install.info" in ln and "version=9.1.0" in ln for ln in lines)
    assert any(ln.endswith("driver/version.info") for ln in lines)
    p = _run(["--dry-run", "--devices=16"], os.environ["PATH"])
    assert "hccn_tool -i 15 -link -g" in p.stdout and "-ping" not in p.stdout


def test_a_machine_without_hccn_tool_says_so_in_one_line(tmp_path):
    p = _run([], str(tmp_path) + ":/usr/bin:/bin")
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and "no hccn_tool on this machine" in p.stderr, p.stderr


def test_every_check_one_line_and_a_failure_named(tmp_path):
    bin_, home = _tools(tmp_path)
    path = f"{bin_}:/usr/bin:/bin"
    p = _run(["--peer", "192.168.2.10"], path, ASCEND_HOME=str(home))
    assert p.returncode == 0, p.stdout + p.stderr
    checks = [ln.split()[:2] for ln in p.stdout.splitlines()]
    assert checks == [["ok", c] for c in ("health", "link", "tls", "ip", "ping", "cann", "driver")], p.stdout
    assert "0:192.168.1.10 1:192.168.1.11" in p.stdout
    for env, name in ((dict(FAKE_DOWN="1"), "link"), (dict(FAKE_HEALTH1="Alarm"), "health"),
                      (dict(FAKE_TLS1="1"), "tls"), (dict(FAKE_UNREACHABLE="192.168.2.10"), "ping")):
        p = _run(["--peer", "192.168.2.10"], path, ASCEND_HOME=str(home), **env)
        assert p.returncode == 1, (env, p.stdout)
        assert p.stderr.strip() == f"npu_preflight: failed: {name}", (env, p.stderr)
        assert f"FAIL {name}" in p.stdout
    p = _run(["--peer", "192.168.2.10"], path, ASCEND_HOME=str(home), FAKE_TLS1="1")
    assert "hccn_tool -i $i -tls -s enable 0" in p.stdout  # ROLL's fix, for every node
    _, old = _tools(tmp_path / "old", cann="8.3.RC1")
    p = _run([], path, ASCEND_HOME=str(old))
    assert p.returncode == 1 and "found '8.3.RC1'" in p.stdout and "needs 9.1.0" in p.stdout
