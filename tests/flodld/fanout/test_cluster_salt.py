"""Tunneled fan-out never drops to open admission (issue 13, point 7).

With every remote worker tunneled the controller binds loopback, which by itself would admit any
joiner without the salt, so a local user on a worker host could join through the `-R` forward,
take the salt from Accept, or squat a roster name. The launcher has an SSH channel for secrets,
so every fan-out agent gets the pre-shared salt, and the controller requires it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flodld.config.builder import ClusterBuilder
from flodld.controller.options import ControllerOptions
from flodld.controller.run import Controller
from flodld.fanout.cluster_run import run_cluster_job
from flodld.membership.policy import TrustMode
from tests.flodld.fanout.sshserver import start_local_ssh_server
from tests.flodld.fanout.test_launcher import _cluster

REPO = Path(__file__).resolve().parents[3]

# The agent (flodld's own process) says in its first line whether its spec (sent over the SSH session's
# stdin) carries the salt: "admission: pre-shared salt" or "admission: open".
PROGRAM = """\
import sys
import flodld
sys.exit(flodld.run(lambda: 0, init_process_group=False))
"""


@pytest.mark.multiproc
@pytest.mark.timeout(180)
async def test_every_tunneled_fan_out_agent_gets_the_salt_and_the_run_needs_it(tmp_path: Path) -> None:
    server = await start_local_ssh_server(tmp_path)
    program = tmp_path / "salt_probe.py"
    program.write_text(PROGRAM)
    said: list[str] = []
    lines: list[str] = []
    try:
        code = await run_cluster_job(
            str(program),
            [],
            _cluster(server, tunnel=True, ranks=1),
            say=said.append,
            on_output=lambda host, line: lines.append(line),
        )
    finally:
        server.close()
    assert code == 0, "\n".join(said + lines)
    assert any("bound to 127.0.0.1" in line for line in said)  # every worker tunneled: a loopback bind
    reports = [line for line in lines if line.startswith("flodld agent: ") and "dialing controller" in line]
    assert reports and all("admission: pre-shared salt)" in line for line in reports), lines
    # The agent joined with the salt, so the controller's join key was the salt: admission was pre-shared.


def test_the_fan_out_controller_is_pre_shared_even_on_a_loopback_bind() -> None:
    cluster = (
        ClusterBuilder()
        .controller("10.0.0.1", 1400)
        .worker("node-a", ["cpu"], path="/srv", tunnel=True)
        .worker("node-b", ["cpu"], path="/srv", tunnel=True)
        .build()
    )
    options = ControllerOptions.from_cluster(cluster, preshared=True)
    controller = Controller(options)
    assert options.effective_bind_host == "127.0.0.1"
    assert controller.policy.trust is TrustMode.PRESHARED and controller.join_key == controller.salt
