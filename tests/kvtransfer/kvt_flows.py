"""The sender-side composition the cluster's KV endpoint makes (``KVEndpoint.send`` then
``release``), for tests with one engine and one transport: export once, send every branch to one
peer, release the source on success. On failure the source stays exported and the error carries
``err.exported`` (the flows' failure contract)."""
from __future__ import annotations

from thinkserve.kvtransfer import flows
from thinkserve.kvtransfer.transport import TransferError


def send_whole(engine, request_id: str, transport, peer: str, *, kind: str = "handoff"):
    export = flows.export_for(engine, request_id, transport)
    branches = tuple(b.index for b in export.exported.branches)
    try:
        rec = flows.send_share(engine.fingerprint(), export, flows.Share(transport, peer, branches), kind=kind)
    except TransferError as e:
        e.exported = export.exported
        raise
    finally:
        export.release_buffer()
    engine.release_request(request_id)
    return rec
