"""The SuperLink's public face: Flower's Fleet API (what SuperNodes call) and nothing else.

Flower 1.42 serves its Fleet, Control and Runtime APIs on one HTTPS port, and its Control API has no
account authentication: anyone who reaches that port with the public ca.crt can register node keys,
list runs and start them. Its `--control-api-address` flag is deprecated and only moves a legacy gRPC
copy of the Control API; the HTTP one stays on the shared port. So `eftguard superlink` binds Flower
itself to loopback and puts this gateway on the public address: it forwards `POST /v1/fleet/NAME`
to Flower and answers everything else 404 without contacting Flower.
"""

from __future__ import annotations

import re
from contextlib import asynccontextmanager

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

FLEET_PATH = re.compile(r"/v1/fleet/[a-z0-9-]+")
# Per-connection headers (RFC 9110 section 7.6.1) and those httpx sets itself; content-encoding goes because
# httpx hands over the decoded body.
NOT_FORWARDED = frozenset({"host", "connection", "keep-alive", "proxy-connection", "te", "trailer",
                           "transfer-encoding", "upgrade", "content-length", "accept-encoding", "content-encoding"})
NOT_FLEET = "this address serves only the Fleet API; the Control API listens on the SuperLink host's loopback\n"


def _forwarded(headers) -> list[tuple[str, str]]:
    return [(name, value) for name, value in headers.items() if name.lower() not in NOT_FORWARDED]


def fleet_gateway(flower: httpx.AsyncClient) -> Starlette:
    """An ASGI app that passes Fleet API calls to `flower` (a client whose base_url is Flower's loopback port)."""

    async def forward(request: Request) -> Response:
        if request.method != "POST" or not FLEET_PATH.fullmatch(request.url.path):
            return PlainTextResponse(NOT_FLEET, status_code=404)
        try:
            reply = await flower.post(request.url.path, content=await request.body(),
                                      headers=_forwarded(request.headers))
        except httpx.HTTPError:
            return PlainTextResponse("the SuperLink behind this gateway is not answering\n", status_code=503)
        return Response(reply.content, status_code=reply.status_code, headers=dict(_forwarded(reply.headers)))

    @asynccontextmanager
    async def lifespan(app):
        async with flower:
            yield

    return Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST", "PUT", "DELETE", "PATCH",
                                                                     "HEAD", "OPTIONS"])], lifespan=lifespan)
