"""``deploy.ray_node.start_ray_head``: a head one of whose components cannot bind its port is started
again on other ports (seen in the suite: the Ray client server's port taken, ``ray start --block``
killed the head a second after ``Ray runtime started``, and ``up``, already connected, waited on the
dead GCS for good)."""

from __future__ import annotations

import socket

import ray

from deploy import ray_node


def test_a_head_whose_client_server_port_is_taken_is_started_again(tmp_path, monkeypatch, capsys):
    taken = socket.socket()  # listening without SO_REUSEPORT: the client server's bind fails
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    drawn: list[list[int]] = []
    real = ray_node.ray_node_ports

    def ports(count: int = 3) -> list[int]:
        got = real(count)
        if not drawn:
            got[1] = taken.getsockname()[1]  # gcs, client server, dashboard agent
        drawn.append(got)
        return got

    monkeypatch.setattr(ray_node, "ray_node_ports", ports)
    try:
        address, pid = ray_node.start_ray_head(tmp_path)
    finally:
        taken.close()
    try:
        assert len(drawn) == 2 and address == f"127.0.0.1:{drawn[1][0]}"
        assert "starting it again on other ports" in capsys.readouterr().err
        ray.init(address=address, logging_level="WARNING")
        try:
            assert ray.cluster_resources()["CPU"] >= 1  # the second head serves
        finally:
            ray.shutdown()
    finally:
        ray_node.stop_ray_head(pid)
