"""A worker's `env:` and `nccl_socket_ifname` reach its ranks, over the cluster-scope `env` (docs/config.md).

Real `fdl run` of a local-only cluster: the rank reports its environment. And the pure plan of a fan-out
agent carries the same host environment in its spec.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from flodld.config import ClusterBuilder
from flodld.fanout.launcher import plan_agent
from tests.e2e.harness import Fdl, child_env

REPORTED = ("SHARED", "ONLY_CLUSTER", "ONLY_HOST", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
PROGRAM = f"""\
import json, os, sys
import flodld

def main() -> int:
    print("RANK-ENV " + json.dumps({{name: os.environ.get(name) for name in {REPORTED!r}}}), flush=True)
    return 0

if __name__ == "__main__":
    sys.exit(flodld.run(main, init_process_group=False))
"""

FDL_YML = """\
cluster:
  controller: {host: 127.0.0.1, port: 0}
  workers:
    - host: 127.0.0.1
      local_devices: [cpu]
      nccl_socket_ifname: lo
      env: {SHARED: from-host, ONLY_HOST: h}
  env: {SHARED: from-cluster, ONLY_CLUSTER: c}
"""


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_a_local_fdl_run_gives_ranks_the_worker_env_over_the_cluster_env(tmp_path: Path) -> None:
    (tmp_path / "fdl.yml").write_text(FDL_YML)
    (tmp_path / "report_env.py").write_text(PROGRAM)
    run = Fdl("run", "report_env.py", cwd=tmp_path, env=child_env())
    assert run.wait(90) == 0, run.output
    reports = [json.loads(match.group(1)) for match in re.finditer(r"RANK-ENV (\{.*\})", run.output)]
    assert reports == [{
        "SHARED": "from-host", "ONLY_CLUSTER": "c", "ONLY_HOST": "h",
        "NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo",
    }], run.output


def test_a_fan_out_agent_spec_carries_the_worker_env_and_interface() -> None:
    cluster = (
        ClusterBuilder()
        .controller("10.0.0.1", averaging="nccl_sync", backend="nccl")
        .worker("node-a", devices=[0], path="/srv/p", nccl_socket_ifname="eth1", env={"SHARED": "a"})
        .worker("node-b", devices=[0], path="/srv/p", nccl_socket_ifname="ib0",
                env={"NCCL_SOCKET_IFNAME": "ib1"})
        .env(SHARED="cluster")
        .build()
    )
    a, b = (plan_agent(worker, cluster, program="t.py", args=[], controller_port=1337, salt_hex=None)
            for worker in cluster.workers)  # fmt: skip
    assert a.spec.host_env == {"NCCL_SOCKET_IFNAME": "eth1", "GLOO_SOCKET_IFNAME": "eth1", "SHARED": "a"}
    # A name written in the worker's env: wins over the one derived from nccl_socket_ifname.
    assert b.spec.host_env == {"NCCL_SOCKET_IFNAME": "ib1", "GLOO_SOCKET_IFNAME": "ib0"}
