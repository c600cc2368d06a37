"""The SuperLink's Fleet-only gateway in process (Starlette's TestClient, Flower replaced by an ASGI app): every
other method and path is refused without reaching Flower, Flower's replies come back as sent, per-connection
headers stay on their own hop, and a Flower that does not answer is a 503. tests/test_deployment.py tries the
gateway against real processes."""

import gzip

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route
from starlette.testclient import TestClient

from eftguard.federation.fleet_gateway import NOT_FLEET, fleet_gateway


def flower_app(seen, status=200, headers=None, body=b"\x08\x01reply"):
    async def flower(request):
        seen.append((request.method, request.url.path, dict(request.headers)))
        return Response(body, status_code=status, headers=headers or {"content-type": "application/protobuf"})
    return Starlette(routes=[Route("/{path:path}", flower, methods=["GET", "POST"])])


def upstream(app):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://flower")


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
def test_every_other_method_is_refused_with_the_gateways_404(method):
    seen = []
    with TestClient(fleet_gateway(upstream(flower_app(seen)))) as outsider:
        reply = outsider.request(method, "/v1/fleet/pull-messages")
    assert reply.status_code == 404 and seen == []
    assert reply.text == ("" if method == "HEAD" else NOT_FLEET)


def test_flowers_status_headers_and_body_come_back_and_its_client_is_closed_at_shutdown():
    seen = []
    flower = upstream(flower_app(seen, status=401, headers={"content-type": "application/protobuf",
                                                            "flwr-reason": "bad signature"}))
    with TestClient(fleet_gateway(flower)) as node:
        reply = node.post("/v1/fleet/push-messages", content=b"x")
        assert not flower.is_closed
    assert (reply.status_code, reply.content) == (401, b"\x08\x01reply")
    assert reply.headers["content-type"] == "application/protobuf" and reply.headers["flwr-reason"] == "bad signature"
    assert flower.is_closed


def test_per_connection_headers_are_not_passed_through():
    """Host and hop-by-hop headers belong to one connection; a compressed reply is handed over decoded, so its
    content-encoding must not be claimed again."""
    seen = []
    packed = gzip.compress(b"\x08\x01reply")
    flower = upstream(flower_app(seen, headers={"content-type": "application/protobuf", "content-encoding": "gzip"},
                                 body=packed))
    with TestClient(fleet_gateway(flower)) as node:
        reply = node.post("/v1/fleet/pull-messages", content=b"x", headers={"TE": "trailers", "X-Node": "7"})
    assert reply.content == b"\x08\x01reply" and "content-encoding" not in reply.headers
    [(_, _, headers)] = seen
    assert headers["host"] == "flower" and headers["x-node"] == "7"
    assert "te" not in headers


def test_flower_not_answering_is_a_503_naming_it():
    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)

    flower = httpx.AsyncClient(transport=httpx.MockTransport(refuse), base_url="http://flower")
    with TestClient(fleet_gateway(flower)) as node:
        reply = node.post("/v1/fleet/pull-messages", content=b"x")
    assert (reply.status_code, reply.text) == (503, "the SuperLink behind this gateway is not answering\n")
