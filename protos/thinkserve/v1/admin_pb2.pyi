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
    __slots__ = ("instance_id", "pool", "role", "state", "num_waiting", "num_running", "num_swapped", "num_free_blocks", "num_total_blocks", "kv_usage", "generated_tokens", "assigned_requests", "node_id", "cpus")
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
    CPUS_FIELD_NUMBER: _ClassVar[int]
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
    cpus: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, instance_id: _Optional[str] = ..., pool: _Optional[str] = ..., role: _Optional[str] = ..., state: _Optional[_Union[InstanceState, str]] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_swapped: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., kv_usage: _Optional[float] = ..., generated_tokens: _Optional[int] = ..., assigned_requests: _Optional[int] = ..., node_id: _Optional[str] = ..., cpus: _Optional[_Iterable[int]] = ...) -> None: ...

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

class GetDebugStateRequest(_message.Message):
    __slots__ = ("prefix_of", "stalls_since_s", "step_traces")
    PREFIX_OF_FIELD_NUMBER: _ClassVar[int]
    STALLS_SINCE_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TRACES_FIELD_NUMBER: _ClassVar[int]
    prefix_of: _containers.RepeatedScalarFieldContainer[int]
    stalls_since_s: float
    step_traces: bool
    def __init__(self, prefix_of: _Optional[_Iterable[int]] = ..., stalls_since_s: _Optional[float] = ..., step_traces: _Optional[bool] = ...) -> None: ...

class KVSendCounts(_message.Message):
    __slots__ = ("sends", "bytes", "seconds")
    SENDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    sends: int
    bytes: int
    seconds: float
    def __init__(self, sends: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class DebugCounters(_message.Message):
    __slots__ = ("completed", "failed", "aborted", "rejected", "resumed", "migrated", "rebalanced", "admission_refused", "promotions_out", "promotions_in", "local_prefills", "parked_released", "promoted", "cancelled_branches", "wave_branches_forked", "reserves_reclaimed", "kv_tcp", "kv_shm", "kv_collective")
    class RebalancedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class PromotionsOutEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class PromotionsInEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class LocalPrefillsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_FIELD_NUMBER: _ClassVar[int]
    REBALANCED_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_REFUSED_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_OUT_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_IN_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    PARKED_RELEASED_FIELD_NUMBER: _ClassVar[int]
    PROMOTED_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_BRANCHES_FIELD_NUMBER: _ClassVar[int]
    WAVE_BRANCHES_FORKED_FIELD_NUMBER: _ClassVar[int]
    RESERVES_RECLAIMED_FIELD_NUMBER: _ClassVar[int]
    KV_TCP_FIELD_NUMBER: _ClassVar[int]
    KV_SHM_FIELD_NUMBER: _ClassVar[int]
    KV_COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    completed: int
    failed: int
    aborted: int
    rejected: int
    resumed: int
    migrated: int
    rebalanced: _containers.ScalarMap[str, int]
    admission_refused: int
    promotions_out: _containers.ScalarMap[str, int]
    promotions_in: _containers.ScalarMap[str, int]
    local_prefills: _containers.ScalarMap[str, int]
    parked_released: int
    promoted: int
    cancelled_branches: int
    wave_branches_forked: int
    reserves_reclaimed: int
    kv_tcp: KVSendCounts
    kv_shm: KVSendCounts
    kv_collective: KVSendCounts
    def __init__(self, completed: _Optional[int] = ..., failed: _Optional[int] = ..., aborted: _Optional[int] = ..., rejected: _Optional[int] = ..., resumed: _Optional[int] = ..., migrated: _Optional[int] = ..., rebalanced: _Optional[_Mapping[str, int]] = ..., admission_refused: _Optional[int] = ..., promotions_out: _Optional[_Mapping[str, int]] = ..., promotions_in: _Optional[_Mapping[str, int]] = ..., local_prefills: _Optional[_Mapping[str, int]] = ..., parked_released: _Optional[int] = ..., promoted: _Optional[int] = ..., cancelled_branches: _Optional[int] = ..., wave_branches_forked: _Optional[int] = ..., reserves_reclaimed: _Optional[int] = ..., kv_tcp: _Optional[_Union[KVSendCounts, _Mapping]] = ..., kv_shm: _Optional[_Union[KVSendCounts, _Mapping]] = ..., kv_collective: _Optional[_Union[KVSendCounts, _Mapping]] = ...) -> None: ...

class LoopStall(_message.Message):
    __slots__ = ("woke_at_s", "lag_s")
    WOKE_AT_S_FIELD_NUMBER: _ClassVar[int]
    LAG_S_FIELD_NUMBER: _ClassVar[int]
    woke_at_s: float
    lag_s: float
    def __init__(self, woke_at_s: _Optional[float] = ..., lag_s: _Optional[float] = ...) -> None: ...

class PrefixLocation(_message.Message):
    __slots__ = ("blocks", "instances", "stores")
    class InstancesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class StoresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    STORES_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    instances: _containers.ScalarMap[str, int]
    stores: _containers.ScalarMap[str, int]
    def __init__(self, blocks: _Optional[int] = ..., instances: _Optional[_Mapping[str, int]] = ..., stores: _Optional[_Mapping[str, int]] = ...) -> None: ...

class StepSample(_message.Message):
    __slots__ = ("start", "duration", "prefill_tokens", "prefill_ctx", "num_decode", "decode_ctx")
    START_FIELD_NUMBER: _ClassVar[int]
    DURATION_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CTX_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_FIELD_NUMBER: _ClassVar[int]
    DECODE_CTX_FIELD_NUMBER: _ClassVar[int]
    start: float
    duration: float
    prefill_tokens: int
    prefill_ctx: int
    num_decode: int
    decode_ctx: int
    def __init__(self, start: _Optional[float] = ..., duration: _Optional[float] = ..., prefill_tokens: _Optional[int] = ..., prefill_ctx: _Optional[int] = ..., num_decode: _Optional[int] = ..., decode_ctx: _Optional[int] = ...) -> None: ...

class PartTiming(_message.Message):
    __slots__ = ("part_id", "added", "first_token", "finished")
    PART_ID_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    part_id: str
    added: float
    first_token: float
    finished: float
    def __init__(self, part_id: _Optional[str] = ..., added: _Optional[float] = ..., first_token: _Optional[float] = ..., finished: _Optional[float] = ...) -> None: ...

class StepTrace(_message.Message):
    __slots__ = ("instance_id", "steps", "parts")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    steps: _containers.RepeatedCompositeFieldContainer[StepSample]
    parts: _containers.RepeatedCompositeFieldContainer[PartTiming]
    def __init__(self, instance_id: _Optional[str] = ..., steps: _Optional[_Iterable[_Union[StepSample, _Mapping]]] = ..., parts: _Optional[_Iterable[_Union[PartTiming, _Mapping]]] = ...) -> None: ...

class DebugState(_message.Message):
    __slots__ = ("requests", "parts", "draining", "lost", "counters", "kv_transport", "stores", "parked", "prefix_blocks", "prefix_in_flight", "loop_stalls", "prefix", "step_traces")
    class PartsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class StoresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class ParkedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class PrefixBlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    STORES_FIELD_NUMBER: _ClassVar[int]
    PARKED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    LOOP_STALLS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    STEP_TRACES_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedScalarFieldContainer[str]
    parts: _containers.ScalarMap[str, str]
    draining: _containers.RepeatedScalarFieldContainer[str]
    lost: _containers.RepeatedScalarFieldContainer[str]
    counters: DebugCounters
    kv_transport: str
    stores: _containers.ScalarMap[str, str]
    parked: _containers.ScalarMap[str, int]
    prefix_blocks: _containers.ScalarMap[str, int]
    prefix_in_flight: int
    loop_stalls: _containers.RepeatedCompositeFieldContainer[LoopStall]
    prefix: PrefixLocation
    step_traces: _containers.RepeatedCompositeFieldContainer[StepTrace]
    def __init__(self, requests: _Optional[_Iterable[str]] = ..., parts: _Optional[_Mapping[str, str]] = ..., draining: _Optional[_Iterable[str]] = ..., lost: _Optional[_Iterable[str]] = ..., counters: _Optional[_Union[DebugCounters, _Mapping]] = ..., kv_transport: _Optional[str] = ..., stores: _Optional[_Mapping[str, str]] = ..., parked: _Optional[_Mapping[str, int]] = ..., prefix_blocks: _Optional[_Mapping[str, int]] = ..., prefix_in_flight: _Optional[int] = ..., loop_stalls: _Optional[_Iterable[_Union[LoopStall, _Mapping]]] = ..., prefix: _Optional[_Union[PrefixLocation, _Mapping]] = ..., step_traces: _Optional[_Iterable[_Union[StepTrace, _Mapping]]] = ...) -> None: ...
