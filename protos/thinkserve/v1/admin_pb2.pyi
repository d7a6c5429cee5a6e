from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InstanceState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INSTANCE_STATE_UNSPECIFIED: _ClassVar[InstanceState]
    INSTANCE_STATE_STARTING: _ClassVar[InstanceState]
    INSTANCE_STATE_SERVING: _ClassVar[InstanceState]
    INSTANCE_STATE_DRAINING: _ClassVar[InstanceState]
    INSTANCE_STATE_STOPPED: _ClassVar[InstanceState]
    INSTANCE_STATE_DEAD: _ClassVar[InstanceState]
INSTANCE_STATE_UNSPECIFIED: InstanceState
INSTANCE_STATE_STARTING: InstanceState
INSTANCE_STATE_SERVING: InstanceState
INSTANCE_STATE_DRAINING: InstanceState
INSTANCE_STATE_STOPPED: InstanceState
INSTANCE_STATE_DEAD: InstanceState

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InstanceStatus(_message.Message):
    __slots__ = ("instance_id", "pool", "role", "state", "num_waiting", "num_running", "num_swapped", "num_free_blocks", "num_total_blocks", "kv_usage", "generated_tokens", "assigned_requests", "node_id")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ASSIGNED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    pool: str
    role: str
    state: InstanceState
    num_waiting: int
    num_running: int
    num_swapped: int
    num_free_blocks: int
    num_total_blocks: int
    kv_usage: float
    generated_tokens: int
    assigned_requests: int
    node_id: str
    def __init__(self, instance_id: _Optional[str] = ..., pool: _Optional[str] = ..., role: _Optional[str] = ..., state: _Optional[_Union[InstanceState, str]] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_swapped: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., kv_usage: _Optional[float] = ..., generated_tokens: _Optional[int] = ..., assigned_requests: _Optional[int] = ..., node_id: _Optional[str] = ...) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("name", "role", "target_replicas", "serving_replicas", "instances", "queue_depth", "kv_usage", "promotions_out", "promotions_in", "rebalanced", "local_prefills")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TARGET_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SERVING_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_OUT_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_IN_FIELD_NUMBER: _ClassVar[int]
    REBALANCED_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: str
    target_replicas: int
    serving_replicas: int
    instances: _containers.RepeatedCompositeFieldContainer[InstanceStatus]
    queue_depth: int
    kv_usage: float
    promotions_out: int
    promotions_in: int
    rebalanced: int
    local_prefills: int
    def __init__(self, name: _Optional[str] = ..., role: _Optional[str] = ..., target_replicas: _Optional[int] = ..., serving_replicas: _Optional[int] = ..., instances: _Optional[_Iterable[_Union[InstanceStatus, _Mapping]]] = ..., queue_depth: _Optional[int] = ..., kv_usage: _Optional[float] = ..., promotions_out: _Optional[int] = ..., promotions_in: _Optional[int] = ..., rebalanced: _Optional[int] = ..., local_prefills: _Optional[int] = ...) -> None: ...

class FrontendStatus(_message.Message):
    __slots__ = ("address", "active_requests", "max_active_requests", "completed_requests", "failed_requests", "aborted_requests", "rejected_requests", "resumed_requests", "migrated_requests", "promoted_requests", "cancelled_branches", "admission_refused", "http_address", "admin_address", "loop_lag_max_ms", "loop_lag_mean_ms", "loop_stalls")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FAILED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ABORTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMOTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_BRANCHES_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_REFUSED_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ADMIN_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LOOP_LAG_MAX_MS_FIELD_NUMBER: _ClassVar[int]
    LOOP_LAG_MEAN_MS_FIELD_NUMBER: _ClassVar[int]
    LOOP_STALLS_FIELD_NUMBER: _ClassVar[int]
    address: str
    active_requests: int
    max_active_requests: int
    completed_requests: int
    failed_requests: int
    aborted_requests: int
    rejected_requests: int
    resumed_requests: int
    migrated_requests: int
    promoted_requests: int
    cancelled_branches: int
    admission_refused: int
    http_address: str
    admin_address: str
    loop_lag_max_ms: float
    loop_lag_mean_ms: float
    loop_stalls: int
    def __init__(self, address: _Optional[str] = ..., active_requests: _Optional[int] = ..., max_active_requests: _Optional[int] = ..., completed_requests: _Optional[int] = ..., failed_requests: _Optional[int] = ..., aborted_requests: _Optional[int] = ..., rejected_requests: _Optional[int] = ..., resumed_requests: _Optional[int] = ..., migrated_requests: _Optional[int] = ..., promoted_requests: _Optional[int] = ..., cancelled_branches: _Optional[int] = ..., admission_refused: _Optional[int] = ..., http_address: _Optional[str] = ..., admin_address: _Optional[str] = ..., loop_lag_max_ms: _Optional[float] = ..., loop_lag_mean_ms: _Optional[float] = ..., loop_stalls: _Optional[int] = ...) -> None: ...

class StoreStatus(_message.Message):
    __slots__ = ("node_id", "address", "capacity_bytes", "bytes_used", "spare_bytes", "entries", "pinned_entries", "hits", "misses", "puts", "refused", "evictions", "evicted_bytes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    SPARE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    PINNED_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    capacity_bytes: int
    bytes_used: int
    spare_bytes: int
    entries: int
    pinned_entries: int
    hits: int
    misses: int
    puts: int
    refused: int
    evictions: int
    evicted_bytes: int
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., bytes_used: _Optional[int] = ..., spare_bytes: _Optional[int] = ..., entries: _Optional[int] = ..., pinned_entries: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., puts: _Optional[int] = ..., refused: _Optional[int] = ..., evictions: _Optional[int] = ..., evicted_bytes: _Optional[int] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("model", "pools", "frontend", "stores")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_FIELD_NUMBER: _ClassVar[int]
    STORES_FIELD_NUMBER: _ClassVar[int]
    model: str
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    frontend: FrontendStatus
    stores: _containers.RepeatedCompositeFieldContainer[StoreStatus]
    def __init__(self, model: _Optional[str] = ..., pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ..., frontend: _Optional[_Union[FrontendStatus, _Mapping]] = ..., stores: _Optional[_Iterable[_Union[StoreStatus, _Mapping]]] = ...) -> None: ...

class ScalePoolRequest(_message.Message):
    __slots__ = ("pool", "replicas")
    POOL_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    replicas: int
    def __init__(self, pool: _Optional[str] = ..., replicas: _Optional[int] = ...) -> None: ...

class ScalePoolResponse(_message.Message):
    __slots__ = ("pool", "added", "removed", "migrated_requests")
    POOL_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    pool: PoolStatus
    added: int
    removed: int
    migrated_requests: int
    def __init__(self, pool: _Optional[_Union[PoolStatus, _Mapping]] = ..., added: _Optional[int] = ..., removed: _Optional[int] = ..., migrated_requests: _Optional[int] = ...) -> None: ...

class DrainInstanceRequest(_message.Message):
    __slots__ = ("instance_id",)
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    def __init__(self, instance_id: _Optional[str] = ...) -> None: ...

class DrainInstanceResponse(_message.Message):
    __slots__ = ("instance_id", "migrated_requests")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    migrated_requests: int
    def __init__(self, instance_id: _Optional[str] = ..., migrated_requests: _Optional[int] = ...) -> None: ...
