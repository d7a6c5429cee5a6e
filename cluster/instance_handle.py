"""What the frontend awaits on an instance and on a node's CPU KV store: the protocols, and their
Ray implementations.

    Orchestrator ──await handle.add_part(...)──▶ InstanceHandle
                                                   ├─ ActorInstance: a Ray actor handle (production)
                                                   └─ InstanceCore itself (in-process, e.g. tests)

The orchestrator imports no Ray: an instance that died raises ``InstanceGone`` from any call,
whatever carried the call. ``ActorInstance`` turns Ray's actor errors into it; a ``ValueError``
or ``KeyError`` the method itself raised (bad input, an unknown or duplicate id) reaches the
caller as itself, as it does in process.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from thinkserve.workers.sampling_params import SamplingParams

from thinkserve.workers.prefix_journal import PrefixCursor, PrefixDelta

from .messages import Admission, ParkedPart, PollResult, ResumeAdmission, SendOutcome, SendTarget, StepTrace

if TYPE_CHECKING:
    from thinkserve.kvtransfer.store import StoreStats


class InstanceGone(RuntimeError):
    """The instance (or store) process is gone: every call to it fails from now on."""


class InstanceHandle(Protocol):
    async def add_part(self, part_id: str, prompt_token_ids: tuple[int, ...], params: SamplingParams,
                       priority: int, reserve: tuple[str, tuple[int, ...]] | None = None) -> Admission: ...
    async def resume_part(self, part_id: str, prompt_token_ids: tuple[int, ...], params: SamplingParams,
                          priority: int, branches: tuple[tuple[int, tuple[int, ...]], ...]) -> ResumeAdmission: ...
    async def send_part(self, part_id: str, targets: tuple[SendTarget, ...], kind: str,
                        publish_prefix: bool) -> SendOutcome: ...
    async def release_part(self, part_id: str) -> None: ...
    async def abort(self, part_id: str) -> bool: ...
    async def abort_branches(self, part_id: str, indices: tuple[int, ...]) -> tuple[int, ...]: ...
    async def fork_part(self, part_id: str, new_part_id: str, indices: tuple[int, ...], reserve: bool = False,
                        start: bool = False) -> bool: ...
    async def has_part(self, part_id: str) -> bool: ...
    async def swap_out_part(self, part_id: str) -> ParkedPart | None: ...
    async def swap_in_part(self, part_id: str, parked: ParkedPart) -> Admission: ...
    async def drain(self) -> tuple[str, ...]: ...
    async def ping(self) -> str | None: ...
    async def poll(self, timeout_s: float, prefix_since: PrefixCursor | None = None) -> PollResult: ...
    async def step_trace(self) -> StepTrace: ...


class StoreHandle(Protocol):
    async def stats(self) -> StoreStats: ...
    async def release(self, namespace: str, keys: list[int], discard_keys: list[int]) -> int: ...
    async def prefix_blocks(self, namespace: str, since: PrefixCursor) -> PrefixDelta: ...


class _ActorCalls:
    """Each attribute is an async function awaiting the actor method of that name."""

    _METHODS: frozenset[str] = frozenset()

    def __init__(self, actor):
        self.actor = actor

    def __getattr__(self, name):
        if name not in self._METHODS:
            raise AttributeError(name)
        method = getattr(self.actor, name)

        async def call(*args, **kwargs):
            from ray.exceptions import RayError, RayTaskError
            try:
                return await method.remote(*args, **kwargs)
            except RayTaskError as e:
                # The method raised, the actor lives: the errors the protocol names (bad input,
                # an unknown or duplicate id) reach the caller as themselves, as they do in process.
                if isinstance(e.cause, (ValueError, KeyError)):
                    raise e.cause from None
                raise InstanceGone(_first_line(e)) from e
            except RayError as e:           # the actor died or cannot be reached
                raise InstanceGone(_first_line(e)) from e
        return call


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0][:300] if str(e) else type(e).__name__


class ActorInstance(_ActorCalls):
    """An ``InstanceHandle`` over the ``Instance`` Ray actor."""

    _METHODS = frozenset(n for n in InstanceHandle.__dict__ if not n.startswith("_"))


class ActorStore(_ActorCalls):
    """A ``StoreHandle`` over the ``KVStoreActor`` Ray actor."""

    _METHODS = frozenset(n for n in StoreHandle.__dict__ if not n.startswith("_"))
