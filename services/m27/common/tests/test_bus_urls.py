"""`[nats] url` as one server or a cluster's servers, comma-separated."""

from __future__ import annotations

import pytest

from m27.common.bus import server_urls
from m27.common.errors import ConfigError


@pytest.mark.parametrize(("url", "servers"), [
    ("nats://a:4222", "nats://a:4222"),
    ("nats://a:4222,nats://b:4222", ["nats://a:4222", "nats://b:4222"]),
    (" nats://a:1 , tls://b:2 ,", ["nats://a:1", "tls://b:2"]),
    ("nats://a:4222,", "nats://a:4222"),
    ("", ""),
])
def test_one_url_stays_as_it_is_several_become_a_list_in_order(
        url: str, servers: str | list[str]) -> None:
    assert server_urls(url) == servers


def test_a_list_of_nothing_is_refused() -> None:
    with pytest.raises(ConfigError, match="names no server"):
        server_urls(" , ")
