"""The fabric measurement of the replica check, run in a network namespace whose loopback ``tc`` throttles
(tests/test_fabric.py starts it under ``unshare -n``): two raylets on 127.0.0.1, a placement group across them, and
``comm_smoke_test`` over gloo judged against the rail given on the command line (bytes per second). Prints one JSON
line: the check's lines and the warnings it logged."""

import json
import logging
import sys

import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, placement_group_table

from kimi_k3_serve.checks.replica import FabricExpectation, comm_smoke_test
from kimi_k3_serve.planning.hardware import Interconnect


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main(measure_bytes: int, rail_bytes_per_s: int) -> None:
    loopback = {"node_ip_address": "127.0.0.1"}  # a new namespace has no route out to pick an address from
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False, **loopback})
    for _ in range(2):
        cluster.add_node(num_cpus=1, **loopback)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    warnings = Warnings()
    logging.getLogger("kimi_k3_serve.checks.replica").addHandler(warnings)
    try:
        pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_SPREAD")
        ray.get(pg.ready(), timeout=60)
        nodes = [n[:8] for n in placement_group_table(pg)["bundles_to_node_id"].values()]
        rail = Interconnect("this host's unthrottled loopback", rail_bytes_per_s, "socket", ("tc qdisc show dev lo",),
                            "measured by tests/test_fabric.py outside the namespace")
        lines = comm_smoke_test(pg, [0, 1], nodes, backend="gloo", timeout_s=150, measure_bytes=measure_bytes,
                                expectation=FabricExpectation("throttled-loopback", rail))
        print(json.dumps({"lines": lines, "warnings": warnings.messages}))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
