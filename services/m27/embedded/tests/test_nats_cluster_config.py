"""The clustered embedded bus's pure parts: the config a member gets, the members' ports
and names, and the order each service is given the servers in."""

from __future__ import annotations

from pathlib import Path

import pytest

from m27.common.errors import M27Error
from m27.embedded.nats_cluster import NatsCluster
from m27.embedded.nats_server import ClusterRoutes, render_config
from m27.embedded.supervisor import rotated


def test_a_member_config_names_its_cluster_listen_address_and_every_route() -> None:
    routes = ("nats-route://127.0.0.1:7001", "nats-route://127.0.0.1:7002")
    text = render_config(store_dir=Path("/s"), ports_dir=Path("/p"), host="127.0.0.1",
                         port=4001, server_name="m27-1", authorization="authorization: {}\n",
                         cluster=ClusterRoutes(name="m27", listen="127.0.0.1:7001",
                                               routes=routes))
    assert 'server_name: "m27-1"' in text
    assert "sync_interval: always" in text
    assert ('cluster {\n  name: "m27"\n  listen: "127.0.0.1:7001"\n'
            '  routes: ["nats-route://127.0.0.1:7001", "nats-route://127.0.0.1:7002"]\n}'
            ) in text
    assert text.rstrip().endswith("authorization: {}")  # last: `m27 up` replaces it
    alone = render_config(store_dir=Path("/s"), ports_dir=Path("/p"), host="127.0.0.1",
                          port=0, server_name="m27")
    assert "cluster" not in alone
    assert "no_advertise" not in text
    hidden = render_config(store_dir=Path("/s"), ports_dir=Path("/p"), host="127.0.0.1",
                           port=4001, server_name="m27-1",
                           cluster=ClusterRoutes(name="m27", listen="127.0.0.1:7001",
                                                 routes=routes, advertise=False))
    assert "\n  no_advertise: true\n}" in hidden


def test_members_have_their_own_names_stores_and_ports(tmp_path: Path) -> None:
    cluster = NatsCluster(tmp_path, 3, prefix="x-")
    names = [s.server_name for s in cluster.servers]
    assert names == ["x-1", "x-2", "x-3"]
    assert len({s.store_dir for s in cluster.servers}) == 3
    ports = [s.port for s in cluster.servers]
    listens = [s.cluster.listen for s in cluster.servers if s.cluster]
    assert len(set(ports) | set(listens)) == 6
    assert all(s.cluster and len(s.cluster.routes) == 3 for s in cluster.servers)
    assert all(s.cluster and s.cluster.advertise for s in cluster.servers)
    quiet = NatsCluster(tmp_path / "quiet", 3, advertise=False)
    assert not any(s.cluster and s.cluster.advertise for s in quiet.servers)


@pytest.mark.parametrize("size", [0, 2, 4, 7])
def test_a_cluster_has_an_odd_number_of_servers(tmp_path: Path, size: int) -> None:
    with pytest.raises(M27Error, match="1, 3 or 5"):
        NatsCluster(tmp_path, size)


def test_each_service_is_given_the_servers_from_another_one_on() -> None:
    urls = ["a", "b", "c"]
    assert [rotated(urls, i) for i in range(4)] == ["a,b,c", "b,c,a", "c,a,b", "a,b,c"]
    assert rotated(["only"], 5) == "only"
